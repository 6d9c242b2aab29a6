"""The Idempotency-Key record: `keys.idempotency` -> the request's hash and the job ids it made.

Claimed with SET NX before anything is queued (ids still unknown) on a short lease (`LEASE_S`),
so a key claimed by an API that died is free again within seconds, not after the key's TTL.
Checked (still the claimer's own) and its lease renewed by the admission script
(sluice/wire/lua/admit.lua), in the tenant's slot, before the jobs are written: a request that
outlived its lease, and whose key another request took meanwhile, queues nothing. Completed with
the ids once the jobs are written (idempotency_complete.lua), so a replayed id always names a
written job; an API that dies between the two leaves the key to lapse, and the client's retry
queues the submission again (at least once, never lost). Released (if still its own,
idempotency_release.lua) when the request fails, so a retry of it runs again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# How long an in-progress claim holds its key. A submission spends milliseconds between claiming
# and queueing; one slower than this is refused (the fence above) rather than run twice.
LEASE_S = 5.0

@dataclass(frozen=True, slots=True)
class IdempotencyRecord:
    request_hash: str
    job_ids: list[str] | None  # None while the first request with the key is still being processed
    owner: str | None = None  # while in progress: the claiming request's random token

    def encode(self) -> str:
        data: dict[str, object] = {"hash": self.request_hash, "ids": self.job_ids}
        if self.owner is not None:
            data["owner"] = self.owner
        return json.dumps(data)

    @classmethod
    def parse(cls, raw: bytes | str) -> IdempotencyRecord:
        data = json.loads(raw)
        ids = data["ids"]
        return cls(
            request_hash=data["hash"], job_ids=None if ids is None else [str(i) for i in ids], owner=data.get("owner")
        )


@dataclass(frozen=True, slots=True)
class IdempotencyClaim:
    """What claiming a key gave: the in-progress marker this request set (to complete or release),
    or the job ids to replay."""

    redis_key: str
    request_hash: str
    marker: str = ""
    replay: list[str] | None = None

    def completed(self, job_ids: list[str]) -> str:
        return IdempotencyRecord(self.request_hash, job_ids).encode()
