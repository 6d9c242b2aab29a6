"""The Idempotency-Key record: `keys.idempotency` -> the request's hash and the job ids it made.

Claimed with SET NX before anything is queued (ids still unknown), completed with the ids once the
jobs are in their streams, and released if the request fails, so a retry of it runs again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class IdempotencyRecord:
    request_hash: str
    job_ids: list[str] | None  # None while the first request with the key is still being processed

    def encode(self) -> str:
        return json.dumps({"hash": self.request_hash, "ids": self.job_ids})

    @classmethod
    def parse(cls, raw: bytes | str) -> IdempotencyRecord:
        data = json.loads(raw)
        ids = data["ids"]
        return cls(request_hash=data["hash"], job_ids=None if ids is None else [str(i) for i in ids])


@dataclass(frozen=True, slots=True)
class IdempotencyClaim:
    """What claiming a key gave: the key to complete or release, or the job ids to replay."""

    redis_key: str
    replay: list[str] | None = None
