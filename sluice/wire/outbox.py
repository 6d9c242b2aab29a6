"""The webhook outbox entry: `{delivery, job}` on a version's outbox (`keys.outbox`).

Written inside the scripts that make a job final (`QUEUE_WEBHOOK`, used by sluice/wire/streams.py), so
a final state and its webhook are queued in one atomic step; read by the relay (workers/outbox.py),
which turns each entry into a Celery task.
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


# Every script that makes a job final ends with this: a job submitted with a callback_url gets its
# webhook queued on the outbox stream in the same atomic step as its final state, so no crash can
# keep one without the other, and since a final state is written only once, a job processed twice
# still queues one delivery. The delivery id is derived from the job id: one job, one delivery id.
QUEUE_WEBHOOK = f"""
local function queue_webhook(job, outbox)
  if redis.call('HEXISTS', job, 'callback_url') == 0 then return end
  local id = redis.call('HGET', job, 'id')
  local delivery = 'dlv_' .. string.sub(redis.sha1hex('sluice-webhook:' .. id), 1, 32)
  redis.call('HSET', job, 'delivery_id', delivery)
  redis.call('XADD', outbox, '*', '{DELIVERY_FIELD}', delivery, '{JOB_FIELD}', id)
end
"""
