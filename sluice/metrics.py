"""Prometheus metric names, defined once. Labels are model, version, lane and outcomes only:
never tenant input, never job ids (unbounded cardinality and user data)."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

from sluice.artifacts import PRECISION_MODES
from sluice.mix import COST_BOUNDS

# 2 s, the registry's default latency budget, is a bound, for dashboards; the latency SLO counts
# each version's jobs over its own budget (JOBS_OVER_BUDGET, deploy/prometheus/sluice.rules.yml).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 2.5, 5, 10, 30, 60, 300)

API_REQUESTS = Counter("sluice_api_requests_total", "HTTP requests", ["route", "method", "status"])
API_LATENCY = Histogram("sluice_api_request_seconds", "HTTP request latency", ["route", "method"],
                        buckets=_LATENCY_BUCKETS)
JOBS_SUBMITTED = Counter("sluice_jobs_submitted_total", "Jobs accepted", ["model", "version", "lane"])
JOBS_REJECTED = Counter("sluice_jobs_rejected_total", "Submissions refused", ["model", "code"])
CACHE_LOOKUPS = Counter("sluice_cache_lookups_total", "Response-cache lookups at submission, by result (hit, miss)",
                        ["model", "version", "result"])

JOBS_FINISHED = Counter("sluice_jobs_finished_total", "Jobs reaching a final state",
                        ["model", "version", "status"])
# Per-job latencies carry the lane: a bulk job's wait behind online traffic is by design, and
# blending the two would hide an online regression behind a batch's long tail.
QUEUE_WAIT = Histogram("sluice_queue_wait_seconds", "Enqueue to batch start, per job", ["model", "version", "lane"],
                       buckets=_LATENCY_BUCKETS)
JOB_SECONDS = Histogram("sluice_job_seconds", "Enqueue to stored result (end to end), per job",
                        ["model", "version", "lane"], buckets=_LATENCY_BUCKETS)
# The latency SLO's bad events, against each version's own `latency_budget_ms` (the alert rules in
# deploy/prometheus/ divide it by sluice_job_seconds_count): a bucket bound could only be one budget
# for every version.
JOBS_OVER_BUDGET = Counter("sluice_jobs_over_budget_total",
                           "Jobs stored later than their version's latency budget after enqueue",
                           ["model", "version", "lane"])
MODEL_TIME = Histogram("sluice_model_seconds", "Model time per batch", ["model", "version", "lane"],
                       buckets=_LATENCY_BUCKETS)
BATCH_SIZE = Histogram("sluice_batch_size", "Jobs per batch", ["model", "version", "lane"],
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
BATCH_FILL = Histogram("sluice_batch_fill_seconds", "From a batch's first job reaching the batcher to its close",
                       ["model", "version", "lane"], buckets=_LATENCY_BUCKETS)
BATCH_WINDOW = Gauge("sluice_batch_window_seconds", "How long the lane's batches wait for more jobs, as of its last "
                     "batch: max_wait_ms less the lane's recent arrival gap (sluice/batch_window.py)",
                     ["model", "version", "lane"])
BATCH_CLOSED = Counter("sluice_batches_total", "Batches by close reason (size, age, drain)",
                       ["model", "version", "lane", "reason"])
INPUT_COST = Histogram("sluice_input_cost", "Cost of each input a worker ran (tokens for text kinds, the "
                       "handler's cost otherwise): the served mix", ["model", "version", "lane"],
                       buckets=COST_BOUNDS)
MIX_DRIFT = Gauge("sluice_mix_drift", "Total-variation distance (0 to 1) between the last 24 h's served mix and "
                  "the mix the version's batching was tuned on", ["model", "version", "lane"])
PADDING_RATIO = Histogram("sluice_batch_padding_ratio", "Padded tokens / real tokens per batch",
                          ["model", "version", "lane"], buckets=(1, 1.1, 1.25, 1.5, 2, 3, 5, 10))
# What a version costs (sluice/cost.py). The padding ratio is `padded / real` in PromQL; the cost
# per 1,000 jobs is `(core_seconds x price per core-hour + gpu_seconds x price per GPU-hour) / 3600
# / jobs x 1000`, the prices exported as gauges of their own (figures are never labels).
PADDED_TOKENS = Counter("sluice_padded_tokens_total", "Tokens the model computed, each pass padded to its longest "
                        "input", ["model", "version", "lane"])
REAL_TOKENS = Counter("sluice_real_tokens_total", "Real (unpadded) tokens of the inputs the model ran",
                      ["model", "version", "lane"])
SLOT_IDLE = Counter("sluice_slot_idle_seconds_total", "Seconds a worker's model slot sat with no batch, charged to "
                    "the version whose batch ended the idle spell", ["model", "version"])
CORE_SECONDS = Counter("sluice_core_seconds_total", "Core-seconds charged to the version: (model time + idle slot "
                       "time) x the slot's cores", ["model", "version"])
GPU_SECONDS = Counter("sluice_gpu_seconds_total", "GPU-seconds charged to the version: (model time + idle slot "
                      "time) x the slot's GPUs", ["model", "version"])
RESIDENT_BYTES = Gauge("sluice_worker_resident_bytes", "Resident memory the version's weights added to its worker "
                       "process (0 when it shares weights another version loaded)", ["model", "version"])
PRICE_PER_CORE_HOUR = Gauge("sluice_price_per_core_hour", "The configured price of one core-hour (0: unknown)")
PRICE_PER_GPU_HOUR = Gauge("sluice_price_per_gpu_hour", "The configured price of one GPU-hour (0: unknown)")
WEBHOOK_ATTEMPTS = Counter("sluice_webhook_attempts_total",
                           "Webhook delivery attempts by outcome (delivered, retrying, failed, refused; "
                           "deferred: not made, its tenant over its share or rate)", ["outcome"])
WORKER_STATE = Gauge("sluice_worker_ready", "1 when the worker's model is loaded and warm",
                     ["model", "version"])
COLD_START = Gauge("sluice_worker_cold_start_seconds", "Verify + load + warm-up time", ["model", "version"])
WORKER_PRECISION = Gauge("sluice_worker_precision", "1 for the precision the worker runs its model in "
                         "(fp32, bf16, fp16, int8)", ["model", "version", "precision"])
PRECISION_SPEEDUP = Gauge("sluice_worker_precision_speedup", "The running precision's speed over fp32's, measured "
                          "at start-up (CPU time on the CPU, wall time on a GPU)", ["model", "version"])


def clear_precision(model: str, version: str) -> None:
    """Drop the version's precision series, whichever precision it ran."""
    for precision in PRECISION_MODES:
        with contextlib.suppress(KeyError):
            WORKER_PRECISION.remove(model, version, precision)

DESIRED_REPLICAS = Gauge("sluice_desired_replicas", "Replicas the scheduler wants", ["model", "version"])
LIVE_REPLICAS = Gauge("sluice_live_replicas", "Replicas alive", ["model", "version"])
ACTUATOR_ERRORS = Counter("sluice_actuator_errors_total",
                          "Kubernetes API calls of the scheduler's actuator that failed (read, patch, list)",
                          ["operation"])
STREAM_LAG = Gauge("sluice_stream_lag", "Entries not yet acknowledged", ["model", "version", "lane"])
QUEUE_PENDING = Gauge("sluice_queue_pending", "Entries a worker has read and not yet acknowledged",
                      ["model", "version", "lane"])
QUEUE_OLDEST_AGE = Gauge("sluice_queue_oldest_age_seconds", "Age of the oldest entry not yet acknowledged",
                         ["model", "version", "lane"])
LIVE_WORKERS = Gauge("sluice_live_workers", "Workers whose heartbeat is current", ["model", "version"])
BREAKER_OPEN = Gauge("sluice_breaker_open", "1 while the version's circuit breaker is not closed",
                     ["model", "version"])
SHADOW_COPIES = Counter("sluice_shadow_copies_total", "Jobs copied to a shadow version", ["model", "version"])
