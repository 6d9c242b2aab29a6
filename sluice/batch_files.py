"""Batch files: the input formats (JSONL, CSV, Parquet) read as a stream, the output file and its
conversions, and schedules' URI templates (which paths a key may name: sluice/tenant_files.py).

Nothing here holds a whole file: readers yield one row at a time from a bounded buffer (a
Parquet record batch at most), so a 1,000,000-row input costs the feeder the same memory as a
thousand-row one. Rows are numbered from 0 in file order; blank JSONL lines are not rows.

A row's input is `{"text": <the text_field column>}`; a JSONL row may instead carry the model's
whole input as an object under `"input"`, for models whose input is not one text.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, get_args

import orjson

from sluice.errors import InvalidInput

Format = Literal["jsonl", "csv", "parquet"]
FORMATS: tuple[Format, ...] = get_args(Format)

_SUFFIXES: dict[str, Format] = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
                                ".parquet": "parquet", ".pq": "parquet"}
_MEDIA_TYPES: dict[Format, str] = {"jsonl": "application/x-ndjson", "csv": "text/csv",
                                   "parquet": "application/vnd.apache.parquet"}
# Rows per Parquet record batch read, and per row group written: the readers' memory bound.
PARQUET_CHUNK_ROWS = 4096
# Placeholders an input or output URI template may use, filled from the schedule's slot.
TEMPLATE_FIELDS = ("date", "time", "datetime", "year", "month", "day", "hour", "minute")


class BatchFileError(InvalidInput):
    """The file cannot be read as the batch says (format, column, path): the whole batch fails."""


@dataclass(frozen=True, slots=True)
class Row:
    """One input row: its number and either the model input or why the row cannot be one."""

    row: int
    input: Any = None
    error: str | None = None


def media_type(fmt: Format) -> str:
    return _MEDIA_TYPES[fmt]


def format_of(name: str, declared: str | None = None) -> Format:
    """The declared format, else the one the file name's suffix says."""
    if declared is not None:
        if declared not in FORMATS:
            raise BatchFileError(f"format must be one of {', '.join(FORMATS)}, not '{declared}'")
        return declared  # type: ignore[return-value]
    suffix = Path(name).suffix.lower()
    if suffix not in _SUFFIXES:
        raise BatchFileError(f"cannot tell the format of '{Path(name).name}' from its suffix; "
                             f"pass format ({', '.join(FORMATS)})")
    return _SUFFIXES[suffix]


# --- URIs ------------------------------------------------------------------------------------------


def render_template(template: str, slot: datetime) -> str:
    """A URI template with the slot's local date and time: `file:///data/in/{date}.parquet`."""
    values = {
        "date": slot.strftime("%Y-%m-%d"), "time": slot.strftime("%H%M"), "datetime": slot.strftime("%Y%m%dT%H%M%S"),
        "year": f"{slot.year:04d}", "month": f"{slot.month:02d}", "day": f"{slot.day:02d}",
        "hour": f"{slot.hour:02d}", "minute": f"{slot.minute:02d}",
    }
    try:
        return template.format_map(values)
    except (KeyError, IndexError, ValueError) as exc:
        raise BatchFileError(f"URI template '{template}' may only use {{{'}, {'.join(TEMPLATE_FIELDS)}}}") from exc


# --- reading ---------------------------------------------------------------------------------------


def count_rows(path: Path, fmt: Format) -> int:
    if fmt == "parquet":
        return int(_parquet(path).metadata.num_rows)
    if fmt == "csv":
        with _text(path) as handle:
            reader = csv.reader(handle)
            next(reader, None)
            return sum(1 for _ in reader)
    with path.open("rb") as handle:
        return sum(1 for line in handle if line.strip())


def read_rows(path: Path, fmt: Format, *, text_field: str, start: int = 0) -> Generator[Row, None, None]:
    """The rows from number `start` on, one at a time."""
    if fmt == "parquet":
        yield from _parquet_rows(path, text_field, start)
    elif fmt == "csv":
        yield from _csv_rows(path, text_field, start)
    else:
        yield from _jsonl_rows(path, text_field, start)


def _jsonl_rows(path: Path, text_field: str, start: int) -> Iterator[Row]:
    number = -1
    with path.open("rb") as handle:
        for line in handle:
            if not line.strip():
                continue
            number += 1
            if number < start:
                continue
            try:
                value = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                yield Row(number, error=f"not JSON: {exc.msg}")
                continue
            yield _jsonl_input(number, value, text_field)


def _jsonl_input(number: int, value: Any, text_field: str) -> Row:
    if isinstance(value, str):
        return Row(number, {"text": value})
    if not isinstance(value, dict):
        return Row(number, error=f"a row must be a JSON object or a string, not {type(value).__name__}")
    if "input" in value and text_field not in value:
        return Row(number, value["input"])
    if text_field not in value:
        return Row(number, error=f"the row has no field '{text_field}'")
    return Row(number, {"text": value[text_field]})


def _text(path: Path) -> io.TextIOWrapper:
    # newline="": the csv module reads quoted newlines inside a field itself.
    return path.open("r", encoding="utf-8", errors="replace", newline="")


def _csv_rows(path: Path, text_field: str, start: int) -> Iterator[Row]:
    with _text(path) as handle:
        reader = csv.reader(handle)
        header = next(reader, None) or []
        if text_field not in header:
            raise BatchFileError(f"the CSV header has no column '{text_field}' (it has {', '.join(header[:20])})")
        column = header.index(text_field)
        for number, record in enumerate(reader):
            if number < start:
                continue
            if column >= len(record):
                yield Row(number, error=f"the row has no value for '{text_field}'")
            else:
                yield Row(number, {"text": record[column]})


def _parquet(path: Path) -> Any:
    import pyarrow.parquet as pq

    try:
        # Buffered reads: a column chunk is read a megabyte at a time, not whole.
        return pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError and more for a bad file
        raise BatchFileError(f"'{path.name}' is not a readable Parquet file: {exc}") from exc


def _parquet_rows(path: Path, text_field: str, start: int) -> Iterator[Row]:
    parquet = _parquet(path)
    if text_field not in parquet.schema_arrow.names:
        raise BatchFileError(f"the Parquet schema has no column '{text_field}' "
                             f"(it has {', '.join(parquet.schema_arrow.names[:20])})")
    # Whole row groups before `start` are skipped without reading them.
    groups, first_row = [], 0
    for index in range(parquet.metadata.num_row_groups):
        rows = parquet.metadata.row_group(index).num_rows
        if first_row + rows > start:
            groups.append(index)
        else:
            first_row += rows
    if not groups:
        return
    number = first_row
    for batch in parquet.iter_batches(batch_size=PARQUET_CHUNK_ROWS, row_groups=groups, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            if number >= start:
                yield (Row(number, error=f"'{text_field}' is null") if value is None
                       else Row(number, {"text": value}))
            number += 1


# --- the output ------------------------------------------------------------------------------------


def output_line(row: int, status: str, *, output: bytes | None = None, error: bytes | None = None) -> bytes:
    """One JSONL output line; `output` and `error` are JSON already (as the job record stores them)."""
    line = b'{"row":' + str(row).encode() + b',"status":"' + status.encode() + b'"'
    if output is not None:
        line += b',"output":' + output
    if error is not None:
        line += b',"error":' + error
    return line + b"}\n"


def error_json(code: str, message: str) -> bytes:
    return orjson.dumps({"code": code, "message": message})


def convert_output(path: Path, fmt: Format, *, size: int, chunk_bytes: int = 1 << 16) -> Iterator[bytes]:
    """The first `size` bytes of the JSONL output file (the rows its feeder has checkpointed) as
    `fmt`, a chunk at a time."""
    if fmt == "jsonl":
        if size <= 0:
            return
        with path.open("rb") as handle:
            left = size
            while left > 0 and (chunk := handle.read(min(chunk_bytes, left))):
                left -= len(chunk)
                yield chunk
    elif fmt == "csv":
        yield from _csv_output(_lines(path, size))
    else:
        yield from _parquet_output(_lines(path, size))


def _lines(path: Path, size: int) -> Iterator[bytes]:
    if size <= 0:
        return
    with path.open("rb") as handle:
        read = 0
        for line in handle:
            read += len(line)
            if read > size:
                return
            yield line


def _flat(line: bytes) -> tuple[int, str, str | None, str | None, str | None]:
    record = orjson.loads(line)
    error = record.get("error") or {}
    output = record.get("output")
    return (record["row"], record["status"], None if output is None else json.dumps(output, separators=(",", ":")),
            error.get("code"), error.get("message"))


def _csv_output(lines: Iterator[bytes]) -> Iterator[bytes]:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["row", "status", "output", "error_code", "error_message"])
    for number, line in enumerate(lines, start=1):
        writer.writerow(_flat(line))
        if number % 1024 == 0:
            yield buffer.getvalue().encode()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue().encode()


class _Drain(io.RawIOBase):
    """A write-only sink whose bytes are taken as they come, so Parquet streams out row group by row group."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        taken, self.parts = b"".join(self.parts), []
        return taken


def _parquet_output(lines: Iterator[bytes]) -> Iterator[bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("row", pa.int64()), ("status", pa.string()), ("output", pa.string()),
                        ("error_code", pa.string()), ("error_message", pa.string())])
    sink = _Drain()
    with pq.ParquetWriter(sink, schema) as writer:
        while True:
            rows = [_flat(line) for _, line in zip(range(PARQUET_CHUNK_ROWS), lines, strict=False)]
            if not rows:
                break
            columns = list(zip(*rows, strict=True))
            writer.write_table(pa.Table.from_arrays([pa.array(column) for column in columns], schema=schema))
            yield sink.take()
    yield sink.take()


def write_output(path: Path, fmt: Format, destination: Path, *, size: int) -> None:
    """Write the output as `fmt` to `destination` (a scheduled run's output location), atomically."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + ".partial")
    with partial.open("wb") as handle:
        for chunk in convert_output(path, fmt, size=size):
            handle.write(chunk)
    partial.replace(destination)
