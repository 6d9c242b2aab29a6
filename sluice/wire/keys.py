"""The Redis key layout: the wire contract between the API, the workers and the scheduler.

Every script touches keys of one Redis Cluster slot only (docs/ARCHITECTURE.md, "Redis Cluster").
Every key of one model version carries the hash tag `{model:version}`, so all of a version's keys
land in one slot. A job id carries a four-character code that hashes to its version's slot
(`slot_code`), and a job's record is tagged with that code: the record, the version's streams and
its webhook outbox share a slot, so the scripts that move a job between states stay atomic on a
cluster. A tenant's admission records share the tag `{tenant}`; webhook deliveries share
`{webhooks}`.
"""

from __future__ import annotations

import itertools
import secrets
import string
from binascii import crc_hqx
from functools import lru_cache

from sluice.vocabulary import Lane

GROUP = "workers"


def events_channel(db: int) -> str:
    """Pub/sub ignores the database index, so each index gets its own channel: two platforms
    (or test sessions) sharing one server on different indexes must not hear each other."""
    return "sluice:events" if db == 0 else f"sluice:events:{db}"


def job_events_channel(db: int, job_id: str) -> str:
    """A job's own sharded channel (SPUBLISH): its record's key after the events channel, so it
    shares the record's slot, as a script that publishes it on a cluster must."""
    return f"{events_channel(db)}:{job(job_id)}"


def tag(model: str, version: str) -> str:
    return f"{{{model}:{version}}}"


# --- slots ------------------------------------------------------------------------------------------

SLOTS = 16384
_CODE_ALPHABET = string.digits + string.ascii_lowercase
_CODE_LENGTH = 4
# A job id of the current shape: "job_" + code + "." + token. The token (`secrets.token_urlsafe`)
# never holds a dot, so an id without one at this place is an id from before codes existed.
_CODE_END = len("job_") + _CODE_LENGTH


def slot(hash_tag: str) -> int:
    """The Redis Cluster slot of a key whose hash tag is `hash_tag` (CRC16/XMODEM mod 16384)."""
    return crc_hqx(hash_tag.encode(), 0) % SLOTS


@lru_cache(maxsize=4096)
def slot_code(slot_number: int) -> str:
    """The first four-character code over 0-9a-z, in order, that hashes to `slot_number`.

    A search of about 16384 CRCs on average (milliseconds), cached: the 1.7 million codes cover
    every slot (tests/unit/test_keys.py checks all of them).
    """
    for chars in itertools.product(_CODE_ALPHABET, repeat=_CODE_LENGTH):
        code = "".join(chars)
        if slot(code) == slot_number:
            return code
    raise ValueError(f"no code hashes to slot {slot_number}")


def version_code(model: str, version: str) -> str:
    """The code of the version's slot, which its job ids carry."""
    return slot_code(slot(f"{model}:{version}"))


def new_job_id(model: str, version: str) -> str:
    # 128 bits from the OS CSPRNG: ids are unguessable, so knowing one is no way into another.
    return f"job_{version_code(model, version)}.{secrets.token_urlsafe(16)}"


def job_code(job_id: str) -> str | None:
    """The slot code a job id carries; None for an id made before codes existed."""
    if len(job_id) > _CODE_END and job_id[_CODE_END] == "." and job_id.startswith("job_"):
        return job_id[len("job_"):_CODE_END]
    return None


def stream(model: str, version: str, lane: Lane) -> str:
    return f"sluice:{tag(model, version)}:{lane}"


def queue_added(model: str, version: str) -> str:
    """Sorted set: a lane's stream key -> how many jobs the queue script has written to it, each
    job's number (`seq`) kept in its record and entry, so that a job's place in its lane is its
    number less the highest number a worker has read (`queue_read`)."""
    return f"sluice:{tag(model, version)}:queue-added"


def queue_read(model: str, version: str) -> str:
    """Sorted set: a lane's stream key -> the highest job number (`seq`) a worker has read from it
    (`ZADD GT`: workers reading at once never move it back)."""
    return f"sluice:{tag(model, version)}:queue-read"


def held_index(model: str, version: str, lane: Lane) -> str:
    """Hash: a held queue's name (`priority|tenant`) -> how many of the lane's jobs it holds, and
    `*` -> all of them. A job is held, rather than added to the stream, while the lane is backed
    up (queue.lua), and released in fair turns by the workers (release.lua)."""
    return f"sluice:{tag(model, version)}:held-index:{lane}"


def held_queue_prefix(model: str, version: str, lane: Lane) -> str:
    """The prefix of the lane's held queues: a list of job record keys per `priority|tenant`,
    oldest first (the scripts append the queue's name)."""
    return f"sluice:{tag(model, version)}:held:{lane}:"


def deadlines(model: str, version: str) -> str:
    """Sorted set: job hash key -> its deadline, of the version's jobs queued with `timeout_s`, so
    the scheduler's sweeper expires them with no worker to read them (`sluice.wire.settling`)."""
    return f"sluice:{tag(model, version)}:deadlines"


def dead_stream(model: str, version: str) -> str:
    return f"sluice:{tag(model, version)}:dead"


def job(job_id: str) -> str:
    code = job_code(job_id)
    return f"sluice:job:{{{job_id}}}" if code is None else f"sluice:job:{{{code}}}:{job_id}"


def idempotency(tenant: str, key: str) -> str:
    """Tagged with the tenant: the key is checked and completed beside its quota and rate."""
    return f"sluice:idem:{{{tenant}}}:{key}"


def cache(model: str, version: str, digest: str) -> str:
    return f"sluice:cache:{tag(model, version)}:{digest}"


def heartbeat(model: str, version: str, worker: str) -> str:
    return f"sluice:hb:{tag(model, version)}:{worker}"


def replicas(model: str, version: str) -> str:
    """The scheduler's last scaling decision for the version: desired, live, reason, at."""
    return f"sluice:replicas:{tag(model, version)}"


def heartbeat_pattern(model: str, version: str) -> str:
    return f"sluice:hb:{tag(model, version)}:*"


def stats(model: str, version: str) -> str:
    """Recent finished-job samples of one version (a capped stream), for exact percentiles."""
    return f"sluice:{tag(model, version)}:samples"


def mix(model: str, version: str) -> str:
    """The version's served mix: input counts per hour, lane and cost bucket (sluice/wire/mix.py)."""
    return f"sluice:{tag(model, version)}:mix"


def passes(model: str, version: str) -> str:
    """The version's recent forward passes (a capped stream): size, longest cost, seconds."""
    return f"sluice:{tag(model, version)}:passes"


def rate_bucket(tenant: str) -> str:
    return f"sluice:rate:{{{tenant}}}"


def queued_jobs(tenant: str) -> str:
    """Sorted set: job id -> when its place frees on its own, of this tenant's jobs accepted and not
    yet started (the quota; `sluice.wire.quota`). A new name: the counter it replaces was a string."""
    return f"sluice:queued-jobs:{{{tenant}}}"


def answered_jobs(tenant: str) -> str:
    """Sorted set: job id -> when its record expires, of this tenant's jobs answered from the
    response cache (the bound on their stored records; `sluice.wire.quota`)."""
    return f"sluice:answered-jobs:{{{tenant}}}"


def scrape_targets() -> str:
    """Sorted set: a process's metrics endpoint (JSON) -> time it last advertised it (sluice.exposition)."""
    return "sluice:scrape-targets"


def placements() -> str:
    """String: the scheduler's placement plan as JSON, which worker process (group) serves which
    versions and which versions cannot be served now (`sluice.wire.placements`)."""
    return "sluice:placements"


def refused_versions() -> str:
    """Hash: `model/version` -> why a worker refused the version's artifact; deleted once it loads."""
    return "sluice:refused"


def live_workers(model: str, version: str) -> str:
    """Sorted set: worker name -> time of its last heartbeat, so readers need no SCAN."""
    return f"sluice:{tag(model, version)}:live"


# --- webhooks ------------------------------------------------------------------------------------


def outbox(model: str, version: str) -> str:
    """Stream of {delivery, job} written by the scripts that make a job of the version final
    (sluice.wire.outbox); the relay group turns each entry into a Celery task (workers/outbox.py)."""
    return f"sluice:{tag(model, version)}:webhooks"


# The outbox of batch callbacks (and of entries queued before outboxes were per version), read by every relay.
WEBHOOK_OUTBOX = "sluice:webhooks:outbox"
# Set of the version outboxes that may hold entries, which every relay reads: the API adds one
# before it queues or cancels a job with a callback, a worker when it starts.
WEBHOOK_OUTBOXES = "sluice:webhooks:outboxes"
RELAY_GROUP = "relay"
# Sorted set: delivery id -> when its next attempt is due (or its running attempt's lease ends);
# beat re-sends the ones long overdue, whose Celery message was lost. In the deliveries' slot.
WEBHOOK_DUE = "sluice:{webhooks}:due"


def delivery(delivery_id: str) -> str:
    """One webhook delivery's state: status, attempts, last answer, lease of the running attempt.
    Every delivery shares the due set's slot, so one script updates both."""
    return f"sluice:delivery:{{webhooks}}:{delivery_id}"


def webhook_tenant_slots(tenant: str) -> str:
    """Sorted set: lease token -> lease end, of the tenant's delivery attempts in flight (its share
    of the delivery pool). In the deliveries' slot, so the script that starts an attempt takes one."""
    return f"sluice:webhook-slots:{{webhooks}}:{tenant}"


def webhook_tenant_rate(tenant: str) -> str:
    """The tenant's delivery rate limit: the theoretical arrival time of its next attempt (GCRA,
    a token bucket kept as one number). In the deliveries' slot."""
    return f"sluice:webhook-rate:{{webhooks}}:{tenant}"
