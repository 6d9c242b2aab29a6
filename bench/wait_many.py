"""What waiting on many jobs costs: one long-poll per job against one long-poll
for all of them (`GET /v1/jobs?ids=…&wait=`), both through the project's `AsyncClient`.

`BenchPlatform` (fresh database, `sluice api`, one `sluice worker`) on a redis-server of the
bench's own, so no one else's job events reach the API's event hub. A synthetic model (no torch:
`--per-item-ms` of sleep per job, batches of 32) runs the jobs. Each wave submits `--jobs` jobs
in one `jobs:bulk` request and then waits for all of them:

* `per-job`: `AsyncClient.wait(id)` for every job at once, one long-poll each (the client's pool
  has a connection per job), as a client holding N jobs in flight did before;
* `one-poll`: `AsyncClient.as_completed(ids)` (the machinery of `wait_many`), one long-poll for
  all of them, re-issued with the ids still pending.

The waves alternate between the two, `--rounds` of each, after one warm-up wave of each. Over
the waiting window of a wave (from the bulk request's answer until the last job is in the
client's hands) the bench measures CPU: the API process and the worker (the run time of all
their threads, `/proc/<pid>/task/*/schedstat`), the client (this process, `time.process_time`)
and the Redis server (`INFO cpu`), each divided by the jobs of the wave; the API's requests per
job (its `/metrics`); and, in wall-clock, how long after a job's `finished_at` the client had it
(p50/p95 over every job of the mode; re-measure on a quiet machine). CPU figures hardly move with
the machine's other load; wall-clock ones do. The worker's CPU is the same work in both modes and
is shown only as a yardstick.

    python -m bench.wait_many [--jobs 256] [--rounds 5] [--per-item-ms 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.machine import CpuWindow, machine_info
from bench.output import PERCENTILE_METHOD, command_line, fmt, table, write_json
from bench.platform_harness import BenchPlatform
from bench.processes import sigterm_as_interrupt
from bench.rollback import private_redis
from sluice.stats import percentiles
from sluice_client import AsyncClient

MODEL = "waitmany-bench"
MODES = ("per-job", "one-poll")
SYNTHETIC_SHA = "0" * 64
WAIT_ROUTES = ("/v1/jobs", "/v1/jobs/{job_id}")
PARTS = ("api", "worker", "client", "redis")


def run_ns(pid: int) -> int:
    """CPU time of every live thread of a process, in ns (`stat`'s ticks are 10 ms: too coarse
    for a wave that costs the API a few ms)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # the thread left meanwhile
    return total


def redis_cpu_s(redis: Any) -> float:
    info = redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def get_requests(api_url: str) -> dict[str, float]:
    """GET requests answered 200 per waiting route, from the API's own metrics."""
    counts = dict.fromkeys(WAIT_ROUTES, 0.0)
    for line in httpx.get(f"{api_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("sluice_api_requests_total{") and 'method="GET"' in line and 'status="200"' in line:
            route = line.split('route="', 1)[1].split('"', 1)[0]
            if route in counts:
                counts[route] = float(line.rsplit(" ", 1)[1])
    return counts


def api_ready(platform: BenchPlatform, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        platform.check_alive()
        try:
            if httpx.get(f"{platform.api_url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the API was not ready in {timeout_s}s; see {platform.home / 'logs'}")
        time.sleep(0.2)


def register_model(platform: BenchPlatform, *, per_item_ms: float) -> None:
    api_ready(platform)
    admin_key = (platform.home / "admin.key").read_text().strip()
    cost = f"fixed_s=0.002&per_item_s={per_item_ms / 1000}&per_token_s=0"
    with httpx.Client(base_url=platform.api_url, headers={"Authorization": f"Bearer {admin_key}"}) as admin:
        for method, path, body in (
            ("POST", "/v1/models", {"name": MODEL, "kind": "synthetic"}),
            (
                "POST",
                f"/v1/models/{MODEL}/versions",
                {
                    "version": "v1",
                    "artifact": f"synthetic:?{cost}",
                    "sha256": SYNTHETIC_SHA,
                    "state": "stable",
                    "batching": {"max_batch_size": 32, "max_wait_ms": 10},
                },
            ),
            ("PUT", f"/v1/models/{MODEL}/routing", {"weights": {"v1": 100.0}, "reason": "bench"}),
        ):
            response = admin.request(method, path, json=body)
            response.raise_for_status()


def _finished_at(job: dict[str, Any]) -> float:
    return datetime.fromisoformat(job["timings"]["finished_at"]).timestamp()


class Meter:
    """CPU of each part, and the API's waiting requests, over one waiting window."""

    def __init__(self, platform: BenchPlatform, redis: Any) -> None:
        self.platform = platform
        self.redis = redis
        self.pids = {
            "api": platform.pids()["api"],
            "worker": next(pid for name, pid in platform.pids().items() if name.startswith("worker")),
        }
        self.used: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        return {
            "api": run_ns(self.pids["api"]) / 1e9,
            "worker": run_ns(self.pids["worker"]) / 1e9,
            "client": time.process_time_ns() / 1e9,
            "redis": redis_cpu_s(self.redis),
            **get_requests(self.platform.api_url),
        }

    def start(self) -> None:
        self.before = self._read()
        self.window = CpuWindow()

    def stop(self) -> None:
        self.window.stop()
        after = self._read()
        self.used = {name: after[name] - self.before[name] for name in after}
        self.used["other_cores"] = self.window.foreign_cores(sum(self.used[p] for p in PARTS))


async def wave(client: AsyncClient, mode: str, n: int, meter: Meter) -> tuple[list[float], float]:
    """Submit n jobs, then wait for all of them inside the meter's window; answer each job's
    delay (ms from its `finished_at` until the client had it) and the seconds the waiting took."""
    ids = await client.submit_bulk(MODEL, [{"text": f"job {i}"} for i in range(n)])
    delays: list[float] = []

    def got(job: dict[str, Any]) -> None:
        assert job["status"] == "succeeded", job
        delays.append((time.time() - _finished_at(job)) * 1000)

    async def one(job_id: str) -> None:
        got(await client.wait(job_id, timeout_s=120))

    meter.start()
    started = time.perf_counter()
    if mode == "per-job":
        await asyncio.gather(*(one(job_id) for job_id in ids))
    else:
        async for job in client.as_completed(ids, timeout_s=120):
            got(job)
    wall_s = time.perf_counter() - started
    meter.stop()
    return delays, wall_s


def measure(platform: BenchPlatform, redis: Any, mode: str, n: int) -> dict[str, Any]:
    meter = Meter(platform, redis)

    async def run() -> tuple[list[float], float]:
        async with AsyncClient(base_url=platform.api_url, api_key=platform.demo_key, max_connections=n) as client:
            # n connections opened before the window (reads of one finished job), so both modes
            # start from a warm pool and the worker is idle.
            [done] = await client.submit_bulk(MODEL, [{"text": "warm"}])
            await client.wait(done)
            await asyncio.gather(*(client.job(done) for _ in range(n)))
            await asyncio.sleep(0.5)
            return await wave(client, mode, n, meter)

    delays, wall_s = asyncio.run(run())
    return {
        "mode": mode,
        "jobs": n,
        "wall_s": wall_s,
        "delays_ms": delays,
        "cpu_ms_per_job": {part: meter.used[part] * 1000 / n for part in PARTS},
        "other_cores": meter.used["other_cores"],
        "requests_per_job": sum(meter.used[route] for route in WAIT_ROUTES) / n,
    }


def summarise(waves: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"waves": len(waves)}
    for part in PARTS:
        values = [w["cpu_ms_per_job"][part] for w in waves]
        out[f"{part}_cpu_ms_per_job"] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    out["requests_per_job"] = statistics.median(w["requests_per_job"] for w in waves)
    out["delay_ms"] = percentiles([d for w in waves for d in w["delays_ms"]], (50, 95))
    out["wall_s"] = statistics.median(w["wall_s"] for w in waves)
    out["other_cores"] = [round(w["other_cores"], 2) for w in waves]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=256, help="jobs per wave (<= 256: one request names all)")
    parser.add_argument("--rounds", type=int, default=5, help="measured waves per mode, interleaved")
    parser.add_argument("--per-item-ms", type=float, default=4.0, help="the synthetic model's cost per job")
    args = parser.parse_args()

    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with (
        sigterm_as_interrupt(),
        private_redis() as (redis_base, redis_db),
        BenchPlatform(redis_base=redis_base, redis_db=redis_db) as platform,
    ):
        register_model(platform, per_item_ms=args.per_item_ms)
        platform.start_workers(MODEL, "v1", 1)
        platform.wait_ready(MODEL, "v1", 1)
        redis = platform.redis()
        try:
            for mode in MODES:
                measure(platform, redis, mode, args.jobs)  # warm-up, not counted
            for round_ in range(args.rounds):
                for mode in MODES:
                    result = measure(platform, redis, mode, args.jobs)
                    results[mode].append(result)
                    cpu = result["cpu_ms_per_job"]
                    print(
                        f"round {round_ + 1} {mode:<8} API {cpu['api']:.3f} ms/job, client {cpu['client']:.3f}, "
                        f"requests/job {result['requests_per_job']:.3f}, other load {result['other_cores']:.2f} "
                        "cores",
                        flush=True,
                    )
        finally:
            redis.close()

    summary = {mode: summarise(results[mode]) for mode in MODES}
    rows = []
    for mode in MODES:
        s = summary[mode]
        rows.append(
            [
                mode,
                fmt(s["requests_per_job"], 3),
                *(
                    f"{fmt(s[f'{p}_cpu_ms_per_job']['median'], 3)} ({fmt(s[f'{p}_cpu_ms_per_job']['min'], 3)}-"
                    f"{fmt(s[f'{p}_cpu_ms_per_job']['max'], 3)})"
                    for p in ("api", "client", "redis", "worker")
                ),
                fmt(s["delay_ms"]["p50"], 1),
                fmt(s["delay_ms"]["p95"], 1),
                fmt(s["wall_s"], 2),
            ]
        )
    print()
    print(f"waiting on {args.jobs} jobs in flight, {args.rounds} waves per mode; CPU ms per job: median (min-max)")
    print(
        table(
            [
                "mode",
                "requests/job",
                "API CPU",
                "client CPU",
                "Redis CPU",
                "worker CPU",
                "delay p50 ms",
                "delay p95 ms",
                "wave s",
            ],
            rows,
        )
    )
    ratios = {
        part: summary["per-job"][f"{part}_cpu_ms_per_job"]["median"]
        / max(summary["one-poll"][f"{part}_cpu_ms_per_job"]["median"], 1e-9)
        for part in ("api", "client")
    }
    print("per-job / one-poll, CPU per job: " + ", ".join(f"{p} {r:.1f}x" for p, r in ratios.items()))
    print(f"delays are wall-clock ({PERCENTILE_METHOD}); re-measure them on a quiet machine")
    path = write_json(
        "wait_many.json",
        {
            "command": command_line("bench.wait_many"),
            "machine": machine_info(),
            "jobs_per_wave": args.jobs,
            "rounds": args.rounds,
            "per_item_ms": args.per_item_ms,
            "summary": summary,
            "ratio_per_job_over_one_poll": ratios,
            "waves": {
                mode: [{k: v for k, v in w.items() if k != "delays_ms"} for w in results[mode]] for mode in MODES
            },
        },
    )
    print(f"written: {path}")


if __name__ == "__main__":
    main()
