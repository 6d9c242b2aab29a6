"""A worker process serving several versions: the ones its placement group lists.

Each version keeps its own `Worker` (its consumer reads, micro-batcher, heartbeat, metrics), so
nothing a user reads per version changes with packing; what they share is the process's loaded
weights (`LoadedModels`: one copy per artifact) and its execution turns (`ExecutionSlots`: ready
batches of all its versions take the model in tier, lane and fair order). See
docs/ARCHITECTURE.md, "Packed worker processes".

The host follows its group's entry in the placement plan (`sluice.wire.placements`), read every
`PLAN_EVERY_S`: a version added is verified, loaded (shared where it can be), warmed and only then
joins its consumer group; a version removed drains (stops reading, finishes and acknowledges what
it holds) and its weights are released once no version holds them. A version whose configuration
changed gets a new Worker beside the old one, and the old one drains once the new one is ready:
no gap in service, and no second copy of the weights (both hold the same loaded model).

A refused artifact is recorded (the registry's `last_error`, and `keys.refused_versions()` for
the scheduler, which then reports the version `not_served`) and tried again later with backoff:
an operator may fix the artifact in its store. The other versions go on serving meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from sluice.backoff import Backoff
from sluice.errors import ArtifactError, SluiceError, WorkerFailed
from sluice.metrics import (
    COLD_START,
    PRECISION_SPEEDUP,
    RESIDENT_BYTES,
    WORKER_PRECISION,
    WORKER_STATE,
    clear_precision,
)
from sluice.registry import catalog
from sluice.registry.store import Registry
from sluice.registry.tables import ModelVersion
from sluice.settings import Settings
from sluice.tenant_objects import ObjectStore
from sluice.vocabulary import ZeroState
from sluice.wire import keys, placements
from sluice.wire.connections import translate_redis_errors
from sluice.wire.heartbeats import WorkerState
from sluice.wire.placements import VersionKey, version_name
from workers.models.loading import Sources
from workers.models.precision import PrecisionPolicy
from workers.models.shared import Loaded, LoadedModels
from workers.references import References
from workers.slots import ExecutionSlots
from workers.worker import Worker

log = logging.getLogger(__name__)

PLAN_EVERY_S = 1.0
REGISTRY_RETRY_S = 2.0


def refusal_backoff() -> Backoff:
    """Retrying a refused artifact: the operator has to act first, so not often."""
    return Backoff(base_s=60.0, cap_s=300.0, jitter=0.1)


@dataclass
class _Served:
    """One version's Worker in this process, from loading to drained."""

    key: VersionKey
    config: str
    task: asyncio.Task[None] | None = None
    worker: Worker | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def ready(self) -> bool:
        return self.worker is not None and self.worker.state == WorkerState.ready

    def request_stop(self) -> None:
        self.stop.set()
        if self.worker is not None:
            self.worker.request_stop()


@dataclass(frozen=True, slots=True)
class _Loaded:
    row: ModelVersion
    tier: str
    model: Loaded
    cold_start_s: float


class ArtifactRefusedAtStart(SluiceError):
    """A host started for fixed versions (`sluice worker --model --version`) could not load one."""


def slot_resources(*, device: str, threads: int | None) -> tuple[float, float]:
    """(cores, GPUs) of a worker process's model slot."""
    import torch

    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return float(threads or torch.get_num_threads()), 1.0 if on_gpu else 0.0


class WorkerHost:
    def __init__(self, *, redis: aioredis.Redis, registry: Registry, settings: Settings, models: LoadedModels,
                 slots: ExecutionSlots, group: str | None = None, fixed: Mapping[VersionKey, str] | None = None,
                 device: str = "auto", threads: int | None = None, clock: Callable[[], float] = time.time) -> None:
        if (group is None) == (fixed is None):
            raise ValueError("a worker host serves either a placement group or fixed versions")
        self.redis = redis
        self.registry = registry
        self.settings = settings
        self.models = models
        self.slots = slots
        self.group = group or ""
        self.fixed = dict(fixed) if fixed is not None else None
        self.device = device
        self.threads = threads
        self.clock = clock
        # What the process's model slot holds, charged per pass (sluice/cost.py): its torch threads
        # (one core each) and the GPU when its models run on one.
        self._cores, self._gpus = slot_resources(device=device, threads=threads)
        # One store for every version served: its client (connections, credentials) is made once.
        self.objects = ObjectStore.from_settings(settings)
        self.served: dict[VersionKey, list[_Served]] = {}
        self._stopping = asyncio.Event()
        self._refusals: dict[VersionKey, Backoff] = {}

    def request_stop(self) -> None:
        """First signal: every version drains (stops reading, finishes, acknowledges)."""
        self._stopping.set()
        for served in self._all():
            served.request_stop()

    def _all(self) -> list[_Served]:
        return [served for versions in self.served.values() for served in versions]

    async def run(self) -> None:
        try:
            while not self._stopping.is_set():
                wanted = await self._wanted()
                if wanted is not None:
                    self._converge(wanted)
                self._collect()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(PLAN_EVERY_S):
                        await self._stopping.wait()
        finally:
            for served in self._all():
                served.request_stop()
            tasks = [s.task for s in self._all() if s.task is not None]
            if tasks:
                await asyncio.wait(tasks)
        self._collect()

    async def _wanted(self) -> dict[VersionKey, str] | None:
        """The versions this process should serve, with their configurations; None when the plan
        cannot be read (Redis away): then it keeps serving what it serves."""
        if self.fixed is not None:
            return self.fixed
        try:
            plan = await placements.read_async(self.redis)
        except SluiceError as exc:
            log.warning("placement plan unreadable, serving what this process serves: %s", exc)
            return None
        if plan is None:
            return None
        group = plan.groups.get(self.group)
        return {} if group is None else {placed.key: placed.config for placed in group.versions}

    def _converge(self, wanted: Mapping[VersionKey, str]) -> None:
        for key, config in wanted.items():
            current = [s for s in self.served.get(key, []) if not s.stop.is_set()]
            if not any(s.config == config for s in current):
                log.info("serving %s here%s", version_name(key), " (new configuration)" if current else "")
                served = _Served(key=key, config=config)
                served.task = asyncio.create_task(self._serve(served), name=f"serve {version_name(key)}")
                self.served.setdefault(key, []).append(served)
            elif any(s.config == config and s.ready for s in current):
                for stale in (s for s in current if s.config != config):
                    log.info("%s: the worker with the old configuration drains", version_name(key))
                    stale.request_stop()
        for key, versions in self.served.items():
            if key not in wanted:
                for served in versions:
                    if not served.stop.is_set():
                        log.info("%s is no longer placed here: draining it", version_name(key))
                        served.request_stop()

    def _collect(self) -> None:
        """Forget the versions whose Worker has ended; a Worker that failed fails the process (its
        model thread may hold the turns forever), so its supervisor starts a fresh one."""
        for key in list(self.served):
            for served in list(self.served[key]):
                task = served.task
                if task is None or not task.done():
                    continue
                self.served[key].remove(served)
                if not task.cancelled() and (error := task.exception()) is not None:
                    raise error
            if not self.served[key]:
                del self.served[key]

    # --- one version ---------------------------------------------------------------------------

    async def _serve(self, served: _Served) -> None:
        # Asked before loading: the scheduler marks the version awake once this Worker is ready.
        woke = await self._waking(served.key)
        loaded = await self._load(served)
        if loaded is None:
            return
        model, version = served.key
        try:
            choice = loaded.model.handler.precision
            worker = Worker(
                redis=self.redis, model=model, version=version, handler=loaded.model.handler,
                max_batch_size=loaded.row.max_batch_size, max_wait_ms=loaded.row.max_wait_ms,
                isolate_tenants=loaded.row.isolate_tenants, result_ttl_s=self.settings.result_ttl_s,
                claim_after_s=self.settings.claim_after_s, max_deliveries=self.settings.max_deliveries,
                prefetch_batches=self.settings.worker_prefetch_batches,
                shutdown_grace_s=self.settings.shutdown_grace_s, cold_start_s=loaded.cold_start_s,
                precision=choice.precision if choice else "", precision_speedup=choice.speedup if choice else None,
                batch_timeout_s=self.settings.batch_timeout_s, slots=self.slots, tier=loaded.tier,
                group=self.group, resident_bytes=loaded.model.resident_bytes, woke=woke,
                fair_share=self.settings.fair_share, ageing_s=self.settings.priority_ageing_s,
                adaptive_wait=self.settings.batch_adaptive_wait,
                latency_budget_ms=loaded.row.latency_budget_ms,
                cores=self._cores, gpus=self._gpus,
                references=References(root=self.settings.batch_root, objects=self.objects,
                                      max_bytes=self.settings.max_object_bytes,
                                      max_text_chars=self.settings.max_text_chars),
            )
            served.worker = worker
            if served.stop.is_set():
                worker.request_stop()
            WORKER_STATE.labels(model, version).set(1)
            try:
                await worker.run()
            except WorkerFailed:
                log.exception("worker for %s failed", version_name(served.key))
                raise
        finally:
            self.models.release(loaded.model)
            if not any(s is not served and not s.stop.is_set() for s in self.served.get(served.key, [])):
                for gauge in (WORKER_STATE, COLD_START, PRECISION_SPEEDUP, RESIDENT_BYTES):
                    with contextlib.suppress(KeyError):
                        gauge.remove(model, version)
                clear_precision(model, version)

    async def _waking(self, key: VersionKey) -> bool:
        """Whether the scheduler placed the version here to wake it from zero (scheduler/idle.py):
        the jobs queued before this Worker is ready then carry `cold_start_ms`. Unknown (Redis
        away) counts as not: the timing is left out, the jobs run all the same."""
        with contextlib.suppress(SluiceError):
            with translate_redis_errors():
                state = await self.redis.hget(keys.replicas(*key), "zero")
            return state in (ZeroState.waking.value, ZeroState.waking.encode())
        return False

    async def _load(self, served: _Served) -> _Loaded | None:
        """Verify, load (or share) and warm the version's model; None when it was stopped first.
        A refusal is retried with backoff while the version stays placed here."""
        key = served.key
        while not served.stop.is_set():
            started = time.perf_counter()
            try:
                row, kind, tier = await asyncio.to_thread(self._version_row, key)
                model = await asyncio.to_thread(self._acquire, row, kind)
            except ArtifactError as exc:
                delay = self._refused(key, exc)
                if self.fixed is not None:
                    raise ArtifactRefusedAtStart(str(exc)) from exc
                await self._refusal_recorded(key, exc)
            except SluiceError as exc:
                # The registry away: the version's row is needed before anything can load.
                log.warning("cannot load %s yet: %s", version_name(key), exc)
                delay = REGISTRY_RETRY_S
            else:
                if served.stop.is_set():
                    self.models.release(model)
                    return None
                cold_start_s = time.perf_counter() - started
                self._refusals.pop(key, None)
                with contextlib.suppress(SluiceError):
                    await placements.clear_refusal(self.redis, key)
                self._loaded_metrics(key, model, cold_start_s)
                return _Loaded(row=row, tier=tier, model=model, cold_start_s=cold_start_s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await served.stop.wait()
        return None

    def _version_row(self, key: VersionKey) -> tuple[ModelVersion, str, str]:
        with self.registry.session() as session:
            row = catalog.get_version(session, *key)
            kind, tier = row.model_row.kind, row.model_row.tier
            session.expunge(row)
            return row, kind, tier

    def _acquire(self, row: ModelVersion, kind: str) -> Loaded:
        settings = self.settings
        model = self.models.acquire(
            kind=kind, artifact=row.artifact, sha256=row.sha256, device=self.device, threads=self.threads,
            precision=PrecisionPolicy.from_settings(settings),
            sources=Sources(handler=row.handler, input_schema=row.input_schema, output_schema=row.output_schema,
                            cache_dir=settings.artifact_cache, ca_bundle=settings.artifact_ca_bundle,
                            allow_pickle=row.allow_pickle))
        if not model.shared:
            try:
                model.handler.warmup()
            except BaseException:
                self.models.release(model)
                raise
        return model

    def _refused(self, key: VersionKey, exc: ArtifactError) -> float:
        log.error("version %s refused: %s", version_name(key), exc)
        try:
            with self.registry.session() as session:
                catalog.record_version_error(session, model=key[0], version=key[1], message=str(exc))
        except SluiceError:
            pass
        return self._refusals.setdefault(key, refusal_backoff()).failed()

    async def _refusal_recorded(self, key: VersionKey, exc: ArtifactError) -> None:
        with contextlib.suppress(SluiceError):
            await placements.record_refusal(self.redis, key, str(exc))

    def _loaded_metrics(self, key: VersionKey, model: Loaded, cold_start_s: float) -> None:
        COLD_START.labels(*key).set(cold_start_s)
        RESIDENT_BYTES.labels(*key).set(model.resident_bytes)
        choice = model.handler.precision
        if choice is not None:
            clear_precision(*key)
            WORKER_PRECISION.labels(*key, choice.precision).set(1)
            if choice.speedup is not None:
                PRECISION_SPEEDUP.labels(*key).set(choice.speedup)
            log.info("%s runs %s: %s", version_name(key), choice.precision, choice.reason)
        log.info("%s ready after %.2fs (%s, %.0f MB resident added)", version_name(key), cold_start_s,
                 "weights shared" if model.shared else "weights loaded", model.resident_bytes / 2**20)
