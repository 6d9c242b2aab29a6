"""The platform's shared words: the states a batch or a rollout passes through, the lanes a job
rides, where a version scaled to zero stands, why a micro-batch closed, what the claim script says
of an entry, and the defaults a new version starts with. Each is spelled here once; the registry's
columns, the API's fields, the workers and the CLI read it from here, so a new state or a changed
default cannot drift apart.

Job states (`sluice.wire.jobs.JobStatus`), version states and tiers (`sluice.versions`) and model
kinds (`sluice.kinds`) already have one home each and stay there. StrEnum members compare equal
to their strings, so stored values and JSON are unchanged. Lanes and close reasons stay `Literal`s:
route models use them as field types, and an enum class there would change /openapi.json.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, get_args


class BatchState(StrEnum):
    """A bulk batch's `status` (the `batches` table; see ARCHITECTURE, 'Bulk batches')."""

    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


FINAL_BATCH_STATES = frozenset({BatchState.succeeded, BatchState.failed, BatchState.cancelled})


class RolloutState(StrEnum):
    """A canary rollout's `state`: at most one is `running` per model."""

    running = "running"
    promoted = "promoted"
    rolled_back = "rolled_back"
    aborted = "aborted"


class ZeroState(StrEnum):
    """Where a version with `min_replicas` 0 stands (scheduler/idle.py): placed on no process,
    its first worker starting, or served. The scheduler publishes it; the API and the CLI show it,
    the circuit breaker and the workers read it."""

    asleep = "asleep"
    waking = "waking"
    awake = "awake"


Lane = Literal["online", "bulk"]
LANES: tuple[Lane, ...] = get_args(Lane)

# Why a micro-batch closed: full, its oldest job waited max_wait_ms, or the worker drained.
CloseReason = Literal["size", "age", "drain"]
CLOSE_REASONS: tuple[CloseReason, ...] = get_args(CloseReason)


class ClaimVerdict(StrEnum):
    """The claim script's word on one delivered entry; besides these it may answer with the final
    job state the job already has."""

    run = "run"
    expired = "expired"
    dead = "dead"
    missing = "missing"


# What a version gets when its registration names none: the registry's column defaults, the
# API's field defaults, the seeded demo versions and the simulators all start here.
DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_MAX_WAIT_MS = 10.0
DEFAULT_MIN_REPLICAS = 1
DEFAULT_MAX_REPLICAS = 4

# The nightly re-tune's Celery task: beat (workers/tasks.py) sends it by this name, the module that
# runs it (scheduler/retune_task.py) registers it under it.
RETUNE_TASK = "sluice.retune"
