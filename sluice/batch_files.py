"""Batch files: the input formats (JSONL, CSV, Parquet), the output file and its conversions, and
schedules' URI templates. Reading an input's rows is `sluice.batch_rows`; which paths a key may name
is `sluice.tenant_files`.

Nothing here holds a whole file: the output is converted a chunk (a Parquet row group) at a time.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
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
# Rows per Parquet record batch read, and per row group written: the memory bound of both.
PARQUET_CHUNK_ROWS = 4096
# Placeholders an input or output URI template may use, filled from the schedule's slot.
TEMPLATE_FIELDS = ("date", "time", "datetime", "year", "month", "day", "hour", "minute")


class BatchFileError(InvalidInput):
    """The file cannot be read as the batch says (format, column, path): the whole batch fails."""


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
