"""The webhook relay: outbox stream entries in, Celery tasks out.

The scripts that make a job final append `{delivery, job}` to their version's outbox
(`keys.outbox`) in the same atomic step (`sluice.wire.outbox`); batch callbacks go to the shared one
(`keys.WEBHOOK_OUTBOX`). The relay reads every outbox named in `keys.WEBHOOK_OUTBOXES` (rereading
the set every few seconds) and the shared one, each with the `relay` consumer group, publishes
one `deliver_webhook` task per entry with the delivery id as the task id, and only then
acknowledges the entry, so a relay that dies in between leaves the entry pending and another
relay takes it over with XAUTOCLAIM. Such an entry may be published twice; the task is a no-op
for a delivery that is done or already running (workers/delivery.py). Publishing is a plain callable,
so the relay runs and is tested without Celery.

The outboxes live in different slots, so the relay reads them one command each (pipelined), not
with one blocking XREADGROUP over all: with nothing to relay it sleeps `idle_s` between reads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis

from sluice.backoff import Backoff
from sluice.errors import BrokerError
from sluice.wire import keys
from sluice.wire.connections import reply_text, translate_redis_errors
from sluice.wire.outbox import OutboxEntry
from sluice.wire.streams import ensure_group

log = logging.getLogger(__name__)

Publish = Callable[[str, str], None]  # (delivery id, job id); raises BrokerError when it cannot
Entry = tuple[bytes, dict[bytes, bytes]]


def relay_name() -> str:
    return f"relay-{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


class OutboxRelay:
    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        publish: Publish,
        name: str | None = None,
        claim_after_s: float = 30.0,
        batch_size: int = 100,
        idle_s: float = 0.05,
        discover_s: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.publish = publish
        self.name = name or relay_name()
        self.claim_after_s = claim_after_s
        self.batch_size = batch_size
        self.idle_s = idle_s
        self.discover_s = discover_s
        self.clock = clock
        self.relayed = 0
        # A threading.Event: the Celery worker stops the relay from its own thread.
        self._stopping = threading.Event()
        self._last_claim = 0.0
        self._last_discovery = -discover_s
        self._outboxes: list[str] = []
        # Entries this consumer read but could not publish are re-read from its own pending lists.
        self._own_pending = True

    def request_stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        backoff = Backoff(base_s=0.1, cap_s=5.0)
        grouped = False
        while not self._stopping.is_set():
            try:
                if not grouped:
                    await self.ensure_group()
                    grouped = True
                await self.relay_once()
                backoff.succeeded()
            except Exception as exc:
                # A relay that stopped would silently stop every webhook: log, back off, go on.
                # (A Redis that lost its data also lost the groups: make them all again.)
                grouped = False
                self._outboxes = []
                if not backoff.failures:
                    log.warning("relay %s: %s; retrying with backoff", self.name, exc,
                                exc_info=not isinstance(exc, BrokerError))
                await asyncio.sleep(backoff.failed())

    async def ensure_group(self) -> None:
        """Learn the outboxes (`keys.WEBHOOK_OUTBOXES`, and the shared one) and make the relay
        group on each one not known yet."""
        self._last_discovery = self.clock()
        with translate_redis_errors():
            named = await self.redis.smembers(keys.WEBHOOK_OUTBOXES)
        outboxes = [keys.WEBHOOK_OUTBOX, *sorted(reply_text(name) for name in named)]
        known = set(self._outboxes)
        for outbox in (outbox for outbox in outboxes if outbox not in known):
            await ensure_group(self.redis, outbox, keys.RELAY_GROUP)
        self._outboxes = outboxes

    async def relay_once(self, *, block: bool = True) -> int:
        """Publish one batch of entries (sleeping idle_s first when there are none); answer how many."""
        if self.clock() - self._last_discovery >= self.discover_s:
            await self.ensure_group()
        entries: list[tuple[str, Entry]] = []
        if self.clock() - self._last_claim >= self.claim_after_s / 2:
            entries = await self._reclaim()
        if not entries and self._own_pending:
            entries = await self._read("0")
            self._own_pending = bool(entries)
        if not entries:
            entries = await self._read(">")
        if not entries:
            if block:
                await asyncio.sleep(self.idle_s)
            return 0
        published: list[tuple[str, bytes]] = []
        try:
            for outbox, (entry_id, fields) in entries:
                entry = OutboxEntry.from_fields(fields)
                if entry is not None:
                    await asyncio.to_thread(self.publish, entry.delivery_id, entry.job_id)
                else:
                    log.warning("relay %s: dropping malformed outbox entry %s", self.name, entry_id.decode())
                published.append((outbox, entry_id))
        except BaseException:
            self._own_pending = True
            raise
        finally:
            await self._ack(published)
        self.relayed += len(published)
        return len(published)

    async def _read(self, start: str) -> list[tuple[str, Entry]]:
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for outbox in self._outboxes:
                pipe.xreadgroup(keys.RELAY_GROUP, self.name, {outbox: start}, count=self.batch_size)
            replies: list[Any] = await pipe.execute()
        return [(outbox, (entry_id, fields))
                for outbox, reply in zip(self._outboxes, replies, strict=True)
                for _, messages in reply or [] for entry_id, fields in messages if fields]

    async def _reclaim(self) -> list[tuple[str, Entry]]:
        """Take over what a dead relay read and never acknowledged; forget long-gone relays."""
        self._last_claim = self.clock()
        idle_ms = int(self.claim_after_s * 1000)
        found: list[tuple[str, Entry]] = []
        for outbox in self._outboxes:
            with translate_redis_errors():
                reply = await self.redis.xautoclaim(outbox, keys.RELAY_GROUP, self.name, min_idle_time=idle_ms,
                                                    start_id="0-0", count=self.batch_size)
                consumers = await self.redis.xinfo_consumers(outbox, keys.RELAY_GROUP)
                for consumer in consumers:
                    name = reply_text(consumer["name"])
                    if name != self.name and consumer["pending"] == 0 and consumer["idle"] > 20 * idle_ms:
                        await self.redis.xgroup_delconsumer(outbox, keys.RELAY_GROUP, name)
            found += [(outbox, (entry_id, fields)) for entry_id, fields in reply[1] if fields]
        if found:
            log.info("relay %s took over %d outbox entries", self.name, len(found))
        return found

    async def _ack(self, entries: Sequence[tuple[str, bytes]]) -> None:
        if not entries:
            return
        by_outbox: dict[str, list[bytes]] = {}
        for outbox, entry_id in entries:
            by_outbox.setdefault(outbox, []).append(entry_id)
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for outbox, entry_ids in by_outbox.items():
                pipe.xack(outbox, keys.RELAY_GROUP, *entry_ids)
                # Acknowledged entries are deleted, so XLEN of an outbox is what is still to relay.
                pipe.xdel(outbox, *entry_ids)
            await pipe.execute()
