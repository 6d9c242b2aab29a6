"""The job channels one API process listens to: a job's sharded channel only while a long-poll, an
event stream or a many-job wait of this process watches the job, so a replica parses the events
of its own waiters' jobs and no others.

Surprising parts:
- `join` returns only once the server has confirmed the subscription (or the connection failed):
  a waiter reads its job after joining, and a read that the server runs before the SSUBSCRIBE
  could miss a final state written between the two.
- Every SSUBSCRIBE and SUNSUBSCRIBE goes out through one queue, in the order the waiters came and
  went, and each confirmation answers the oldest command of its channel still unanswered: a job
  left and joined again in quick succession is not mistaken for subscribed by an earlier reply.
- On a Redis Cluster a channel lives on the node that owns the job's slot, so there is one
  pub/sub connection per node in use. A lost connection, a slot that moved (the server then
  unsubscribes its channels itself) or a client that resubscribed by itself after a reconnect is
  a gap: the channels are subscribed again, then `on_gap` names their jobs so that their waiters
  re-read them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from sluice.backoff import Backoff
from sluice.wire import events
from sluice.wire.connections import is_cluster, reply_text

log = logging.getLogger(__name__)

# How long a joining waiter waits for the server's confirmation before it reads the job anyway; a
# confirmation this late means the connection is failing, and its gap handling wakes the waiter.
CONFIRM_TIMEOUT_S = 5.0
# How long a channel stays subscribed after its last waiter left: its unsubscribe goes out with the
# others of that time, in one command, and a waiter that comes back to the job meanwhile (a client
# polling again after its wait ran out, the next turn of an event stream) finds it ready. A long-poll
# mostly ends because its job is final, and a final job is announced no more, so lingering costs
# next to no messages.
LINGER_S = 1.0
_FAILURES = (redis_errors.RedisError, redis_errors.RedisClusterException, OSError)


class _Connection:
    """One server's pub/sub connection, and the task that reads it."""

    def __init__(self, *, name: str, pool: aioredis.ConnectionPool) -> None:
        self.name = name
        self.client = aioredis.Redis.from_pool(pool)
        self.pubsub = self.client.pubsub()
        self.reader: asyncio.Task[None] | None = None

    async def aclose(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, *_FAILURES):
                await self.reader
        with contextlib.suppress(*_FAILURES):
            await self.pubsub.aclose()  # type: ignore[no-untyped-call]
            await self.client.aclose()


def _pool(connection_class: Any, connection_kwargs: dict[str, Any]) -> aioredis.ConnectionPool:
    # Its own connection, and no health check: redis-py's check reads a PONG on the connection that
    # the reader is reading; the reader pings an idle connection itself instead.
    return aioredis.ConnectionPool(connection_class=connection_class,
                                   **{**connection_kwargs, "health_check_interval": 0})


class JobSubscriptions:
    def __init__(self, *, redis: aioredis.Redis, on_event: Callable[[events.JobChanged], None],
                 on_gap: Callable[[list[str]], None]) -> None:
        self.redis = redis
        self.on_event = on_event
        self.on_gap = on_gap
        # The job messages this process has read and parsed: what sharding keeps low.
        self.received = 0
        self._jobs: dict[str, str] = {}  # a channel joined or parting -> its job
        self._joined: Counter[str] = Counter()  # a channel -> its waiters
        self._parting: set[str] = set()  # subscribed, no waiter left, unsubscribed at the next flush
        self._flush: asyncio.TimerHandle | None = None
        self._ready: dict[str, asyncio.Future[bool]] = {}  # a channel -> its newest SSUBSCRIBE's answer
        self._unanswered: dict[str, deque[asyncio.Future[bool]]] = {}
        self._leaving: Counter[str] = Counter()  # SUNSUBSCRIBEs not answered yet
        self._where: dict[str, _Connection] = {}
        self._connections: dict[str, _Connection] = {}
        self._outbox: deque[tuple[bool, str]] = deque()  # (subscribe?, channel), in call order
        self._sender: asyncio.Task[None] | None = None
        self._repairs: set[asyncio.Task[None]] = set()
        self._backoff = Backoff(base_s=0.1, cap_s=5.0, jitter=0.5)

    @property
    def channels(self) -> int:
        return len(self._joined)

    async def join(self, job_ids: Iterable[str]) -> None:
        """Subscribe to these jobs' channels, one more waiter each; returns once every one of them
        is confirmed (or failed, or after `CONFIRM_TIMEOUT_S`)."""
        waiting = [self._take(job_id) for job_id in job_ids]
        answers = [answer for answer in waiting if not answer.done()]
        if answers:
            await asyncio.wait(answers, timeout=CONFIRM_TIMEOUT_S)

    def leave(self, job_ids: Iterable[str]) -> None:
        """One waiter fewer on each of these jobs; a channel whose last waiter left is unsubscribed
        within `LINGER_S`."""
        for job_id in job_ids:
            channel = events.job_channel(self.redis, job_id)
            if self._joined[channel] > 1:
                self._joined[channel] -= 1
                continue
            del self._joined[channel]
            self._parting.add(channel)
        if self._parting and self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(LINGER_S, self._part)

    def _part(self) -> None:
        self._flush = None
        for channel in self._parting:
            self._jobs.pop(channel, None)
            self._ready.pop(channel, None)
            self._send(False, channel)
        self._parting.clear()

    def _take(self, job_id: str) -> asyncio.Future[bool]:
        channel = events.job_channel(self.redis, job_id)
        self._joined[channel] += 1
        self._parting.discard(channel)
        ready = self._ready.get(channel)
        if ready is None:
            self._jobs[channel] = job_id
            ready = self._subscribe(channel)
        return ready

    def _subscribe(self, channel: str) -> asyncio.Future[bool]:
        ready: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._ready[channel] = ready
        self._unanswered.setdefault(channel, deque()).append(ready)
        self._send(True, channel)
        return ready

    def _send(self, subscribe: bool, channel: str) -> None:
        if not subscribe:
            self._leaving[channel] += 1
        self._outbox.append((subscribe, channel))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_all(), name="job-subscriptions")

    async def _send_all(self) -> None:
        """Send the queued commands in order, runs of one kind to one server as one command."""
        while self._outbox:
            subscribe, channel = self._outbox.popleft()
            run = [channel]
            try:
                connection = await self._connection(channel)
            except _FAILURES as exc:
                self._lost(None, run, exc)
                continue
            while self._outbox and self._outbox[0][0] == subscribe and \
                    self._route(self._outbox[0][1]) == connection.name:
                run.append(self._outbox.popleft()[1])
            if subscribe:
                for each in run:
                    self._where[each] = connection
            try:
                if subscribe:
                    await connection.pubsub.ssubscribe(*run)
                    if connection.reader is None:
                        connection.reader = asyncio.create_task(self._read(connection), name="job-events")
                else:
                    await connection.pubsub.sunsubscribe(*run)
            except _FAILURES as exc:
                self._lost(connection, run, exc)

    def _route(self, channel: str) -> str:
        """The name of the server that holds a channel: the one server, or its slot's node."""
        if not is_cluster(self.redis):
            return ""
        return str(self.redis.get_node_from_key(channel).name)  # type: ignore[attr-defined]

    async def _connection(self, channel: str) -> _Connection:
        if is_cluster(self.redis):
            await self.redis.initialize()  # type: ignore[attr-defined]
        name = self._route(channel)
        connection = self._connections.get(name)
        if connection is None:
            server: Any = self.redis.get_node_from_key(channel) if name else self.redis.connection_pool  # type: ignore[attr-defined]
            connection = _Connection(name=name, pool=_pool(server.connection_class, server.connection_kwargs))
            self._connections[name] = connection
        return connection

    async def _read(self, connection: _Connection) -> None:
        try:
            while True:
                message = await connection.pubsub.get_message(timeout=30.0)
                if message is None:
                    await connection.pubsub.ping()  # its answer is read here: it proves the link
                else:
                    self._handle(connection, message)
        except _FAILURES as exc:
            self._lost(connection, [], exc)

    def _handle(self, connection: _Connection, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "smessage":
            self.received += 1
            event = events.parse(message["data"])
            if isinstance(event, events.JobChanged):
                self.on_event(event)
            return
        channel = reply_text(message["channel"])
        if kind == "ssubscribe":
            unanswered = self._unanswered.get(channel)
            if unanswered:
                answer = unanswered.popleft()
                if not unanswered:
                    del self._unanswered[channel]
                if not answer.done():
                    answer.set_result(True)
                self._backoff.succeeded()
            elif channel in self._joined:
                # The client reconnected and resubscribed by itself: events may have been lost.
                self.on_gap([self._jobs[channel]])
        elif kind == "sunsubscribe":
            if self._leaving[channel] > 0:
                self._leaving[channel] -= 1
                if not self._leaving[channel]:
                    del self._leaving[channel]
                if channel not in self._ready and self._where.get(channel) is connection:
                    del self._where[channel]  # no subscription of it made since
            elif channel in self._jobs:
                # The server dropped it: its slot moved to another node.
                self._lost(None, [channel], None)

    def _lost(self, connection: _Connection | None, channels: list[str], exc: BaseException | None) -> None:
        """Forget a failed connection with its channels, or channels the server dropped, and
        subscribe the ones still joined again; their jobs go to `on_gap` once that is confirmed."""
        if exc is not None and not self._backoff.failures:
            log.warning("job event subscription lost: %s", exc)
        lost = set(channels)
        if connection is not None:
            lost.update(channel for channel, there in self._where.items() if there is connection)
            if self._connections.get(connection.name) is connection:
                del self._connections[connection.name]
            self._spawn(connection.aclose())
        jobs = []
        for channel in lost:
            self._where.pop(channel, None)
            self._leaving.pop(channel, None)
            for answer in self._unanswered.pop(channel, ()):
                if not answer.done():
                    answer.set_result(False)  # the joiner reads its job; the repair wakes it
            self._ready.pop(channel, None)
            if channel in self._parting:
                self._parting.discard(channel)
                self._jobs.pop(channel, None)
            elif channel in self._jobs:
                jobs.append(self._jobs[channel])
        if jobs:
            self._spawn(self._resubscribe(jobs))

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._repairs.add(task)
        task.add_done_callback(self._repairs.discard)

    async def _resubscribe(self, job_ids: list[str]) -> None:
        """One try, after a backoff shared by every try; a failed one starts the next."""
        await asyncio.sleep(self._backoff.failed())
        if is_cluster(self.redis):
            # The slot map may be what changed.
            with contextlib.suppress(*_FAILURES):
                await self.redis.nodes_manager.initialize()  # type: ignore[attr-defined]
        answers = {}
        for job_id in job_ids:
            channel = events.job_channel(self.redis, job_id)
            if channel in self._joined:
                answers[job_id] = self._ready.get(channel) or self._subscribe(channel)
        if answers:
            await asyncio.wait(answers.values(), timeout=CONFIRM_TIMEOUT_S)
        restored = [job_id for job_id, answer in answers.items() if answer.done() and answer.result()]
        if restored:
            if not self._backoff.failures:
                log.info("job event subscription restored")
            self.on_gap(restored)

    async def aclose(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        tasks = [task for task in (self._sender, *self._repairs) if task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, *_FAILURES):
                await task
        for connection in list(self._connections.values()):
            await connection.aclose()
        self._connections.clear()
