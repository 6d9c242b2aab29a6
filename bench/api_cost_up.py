"""`bench.api_cost --under-up`: what the API spends per request when it shares the machine with the
rest of `sluice up`, its worker busy with the jobs it accepts.

This mode starts the real platform (`bench.up_platform.running_up`: `sluice up --no-demo` on a
fresh home), makes a tenant of its own, and drives, from another process (`bench.rawhttp`),
single submits (`POST /v1/models/minilm/jobs`) and plain reads (`GET /v1/jobs/{id}` of jobs the
worker finished) at 32 and at 4 concurrent connections, interleaved, `--rounds` times. Each
figure is the API process's user + system CPU from /proc around one drive, divided by the
requests, as median (min-max) over rounds; the worker's CPU in the same window is shown to say
how busy it was. Every submit stays queued behind the ones before it, so the worker is busy
through the run. With several `--checkout`s, each tree gets fresh starts, alternating.

The surprise: on the same host in the same hour an API beside `sluice up` costs what a lone one
costs; what moves the figure is the rate each phase reaches (fewer connections, fewer requests a
second, more CPU each) and the machine's other load, so trees are compared within one run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench import pyspy, rawhttp
from bench.api_cost import (
    MODEL,
    Stack,
    _cell,
    measure,
    print_profile,
    read_requests,
    spread,
    submit_requests,
)
from bench.machine import CpuWindow, cpu_seconds, machine_info
from bench.output import command_line, table, write_json
from bench.processes import REPO, sigterm_as_interrupt
from bench.up_platform import RunningUp, running_up
from scheduler.planning.text_mix import skewed_texts

TARGETS = {"submit": "<= 1.0 ms", "read": "<= 0.5 ms"}


def without_shedding(up: RunningUp, model: str) -> None:
    """Lift `model`'s latency budget past any backlog the run makes, and tell the API at once.

    Closed-loop clients submit faster than one CPU worker serves, so the API would soon answer
    429 (a shed costs less than an accepted job: the figures would flatter it). The registry is
    the embedded Postgres the API was started with (its environment in /proc)."""
    import asyncio

    import sqlalchemy as sa

    from sluice.wire import events
    from sluice.wire.connections import connect

    environ = dict(line.split("=", 1) for line in
                   Path(f"/proc/{up.api_pid}/environ").read_text().split("\0") if "=" in line)
    url = environ["SLUICE_DATABASE_URL"]
    engine = sa.create_engine(url if "+" in url.split("://")[0] else url.replace("://", "+psycopg://", 1))
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE model_versions SET latency_budget_ms = 1e12 WHERE model = :model"),
                         {"model": model})
    finally:
        engine.dispose()

    async def announce() -> None:
        client = connect(up.redis_url)
        try:
            await events.announce_routing(client, model)
        finally:
            await client.aclose()

    asyncio.run(announce())


def _cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += cpu_seconds(pid)
        except (OSError, IndexError, ValueError):
            continue
    return total


class UpPhases:
    """The measured drives against one running `sluice up`."""

    def __init__(self, *, up: RunningUp, executor: ProcessPoolExecutor) -> None:
        self.up = up
        self.executor = executor
        self.stack = Stack(api_pid=up.api_pid, redis_pid=up.redis_pid, port=up.port, key=up.key,
                           redis_url=up.redis_url)
        self.finished: list[str] = []

    def warm(self, pool: int) -> None:
        """Submit `pool` jobs and long-poll each until the worker has finished it: the reads'
        jobs, and the submit and read paths' warm-up."""
        ids = self._submit(pool, seed=10_000, concurrency=32, keep=True)
        waited = self.executor.submit(rawhttp.drive, self.up.port, read_requests(self.up.key, ids, wait=True), 32,
                                      True).result()
        states = {json.loads(body)["status"] for body in waited.bodies}
        if states != {"succeeded"}:
            raise RuntimeError(f"the warm-up jobs ended {states}, not all succeeded")
        self.finished = ids

    def _submit(self, n: int, *, seed: int, concurrency: int, keep: bool = False) -> list[str]:
        driven = self.executor.submit(rawhttp.drive, self.up.port,
                                      submit_requests(self.up.key, skewed_texts(n, seed=seed)), concurrency,
                                      keep).result()
        return [json.loads(body)["id"] for body in driven.bodies]

    def run(self, phase: str, *, n: int, concurrency: int, seed: int) -> dict[str, Any]:
        if phase == "submit":
            requests = submit_requests(self.up.key, skewed_texts(n, seed=seed))
        else:
            requests = read_requests(self.up.key, random.Random(seed).choices(self.finished, k=n), wait=False)
        workers = self.up.worker_pids()
        workers0 = _cpu_of(workers)
        future = self.executor.submit(rawhttp.drive, self.up.port, requests, concurrency)
        result, driven = measure(self.stack, phase, future, jobs_per_request=1, concurrency=concurrency)
        result["worker_cores"] = (_cpu_of(workers) - workers0) / driven.wall_s
        result["phase"] = f"{phase}@{concurrency}"
        return result


def measure_one_up(args: argparse.Namespace, checkout: Path, label: str) -> tuple[list[dict[str, Any]], float,
                                                                             dict[str, list[list[Any]]]]:
    """One `sluice up` from `checkout`: the rounds of measured phases (then, with --profile, one
    profiled submit and read phase); answers the runs, the API's idle CPU (ms a second) and the profiles."""
    phases_ = [(phase, c) for c in args.up_concurrency for phase in ("submit", "read")]
    runs: list[dict[str, Any]] = []
    profiles: dict[str, list[list[Any]]] = {}
    with (
        running_up(checkout=checkout) as up,
        ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as executor,
    ):
        without_shedding(up, MODEL)
        phases = UpPhases(up=up, executor=executor)
        phases.warm(args.up_pool)
        idle = CpuWindow()
        api0 = cpu_seconds(up.api_pid)
        time.sleep(2)
        idle_api_ms_per_s = (cpu_seconds(up.api_pid) - api0) * 1000 / idle.stop().elapsed
        for round_ in range(args.rounds):
            for index, (phase, concurrency) in enumerate(phases_):
                result = phases.run(phase, n=args.up_requests, concurrency=concurrency,
                                    seed=args.seed + 100 * round_ + index)
                result.update(round=round_ + 1, checkout=label)
                runs.append(result)
                print(f"{label} round {round_ + 1} {result['phase']:<10} API {result['api_ms_per_request']:.3f} "
                      f"ms/request CPU ({result['api_system_share']:.0%} in the kernel), Redis "
                      f"{result['redis_ms_per_request']:.3f}, {result['requests_per_s_wall']:.0f}/s wall, "
                      f"worker {result['worker_cores']:.2f} cores", flush=True)
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
            for phase in ("submit", "read"):
                path = args.profile / f"api_cost_up-{label}-{phase}.txt"
                with pyspy.recording(up.api_pid, path, extra=("--native",) if args.profile_native else ()):
                    phases.run(phase, n=args.up_requests, concurrency=args.up_concurrency[0], seed=args.seed + 7)
                profile = pyspy.summarise(path)
                print_profile(f"{phase} ({label})", profile)
                profiles[f"{label} {phase}"] = [[key, inclusive, self_] for key, inclusive, self_ in profile.top(60)]
    return runs, idle_api_ms_per_s, profiles


def run_under_up(args: argparse.Namespace) -> None:
    checkouts = [path.resolve() for path in args.checkout] or [REPO]
    labels = [path.name or str(path) for path in checkouts]
    if len(set(labels)) < len(labels):
        labels = [str(path) for path in checkouts]
    runs: list[dict[str, Any]] = []
    idle: dict[str, list[float]] = {}
    profiles: dict[str, list[list[Any]]] = {}
    with sigterm_as_interrupt():
        for repeat in range(args.up_repeats):
            # Alternating, so that a change in the machine's other load falls on every checkout.
            order = list(zip(checkouts, labels, strict=True))
            for checkout, label in order if repeat % 2 == 0 else order[::-1]:
                measured, idle_ms, profiled = measure_one_up(args, checkout, label)
                runs += measured
                idle.setdefault(label, []).append(idle_ms)
                profiles.update(profiled)

    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for label in labels:
        for name in dict.fromkeys(run["phase"] for run in runs):
            mine = [run for run in runs if run["phase"] == name and run["checkout"] == label]
            summary.setdefault(label, {})[name] = {
                field: spread([run[field] for run in mine])
                for field in ("api_ms_per_request", "api_system_share", "redis_ms_per_request", "requests_per_s_wall",
                              "worker_cores", "other_load_cores")
            }
            summary[label][name]["rounds"] = len(mine)
    host = machine_info()
    print()
    print(f"API process CPU per request under sluice up, median (min-max) over {args.rounds} rounds x "
          f"{args.up_repeats} starts of {args.up_requests} requests; host: {host['cpu']}, {host['cores']} cores")
    rows = []
    for label, phases in summary.items():
        for name, s in phases.items():
            first = summary[labels[0]][name]["api_ms_per_request"]["median"]
            ratio = f"{s['api_ms_per_request']['median'] / first:.2f}" if label != labels[0] else ""
            rows.append([label, name, _cell(s["api_ms_per_request"]), ratio, _cell(s["api_system_share"], 2),
                         _cell(s["redis_ms_per_request"]), _cell(s["requests_per_s_wall"], 0),
                         _cell(s["worker_cores"], 2), TARGETS[name.split("@")[0]]])
    print(table(["checkout", "phase@connections", "API CPU ms", f"x {labels[0]}", "of it in the kernel",
                 "Redis CPU ms", "requests/s (wall)", "worker, cores", "target"], rows))
    for label in labels:
        print(f"API process idle ({label}): {statistics.median(idle[label]):.1f} ms CPU per second (included above)")
    path = write_json("api_cost_up.json", {
        "command": command_line("bench.api_cost"),
        "machine": host,
        "checkouts": {label: str(path) for label, path in zip(labels, checkouts, strict=True)},
        "rounds": args.rounds,
        "starts_per_checkout": args.up_repeats,
        "requests_per_phase": args.up_requests,
        "concurrency": args.up_concurrency,
        "model": MODEL,
        "targets": TARGETS,
        "cpu": "user + system from /proc/<pid>/stat (10 ms ticks), API process",
        "summary": summary,
        "idle_api_ms_per_s": idle,
        "runs": runs,
        "profiles": profiles,
    })
    print(f"written: {path}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--under-up", action="store_true",
                        help="measure single submits and reads against a real `sluice up` (workers busy)")
    parser.add_argument("--up-requests", type=int, default=1000, help="with --under-up: requests per phase")
    parser.add_argument("--up-concurrency", type=int, nargs="+", default=[32, 4],
                        help="with --under-up: connections, one submit and one read phase each")
    parser.add_argument("--up-pool", type=int, default=300, help="with --under-up: finished jobs the reads choose from")
    parser.add_argument("--checkout", type=Path, action="append", default=[],
                        help="with --under-up: run `sluice up` from this tree (repeat to compare trees, each "
                             "against the first; default this one)")
    parser.add_argument("--up-repeats", type=int, default=1,
                        help="with --under-up: fresh `sluice up` starts per checkout, alternating between them")

