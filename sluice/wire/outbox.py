"""The webhook outbox entry: `{delivery, job}` on a version's outbox (`keys.outbox`).

Written inside the scripts that make a job final (sluice/wire/lua/lib/queue_webhook.lua, which
spells these field names too), so a final state and its webhook are queued in one atomic step; read
by the relay (workers/outbox.py), which turns each entry into a Celery task.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DELIVERY_FIELD = "delivery"
JOB_FIELD = "job"


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    delivery_id: str
    job_id: str

    def to_fields(self) -> dict[str, str]:
        return {DELIVERY_FIELD: self.delivery_id, JOB_FIELD: self.job_id}

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> OutboxEntry | None:
        """None for a malformed entry, which the relay drops rather than retrying forever."""
        delivery, job = fields.get(DELIVERY_FIELD.encode()), fields.get(JOB_FIELD.encode())
        if not delivery or not job:
            return None
        return cls(delivery_id=delivery.decode(), job_id=job.decode())

