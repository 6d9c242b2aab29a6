"""Rollback propagation across two API replicas: from the rollback's answer until both
replicas route unpinned jobs to the stable version again. Target: under 100 ms.

Two `sluice api` processes (A and B) share a fresh database (`BenchPlatform`) and a
redis-server of the bench's own (`--shared-redis`: a DB index of the system Redis instead). A
synthetic model has versions `stable` and `canary`, with all weight on `canary`. Each round
posts `POST /v1/models/{m}/rollback` to A; from the moment its answer arrives, both replicas are
probed at once, each by one submit after another of an unpinned job (routing keys rotate), until
a 202 names `stable` (routing is decided at submit time). Then the canary weight is restored
through A and both are probed until they route to `canary` again. One synthetic worker per
version runs the probe jobs; without live workers the API's circuit breakers would open after
their grace period and move traffic on their own.

A propagation time is the arrival of the first answer naming the new version (an upper bound:
the change happened between the sending of the last probe that still named the old version and
that arrival; both ends are kept in the JSON). The probe's own round trip is the resolution.

With `--direct-rounds N` the rollback is also written straight into the registry, where nobody
announces it: the replicas then learn of it only from their periodic reload (the safety net,
`SLUICE_ROUTING_REFRESH_S`, 30 s by default). That is the "without the event channel" figure,
measured without a switch in the API. Pub/sub channels ignore the Redis DB index, so on a shared
Redis a routing change announced by anyone else reloads our replicas too (hence the private
server): the bench listens on the channel and leaves out of the direct figures every round
during which such a foreign announcement arrived (announced rounds only count them).

Run: ``python -m bench.rollback [--rounds 50] [--direct-rounds 5] [--shared-redis]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from bench.machine import CpuWindow, cpu_seconds
from bench.output import command_line, fmt, table, write_json
from bench.platform_harness import BenchPlatform
from bench.processes import free_port, private_redis, sigterm_as_interrupt, stop_processes

MODEL = "rollback-bench"
ROUTING_KEYS = ("k0", "k1", "k2", "k3")
SYNTHETIC_SHA = "0" * 64
# The test sessions' lock on a Redis DB (tests/conftest.py): holding it keeps them off ours.
REDIS_DB_LOCK = "sluice-test:redis-db:{db}"
REDIS_DBS = (10, 9, 8, 7, 6, 5, 4, 3, 2, 1)


@dataclass
class TwoApis(BenchPlatform):
    """The bench platform with a second API process (replica B) on its own port."""

    api_b_port: int = field(init=False, default=0)
    api_b: Any = field(init=False, default=None)

    @property
    def api_b_url(self) -> str:
        return f"http://127.0.0.1:{self.api_b_port}"

    def start(self) -> None:
        super().start()
        self.api_b_port = free_port()
        self.api_b = self._spawn("api-b", ["api", "--port", str(self.api_b_port)])

    def check_alive(self) -> None:
        super().check_alive()
        if self.api_b is not None and self.api_b.poll() is not None:
            raise RuntimeError(f"api-b exited with {self.api_b.returncode}; see {self.home / 'logs'}")

    def close(self) -> None:
        if self.api_b is not None:
            with contextlib.suppress(Exception):
                stop_processes([self.api_b])
            self.api_b = None
        super().close()


@contextlib.contextmanager
def claimed_redis_db(pinned: int | None) -> Iterator[tuple[str, int]]:
    """The system Redis and a DB index no test session uses meanwhile (BenchPlatform flushes it)."""
    import redis

    base = redis.Redis.from_url(BenchPlatform.redis_base)
    token = f"bench.rollback:{socket.gethostname()}:{os.getpid()}"
    candidates = (pinned,) if pinned is not None else REDIS_DBS
    held = next((db for db in candidates if base.set(REDIS_DB_LOCK.format(db=db), token, nx=True, ex=3600)), None)
    try:
        if held is None:
            raise RuntimeError(f"Redis DB {candidates} held by test sessions; pass another --redis-db")
        yield BenchPlatform.redis_base, held
    finally:
        if held is not None and base.get(REDIS_DB_LOCK.format(db=held)) == token.encode():
            base.delete(REDIS_DB_LOCK.format(db=held))
        base.close()


@dataclass(frozen=True, slots=True)
class Probe:
    """When one replica was seen routing to the new version, in ms after the change."""

    upper_ms: float  # arrival of the first answer naming the new version
    lower_ms: float  # sending of the last probe that still named the old one (0 if none)
    probes: int
    rtt_ms: float  # round trip of the deciding probe


async def probe_until(client: httpx.AsyncClient, url: str, want: str, t0: float, *, timeout_s: float,
                      pause_s: float = 0.0) -> Probe:
    """Submit unpinned jobs to one replica until one is routed to `want`."""
    last_old_sent: float | None = None
    n = 0
    while True:
        sent = time.perf_counter()
        response = await client.post(f"{url}/v1/models/{MODEL}/jobs", json={
            "input": {"tokens": 1}, "routing_key": ROUTING_KEYS[n % len(ROUTING_KEYS)]})
        got = time.perf_counter()
        n += 1
        if response.status_code != 202:
            raise RuntimeError(f"probe to {url}: {response.status_code} {response.text[:300]}")
        if response.json()["version"] == want:
            lower = 0.0 if last_old_sent is None else max(0.0, last_old_sent - t0)
            return Probe(upper_ms=(got - t0) * 1e3, lower_ms=lower * 1e3, probes=n, rtt_ms=(got - sent) * 1e3)
        last_old_sent = sent
        if got - t0 > timeout_s:
            raise TimeoutError(f"{url} still routes away from {want!r} {timeout_s:.0f}s after the change")
        if pause_s:
            await asyncio.sleep(pause_s)


@dataclass(frozen=True, slots=True)
class Round:
    variant: str
    index: int
    request_ms: float  # the rollback request's own round trip (or the registry write)
    a: Probe
    b: Probe
    restore_a: Probe
    restore_b: Probe
    foreign_events: int  # routing announcements of other models between the change and both switching

    @property
    def both_ms(self) -> float:
        return max(self.a.upper_ms, self.b.upper_ms)


class ForeignAnnouncements:
    """Arrival times of routing announcements on `sluice:events` that are not about our model."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.arrivals: list[float] = []
        self.subscribed = asyncio.Event()

    async def listen(self) -> None:
        import redis.asyncio as aioredis

        from sluice.wire.events import channel as events_channel

        client = aioredis.Redis.from_url(self.redis_url)
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(events_channel(client))
            self.subscribed.set()
            while True:
                message = await pubsub.get_message(timeout=5.0)
                if message is None or message.get("type") != "message":
                    continue
                with contextlib.suppress(ValueError, TypeError):
                    event = json.loads(message["data"])
                    if event.get("type") in ("routing", "resync") and event.get("model") != MODEL:
                        self.arrivals.append(time.perf_counter())
        finally:
            await pubsub.aclose()
            await client.aclose()

    def between(self, start: float, end: float) -> int:
        return sum(1 for t in self.arrivals if start <= t <= end)


def summary(samples: Sequence[float]) -> dict[str, float | None]:
    """Exact type-7 percentiles. With 50 samples the p99 lies between the two largest."""
    import numpy as np

    data = np.asarray(samples, dtype=float)
    if len(data) == 0:
        return {"n": 0, "p50": None, "p95": None, "p99": None, "max": None}
    out: dict[str, float | None] = {"n": float(len(data))}
    for q in (50, 95, 99):
        out[f"p{q}"] = float(np.percentile(data, q, method="linear"))
    out["max"] = float(data.max())
    return out


class Bench:
    def __init__(self, *, platform: TwoApis, admin_key: str, refresh_s: float,
                 foreign: ForeignAnnouncements) -> None:
        self.platform = platform
        self.foreign = foreign
        self.refresh_s = refresh_s
        self.timeout_s = 2 * refresh_s + 10
        self.admin = httpx.AsyncClient(headers={"Authorization": f"Bearer {admin_key}"}, timeout=30.0)
        self.probe = httpx.AsyncClient(timeout=30.0)
        self.urls = (platform.api_url, platform.api_b_url)

    async def aclose(self) -> None:
        await self.admin.aclose()
        await self.probe.aclose()

    async def _call(self, method: str, path: str, body: dict[str, Any], expect: int) -> dict[str, Any]:
        response = await self.admin.request(method, f"{self.platform.api_url}{path}", json=body)
        if response.status_code != expect:
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text[:300]}")
        answer: dict[str, Any] = response.json()
        return answer

    async def setup(self) -> None:
        tenant = await self._call("POST", "/v1/tenants", {"id": "probe", "rate_limit_per_s": 1e6,
                                                          "max_queued": 10**9}, 201)
        self.probe.headers["Authorization"] = f"Bearer {tenant['key']['secret']}"
        await self._call("POST", "/v1/models", {"name": MODEL, "kind": "synthetic"}, 201)
        for version in ("stable", "canary"):
            await self._call("POST", f"/v1/models/{MODEL}/versions", {
                "version": version, "artifact": "synthetic:?fixed_s=0.001", "sha256": SYNTHETIC_SHA,
                "state": version}, 201)
        await self.restore()

    async def both(self, want: str, t0: float, *, pause_s: float = 0.0) -> tuple[Probe, Probe]:
        a, b = await asyncio.gather(*(probe_until(self.probe, url, want, t0, timeout_s=self.timeout_s,
                                                  pause_s=pause_s) for url in self.urls))
        return a, b

    async def restore(self) -> tuple[Probe, Probe]:
        await self._call("PUT", f"/v1/models/{MODEL}/routing", {"weights": {"canary": 100.0},
                                                               "reason": "bench: canary again"}, 200)
        return await self.both("canary", time.perf_counter())

    async def api_round(self, index: int) -> Round:
        sent = time.perf_counter()
        answer = await self._call("POST", f"/v1/models/{MODEL}/rollback", {"reason": f"bench {index}"}, 200)
        t0 = time.perf_counter()
        if answer["routing"] != {"stable": 100.0}:
            raise RuntimeError(f"rollback answered {answer['routing']}")
        a, b = await self.both("stable", t0)
        foreign = self.foreign.between(sent, t0 + max(a.upper_ms, b.upper_ms) / 1e3)
        restore_a, restore_b = await self.restore()
        return Round("event", index, (t0 - sent) * 1e3, a, b, restore_a, restore_b, foreign)

    async def direct_round(self, index: int, registry: Any) -> Round:
        """A rollback nobody announces: only the replicas' periodic reload can pick it up."""
        from sluice.registry import routing_table

        def write() -> None:
            with registry.session() as session:
                routing_table.rollback(session, model=MODEL, actor="bench", reason=f"bench direct {index}")

        # At a random phase of the replicas' reload timers: rounds would otherwise start just after
        # the tick that ended the previous one, and each would wait the whole interval.
        await asyncio.sleep(random.uniform(0, self.refresh_s))
        sent = time.perf_counter()
        await asyncio.to_thread(write)
        t0 = time.perf_counter()
        # Seconds are expected here: probe every 20 ms instead of flat out.
        a, b = await self.both("stable", t0, pause_s=0.02)
        foreign = self.foreign.between(sent, t0 + max(a.upper_ms, b.upper_ms) / 1e3)
        restore_a, restore_b = await self.restore()
        return Round("direct", index, (t0 - sent) * 1e3, a, b, restore_a, restore_b, foreign)


def wait_ready(platform: TwoApis, timeout_s: float = 60.0) -> None:
    """Both replicas fully ready, their event subscription included (`/readyz` says ok)."""
    deadline = time.monotonic() + timeout_s
    for url in (platform.api_url, platform.api_b_url):
        while True:
            platform.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=2.0).json().get("status") == "ok":
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready in {timeout_s}s")
            time.sleep(0.1)


async def run(platform: TwoApis, args: argparse.Namespace, refresh_s: float) -> tuple[list[Round], dict[str, Any]]:
    from sluice.registry.store import Registry

    admin_key = (platform.home / "admin.key").read_text().strip()
    foreign = ForeignAnnouncements(platform.redis_url)
    listener = asyncio.create_task(foreign.listen())
    await asyncio.wait_for(foreign.subscribed.wait(), timeout=10)
    bench = Bench(platform=platform, admin_key=admin_key, refresh_s=refresh_s, foreign=foreign)
    registry = Registry(url=platform.database_url, pool_size=1)
    rounds: list[Round] = []
    try:
        await bench.setup()
        # Live workers keep both versions' circuit breakers closed, so routing follows the weights alone.
        for version in ("stable", "canary"):
            platform.start_workers(MODEL, version, 1)
        for version in ("stable", "canary"):
            await asyncio.to_thread(platform.wait_ready, MODEL, version, 1)
        pids = {"bench": os.getpid(), "api B": platform.api_b.pid, **platform.pids()}
        for _ in range(args.warmup):
            await bench.api_round(-1)
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        window = CpuWindow()
        for index in range(args.rounds):
            rounds.append(await bench.api_round(index))
            platform.check_alive()
            # Rounds spaced a little, at random, so they do not lock step with anything periodic.
            await asyncio.sleep(args.gap_ms / 1e3 * random.uniform(0.5, 1.5))
        window.stop()
        ours = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
        load = {"elapsed_s": window.elapsed, "our_cpu_s": ours,
                "other_load_cores": window.foreign_cores(sum(ours.values()))}
        for index in range(args.direct_rounds):
            rounds.append(await bench.direct_round(index, registry))
            print(f"  direct round {index}: both after {rounds[-1].both_ms / 1e3:.1f} s"
                  f"{' (left out: a foreign announcement came first)' if rounds[-1].foreign_events else ''}",
                  flush=True)
    finally:
        listener.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listener
        registry.dispose()
        await bench.aclose()
    return rounds, load


def report(rounds: Sequence[Round], refresh_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant in ("event", "direct"):
        ran = [r for r in rounds if r.variant == variant]
        if not ran:
            continue
        # Announced rounds keep theirs: our own announcement was already on its way.
        chosen = [r for r in ran if variant == "event" or not r.foreign_events]
        out[variant] = {
            "rounds_with_foreign_announcements": sum(1 for r in ran if r.foreign_events),
            "rounds_left_out": len(ran) - len(chosen),
            "both_ms": summary([r.both_ms for r in chosen]),
            "replica_a_ms": summary([r.a.upper_ms for r in chosen]),
            "replica_b_ms": summary([r.b.upper_ms for r in chosen]),
            "replica_b_lower_bound_ms": summary([r.b.lower_ms for r in chosen]),
            "probe_rtt_ms": summary([p.rtt_ms for r in chosen for p in (r.a, r.b)]),
            "request_ms": summary([r.request_ms for r in chosen]),
            "restore_both_ms": summary([max(r.restore_a.upper_ms, r.restore_b.upper_ms) for r in chosen]),
            "over_100_ms": sum(1 for r in chosen if r.both_ms > 100.0),
        }
    out["refresh_s"] = refresh_s
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.rollback", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50, help="rollbacks announced through the API")
    parser.add_argument("--direct-rounds", type=int, default=5,
                        help="rollbacks written straight to the registry (each waits for the periodic reload)")
    parser.add_argument("--warmup", type=int, default=3, help="unrecorded rounds first")
    parser.add_argument("--gap-ms", type=float, default=100.0, help="mean pause between rounds")
    parser.add_argument("--shared-redis", action="store_true",
                        help="use the system Redis (a DB index of its own) instead of a private redis-server")
    parser.add_argument("--redis-db", type=int, default=None,
                        help="with --shared-redis; default: the first of 10..1 no test holds")
    args = parser.parse_args(argv)

    from sluice.settings import Settings

    # What the API children will read: they get this process's environment.
    refresh_s = Settings().routing_refresh_s
    stores = claimed_redis_db(args.redis_db) if args.shared_redis else private_redis()
    with sigterm_as_interrupt(), stores as (redis_base, redis_db), \
            TwoApis(redis_base=redis_base, redis_db=redis_db) as platform:
        wait_ready(platform)
        rounds, load = asyncio.run(run(platform, args, refresh_s))

    figures = report(rounds, refresh_s)
    rows = []
    for variant, label in (("event", "via sluice:events"), ("direct", "periodic reload only")):
        if variant not in figures:
            continue
        for name, key in (("both", "both_ms"), ("A", "replica_a_ms"), ("B", "replica_b_ms")):
            s = figures[variant][key]
            rows.append([label, name, int(s["n"]), s["p50"], s["p95"], s["p99"], s["max"]])
    print(table(["rollback", "replica", "n", "p50 ms", "p95 ms", "p99 ms", "max ms"], rows))
    event = figures["event"]
    print(f"probe round trip p50 {fmt(event['probe_rtt_ms']['p50'])} ms (the resolution); rollback request "
          f"p50 {fmt(event['request_ms']['p50'])} ms; rounds over 100 ms: {event['over_100_ms']} of {args.rounds}; "
          f"rounds with foreign routing announcements: {event['rounds_with_foreign_announcements']} announced, "
          f"{figures.get('direct', {}).get('rounds_left_out', 0)} direct (left out); "
          f"other load {fmt(load['other_load_cores'])} cores; periodic reload every {refresh_s:g} s")
    path = write_json("rollback.json", {
        "command": command_line("bench.rollback"),
        "machine": {"cores": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
        "config": vars(args), "load": load, "figures": figures,
        "rounds": [{**asdict(r), "both_ms": r.both_ms} for r in rounds],
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
