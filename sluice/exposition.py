"""Each process serves its own Prometheus metrics, and says where in Redis.

The API serves `/metrics` on its own port. Workers, the scheduler and the Celery worker each
start a small HTTP server on `metrics_host:metrics_port` (port 0: one the kernel picks, so a
machine runs many workers) and advertise its address in a sorted set (`keys.scrape_targets`),
scored by the time of their last advertisement. Whatever runs the processes turns the live
entries into its discovery: `sluice up` writes a Prometheus file-SD file; the API serves the same
list for Prometheus' HTTP service discovery (`GET /metrics/targets`, what compose uses, where a
worker pool's processes each pick a port); Kubernetes uses fixed ports and pod annotations.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from prometheus_client import start_http_server

from sluice.wire import keys
from sluice.wire.connections import translate_redis_errors

ADVERTISE_EVERY_S = 5.0
# Three missed advertisements: a process that stopped drops out of discovery within this.
LIVE_WITHIN_S = 3 * ADVERTISE_EVERY_S

_WILDCARDS = ("0.0.0.0", "::", "")


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    address: str
    process: str
    labels: dict[str, str] = field(default_factory=dict)

    def to_member(self) -> str:
        return json.dumps({"address": self.address, "process": self.process, "labels": self.labels},
                          sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_member(cls, raw: str | bytes) -> ScrapeTarget:
        data = json.loads(raw)
        return cls(address=data["address"], process=data["process"], labels=dict(data.get("labels") or {}))


@dataclass(frozen=True, slots=True)
class MetricsEndpoint:
    host: str
    port: int

    @property
    def address(self) -> str:
        """Where others reach it: a wildcard bind is advertised under this machine's name."""
        host = socket.gethostname() if self.host in _WILDCARDS else self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"


def serve_metrics(*, host: str, port: int) -> MetricsEndpoint:
    """Serve this process's default registry on a daemon thread; answer where it listens."""
    server, _ = start_http_server(port, addr=host)
    return MetricsEndpoint(host=host, port=int(server.server_address[1]))


def _queue_advertisement(pipe: Any, target: ScrapeTarget, now: float) -> None:
    """This target's time, and the lapsed ones of processes that died without withdrawing."""
    pipe.zadd(keys.scrape_targets(), {target.to_member(): now})
    pipe.zremrangebyscore(keys.scrape_targets(), "-inf", now - LIVE_WITHIN_S)


def advertise(client: redis.Redis, target: ScrapeTarget, *, now: float) -> None:
    with translate_redis_errors():
        pipe = client.pipeline(transaction=False)
        _queue_advertisement(pipe, target, now)
        pipe.execute()


async def advertise_async(client: aioredis.Redis, target: ScrapeTarget, *, now: float) -> None:
    with translate_redis_errors():
        pipe = client.pipeline(transaction=False)
        _queue_advertisement(pipe, target, now)
        await pipe.execute()


def withdraw(client: redis.Redis, target: ScrapeTarget) -> None:
    with translate_redis_errors():
        client.zrem(keys.scrape_targets(), target.to_member())


async def withdraw_async(client: aioredis.Redis, target: ScrapeTarget) -> None:
    with translate_redis_errors():
        await client.zrem(keys.scrape_targets(), target.to_member())


def live_targets(client: redis.Redis, *, now: float) -> list[ScrapeTarget]:
    with translate_redis_errors():
        members: list[bytes] = client.zrangebyscore(  # type: ignore[assignment]
            keys.scrape_targets(), now - LIVE_WITHIN_S, "+inf")
    return [ScrapeTarget.from_member(member) for member in members]


async def live_targets_async(client: aioredis.Redis, *, now: float) -> list[ScrapeTarget]:
    with translate_redis_errors():
        members: list[bytes] = await client.zrangebyscore(  # type: ignore[assignment]
            keys.scrape_targets(), now - LIVE_WITHIN_S, "+inf")
    return [ScrapeTarget.from_member(member) for member in members]


def file_sd(targets: Iterable[ScrapeTarget]) -> list[dict[str, Any]]:
    """Prometheus file-based service discovery: one group per target, in a stable order."""
    return [{"targets": [t.address], "labels": {"process": t.process, **t.labels}}
            for t in sorted(targets, key=lambda t: (t.process, t.address))]


def write_file_sd(path: Path, targets: Iterable[ScrapeTarget]) -> None:
    """Replace the file atomically: Prometheus re-reads it on change and must never see half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps(file_sd(targets), indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".targets-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as sink:
            sink.write(body)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
