"""The peer bench's pure parts (bench/peer_client.py's closed loop, bench/peer_report.py): latency
counts from the scheduled send time, saturation is the best level of each repeat over the middle
80 % of completions, a p99 needs 300 samples, and the summary pairs the systems repeat by repeat.
Nothing here measures a speed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench.peer_client import closed_loop
from bench.peer_report import middle_throughput, phase_report, summarise

pytestmark = pytest.mark.slow

SPENT = {"sluice api": 1.0, "sluice workers": 4.0, "celery workers": 0.5, "redis-server": 1.0, "client": 2.0}


def record(i: int, *, scheduled: float, sent: float, done: float, status: str = "succeeded") -> dict[str, Any]:
    return {
        "index": i,
        "scheduled_at": scheduled,
        "sent_at": sent,
        "accepted_at": sent + 0.001,
        "done_at": done,
        "status": status,
        "refused": 0,
        "batch_size": 1 + i % 3,
        "error": None if status == "succeeded" else "boom",
    }


def test_open_loop_latency_counts_from_the_scheduled_send_not_the_actual_one() -> None:
    # Every request left 100 ms late and took 50 ms once sent: the latency is 150 ms.
    records = [record(i, scheduled=i * 0.1, sent=i * 0.1 + 0.1, done=i * 0.1 + 0.15) for i in range(300)]
    records.append(record(300, scheduled=30.0, sent=30.0, done=30.0, status="failed"))
    report = phase_report(records, mode="open", system="sluice", spent=SPENT, window_s=10.0, foreign_cores=0.0)
    assert report["latency_ms"]["p50"] == pytest.approx(150.0)
    assert report["latency_ms"]["p99"] == pytest.approx(150.0)
    assert report["send_lag_ms"]["p50"] == pytest.approx(100.0)
    assert report["succeeded"] == 300 and report["not_succeeded"] == {"boom": 1}
    # Per succeeded job: Sluice's serving groups are the API, its workers and Redis (1 + 4 + 1 s).
    assert report["serving_cpu_ms_per_job"] == pytest.approx(6000 / 300)
    assert report["ours_cpu_ms_per_job"] == pytest.approx(8000 / 300)
    assert report["cores"]["client"] == pytest.approx(0.2)
    assert report["mean_batch_size"] == pytest.approx(2.0)


def test_no_p99_from_fewer_than_300_samples() -> None:
    records = [record(i, scheduled=i * 0.1, sent=i * 0.1, done=i * 0.1 + 0.02) for i in range(299)]
    report = phase_report(records, mode="open", system="celery", spent=SPENT, window_s=10.0, foreign_cores=0.0)
    assert report["latency_ms"]["p99"] is None and report["latency_ms"]["p50"] == pytest.approx(20.0)


def test_saturation_leaves_out_the_ramp_and_the_drain() -> None:
    # 10 completions/s in the middle, slow at both ends.
    done = [0.5 * i for i in range(10)] + [5.0 + 0.1 * i for i in range(80)] + [13.0 + 2.0 * i for i in range(10)]
    assert middle_throughput(done) == pytest.approx(10.0, rel=0.02)


def phase(
    system: str,
    repeat: int,
    *,
    kind: str,
    throughput: float = 0.0,
    level: int = 16,
    factor: float = 0.0,
    p99: float | None = None,
    cpu_ms: float = 20.0,
) -> dict[str, Any]:
    return {
        "system": system,
        "repeat": repeat,
        "kind": kind,
        "factor": factor,
        "throughput": throughput,
        "spec": {"concurrency": level},
        "offered_rate": 10.0,
        "requests": 300,
        "succeeded": 300,
        "refused_429": 0,
        "latency_ms": {"p50": 10.0, "p95": 20.0, "p99": p99},
        "latencies_ms": [10.0] * 300,
        "cpu_ms_per_job": {},
        "serving_cpu_ms_per_job": cpu_ms,
        "ours_cpu_ms_per_job": cpu_ms,
        "cores": {"client": 0.1},
        "mean_batch_size": 4.0,
        "ours_cores": 1.0,
        "foreign_cores": 0.0,
    }


def test_summary_takes_each_repeats_best_level_and_pairs_the_systems_by_repeat() -> None:
    phases = [
        phase("celery", 0, kind="saturation", throughput=30.0, level=16, cpu_ms=30.0),
        phase("celery", 0, kind="saturation", throughput=28.0, level=32),
        phase("sluice", 0, kind="saturation", throughput=40.0, level=16),
        phase("sluice", 0, kind="saturation", throughput=60.0, level=32, cpu_ms=15.0),
        phase("sluice", 1, kind="saturation", throughput=45.0, level=32, cpu_ms=20.0),
        phase("celery", 1, kind="saturation", throughput=36.0, level=16, cpu_ms=30.0),
        phase("celery", 0, kind="latency", factor=0.8, p99=500.0),
        phase("sluice", 0, kind="latency", factor=0.8, p99=400.0),
        phase("celery", 1, kind="latency", factor=0.8, p99=300.0),
        phase("sluice", 1, kind="latency", factor=0.8, p99=350.0),
    ]
    summary = summarise(phases, [0.8])
    assert summary["saturation_ratio_sluice_over_celery"]["by_repeat"] == pytest.approx([2.0, 1.25])
    assert summary["cpu_bound_ratio_sluice_over_celery"]["by_repeat"] == pytest.approx([2.0, 1.5])
    assert summary["saturation"]["celery"]["median"] == pytest.approx(33.0)
    assert summary["saturation"]["sluice"]["by_level"][16]["median"] == pytest.approx(40.0)
    latency = summary["latency"]["0.8"]
    assert latency["sluice_p99_below_celery_by_repeat"] == [True, False]
    assert latency["celery"]["p99"] == {"median": 400.0, "min": 300.0, "max": 500.0, "n": 2}


def test_closed_loop_keeps_the_concurrency_and_sends_every_job_once() -> None:
    in_flight, most, seen = 0, 0, []

    async def send(i: int) -> dict[str, Any]:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        seen.append(i)
        await asyncio.sleep(0.001 * (i % 3))
        in_flight -= 1
        return {"status": "succeeded"}

    records = asyncio.run(closed_loop(50, 4, send))
    assert sorted(seen) == list(range(50)) and [r.index for r in records] == list(range(50))
    assert most == 4
    assert all(r.answered_at >= r.sent_at == r.scheduled_at for r in records)
