"""The figures of the peer bench (`bench.celery_peer`), from the records its clients write: one
phase's throughput, latency and CPU per job, the summary over repeats, and the printed tables.

Pure: no process, no clock. A phase's records are dicts with `bench.peer_client.COLUMNS`.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from bench.output import fmt, table
from sluice.stats import percentiles

SYSTEMS = ("celery", "sluice")
GROUPS = ("sluice api", "sluice workers", "celery workers", "redis-server", "client")
# The groups that serve each system; the Redis server is shared, the client is the phase's own.
SERVING = {"sluice": ("sluice api", "sluice workers", "redis-server"), "celery": ("celery workers", "redis-server")}


# --- pure: a phase's figures, the summary over repeats ---------------------------------------------


def middle_throughput(done_at: Sequence[float]) -> float:
    """Completions/s over the middle 80 % of completions: the closed loop's ramp-up and its drain
    (the last clients finishing alone) left out."""
    times = sorted(done_at)
    lo, hi = len(times) // 10, (len(times) * 9) // 10
    return (hi - lo) / (times[hi] - times[lo]) if hi > lo and times[hi] > times[lo] else math.nan


def phase_report(
    records: Sequence[dict[str, Any]],
    *,
    mode: str,
    system: str,
    spent: dict[str, float],
    window_s: float,
    foreign_cores: float,
) -> dict[str, Any]:
    ok = [r for r in records if r["status"] == "succeeded"]
    latency = [1000 * (r["done_at"] - r["scheduled_at"]) for r in ok]
    jobs = max(1, len(ok))
    out: dict[str, Any] = {
        "system": system,
        "mode": mode,
        "requests": len(records),
        "succeeded": len(ok),
        "not_succeeded": dict(Counter(r["error"] or r["status"] for r in records if r["status"] != "succeeded")),
        "refused_429": sum(r["refused"] for r in records),
        # Job-weighted: the size of the batch the average job ran in.
        "mean_batch_size": statistics.fmean(sizes)
        if (sizes := [r["batch_size"] for r in ok if r["batch_size"]])
        else None,
        "latency_ms": percentiles(latency),
        "submit_ms": percentiles([1000 * (r["accepted_at"] - r["sent_at"]) for r in ok]),
        "window_s": window_s,
        "foreign_cores": foreign_cores,
        "cpu_core_s": spent,
        "cores": {k: v / window_s for k, v in spent.items()},
        "cpu_ms_per_job": {k: 1000 * v / jobs for k, v in spent.items()},
        "serving_cpu_ms_per_job": 1000 * sum(spent.get(g, 0.0) for g in SERVING[system]) / jobs,
        "ours_cpu_ms_per_job": 1000 * sum(spent.get(g, 0.0) for g in (*SERVING[system], "client")) / jobs,
        "ours_cores": sum(spent.get(g, 0.0) for g in (*SERVING[system], "client")) / window_s,
    }
    if mode == "closed":
        out["throughput"] = middle_throughput([r["done_at"] for r in ok])
        out["throughput_whole_run"] = len(ok) / (max(r["done_at"] for r in ok) - min(r["sent_at"] for r in records))
    else:
        scheduled = sorted(r["scheduled_at"] for r in records)
        out["offered_rate"] = (len(scheduled) - 1) / (scheduled[-1] - scheduled[0])
        out["send_lag_ms"] = percentiles([1000 * (r["sent_at"] - r["scheduled_at"]) for r in records])
        out["latencies_ms"] = [round(v, 2) for v in latency]
    return out


def spread(values: Sequence[float | None]) -> dict[str, float | None]:
    """Median and range over repeats (None where a repeat had no value, e.g. p99 of < 300)."""
    present = [v for v in values if v is not None and not math.isnan(v)]
    if not present:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(present), "min": min(present), "max": max(present), "n": len(present)}


def _best_by_repeat(phases: Sequence[dict[str, Any]], system: str) -> dict[int, dict[str, Any]]:
    """Each repeat's saturation phase of `system` with the highest throughput over the levels."""
    best: dict[int, dict[str, Any]] = {}
    for p in phases:
        if p["kind"] == "saturation" and p["system"] == system:
            held = best.get(p["repeat"])
            if held is None or p["throughput"] > held["throughput"]:
                best[p["repeat"]] = p
    return best


def _cpu_row(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        **{g: spread([p["cpu_ms_per_job"].get(g, 0.0) for p in runs]) for g in GROUPS},
        "serving": spread([p["serving_cpu_ms_per_job"] for p in runs]),
        "serving + client": spread([p["ours_cpu_ms_per_job"] for p in runs]),
        "client cores": spread([p["cores"]["client"] for p in runs]),
        "our cores": spread([p["ours_cores"] for p in runs]),
        "other load cores": spread([p["foreign_cores"] for p in runs]),
        "mean batch size": spread([p["mean_batch_size"] for p in runs]),
    }


def _latency_row(phases: Sequence[dict[str, Any]], factor: float) -> dict[str, Any]:
    row: dict[str, Any] = {}
    by_system = {
        system: {
            p["repeat"]: p for p in phases if p["kind"] == "latency" and p["system"] == system and p["factor"] == factor
        }
        for system in SYSTEMS
    }
    for system, runs in by_system.items():
        if runs:
            row[system] = {
                "rate": spread([p["offered_rate"] for p in runs.values()]),
                **{q: spread([p["latency_ms"][q] for p in runs.values()]) for q in ("p50", "p95", "p99")},
                "pooled": percentiles([v for p in runs.values() for v in p["latencies_ms"]]),
                "requests": sum(p["requests"] for p in runs.values()),
                "failed": sum(p["requests"] - p["succeeded"] for p in runs.values()),
                "refused_429": sum(p["refused_429"] for p in runs.values()),
            }
    both = sorted(set(by_system["sluice"]) & set(by_system["celery"]))
    p99s = [(by_system["sluice"][r]["latency_ms"]["p99"], by_system["celery"][r]["latency_ms"]["p99"]) for r in both]
    row["sluice_p99_below_celery_by_repeat"] = [s is not None and c is not None and s < c for s, c in p99s]
    return row


def summarise(phases: Sequence[dict[str, Any]], factors: Sequence[float]) -> dict[str, Any]:
    """Saturation per system (each repeat's best level) and the Sluice/Celery ratio per repeat,
    latency percentiles per load factor, CPU per job per process group; each as the median and
    the range over repeats.

    The CPU-bound ratio is what the saturation ratio would be on a machine with nothing else
    running, if each system kept the cores busy: the CPU per job of everything it runs on them
    (its servers, the Redis server and its client), Celery's over Sluice's, at saturation.
    """
    best = {system: _best_by_repeat(phases, system) for system in SYSTEMS}
    repeats = sorted(set(best["celery"]) & set(best["sluice"]))
    ratios = [best["sluice"][r]["throughput"] / best["celery"][r]["throughput"] for r in repeats]
    cpu_ratios = [best["celery"][r]["ours_cpu_ms_per_job"] / best["sluice"][r]["ours_cpu_ms_per_job"] for r in repeats]
    saturation = {}
    for system in SYSTEMS:
        levels: dict[int, list[float]] = {}
        for p in phases:
            if p["kind"] == "saturation" and p["system"] == system:
                levels.setdefault(p["spec"]["concurrency"], []).append(p["throughput"])
        saturation[system] = {
            **spread([p["throughput"] for p in best[system].values()]),
            "by_level": {c: spread(v) for c, v in sorted(levels.items())},
        }
    cpu = {f"saturation/{s}": _cpu_row(list(best[s].values())) for s in SYSTEMS if best[s]}
    for factor in factors:
        for system in SYSTEMS:
            runs = [p for p in phases if p["kind"] == "latency" and p["system"] == system and p["factor"] == factor]
            if runs:
                cpu[f"{factor:.0%} load/{system}"] = _cpu_row(runs)
    return {
        "saturation": saturation,
        "saturation_ratio_sluice_over_celery": {**spread(ratios), "by_repeat": ratios},
        "cpu_bound_ratio_sluice_over_celery": {**spread(cpu_ratios), "by_repeat": cpu_ratios},
        "latency": {f"{factor:g}": _latency_row(phases, factor) for factor in factors},
        "cpu_ms_per_job": cpu,
    }


def _range(s: dict[str, Any], digits: int = 1) -> str:
    if s["median"] is None:
        return "n/a"
    if s["n"] == 1:
        return fmt(s["median"], digits)
    return f"{fmt(s['median'], digits)} [{fmt(s['min'], digits)}-{fmt(s['max'], digits)}]"


def progress_line(p: dict[str, Any]) -> str:
    head = (
        f"{p['throughput']:.1f} jobs/s"
        if p["mode"] == "closed"
        else f"p50 {fmt(p['latency_ms']['p50'], 0)} p99 {fmt(p['latency_ms']['p99'], 0)} ms"
    )
    return (
        f"    {head}; serving CPU {p['serving_cpu_ms_per_job']:.1f} ms/job; client {p['cores']['client']:.2f} cores; "
        f"other load {p['foreign_cores']:.2f} cores; failed {p['requests'] - p['succeeded']}, "
        f"429s {p['refused_429']}"
    )


def print_summary(summary: dict[str, Any], args: argparse.Namespace) -> None:
    sat = summary["saturation"]
    ratio, cpu_ratio = summary["saturation_ratio_sluice_over_celery"], summary["cpu_bound_ratio_sluice_over_celery"]
    rows = [
        [system, _range(sat[system]), ", ".join(f"{c}: {_range(s)}" for c, s in sat[system]["by_level"].items())]
        for system in SYSTEMS
    ]
    print(
        f"\nSATURATION, wall-clock (closed loops; completions/s over the middle 80 %; the best level of each "
        f"repeat; median [min-max] over {args.repeats} repeat(s))"
    )
    print(table(["system", "saturation jobs/s", "by concurrent clients"], rows))
    per_repeat = ", ".join(f"{r:.2f}" for r in ratio["by_repeat"])
    print(f"ratio Sluice / Celery, wall-clock: {_range(ratio, 2)} (per repeat: {per_repeat}); target >= 1.5")
    per_repeat = ", ".join(f"{r:.2f}" for r in cpu_ratio["by_repeat"])
    print(
        f"ratio Sluice / Celery, CPU-bound (Celery's CPU per job over Sluice's, servers + Redis + client): "
        f"{_range(cpu_ratio, 2)} (per repeat: {per_repeat})"
    )
    rows = []
    for factor, row in summary["latency"].items():
        for system in SYSTEMS:
            if system in row:
                r = row[system]
                rows.append(
                    [
                        f"{float(factor):.0%}",
                        system,
                        _range(r["rate"]),
                        _range(r["p50"], 0),
                        _range(r["p95"], 0),
                        _range(r["p99"], 0),
                        fmt(r["pooled"]["p99"], 0),
                        r["requests"],
                        r["failed"],
                        r["refused_429"],
                    ]
                )
    print("\nLATENCY, wall-clock (open loops, Poisson; ms from the scheduled send to the result seen by the client)")
    print(
        table(
            [
                "load (x Celery sat.)",
                "system",
                "rate /s",
                "p50",
                "p95",
                "p99",
                "p99 pooled",
                "requests",
                "failed",
                "429s",
            ],
            rows,
        )
    )
    for factor, row in summary["latency"].items():
        print(
            f"Sluice p99 below Celery's at {float(factor):.0%} (per repeat): {row['sluice_p99_below_celery_by_repeat']}"
        )
    rows = [
        [
            key,
            *(_range(cpu[g], 2) for g in GROUPS),
            _range(cpu["serving"], 2),
            _range(cpu["serving + client"], 2),
            _range(cpu["our cores"], 2),
            _range(cpu["other load cores"], 2),
            _range(cpu["mean batch size"], 1),
        ]
        for key, cpu in summary["cpu_ms_per_job"].items()
    ]
    print("\nCPU ms PER JOB (utime + stime over each phase's window; the idle system's processes in their own columns)")
    print(
        table(
            ["phase/system", *GROUPS, "serving", "serving + client", "our cores", "other load cores", "mean batch"],
            rows,
        )
    )
