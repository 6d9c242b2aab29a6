"""The API's views of the registry: routing and API keys, cached so Postgres is off the hot path.

Both keep serving their last good answer while Postgres is unreachable; the routing cache says
so through `degraded`, which `/readyz` reports.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from anyio import to_thread

from sluice.errors import RegistryError, ServiceUnavailable, Unauthenticated
from sluice.registry import routing_table, tenants
from sluice.registry.store import Registry
from sluice.routing import RoutingSnapshot

log = logging.getLogger(__name__)


class RoutingCache:
    def __init__(self, *, registry: Registry, refresh_s: float) -> None:
        self.registry = registry
        self.refresh_s = refresh_s
        self.snapshot: RoutingSnapshot | None = None
        self.loaded_at: float | None = None
        self.degraded: str | None = None
        self._lock = asyncio.Lock()
        self._wanted = asyncio.Event()

    @property
    def loaded(self) -> bool:
        return self.snapshot is not None

    def current(self) -> RoutingSnapshot:
        if self.snapshot is None:
            raise ServiceUnavailable("the routing table has not been loaded yet")
        return self.snapshot

    async def reload(self) -> bool:
        """Load a fresh snapshot; on failure keep the last one and mark the cache degraded."""
        async with self._lock:
            try:
                snapshot = await to_thread.run_sync(self._read)
            except RegistryError as exc:
                if self.degraded is None:
                    log.warning("routing reload failed, serving the cached table: %s", exc)
                self.degraded = str(exc)
                return False
            self.snapshot = snapshot
            self.loaded_at = time.time()
            self.degraded = None
            return True

    def _read(self) -> RoutingSnapshot:
        with self.registry.session() as session:
            return routing_table.routing_snapshot(session)

    def request_reload(self) -> None:
        """Have `refresh_forever` reload soon, without waiting for it. Requests made while a reload
        runs are folded into one more after it, which reads whatever they announced."""
        self._wanted.set()

    async def refresh_forever(self) -> None:
        """Reload on request, and every refresh_s as the safety net behind the events: a missed
        event heals within refresh_s."""
        while True:
            # Retry sooner while degraded so recovery is noticed quickly.
            period = min(self.refresh_s, 2.0) if self.degraded else self.refresh_s
            try:
                await asyncio.wait_for(self._wanted.wait(), timeout=period)
            except TimeoutError:
                pass
            self._wanted.clear()
            await self.reload()


@dataclass(frozen=True, slots=True)
class _Entry:
    key: tenants.KeyInfo | None
    expires_at: float


class AuthCache:
    """Key hash -> tenant, with positive and short negative caching. `lookup` resolves a raw key
    (blocking: it runs on a worker thread), usually `registry_lookup(registry)`.

    Single flight: requests that find the same key uncached at once share one lookup, run as a
    task of its own, so a caller that gives up (its client hung up) takes it from no one."""

    NEGATIVE_TTL_S = 5.0

    def __init__(self, *, lookup: Callable[[str], tenants.KeyInfo | None], ttl_s: float) -> None:
        self.lookup = lookup
        self.ttl_s = ttl_s
        self._entries: dict[str, _Entry] = {}
        self._flights: dict[str, asyncio.Task[_Entry]] = {}

    def forget(self, key_hash: str | None = None) -> None:
        """A lookup in flight may have read the key before its revocation: it stores nothing."""
        if key_hash is None:
            self._entries.clear()
            self._flights.clear()
        else:
            self._entries.pop(key_hash, None)
            self._flights.pop(key_hash, None)

    async def authenticate(self, raw_key: str) -> tenants.KeyInfo:
        digest = tenants.hash_key(raw_key)
        entry = self._entries.get(digest)
        if entry is None or entry.expires_at <= time.monotonic():
            try:
                entry = await asyncio.shield(self._flight(digest, raw_key))
            except RegistryError as exc:
                if entry is not None and entry.key is not None:
                    return entry.key  # Postgres is down: a key we knew stays valid until it is back.
                raise ServiceUnavailable("the registry is unreachable and this key is not cached") from exc
        if entry.key is None:
            raise Unauthenticated("the API key is not valid")
        return entry.key

    def _flight(self, digest: str, raw_key: str) -> asyncio.Task[_Entry]:
        flight = self._flights.get(digest)
        if flight is None:
            flight = asyncio.create_task(self._resolve(digest, raw_key), name="auth-lookup")
            self._flights[digest] = flight
            flight.add_done_callback(lambda done: self._landed(digest, done))
        return flight

    def _landed(self, digest: str, flight: asyncio.Task[_Entry]) -> None:
        if self._flights.get(digest) is flight:
            del self._flights[digest]
        if not flight.cancelled():
            flight.exception()  # retrieved here, should every waiter have given up

    async def _resolve(self, digest: str, raw_key: str) -> _Entry:
        found = await to_thread.run_sync(self.lookup, raw_key)
        ttl = self.ttl_s if found is not None else min(self.ttl_s, self.NEGATIVE_TTL_S)
        entry = _Entry(found, time.monotonic() + ttl)
        if self._flights.get(digest) is asyncio.current_task():
            if len(self._entries) > 100_000:
                self._entries.clear()
            self._entries[digest] = entry
        return entry


def registry_lookup(registry: Registry) -> Callable[[str], tenants.KeyInfo | None]:
    def lookup(raw_key: str) -> tenants.KeyInfo | None:
        with registry.session() as session:
            return tenants.lookup_key(session, raw_key)

    return lookup
