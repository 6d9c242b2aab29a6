"""The stream consumer: read a version's streams, form micro-batches, run them, store, ack.

Reading runs in one task and the model in another (in a thread, since torch releases the GIL),
so while batch k runs the next entries are already read and held by the batcher: the model never
waits on a Redis round trip. The runner takes the best batch at the moment the model is free
(`MicroBatcher.take`), so under a backlog it gets full, length-matched batches instead of the
crumbs an eager close at read time would leave. In a process serving several versions the batch
then waits for its turn on the model (`workers/slots.py`: tier, lane, then fair by model time),
so one version's flood holds another's batch back by at most the batch already running. An
entry is acknowledged only after its outcome is stored; an entry left unacknowledged by a dead
worker is taken over with XAUTOCLAIM.

Exactly once while workers live: what a worker holds it keeps its own by refreshing it, and it
holds no more than it can start soon (`workers/holdings.py`).

The worker is orchestration only: the stream protocol (reading, claiming, acknowledging, the
heartbeat) is `sluice.wire.streams`', and storing a batch's outcomes is `workers.results`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis

from sluice.backoff import Backoff
from sluice.batcher import DEFAULT_BUCKET_BOUNDS, Batch, Item, MicroBatcher
from sluice.cost import PassUsage
from sluice.errors import BrokerError, HandlerHung, WorkerFailed
from sluice.fair_share import DEFAULT_AGEING_S
from sluice.vocabulary import ClaimVerdict, Lane
from sluice.wire.connections import stop_if_cancelled
from sluice.wire.entries import Delivered
from sluice.wire.heartbeats import BEAT_EVERY_S, Heartbeat, WorkerState
from sluice.wire.jobs import JobStatus
from sluice.wire.mix import Pass, Tally
from sluice.wire.streams import StreamConsumer
from workers.batch_log import BatchLog
from workers.execution import Outcome, run_timed_out, timed_out
from workers.holdings import Holdings, held_limit, releasable
from workers.metrics import BatchMetrics
from workers.models.protocol import ModelHandler
from workers.passes import forward_passes, part
from workers.references import References
from workers.results import Delivery, ResultWriter
from workers.service_rates import ServiceRates
from workers.slots import ExecutionSlots, Turn, rank
from workers.tenant_turns import TenantTurns
from workers.usage import pass_usage

log = logging.getLogger(__name__)

# The longest the reader sleeps (blocked on the streams, or napping while the model is busy)
# before it looks at the stop flag and the prefetch room again.
READ_BLOCK_MS = 250
# The longest the runner waits for a claim under way before it takes the next batch.
CLAIM_WAIT_S = 0.005
# The shortest wait on the streams of a reader whose model is busy with a backlog.
BUSY_BLOCK_MIN_MS = 2


def redis_backoff() -> Backoff:
    """The retry delays of a worker loop cut off from Redis: jittered, so workers cut off together
    do not retry in step."""
    return Backoff(base_s=0.05, cap_s=5.0, jitter=0.5)


async def _wait(event: asyncio.Event, timeout_s: float | None) -> None:
    """Until `event` is set or `timeout_s` has passed. Not wait_for, which wraps the wait in a new
    task (Python 3.11): the runner and the reader wait here once or more per batch."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


# How long a stopping worker waits for its cancelled loops.
LOOP_STOP_S = 2.0

# The batcher runs online items before any bulk one (sluice/batcher.py).
LANE_PRIORITY: dict[Lane, int] = {"online": 0, "bulk": 1}


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
        precision: str = "",
        precision_speedup: float | None = None,
        top_up: bool = False,
        batch_timeout_s: float = 120.0,
        group: str = "",
        resident_bytes: int = 0,
        cores: float = 1.0,
        gpus: float = 0.0,
        slots: ExecutionSlots | None = None,
        tier: str = "latency",
        references: References | None = None,
        woke: bool = False,
        fair_share: bool = True,
        ageing_s: float = DEFAULT_AGEING_S,
        adaptive_wait: bool = True,
        latency_budget_ms: float = 2000.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.model = model
        self.version = version
        self.handler = handler
        self._redis = redis
        self.max_batch_size = max_batch_size
        self.name = name or consumer_name()
        self.claim_after_s = claim_after_s
        self.prefetch = prefetch_batches * max_batch_size
        self.shutdown_grace_s = shutdown_grace_s
        self.batch_timeout_s = batch_timeout_s
        self.cold_start_s = cold_start_s
        self.precision = precision
        self.precision_speedup = precision_speedup
        self._batch_log = BatchLog(model=model, version=version)
        self.group = group
        self.resident_bytes = resident_bytes
        # What the model slot holds, for the core- and GPU-seconds charged to each pass (sluice/cost.py).
        self.cores = cores
        self.gpus = gpus
        # The process's model slots, shared with the other versions it serves (workers/slots.py).
        self.slots = slots or ExecutionSlots()
        self.tier = tier
        # Reads the inputs and writes the outputs of jobs by reference (workers/references.py).
        self.references = references or References(root=None)
        self.clock = clock
        # Tenants take turns on the model and in the release of held jobs (sluice/fair_share.py).
        self._turns = TenantTurns(slice_s=max_wait_ms / 1000.0, ageing_s=ageing_s, fair=fair_share)
        # Prefetch places a worker releasing a backlog leaves for jobs written straight to the stream.
        self._arrival_reserve = max(1, max_batch_size // 4)
        # Top-up is off by default: on one CPU thread a forward pass costs per padded token, and
        # topping up with shorter items raised padding 1.3-2.4x under a backlog (bench/README.md).
        # A handler that splits batches by length itself gets one bucket: length buckets would
        # only fragment what it is handed (a mean batch of 2.7 at saturation with MiniLM).
        self.batcher: MicroBatcher[Delivery] = MicroBatcher(
            max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, isolate_tenants=isolate_tenants, top_up=top_up,
            bucket_bounds=DEFAULT_BUCKET_BOUNDS if handler.length_buckets else (), ageing_s=ageing_s,
            turns=self._turns.model if fair_share else None, adaptive_wait=adaptive_wait)
        self.streams = StreamConsumer(redis=redis, model=model, version=version, name=self.name,
                                      claim_after_s=claim_after_s, max_deliveries=max_deliveries,
                                      result_ttl_s=result_ttl_s)
        # `woke`: this Worker is the one its version's wake from zero placed, ready from now.
        self.results = ResultWriter(streams=self.streams, result_ttl_s=result_ttl_s,
                                    woke_at=clock() if woke else None)
        self._ready: deque[Batch[Delivery]] = deque()  # drain batches, run before anything else
        self.holdings = Holdings(streams=self.streams, name=self.name, claim_after_s=claim_after_s)
        self._wake_runner = asyncio.Event()
        self._wake_reader = asyncio.Event()
        self._claimed = asyncio.Event()  # clear while entries read are being claimed
        self._claimed.set()
        self._runner_idle = True  # no batch running: the model waits for work
        self._reading_done = False
        self._drained = False  # the last read found fewer entries than it asked for
        self._stopping = asyncio.Event()
        self._writes: set[asyncio.Task[None]] = set()
        # Set to the first write that failed other than on Redis (which it retries): its jobs would
        # stay held, refreshed and never reclaimed, so the worker fails as when a loop stops.
        self._failed_write: asyncio.Future[asyncio.Task[None]] | None = None
        self._last_claim = 0.0
        self.state = WorkerState.starting
        self.processed = 0
        self.last_batch_size = 0
        self.rates = ServiceRates()
        self._metrics = BatchMetrics(model=model, version=version, latency_budget_s=latency_budget_ms / 1000.0,
                                     max_wait_s=max_wait_ms / 1000.0)
        # The served mix and the forward passes, flushed with the heartbeat (sluice/wire/mix.py).
        self._tally = Tally()

    # --- lifecycle ------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """First signal: stop reading, flush open batches (close reason `drain`), finish, ack."""
        if not self._stopping.is_set():
            log.info("worker %s draining", self.name)
            self.state = WorkerState.draining
            self._stopping.set()
            self._wake_runner.set()
            self._wake_reader.set()

    async def run(self) -> None:
        await self.streams.ensure_groups()
        failed_write = self._failed_write = asyncio.get_running_loop().create_future()
        self.state = WorkerState.ready
        reader = asyncio.create_task(self._read_loop(), name="reader")
        runner = asyncio.create_task(self._run_loop(), name="runner")
        beat = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        refresh = asyncio.create_task(self.holdings.keep(self._give_up), name="refresh")
        try:
            # Only the reader ends on its own (on a stop request). Any other loop that ends has
            # failed: a worker whose runner died would go on claiming jobs it never runs while its
            # heartbeat says ready and its refreshes keep other workers off them. Fail instead:
            # the process exits, its supervisor replaces it, and the entries it held are reclaimed.
            await asyncio.wait((reader, runner, beat, refresh, failed_write), return_when=asyncio.FIRST_COMPLETED)
            self._raise_if_a_write_failed()
            for loop in (runner, beat, refresh):
                if loop.done():
                    log.error("worker %s: its %s loop stopped; the worker stops", self.name, loop.get_name(),
                              exc_info=loop.exception() if not loop.cancelled() else None)
                    raise WorkerFailed(f"the worker's {loop.get_name()} loop stopped") from (
                        None if loop.cancelled() else loop.exception())
            await reader
            # Reading has stopped: everything held is flushed and finished within the grace period.
            self._ready.extend(one for batch in self.batcher.drain(self.clock())
                               for one in forward_passes(self.handler, batch))
            self._reading_done = True
            self._wake_runner.set()
            await asyncio.wait_for(runner, timeout=self.shutdown_grace_s)
            if self._writes:
                await asyncio.wait_for(asyncio.gather(*self._writes), timeout=self.shutdown_grace_s)
            self._raise_if_a_write_failed()
        finally:
            loops = (reader, runner, beat, refresh)
            for task in loops:
                task.cancel()
            # Bounded: a loop cancelled inside a redis-py command can miss its cancellation (seen
            # with a blocking XREADGROUP) and must not hold the worker's exit.
            _, stuck = await asyncio.wait(loops, timeout=LOOP_STOP_S)
            for task in loops:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: a failed loop was reported above
            if stuck:
                log.warning("worker %s: %s did not stop within %.0fs", self.name,
                            ", ".join(sorted(task.get_name() for task in stuck)), LOOP_STOP_S)
            self.state = WorkerState.stopped
            with contextlib.suppress(BrokerError):
                await self._tally.flush(self._redis, self.model, self.version)
            with contextlib.suppress(BrokerError):
                await self.streams.leave()

    def _raise_if_a_write_failed(self) -> None:
        if self._failed_write is not None and self._failed_write.done():
            write = self._failed_write.result()
            log.error("worker %s: storing a batch's outcomes failed; the worker stops", self.name,
                      exc_info=write.exception())
            raise WorkerFailed("storing a batch's outcomes failed") from write.exception()

    def _write_done(self, write: asyncio.Task[None]) -> None:
        self._writes.discard(write)
        failed = not write.cancelled() and write.exception() is not None
        if failed and self._failed_write is not None and not self._failed_write.done():
            self._failed_write.set_result(write)

    # --- reading and batch formation -----------------------------------------------------------

    async def _read_loop(self) -> None:
        backoff = redis_backoff()
        while not self._stopping.is_set():
            try:
                await self._read_once()
                stop_if_cancelled()
                backoff.succeeded()
            except BrokerError as exc:
                stop_if_cancelled(exc)
                if not backoff.failures:
                    log.warning("worker %s lost Redis, retrying with backoff: %s", self.name, exc)
                await asyncio.sleep(backoff.failed())

    async def _read_once(self) -> None:
        # Cleared first: a batch completing or the model going idle during the reads below
        # must end the nap at the bottom, not be forgotten.
        self._wake_reader.clear()
        limit = held_limit(prefetch=self.prefetch, max_batch_size=self.max_batch_size,
                           items_per_s=self.rates.items_per_s(), claim_after_s=self.claim_after_s)
        room = limit - len(self.holdings)
        # Bulk entries never take the last batch of room: an online arrival is read (and, by its
        # priority in the batcher, run) after at most the forward pass under way.
        bulk_room = min(self.max_batch_size, room - min(self.max_batch_size, limit // 2))
        # While the version holds a backlog (queue.lua) every worker has work: a busy one waits on
        # the streams too, for the jobs of tenants with nothing held, which queue.lua writes there
        # directly, and keeps room for them out of what it releases (docs/ARCHITECTURE.md,
        # "Priority and fair sharing").
        backlog = self._turns.fair and any(self.streams.held_count.values())
        reserve = self._arrival_reserve if backlog else 0
        entries: list[Delivered] = []
        blocked = False
        if room > 0:
            await self._release_held("online", releasable(room, reserve))
            await self._release_held("bulk", releasable(bulk_room, reserve))
            entries = await self._reclaim(room) if self._claim_due() else []
            # After a read that came back short, an idle model's blocking read below answers at once
            # with whatever arrived since: the non-blocking reads would add two empty round trips
            # per job at low traffic, where such overhead weighs most (bench/worker_cost.py).
            if not entries and not (self._drained and self._runner_idle):
                entries = await self._read(["online"], room, block_ms=None)
                if not entries and bulk_room > 0:
                    entries = await self._read(["bulk"], bulk_room, block_ms=None)
            # Otherwise only a worker whose model is idle blocks on the streams: a new arrival then
            # goes to a worker that can start it now, not into the prefetch of one whose model is
            # busy. Nor while outcomes are being stored: their entries free room the moment the
            # store ends, and a read blocked on the online lane alone would not see the bulk backlog.
            block_ms = (READ_BLOCK_MS if self._runner_idle and not self._storing()
                        else self._busy_block_ms() if backlog else None)
            if not entries and block_ms is not None:
                blocked = True
                if bulk_room > 0:
                    entries = await self._read(["online", "bulk"], bulk_room, block_ms=block_ms)
                else:
                    entries = await self._read(["online"], room, block_ms=block_ms)
        if entries:
            await self._accept(entries)
            self._wake_runner.set()
            if self._drained and not any(self.streams.held_count.values()):
                await self._nap_while_busy()
        elif not blocked and (room <= 0 or not self._runner_idle or self._storing()):
            await _wait(self._wake_reader, READ_BLOCK_MS / 1000)

    async def _nap_while_busy(self) -> None:
        """After a read that emptied the streams: once the runner has taken what was just handed
        over, a busy model means the next read waits for the pass to end. Read again at once and
        the streams are as empty as a moment ago (two round trips a job at single-job rates);
        block on them and a busy model takes in arrivals an idle worker could start now."""
        await asyncio.sleep(0)  # the runner's turn: it takes the batch, or waits on its window
        if not self._runner_idle:
            await _wait(self._wake_reader, READ_BLOCK_MS / 1000)

    def _busy_block_ms(self) -> int:
        """How long a reader whose model is busy may wait on the streams: half the work its batcher
        holds, so that it is back to release more before the model runs out."""
        rate = self.rates.items_per_s()
        queued_ms = 1000.0 * len(self.batcher) / rate if rate > 0 else 0.0
        return int(min(READ_BLOCK_MS, max(BUSY_BLOCK_MIN_MS, queued_ms / 2)))

    def _storing(self) -> bool:
        """Whether outcomes are being stored. A store that has just ended may still be in `_writes`
        (its done-callback runs after the wake-up it sent the reader)."""
        return any(not write.done() for write in self._writes)

    async def _release_held(self, lane: Lane, room: int) -> None:
        """While the lane holds jobs (queue.lua), move up to `room` of them into the stream in fair
        turns, to be read next; the first release after the count rose learns the held queues."""
        if room <= 0 or not self.streams.held_count[lane]:
            return
        if not self.streams.held_queues[lane]:
            await self.streams.release(lane, [])
        plan = self._turns.release(lane, self.streams.held_queues[lane], want=room, now=self.clock())
        await self.streams.release(lane, plan)
        stop_if_cancelled()

    async def _read(self, lanes: Sequence[Lane], count: int, *, block_ms: int | None) -> list[Delivered]:
        found = await self.streams.read(lanes, count=count, block_ms=block_ms)
        self._drained = len(found) < count
        return found

    def _claim_due(self) -> bool:
        return self.clock() - self._last_claim >= self.claim_after_s / 2

    async def _reclaim(self, room: int) -> list[Delivered]:
        """Take over entries a dead worker left pending for longer than claim_after_s."""
        self._last_claim = self.clock()
        found = await self.streams.reclaim(room)
        if found:
            log.info("worker %s took over %d pending entries", self.name, len(found))
        return found

    async def _accept(self, entries: Sequence[Delivered]) -> None:
        """Claim each job (queued -> running) and hand the runnable ones to the batcher."""
        # XAUTOCLAIM can hand back an entry this worker still holds (a slow model): not twice.
        entries = [e for e in entries if e.entry_id not in self.holdings]
        if not entries:
            return
        # One round trip: the claim script also announces each change and settles (acknowledges,
        # dead-letters) the entries whose jobs will not run here.
        now = self.clock()
        self._claimed.clear()
        try:
            claims = await self.streams.claim(entries, now=now)
        finally:
            self._claimed.set()
        for delivered, claim in zip(entries, claims, strict=True):
            entry = delivered.entry
            if claim.verdict == ClaimVerdict.run:
                item = Item(id=delivered.entry_id, tenant=entry.tenant, cost=self._cost(claim.input, entry.cost),
                            enqueued_at=entry.enqueued_at, priority=LANE_PRIORITY[delivered.lane],
                            job_priority=entry.priority, payload=Delivery.claimed(delivered, claim, arrived_at=now))
                self._turns.saw(entry.tenant, entry.share, now)
                self.batcher.add(item)
                self.holdings.hold(item.id, delivered.lane)
            elif claim.verdict == ClaimVerdict.expired:
                self._metrics.finished[JobStatus.expired].inc()
            elif claim.verdict == ClaimVerdict.dead:
                self._metrics.finished[JobStatus.failed].inc()

    def _cost(self, job_input: Mapping[str, Any], hint: int) -> int:
        """The handler's own cost of an input where it declares one (a handler class's `cost`),
        else the API's hint."""
        own = self.handler.cost_of(job_input)
        return hint if own is None else own

    # --- running ---------------------------------------------------------------------------------

    async def _run_loop(self) -> None:
        while True:
            began = self.clock()
            if not self._claimed.is_set() and self._limit(self.clock()) is not None:
                # While tenants contend, entries read but not yet claimed are most likely a light
                # tenant's arrival: taking the next batch without them would make it wait one
                # more slice. The claim is one round trip away.
                await _wait(self._claimed, CLAIM_WAIT_S)
            batch = self._take()
            if batch is None:
                if self._reading_done and len(self.batcher) == 0:
                    return
                # No await since take(): nothing added meanwhile, so clearing loses no wake-up.
                self._wake_runner.clear()
                self._runner_idle = True
                self._wake_reader.set()
                deadline = self.batcher.next_deadline()
                await _wait(self._wake_runner, None if deadline is None else max(0.0, deadline - self.clock()))
                continue
            self._runner_idle = False
            # More work waits behind this pass: passes held or formed, or a last read that came
            # back full (a bulk backlog is read one batch at a time).
            backlogged = bool(self._ready) or len(self.batcher) > 0 or not self._drained
            async with self.slots.turn(version=(self.model, self.version),
                                       rank=rank(self.tier, batch.items[0].priority)) as turn:
                started = self.clock()
                left, outcomes, model_s = await self._run_pass(batch, started, turn)
                turn.used(model_s)
                self._turns.charge(batch, model_s, self.clock())
            self._tally.passed(Pass(size=len(batch.items), longest=batch.max_cost, seconds=model_s))
            if backlogged:
                # Wall time from this turn's start: what slows a backlog's drain besides the model
                # (the claim, the other versions' turns on the slots, the event loop's reads and
                # stores) counts, and the runner's idle waits, which a backlog has none of, do not.
                self.rates.drained(len(batch.items), self.clock() - began)
            if left:
                usage = pass_usage(self.handler, batch.items, model_s=model_s, idle_s=turn.idle_s, cores=self.cores,
                                   gpus=self.gpus)
                self._store(part(batch, left), outcomes, started, model_s, usage)

    def _limit(self, now: float) -> Callable[[str], int | None] | None:
        return self._turns.limit(now, items_per_s=self.rates.items_per_s())

    async def _run_pass(self, batch: Batch[Delivery], started: float,
                        turn: Turn) -> tuple[list[Item[Delivery]], list[Outcome], float]:
        """Run a batch on the model; answer its items not failed meanwhile by their own
        `run_timeout_s`, their outcomes, and the model seconds.

        A thread cannot be stopped. Past a job's `run_timeout_s` the job fails (`run_timeout`) and is
        stored at once while the pass runs on, holding the model, and what it answers for that job
        is dropped. Past `batch_timeout_s` every job left fails (`handler_timeout`) and then the
        worker, so a fresh process takes the rest instead of queueing behind a model that never
        answers.
        """
        # Jobs by reference are read before the pass and written after it (workers/references.py).
        work = asyncio.ensure_future(self.slots.run(self.references.run, self.handler, batch.items))
        left = list(batch.items)
        while True:
            limit = min([self.batch_timeout_s, *(item.payload.run_timeout_s for item in left
                                                 if item.payload.run_timeout_s is not None)])
            try:
                async with asyncio.timeout(max(0.0, started + limit - self.clock())):
                    outcomes, model_s = await asyncio.shield(work)
            except TimeoutError:
                if limit >= self.batch_timeout_s:
                    log.error("worker %s: a batch of %d ran past the %.0f s per-batch timeout; its jobs fail "
                              "(handler_timeout) and the worker exits", self.name, len(batch.items),
                              self.batch_timeout_s)
                    turn.used(self.batch_timeout_s)
                    if left:
                        await self._complete(part(batch, left), timed_out(len(left), self.batch_timeout_s),
                                             started, self.batch_timeout_s)
                    raise HandlerHung(f"a batch ran past the {self.batch_timeout_s:g} s per-batch timeout") from None
                over = [item for item in left if (item.payload.run_timeout_s or math.inf) <= limit]
                log.warning("worker %s: %d jobs ran past their run_timeout_s of %g s; they fail (run_timeout) "
                            "while the pass runs on", self.name, len(over), limit)
                self._store(part(batch, over), [run_timed_out(limit) for _ in over], started, limit)
                failed = {item.id for item in over}
                left = [item for item in left if item.id not in failed]
                continue
            kept = {item.id for item in left}
            return left, [outcome for item, outcome in zip(batch.items, outcomes, strict=True)
                          if item.id in kept], model_s

    def _store(self, batch: Batch[Delivery], outcomes: list[Outcome], started: float, model_s: float,
               usage: PassUsage | None = None) -> None:
        """Store a pass's outcomes in the background: the model goes on with the next batch."""
        task = asyncio.create_task(self._complete(batch, outcomes, started, model_s, usage))
        self._writes.add(task)
        task.add_done_callback(self._write_done)

    def _take(self) -> Batch[Delivery] | None:
        """The next batch to run: the batcher's most urgent, or its first forward pass when the
        handler splits batches itself (the other passes run next, before anything else but an
        online batch that is ready while they are bulk ones)."""
        now = self.clock()
        if self._ready:
            urgent = (self.batcher.take(now, max_priority=LANE_PRIORITY["online"], limit=self._limit(now))
                      if self._ready[0].items[0].priority > LANE_PRIORITY["online"] else None)
            if urgent is None:
                return self._ready.popleft()
            batch: Batch[Delivery] | None = urgent
        else:
            batch = self.batcher.take(now, limit=self._limit(now))
        if batch is None:
            return None
        first, *rest = forward_passes(self.handler, batch)
        self._ready.extendleft(reversed(rest))
        return first

    async def _complete(self, batch: Batch[Delivery], outcomes: list[Outcome], started: float, model_s: float,
                        usage: PassUsage | None = None) -> None:
        """Store every outcome, then acknowledge: a job is never acked before its outcome exists.

        A faulted item's entry is released unacknowledged: no longer refreshed, it goes idle and
        XAUTOCLAIM delivers it again after claim_after_s (to any worker, this one included).
        """
        finished = self.clock()
        size = len(batch.items)
        model_ms = round(model_s * 1000.0, 3)
        backoff = redis_backoff()
        while True:
            try:
                won = await self.results.store(batch, outcomes, started=started, finished=finished,
                                               model_ms=model_ms, usage=usage)
                break
            except BrokerError as exc:
                # Keep the results and retry: the model's work is not thrown away on a Redis blip.
                if not backoff.failures:
                    log.warning("storing a batch failed, retrying: %s", exc)
                await asyncio.sleep(backoff.failed())
        for item in batch.items:
            self.holdings.let_go(item.id)
        self._wake_reader.set()
        self.processed += size
        self.last_batch_size = size
        self.rates.stored(size, model_s)
        self._metrics.batch(batch, outcomes, won, started=started, model_s=model_s, finished=finished,
                            window_s=self.batcher.window_s(batch.items[0].priority), usage=usage)
        self._tally.served(at=finished, lane=batch.items[0].payload.lane,
                           costs=[item.cost for item, first in zip(batch.items, won, strict=True) if first])
        self._batch_log.failed([(item.payload, outcome.error) for item, outcome, first
                                in zip(batch.items, outcomes, won, strict=True) if first and outcome.error is not None])
        self._batch_log.stored(lane=batch.items[0].payload.lane, close_reason=batch.close_reason, model_ms=model_ms,
                               job_ids=[item.payload.job_id for item in batch.items],
                               request_ids=[item.payload.request_id for item in batch.items])

    # --- keeping what this worker holds -----------------------------------------------------------

    def _give_up(self, lost: set[str]) -> None:
        """Entries this worker no longer owns: acknowledged meanwhile, or taken over by another
        worker while this one stalled past claim_after_s. Those still waiting in the batcher are
        the other worker's to run now; a batch already on the model finishes, and FINISH keeps
        the first outcome (and its sample) of the two."""
        dropped = self.batcher.remove(lost)
        for item in dropped:
            self.holdings.let_go(item.id)
        if dropped:
            log.warning("worker %s gave up %d entries another worker took over", self.name, len(dropped))
            self._wake_reader.set()

    # --- heartbeat ---------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            held = self.holdings.per_lane()
            try:
                await self.streams.beat(Heartbeat(
                    state=self.state, items_per_s=self.rates.items_per_s(), batch_size=self.last_batch_size,
                    cold_start_s=self.cold_start_s, processed=self.processed, pid=os.getpid(), at=self.clock(),
                    precision=self.precision, precision_speedup=self.precision_speedup, group=self.group,
                    resident_bytes=self.resident_bytes, backlog_items_per_s=self.rates.backlog_items_per_s(),
                    held_online=held["online"], held_bulk=held["bulk"],
                ))
                await self._tally.flush(self._redis, self.model, self.version)
                stop_if_cancelled()
            except BrokerError as exc:
                stop_if_cancelled(exc)
            await asyncio.sleep(BEAT_EVERY_S)
