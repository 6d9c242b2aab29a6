"""Peak memory of reading a batch input as the feeder does, by input size: flat, not growing with rows.

Each measurement runs in a fresh interpreter that imports the reader (and pyarrow), records its
peak RSS (VmHWM), then reads every row of the file with `sluice.batch_rows.read_rows`, validating each
input as the feeder does, and records the peak again. The figure is the growth: what reading the
file added on top of the interpreter and its imports.

Run: ``python -m bench.batch_memory [--rows 1000000]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.machine import machine_info
from bench.output import command_line, table, write_json

_PROBE = """
import json, sys
from pathlib import Path
from sluice.batch_rows import read_rows, count_rows
from sluice.kinds import ModelKind, validate_input
import pyarrow.parquet  # noqa: F401  (imported before the baseline, as in the feeder)

def peak_kib():
    # VmHWM, not ru_maxrss: a child's ru_maxrss keeps the peak of the parent it was forked from.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")

path, fmt = Path(sys.argv[1]), sys.argv[2]
before = peak_kib()
total = list(count_rows(path, fmt, max_line_bytes=1 << 20))[-1]
rows = 0
for row in read_rows(path, fmt, text_field="text", max_line_bytes=1 << 20):
    validate_input(ModelKind.embedding, row.input, max_text_chars=20000)
    rows += 1
print(json.dumps({"rows": rows, "counted": total, "baseline_kib": before, "peak_kib": peak_kib()}))
"""


def write_inputs(folder: Path, rows: int) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"customer message number {i}: please check the status of order {i * 7 % 100003}" for i in range(rows)]
    parquet = folder / f"in-{rows}.parquet"
    pq.write_table(pa.table({"text": texts, "id": list(range(rows))}), parquet, row_group_size=65_536)
    jsonl = folder / f"in-{rows}.jsonl"
    with jsonl.open("w") as handle:
        for text in texts:
            handle.write(json.dumps({"text": text}) + "\n")
    return {"parquet": parquet, "jsonl": jsonl}


def measure(path: Path, fmt: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(path), fmt], capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout)
    result["growth_mib"] = round((result["peak_kib"] - result["baseline_kib"]) / 1024, 1)
    result["file_mib"] = round(path.stat().st_size / 2**20, 1)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--output", default="batch_memory.json")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"machine": machine_info(), "command": command_line("bench.batch_memory"), "runs": []}
    with tempfile.TemporaryDirectory(prefix="sluice-batch-memory-") as tmp:
        rows_table = []
        for rows in (args.small, args.rows):
            for fmt, path in write_inputs(Path(tmp), rows).items():
                run = {"format": fmt, **measure(path, fmt)}
                results["runs"].append(run)
                rows_table.append([fmt, f"{rows:,}", run["file_mib"], run["baseline_kib"] // 1024,
                                   run["peak_kib"] // 1024, run["growth_mib"]])
    print(table(["format", "rows", "file MiB", "baseline MiB", "peak MiB", "growth MiB"], rows_table))
    by = {(r["format"], r["rows"]): r for r in results["runs"]}
    for fmt in ("parquet", "jsonl"):
        small, large = by[(fmt, args.small)], by[(fmt, args.rows)]
        results[f"{fmt}_peak_ratio"] = round(large["peak_kib"] / small["peak_kib"], 3)
        print(f"{fmt}: peak RSS reading {args.rows:,} rows is {results[f'{fmt}_peak_ratio']}x "
              f"that of {args.small:,} rows")
    print(f"wrote {write_json(args.output, results)}")


if __name__ == "__main__":
    main()
