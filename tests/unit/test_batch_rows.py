"""Reading a batch's input rows under a bound on a line's size: what fails a row, what fails the
batch (with the row and the reason), and that a line longer than the bound is never held whole
(the reading process's peak RSS, measured in a fresh interpreter)."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sluice.batch_files import BatchFileError
from sluice.batch_rows import COUNT_STEP_LINES, Row, count_rows, read_rows
from tests.support import REPO

MiB = 1 << 20


def _jsonl(path: Path, *lines: bytes) -> Path:
    path.write_bytes(b"".join(lines))
    return path


def test_a_jsonl_line_at_the_bound_is_read_and_one_byte_more_fails_the_batch_at_its_row(tmp_path: Path) -> None:
    limit = 1024
    at_bound = b'{"text": "' + b"a" * (limit - 13) + b'"}\n'
    assert len(at_bound) == limit
    path = _jsonl(tmp_path / "in.jsonl", b'{"text": "zero"}\n', b"\n", at_bound, b'{"text": "' + b"b" * limit + b'"}\n')

    rows = read_rows(path, "jsonl", text_field="text", max_line_bytes=limit)
    assert next(rows) == Row(0, {"text": "zero"})
    assert next(rows).input == {"text": "a" * (limit - 13)}
    with pytest.raises(BatchFileError, match=r"^row 2: line longer than 1024 bytes$"):
        next(rows)
    with pytest.raises(BatchFileError, match=r"^row 2: line longer than 1024 bytes$"):
        list(count_rows(path, "jsonl", max_line_bytes=limit))


def test_rows_a_reader_can_step_over_fail_alone(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "in.jsonl", b'{"text": "a"}\n', b"{not json\n", b'{"body": "b"}\n', b"[1]\n",
                  b'"just text"\n', b'{"input": {"tokens": 3}}\n')
    rows = list(read_rows(path, "jsonl", text_field="text", max_line_bytes=MiB))
    assert [row.row for row in rows] == list(range(6))
    assert rows[1].error is not None and rows[1].error.startswith("not JSON")
    assert rows[2].error == "the row has no field 'text'"
    assert rows[3].error == "a row must be a JSON object or a string, not list"
    assert rows[4].input == {"text": "just text"} and rows[5].input == {"tokens": 3}
    assert list(count_rows(path, "jsonl", max_line_bytes=MiB))[-1] == 6


def test_a_csv_field_longer_than_the_csv_module_s_own_limit_is_a_row(tmp_path: Path) -> None:
    text = io.StringIO()
    csv.writer(text).writerows([["id", "text"], [0, "short"], [1, "x" * 200_000], [2, "a\nquoted newline"]])
    path = tmp_path / "in.csv"
    path.write_text(text.getvalue())
    rows = list(read_rows(path, "csv", text_field="text", max_line_bytes=MiB))
    assert [row.input["text"] for row in rows] == ["short", "x" * 200_000, "a\nquoted newline"]
    assert list(count_rows(path, "csv", max_line_bytes=MiB))[-1] == 3


def test_a_csv_record_longer_than_the_bound_fails_the_batch_at_its_row(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text("text\nfine\n" + '"open\n' + "y" * 100 + "\n" * 20 + "more\n" * 300)
    rows = read_rows(path, "csv", text_field="text", max_line_bytes=1024)
    assert next(rows) == Row(0, {"text": "fine"})
    message = r"^row 1: record longer than 1024 bytes \(a quote left open makes the rest of the file one field\)$"
    with pytest.raises(BatchFileError, match=message):
        next(rows)
    with pytest.raises(BatchFileError, match=message):
        list(count_rows(path, "csv", max_line_bytes=1024))
    one_line = tmp_path / "wide.csv"
    one_line.write_text("text\n" + "z" * 2000 + "\n")
    with pytest.raises(BatchFileError, match=r"^row 0: record longer than 1024 bytes$"):
        list(read_rows(one_line, "csv", text_field="text", max_line_bytes=1024))
    header = tmp_path / "header.csv"
    header.write_text(",".join(f"c{i}" for i in range(500)) + "\n")
    with pytest.raises(BatchFileError, match=r"^the CSV header: record longer than 1024 bytes$"):
        list(read_rows(header, "csv", text_field="c1", max_line_bytes=1024))


def test_a_corrupt_parquet_row_group_fails_the_batch_at_its_first_row(tmp_path: Path) -> None:
    sink = io.BytesIO()
    pq.write_table(pa.table({"text": [f"parquet row {i} " * 3 for i in range(1000)]}), sink, row_group_size=100)
    data = bytearray(sink.getvalue())
    column = pq.ParquetFile(io.BytesIO(bytes(data))).metadata.row_group(4).column(0)
    data[column.data_page_offset + 20:column.data_page_offset + 200] = b"\xab" * 180
    path = tmp_path / "in.parquet"
    path.write_bytes(bytes(data))

    assert list(count_rows(path, "parquet", max_line_bytes=MiB)) == [1000]
    read: list[Row] = []
    with pytest.raises(BatchFileError, match=r"^row 400: the Parquet file cannot be read from here on \(row group 4\)"):
        read.extend(read_rows(path, "parquet", text_field="text", max_line_bytes=MiB))
    assert [row.row for row in read] == list(range(400))
    # Read on from a later row, the groups before it are skipped, the corrupt one too.
    later = list(read_rows(path, "parquet", text_field="text", max_line_bytes=MiB, start=550))
    assert [row.row for row in later] == list(range(550, 1000))


def test_an_input_that_cannot_be_read_fails_the_batch(tmp_path: Path) -> None:
    for fmt in ("jsonl", "csv"):
        with pytest.raises(BatchFileError, match="^the input cannot be read: Is a directory$"):
            list(read_rows(tmp_path, fmt, text_field="text", max_line_bytes=MiB))  # type: ignore[arg-type]
        with pytest.raises(BatchFileError, match="^the input cannot be read: Is a directory$"):
            list(count_rows(tmp_path, fmt, max_line_bytes=MiB))  # type: ignore[arg-type]


def test_counting_answers_as_it_goes_so_its_caller_can_stop(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "in.jsonl", b"\n" * (3 * COUNT_STEP_LINES), b'{"text": "a"}\n' * 5)
    counts = list(count_rows(path, "jsonl", max_line_bytes=MiB))
    assert counts == [0, 0, 0, 5]


_PROBE = """
import json, sys
from pathlib import Path
from sluice.batch_files import BatchFileError
from sluice.batch_rows import count_rows, read_rows

def peak_kib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

path, fmt = Path(sys.argv[1]), sys.argv[2]
before = peak_kib()
errors = []
for read in (lambda: list(count_rows(path, fmt, max_line_bytes=1 << 20)),
             lambda: list(read_rows(path, fmt, text_field="text", max_line_bytes=1 << 20))):
    try:
        read()
    except BatchFileError as exc:
        errors.append(exc.message)
print(json.dumps({"errors": errors, "grown_kib": peak_kib() - before}))
"""


@pytest.mark.parametrize(("fmt", "head"), [("jsonl", b'{"text": "'), ("csv", b'text\n"')])
def test_a_line_larger_than_the_bound_is_never_held_whole(tmp_path: Path, fmt: str, head: bytes) -> None:
    # 256 MiB with no newline, sparse: nothing to write, and reading it whole would show in the RSS.
    path = tmp_path / f"in.{fmt}"
    with path.open("wb") as handle:
        handle.write(head)
        handle.truncate(256 * MiB)
    out = subprocess.run([sys.executable, "-c", _PROBE, str(path), fmt], capture_output=True, text=True, check=True,
                         cwd=REPO, timeout=120)
    result = json.loads(out.stdout)
    what = "line" if fmt == "jsonl" else "record"
    assert result["errors"] == [f"row 0: {what} longer than {MiB} bytes"] * 2
    assert result["grown_kib"] < 24 * 1024, f"reading grew the peak RSS by {result['grown_kib'] // 1024} MiB"
