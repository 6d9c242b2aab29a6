"""The worker's CPU per job, split into the model's forward pass and everything else.

A real `workers.worker.Worker` with the real MiniLM embedding handler (1 torch thread) runs in a
process of its own (this module with `--serve`, on the event loop `sluice worker` uses), on a
redis-server of the bench's own. This process queues jobs straight into Redis as the API does
(record, then stream entry) and never runs the model, so the worker process's CPU is the
worker's alone.

The worker process adds up the thread CPU time spent inside `handler.run` ("forward": tokenizing,
the model, the vectors turned into lists; torch runs on the calling thread with 1 thread) and,
on SIGUSR1, writes its process CPU time, that sum and its Redis round trips to a file. "Outside"
is the rest of the process's CPU over the same window: reading, decoding, claiming, batching,
storing results, samples, events, acks, heartbeat, refresh and the event loop itself.

Two traffic patterns, interleaved `--repeats` times:

* `single`: `--single-jobs` jobs queued one at a time on a Poisson timetable at `--rate` jobs/s,
  so batches are small and the cost around each batch is shared by few jobs;
* `backlog`: `--backlog-jobs` jobs queued at once (one pipeline), so batches are full.

Texts are the skewed mix (`scheduler.planning.text_mix.skewed_texts`, a new seed per run). Every figure is CPU
time, except the wall-clock throughput, which moves with the machine's other load.
Run: ``python -m bench.worker_cost [--repeats 3] [--rate 20] [--profile DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.load import poisson_timetable
from bench.machine import CpuWindow, machine_info
from bench.output import command_line, fmt, table, write_json
from bench.processes import sigterm_as_interrupt, stop_processes
from launch.frontier_run import PassThroughHandler
from scheduler.planning.text_mix import skewed_texts

MODEL, VERSION = "minilm", "v1"
PATTERNS = ("single", "backlog")


# --- the worker process --------------------------------------------------------------------------


class TimedHandler(PassThroughHandler):
    """A handler that adds up the thread CPU time of its inner handler's `run`."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.cpu_s = 0.0
        self.calls = 0
        self.items = 0

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        started = time.thread_time()
        try:
            return self.inner.run(inputs)  # type: ignore[no-any-return]
        finally:
            self.cpu_s += time.thread_time() - started
            self.calls += 1
            self.items += len(inputs)


def counting_redis(url: str) -> tuple[Any, list[int]]:
    """The worker's client (`sluice.wire.connections.connect`'s pool settings) on connections that
    count what they send: one send is one round trip (a pipeline is one send)."""
    import redis.asyncio as aioredis

    sent = [0]

    class CountingConnection(aioredis.Connection):
        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            sent[0] += 1
            await super().send_packed_command(command, check_health)

    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=8,
        timeout=5.0,
        socket_timeout=5.0,
        socket_connect_timeout=2.0,
        health_check_interval=15,
        retry_on_timeout=False,
        connection_class=CountingConnection,
    )
    return aioredis.Redis.from_pool(pool), sent


async def serve(args: argparse.Namespace) -> None:
    from bench.inprocess import configure_torch

    configure_torch(1)
    from sluice.artifacts import MINILM_URI, artifact_sha256, resolve_artifact
    from sluice.settings import Settings
    from workers.models.loading import load_handler
    from workers.worker import Worker

    handler = TimedHandler(
        load_handler(
            kind="embedding",
            artifact=f"{MINILM_URI}?precision={args.precision}",
            sha256=artifact_sha256(resolve_artifact(MINILM_URI)),
            device="cpu",
            threads=1,
        )
    )
    handler.warmup()
    settings = Settings()
    redis, sent = counting_redis(args.redis_url)
    worker = Worker(
        redis=redis,
        model=MODEL,
        version=VERSION,
        handler=handler,
        max_batch_size=args.max_batch_size,
        max_wait_ms=args.max_wait_ms,
        result_ttl_s=settings.result_ttl_s,
        claim_after_s=settings.claim_after_s,
        max_deliveries=settings.max_deliveries,
        prefetch_batches=settings.worker_prefetch_batches,
    )
    snapshot_path = Path(args.snapshot)

    def snapshot() -> None:
        data = {
            "cpu_s": time.process_time(),
            "system_cpu_s": os.times().system,
            "forward_cpu_s": handler.cpu_s,
            "batches": handler.calls,
            "items": handler.items,
            "round_trips": sent[0],
            "processed": worker.processed,
        }
        partial = snapshot_path.with_suffix(".tmp")
        partial.write_text(json.dumps(data))
        partial.replace(snapshot_path)

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, snapshot)
    loop.add_signal_handler(signal.SIGTERM, worker.request_stop)

    # Ready: jobs queued from now on are read once the group exists (it is created at id 0).
    snapshot()
    try:
        await worker.run()
    finally:
        await redis.aclose()


# --- the driver ----------------------------------------------------------------------------------


class WorkerProcess:
    def __init__(self, redis_url: str, directory: Path, args: argparse.Namespace) -> None:
        self.snapshot_path = directory / "snapshot.json"
        self.log_path = directory / "worker.log"
        with self.log_path.open("ab") as sink:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.worker_cost",
                    "--serve",
                    "--redis-url",
                    redis_url,
                    "--snapshot",
                    str(self.snapshot_path),
                    "--max-batch-size",
                    str(args.max_batch_size),
                    "--max-wait-ms",
                    str(args.max_wait_ms),
                    "--precision",
                    args.precision,
                ],
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
            )
        self._wait_snapshot(timeout_s=180)

    def _wait_snapshot(self, *, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self.snapshot_path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker process failed:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.01)
        data: dict[str, Any] = json.loads(self.snapshot_path.read_text())
        self.snapshot_path.unlink()
        return data

    def snapshot(self) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGUSR1)
        return self._wait_snapshot(timeout_s=30)

    def stop(self) -> None:
        stop_processes([self.proc])


def records_for(texts: Sequence[str]) -> list[Any]:
    from sluice.kinds import token_estimate
    from sluice.wire.jobs import JobRecord, JobStatus
    from sluice.wire.keys import new_job_id

    now = time.time()
    return [
        JobRecord(
            id=new_job_id(MODEL, VERSION),
            tenant="demo",
            model=MODEL,
            version=VERSION,
            lane="online",
            status=JobStatus.queued,
            input={"text": text},
            enqueued_at=now,
            cost=token_estimate(text),
        )
        for text in texts
    ]


async def queue(redis: Any, texts: Sequence[str]) -> None:
    """As the API queues them: each record, then its stream entry (`streams.queue_jobs`)."""
    from sluice.wire.streams import queue_jobs

    pipe = redis.pipeline(transaction=False)
    queue_jobs(pipe, records_for(texts), result_ttl_s=3600)
    await pipe.execute()


async def wait_finished(redis: Any, total: int, *, timeout_s: float) -> None:
    """Until `total` samples are in the version's stream: one per job made final by the worker."""
    from sluice.wire import keys

    deadline = time.monotonic() + timeout_s
    while await redis.xlen(keys.stats(MODEL, VERSION)) < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs not finished within {timeout_s}s")
        await asyncio.sleep(0.01)


def redis_cpu_s(info: Mapping[str, Any]) -> float:
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def one_run(
    redis: Any, worker: WorkerProcess, pattern: str, texts: Sequence[str], *, done_before: int, rate: float, seed: int
) -> dict[str, Any]:
    before = worker.snapshot()
    redis_before = redis_cpu_s(await redis.info("cpu"))
    window = CpuWindow()
    started = time.perf_counter()
    if pattern == "backlog":
        await queue(redis, texts)
    else:
        loop = asyncio.get_running_loop()
        start = loop.time()
        for offset, text in zip(poisson_timetable(rate, len(texts), seed=seed), texts, strict=True):
            delay = start + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await queue(redis, [text])
    await wait_finished(redis, done_before + len(texts), timeout_s=60 + 2 * len(texts))
    elapsed = time.perf_counter() - started
    after = worker.snapshot()
    redis_used = redis_cpu_s(await redis.info("cpu")) - redis_before
    window.stop()
    n = len(texts)
    cpu = after["cpu_s"] - before["cpu_s"]
    forward = after["forward_cpu_s"] - before["forward_cpu_s"]
    batches = after["batches"] - before["batches"]
    return {
        "pattern": pattern,
        "jobs": n,
        "batches": batches,
        "mean_batch": n / batches if batches else None,
        "wall_s": elapsed,
        "jobs_per_s_wall": n / elapsed,
        "worker_cpu_ms_per_job": 1000 * cpu / n,
        "forward_cpu_ms_per_job": 1000 * forward / n,
        "outside_cpu_ms_per_job": 1000 * (cpu - forward) / n,
        "outside_share": (cpu - forward) / cpu,
        "system_cpu_ms_per_job": 1000 * (after["system_cpu_s"] - before["system_cpu_s"]) / n,
        "round_trips_per_job": (after["round_trips"] - before["round_trips"]) / n,
        "round_trips_per_batch": (after["round_trips"] - before["round_trips"]) / batches if batches else None,
        "redis_cpu_ms_per_job": 1000 * redis_used / n,
        "foreign_cores": window.foreign_cores(cpu + redis_used),
    }


FIGURES = (
    "worker_cpu_ms_per_job",
    "forward_cpu_ms_per_job",
    "outside_cpu_ms_per_job",
    "outside_share",
    "system_cpu_ms_per_job",
    "mean_batch",
    "round_trips_per_job",
    "round_trips_per_batch",
    "redis_cpu_ms_per_job",
    "jobs_per_s_wall",
    "foreign_cores",
)


def summarise(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pattern in PATTERNS:
        mine = [r for r in runs if r["pattern"] == pattern]
        if not mine:
            continue
        out[pattern] = {
            figure: {
                "median": statistics.median(r[figure] for r in mine),
                "min": min(r[figure] for r in mine),
                "max": max(r[figure] for r in mine),
            }
            for figure in FIGURES
            if all(r[figure] is not None for r in mine)
        }
        out[pattern]["runs"] = len(mine)
    return out


@contextlib.contextmanager
def profiling(pid: int, path: Path | None) -> Iterator[None]:
    """py-spy (`pip install py-spy`) sampling the worker process into a collapsed-stack file."""
    if path is None:
        yield
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    # --gil: only the thread holding the GIL is sampled. Without it py-spy counted threads waiting
    # for the GIL or for work (the executor's idle thread) as busy, over half of the samples.
    proc = subprocess.Popen(
        [
            spy,
            "record",
            "--pid",
            str(pid),
            "--rate",
            "200",
            "--format",
            "raw",
            "--gil",
            "--nonblocking",
            "--output",
            str(path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    time.sleep(1.0)  # attached before the first job
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


async def drive(args: argparse.Namespace, redis_url: str, directory: Path) -> list[dict[str, Any]]:
    import redis.asyncio as aioredis

    worker = WorkerProcess(redis_url, directory, args)
    redis = aioredis.Redis.from_url(redis_url)
    runs: list[dict[str, Any]] = []
    done = 0
    try:
        # One short backlog first: the first batches of each shape after warm-up are slower.
        warm = skewed_texts(64, seed=10_000)
        await queue(redis, warm)
        done += len(warm)
        await wait_finished(redis, done, timeout_s=120)
        for repeat in range(args.repeats):
            for pattern in PATTERNS if repeat % 2 == 0 else reversed(PATTERNS):
                n = args.single_jobs if pattern == "single" else args.backlog_jobs
                texts = skewed_texts(n, seed=args.seed + repeat)
                profile = args.profile / f"{pattern}-{repeat}.txt" if args.profile else None
                with profiling(worker.proc.pid, profile):
                    run = await one_run(
                        redis, worker, pattern, texts, done_before=done, rate=args.rate, seed=args.seed + repeat
                    )
                done += n
                run["repeat"] = repeat
                runs.append(run)
                print(
                    f"{pattern:7} repeat {repeat}: worker {fmt(run['worker_cpu_ms_per_job'])} ms CPU/job, "
                    f"forward {fmt(run['forward_cpu_ms_per_job'])}, outside {fmt(run['outside_cpu_ms_per_job'])} "
                    f"({fmt(100 * run['outside_share'], 1)} %), mean batch {fmt(run['mean_batch'], 1)}, "
                    f"{fmt(run['round_trips_per_batch'], 1)} round trips/batch, other load "
                    f"{fmt(run['foreign_cores'])} cores",
                    flush=True,
                )
    finally:
        worker.stop()
        await redis.aclose()
    return runs


def report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary = summarise(runs)
    rows = []
    for pattern, figures in summary.items():

        def cell(name: str, scale: float = 1.0, digits: int = 2, figures: dict[str, Any] = figures) -> str:
            f = figures[name]
            return (
                f"{fmt(f['median'] * scale, digits)} ({fmt(f['min'] * scale, digits)}-{fmt(f['max'] * scale, digits)})"
            )

        rows.append(
            [
                pattern,
                figures["runs"],
                cell("mean_batch", digits=1),
                cell("worker_cpu_ms_per_job"),
                cell("forward_cpu_ms_per_job"),
                cell("outside_cpu_ms_per_job"),
                cell("outside_share", 100, 1),
                cell("system_cpu_ms_per_job"),
                cell("round_trips_per_batch", digits=1),
                cell("redis_cpu_ms_per_job", digits=3),
                cell("foreign_cores"),
            ]
        )
    print()
    print("worker CPU per job, median (min-max) over repeats; CPU ms unless said:")
    print(
        table(
            [
                "pattern",
                "runs",
                "mean batch",
                "worker",
                "forward",
                "outside",
                "outside %",
                "kernel (whole process)",
                "round trips/batch",
                "redis (server)",
                "other load, cores",
            ],
            rows,
        )
    )
    result = {
        "command": command_line("bench.worker_cost"),
        "machine": machine_info(),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "summary": summary,
        "runs": runs,
    }
    path = write_json(args.output, result)
    print(f"\nwrote {path}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each pattern, interleaved")
    parser.add_argument("--rate", type=float, default=20.0, help="jobs/s of the single-job pattern (Poisson)")
    parser.add_argument("--single-jobs", type=int, default=300)
    parser.add_argument("--backlog-jobs", type=int, default=640)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=10.0)
    parser.add_argument("--precision", choices=("fp32", "bf16", "int8", "auto"), default="fp32",
                        help="what the worker's MiniLM runs (fp32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, help="record each run with py-spy into this directory")
    parser.add_argument("--output", default="worker_cost.json", help="file name under bench/results/")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    parser.add_argument("--snapshot", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        from workers.main import run_event_loop

        run_event_loop(serve(args))
        return
    from bench.rollback import private_redis

    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    with (
        sigterm_as_interrupt(),
        private_redis() as (redis_url, _),
        tempfile.TemporaryDirectory(prefix="sluice-worker-cost-") as directory,
    ):
        runs = asyncio.run(drive(args, redis_url, Path(directory)))
    report(args, runs)


if __name__ == "__main__":
    main()
