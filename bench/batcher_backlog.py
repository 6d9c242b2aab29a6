"""Batch sizes under a backlog: a deterministic replay of one worker's read/take/run loop.

No model and no Redis: the real sluice.batcher.MicroBatcher is driven the way
workers/worker.py drives it, on a backlog whose jobs were all enqueued before the worker
started, so every job is already past `max_wait_ms` when it is read. The reader keeps the
prefetch room full (bulk lane: at most one batch per read); a batch's room is freed when it
completes. Model time is a linear cost model (a fixed cost per call + a cost per padded token)
calibrated on MiniLM with one torch thread; only batch sizes, padding and the *modelled*
throughput ratio are reported unless `--measure` times the batch lists.

Policies compared:

* ``eager``: the worker as it first was: `poll(now)` after every read, every closed batch
  queued for the model; power-of-two buckets (16 .. 256) with the batcher's top-up;
* ``take``: the worker now: `take(now)` when the model is free, everything else stays held and
  keeps growing; with power-of-two or fine buckets (`sluice.batcher.DEFAULT_BUCKET_BOUNDS`),
  top-up on and off;
* ``sorted`` (the in-process ideal): the whole backlog sorted by real token length, chunks of 32.

With ``--measure`` every policy's batch list is also run through MiniLM in one process with one
torch thread and timed, so the throughput ratios are measured, not modelled.

Run: ``python -m bench.batcher_backlog [--texts 2000] [--lane bulk|online] [--prefetch-batches 4]
[--measure [--repeats 2]]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

from bench.batch_plans import padding_ratio, sorted_batches, token_lengths
from bench.machine import machine_info
from bench.output import command_line, table, write_json
from scheduler.planning.text_mix import SKEWED, skewed_texts

# Calibrated on MiniLM, 1 torch thread, CPU time of one encode() call: ~10 ms per call (tokenising,
# Python, small kernels) + ~0.26 ms per padded token (batches of 1-32, 16-220 tokens).
FIXED_MS = 10.0
PER_TOKEN_MS = 0.26
POWER_OF_TWO = (16, 32, 64, 128, 256)


def model_ms(lengths: Sequence[int], batch: Sequence[int]) -> float:
    return FIXED_MS + PER_TOKEN_MS * max(lengths[i] for i in batch) * len(batch)


def replay(costs: Sequence[int], lengths: Sequence[int], *, policy: str, lane: str, top_up: bool,
           bounds: Sequence[int], batch_size: int = 32, prefetch_batches: int = 4,
           max_wait_ms: float = 10.0) -> dict[str, Any]:
    from sluice.batcher import Item, MicroBatcher

    batcher = MicroBatcher(max_batch_size=batch_size, max_wait_ms=max_wait_ms, isolate_tenants=False,
                           top_up=top_up, bucket_bounds=bounds)
    stream = deque(range(len(costs)))
    prefetch = prefetch_batches * batch_size
    held = 0
    now = 1.0  # every job was enqueued at t=0: all are overdue when read
    ready: deque[Any] = deque()
    batches: list[list[int]] = []
    reasons: dict[str, int] = {}

    def item(i: int) -> Any:
        return Item(id=str(i), tenant="t", cost=int(costs[i]), enqueued_at=i * 1e-9)

    while stream or held:
        # The reader: refill the prefetch room (bulk lane: at most one batch per read).
        while stream and held < prefetch:
            room = prefetch - held
            count = min(room, batch_size) if lane == "bulk" else room
            for _ in range(min(count, len(stream))):
                batcher.add(item(stream.popleft()))
                held += 1
            if policy == "eager":
                ready.extend(batcher.poll(now))
        # The runner, the model being free: one batch; its room is freed when it completes.
        batch = ready.popleft() if ready else batcher.take(now)
        if batch is None:
            batch = batcher.drain(now)[0]
        reasons[batch.close_reason] = reasons.get(batch.close_reason, 0) + 1
        members = [int(x.id) for x in batch.items]
        batches.append(members)
        now += model_ms(lengths, members) / 1000
        held -= len(members)
    seconds = now - 1.0
    named = "fine" if tuple(bounds) != POWER_OF_TWO else "2^k"
    return {
        "policy": f"{policy}, {named} buckets, top-up {'on' if top_up else 'off'}", "lane": lane,
        "prefetch": prefetch, "batch_list": batches, "batches": len(batches),
        "mean_batch_size": len(costs) / len(batches),
        "size_1_batches": sum(1 for b in batches if len(b) == 1), "close_reasons": reasons,
        "padding_ratio": padding_ratio(lengths, batches), "modelled_seconds": seconds,
        "modelled_texts_per_s": len(costs) / seconds,
    }


def _measure(texts: Sequence[str], plans: list[list[list[int]]], repeats: int, queue: Any) -> None:
    try:
        import time

        from bench.inprocess import load_encoder, warmup

        encoder = load_encoder(1)
        warmup(encoder)
        wall: list[list[float]] = [[] for _ in plans]
        cpu: list[list[float]] = [[] for _ in plans]
        for _ in range(repeats):  # interleaved, so a neighbour's load spreads over every plan
            for k, batches in enumerate(plans):
                started, cpu0 = time.perf_counter(), time.process_time()
                for batch in batches:
                    encoder.encode([texts[i] for i in batch])
                wall[k].append(time.perf_counter() - started)
                cpu[k].append(time.process_time() - cpu0)
        queue.put(("ok", [(len(texts) / statistics.median(w), 1000 * statistics.median(c) / len(texts))
                          for w, c in zip(wall, cpu, strict=True)]))
    except BaseException as exc:
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def measure(texts: Sequence[str], plans: list[list[list[int]]], repeats: int) -> list[tuple[float, float]]:
    """(texts/s, CPU ms per text) of each batch list, medians over `repeats` interleaved runs."""
    import multiprocessing as mp

    from bench.inprocess import _gather

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(list(texts), plans, repeats, queue))
    proc.start()
    [(status, payload)] = _gather(queue, [proc])
    if status != "ok":
        raise RuntimeError(payload)
    return [tuple(x) for x in payload]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.batcher_backlog", description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lane", choices=("bulk", "online"), default="bulk")
    parser.add_argument("--prefetch-batches", type=int, default=4, help="the worker's prefetch room, in batches")
    parser.add_argument("--measure", action="store_true", help="also time every batch list with MiniLM (minutes)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved timing runs with --measure (median)")
    parser.add_argument("--output", default="batcher_backlog.json", help="file name under bench/results/")
    args = parser.parse_args(argv)
    from sluice.batcher import DEFAULT_BUCKET_BOUNDS
    from sluice.kinds import token_estimate

    texts = skewed_texts(args.texts, seed=args.seed)
    lengths = token_lengths(texts)
    costs = [token_estimate(t) for t in texts]
    variants = [("eager", POWER_OF_TWO, True), ("take", POWER_OF_TWO, True), ("take", POWER_OF_TWO, False),
                ("take", DEFAULT_BUCKET_BOUNDS, True), ("take", DEFAULT_BUCKET_BOUNDS, False)]
    results = [replay(costs, lengths, policy=p, lane=args.lane, top_up=t, bounds=b,
                      prefetch_batches=args.prefetch_batches) for p, b, t in variants]
    ideal = sorted_batches(lengths, 32)
    ideal_s = sum(model_ms(lengths, b) for b in ideal) / 1000
    results.append({"policy": "sorted (in-process ideal)", "lane": "-", "batch_list": ideal, "batches": len(ideal),
                    "mean_batch_size": args.texts / len(ideal), "size_1_batches": 0, "close_reasons": {},
                    "padding_ratio": padding_ratio(lengths, ideal), "modelled_seconds": ideal_s,
                    "modelled_texts_per_s": args.texts / ideal_s})
    if args.measure:
        print(f"timing {len(results)} batch lists with MiniLM, 1 thread ...", flush=True)
        measured = measure(texts, [r["batch_list"] for r in results], args.repeats)
        for r, (tps, cpu_ms) in zip(results, measured, strict=True):
            r["measured_texts_per_s"] = tps
            r["measured_cpu_ms_per_text"] = cpu_ms
    key = "measured_texts_per_s" if args.measure else "modelled_texts_per_s"
    print(f"backlog of {args.texts} overdue jobs ({SKEWED.describe()}), one worker, {args.lane} lane, "
          f"prefetch {args.prefetch_batches} x 32; cost model {FIXED_MS} ms + {PER_TOKEN_MS} ms/padded token")
    headers = ["policy", "batches", "mean size", "size-1 batches", "close reasons", "padding", "modelled texts/s"]
    if args.measure:
        headers += ["measured texts/s", "CPU ms/text", "vs sorted (CPU-normalised)"]
    headers.append("vs sorted" + (" (measured, wall)" if args.measure else " (modelled)"))
    rows = []
    for r in results:
        row = [r["policy"], r["batches"], r["mean_batch_size"], r["size_1_batches"],
               ", ".join(f"{k}={v}" for k, v in r["close_reasons"].items()) or "-", r["padding_ratio"],
               r["modelled_texts_per_s"]]
        if args.measure:
            row += [r["measured_texts_per_s"], r["measured_cpu_ms_per_text"],
                    results[-1]["measured_cpu_ms_per_text"] / r["measured_cpu_ms_per_text"]]
        row.append(r[key] / results[-1][key])
        rows.append(row)
    print(table(headers, rows))
    command = command_line("bench.batcher_backlog")
    for r in results:
        r["batch_sizes"] = [len(b) for b in r.pop("batch_list")]
    path = write_json(args.output, {"bench": "batcher_backlog", "command": command, "machine": machine_info(),
                                    "params": vars(args),
                                    "cost_model_ms": {"fixed": FIXED_MS, "per_padded_token": PER_TOKEN_MS},
                                    "results": results})
    print(f"reproduce: {command}\nresults: bench/results/{path.name}")
    if math.isnan(results[0]["padding_ratio"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
