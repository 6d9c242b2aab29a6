"""In-process MiniLM throughput on the skewed length mix, by batch plan.

Plans, all on the same texts in the same process (torch threads as given, default 1):

* (a) ``sorted``: sort by real token length, then chunk into batches of ``--batch-size``;
* (a') ``buckets``: sluice.batcher.MicroBatcher's length buckets (the platform's policy, all
  texts present at once, cost = the API's token estimate), size closes then age closes;
* (b) ``arrival``: chunks of ``--batch-size`` in arrival order;
* (c) ``single``: one text at a time (batch size 1);
* (d) ``chunked``: the arrival-order chunks of (b), which the encoder itself sorts and runs as
  passes of at most ``max_batch_tokens`` padded tokens (its default; the worker's way).

Plans (a) to (c) run every batch as one padded pass, so they measure the batch plan alone.
Reports texts/s, padding (padded tokens / real tokens) and the ratios a/b, a/c, a'/b, d/c.
Run: ``python -m bench.inprocess [--texts 640] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue as queue_mod
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench.batch_plans import arrival_batches, bucketed_batches, padding_ratio, sorted_batches
from bench.machine import CpuWindow, machine_info, wait_quiet
from bench.output import command_line, fmt, table, write_json
from scheduler.planning.text_mix import SKEWED, skewed_texts

PLANS = ("sorted", "buckets", "arrival", "single", "chunked")
# Larger than any batch: the encoder runs the plan's batch as one pass.
ONE_PASS = 1 << 30
PLAN_LABELS = {
    "sorted": "(a) length-sorted",
    "buckets": "(a') MicroBatcher buckets",
    "arrival": "(b) arrival order",
    "single": "(c) one at a time",
    "chunked": "(d) arrival order, encoder passes",
}


def configure_torch(threads: int) -> None:
    """Before torch is imported where possible (OpenMP reads these at start), then explicitly."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass


def load_encoder(threads: int, precision: str = "fp32") -> Any:
    """The encoder the worker builds for `precision` (fp32, bf16 or int8), on the CPU."""
    configure_torch(threads)
    from sluice.artifacts import MINILM_URI, resolve_artifact
    from workers.models.calibration import measure_pass_overhead, torch_dtype
    from workers.models.minilm import MiniLMEncoder

    encoder = MiniLMEncoder(model_dir=resolve_artifact(MINILM_URI), device="cpu", dtype=torch_dtype(precision),
                            quantize="int8" if precision == "int8" else None)
    # Planned as the worker plans them: with the pass cost measured on this host at this precision.
    measured = measure_pass_overhead(encoder, rounds=5)
    if measured is not None:
        encoder.pass_overhead_tokens = measured
    return encoder


def warmup(encoder: Any) -> None:
    from workers.models.text_handlers import WARMUP_BATCHES

    for batch in WARMUP_BATCHES:
        encoder.encode(list(batch))


def plan_batches(plan: str, texts: Sequence[str], lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    if plan == "sorted":
        return sorted_batches(lengths, batch_size)
    if plan == "buckets":
        from sluice.kinds import token_estimate

        return bucketed_batches([token_estimate(t) for t in texts], batch_size)
    if plan in ("arrival", "chunked"):
        return arrival_batches(len(texts), batch_size)
    if plan == "single":
        return arrival_batches(len(texts), 1)
    raise ValueError(f"unknown plan {plan!r}")


def plan_passes(encoder: Any, plan: str, batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> list[list[int]]:
    """The forward passes a plan's batches run as: each batch one pass, or for `chunked` the passes
    the encoder plans of each (as the worker's handler does)."""
    if plan != "chunked":
        return [list(batch) for batch in batches]
    return [[batch[i] for i in chunk] for batch in batches for chunk in encoder.passes([lengths[j] for j in batch])]


def plan_padding(encoder: Any, texts: Sequence[str], plan: str, batch_size: int) -> float:
    """The padding (padded / real tokens) a plan costs on these texts, untimed: the figure
    `time_plan` reports, which the worker's `/metrics` is checked against
    (tests/integration/test_padding_metrics.py)."""
    lengths = encoder.token_lengths(texts)
    batches = plan_batches(plan, texts, lengths, batch_size)
    return padding_ratio(lengths, plan_passes(encoder, plan, batches, lengths))


def time_plan(encoder: Any, texts: Sequence[str], plan: str, batch_size: int) -> dict[str, Any]:
    """Plan (the length look-up included in the timing) and run; answer texts/s and padding."""
    from workers.models.minilm import DEFAULT_MAX_BATCH_TOKENS

    encoder.max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS if plan == "chunked" else ONE_PASS
    window = CpuWindow()
    cpu0 = time.process_time()
    started = time.perf_counter()
    lengths = encoder.token_lengths(texts) if plan == "sorted" else None
    batches = plan_batches(plan, texts, lengths or [], batch_size)
    batch_s = []
    for batch in batches:
        t = time.perf_counter()
        encoder.encode([texts[i] for i in batch])
        batch_s.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - started
    own_cpu = time.process_time() - cpu0
    window.stop()
    real_lengths = lengths or encoder.token_lengths(texts)  # outside the timing when not needed
    passes = plan_passes(encoder, plan, batches, real_lengths)
    return {**_timed(plan, len(texts), batches, passes, real_lengths, elapsed, own_cpu, window),
            "mean_batch_ms": 1000 * statistics.fmean(batch_s)}


def _timed(plan: str, count: int, batches: Sequence[Sequence[int]], passes: Sequence[Sequence[int]],
           lengths: Sequence[int], elapsed: float, own_cpu: float, window: CpuWindow) -> dict[str, Any]:
    """What a timed run of `count` texts in `batches` (run as `passes`) answers."""
    return {
        "plan": plan, "texts": count, "batches": len(batches), "passes": len(passes), "seconds": elapsed,
        "texts_per_s": count / elapsed, "padding_ratio": padding_ratio(lengths, passes),
        "own_cpu_s": own_cpu, "cpu_ms_per_text": 1000 * own_cpu / count, "system_busy_s": window.busy,
        "foreign_cores": window.foreign_cores(own_cpu),
    }


def time_replay(encoder: Any, texts: Sequence[str], batches: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Run the given batches (indices into `texts`) in their order, each split into the passes the
    encoder plans, as the worker's handler does: the platform's own batch plan, replayed."""
    from workers.models.minilm import DEFAULT_MAX_BATCH_TOKENS

    encoder.max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS
    window = CpuWindow()
    cpu0 = time.process_time()
    started = time.perf_counter()
    for batch in batches:
        encoder.encode([texts[i] for i in batch])
    elapsed = time.perf_counter() - started
    own_cpu = time.process_time() - cpu0
    window.stop()
    lengths = encoder.token_lengths(texts)
    passes = plan_passes(encoder, "chunked", batches, lengths)
    return _timed("replay", sum(len(batch) for batch in batches), batches, passes, lengths, elapsed, own_cpu,
                  window)


def run_plans(texts: Sequence[str], plans: Sequence[str], *, threads: int, batch_size: int,
              repeats: int = 1, quiet_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """Every plan `repeats` times (interleaved), keeping the median-throughput run of each."""
    encoder = load_encoder(threads)
    warmup(encoder)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in plans}
    for _ in range(repeats):
        for plan in plans:
            if quiet_s > 0:
                wait_quiet(quiet_s)
            runs[plan].append(time_plan(encoder, texts, plan, batch_size))
    out = {}
    for plan, results in runs.items():
        results.sort(key=lambda r: r["texts_per_s"])
        chosen = dict(results[len(results) // 2])
        chosen["all_texts_per_s"] = [r["texts_per_s"] for r in results]
        out[plan] = chosen
    return out


def _child(texts: Sequence[str], plans: Sequence[str], threads: int, batch_size: int, repeats: int,
           quiet_s: float, queue: Any) -> None:
    try:
        queue.put(("ok", run_plans(texts, plans, threads=threads, batch_size=batch_size, repeats=repeats,
                                   quiet_s=quiet_s)))
    except BaseException as exc:
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def run_plans_isolated(texts: Sequence[str], plans: Sequence[str], *, threads: int, batch_size: int,
                       repeats: int = 1, quiet_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """`run_plans` in a fresh spawned process, so the caller's torch settings do not leak in."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(list(texts), list(plans), threads, batch_size, repeats, quiet_s, queue))
    proc.start()
    [(status, payload)] = _gather(queue, [proc])
    if status != "ok":
        raise RuntimeError(f"in-process bench failed: {payload}")
    return dict(payload)


# --- several processes at once (the fair baseline for a multi-worker platform) ------------------


def _parallel_child(texts: Sequence[str], plan: str, threads: int, batch_size: int, precision: str,
                    barrier: Any, queue: Any, batches: Sequence[Sequence[int]] | None = None) -> None:
    try:
        encoder = load_encoder(threads, precision)
        warmup(encoder)
        barrier.wait(timeout=300)
        started = time.time()
        result = (time_plan(encoder, texts, plan, batch_size) if batches is None
                  else time_replay(encoder, texts, batches))
        result["started_at"] = started
        result["finished_at"] = time.time()
        queue.put(("ok", result))
    except BaseException as exc:
        barrier.abort()
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def run_parallel(texts: Sequence[str], plan: str, *, procs: int, threads: int, batch_size: int,
                 precision: str = "fp32", replay: Sequence[Sequence[Sequence[int]]] | None = None) -> dict[str, Any]:
    """`procs` processes of `threads` threads each, text i going to process i % procs, started
    together on a barrier. Answers the sum of their throughputs and the wall-clock aggregate.
    With `replay` (one list of batches of text indices per process; `plan` is then "replay"), each
    process runs its own batches of the whole `texts` instead (`time_replay`)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # Each child's texts, and the batches it replays (None: it plans its own share).
    shares: list[tuple[list[str], list[list[int]] | None]] = (
        [(list(texts[i::procs]), None) for i in range(procs)] if replay is None
        else [(list(texts), [list(batch) for batch in own]) for own in replay])
    procs = len(shares)
    barrier = ctx.Barrier(procs)
    children = [ctx.Process(target=_parallel_child,
                            args=(share, plan, threads, batch_size, precision, barrier, queue, batches))
                for share, batches in shares]
    for child in children:
        child.start()
    results = _gather(queue, children)
    errors = [payload for status, payload in results if status != "ok"]
    if errors:
        raise RuntimeError(f"parallel in-process bench failed: {errors}")
    parts = [payload for _, payload in results]
    texts_done = sum(p["texts"] for p in parts)
    wall = max(p["finished_at"] for p in parts) - min(p["started_at"] for p in parts)
    # Each child saw the whole machine: what was busy beyond all the children's own CPU.
    busy = statistics.fmean(p["system_busy_s"] for p in parts)
    elapsed = statistics.fmean(p["seconds"] for p in parts)
    foreign = max(0.0, busy - sum(p["own_cpu_s"] for p in parts)) / elapsed
    return {
        "plan": plan, "procs": procs, "threads": threads, "texts": texts_done, "precision": precision,
        "texts_per_s_sum": sum(p["texts_per_s"] for p in parts),
        "texts_per_s_wall": texts_done / wall,
        "padding_ratio": [p["padding_ratio"] for p in parts], "foreign_cores": foreign,
        "cpu_ms_per_text": 1000 * sum(p["own_cpu_s"] for p in parts) / texts_done,
        "per_process": parts,
    }


def _gather(queue: Any, children: Sequence[Any]) -> list[tuple[str, Any]]:
    """One message per child. On any error or interrupt the children are terminated at once."""
    results: list[tuple[str, Any]] = []
    try:
        while len(results) < len(children):
            try:
                results.append(queue.get(timeout=1.0))
            except queue_mod.Empty:
                crashed = [c.exitcode for c in children if not c.is_alive() and c.exitcode not in (0, None)]
                if crashed:
                    raise RuntimeError(f"an in-process bench child died (exit codes {crashed})") from None
    except BaseException:
        for child in children:
            if child.is_alive():
                child.terminate()
        raise
    finally:
        for child in children:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
                child.join()
    return results


# --- command line ------------------------------------------------------------------------------


def summarise(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Wall-clock ratios, and CPU-normalised ones (CPU ms per text, inverted): the latter hold up
    when other tenants of the machine take a varying share of the cores during the run."""

    def ratio(a: str, b: str, cpu: bool = False) -> float:
        if a not in results or b not in results:
            return float("nan")
        if cpu:
            return float(results[b]["cpu_ms_per_text"] / results[a]["cpu_ms_per_text"])
        return float(results[a]["texts_per_s"] / results[b]["texts_per_s"])

    pairs = {"a/b": ("sorted", "arrival"), "a/c": ("sorted", "single"), "a'/b": ("buckets", "arrival"),
             "a/a'": ("sorted", "buckets"), "d/c": ("chunked", "single"), "d/a": ("chunked", "sorted")}
    out = {name: ratio(a, b) for name, (a, b) in pairs.items()}
    out.update({f"{name} (CPU-normalised)": ratio(a, b, cpu=True) for name, (a, b) in pairs.items()})
    return out


def print_results(results: dict[str, dict[str, Any]], ratios: dict[str, float]) -> None:
    rows = [[PLAN_LABELS[p], r["batches"], r["texts_per_s"], r["cpu_ms_per_text"],
             r["padding_ratio"] if p != "single" else None, r["mean_batch_ms"], r["foreign_cores"]]
            for p, r in results.items()]
    print(table(["plan", "batches", "texts/s", "CPU ms/text", "padding (padded/real tokens)", "mean ms/batch",
                 "other load (cores)"], rows))
    print(table(["ratio (texts/s over texts/s)", "value"], [[k, v] for k, v in ratios.items() if v == v]))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.inprocess", description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=640, help="texts in the skewed mix (default 640)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the process (default 1)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1, help="runs per plan; the median is kept")
    parser.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated subset of {PLANS}")
    parser.add_argument("--quiet-wait", type=float, default=10.0,
                        help="before each plan, wait up to this many s for the machine to be idle (0: off)")
    parser.add_argument("--output", default="inprocess.json", help="file name under bench/results/")
    args = parser.parse_args(argv)
    plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    for plan in plans:
        if plan not in PLANS:
            parser.error(f"unknown plan {plan!r}")

    texts = skewed_texts(args.texts, seed=args.seed)
    print(f"in-process MiniLM, {args.texts} texts ({SKEWED.describe()}), seed {args.seed}, "
          f"batch size {args.batch_size}, {args.threads} torch thread(s), {os.cpu_count()} cores")
    info = machine_info()
    results = run_plans(texts, plans, threads=args.threads, batch_size=args.batch_size, repeats=args.repeats,
                        quiet_s=args.quiet_wait)
    ratios = summarise(results)
    print_results(results, ratios)
    command = command_line("bench.inprocess")
    path = write_json(args.output, {
        "bench": "inprocess", "command": command, "machine": info,
        "params": {**vars(args), "mix": SKEWED.describe()}, "results": results, "ratios": ratios,
    })
    print(f"reproduce: {command}\nresults: {path}"
          f"   (a/b = {fmt(ratios['a/b'])}x, a/c = {fmt(ratios['a/c'])}x)")


if __name__ == "__main__":
    main()
