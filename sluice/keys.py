"""The Redis key layout: the wire contract between the API, the workers and the scheduler.

Every key of one model version carries the hash tag `{model:version}`, so all of a version's
keys land in one Redis Cluster slot and no command ever spans two versions.
"""

from __future__ import annotations

from typing import Literal

Lane = Literal["online", "bulk"]
LANES: tuple[Lane, ...] = ("online", "bulk")

GROUP = "workers"


def events_channel(db: int) -> str:
    """Pub/sub ignores the database index, so each index gets its own channel: two platforms
    (or test sessions) sharing one server on different indexes must not hear each other."""
    return "sluice:events" if db == 0 else f"sluice:events:{db}"


def tag(model: str, version: str) -> str:
    return f"{{{model}:{version}}}"


def stream(model: str, version: str, lane: Lane) -> str:
    return f"sluice:{tag(model, version)}:{lane}"


def dead_stream(model: str, version: str) -> str:
    return f"sluice:{tag(model, version)}:dead"


def job(job_id: str) -> str:
    return f"sluice:job:{{{job_id}}}"


def idempotency(tenant: str, key: str) -> str:
    return f"sluice:idem:{tenant}:{key}"


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


def rate_bucket(tenant: str) -> str:
    return f"sluice:rate:{{{tenant}}}"


def queued_jobs(tenant: str) -> str:
    """Sorted set: job id -> when its place frees on its own, of this tenant's jobs accepted and not
    yet started (the quota; `sluice.quota`). A new name: the counter it replaces was a string."""
    return f"sluice:queued-jobs:{{{tenant}}}"


def scrape_targets() -> str:
    """Sorted set: a process's metrics endpoint (JSON) -> time it last advertised it (sluice.exposition)."""
    return "sluice:scrape-targets"


def live_workers(model: str, version: str) -> str:
    """Sorted set: worker name -> time of its last heartbeat, so readers need no SCAN."""
    return f"sluice:{tag(model, version)}:live"


# --- webhooks ------------------------------------------------------------------------------------

# Stream of {delivery, job} written by the scripts that make a job final (sluice.jobs); the relay
# group turns each entry into a Celery task (workers/outbox.py).
WEBHOOK_OUTBOX = "sluice:webhooks:outbox"
RELAY_GROUP = "relay"
# Sorted set: delivery id -> when its next attempt is due (or its running attempt's lease ends);
# beat re-sends the ones long overdue, whose Celery message was lost.
WEBHOOK_DUE = "sluice:webhooks:due"


def delivery(delivery_id: str) -> str:
    """One webhook delivery's state: status, attempts, last answer, lease of the running attempt."""
    return f"sluice:delivery:{{{delivery_id}}}"
