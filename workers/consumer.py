"""The stream consumer: read a version's streams, form micro-batches, run them, store, ack.

Reading runs in one task and the model in another (in a thread, since torch releases the GIL),
so while batch k runs the next entries are already read and held by the batcher: the model never
waits on a Redis round trip. The runner takes the best batch at the moment the model is free
(`MicroBatcher.take`), so under a backlog it gets full, length-matched batches instead of the
crumbs an eager close at read time would leave. An entry is acknowledged only after its outcome
is stored; an entry left unacknowledged by a dead worker is taken over with XAUTOCLAIM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from sluice import keys
from sluice.broker import ensure_groups, events_channel, queue_jobs, translate_redis_errors
from sluice.errors import BrokerError
from sluice.jobs import (
    CLAIM_SCRIPT,
    FINISH_SCRIPT,
    NOTE_ERROR_SCRIPT,
    SHADOW_TENANT,
    JobRecord,
    JobStatus,
    new_job_id,
)
from sluice.metrics import (
    BATCH_CLOSED,
    BATCH_SIZE,
    JOBS_FINISHED,
    MODEL_TIME,
    PADDING_RATIO,
    QUEUE_WAIT,
    SHADOW_COPIES,
)
from sluice.quality import agreement, proxies
from sluice.redact import scrub
from workers.batcher import Batch, Item, MicroBatcher
from workers.execution import Outcome, run_isolating
from workers.models.handlers import ModelHandler

log = logging.getLogger(__name__)

SAMPLES_MAXLEN = 20_000
# The longest the reader sleeps (blocked on the streams, or napping while the model is busy)
# before it looks at the stop flag and the prefetch room again.
READ_BLOCK_MS = 250

Entry = tuple[str, bytes, dict[bytes, bytes]]  # (lane, stream entry id, fields)


@dataclass(frozen=True, slots=True)
class Delivery:
    """What the batcher carries as an item's payload."""

    job_id: str
    lane: str
    input: dict[str, Any]
    attempts: int
    shadow: str | None = None  # copy the input to this version once the job succeeds
    shadow_of: str | None = None  # this job is a shadow copy of that primary job


def jittered(delay: float) -> float:
    """Between half and all of a retry delay, so workers cut off together do not retry in step."""
    return delay * random.uniform(0.5, 1.0)


def _text(value: bytes | None) -> str | None:
    return value.decode() if value else None


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


class Worker:
    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        model: str,
        version: str,
        handler: ModelHandler,
        max_batch_size: int,
        max_wait_ms: float,
        isolate_tenants: bool = True,
        name: str | None = None,
        result_ttl_s: int = 86_400,
        claim_after_s: float = 30.0,
        max_deliveries: int = 3,
        prefetch_batches: int = 4,
        shutdown_grace_s: float = 30.0,
        cold_start_s: float = 0.0,
        top_up: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.model = model
        self.version = version
        self.handler = handler
        self.max_batch_size = max_batch_size
        self.name = name or consumer_name()
        self.result_ttl_s = result_ttl_s
        self.claim_after_s = claim_after_s
        self.max_deliveries = max_deliveries
        self.prefetch = prefetch_batches * max_batch_size
        self.shutdown_grace_s = shutdown_grace_s
        self.cold_start_s = cold_start_s
        self.clock = clock
        # Top-up is off by default: on one CPU thread a forward pass costs per padded token, and
        # topping up with shorter items raised padding 1.3-2.4x under a backlog (bench/README.md).
        self.batcher = MicroBatcher(max_batch_size=max_batch_size, max_wait_ms=max_wait_ms,
                                    isolate_tenants=isolate_tenants, top_up=top_up)
        self.streams = {lane: keys.stream(model, version, lane) for lane in keys.LANES}
        self._events = events_channel(redis)
        self._ready: deque[Batch] = deque()  # drain batches, run before anything else
        self._held: set[str] = set()  # entry ids read and not yet acknowledged
        self._wake_runner = asyncio.Event()
        self._wake_reader = asyncio.Event()
        self._runner_idle = True  # no batch running: the model waits for work
        self._reading_done = False
        self._stopping = asyncio.Event()
        self._writes: set[asyncio.Task[None]] = set()
        self._claim = redis.register_script(CLAIM_SCRIPT)
        self._finish = redis.register_script(FINISH_SCRIPT)
        self._note_error = redis.register_script(NOTE_ERROR_SCRIPT)
        self._last_claim = 0.0
        self.state = "starting"
        self.processed = 0
        self.last_batch_size = 0
        self._rate_window: deque[tuple[int, float]] = deque(maxlen=64)  # (items, model seconds)

    # --- lifecycle ------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """First signal: stop reading, flush open batches (close reason `drain`), finish, ack."""
        if not self._stopping.is_set():
            log.info("worker %s draining", self.name)
            self.state = "draining"
            self._stopping.set()
            self._wake_runner.set()
            self._wake_reader.set()

    async def run(self) -> None:
        await ensure_groups(self.redis, self.model, self.version)
        self.state = "ready"
        reader = asyncio.create_task(self._read_loop(), name="reader")
        runner = asyncio.create_task(self._run_loop(), name="runner")
        beat = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        try:
            await reader
            # Reading has stopped: everything held is flushed and finished within the grace period.
            self._ready.extend(self.batcher.drain(self.clock()))
            self._reading_done = True
            self._wake_runner.set()
            await asyncio.wait_for(runner, timeout=self.shutdown_grace_s)
            if self._writes:
                await asyncio.wait_for(asyncio.gather(*self._writes), timeout=self.shutdown_grace_s)
        finally:
            for task in (reader, runner, beat):
                task.cancel()
            for task in (reader, runner, beat):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            self.state = "stopped"
            with contextlib.suppress(BrokerError), translate_redis_errors():
                await self.redis.delete(keys.heartbeat(self.model, self.version, self.name))
                await self.redis.zrem(keys.live_workers(self.model, self.version), self.name)

    # --- reading and batch formation -----------------------------------------------------------

    async def _read_loop(self) -> None:
        backoff = 0.05
        while not self._stopping.is_set():
            try:
                await self._read_once()
                backoff = 0.05
            except BrokerError as exc:
                if backoff <= 0.05:
                    log.warning("worker %s lost Redis, retrying with backoff: %s", self.name, exc)
                await asyncio.sleep(jittered(backoff))
                backoff = min(backoff * 2, 5.0)

    async def _read_once(self) -> None:
        # Cleared first: a batch completing or the model going idle during the reads below
        # must end the nap at the bottom, not be forgotten.
        self._wake_reader.clear()
        room = self.prefetch - len(self._held)
        entries: list[Entry] = []
        if room > 0:
            entries = await self._reclaim(room) if self._claim_due() else []
            if not entries:
                entries = await self._xread({self.streams["online"]: ">"}, room, block=None)
            if not entries:
                entries = await self._xread({self.streams["bulk"]: ">"}, min(room, self.max_batch_size),
                                            block=None)
            # Only a worker whose model is idle blocks on the streams: a new arrival then goes to
            # a worker that can start it now, not into the prefetch of one whose model is busy.
            if not entries and self._runner_idle:
                entries = await self._xread(
                    {self.streams["online"]: ">", self.streams["bulk"]: ">"}, room, block=READ_BLOCK_MS
                )
        if entries:
            await self._accept(entries)
            self._wake_runner.set()
        elif room <= 0 or not self._runner_idle:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake_reader.wait(), timeout=READ_BLOCK_MS / 1000)

    def _claim_due(self) -> bool:
        return self.clock() - self._last_claim >= self.claim_after_s / 2

    async def _xread(self, streams: dict[str, str], count: int, block: int | None) -> list[Entry]:
        with translate_redis_errors():
            reply = await self.redis.xreadgroup(keys.GROUP, self.name, streams, count=count, block=block)  # type: ignore[arg-type]
        found = []
        for stream_name, messages in reply or []:
            name = stream_name.decode() if isinstance(stream_name, bytes) else stream_name
            lane = "online" if name == self.streams["online"] else "bulk"
            for entry_id, fields in messages:
                if fields:
                    found.append((lane, entry_id, fields))
        return found

    async def _reclaim(self, room: int) -> list[Entry]:
        """Take over entries a dead worker left pending for longer than claim_after_s."""
        self._last_claim = self.clock()
        found: list[Entry] = []
        for lane, stream_name in self.streams.items():
            with translate_redis_errors():
                reply = await self.redis.xautoclaim(
                    stream_name, keys.GROUP, self.name, min_idle_time=int(self.claim_after_s * 1000),
                    start_id="0-0", count=max(1, room - len(found)),
                )
            for entry_id, fields in reply[1]:
                if fields:
                    found.append((lane, entry_id, fields))
            # Entries trimmed from the stream come back as deleted ids: nothing to acknowledge.
        if found:
            log.info("worker %s took over %d pending entries", self.name, len(found))
        return found

    async def _accept(self, entries: Sequence[Entry]) -> None:
        """Claim each job (queued -> running) and hand the runnable ones to the batcher."""
        # XAUTOCLAIM can hand back an entry this worker still holds (a slow model): not twice.
        entries = [e for e in entries if e[1].decode() not in self._held]
        if not entries:
            return
        now = self.clock()
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for _, _, fields in entries:
                await self._claim(keys=[keys.job(fields[b"id"].decode()),
                                        keys.queued_count(fields[b"tenant"].decode()), keys.WEBHOOK_OUTBOX],
                                  args=[repr(now), self.name, self.max_deliveries], client=pipe)
            replies = await pipe.execute()
        settle: list[tuple[str, bytes]] = []
        events: list[dict[str, Any]] = []
        dead: list[tuple[str, str]] = []
        for (lane, entry_id, fields), reply in zip(entries, replies, strict=True):
            job_id = fields[b"id"].decode()
            verdict = reply[0].decode()
            if verdict == "run":
                item = Item(
                    id=entry_id.decode(), tenant=fields[b"tenant"].decode(), cost=int(fields[b"cost"]),
                    enqueued_at=float(fields[b"t"]),
                    payload=Delivery(job_id=job_id, lane=lane, input=json.loads(reply[1]), attempts=int(reply[2]),
                                     shadow=_text(fields.get(b"sh")), shadow_of=_text(fields.get(b"so"))),
                )
                self.batcher.add(item)
                self._held.add(item.id)
                events.append({"type": "job", "id": job_id, "status": "running"})
                continue
            settle.append((lane, entry_id))
            if verdict == "expired":
                JOBS_FINISHED.labels(self.model, self.version, "expired").inc()
                events.append({"type": "job", "id": job_id, "status": "expired"})
            elif verdict == "dead":
                JOBS_FINISHED.labels(self.model, self.version, "failed").inc()
                dead.append((job_id, reply[1].decode() if len(reply) > 1 else ""))
                events.append({"type": "job", "id": job_id, "status": "failed"})
        if settle or events:
            with translate_redis_errors():
                pipe = self.redis.pipeline(transaction=False)
                for job_id, last_error in dead:
                    pipe.xadd(keys.dead_stream(self.model, self.version),
                              {"id": job_id, "error": last_error[:500], "t": repr(now)}, maxlen=100_000,
                              approximate=True)
                for event in events:
                    pipe.publish(self._events, json.dumps(event, separators=(",", ":")))
                self._ack(pipe, settle)
                await pipe.execute()

    def _ack(self, pipe: Any, entries: Sequence[tuple[str, bytes | str]]) -> None:
        by_lane: dict[str, list[bytes | str]] = {}
        for lane, entry_id in entries:
            by_lane.setdefault(lane, []).append(entry_id)
        for lane, ids in by_lane.items():
            pipe.xack(self.streams[lane], keys.GROUP, *ids)
            # Deleting acknowledged entries keeps XLEN equal to the backlog the scheduler reads.
            pipe.xdel(self.streams[lane], *ids)

    # --- running ---------------------------------------------------------------------------------

    async def _run_loop(self) -> None:
        while True:
            batch = self._ready.popleft() if self._ready else self.batcher.take(self.clock())
            if batch is None:
                if self._reading_done and len(self.batcher) == 0:
                    return
                # No await since take(): nothing added meanwhile, so clearing loses no wake-up.
                self._wake_runner.clear()
                self._runner_idle = True
                self._wake_reader.set()
                deadline = self.batcher.next_deadline()
                timeout = None if deadline is None else max(0.0, deadline - self.clock())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake_runner.wait(), timeout=timeout)
                continue
            self._runner_idle = False
            started = self.clock()
            inputs = [item.payload.input for item in batch.items]
            outcomes, model_s = await asyncio.to_thread(run_isolating, self.handler, inputs)
            task = asyncio.create_task(self._complete(batch, outcomes, started, model_s))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def _complete(self, batch: Batch, outcomes: list[Outcome], started: float, model_s: float) -> None:
        """Store every outcome, then acknowledge: a job is never acked before its outcome exists."""
        finished = self.clock()
        size = len(batch.items)
        model_ms = round(model_s * 1000.0, 3)
        backoff = 0.05
        while True:
            try:
                await self._store(batch, outcomes, started, finished, model_ms)
                break
            except BrokerError as exc:
                # Keep the results and retry: the model's work is not thrown away on a Redis blip.
                if backoff <= 0.05:
                    log.warning("storing a batch failed, retrying: %s", exc)
                await asyncio.sleep(jittered(backoff))
                backoff = min(backoff * 2, 5.0)
        self._held.difference_update(item.id for item in batch.items)
        self._wake_reader.set()
        self.processed += size
        self.last_batch_size = size
        self._rate_window.append((size, model_s))
        labels = (self.model, self.version)
        BATCH_SIZE.labels(*labels).observe(size)
        BATCH_CLOSED.labels(*labels, batch.close_reason).inc()
        MODEL_TIME.labels(*labels).observe(model_s)
        real = sum(max(1, item.cost) for item in batch.items)
        PADDING_RATIO.labels(*labels).observe(batch.max_cost * size / real if real else 1.0)
        queue_wait = QUEUE_WAIT.labels(*labels)
        for item in batch.items:
            queue_wait.observe(max(0.0, started - item.enqueued_at))
        failed = sum(1 for outcome in outcomes if outcome.error is not None)
        if failed:
            JOBS_FINISHED.labels(*labels, "failed").inc(failed)
        if size - failed:
            JOBS_FINISHED.labels(*labels, "succeeded").inc(size - failed)

    async def _primary_outputs(self, batch: Batch, outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
        """The primary outputs that shadow copies in this batch are compared with."""
        wanted = [item.payload.shadow_of for item, outcome in zip(batch.items, outcomes, strict=True)
                  if item.payload.shadow_of and outcome.error is None]
        if not wanted:
            return {}
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for job_id in wanted:
                pipe.hget(keys.job(job_id), "output")
            replies = await pipe.execute()
        return {job_id: json.loads(raw) for job_id, raw in zip(wanted, replies, strict=True) if raw}

    def _shadow_copy(self, delivery: Delivery, item: Item, now: float) -> JobRecord:
        SHADOW_COPIES.labels(self.model, self.version).inc()
        return JobRecord(
            id=new_job_id(), tenant=SHADOW_TENANT, model=self.model, version=str(delivery.shadow),
            lane="bulk", status=JobStatus.queued, input=delivery.input, cost=item.cost, enqueued_at=now,
            shadow_of=delivery.job_id,
        )

    async def _store(self, batch: Batch, outcomes: list[Outcome], started: float, finished: float,
                     model_ms: float) -> None:
        size = str(len(batch.items))
        primaries = await self._primary_outputs(batch, outcomes)
        copies: list[JobRecord] = []
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for item, outcome in zip(batch.items, outcomes, strict=True):
                delivery: Delivery = item.payload
                status = "succeeded" if outcome.error is None else "failed"
                output = json.dumps(outcome.output, separators=(",", ":")) if outcome.output is not None else ""
                error = json.dumps(outcome.error, separators=(",", ":")) if outcome.error is not None else ""
                await self._finish(
                    keys=[keys.job(delivery.job_id), keys.WEBHOOK_OUTBOX],
                    args=[status, output, error, repr(finished), repr(model_ms), size, batch.close_reason,
                          self.result_ttl_s, repr(started)],
                    client=pipe,
                )
                sample = {
                    "s": status, "t": repr(finished), "qw": repr(round((started - item.enqueued_at) * 1000, 3)),
                    "m": repr(model_ms), "tt": repr(round((finished - item.enqueued_at) * 1000, 3)),
                    "b": size, "r": batch.close_reason,
                }
                if outcome.error is None:
                    proxy = proxies(outcome.output, encoded_size=len(output))
                    primary = primaries.get(delivery.shadow_of or "")
                    if primary is not None and outcome.output is not None:
                        agreed = agreement(primary, outcome.output)
                        if agreed is not None:
                            proxy["agreement"] = agreed
                    sample["q"] = json.dumps(proxy, separators=(",", ":"))
                    if delivery.shadow:
                        copies.append(self._shadow_copy(delivery, item, finished))
                if not delivery.shadow_of:
                    pipe.publish(self._events,
                                 json.dumps({"type": "job", "id": delivery.job_id, "status": status}))
                pipe.xadd(keys.stats(self.model, self.version), sample,  # type: ignore[arg-type]
                          maxlen=SAMPLES_MAXLEN, approximate=True)
            queue_jobs(pipe, copies, result_ttl_s=self.result_ttl_s)
            self._ack(pipe, [(item.payload.lane, item.id) for item in batch.items])
            await pipe.execute()

    async def note_error(self, job_id: str, message: str) -> None:
        with translate_redis_errors():
            await self._note_error(keys=[keys.job(job_id)], args=[scrub(message)[:500]])

    # --- heartbeat ---------------------------------------------------------------------------------

    def items_per_s(self) -> float:
        """Service capacity while busy (items per model-second), not wall-clock throughput: an
        idle worker must not look slow, or a burst after a quiet spell would be shed."""
        busy = sum(seconds for _, seconds in self._rate_window)
        return sum(n for n, _ in self._rate_window) / busy if busy > 0 else 0.0

    async def _heartbeat_loop(self, every_s: float = 2.0) -> None:
        key = keys.heartbeat(self.model, self.version, self.name)
        live = keys.live_workers(self.model, self.version)
        while True:
            with contextlib.suppress(BrokerError), translate_redis_errors():
                now = self.clock()
                pipe = self.redis.pipeline(transaction=False)
                pipe.hset(key, mapping={
                    "state": self.state, "items_per_s": f"{self.items_per_s():.3f}",
                    "batch_size": str(self.last_batch_size), "cold_start_s": f"{self.cold_start_s:.3f}",
                    "processed": str(self.processed), "pid": str(os.getpid()), "at": repr(now),
                })
                pipe.expire(key, int(every_s * 5))
                pipe.zadd(live, {self.name: now})
                pipe.zremrangebyscore(live, "-inf", now - every_s * 5)
                await pipe.execute()
            await asyncio.sleep(every_s)
