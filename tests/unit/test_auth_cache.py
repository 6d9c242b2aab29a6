"""The API's key cache under concurrency: requests that arrive together with one key not yet cached
wait on one lookup, not one each (a burst of a new client's requests, or every request after the
entry expires, would otherwise each take a registry connection and a thread)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from api.caches import AuthCache
from sluice.errors import RegistryUnavailable, ServiceUnavailable, Unauthenticated
from sluice.registry.tenants import KeyInfo

KEY = KeyInfo(key_id="key-1", tenant="acme", is_admin=False)


class Lookups:
    """A lookup that counts its calls and holds each until released, so callers overlap."""

    def __init__(self, answer: KeyInfo | None | Exception = KEY) -> None:
        self.answer = answer
        self.calls: list[str] = []
        self.release = threading.Event()

    def __call__(self, raw_key: str) -> KeyInfo | None:
        self.calls.append(raw_key)
        assert self.release.wait(10), "never released"
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


async def _together(cache: AuthCache, lookups: Lookups, raw_keys: list[str]) -> list[object]:
    tasks = [asyncio.create_task(cache.authenticate(raw_key)) for raw_key in raw_keys]
    await asyncio.sleep(0.2)  # every request is waiting before the lookup answers
    lookups.release.set()
    return await asyncio.gather(*tasks, return_exceptions=True)


async def test_concurrent_requests_with_one_uncached_key_make_one_lookup() -> None:
    lookups = Lookups()
    cache = AuthCache(lookup=lookups, ttl_s=60)
    results = await _together(cache, lookups, ["sk-one"] * 50)
    assert results == [KEY] * 50
    assert lookups.calls == ["sk-one"]
    assert await cache.authenticate("sk-one") == KEY
    assert lookups.calls == ["sk-one"], "then it is cached"


async def test_distinct_keys_are_looked_up_each_once() -> None:
    lookups = Lookups()
    cache = AuthCache(lookup=lookups, ttl_s=60)
    await _together(cache, lookups, ["sk-a", "sk-b"] * 10)
    assert sorted(lookups.calls) == ["sk-a", "sk-b"]


async def test_an_unknown_key_is_refused_to_every_waiter_after_one_lookup() -> None:
    lookups = Lookups(answer=None)
    cache = AuthCache(lookup=lookups, ttl_s=60)
    results = await _together(cache, lookups, ["sk-nope"] * 10)
    assert all(isinstance(result, Unauthenticated) for result in results), results
    assert lookups.calls == ["sk-nope"]


async def test_a_failed_lookup_fails_every_waiter_and_the_next_request_tries_again() -> None:
    lookups = Lookups(answer=RegistryUnavailable("Postgres is unreachable"))
    cache = AuthCache(lookup=lookups, ttl_s=60)
    results = await _together(cache, lookups, ["sk-one"] * 10)
    assert all(isinstance(result, ServiceUnavailable) for result in results), results
    assert lookups.calls == ["sk-one"]
    lookups.answer = KEY
    assert await cache.authenticate("sk-one") == KEY
    assert lookups.calls == ["sk-one", "sk-one"]


async def test_a_caller_that_gives_up_does_not_fail_the_others() -> None:
    lookups = Lookups()
    cache = AuthCache(lookup=lookups, ttl_s=60)
    first = asyncio.create_task(cache.authenticate("sk-one"))
    await asyncio.sleep(0.1)
    second = asyncio.create_task(cache.authenticate("sk-one"))
    await asyncio.sleep(0.1)
    first.cancel()  # its client hung up
    await asyncio.sleep(0.1)
    lookups.release.set()
    assert await second == KEY
    with pytest.raises(asyncio.CancelledError):
        await first
    assert lookups.calls == ["sk-one"]


async def test_a_key_forgotten_during_its_lookup_is_not_cached_from_it() -> None:
    lookups = Lookups()
    cache = AuthCache(lookup=lookups, ttl_s=60)
    waiting = asyncio.create_task(cache.authenticate("sk-one"))
    await asyncio.sleep(0.1)
    cache.forget()  # revoked while the lookup ran
    lookups.release.set()
    assert await waiting == KEY
    await cache.authenticate("sk-one")
    assert lookups.calls == ["sk-one", "sk-one"]
