"""The batching frontier of one model (`sluice bench frontier`): p99 against sustained throughput
for every (max_batch_size, max_wait_ms) of a grid, on the real worker and in the simulator.

The real series runs `workers.worker.Worker` (the real class, its real handler, real Redis) in
this process, one replica with `--threads` torch threads, a fresh one for every phase. Jobs go
straight into Redis as the API queues them (record, then stream entry) on an open-loop Poisson
timetable fixed in advance, each stamped with its *scheduled* arrival time, so a late feeder
cannot hide latency (no coordinated omission). Texts are the skewed length mix
(`scheduler.planning.text_mix`). Latency is the worker's own `total_ms` sample: scheduled arrival to
the end of the job's forward pass. The procedure (capacity probe, ladder of rates, keep-up rule)
is `scheduler.planning.frontier.sweep`.

Every phase at the same step of the ladder replays the same arrival pattern (stretched to its
rate) and the same run of texts, whatever the configuration, and every probe the same texts:
with a few hundred jobs a phase, two configurations that met different bursts would differ more
by their luck than by their settings.

The simulated series runs the same grid, ladder and arrivals through `scheduler.planning.frontier_sim`
with the real `MicroBatcher`, at a cost fitted (least squares) to the forward passes the real
series timed, so the two frontiers differ only where the model of the worker is wrong.

Every phase uses a version of its own (`b8-w5-r2`) of a model named for the run, so nothing is
shared with the next phase; its keys are deleted afterwards. By default Redis is a Valkey of the
run's own (`launch.private_valkey`, the binary `sluice up` embeds): the worker's job events and
heartbeats then reach nobody else's processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform as py_platform
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scheduler.planning.frontier import (
    CostFit,
    Rung,
    Series,
    drain_rate,
    falling_behind,
    fit_cost,
    measure_rung,
    poisson_arrivals,
    sweep,
)
from scheduler.planning.frontier_sim import PassPlan, SimJob, run_replica
from scheduler.planning.text_mix import skewed_texts
from sluice.kinds import token_estimate
from workers.models.protocol import ModelHandler

if TYPE_CHECKING:
    from sluice.wire.samples import Sample

# A capacity probe drains this many batches' worth of a backlog (and this many jobs at least), the
# same texts for every batch size.
PROBE_BATCHES = 6
PROBE_MIN_JOBS = 128
# A probe's backlog is given this long to drain (only a broken worker takes it).
PROBE_TIMEOUT_S = 600.0
# The worker starts this long before the first arrival is due.
START_LEAD_S = 0.2
# After a phase's last arrival, its jobs have this long (or half the phase, if longer) to finish.
MIN_DRAIN_S = 2.0
TENANT = "bench"
DEFAULT_SYNTHETIC = "synthetic:?fixed_s=0.004&per_item_s=0.001&per_token_s=0.00003"


# --- what to run ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """A model to sweep: how to load it without the registry."""

    label: str
    kind: str
    artifact: str
    sha256: str | None


def resolve_target(model: str, version: str | None) -> Target:
    """`minilm`/`embedding`, `intent`/`classifier`, `synthetic` (a default cost) or a
    `synthetic:?fixed_s=..` URI; anything else is a registered model, read from the registry
    (SLUICE_DATABASE_URL) at `version` or its most weighted one."""
    from sluice.artifacts import INTENT_HEAD_URI, MINILM_URI, artifact_sha256, resolve_artifact

    if model in ("minilm", "embedding"):
        return Target("minilm", "embedding", MINILM_URI, artifact_sha256(resolve_artifact(MINILM_URI)))
    if model in ("intent", "classifier"):
        return Target("intent", "classifier", INTENT_HEAD_URI, artifact_sha256(resolve_artifact(INTENT_HEAD_URI)))
    if model == "synthetic":
        return Target("synthetic", "synthetic", DEFAULT_SYNTHETIC, None)
    if model.startswith("synthetic:"):
        return Target("synthetic", "synthetic", model, None)
    return _registered(model, version)


def _registered(model: str, version: str | None) -> Target:
    from sluice.errors import SluiceError
    from sluice.registry import catalog
    from sluice.registry.store import Registry
    from sluice.settings import Settings

    url = Settings().database_url
    if not url:
        raise LookupError(f"{model!r} is not minilm, intent or synthetic, and SLUICE_DATABASE_URL is not set "
                          "to look it up in the registry")
    registry = Registry(url=url, pool_size=1)
    try:
        with registry.session() as session:
            if version is None:
                weights = catalog.routing_weights(session, model)
                if not weights:
                    raise LookupError(f"model {model!r} has no routed version in the registry; pass --version")
                version = max(weights, key=weights.__getitem__)
            row = catalog.get_version(session, model, version)
            return Target(f"{model} {version}", row.model_row.kind, row.artifact, row.sha256)
    except SluiceError as exc:  # not found, or no registry there
        raise LookupError(f"{model!r} {version or ''}: {exc}") from None
    finally:
        registry.dispose()


@dataclass(frozen=True, slots=True)
class Options:
    model: str
    version: str | None
    batch_sizes: tuple[int, ...]
    waits_ms: tuple[float, ...]
    fractions: tuple[float, ...]
    phase_s: float
    p99_budget_ms: float
    threads: int
    device: str
    seed: int
    texts: int
    min_ratio: float
    redis_url: str | None


# --- the handler, timed ---------------------------------------------------------------------------


class PassThroughHandler(ModelHandler):
    """A model handler that hands everything to `inner`; a measurement subclasses it to time `run`.
    One place passes the whole handler surface through: a wrapper that forgot `passes` once left
    the worker's runner dead on its first batch of two."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.length_buckets = inner.length_buckets
        self.precision = inner.precision
        self.takes_files = inner.takes_files

    def warmup(self) -> None:
        self.inner.warmup()

    def passes(self, inputs: Sequence[Any]) -> list[list[int]]:
        return self.inner.passes(inputs)  # type: ignore[no-any-return]

    def run(self, inputs: Sequence[Any]) -> list[dict[str, Any]]:
        return self.inner.run(inputs)  # type: ignore[no-any-return]

    def cost_of(self, item: Mapping[str, Any]) -> int | None:
        return self.inner.cost_of(item)  # type: ignore[no-any-return]

    def count_tokens(self, inputs: Sequence[Mapping[str, Any]]) -> tuple[int, int] | None:
        return self.inner.count_tokens(inputs)  # type: ignore[no-any-return]

    def proxies(self, output: Mapping[str, Any]) -> dict[str, Any] | None:
        return self.inner.proxies(output)  # type: ignore[no-any-return]


class RecordingHandler(PassThroughHandler):
    """The handler the worker runs, timing every call (one forward pass: the worker hands a
    handler that plans passes one pass at a time) as (jobs, longest tokens, seconds)."""

    def __init__(self, inner: Any, tokens: Mapping[str, int]) -> None:
        super().__init__(inner)
        self.tokens = tokens
        self.calls: list[tuple[int, int, float]] = []

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        started = time.perf_counter()
        try:
            return self.inner.run(inputs)  # type: ignore[no-any-return]
        finally:
            longest = max(self.tokens[item["text"]] for item in inputs) if inputs else 0
            self.calls.append((len(inputs), longest, time.perf_counter() - started))


def model_tokens(handler: Any, texts: Sequence[str]) -> list[int]:
    """What the model pads each text to: its tokenizer's count for the MiniLM kinds, the API's
    estimate (which the synthetic handler charges) otherwise."""
    encoder = getattr(handler, "encoder", None)
    if encoder is not None:
        return list(encoder.token_lengths(texts))
    return [token_estimate(text) for text in texts]


def pass_plan(handler: Any) -> PassPlan | None:
    """The simulator's view of how the handler splits a batch (None: it pads a batch as one)."""
    return None if handler.length_buckets else handler.encoder.passes  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class TextPool:
    """The skewed mix, with each text's batcher cost and model tokens; a phase takes a run of it."""

    texts: tuple[str, ...]
    costs: tuple[int, ...]
    tokens: tuple[int, ...]

    def take(self, n: int, seed: int) -> list[int]:
        start = random.Random(seed).randrange(len(self.texts))
        return [(start + j) % len(self.texts) for j in range(n)]


def text_pool(handler: Any, n: int, seed: int) -> TextPool:
    texts = skewed_texts(n, seed=seed)
    return TextPool(texts=tuple(texts), costs=tuple(token_estimate(t) for t in texts),
                    tokens=tuple(model_tokens(handler, texts)))


# --- the real worker ------------------------------------------------------------------------------


class RealReplica:
    """Probes and phases of one real `Worker` on Redis; every call runs on `runner`'s loop."""

    def __init__(self, *, runner: asyncio.Runner, redis_url: str, handler: RecordingHandler, pool: TextPool,
                 options: Options) -> None:
        from sluice.settings import Settings
        from sluice.wire.connections import connect

        self.runner = runner
        self.handler = handler
        self.pool = pool
        self.options = options
        self.settings = Settings()
        self.model = f"frontier-{os.urandom(3).hex()}"
        self.redis = connect(redis_url, max_connections=16)

    def close(self) -> None:
        self.runner.run(self.redis.aclose())

    def probe(self, max_batch_size: int) -> float:
        return self.runner.run(self._probe(max_batch_size))

    def rung(self, max_batch_size: int, max_wait_ms: float, rate: float, seed: int) -> Rung:
        return self.runner.run(self._rung(max_batch_size, max_wait_ms, rate, seed))

    def _worker(self, version: str, max_batch_size: int, max_wait_ms: float) -> Any:
        from workers.worker import Worker

        return Worker(redis=self.redis, model=self.model, version=version, handler=self.handler,
                      max_batch_size=max_batch_size, max_wait_ms=max_wait_ms,
                      result_ttl_s=self.settings.result_ttl_s, claim_after_s=self.settings.claim_after_s,
                      max_deliveries=self.settings.max_deliveries,
                      prefetch_batches=self.settings.worker_prefetch_batches,
                      shutdown_grace_s=self.settings.shutdown_grace_s,
                      adaptive_wait=self.settings.batch_adaptive_wait)

    async def _queue(self, version: str, indices: Sequence[int], arrivals: Sequence[float]) -> list[str]:
        from sluice.wire.jobs import JobRecord, JobStatus
        from sluice.wire.keys import new_job_id
        from sluice.wire.streams import queue_jobs

        records = [JobRecord(id=new_job_id(self.model, version), tenant=TENANT, model=self.model, version=version,
                             lane="online",
                             status=JobStatus.queued, input={"text": self.pool.texts[i]}, enqueued_at=at,
                             cost=self.pool.costs[i]) for i, at in zip(indices, arrivals, strict=True)]
        pipe = self.redis.pipeline(transaction=False)
        queue_jobs(pipe, records, result_ttl_s=self.settings.result_ttl_s)
        await pipe.execute()
        return [record.id for record in records]

    async def _feed(self, version: str, indices: Sequence[int], offsets: Sequence[float], start: float) -> list[str]:
        """Queue each job at start + its offset, late ones together, whatever the worker does."""
        ids: list[str] = []
        sent = 0
        while sent < len(offsets):
            due = sent
            now = time.time() - start
            while due < len(offsets) and offsets[due] <= now:
                due += 1
            if due > sent:
                ids += await self._queue(version, indices[sent:due], [start + at for at in offsets[sent:due]])
                sent = due
            if sent < len(offsets):
                await asyncio.sleep(max(0.0, start + offsets[sent] - time.time()))
        return ids

    async def _samples(self, version: str) -> list[Sample]:
        from sluice.wire import keys
        from sluice.wire.samples import parse

        entries: list[tuple[bytes, dict[bytes, bytes]]] = await self.redis.xrange(  # type: ignore[assignment]
            keys.stats(self.model, version))
        return parse(entries)

    async def _finished(self, version: str, total: int, deadline: float, worker: asyncio.Task[None]) -> list[Sample]:
        """The samples of the version's finished jobs, once `total` are in, at `deadline`, or
        when the worker has stopped (its error is raised by whoever awaits it)."""
        from sluice.wire import keys

        stream = keys.stats(self.model, version)
        while time.time() < deadline and not worker.done():
            if await self.redis.xlen(stream) >= total:
                break
            await asyncio.sleep(0.02)
        return await self._samples(version)

    async def _forget(self, version: str, ids: Sequence[str]) -> None:
        from sluice.vocabulary import LANES
        from sluice.wire import keys

        names = [keys.stream(self.model, version, lane) for lane in LANES]
        names += [keys.dead_stream(self.model, version), keys.stats(self.model, version),
                  keys.live_workers(self.model, version), keys.mix(self.model, version),
                  keys.passes(self.model, version), *(keys.job(job_id) for job_id in ids)]
        names += [key async for key in self.redis.scan_iter(match=keys.heartbeat_pattern(self.model, version))]
        for first in range(0, len(names), 500):
            await self.redis.delete(*names[first:first + 500])

    @contextlib.asynccontextmanager
    async def _running(self, worker: Any, version: str, ids: list[str]) -> AsyncIterator[asyncio.Task[None]]:
        """The worker running; afterwards stopped (what it holds is finished), then the version's
        keys and the records of the jobs in `ids` deleted (read on the way out: the block may
        still be filling it)."""
        task = asyncio.create_task(worker.run())
        try:
            yield task
        finally:
            worker.request_stop()
            await task
            await self._forget(version, ids)

    async def _probe(self, max_batch_size: int) -> float:
        n = max(PROBE_MIN_JOBS, PROBE_BATCHES * max_batch_size)
        version = f"probe-b{max_batch_size}"
        now = time.time()
        ids = await self._queue(version, self.pool.take(n, self.options.seed), [now] * n)
        async with self._running(self._worker(version, max_batch_size, 0.0), version, ids) as task:
            samples = await self._finished(version, n, now + PROBE_TIMEOUT_S, task)
        return drain_rate([sample.finished_at for sample in samples])

    async def _rung(self, max_batch_size: int, max_wait_ms: float, rate: float, seed: int) -> Rung:
        phase_s, min_ratio = self.options.phase_s, self.options.min_ratio
        offsets = poisson_arrivals(rate, phase_s, seed)
        indices = self.pool.take(len(offsets), seed)
        version = f"b{max_batch_size}-w{max_wait_ms:g}-s{seed}"
        start = time.time() + START_LEAD_S
        calls_before = len(self.handler.calls)
        ids: list[str] = []
        async with self._running(self._worker(version, max_batch_size, max_wait_ms), version, ids) as task:
            ids += await self._feed(version, indices, offsets, start)
            samples = await self._samples(version)
            # One that fell behind during the phase has failed already: no use waiting for its backlog.
            if not falling_behind(offsets, [sample.finished_at - start for sample in samples], phase_s, rate,
                                  min_ratio=min_ratio):
                drain_s = max(MIN_DRAIN_S, phase_s / 2)
                samples = await self._finished(version, len(offsets), start + phase_s + drain_s, task)
        sizes = [n for n, _, _ in self.handler.calls[calls_before:]]
        return measure_rung(offered_rps=rate, duration_s=phase_s, arrivals=offsets,
                            finishes=[sample.finished_at - start for sample in samples],
                            latencies_ms=[sample.total_ms for sample in samples], batch_sizes=sizes,
                            min_ratio=min_ratio)


# --- the simulated replica ------------------------------------------------------------------------


class SimReplica:
    """The same probes and phases in `scheduler.planning.frontier_sim`, at a fitted cost."""

    def __init__(self, *, fit: CostFit, pool: TextPool, passes: PassPlan | None, options: Options,
                 prefetch_batches: int, adaptive_wait: bool) -> None:
        self.fit, self.pool, self.passes, self.options = fit, pool, passes, options
        self.prefetch_batches = prefetch_batches
        self.adaptive_wait = adaptive_wait

    def _jobs(self, indices: Sequence[int], arrivals: Sequence[float]) -> list[SimJob]:
        return [SimJob(at=at, cost=self.pool.costs[i], tokens=self.pool.tokens[i])
                for i, at in zip(indices, arrivals, strict=True)]

    def _run(self, jobs: Sequence[SimJob], max_batch_size: int, max_wait_ms: float) -> Any:
        return run_replica(jobs, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, cost=self.fit.cost,
                           passes=self.passes, prefetch_batches=self.prefetch_batches,
                           adaptive_wait=self.adaptive_wait)

    def probe(self, max_batch_size: int) -> float:
        n = max(PROBE_MIN_JOBS, PROBE_BATCHES * max_batch_size)
        jobs = self._jobs(self.pool.take(n, self.options.seed), [0.0] * n)
        return drain_rate(self._run(jobs, max_batch_size, 0.0).finished)

    def rung(self, max_batch_size: int, max_wait_ms: float, rate: float, seed: int) -> Rung:
        offsets = poisson_arrivals(rate, self.options.phase_s, seed)
        jobs = self._jobs(self.pool.take(len(offsets), seed), offsets)
        outcome = self._run(jobs, max_batch_size, max_wait_ms)
        return measure_rung(offered_rps=rate, duration_s=self.options.phase_s, arrivals=offsets,
                            finishes=outcome.finished,
                            latencies_ms=[(done - job.at) * 1000 for done, job in zip(outcome.finished, jobs,
                                                                                      strict=True)],
                            batch_sizes=outcome.batch_sizes, min_ratio=self.options.min_ratio)


# --- the run --------------------------------------------------------------------------------------


def load(target: Target, options: Options) -> Any:
    """The handler, loaded and warmed as `sluice worker` does (without the registry)."""
    from workers.models.loading import load_handler

    if target.kind != "synthetic":
        # Before torch is imported: its OpenMP pool reads these at start.
        os.environ.setdefault("OMP_NUM_THREADS", str(options.threads))
        os.environ.setdefault("MKL_NUM_THREADS", str(options.threads))
    handler = load_handler(kind=target.kind, artifact=target.artifact, sha256=target.sha256, device=options.device,
                           threads=options.threads if target.kind != "synthetic" else None)
    handler.warmup()
    return handler


@contextlib.contextmanager
def redis_for(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    from launch.private_valkey import private_valkey

    with private_valkey() as private_url:
        yield private_url


def machine(handler: Any) -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    torch = sys.modules.get("torch")
    precision = handler.precision
    return {"cores": os.cpu_count(), "cpu": cpu, "python": py_platform.python_version(),
            "torch": getattr(torch, "__version__", None), "loadavg_at_start": os.getloadavg(),
            "precision": precision.precision if precision is not None else None}


def run(options: Options, *, log: Callable[[str], None]) -> dict[str, Any]:
    """Both sweeps; answer the frontier.json document (the caller writes it)."""
    target = resolve_target(options.model, options.version)
    log(f"loading {target.label} ({target.kind}, {target.artifact})")
    inner = load(target, options)
    at_start = machine(inner)
    pool = text_pool(inner, options.texts, options.seed)
    handler = RecordingHandler(inner, dict(zip(pool.texts, pool.tokens, strict=True)))

    def progress(series: str) -> Callable[[int, float, Rung], None]:
        def line(max_batch_size: int, max_wait_ms: float, rung: Rung) -> None:
            p99 = "-" if rung.p99_ms is None else f"{rung.p99_ms:.0f}"
            log(f"{series} batch {max_batch_size:>3} wait {max_wait_ms:>4g} ms: {rung.offered_rps:6.1f}/s, "
                f"{rung.jobs:>4} jobs, p99 {p99:>5} ms, batch {rung.mean_batch:4.1f}, "
                f"{'kept up' if rung.kept_up else 'fell behind'}")
        return line

    grid: dict[str, Any] = {"batch_sizes": options.batch_sizes, "waits_ms": options.waits_ms,
                            "fractions": options.fractions, "seed": options.seed}
    started = time.monotonic()
    with redis_for(options.redis_url) as url, asyncio.Runner(loop_factory=_loop_factory()) as runner:
        replica = RealReplica(runner=runner, redis_url=url, handler=handler, pool=pool, options=options)
        try:
            real = sweep("real", probe=replica.probe, rung=replica.rung, on_rung=progress("real"), **grid)
        finally:
            replica.close()
        prefetch = replica.settings.worker_prefetch_batches
        adaptive_wait = replica.settings.batch_adaptive_wait
    real_s = time.monotonic() - started
    fit = fit_cost(handler.calls)
    log(f"cost fitted to {fit.batches} forward passes: {fit.describe()} (R^2 {fit.r2:.3f})")
    started = time.monotonic()
    sim = SimReplica(fit=fit, pool=pool, passes=pass_plan(inner), options=options, prefetch_batches=prefetch,
                     adaptive_wait=adaptive_wait)
    simulated = sweep("sim", probe=sim.probe, rung=sim.rung, **grid)
    return document(options, target, at_start, fit, {"real": real, "sim": simulated},
                    {"real": real_s, "sim": time.monotonic() - started})


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop, as `sluice worker` runs its worker (workers/main.py)."""
    import uvloop

    return uvloop.new_event_loop


def command_for(options: Options) -> str:
    """The command that repeats this sweep (on a private Valkey)."""
    import shlex

    def listed(values: Sequence[float]) -> str:
        return ",".join(f"{value:g}" for value in values)

    words = ["sluice", "bench", "frontier", "--model", options.model, "--batch-sizes", listed(options.batch_sizes),
             "--waits-ms", listed(options.waits_ms), "--fractions", listed(options.fractions),
             "--phase-s", f"{options.phase_s:g}", "--p99-budget-ms", f"{options.p99_budget_ms:g}",
             "--threads", str(options.threads), "--device", options.device, "--seed", str(options.seed),
             "--texts", str(options.texts), "--min-ratio", f"{options.min_ratio:g}"]
    if options.version:
        words += ["--version", options.version]
    return shlex.join(words)


def document(options: Options, target: Target, at_start: Mapping[str, Any], fit: CostFit,
             series: Mapping[str, Series], seconds: Mapping[str, float]) -> dict[str, Any]:
    budget = options.p99_budget_ms
    settings = {name: value for name, value in asdict(options).items() if name != "redis_url"}
    return {
        "bench": "frontier",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command_for(options),
        "model": {"label": target.label, "kind": target.kind, "artifact": target.artifact},
        "machine": dict(at_start),
        "options": settings,
        "p99_budget_ms": budget,
        "cost_fit": fit.to_dict(),
        "seconds": {name: round(value, 1) for name, value in seconds.items()},
        "series": {name: each.to_dict(budget) for name, each in series.items()},
    }
