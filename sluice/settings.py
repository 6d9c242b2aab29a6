"""The one configuration surface, read from `SLUICE_*` environment variables.

A `Settings` object is built once by the process entry point (`sluice ...`) and passed down;
nothing reads the environment at import time. Each component takes keyword-only arguments and
`Settings` maps onto them, so tests build components directly without any environment.
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from sluice.cost import Prices
from sluice.wire.connections import as_cluster_url, cluster_url


class Settings(BaseSettings):
    # A refused value is never echoed: some hold credentials (keys, storage options, URLs).
    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="ignore", hide_input_in_errors=True)

    # Unset means "start the embedded store" under `home` (sluice up only).
    redis_url: str | None = None
    # Treat redis_url as any node of a Redis Cluster (as the `redis+cluster://` scheme does).
    redis_cluster: bool = False
    # Celery's broker and result backend; unset, the Redis of redis_url. Celery's Redis transport
    # does not speak Cluster: with a cluster this must name a single Redis (or any Celery broker).
    celery_broker_url: str | None = None
    database_url: str | None = None
    home: Path = Path(".sluice")

    api_host: str = "127.0.0.1"
    api_port: int = 8000
    flower_port: int = 5555
    # Workers, the scheduler and the Celery worker each serve their metrics here (the API serves
    # its own on api_port). Port 0 lets the kernel pick one, so one machine runs many workers;
    # each process advertises where it listens (sluice.exposition).
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=0, ge=0, le=65535)

    bootstrap_admin_key: SecretStr | None = None

    # One JSON object per line (sluice.logs); `text` for a person reading a terminal.
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["json", "text"] = "json"

    # The registry's bounds in the serving processes (API, workers, scheduler, Celery), never in
    # `sluice migrate`, whose statements may rightly run long: Postgres cancels a statement past
    # the statement timeout and a lock wait past the lock timeout, and a Postgres that does not
    # answer at all (stopped, or a network gone quiet) is given up by the client one second after
    # the statement timeout, its connection closed, so no thread or pooled connection waits longer.
    registry_statement_timeout_s: float = Field(default=5.0, gt=0, le=600)
    registry_lock_timeout_s: float = Field(default=2.0, gt=0, le=600)
    registry_connect_timeout_s: float = Field(default=3.0, ge=1, le=60)

    result_ttl_s: int = Field(default=24 * 3600, ge=60)
    idempotency_ttl_s: int = Field(default=24 * 3600, ge=60)
    claim_after_s: float = Field(default=30.0, gt=0)
    max_deliveries: int = Field(default=3, ge=1)
    routing_refresh_s: float = Field(default=30.0, gt=0)
    auth_cache_s: float = Field(default=60.0, ge=0)

    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    max_text_chars: int = Field(default=20_000, ge=1)
    max_bulk_items: int = Field(default=1000, ge=1)
    max_wait_s: float = Field(default=60.0, ge=0)
    # Admission of jobs answered from the response cache (docs/ARCHITECTURE.md, "Admission"): the
    # rate tokens each spends (a queued job spends one), and how many such jobs' records a tenant
    # may have stored at once (each lives result_ttl_s); over it, 429 `stored_jobs_limit`.
    cache_hit_token_cost: float = Field(default=1.0, ge=0, le=1)
    max_answered_jobs: int = Field(default=100_000, ge=1)

    # Durable accept (sluice/wire/durability.py): answer 202 only once the store has fsynced the job,
    # waiting up to the timeout, else 503 `not_durable` with the job withdrawn. Needs WAITAOF
    # (Redis >= 7.2 or Valkey) with appendonly on; checked at start-up.
    durable_accept: bool = False
    durable_accept_timeout_ms: int = Field(default=1000, ge=1, le=60_000)

    shutdown_grace_s: float = Field(default=30.0, ge=0)
    # A batch waits for more jobs only while another of its lane is expected within the version's
    # `max_wait_ms` (sluice/batch_window.py); off, it always waits the whole `max_wait_ms`.
    batch_adaptive_wait: bool = True
    worker_prefetch_batches: int = Field(default=4, ge=1)
    # `?precision=auto` versions (workers/models/precision.py): the fastest precision that stays
    # within the quality bound against fp32 and reaches `precision_min_speedup` times its speed at
    # the worker's start-up calibration, measured over `precision_calibration_rounds` rounds.
    # The old `SLUICE_INT8_*` names are still read.
    precision_min_speedup: float = Field(default=1.15, ge=1.0, validation_alias=AliasChoices(
        "precision_min_speedup", "SLUICE_PRECISION_MIN_SPEEDUP", "SLUICE_INT8_MIN_SPEEDUP"))
    precision_calibration_rounds: int = Field(default=5, ge=1, le=50, validation_alias=AliasChoices(
        "precision_calibration_rounds", "SLUICE_PRECISION_CALIBRATION_ROUNDS", "SLUICE_INT8_CALIBRATION_ROUNDS"))
    precision_min_cosine: float = Field(default=0.999, gt=0.0, le=1.0)  # embeddings, worst text
    precision_min_label_agreement: float = Field(default=0.995, gt=0.0, le=1.0)  # classifiers
    precision_max_probability_error: float = Field(default=0.01, ge=0.0, le=1.0)  # classifiers, mean over texts
    # A batch still running after this many seconds fails its jobs (`handler_timeout`) and the
    # worker, whose model thread cannot be taken back, exits for a fresh one.
    batch_timeout_s: float = Field(default=120.0, gt=0)
    # Tenants share a version's workers in fair turns (sluice/fair_share.py): a backed-up lane's jobs
    # are held per tenant and priority and released in turns. Off, a lane is first come, first served.
    fair_share: bool = True
    # A queued job that has waited this long runs as the most urgent priority with work: the bound
    # on how long priority 0 can hold back priority 2.
    priority_ageing_s: float = Field(default=10.0, gt=0, le=3600)
    # The most `retry.max_attempts` a submission may ask for (sluice/retry.py).
    retry_max_attempts: int = Field(default=5, ge=1, le=100)
    # How often the scheduler's sweeper expires queued jobs past their deadline (`timeout_s`,
    # `start_by`), between its scaling ticks: a job expires at most this late.
    deadline_sweep_s: float = Field(default=0.5, gt=0, le=60)
    # What an hour of one core and of one GPU costs (one currency), for the cost per 1,000 jobs of
    # `/stats`, the dashboard and Grafana (sluice/cost.py); 0 = unknown, shown as "—".
    price_per_core_hour: float = Field(default=0.0, ge=0)
    price_per_gpu_hour: float = Field(default=0.0, ge=0)

    # Artifacts (sluice/artifact_store.py). `sluice models register` publishes to `artifact_store`
    # (an fsspec URL: file://, s3://, gs://, ...; unset: HOME/artifacts); workers fetch remote
    # artifacts into `artifact_cache_dir` (unset: HOME/cache/artifacts), keyed by content hash and
    # verified before load. `artifact_ca_bundle` adds a CA to trust for https:// stores.
    artifact_store: str | None = None
    artifact_cache_dir: Path | None = None
    artifact_ca_bundle: Path | None = None
    cpu_cores: int | None = None

    # Autoscaling (scheduler/autoscale.py) and placement (scheduler/placement.py): the worker
    # processes scale-up may open, each with `cores // worker_slots` torch threads (floors are
    # placed whatever it says); unset: the cores the local actuator may use (`cpu_cores` or all).
    worker_slots: int | None = Field(default=None, ge=1)
    scale_headroom: float = Field(default=0.2, ge=0)
    scale_drain_target_s: float = Field(default=30.0, gt=0)
    scale_down_stabilization_s: float = Field(default=300.0, ge=0)
    scale_max_step_down: int = Field(default=1, ge=1)
    scale_interval_s: float = Field(default=2.0, gt=0)
    # A version with `min_replicas` 0 (scheduler/idle.py) releases its placement after this long
    # with nothing queued, running or arriving; the next job wakes it.
    scale_to_zero_idle_s: float = Field(default=300.0, gt=0)
    # Placement (scheduler/placement.py): whether a latency-tier version may share a worker process
    # with a batch-tier one (unset: only when the budget gives a single process), the share of the
    # machine's memory one process may hold in loaded weights, and how long a retired version's
    # workers may finish what is queued for it before the rest fails with `version_retired`.
    pack_across_tiers: bool | None = None
    process_memory_share: float = Field(default=0.5, gt=0, le=1)
    retire_drain_s: float = Field(default=60.0, ge=0)
    # The kubernetes actuator (scheduler/kubernetes.py) keeps one Deployment per placement group in
    # this namespace, each a copy of the template Deployment named here (`<template>-<group>`).
    kubernetes_namespace: str = "sluice"
    kubernetes_worker_template: str = "sluice-worker"

    # Circuit breaker per version (sluice.breaker): trip on this error rate over at least
    # `breaker_min_samples` jobs in the window, or on no live worker for the grace period.
    breaker_error_rate: float = Field(default=0.5, gt=0, le=1)
    breaker_min_samples: int = Field(default=20, ge=1)
    breaker_window_s: float = Field(default=30.0, gt=0)
    breaker_no_worker_grace_s: float = Field(default=30.0, ge=0)
    breaker_open_s: float = Field(default=10.0, gt=0)

    # CIDRs a callback may reach although private or loopback (on-premise receivers, tests):
    # `SLUICE_WEBHOOK_ALLOWED_NETWORKS=10.0.0.0/8,127.0.0.0/8` (NoDecode: a comma list, not JSON).
    webhook_allowed_networks: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Delivery (workers/delivery.py): the timeout of each network operation, the deadline of a whole
    # attempt (connect, send and every byte of the answer's head: a receiver that drips its status
    # line a byte at a time trips it, where it never trips the per-operation timeout), attempts
    # before a delivery is recorded as failed, the capped exponential backoff between attempts
    # (defaults: 12 attempts over about two hours, well inside result_ttl_s, which bounds how long
    # the job record is there to send), how often beat re-sends overdue deliveries, and the delivery
    # worker's threads.
    webhook_timeout_s: float = Field(default=10.0, gt=0, le=120)
    webhook_attempt_deadline_s: float = Field(default=10.0, gt=0, le=300)
    webhook_max_attempts: int = Field(default=12, ge=1, le=100)
    webhook_backoff_base_s: float = Field(default=5.0, gt=0)
    webhook_backoff_cap_s: float = Field(default=3600.0, gt=0)
    webhook_sweep_s: float = Field(default=30.0, gt=0)
    webhook_concurrency: int = Field(default=8, ge=1, le=256)
    # Fairness between tenants (sluice/wire/lua/delivery_begin.lua): a tenant's attempts in flight at once,
    # over every delivery worker, are at most this share of webhook_concurrency (at least one), and
    # a tenant's attempts pass a token bucket of its own (rate per second, burst). An attempt over
    # either is deferred, not lost and not counted as an attempt.
    webhook_tenant_share: float = Field(default=0.25, gt=0, le=1)
    webhook_rate_per_tenant_s: float = Field(default=20.0, gt=0)
    webhook_rate_burst: int = Field(default=100, ge=1)

    # Batch scoring (workers/batches.py). An `input_uri` names a file in its tenant's folder,
    # `batch_root/tenants/<tenant>/` (unset: refused; sluice/tenant_files.py); uploads, inline
    # inputs and outputs live under `batch_dir` (default HOME/batches), which the API and the
    # Celery workers share. A batch keeps at most `batch_max_in_flight` jobs on its version's
    # bulk lane; at most `batch_max_running` batches are fed at once (in all); a feeder that stops
    # renewing its lease for `batch_lease_s` is replaced on the next sweep, which beat sends
    # every `batch_sweep_s` with the due schedules' dispatch.
    batch_root: Path | None = None
    batch_dir: Path | None = None
    batch_max_in_flight: int = Field(default=256, ge=1, le=100_000)
    batch_max_running: int = Field(default=4, ge=1, le=256)
    # Feeders one Celery worker process runs at once: each holds a pool thread for its whole
    # batch. Deliveries have a queue and a worker of their own (workers/tasks.py), so feeders never
    # take their threads; a worker that consumes both queues still keeps the rest for deliveries.
    batch_feeders_per_worker: int = Field(default=2, ge=1, le=64)
    batch_lease_s: float = Field(default=30.0, ge=2)
    batch_sweep_s: float = Field(default=2.0, gt=0)
    batch_checkpoint_s: float = Field(default=1.0, gt=0)
    max_batch_inputs: int = Field(default=100_000, ge=1)
    # The most bytes of one JSONL line or CSV record (its newline included) an input's reader holds
    # (sluice/batch_rows.py): a longer one fails its batch; an inline input longer than this as a
    # JSON line is refused at submit.
    batch_max_line_bytes: int = Field(default=1 << 20, ge=1024, le=1 << 30)
    max_batch_upload_bytes: int = Field(default=4 * 1024**3, ge=1024)
    # Payloads by reference (sluice/references.py): the most bytes of one object a job names by
    # `input_uri` (checked at submit and again when the worker reads it) or writes to `output_uri`.
    max_object_bytes: int = Field(default=64 * 1024**2, ge=1024)
    # An object store for references (sluice/tenant_objects.py): an fsspec URL such as
    # `s3://bucket/prefix` whose `tenants/<tenant>/` folders hold the tenants' objects (unset: none),
    # and the filesystem's storage options as a JSON object (credentials, `client_kwargs`'
    # `endpoint_url`; unset: the library's own, e.g. AWS_* variables), kept secret.
    object_root: str | None = None
    object_storage_options: SecretStr | None = None

    # Re-tuning batching (scheduler/retune.py): beat sends the job once a day at `retune_hour_utc`;
    # a version with `auto_tune` gets its proposal applied when the predicted gain in sustained
    # throughput within its p99 budget is over `retune_min_gain` (0.1: ten per cent more).
    retune_hour_utc: int = Field(default=3, ge=0, le=23)
    retune_min_gain: float = Field(default=0.1, ge=0)

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @field_validator("webhook_allowed_networks", mode="before")
    @classmethod
    def _split_networks(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("webhook_allowed_networks")
    @classmethod
    def _valid_networks(cls, value: list[str]) -> list[str]:
        for cidr in value:
            ipaddress.ip_network(cidr, strict=False)
        return value

    @field_validator("object_root")
    @classmethod
    def _object_url(cls, value: str | None) -> str | None:
        if value is not None:
            parsed = urlparse(value)
            if not parsed.scheme or parsed.scheme == "file" or not parsed.netloc or parsed.query or parsed.fragment:
                raise ValueError("SLUICE_OBJECT_ROOT must be an fsspec URL with a bucket, e.g. s3://bucket/prefix "
                                 "(file:// references live under SLUICE_BATCH_ROOT)")
        return value

    @field_validator("object_storage_options")
    @classmethod
    def _options_object(cls, value: SecretStr | None) -> SecretStr | None:
        # The message never quotes the value: it holds credentials.
        if value is not None:
            try:
                parsed = json.loads(value.get_secret_value())
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                raise ValueError("SLUICE_OBJECT_STORAGE_OPTIONS must be a JSON object")
        return value

    @field_validator("bootstrap_admin_key")
    @classmethod
    def _strong_admin_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("SLUICE_BOOTSTRAP_ADMIN_KEY must be at least 16 characters")
        return value

    @model_validator(mode="after")
    def _batch_store_apart(self) -> Settings:
        # Uploads and outputs are read through their batch's resource only; inside the batch
        # root they could be named by an input_uri (a tenant's folder) and read by anyone.
        if self.batch_root is not None and self.batch_storage.is_relative_to(self.batch_root.resolve()):
            raise ValueError("SLUICE_BATCH_DIR must not lie inside SLUICE_BATCH_ROOT")
        return self

    @property
    def prices(self) -> Prices:
        return Prices(per_core_hour=self.price_per_core_hour, per_gpu_hour=self.price_per_gpu_hour)

    @property
    def object_options(self) -> dict[str, Any]:
        if self.object_storage_options is None:
            return {}
        options: dict[str, Any] = json.loads(self.object_storage_options.get_secret_value())
        return options

    @property
    def batch_storage(self) -> Path:
        return (self.batch_dir or self.home / "batches").resolve()

    @property
    def artifact_cache(self) -> Path:
        return (self.artifact_cache_dir or self.home / "cache" / "artifacts").resolve()

    @property
    def artifact_store_url(self) -> str:
        return self.artifact_store or (self.home / "artifacts").resolve().as_uri()

    def require_redis_url(self) -> str:
        if not self.redis_url:
            raise ValueError("SLUICE_REDIS_URL is not set (only `sluice up` starts an embedded store)")
        return as_cluster_url(self.redis_url) if self.redis_cluster else self.redis_url

    def require_celery_broker_url(self) -> str:
        if self.celery_broker_url:
            return self.celery_broker_url
        url = self.require_redis_url()
        if cluster_url(url) is not None:
            raise ValueError("SLUICE_CELERY_BROKER_URL is not set: Celery cannot use a Redis Cluster as its broker; "
                             "name a single Redis (or another Celery broker) for webhooks and batch scoring")
        return url

    def require_database_url(self) -> str:
        if not self.database_url:
            raise ValueError(
                "SLUICE_DATABASE_URL is not set (only `sluice up` starts an embedded store)"
            )
        return self.database_url
