"""Packed bf16 MiniLM with its row counts rounded up (what the worker runs) against the same
packed layers run at every row count as it comes.

oneDNN builds and keeps a kernel per row count of a product (workers/models/packed.py). Each
repeat runs two processes at once, one per core, on 1 torch thread each: both encode the same
arrival-order batches of the skewed mix, their sizes drawn as a worker's come (mostly 1-6 texts,
now and then 8-32), one with ``padded_rows`` and one with ``exact_rows``. Each reports its CPU time
per text (``time.process_time``) and how much its resident memory grew from the end of its warm-up
(the same 4 batches for both) to the end of the run, so the figure includes every kernel it built.
The ratio of the two CPU times is read per repeat; the processes swap cores by the scheduler's
choice, so the repeats show the spread.
Run: ``python -m bench.packed_rows [--batches 800] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.inprocess import configure_torch
from bench.machine import machine_info
from bench.output import command_line, table, write_json
from scheduler.planning.text_mix import SKEWED, skewed_texts

# Batch sizes as a worker at moderate load forms them: mostly a few texts, now and then a full batch.
BATCH_SIZES = (1, 1, 1, 2, 2, 3, 4, 5, 6, 8, 11, 16, 24, 32)
WARM_BATCHES = 4
MB = 2**20
MODES = ("padded", "exact")


def plan(batches: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    sizes = [rng.choice(BATCH_SIZES) for _ in range(batches)]
    texts = skewed_texts(sum(sizes), seed=seed)
    out, start = [], 0
    for size in sizes:
        out.append(texts[start:start + size])
        start += size
    return out


def child(mode: str, batches: int, seed: int) -> dict[str, Any]:
    configure_torch(1)
    import torch

    from sluice.artifacts import MINILM_URI, resolve_artifact
    from workers.models.minilm import MiniLMEncoder
    from workers.models.packed import pack_layers, packs
    from workers.models.shared import resident_bytes

    if not packs(torch.device("cpu"), torch.bfloat16):
        raise SystemExit("this CPU's oneDNN runs no bf16: nothing is packed here")
    encoder = MiniLMEncoder(model_dir=resolve_artifact(MINILM_URI), dtype=torch.bfloat16, packed=False)
    pack_layers(encoder.model, exact_rows=mode == "exact")
    work = plan(batches, seed)
    for batch in work[:WARM_BATCHES]:
        encoder.encode(batch)
    before = resident_bytes()
    started = time.process_time()
    for batch in work:
        encoder.encode(batch)
    spent = time.process_time() - started
    after = resident_bytes()
    return {"mode": mode, "cpu_ms_per_text": 1000 * spent / sum(len(b) for b in work),
            "resident_grew_mb": (after - before) / MB, "resident_end_mb": after / MB}


def repeat(batches: int, seed: int) -> dict[str, dict[str, Any]]:
    procs = {mode: subprocess.Popen([sys.executable, "-m", "bench.packed_rows", "--child", mode,
                                     "--batches", str(batches), "--seed", str(seed)], stdout=subprocess.PIPE)
             for mode in MODES}
    found = {}
    for mode, proc in procs.items():
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"the {mode} process failed ({proc.returncode})")
        found[mode] = json.loads(out.decode().strip().splitlines()[-1])
    return found


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.packed_rows", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=800, help="batches a repeat (default 800)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="repeat r runs the plan of seed + r")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--output", default="packed_rows.json", help="file name under bench/results/")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.batches, args.seed)))
        return
    info = machine_info()
    print(f"packed bf16 MiniLM, row counts padded vs exact: {args.batches} batches of {SKEWED.describe()}, "
          f"1 torch thread a process, {info['cpu']}, flags {' '.join(info['cpu_flags'])}, torch {info['torch']}")
    runs = [repeat(args.batches, args.seed + r) for r in range(args.repeats)]
    rows = [[r, run["exact"]["cpu_ms_per_text"], run["padded"]["cpu_ms_per_text"],
             f"{run['exact']['cpu_ms_per_text'] / run['padded']['cpu_ms_per_text']:.2f}x",
             run["exact"]["resident_grew_mb"], run["padded"]["resident_grew_mb"]] for r, run in enumerate(runs)]
    print(table(["repeat", "exact CPU ms/text", "padded CPU ms/text", "exact / padded", "exact grew MB",
                 "padded grew MB"], rows))
    ratios = [run["exact"]["cpu_ms_per_text"] / run["padded"]["cpu_ms_per_text"] for run in runs]
    print(f"exact / padded CPU: median {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    command = command_line("bench.packed_rows")
    path = write_json(args.output, {"bench": "packed_rows", "command": command, "machine": info,
                                    "params": {**vars(args), "mix": SKEWED.describe(), "batch_sizes": BATCH_SIZES},
                                    "runs": runs, "exact_over_padded": ratios})
    print(f"reproduce: {command}\nresults: {path}")


if __name__ == "__main__":
    main()
