"""An API process's events: the broadcast channel, fanned out to its caches, and the channels of
the jobs its long-polls, SSE streams and many-job waits watch (`api/job_subscriptions.py`)."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from api.job_subscriptions import JobSubscriptions
from sluice.backoff import Backoff
from sluice.wire import events
from sluice.wire.jobs import FINAL_STATES

log = logging.getLogger(__name__)

# Called on the loop that wakes every long-poll, so it must not wait: a routing reload that it
# starts runs elsewhere (`RoutingCache.request_reload`), never inside it.
EventHandler = Callable[[events.Event], None]


class FinalWatch:
    """One waiter on many jobs, registered under each of their ids: set when any of them is
    announced final (a job going to `running` does not wake it), or by `wake_all`."""

    __slots__ = ("event", "finished")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.finished: set[str] = set()

    def take(self) -> set[str]:
        """The jobs announced final since the last take, and re-arm; empty after a `wake_all`,
        which may follow missed events, so the waiter must then re-read every job it watches."""
        finished, self.finished = self.finished, set()
        self.event.clear()
        return finished


class EventHub:
    def __init__(self, *, redis: aioredis.Redis, on_control: EventHandler) -> None:
        self.redis = redis
        self.on_control = on_control
        self._waiters: dict[str, set[asyncio.Event]] = defaultdict(set)
        # Woken only by a final state: a long-poll has nothing to answer on `running`.
        self._final_watches: dict[str, set[FinalWatch]] = defaultdict(set)
        self.jobs = JobSubscriptions(redis=redis, on_event=self._dispatch, on_gap=self._wake)
        self.connected = asyncio.Event()

    async def watch(self, job_id: str) -> asyncio.Event:
        """Wake on every change of the job (an event stream). Returns once the job's channel is
        subscribed: read the job after it, so a change between the read and the wait is not lost."""
        event = asyncio.Event()
        self._waiters[job_id].add(event)
        try:
            await self.jobs.join((job_id,))
        except BaseException:
            # A caller cancelled here never gets the event to unwatch.
            self.unwatch(job_id, event)
            raise
        return event

    def unwatch(self, job_id: str, event: asyncio.Event) -> None:
        waiters = self._waiters.get(job_id)
        if waiters is not None and event in waiters:
            waiters.discard(event)
            if not waiters:
                del self._waiters[job_id]
            self.jobs.leave((job_id,))

    async def watch_final(self, job_ids: Iterable[str]) -> FinalWatch:
        """One watch for one or many jobs, woken only when one of them is final (a long-poll);
        like `watch`, read them after it returns."""
        watch = FinalWatch()
        job_ids = list(dict.fromkeys(job_ids))
        for job_id in job_ids:
            self._final_watches[job_id].add(watch)
        try:
            await self.jobs.join(job_ids)
        except BaseException:
            self.unwatch_final(job_ids, watch)
            raise
        return watch

    def unwatch_final(self, job_ids: Iterable[str], watch: FinalWatch) -> None:
        left = []
        for job_id in dict.fromkeys(job_ids):
            watches = self._final_watches.get(job_id)
            if watches is not None and watch in watches:
                watches.discard(watch)
                if not watches:
                    del self._final_watches[job_id]
                left.append(job_id)
        self.jobs.leave(left)

    def wake_all(self) -> None:
        """Wake every long-poll and SSE stream, e.g. so they end when the process drains."""
        for waiters in self._waiters.values():
            for event in waiters:
                event.set()
        for watches in self._final_watches.values():
            for watch in watches:
                watch.event.set()

    def _wake(self, job_ids: list[str]) -> None:
        """Wake these jobs' waiters without naming a change: their channels had a gap."""
        for job_id in job_ids:
            for waiter in self._waiters.get(job_id, ()):
                waiter.set()
            for watch in self._final_watches.get(job_id, ()):
                watch.event.set()

    def _dispatch(self, event: events.JobChanged) -> None:
        for waiter in self._waiters.get(event.id, ()):
            waiter.set()
        if event.status in FINAL_STATES:
            for watch in self._final_watches.get(event.id, ()):
                watch.finished.add(event.id)
                watch.event.set()

    async def run(self) -> None:
        """Listen to the broadcast channel forever, reconnecting with capped, jittered backoff (never
        flooding the log); the job channels' connections close when it ends."""
        try:
            await self._listen()
        finally:
            await self.jobs.aclose()

    async def _listen(self) -> None:
        backoff = Backoff(base_s=0.1, cap_s=5.0, jitter=0.5)
        while True:
            pubsub = None
            try:
                pubsub = await events.subscribe(self.redis)
                self.connected.set()
                if backoff.failures:
                    log.info("event subscription restored")
                    # Routing may have changed while we were deaf.
                    self.on_control(events.Resync())
                backoff.succeeded()
                while True:
                    message = await pubsub.get_message(timeout=30.0)
                    if message is None or message.get("type") != "message":
                        continue
                    event = events.parse(message["data"])
                    if event is not None and not isinstance(event, events.JobChanged):
                        self.on_control(event)
            except asyncio.CancelledError:
                raise
            except (redis_errors.RedisError, redis_errors.RedisClusterException, OSError) as exc:
                self.connected.clear()
                if not backoff.failures:
                    log.warning("event subscription lost: %s", exc)
                await asyncio.sleep(backoff.failed())
            finally:
                try:
                    if pubsub is not None:
                        await pubsub.aclose()
                except (redis_errors.RedisError, OSError):
                    pass
