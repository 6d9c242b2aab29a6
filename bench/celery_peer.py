"""Sluice against the queue a team would otherwise write, in one run: single-job clients, each
submitting ONE job and waiting for ITS result.

* **Celery** (`bench.celery_baseline`): one task per request, `--pool prefork --concurrency 2`,
  each child with the platform's own MiniLM handler and one torch thread.
* **Sluice**: the platform as a user runs it (`bench.platform_harness.BenchPlatform`: `sluice api` and 2
  `sluice worker` processes x 1 thread for `minilm` v1, batches of up to 32 after 10 ms).

Both run side by side on one private redis-server (Sluice on DB 0, Celery's broker and result
backend on DB 1) and are measured one at a time, the order alternating between repeats, each
phase after waiting up to `--quiet-wait` s for an idle machine. Every phase runs its client in a
fresh process (`bench.peer_client`) over the same texts (the skewed mix) and, for the latency
phases, the same Poisson timetable.

1. **Saturation**, per repeat and system: closed loops of `--levels` concurrent clients (each
   sends its next job once the last one's result is in), `--sat-jobs` jobs each. Throughput is
   completions/s over the middle 80 % of completions (the ramp-up and the drain left out); the
   saturation of a repeat is the highest over the levels, and the per-level figures show whether
   it plateaued.
2. **Latency**: open loops at `--load-factors` x CELERY's saturation (median over repeats, or
   `--celery-rate`), `--load-jobs` requests each; latency from the scheduled send time to the
   client seeing the final result (exact percentiles, type 7; no p99 under 300 samples).
3. **CPU per job** of each process group over each phase's window (/proc utime + stime): the API,
   the Sluice workers, the Celery workers (parent and children), the redis-server, the client.

Run: ``python -m bench.celery_peer [--repeats 2]``; ``--quick`` for a smoke check (~1 min).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.celery_app import URL_ENV, wait_children
from bench.celery_baseline import ARTIFACT_ENV, SHA256_ENV
from bench.machine import CpuWindow, cpu_seconds, machine_info, wait_quiet
from bench.output import PERCENTILE_METHOD, command_line, write_json
from bench.peer_client import COLUMNS
from bench.peer_report import SYSTEMS, phase_report, print_summary, progress_line, summarise
from bench.platform_harness import BenchPlatform
from bench.processes import REPO, descendants, private_redis, sigterm_as_interrupt, stop_processes
from scheduler.planning.text_mix import SKEWED

MODEL, VERSION = "minilm", "v1"  # the seeded demo version: max_batch_size 32, max_wait_ms 10
SLUICE_WORKERS = CELERY_CHILDREN = 2  # x 1 torch thread each
SLUICE_DB, CELERY_DB = 0, 1
FULL = {
    "repeats": 2,
    "levels": "16,32,64",
    "sat_jobs": 600,
    "load_factors": "0.5,0.8",
    "load_jobs": 600,
    "quiet_wait": 10.0,
    "output": "celery_peer.json",
}
QUICK = {
    "repeats": 1,
    "levels": "16",
    "sat_jobs": 150,
    "load_factors": "0.8",
    "load_jobs": 300,
    "quiet_wait": 0.0,
    "output": "celery_peer_quick.json",
}
JOB_TIMEOUT_S = 120.0


# --- the two systems, up side by side -------------------------------------------------------------


@dataclass
class Stack:
    platform: BenchPlatform
    celery: subprocess.Popen[bytes]
    celery_url: str
    redis_pid: int

    def groups(self) -> dict[str, list[int]]:
        workers = [p.pid for procs in self.platform.workers.values() for p in procs]
        api = self.platform.api.pid if self.platform.api else 0
        return {
            "sluice api": [api, *descendants(api)],
            "sluice workers": [pid for w in workers for pid in (w, *descendants(w))],
            "celery workers": [self.celery.pid, *descendants(self.celery.pid)],
            "redis-server": [self.redis_pid],
        }

    def check_alive(self) -> None:
        self.platform.check_alive()
        if self.celery.poll() is not None:
            raise RuntimeError(
                f"the Celery worker exited with {self.celery.returncode}; see {self.platform.home / 'logs'}"
            )


def celery_worker(
    home: Path, url: str, *, app: str = "bench.celery_baseline", env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """2 prefork children x 1 torch thread of the Celery app module `app`, on the broker `url`.
    Gossip, mingle and heartbeats are off, as is usual for a Redis broker: they are cluster
    chatter, not work."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    env[URL_ENV] = url
    name = app.rsplit(".", 1)[-1]
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / f"{name}.log").open("ab") as sink:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                app,
                "worker",
                "--pool",
                "prefork",
                "--concurrency",
                str(CELERY_CHILDREN),
                "--loglevel",
                "WARNING",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--hostname",
                f"{name}{os.getpid()}@localhost",
            ],
            env=env,
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def version_artifact(database_url: str, version: str) -> tuple[str, str]:
    from sluice.registry import catalog
    from sluice.registry.store import Registry

    registry = Registry(url=database_url, pool_size=1)
    try:
        with registry.session() as session:
            row = catalog.get_version(session, MODEL, version)
            return row.artifact, row.sha256
    finally:
        registry.dispose()


@contextlib.contextmanager
def both_systems(pg_url: str, *, artifact: str | None = None, max_wait_ms: float | None = None) -> Iterator[Stack]:
    """Sluice and the Celery peer with its handler, ready and warm; both run `artifact` (by default
    the one the seed registers for the version), Sluice's version with `max_wait_ms` if given."""
    import redis

    from bench.platform import warm

    with (
        private_redis() as (redis_base, _),
        BenchPlatform(
            pg_admin_url=pg_url,
            redis_base=redis_base,
            redis_db=SLUICE_DB,
            seeded_artifacts={f"{MODEL}/{VERSION}": artifact} if artifact else {},
            seeded_max_wait_ms={f"{MODEL}/{VERSION}": max_wait_ms} if max_wait_ms is not None else {},
        ) as platform,
    ):
        client = redis.Redis.from_url(redis_base)
        redis_pid = int(client.info("server")["process_id"])
        client.close()
        celery_url = f"{redis_base}/{CELERY_DB}"
        # The same model as the Sluice version, whatever the seed registers for it.
        artifact, sha256 = version_artifact(platform.database_url, VERSION)
        stack = Stack(
            platform=platform,
            celery=celery_worker(platform.home, celery_url, env={ARTIFACT_ENV: artifact, SHA256_ENV: sha256}),
            celery_url=celery_url,
            redis_pid=redis_pid,
        )
        try:
            platform.start_workers(MODEL, VERSION, SLUICE_WORKERS, threads=1)
            platform.wait_ready(MODEL, VERSION, SLUICE_WORKERS)
            warm(platform, VERSION)
            wait_children(celery_url, CELERY_CHILDREN, stack.check_alive)
            yield stack
        finally:
            stop_processes([stack.celery])


# --- one phase: a client process, the CPU of every group over its window ---------------------------


def _cpu(groups: dict[str, list[int]]) -> dict[str, float]:
    return {
        name: sum(s for s in (cpu_seconds(pid) for pid in pids) if not math.isnan(s)) for name, pids in groups.items()
    }


def run_phase(stack: Stack, spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Start the client, let it warm up, then measure from `go` to `done`."""
    output = workdir / f"phase-{os.urandom(4).hex()}.json"
    spec = {
        **spec,
        "output": str(output),
        "timeout_s": JOB_TIMEOUT_S,
        "model": MODEL,
        "api_url": stack.platform.api_url,
        "api_key": stack.platform.demo_key,
    }
    env = dict(os.environ, **{URL_ENV: stack.celery_url})
    with (workdir / "clients.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.peer_client", json.dumps(spec)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
        )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {spec['system']} client did not start; see {workdir / 'clients.log'}")
        stack.check_alive()
        groups = {**stack.groups(), "client": [proc.pid]}
        before, window, bench0 = _cpu(groups), CpuWindow(), time.process_time()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        if proc.stdout.readline().strip() != "done":
            raise RuntimeError(f"the {spec['system']} client failed; see {workdir / 'clients.log'}")
        window.stop()
        spent = {name: after - before[name] for name, after in _cpu(groups).items()}
        spent["bench (orchestrator)"] = time.process_time() - bench0
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    data = json.loads(output.read_text())
    output.unlink()
    records = [dict(zip(COLUMNS, row, strict=True)) for row in data["rows"]]
    result = phase_report(
        records,
        mode=spec["mode"],
        system=spec["system"],
        spent=spent,
        window_s=window.elapsed,
        foreign_cores=window.foreign_cores(sum(spent.values())),
    )
    result["client_self_cpu_s"] = data["process_cpu_s"]
    result["spec"] = {k: spec[k] for k in ("system", "mode", "n", "seed", "concurrency", "rate") if k in spec}
    return result


# --- the run ---------------------------------------------------------------------------------------


def measure(stack: Stack, args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    """Saturation phases for every repeat, then the latency phases at rates set by Celery's
    median saturation; both systems in each repeat, the order alternating."""
    workdir = stack.platform.home / "logs"
    phases: list[dict[str, Any]] = []

    def one(what: str, spec: dict[str, Any], **labels: Any) -> None:
        print(f"[repeat {labels['repeat'] + 1}] {spec['system']}: {what} ...", flush=True)
        busy = wait_quiet(args.quiet_wait) if args.quiet_wait > 0 else None
        phase = run_phase(stack, spec, workdir)
        phases.append({**phase, **labels, "busy_cores_before": busy})
        print(progress_line(phase), flush=True)

    for repeat in range(args.repeats):
        for system in SYSTEMS if repeat % 2 == 0 else SYSTEMS[::-1]:
            for level in args.levels:
                spec = {
                    "system": system,
                    "mode": "closed",
                    "n": args.sat_jobs,
                    "seed": args.seed + repeat,
                    "concurrency": level,
                    "pool": level,
                }
                one(f"closed loop, {level} clients, {args.sat_jobs} jobs", spec, kind="saturation", repeat=repeat)
    # The saturation the summary reports: the median over repeats of each repeat's best level.
    celery_sat = args.celery_rate or summarise(phases, [])["saturation"]["celery"]["median"]
    for repeat in range(args.repeats):
        for factor in args.load_factors:
            for system in SYSTEMS if repeat % 2 == 0 else SYSTEMS[::-1]:
                rate = factor * celery_sat
                spec = {
                    "system": system,
                    "mode": "open",
                    "n": args.load_jobs,
                    "rate": rate,
                    "seed": args.seed + 100 + repeat,
                    "pool": args.client_pool,
                }
                one(
                    f"open loop at {rate:.1f} jobs/s ({factor:.0%} of Celery's saturation), {args.load_jobs} requests",
                    spec,
                    kind="latency",
                    repeat=repeat,
                    factor=factor,
                )
    return phases, celery_sat


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.celery_peer", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a smoke check (~1 min): the smaller defaults marked quick below"
    )
    parser.add_argument("--repeats", type=int, help="repeats of every phase, interleaved (2; quick 1)")
    parser.add_argument("--levels", help="concurrent clients of the saturation runs (16,32,64; quick 16)")
    parser.add_argument("--sat-jobs", type=int, help="jobs per saturation run (600; quick 150)")
    parser.add_argument("--load-factors", help="open-loop rates, fractions of Celery's saturation (0.5,0.8; quick 0.8)")
    parser.add_argument("--load-jobs", type=int, help="requests per open-loop run, >= 300 for a p99 (600; quick 300)")
    parser.add_argument(
        "--celery-rate",
        type=float,
        default=None,
        help="take this as Celery's saturation (jobs/s) for the open-loop rates, not the measured one",
    )
    parser.add_argument(
        "--client-pool",
        type=int,
        default=128,
        help="open loops: the AsyncClient's connections and the Celery client's threads (128)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quiet-wait",
        type=float,
        help="before each phase, wait up to this many s for the machine to be idle (10; quick 0)",
    )
    parser.add_argument(
        "--pg-url",
        default="postgresql://postgres@127.0.0.1:5432/test",
        help="a Postgres database on the server where a scratch database may be created",
    )
    parser.add_argument("--output", help="file under bench/results/ (celery_peer.json; quick celery_peer_quick.json)")
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.levels = [int(c) for c in str(args.levels).split(",")]
    args.load_factors = [float(f) for f in str(args.load_factors).split(",")]
    if args.repeats < 1 or min(args.levels) < 1:
        parser.error("--repeats and --levels must be >= 1")

    command = command_line("bench.celery_peer")
    info = machine_info()
    print(
        f"Sluice vs Celery, single-job clients: {info['cores']} cores ({info['cpu']}); mix {SKEWED.describe()}; "
        f"seed {args.seed}",
        flush=True,
    )
    with sigterm_as_interrupt(), both_systems(args.pg_url) as stack:
        phases, celery_sat = measure(stack, args)
    summary = summarise(phases, args.load_factors)
    print_summary(summary, args)
    path = write_json(
        args.output,
        {
            "bench": "celery_peer",
            "command": command,
            "machine": info,
            "params": {**vars(args), "mix": SKEWED.describe()},
            "percentile_method": PERCENTILE_METHOD,
            "celery_saturation_for_rates": celery_sat,
            "summary": summary,
            "phases": phases,
        },
    )
    print(f"reproduce: {command}\nresults: bench/results/{path.name}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted; everything started by the bench was stopped", file=sys.stderr)
        sys.exit(130)
