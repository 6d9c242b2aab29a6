"""A batch's input rows (JSONL, CSV, Parquet), read and counted as a stream under a bound on a row's size.

Nothing here holds a whole file, nor a whole line: a JSONL line or a CSV record is read at most
`max_line_bytes` at a time (its newline included), and one longer fails the batch the moment the
bound is passed; a Parquet file is read one record batch of one row group at a time. Rows are
numbered from 0 in file order; blank JSONL lines are not rows.

What fails one row and what fails the batch (ARCHITECTURE, "Batch scoring"): a row the reader can
step over (not JSON, no text field, a null, a text the model refuses) is a failed output line and
the batch goes on; one it cannot go past (a line or record over the bound, a Parquet row group that
does not decode, a read error) ends the batch `failed` with "row N: why".

A row's input is `{"text": <the text_field column>}`; a JSONL row may instead carry the model's
whole input as an object under `"input"`, for models whose input is not one text.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from sluice.batch_files import PARQUET_CHUNK_ROWS, BatchFileError, Format

# How many lines are read between two answers of `count_rows`: its caller's chance to stop.
COUNT_STEP_LINES = 4096


@dataclass(frozen=True, slots=True)
class Row:
    """One input row: its number and either the model input or why the row cannot be one."""

    row: int
    input: Any = None
    error: str | None = None


def count_rows(path: Path, fmt: Format, *, max_line_bytes: int) -> Iterator[int]:
    """The rows counted so far, every few thousand lines, and last the total: a caller that stops
    iterating stops the count (a cancelled batch's feeder does not read on to the end)."""
    try:
        if fmt == "parquet":
            yield int(_parquet(path).metadata.num_rows)
        elif fmt == "csv":
            rows = -1  # the header is no row
            for _ in _records(path, max_line_bytes):
                rows += 1
                if rows % COUNT_STEP_LINES == 0:
                    yield rows
            yield max(rows, 0)
        else:
            rows = 0
            with path.open("rb") as handle:
                try:
                    for lines, line in enumerate(_bounded_lines(handle, max_line_bytes), start=1):
                        rows += bool(line.strip())
                        if lines % COUNT_STEP_LINES == 0:
                            yield rows
                except _LineTooLong:
                    raise _too_long(rows, max_line_bytes) from None
            yield rows
    except OSError as exc:
        raise BatchFileError(f"the input cannot be read: {exc.strerror or exc}") from None


def read_rows(path: Path, fmt: Format, *, text_field: str, max_line_bytes: int,
              start: int = 0) -> Generator[Row, None, None]:
    """The rows from number `start` on, one at a time."""
    try:
        if fmt == "parquet":
            yield from _parquet_rows(path, text_field, start)
        elif fmt == "csv":
            yield from _csv_rows(path, text_field, start, max_line_bytes)
        else:
            yield from _jsonl_rows(path, text_field, start, max_line_bytes)
    except OSError as exc:
        raise BatchFileError(f"the input cannot be read: {exc.strerror or exc}") from None


class _LineTooLong(Exception):
    """A line longer than the bound: its reader names the row."""


def _too_long(row: int, limit: int) -> BatchFileError:
    return BatchFileError(f"row {row}: line longer than {limit} bytes")


def _bounded_lines(handle: BinaryIO, limit: int) -> Iterator[bytes]:
    """The handle's lines, each at most `limit` bytes, none of a longer one held whole."""
    while line := handle.readline(limit + 1):
        if len(line) > limit:
            raise _LineTooLong
        yield line


def _jsonl_rows(path: Path, text_field: str, start: int, limit: int) -> Iterator[Row]:
    number = -1
    with path.open("rb") as handle:
        lines = _bounded_lines(handle, limit)
        while True:
            try:
                line = next(lines, None)
            except _LineTooLong:
                raise _too_long(number + 1, limit) from None
            if line is None:
                return
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


class _RecordLines:
    """A CSV file's lines for `csv.reader`, bounding the bytes of the record being read (quoted
    newlines make one record of many lines). The reader asks for a line only when its record
    needs one, so `next_record` between two records resets the count."""

    def __init__(self, handle: io.TextIOWrapper, limit: int) -> None:
        self.handle = handle
        self.limit = limit
        self.size = 0
        self.lines = 0
        self.row = -1  # the header

    def next_record(self) -> None:
        self.size = self.lines = 0
        self.row += 1

    def __iter__(self) -> _RecordLines:
        return self

    def __next__(self) -> str:
        # A line of more than `limit` characters is more than `limit` bytes: read no further.
        line = self.handle.readline(self.limit + 1)
        if not line:
            raise StopIteration
        self.size += len(line) if line.isascii() else len(line.encode())
        self.lines += 1
        if self.size > self.limit:
            where = "the CSV header" if self.row < 0 else f"row {self.row}"
            hint = " (a quote left open makes the rest of the file one field)" if self.lines > 1 else ""
            raise BatchFileError(f"{where}: record longer than {self.limit} bytes{hint}")
        return line


def _records(path: Path, limit: int) -> Generator[list[str], None, None]:
    """The CSV file's records, its header first."""
    # The csv module's own bound on a field (131,072 characters, process-wide) is raised to ours,
    # which is already the tighter one on what is held: a long field is then a row the model
    # refuses (its text is too long), not an error that stops the reader.
    if csv.field_size_limit() < limit:
        csv.field_size_limit(limit)
    # newline="": the csv module reads quoted newlines inside a field itself.
    with path.open("r", encoding="utf-8", errors="replace", newline="") as handle:
        lines = _RecordLines(handle, limit)
        for record in csv.reader(lines):
            yield record
            lines.next_record()


def _csv_rows(path: Path, text_field: str, start: int, limit: int) -> Iterator[Row]:
    records = _records(path, limit)
    try:
        header = next(records, None) or []
        if text_field not in header:
            raise BatchFileError(f"the CSV header has no column '{text_field}' (it has {', '.join(header[:20])})")
        column = header.index(text_field)
        for number, record in enumerate(records):
            if number < start:
                continue
            if column >= len(record):
                yield Row(number, error=f"the row has no value for '{text_field}'")
            else:
                yield Row(number, {"text": record[column]})
    finally:
        records.close()


def _parquet(path: Path) -> Any:
    import pyarrow.parquet as pq

    try:
        # Buffered reads: a column chunk is read a megabyte at a time, not whole.
        return pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError and more for a bad file
        raise BatchFileError(f"'{path.name}' is not a readable Parquet file: {exc}") from exc


def _parquet_rows(path: Path, text_field: str, start: int) -> Iterator[Row]:
    import pyarrow as pa

    parquet = _parquet(path)
    if text_field not in parquet.schema_arrow.names:
        raise BatchFileError(f"the Parquet schema has no column '{text_field}' "
                             f"(it has {', '.join(parquet.schema_arrow.names[:20])})")
    number = 0
    for group in range(parquet.metadata.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if number + rows <= start:
            # A whole row group before `start` is skipped without reading it.
            number += rows
            continue
        # One row group at a time, so a group that does not decode is named by its first row.
        first = number
        try:
            for batch in parquet.iter_batches(batch_size=PARQUET_CHUNK_ROWS, row_groups=[group],
                                              columns=[text_field]):
                for value in batch.column(0).to_pylist():
                    if number >= start:
                        yield (Row(number, error=f"'{text_field}' is null") if value is None
                               else Row(number, {"text": value}))
                    number += 1
        except (pa.ArrowException, OSError) as exc:
            raise BatchFileError(f"row {max(number, start)}: the Parquet file cannot be read from here on "
                                 f"(row group {group}): {exc}") from None
        number = first + rows
