"""Batch sizes under a backlog: a deterministic replay of one worker's read/close/run loop.

No model and no Redis: the real workers.batcher.MicroBatcher is driven the way
workers/consumer.py drives it (read up to the free prefetch room, `poll(now)` after every read,
run closed batches one at a time, free the room when a batch completes), on a backlog whose
jobs were all enqueued before the worker started, so every job is already past `max_wait_ms`
when it is read. Model time is a linear cost model (fixed + per padded token) calibrated on
bench.inprocess; only batch sizes, padding and the *modelled* throughput ratio are reported.

Policies compared, each with the batcher's top-up on (the worker's default) and off:

* ``eager`` (what the worker does): poll after each read, queue every closed batch;
* ``lazy`` (an alternative): close a batch only when the model is free to run it, taking the
  fullest group and leaving the other items in the batcher to keep growing;
* ``sorted`` (the in-process ideal): the whole backlog sorted by length, chunks of 32.

With ``--measure`` every policy's batch list is also run through MiniLM in one process with one
torch thread and timed, so the throughput ratios are measured, not modelled.

Run: ``python -m bench.batcher_backlog [--texts 2000] [--lane bulk|online] [--measure [--repeats 2]]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

from bench.common import (
    SKEWED,
    command_line,
    padding_ratio,
    skewed_texts,
    sorted_batches,
    table,
    token_lengths,
    write_json,
)

# Calibrated on bench.inprocess (1 torch thread): ~0.44 ms per padded token, ~2.5 ms per call.
FIXED_MS = 2.5
PER_TOKEN_MS = 0.44


def model_ms(lengths: Sequence[int], batch: Sequence[int]) -> float:
    return FIXED_MS + PER_TOKEN_MS * max(lengths[i] for i in batch) * len(batch)


def replay(costs: Sequence[int], lengths: Sequence[int], *, policy: str, lane: str, top_up: bool = True,
           batch_size: int = 32, prefetch_batches: int = 4, max_wait_ms: float = 10.0) -> dict[str, Any]:
    from workers.batcher import Item, MicroBatcher

    batcher = MicroBatcher(max_batch_size=batch_size, max_wait_ms=max_wait_ms, isolate_tenants=False,
                           top_up=top_up)
    stream = deque(range(len(costs)))
    prefetch = prefetch_batches * batch_size
    held = 0
    now = 1.0  # every job was enqueued at t=0: all are overdue when read
    ready: deque[list[int]] = deque()
    batches: list[list[int]] = []
    reasons: dict[str, int] = {}

    def item(i: int) -> Any:
        return Item(id=str(i), tenant="t", cost=int(costs[i]), enqueued_at=i * 1e-9)

    def take(closed: list[Any]) -> None:
        for batch in closed:
            reasons[batch.close_reason] = reasons.get(batch.close_reason, 0) + 1
            ready.append([int(x.id) for x in batch.items])

    while stream or held:
        # The reader: refill the prefetch room (bulk lane: at most one batch per read).
        while stream and held < prefetch:
            room = prefetch - held
            count = min(room, batch_size) if lane == "bulk" else room
            for _ in range(min(count, len(stream))):
                batcher.add(item(stream.popleft()))
                held += 1
            if policy == "eager":
                take(batcher.poll(now))
        if policy == "lazy" and not ready:
            closed = batcher.poll(now)
            if closed:
                closed.sort(key=lambda b: -len(b.items))
                take(closed[:1])
                for other in closed[1:]:  # back into the batcher, to grow until the model is free
                    for x in other.items:
                        batcher.add(x)
        if not ready:
            take(batcher.drain(now))
        # The runner: one batch; its items' room is freed when it completes.
        batch = ready.popleft()
        batches.append(batch)
        now += model_ms(lengths, batch) / 1000
        held -= len(batch)
    seconds = now - 1.0
    return {
        "policy": f"{policy}, top-up {'on' if top_up else 'off'}", "lane": lane, "batch_list": batches,
        "batches": len(batches), "mean_batch_size": len(costs) / len(batches),
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
    parser.add_argument("--measure", action="store_true", help="also time every batch list with MiniLM (minutes)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved timing runs with --measure (median)")
    parser.add_argument("--output", default="batcher_backlog.json", help="file name under bench/results/")
    args = parser.parse_args(argv)
    from sluice.kinds import token_estimate

    texts = skewed_texts(args.texts, seed=args.seed)
    lengths = token_lengths(texts)
    costs = [token_estimate(t) for t in texts]
    results = [replay(costs, lengths, policy=p, lane=args.lane, top_up=t)
               for p in ("eager", "lazy") for t in (True, False)]
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
          f"prefetch 4 x 32; cost model {FIXED_MS} ms + {PER_TOKEN_MS} ms/padded token")
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
    path = write_json(args.output, {"bench": "batcher_backlog", "command": command, "params": vars(args),
                                    "cost_model_ms": {"fixed": FIXED_MS, "per_padded_token": PER_TOKEN_MS},
                                    "results": results})
    print(f"reproduce: {command}\nresults: bench/results/{path.name}")
    if math.isnan(results[0]["padding_ratio"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
