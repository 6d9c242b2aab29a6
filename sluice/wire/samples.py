"""Finished-job samples: one capped stream entry per finished job, per version (`keys.stats`).

Workers append them in the script that stores the job's outcome (sluice/wire/lua/finish.lua, from
workers/results.py, capped at `SAMPLES_MAXLEN`), so only the write that wins adds one; `/stats`, the
rollout controller, the quality aggregator and the API's circuit breakers read them. A sample
carries timings, batch facts and the job's quality proxies (`sluice.quality`), never its input or
output.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from sluice.wire import keys
from sluice.wire.connections import translate_redis_errors

SAMPLES_MAXLEN = 20_000


@dataclass(frozen=True, slots=True)
class Sample:
    status: str
    finished_at: float
    queue_wait_ms: float
    model_ms: float
    total_ms: float
    batch_size: int
    close_reason: str
    # Quality proxies of the job's output (sluice.quality.proxies), plus `agreement` on a
    # shadow version's samples.
    quality: dict[str, Any] = field(default_factory=dict)
    # The job's share of its forward pass (sluice/cost.py): the pass's padded and real tokens and
    # the core-, GPU- and idle slot seconds charged to it, each divided by the jobs in the pass, so
    # a window's sum is the passes' total. `fill_ms`: its batch's oldest arrival to its close.
    fill_ms: float = 0.0
    padded_tokens: float = 0.0
    real_tokens: float = 0.0
    core_s: float = 0.0
    gpu_s: float = 0.0
    idle_s: float = 0.0

    @property
    def succeeded(self) -> bool:
        return self.status == "succeeded"

    def to_fields(self) -> dict[str, str]:
        fields = {
            "s": self.status, "t": repr(self.finished_at), "qw": repr(self.queue_wait_ms), "m": repr(self.model_ms),
            "tt": repr(self.total_ms), "b": str(self.batch_size), "r": self.close_reason,
        }
        if self.quality:
            fields["q"] = json.dumps(self.quality, separators=(",", ":"))
        for key, value in (("f", self.fill_ms), ("pt", self.padded_tokens), ("rt", self.real_tokens),
                           ("cs", self.core_s), ("gs", self.gpu_s), ("is", self.idle_s)):
            if value:
                fields[key] = repr(value)
        return fields

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> Sample:
        return cls(
            status=fields[b"s"].decode(), finished_at=float(fields[b"t"]), queue_wait_ms=float(fields[b"qw"]),
            model_ms=float(fields[b"m"]), total_ms=float(fields[b"tt"]), batch_size=int(fields[b"b"]),
            close_reason=fields[b"r"].decode(), quality=json.loads(fields[b"q"]) if b"q" in fields else {},
            fill_ms=float(fields.get(b"f", 0.0)), padded_tokens=float(fields.get(b"pt", 0.0)),
            real_tokens=float(fields.get(b"rt", 0.0)), core_s=float(fields.get(b"cs", 0.0)),
            gpu_s=float(fields.get(b"gs", 0.0)), idle_s=float(fields.get(b"is", 0.0)),
        )


def queue_recent(pipe: Any, model: str, version: str, *, count: int) -> None:
    """Add a read of the version's `count` newest samples to a pipeline; `parse` its reply."""
    pipe.xrevrange(keys.stats(model, version), count=count)


def parse(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Sample]:
    return [Sample.from_fields(fields) for _, fields in entries]


async def read_samples(redis: aioredis.Redis, model: str, version: str, *, window_s: float,
                       now: float | None = None) -> list[Sample]:
    """The samples of jobs finished within `window_s` before `now`, oldest first."""
    since_ms = int(((now or time.time()) - window_s) * 1000)
    with translate_redis_errors():
        entries: list[tuple[bytes, dict[bytes, bytes]]] = await redis.xrange(  # type: ignore[assignment]
            keys.stats(model, version), min=f"{since_ms}-0", max="+"
        )
    return parse(entries)
