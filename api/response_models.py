"""The response models of the REST API: what `/openapi.json` promises clients get back.

The kernel builds these bodies as plain dicts (`JobRecord.resource()`, `catalog.model_resource`,
`stats.summarise`); the routes validate them through these models on the way out.

The surprising part: some keys are optional by *absence*, not by null. A job has `output`,
`error` and `metadata` only when there is one, and a stats `quality` only the aggregates some
sample carried, while `timings` and `batch` always hold every key, null until known. Routes that
answer such a body set `response_model_exclude_unset=True`, which keeps exactly the keys the dict
had; `exclude_none` would drop the nulls too.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field
from pydantic.config import JsonDict
from pydantic.json_schema import SkipJsonSchema

from sluice.kinds import ModelKind
from sluice.registry.tables import ROLLOUT_ACTIONS
from sluice.retry import RetryOn
from sluice.versions import Tier, VersionState
from sluice.vocabulary import CLOSE_REASONS, BatchState, Lane, RolloutState, ZeroState
from sluice.wire.jobs import JobStatus

__all__ = [
    "AttemptError",
    "AuditResource",
    "BatchFacts",
    "BatchList",
    "BatchResource",
    "BulkAccepted",
    "ErrorResource",
    "JobError",
    "JobResource",
    "JobSet",
    "ModelList",
    "ModelResource",
    "QueueResource",
    "RetryResource",
    "RolloutDecisionResource",
    "RolloutResource",
    "RoutingChange",
    "ScheduleList",
    "ScheduleResource",
    "StatsResource",
    "StatsSeriesResource",
    "Timings",
    "VersionChange",
    "VersionResource",
    "WebhookSecretRotation",
]

_ISO: JsonDict = {"format": "date-time"}

# Absent rather than null: the schema shows the key as optional but never null (the None default
# only marks "not set", and `response_model_exclude_unset` leaves it out).
_Absent = SkipJsonSchema[None]

# --- jobs ----------------------------------------------------------------------------------------


class Timings(BaseModel):
    """Every key but `cold_start_ms` is always present; a time not reached yet is null."""

    enqueued_at: str = Field(json_schema_extra=_ISO)
    started_at: str | None = Field(json_schema_extra=_ISO)
    finished_at: str | None = Field(json_schema_extra=_ISO)
    queue_wait_ms: float | None
    model_ms: float | None
    total_ms: float | None
    cold_start_ms: float | _Absent = Field(
        default=None, description="Only for a job that woke its version from zero (`min_replicas` 0): how long "
                                  "it waited for the version's first worker to start; part of `queue_wait_ms`")


class BatchFacts(BaseModel):
    """The batch the job ran in; both null until it ran."""

    size: int | None
    close_reason: str | None = Field(json_schema_extra={"enum": [*CLOSE_REASONS, None]})


class JobError(BaseModel):
    code: str
    message: str


_QUEUE_POSITION = ("Only while queued: how many jobs are ahead of this one in its version and lane (0: the "
                   "next one a worker reads). An estimate: a job ahead that is cancelled or expires still "
                   "counts until the workers' reading passes it")
_ESTIMATED_START = ("Only while queued: seconds until a worker may start it, the jobs in front of it (those ahead "
                    "and those its workers have read and not finished; a bulk job's include the online lane's) "
                    "over the rate its live workers were measured draining a backlog at; null while no live "
                    "worker has measured a rate. An estimate")


class RetryResource(BaseModel):
    max_attempts: int = Field(description="Starts in all, the first included")
    on: list[RetryOn] = Field(description="The failures that re-queue the job while attempts are left")


class AttemptError(BaseModel):
    """How one attempt of the job ended without making it final: re-queued by its retry policy, or its
    run lost to a worker error (code `worker_error`)."""

    attempt: int = Field(description="Which start this was, from 1")
    error: JobError
    at: str = Field(json_schema_extra=_ISO)


class JobResource(BaseModel):
    """The job resource. `output`, `error`, `metadata`, `start_by`, `run_timeout_s`, `retry` and
    `attempt_errors` are absent (not null) when there is none."""

    id: str
    status: JobStatus
    model: str
    version: str
    lane: Lane
    priority: int = Field(default=1, ge=0, le=2, description=(
        "Within its version and lane, 0 runs first, then 1 (the default), then 2; a job that has waited "
        "the server's ageing bound (`SLUICE_PRIORITY_AGEING_S`, 10 s by default) runs as 0"))
    cache_hit: bool
    attempts: int = Field(description="How many times the job was started")
    timings: Timings
    batch: BatchFacts
    input_uri: str | _Absent = Field(default=None, description="The object the input was read from, as submitted")
    output_uri: str | _Absent = Field(default=None, description="Where the worker writes the output (JSON) "
                                                                "instead of `output`, as submitted")
    output_size: int | _Absent = Field(default=None, description="The bytes written to `output_uri`")
    output_sha256: str | _Absent = Field(default=None, description="The sha256 (hex) of what was written to "
                                                                   "`output_uri`")
    start_by: str | _Absent = Field(default=None, json_schema_extra=_ISO, description=(
        "The instant by which the job must start, else `expired`: the earlier of its `start_by` and its "
        "submission plus `timeout_s`"))
    run_timeout_s: float | _Absent = Field(default=None, description="The longest a batch holding the job may run")
    retry: RetryResource | _Absent = None
    attempt_errors: list[AttemptError] | _Absent = Field(default=None, description=(
        "The errors of the attempts that did not make the job final, oldest first: each retried attempt, and "
        "each run lost to a worker error (`worker_error`); a final attempt's error is `error`"))
    output: dict[str, Any] | _Absent = None
    error: JobError | _Absent = None
    metadata: dict[str, str | int | float | bool | None] | _Absent = None
    queue_position: int | _Absent = Field(
        default=None, description=_QUEUE_POSITION)
    estimated_start_s: float | None | _Absent = Field(default=None, description=_ESTIMATED_START)


class QueuedStanding(BaseModel):
    """Where a listed job that is still queued stands (estimates; see the job resource)."""

    id: str
    queue_position: int = Field(description=_QUEUE_POSITION)
    estimated_start_s: float | None = Field(description=_ESTIMATED_START)


class JobSet(BaseModel):
    """The answer to `GET /v1/jobs?ids=`: every listed id once, in the order listed, in one of
    three lists."""

    jobs: list[JobResource] = Field(description="The listed jobs that are final")
    pending: list[str] = Field(description="The ids of the listed jobs not final yet (queued or running)")
    not_found: list[str] = Field(description="Ids that name no job of the caller: unknown, expired or "
                                             "another tenant's")
    queued: list[QueuedStanding] | _Absent = Field(
        default=None, description="The pending jobs still queued, with where they stand; absent when none is")


class BulkAccepted(BaseModel):
    """The answer to a bulk submission: the new jobs' ids, in input order."""

    ids: list[str]
    model: str
    version: str
    count: int


# --- batches and schedules -----------------------------------------------------------------------


class BatchOutput(BaseModel):
    url: str = Field(description="GET it for the rows in input order (`?format=` jsonl, csv or parquet)")
    format: str = Field(description="The output's default format")


class BatchResource(BaseModel):
    """A batch-scoring run. `done` rows succeeded, `failed` rows have a per-row error; `total` is
    null until the feeder has counted the input."""

    id: str
    model: str
    version: str
    status: str = Field(json_schema_extra={"enum": list(BatchState)})
    total: int | None
    done: int
    failed: int
    created_at: str = Field(json_schema_extra=_ISO)
    started_at: str | None = Field(json_schema_extra=_ISO)
    finished_at: str | None = Field(json_schema_extra=_ISO, description="Set once the output holds every row "
                                                                       "that ran (a cancelled batch too)")
    output: BatchOutput
    error: str | _Absent = Field(default=None, description="Why the whole batch failed")
    schedule_id: str | _Absent = None
    slot: str | _Absent = Field(default=None, json_schema_extra=_ISO)
    metadata: dict[str, str | int | float | bool | None] | _Absent = None


class BatchList(BaseModel):
    batches: list[BatchResource]


class ScheduleResource(BaseModel):
    id: str
    tenant: str
    model: str
    version: str | None = Field(description="Null: each run is routed like the tenant's jobs")
    cron: str
    timezone: str
    input_uri: str
    input_format: str | None
    text_field: str
    output_uri: str | None
    output_format: str
    callback_url: str | None
    created_at: str = Field(json_schema_extra=_ISO)
    next_run_at: str = Field(json_schema_extra=_ISO)
    last_error: str | None = Field(description="Why the last dispatch failed (its slots stay due and are "
                                               "tried again); null once one succeeds")
    last_error_at: str | None = Field(json_schema_extra=_ISO)


class ScheduleList(BaseModel):
    schedules: list[ScheduleResource]


# --- errors --------------------------------------------------------------------------------------


class RetryWith(BaseModel):
    """What to change for the retry to pass: a 429 of the online lane names the bulk lane."""

    lane: Lane


class ErrorDetail(BaseModel):
    code: str = Field(description="Machine-readable: e.g. too_many_requests, not_servable, job_expired")
    message: str
    retry_with: RetryWith | _Absent = None


class ErrorResource(BaseModel):
    """Every error answer: `{"error": {"code", "message"}}`, plus `retry_with` where it applies."""

    error: ErrorDetail


# --- the registry --------------------------------------------------------------------------------


class TuningProposal(BaseModel):
    """The nightly re-tune's last proposal (scheduler/retune.py): the best setting within the budget
    in the simulator, on the mix the version served, beside the current one's figure."""

    max_batch_size: int
    max_wait_ms: float
    throughput_rps: float = Field(description="Simulated sustained throughput of the proposed setting")
    p99_ms: float = Field(description="Its simulated p99")
    p99_budget_ms: float
    current_rps: float | None = Field(description="The current setting's best within the budget in the same "
                                      "simulation; null where it never meets the budget")
    gain: float | None = Field(description="throughput_rps / current_rps - 1; null with current_rps null")
    planned_at: float = Field(description="Unix seconds")
    on: dict[str, Any] = Field(description="The mix it was planned on (becomes `tuned_on` when applied)")


class VersionBatching(BaseModel):
    max_batch_size: int
    max_wait_ms: float
    isolate_tenants: bool
    p99_budget_ms: float | None = Field(default=None, description="The p99 the batching is re-tuned to; null: "
                                        "never re-tuned")
    auto_tune: bool = Field(default=False, description="The nightly job applies its proposal itself")
    tuned_at: str | None = Field(default=None, description="When the batching was last set from a proposal "
                                 "(ISO 8601), or null")
    tuned_on: dict[str, Any] | None = Field(default=None, description=(
        "What it was tuned on: `mix` (inputs per cost bucket), `samples`, `window_h`, `until`, `passes`, `fit`"))
    proposal: TuningProposal | None = Field(default=None, description="The nightly job's last proposal, or null")
    drift: dict[str, float] | None = Field(default=None, description=(
        "One version's resource only, once tuned: per lane, the total-variation distance (0 to 1) between "
        "the last 24 h's served mix and `tuned_on`'s (the `sluice_mix_drift` gauge)"))


class ProcessPlacement(BaseModel):
    """A worker process (placement group) serving the version, and the versions it shares it with."""

    group: str
    tier: str = Field(description="latency, batch, or mixed where the operator lets tiers share a process")
    shares_with: list[str] = Field(description="The other versions this process serves, as model/version")


class Replicas(BaseModel):
    """The scheduler's last scaling decision for the version (absent when no scheduler has made one
    in the last minute)."""

    desired: int
    live: int
    reason: str
    processes: list[ProcessPlacement] = Field(default_factory=list,
                                              description="The worker processes the version is placed on")
    not_served: str | None = Field(default=None, description="Why no worker can serve the version now "
                                   "(submissions get 503 `not_served`), or null")
    scale_to_zero: str | None = Field(
        default=None, json_schema_extra={"enum": [*(state.value for state in ZeroState), None]},
        description="A version with `min_replicas` 0: `asleep` (idle, placed on no process; a submission is "
                    "accepted and wakes it), `waking` (its first worker is starting) or `awake`; null otherwise")


class RunningPrecision(BaseModel):
    """A precision the version's live workers run, as their start-up calibration chose it or the
    artifact's `?precision=` asked for it."""

    precision: str = Field(description="fp32, bf16, fp16 or int8")
    speedup: float | None = Field(description="Its speed over fp32's, measured at the worker's start-up; "
                                  "null where nothing was measured")
    workers: int = Field(description="Live workers running it")


class VersionResource(BaseModel):
    version: str
    state: str = Field(json_schema_extra={"enum": [state.value for state in VersionState]})
    artifact: str
    sha256: str
    batching: VersionBatching
    min_replicas: int
    max_replicas: int
    cache_ttl_s: int = Field(description="Seconds the response cache keeps an output; 0: no cache")
    max_queue_s: float | None = Field(default=None, description="Seconds within which a job naming neither "
                                      "`start_by` nor `timeout_s` must start, else it expires; null: none")
    run_timeout_s: float | None = Field(default=None, description="The run limit of a job naming no "
                                        "`run_timeout_s`; null: none")
    last_error: str | None = Field(description="Why the version's last load failed, if it did")
    handler: str | None = Field(default=None, description="Kind `handler`: the class serving the version")
    input_schema: dict[str, Any] | None = Field(default=None, description="The declared JSON Schema of one input")
    output_schema: dict[str, Any] | None = Field(default=None, description="The declared JSON Schema of one output")
    allow_pickle: bool = Field(default=False, description="Kind `torch-export`: whether an admin let the version's "
                               "archive load even though a pickle in it could run code in the worker")
    replicas: Replicas | None = None
    running_precision: list[RunningPrecision] = Field(
        default_factory=list, description="What the live workers run (only on the version's own resource); "
        "empty for kinds with no precision to choose")


class ModelResource(BaseModel):
    name: str
    kind: str = Field(json_schema_extra={"enum": [kind.value for kind in ModelKind]})
    tier: str = Field(json_schema_extra={"enum": [tier.value for tier in Tier]},
                      description="Availability tier: `latency` models' need for workers is met before `batch` ones'")
    versions: list[VersionResource]
    routing: dict[str, float] = Field(description="Traffic weight per version; versions without one get none")


class ModelList(BaseModel):
    models: list[ModelResource]


class AuditLog(BaseModel):
    """A model's audit log, newest first; page back with `before` = the last entry's id."""

    entries: list[AuditResource]


class QualityWindow(BaseModel):
    """One version's quality aggregate over one closed window (written by the scheduler)."""

    window_start: str = Field(json_schema_extra=_ISO)
    window_s: int
    count: int
    errors: int
    metrics: dict[str, Any] = Field(description="Quality proxies of the window: sizes, top probability, labels, "
                                                "shadow agreement, as the kind has them")


class MixDay(BaseModel):
    """One UTC day of one lane of a version: its inputs per cost bucket (the scheduler's daily fold)."""

    day: str = Field(description="The UTC day, YYYY-MM-DD")
    lane: Lane
    total: int
    counts: dict[str, int] = Field(description="Bucket (a cost's upper bound, or `inf`) -> inputs; empty ones left out")


class MixResource(BaseModel):
    model: str
    version: str
    buckets: list[str] = Field(description="Every bucket's label, lowest first: powers of two up to 4096, then `inf`")
    days: list[MixDay]


class QualityResource(BaseModel):
    model: str
    version: str
    windows: list[QualityWindow]


class AuditResource(BaseModel):
    """One row of the registry's audit log; `before` and `after` are whatever the action changed."""

    id: int
    at: str = Field(json_schema_extra=_ISO)
    actor: str
    action: str
    model: str | None
    before: Any
    after: Any
    reason: str | None


class TenantShare(BaseModel):
    """A tenant's weight in fair sharing after a change."""

    id: str
    share: float = Field(description="Its weight when tenants share a version's workers (1 by default)")


class WebhookSecretRotation(BaseModel):
    """A tenant's webhook secret after a rotation, shown to the admin as at the tenant's creation."""

    tenant: str
    webhook_secret: str = Field(description="The secret deliveries are signed with from now on")
    previous_until: str | None = Field(json_schema_extra=_ISO, description=(
        "Until when the replaced secret signs deliveries too; null when it no longer does"))
    audit: AuditResource | None = Field(description="The audit row; null when the secret was already this one")


class RoutingChange(BaseModel):
    """The routing table after a change, and the audit row that records it."""

    routing: dict[str, float]
    audit: AuditResource


class VersionChange(VersionResource):
    """The version after a change, and the audit row that records it."""

    audit: AuditResource


# --- rollouts ------------------------------------------------------------------------------------


class RolloutDecisionResource(BaseModel):
    """One decision of a rollout: its start, each look of the controller, a promotion, a rollback
    or an abort, with the evidence it was taken on."""

    id: int
    at: str = Field(json_schema_extra=_ISO)
    step_index: int = Field(description="The step the rollout was at when this was decided; -1: the shadow phase")
    action: str = Field(json_schema_extra={"enum": list(ROLLOUT_ACTIONS)})
    reason: str
    audit_id: int | None = Field(description="The audit row of the routing change it made, if it made one")
    evidence: dict[str, Any] = Field(description="What the decision saw: the policy at the start; soak, samples, "
                                                 "live workers and every test's statistic, p-value, effect and "
                                                 "margin at a look; the restored weights at an abort")


class RolloutResource(BaseModel):
    """A canary rollout of a model and its latest decisions, oldest first."""

    id: int
    model: str
    canary: str
    stable: str
    state: str = Field(json_schema_extra={"enum": list(RolloutState)})
    step_index: int = Field(description="Index into `policy.steps`; -1: the shadow phase, before any canary weight")
    weight: float = Field(description="The canary's percentage of traffic at this step")
    policy: dict[str, Any] = Field(description="Steps, soak, sample bars, alpha and margins, as started")
    started_at: str = Field(json_schema_extra=_ISO)
    step_started_at: str = Field(json_schema_extra=_ISO)
    finished_at: str | None = Field(json_schema_extra=_ISO)
    reason: str | None = Field(description="Why it finished, once it has")
    decisions: list[RolloutDecisionResource]


class RolloutList(BaseModel):
    """A model's rollouts, newest first (empty when it never had one)."""

    items: list[RolloutResource]


# --- stats ---------------------------------------------------------------------------------------


class Percentiles(BaseModel):
    """Exact over the window (linear interpolation); null when the window has no samples, and p99
    also while the window has fewer than `p99_min_samples`."""

    p50: float | None
    p95: float | None
    p99: float | None


class BatchSizes(BaseModel):
    mean: float
    histogram: dict[str, int] = Field(description="Batches per batch size")


class CloseReasons(BaseModel):
    """Batches per close reason."""

    size: int
    age: int
    drain: int


class CostSummary(BaseModel):
    """What the window's passes used and cost (sluice/cost.py): each pass is charged its model time
    plus the idle slot time before it, times its slot's cores and GPUs."""

    padded_tokens: int = Field(description="Tokens the model computed, each pass padded to its longest input")
    real_tokens: int
    padding_ratio: float | None = Field(description="padded_tokens / real_tokens; null without tokens")
    idle_slot_s: float = Field(description="Idle model-slot seconds charged to this version's passes")
    core_s: float
    gpu_s: float
    price_per_core_hour: float = Field(description="As configured; 0: unknown")
    price_per_gpu_hour: float = Field(description="As configured; 0: unknown")
    per_1k_jobs: float | None = Field(description="Cost of 1,000 jobs; null when a needed price is unknown")


class QualitySummary(BaseModel):
    """Aggregates of the jobs' quality proxies; a key is absent when no sample carried its proxy."""

    output_size_mean: float | _Absent = None
    mean_top_p: float | _Absent = None
    low_confidence_rate: float | _Absent = None
    low_confidence_threshold: float | _Absent = None
    label_counts: dict[str, int] | _Absent = None
    label_distribution: dict[str, float] | _Absent = None
    mean_agreement: float | _Absent = None
    min_agreement: float | _Absent = None
    agreement_n: int | _Absent = None


class StatsResource(BaseModel):
    model: str
    version: str
    window_s: float
    count: int
    errors: int
    error_rate: float
    throughput_per_s: float
    queue_wait_ms: Percentiles
    model_ms: Percentiles
    total_ms: Percentiles
    batch_size: BatchSizes
    close_reasons: CloseReasons
    fill_ms: Percentiles = Field(description="Time to fill: a batch's oldest arrival at the worker to its close, "
                                             "per job")
    cost: CostSummary
    quality: QualitySummary
    percentile_method: str
    p99_min_samples: int = Field(description="The samples a p99 needs; with fewer `count`, every p99 is null")
    resident_bytes: int | None = Field(description="Resident memory one copy of the version's weights added to "
                                                   "its worker process, the most over its live workers; null when "
                                                   "none is live")


class SeriesBucket(BaseModel):
    """The jobs of one version finished in [t, t + step_s)."""

    t: float = Field(description="The bucket's start, Unix seconds")
    count: int
    errors: int
    error_rate: float | None = Field(description="Null when the bucket has no jobs")
    throughput_per_s: float
    queue_wait_ms: Percentiles
    model_ms: Percentiles
    batch_size_mean: float | None = Field(description="Jobs per batch; null when the bucket has no jobs")


class StatsSeriesResource(BaseModel):
    """One version's finished jobs over time, in complete buckets of `step_s` on a grid of
    multiples of `step_s`, oldest first: the bucket in progress is not reported."""

    model: str
    version: str
    window_s: float
    step_s: float
    since: float = Field(description="The first bucket's start, Unix seconds")
    until: float = Field(description="The last bucket's end, Unix seconds: at most `step_s` before now")
    buckets: list[SeriesBucket]
    percentile_method: str
    p99_min_samples: int = Field(description="The jobs a bucket's p99 needs; with fewer it is null")


# --- queues --------------------------------------------------------------------------------------


class LaneQueueResource(BaseModel):
    lag: int = Field(description="Entries in the lane's stream: its jobs queued and in flight")
    pending: int = Field(description="Entries delivered to a worker and not acknowledged")
    oldest_age_s: float = Field(description="Seconds since the oldest entry was added; 0 when there is none")


class VersionQueueResource(BaseModel):
    version: str
    lanes: dict[Lane, LaneQueueResource]
    live_workers: int = Field(description="Workers whose heartbeat is recent")


class QueueResource(BaseModel):
    """A model's queues as Redis holds them now, per version that is not retired."""

    model: str
    at: float = Field(description="When they were read, Unix seconds")
    versions: list[VersionQueueResource]
