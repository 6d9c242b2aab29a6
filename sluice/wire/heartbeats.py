"""Worker heartbeats: a hash per worker, and a sorted set of the version's live workers.

A worker beats every `BEAT_EVERY_S`; one silent for `LIVE_WITHIN_S` is dead to every reader
(admission's service rate, the circuit breakers, the rollout controller, the launcher). The sorted
set maps worker name -> time of its last beat, so readers count live workers without a SCAN.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis.asyncio as aioredis

from sluice.wire import keys
from sluice.wire.connections import translate_redis_errors

BEAT_EVERY_S = 2.0
# Five missed beats: a worker busy on a long batch still beats (from its own task), so silence
# this long means the process is gone or cut off.
LIVE_WITHIN_S = 5 * BEAT_EVERY_S


class WorkerState(StrEnum):
    starting = "starting"
    ready = "ready"
    draining = "draining"
    stopped = "stopped"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    state: WorkerState
    # Service capacity while busy (items per model-second), not wall-clock throughput.
    items_per_s: float
    batch_size: int
    cold_start_s: float
    processed: int
    pid: int
    at: float
    # What the model runs in (fp32, bf16, fp16, int8; empty for kinds without a choice) and, where
    # the worker measured it at start-up, its speed over fp32's (workers/models/precision.py).
    precision: str = ""
    precision_speedup: float | None = None
    # The placement group (worker process) serving it, and the resident memory its load added to
    # that process: 0 when it shares weights another version had loaded there.
    group: str = ""
    resident_bytes: int = 0
    # Items per wall-clock second over the passes run while more work waited: how fast a backlog
    # drains, which small batches of light traffic understate. 0 until such a pass ran.
    backlog_items_per_s: float = 0.0
    # Entries read and not yet acknowledged, per lane: jobs in front of every queued job of the
    # lane that the lane's job numbers no longer count (sluice/queue_standing.py).
    held_online: int = 0
    held_bulk: int = 0

    def to_fields(self) -> dict[str, str]:
        return {
            "state": self.state.value, "items_per_s": f"{self.items_per_s:.3f}", "batch_size": str(self.batch_size),
            "cold_start_s": f"{self.cold_start_s:.3f}", "processed": str(self.processed), "pid": str(self.pid),
            "at": repr(self.at), "precision": self.precision,
            "precision_speedup": "" if self.precision_speedup is None else f"{self.precision_speedup:.3f}",
            "group": self.group, "resident_bytes": str(self.resident_bytes),
            "backlog_items_per_s": f"{self.backlog_items_per_s:.3f}", "held_online": str(self.held_online),
            "held_bulk": str(self.held_bulk),
        }

    @classmethod
    def from_fields(cls, raw: Mapping[Any, Any]) -> Heartbeat:
        data = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in raw.items()}
        return cls(state=WorkerState(data["state"]), items_per_s=float(data["items_per_s"]),
                   batch_size=int(data["batch_size"]), cold_start_s=float(data["cold_start_s"]),
                   processed=int(data["processed"]), pid=int(data["pid"]), at=float(data["at"]),
                   precision=data.get("precision", ""),
                   precision_speedup=float(data["precision_speedup"]) if data.get("precision_speedup") else None,
                   group=data.get("group", ""), resident_bytes=int(data.get("resident_bytes") or 0),
                   backlog_items_per_s=float(data.get("backlog_items_per_s") or 0.0),
                   held_online=int(data.get("held_online") or 0), held_bulk=int(data.get("held_bulk") or 0))


def live_since(now: float) -> float:
    """The oldest last beat that still counts as live at `now`."""
    return now - LIVE_WITHIN_S


async def beat(redis: aioredis.Redis, model: str, version: str, worker: str, heartbeat: Heartbeat) -> None:
    key = keys.heartbeat(model, version, worker)
    live = keys.live_workers(model, version)
    with translate_redis_errors():
        pipe = redis.pipeline(transaction=False)
        pipe.hset(key, mapping=heartbeat.to_fields())  # type: ignore[arg-type]
        pipe.expire(key, int(LIVE_WITHIN_S))
        pipe.zadd(live, {worker: heartbeat.at})
        pipe.zremrangebyscore(live, "-inf", live_since(heartbeat.at))
        await pipe.execute()


async def forget(redis: aioredis.Redis, model: str, version: str, worker: str) -> None:
    """A worker that stops says so at once, rather than being counted live until its beats age out."""
    with translate_redis_errors():
        pipe = redis.pipeline(transaction=False)
        pipe.delete(keys.heartbeat(model, version, worker))
        pipe.zrem(keys.live_workers(model, version), worker)
        await pipe.execute()


def queue_live_count(pipe: Any, model: str, version: str, *, now: float) -> None:
    """Add the count of the version's live workers to a pipeline (its reply is an int)."""
    pipe.zcount(keys.live_workers(model, version), live_since(now), "+inf")


async def live_count(redis: aioredis.Redis, model: str, version: str, *, now: float) -> int:
    with translate_redis_errors():
        return int(await redis.zcount(keys.live_workers(model, version), live_since(now), "+inf"))


async def live_heartbeats(redis: aioredis.Redis, model: str, version: str, *, now: float) -> list[Heartbeat]:
    """The last beat of every live worker of the version (a worker gone meanwhile is left out)."""
    with translate_redis_errors():
        names: list[bytes] = await redis.zrangebyscore(  # type: ignore[assignment]
            keys.live_workers(model, version), live_since(now), "+inf")
        if not names:
            return []
        pipe = redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(keys.heartbeat(model, version, name.decode()))
        replies = await pipe.execute()
    return [Heartbeat.from_fields(raw) for raw in replies if raw]
