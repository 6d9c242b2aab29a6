"""What one API process spends per request: CPU ms of the API process, and of
Redis, per single submit, per job read (plain and `?wait=`) and per job through `jobs:bulk`.

One `sluice api` process (`python -m launch.cli api`, as `sluice api` starts it: uvicorn, the
settings from the environment), a redis-server of the bench's own (so its CPU is ours alone) and
a fresh registry database. The model is the seeded `minilm` (kind `embedding`), so the API
validates and costs text inputs as it does for the real one; no worker runs. Jobs to read are
made final by the bench itself, through the kernel's finish script (`StreamConsumer.finish`),
with an output the size of MiniLM's (384 float32 values as the worker writes them), so a read
returns what a user polling MiniLM gets. The tenant has limits no phase reaches, and the API's
no-worker breaker grace is set past the run, so every request is answered 202 or 200 (anything
else stops the bench).

The load comes from another process (`bench.rawhttp`, kept-alive connections, closed loop:
each connection sends its next request when the answer is in), so the client's CPU is not
counted. Texts follow the skewed mix (`scheduler.planning.text_mix.skewed_texts`). Phases, each measured from
/proc (user + system CPU of the API process, of redis-server, of the client) around one drive:

* `submit`: `POST /v1/models/minilm/jobs` with `{"input": {"text": ...}}`, online lane;
* `read`: `GET /v1/jobs/{id}` of a finished job;
* `read_wait`: `GET /v1/jobs/{id}?wait=30` of a finished job;
* `long_poll`: `GET /v1/jobs/{id}?wait=30` of each job the submit phase just queued, as a client
  submitting and polling does: 20 ms after the request left, the bench's stand-in worker (in the
  client process, `bench.job_progress.Progress`) claims the job (`running`, with its event) and
  20 ms later finishes it (with its event), through the scripts a worker runs. The API's cost
  includes reading both events off pub/sub and the reads each wake-up makes; Redis's includes
  the claim and finish scripts. The share of long-polls that really waited is reported;
* `bulk`: `POST /v1/models/minilm/jobs:bulk` with `--bulk-size` inputs (bulk lane);
* with `--paced-rate R`: `submit_paced` and `read_paced`, single submits and reads sent one at
  a time on one connection, R a second. The surprise: CPU per request depends on the rate. A
  process that sleeps between requests meets each one cold (caches, wake-ups), and on the shared
  2-core machine a read cost about 0.3 ms closed-loop but 0.7-1.2 ms at 30 a second, the rate
  of the platform's open-loop benches.

The phases run interleaved, `--rounds` times, after a warm-up; each figure is reported as the
median with the minimum and maximum over the rounds. CPU per request hardly moves with the
machine's other load; wall-clock rates do, and are shown only as context. `--profile DIR` then
runs each phase once more under py-spy (a separate run: sampling slows the process) and prints
where the API's time went.

`--under-up` measures single submits and reads against a real `sluice up` instead, its workers
busy with the jobs (`bench.api_cost_up`).

    python -m bench.api_cost --under-up [--rounds 3] [--up-requests 1000] [--up-concurrency 32 4] [--profile DIR]
                             [--checkout BEFORE --checkout AFTER --up-repeats 2]
    python -m bench.api_cost [--rounds 5] [--requests 3000] [--bulk-requests 40] [--paced-rate 30]
                             [--profile DIR [--profile-native]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import pyspy, rawhttp
from bench.durable_accept import database
from bench.job_progress import Progress, finish_jobs
from bench.machine import CpuWindow, cpu_seconds, machine_info
from bench.output import command_line, fmt, table, write_json
from bench.processes import private_redis, sigterm_as_interrupt, sluice_api
from scheduler.planning.text_mix import skewed_texts

MODEL, VERSION = "minilm", "v1"
TENANT = "bench"
# The submit phase's jobs are long-polled in the next phase, so both run as many requests.
PHASES = ("submit", "read", "read_wait", "long_poll", "bulk")
TARGETS = {
    "submit": "<= 1.0 ms",
    "read": "<= 0.5 ms",
    "read_wait": "<= 0.5 ms",
    "long_poll": "<= 0.5 ms",
    "bulk": ">= 20000 jobs/s",
    "submit_paced": "<= 1.0 ms",
    "read_paced": "<= 0.5 ms",
}
# With --paced-rate: a submit and a read phase on one connection at that many requests a second.
PACED = ("submit_paced", "read_paced")
# When the bench's stand-in worker claims a long-polled job, and finishes it, after the request left.
RUNNING_AFTER_S, FINAL_AFTER_S = 0.02, 0.04
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Stack:
    """The processes under measurement and how to reach them."""

    api_pid: int
    redis_pid: int
    port: int
    key: str
    redis_url: str


def api_process(*, redis_url: str, database_url: str, home: Path) -> AbstractContextManager[tuple[int, int]]:
    """`sluice api` on a free port: answers (pid, port) once /readyz says 200."""
    return sluice_api(log=home / "api.log", env={
        "SLUICE_REDIS_URL": redis_url, "SLUICE_DATABASE_URL": database_url, "SLUICE_HOME": str(home),
        # No worker runs: the breaker must not take the version out of service mid-run.
        "SLUICE_BREAKER_NO_WORKER_GRACE_S": "1e9",
    })


def bench_tenant(database_url: str, home: Path) -> str:
    """A seeded registry (minilm v1, kind embedding) and a tenant no phase can rate-limit; its key."""
    from launch.seed import seed
    from sluice.registry import tenants
    from sluice.registry.store import Registry

    registry = Registry(url=database_url, pool_size=1)
    try:
        seed(registry, home=home)
        with registry.session() as session:
            _, key = tenants.create_tenant(
                session, tenant_id=TENANT, actor="bench", rate_limit_per_s=1e6, max_queued=1_000_000_000
            )
        return key.secret
    finally:
        registry.dispose()


def redis_pid(redis_url: str) -> int:
    import redis

    with redis.Redis.from_url(redis_url) as client:
        return int(client.info("server")["process_id"])


# --- the phases ------------------------------------------------------------------------------------


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def submit_requests(key: str, texts: Sequence[str]) -> list[bytes]:
    body = [_json({"input": {"text": text}}) for text in texts]
    return [rawhttp.request("POST", f"/v1/models/{MODEL}/jobs", key=key, body=one) for one in body]


def read_requests(key: str, job_ids: Sequence[str], *, wait: bool) -> list[bytes]:
    query = "?wait=30" if wait else ""
    return [rawhttp.request("GET", f"/v1/jobs/{job_id}{query}", key=key) for job_id in job_ids]


def bulk_requests(key: str, texts: Sequence[str], size: int) -> list[bytes]:
    return [
        rawhttp.request(
            "POST",
            f"/v1/models/{MODEL}/jobs:bulk",
            key=key,
            body=_json({"inputs": [{"text": text} for text in texts[start : start + size]]}),
        )
        for start in range(0, len(texts) - size + 1, size)
    ]


def drive_long_polls(
    port: int, requests: Sequence[bytes], job_ids: Sequence[str], concurrency: int, *, redis_url: str, tenant: str
) -> rawhttp.Driven:
    """In the client process: each long-poll's job is claimed and finished while it waits."""

    async def main() -> rawhttp.Driven:
        progress = Progress(
            redis_url=redis_url,
            model=MODEL,
            version=VERSION,
            tenant=tenant,
            running_after_s=RUNNING_AFTER_S,
            final_after_s=FINAL_AFTER_S,
        )
        try:
            return await rawhttp.drive_async(
                port, requests, concurrency, on_send=lambda index: progress.schedule(job_ids[index])
            )
        finally:
            await progress.close()

    return asyncio.run(main())


EXPECTED_STATUS = {
    "submit": 202,
    "read": 200,
    "read_wait": 200,
    "long_poll": 200,
    "bulk": 202,
    "submit_paced": 202,
    "read_paced": 200,
}


@dataclass
class Phases:
    """Runs the phases against one stack; `pending` holds the last submit phase's jobs, which are
    still queued, for the next long-poll phase."""

    stack: Stack
    executor: ProcessPoolExecutor
    args: argparse.Namespace
    finished: Sequence[str] = ()
    pending: Sequence[str] = ()

    def run(self, phase: str, *, n: int, seed: int) -> dict[str, Any]:
        key, concurrency, per = self.stack.key, self.args.concurrency, 1
        if phase == "submit":
            future = self._drive(submit_requests(key, skewed_texts(n, seed=seed)), concurrency, keep_bodies=True)
        elif phase in PACED:
            concurrency, interval_s = 1, 1.0 / self.args.paced_rate
            requests = (
                submit_requests(key, skewed_texts(n, seed=seed))
                if phase == "submit_paced"
                else read_requests(key, random.Random(seed).choices(self.finished, k=n), wait=False)
            )
            future = self.executor.submit(rawhttp.drive, self.stack.port, requests, 1, False, interval_s)
        elif phase in ("read", "read_wait"):
            chosen = random.Random(seed).choices(self.finished, k=n)
            future = self._drive(read_requests(key, chosen, wait=phase == "read_wait"), concurrency)
        elif phase == "long_poll":
            waiting, self.pending = list(self.pending[:n]), self.pending[n:]
            future = self.executor.submit(
                drive_long_polls,
                self.stack.port,
                read_requests(key, waiting, wait=True),
                waiting,
                concurrency,
                redis_url=self.stack.redis_url,
                tenant=TENANT,
            )
        else:
            per, concurrency = self.args.bulk_size, self.args.bulk_concurrency
            texts = skewed_texts(max(1, n // per) * per, seed=seed)
            future = self._drive(bulk_requests(key, texts, per), concurrency)
        result, driven = measure(self.stack, phase, future, jobs_per_request=per, concurrency=concurrency)
        if phase == "submit":
            self.pending = [json.loads(body)["id"] for body in driven.bodies]
        if phase == "long_poll":
            # A long-poll that came back before its job was finished did not wait: say how many did.
            result["waited_share"] = sum(t >= 0.9 * FINAL_AFTER_S for t in driven.round_trips_s) / len(waiting)
        return result

    def _drive(self, requests: list[bytes], concurrency: int, keep_bodies: bool = False) -> Future[rawhttp.Driven]:
        return self.executor.submit(rawhttp.drive, self.stack.port, requests, concurrency, keep_bodies)


def measure(
    stack: Stack, phase: str, future: Future[rawhttp.Driven], *, jobs_per_request: int, concurrency: int
) -> tuple[dict[str, Any], rawhttp.Driven]:
    """The CPU the API and Redis spent while the client process drove one phase."""
    api0, redis0 = user_system(stack.api_pid), cpu_seconds(stack.redis_pid)
    window = CpuWindow()
    driven = future.result()
    api1, redis_s = user_system(stack.api_pid), cpu_seconds(stack.redis_pid) - redis0
    window.stop()
    api_s, api_system_s = sum(api1) - sum(api0), api1[1] - api0[1]
    unexpected = {status: count for status, count in driven.statuses.items() if status != EXPECTED_STATUS[phase]}
    if unexpected:
        raise RuntimeError(f"{phase}: answers other than {EXPECTED_STATUS[phase]}: {unexpected}")
    n = sum(driven.statuses.values())
    jobs = n * jobs_per_request
    return {
        "phase": phase,
        "requests": n,
        "jobs": jobs,
        "concurrency": concurrency,
        "wall_s": driven.wall_s,
        "api_cpu_s": api_s,
        "api_system_share": api_system_s / api_s if api_s > 0 else None,
        "redis_cpu_s": redis_s,
        "client_cpu_s": driven.client_cpu_s,
        "api_ms_per_request": api_s * 1000 / n,
        "redis_ms_per_request": redis_s * 1000 / n,
        "client_ms_per_request": driven.client_cpu_s * 1000 / n,
        "api_ms_per_job": api_s * 1000 / jobs,
        "redis_ms_per_job": redis_s * 1000 / jobs,
        "jobs_per_api_cpu_s": jobs / api_s if api_s > 0 else None,
        "requests_per_s_wall": n / driven.wall_s,
        "jobs_per_s_wall": jobs / driven.wall_s,
        "other_load_cores": window.foreign_cores(api_s + redis_s + driven.client_cpu_s),
    }, driven


def user_system(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICKS, int(fields[12]) / TICKS


# --- the report ------------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for phase in dict.fromkeys(run["phase"] for run in runs):
        mine = [run for run in runs if run["phase"] == phase]
        out[phase] = {
            name: spread([run[name] for run in mine])
            for name in (
                "api_ms_per_request",
                "redis_ms_per_request",
                "client_ms_per_request",
                "api_ms_per_job",
                "redis_ms_per_job",
                "api_system_share",
                "jobs_per_api_cpu_s",
                "requests_per_s_wall",
                "jobs_per_s_wall",
                "other_load_cores",
            )
        }
        if phase == "long_poll":
            out[phase]["waited_share"] = spread([run["waited_share"] for run in mine])
        out[phase]["rounds"] = len(mine)
    return out


def _cell(figure: dict[str, float], digits: int = 3) -> str:
    return f"{fmt(figure['median'], digits)} ({fmt(figure['min'], digits)}-{fmt(figure['max'], digits)})"


def print_report(summary: dict[str, dict[str, Any]], *, bulk_size: int) -> None:
    rows = []
    for phase, s in summary.items():
        rows.append(
            [
                phase if phase != "bulk" else f"bulk ({bulk_size}/request), per job",
                _cell(s["api_ms_per_job"]),
                _cell(s["api_system_share"], 2),
                _cell(s["redis_ms_per_job"]),
                _cell(s["jobs_per_api_cpu_s"], 0),
                _cell(s["jobs_per_s_wall"], 0),
                _cell(s["other_load_cores"], 2),
                TARGETS[phase],
            ]
        )
    print()
    print("CPU per job of one API process and of Redis, median (min-max) over rounds; wall-clock rates for context")
    print(
        table(
            [
                "phase",
                "API CPU ms",
                "of it in the kernel",
                "Redis CPU ms",
                "jobs per API CPU-s",
                "jobs/s (wall)",
                "other load, cores",
                "target",
            ],
            rows,
        )
    )
    print(f"long_poll: {_cell(summary['long_poll']['waited_share'], 2)} of the long-polls waited for their job")
    bulk = summary["bulk"]
    print(
        f"bulk per request: API {_cell(bulk['api_ms_per_request'], 2)} ms CPU, "
        f"Redis {_cell(bulk['redis_ms_per_request'], 2)} ms CPU"
    )


def print_profile(phase: str, profile: pyspy.Profile, n: int = 30) -> None:
    print(
        f"\npy-spy, API process, phase {phase}: {profile.samples} samples; share of samples on the stack / at the top"
    )
    print(
        table(
            ["function", "inclusive", "self"],
            [[key, f"{inclusive:.1%}", f"{self_:.1%}"] for key, inclusive, self_ in profile.top(n)],
            max_width=100,
        )
    )


# --- main ------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, stack: Stack, executor: ProcessPoolExecutor) -> dict[str, Any]:
    phases = Phases(stack=stack, executor=executor, args=args)
    sizes = {
        "submit": args.requests,
        "read": args.requests,
        "read_wait": args.requests,
        "long_poll": args.requests,
        "bulk": args.bulk_requests * args.bulk_size,
    }
    # The finished jobs the reads choose from; submitting them is the submit path's warm-up.
    phases.run("submit", n=args.pool, seed=10_000)
    finish_jobs(stack.redis_url, MODEL, VERSION, phases.pending)
    phases.finished, phases.pending = phases.pending, ()
    for phase in PHASES:
        phases.run(phase, n=4 * args.bulk_size if phase == "bulk" else 200, seed=1)
    idle = CpuWindow()
    api0 = cpu_seconds(stack.api_pid)
    time.sleep(3)
    idle_api_cores = (cpu_seconds(stack.api_pid) - api0) / idle.stop().elapsed

    sizes.update(dict.fromkeys(PACED, args.paced_requests))
    measured = PHASES + (PACED if args.paced_rate else ())
    runs = []
    for round_ in range(args.rounds):
        for phase in measured:
            result = phases.run(phase, n=sizes[phase], seed=args.seed + 100 * round_ + measured.index(phase))
            result["round"] = round_ + 1
            runs.append(result)
            waited = f", {result['waited_share']:.0%} waited" if "waited_share" in result else ""
            print(
                f"round {round_ + 1} {phase:<9} API {result['api_ms_per_job']:.3f} ms/job CPU "
                f"({result['api_system_share']:.0%} in the kernel), Redis {result['redis_ms_per_job']:.3f}, "
                f"{result['jobs_per_s_wall']:.0f} jobs/s wall, other load {result['other_load_cores']:.2f} cores"
                f"{waited}",
                flush=True,
            )

    profiles: dict[str, list[list[Any]]] = {}
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        for phase in PHASES:
            path = args.profile / f"api_cost-{phase}.txt"
            with pyspy.recording(stack.api_pid, path, extra=("--native",) if args.profile_native else ()):
                phases.run(phase, n=sizes[phase], seed=args.seed + 7)
            profile = pyspy.summarise(path)
            print_profile(phase, profile)
            profiles[phase] = [[key, inclusive, self_] for key, inclusive, self_ in profile.top(60)]
    return {"runs": runs, "idle_api_cores": idle_api_cores, "profiles": profiles}


def main() -> None:
    from bench import api_cost_up

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the phases")
    parser.add_argument("--requests", type=int, default=3000, help="requests per submit, read and long-poll phase")
    parser.add_argument("--bulk-requests", type=int, default=40, help="jobs:bulk requests per bulk phase")
    parser.add_argument("--bulk-size", type=int, default=500, help="inputs per jobs:bulk request")
    parser.add_argument("--concurrency", type=int, default=32, help="connections for single requests")
    parser.add_argument("--bulk-concurrency", type=int, default=4, help="connections for jobs:bulk")
    parser.add_argument("--pool", type=int, default=2000, help="finished jobs the reads choose from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="then run each phase under py-spy, writing collapsed stacks to this directory",
    )
    parser.add_argument("--profile-native", action="store_true", help="with --profile: native frames too")
    parser.add_argument(
        "--paced-rate",
        type=float,
        default=0.0,
        help="also measure single submits and reads sent one at a time at this rate (e.g. 30)",
    )
    parser.add_argument("--paced-requests", type=int, default=300, help="requests per paced phase")
    api_cost_up.add_arguments(parser)
    args = parser.parse_args()
    if args.under_up:
        api_cost_up.run_under_up(args)
        return

    with (
        sigterm_as_interrupt(),
        tempfile.TemporaryDirectory(prefix="sluice-bench-api-cost-") as tmp,
        private_redis() as (redis_base, _),
        database() as database_url,
    ):
        home = Path(tmp)
        redis_url = f"{redis_base}/0"
        key = bench_tenant(database_url, home)
        with (
            api_process(redis_url=redis_url, database_url=database_url, home=home) as (api_pid, port),
            ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as executor,
        ):
            stack = Stack(api_pid=api_pid, redis_pid=redis_pid(redis_url), port=port, key=key, redis_url=redis_url)
            measured = run(args, stack, executor)

    summary = summarise(measured["runs"])
    print_report(summary, bulk_size=args.bulk_size)
    print(f"API process idle: {measured['idle_api_cores'] * 1000:.1f} ms CPU per second (included above)")
    path = write_json(
        "api_cost.json",
        {
            "command": command_line("bench.api_cost"),
            "machine": machine_info(),
            "rounds": args.rounds,
            "requests_per_phase": args.requests,
            "bulk_requests": args.bulk_requests,
            "bulk_size": args.bulk_size,
            "concurrency": args.concurrency,
            "bulk_concurrency": args.bulk_concurrency,
            "targets": TARGETS,
            "cpu": "user + system from /proc/<pid>/stat (10 ms ticks), per process",
            "summary": summary,
            "idle_api_cores": measured["idle_api_cores"],
            "runs": measured["runs"],
            "profiles": measured["profiles"],
        },
    )
    print(f"written: {path}")


if __name__ == "__main__":
    main()
