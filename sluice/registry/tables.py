"""ORM mapping of the registry (SQLAlchemy 2 typed declarative). Alembic owns the DDL."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import date, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Date,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from sluice.kinds import ModelKind
from sluice.versions import Tier, VersionState
from sluice.vocabulary import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_REPLICAS,
    DEFAULT_MAX_WAIT_MS,
    DEFAULT_MIN_REPLICAS,
    BatchState,
    RolloutState,
)

JsonDoc = JSON().with_variant(JSONB(), "postgresql")


def _one_of(column: str, values: Iterable[str]) -> str:
    """`column IN ('a', 'b')`, spelled as the migrations spelled it, so the ORM and the
    migrated schema carry the same constraint text."""
    return f"{column} IN ({', '.join(repr(str(v)) for v in values)})"


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    webhook_secret: Mapped[str] = mapped_column(String(128))
    # The secret a rotation replaced: deliveries are signed with it too until the time below, so a
    # receiver can switch to the new one at its own pace.
    webhook_secret_previous: Mapped[str | None] = mapped_column(String(128))
    webhook_secret_previous_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    rate_limit_per_s: Mapped[float] = mapped_column(Float, default=200.0)
    rate_burst: Mapped[int] = mapped_column(Integer, default=2000)
    max_queued: Mapped[int] = mapped_column(Integer, default=100_000)
    # Its weight when tenants share a version's workers (sluice/fair_share.py).
    share: Mapped[float] = mapped_column(Float, default=1.0, server_default="1.0")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Model(Base):
    __tablename__ = "models"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    tier: Mapped[str] = mapped_column(String(16), default=Tier.latency, server_default=Tier.latency.value)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())

    versions: Mapped[list[ModelVersion]] = relationship(
        back_populates="model_row", order_by="ModelVersion.created_at"
    )

    __table_args__ = (
        CheckConstraint(_one_of("kind", ModelKind), name="model_kind"),
        CheckConstraint(_one_of("tier", Tier), name="model_tier"),
    )


class ModelVersion(Base):
    __tablename__ = "model_versions"

    model: Mapped[str] = mapped_column(ForeignKey("models.name", ondelete="CASCADE"), primary_key=True)
    version: Mapped[str] = mapped_column(String(64), primary_key=True)
    artifact: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16), default=VersionState.staged)
    max_batch_size: Mapped[int] = mapped_column(Integer, default=DEFAULT_MAX_BATCH_SIZE)
    max_wait_ms: Mapped[float] = mapped_column(Float, default=DEFAULT_MAX_WAIT_MS)
    isolate_tenants: Mapped[bool] = mapped_column(Boolean, default=True)
    min_replicas: Mapped[int] = mapped_column(Integer, default=DEFAULT_MIN_REPLICAS)
    max_replicas: Mapped[int] = mapped_column(Integer, default=DEFAULT_MAX_REPLICAS)
    latency_budget_ms: Mapped[float] = mapped_column(Float, default=2000.0)
    # Seconds a result is answered again from the response cache; 0: no cache.
    cache_ttl_s: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Defaults for a job that names no limit of its own (api/routes/jobs.py): seconds from submission
    # it may wait to start, and the longest one batch holding it may run. Null: none.
    max_queue_s: Mapped[float | None] = mapped_column(Float)
    run_timeout_s: Mapped[float | None] = mapped_column(Float)
    # Kind `handler`: the class serving the version ("package.module:Class", sluice.handler).
    handler: Mapped[str | None] = mapped_column(String(200))
    # JSON Schemas of one input and one output, where the kind does not fix them (handler,
    # torch-export): the API checks inputs against the first before queueing.
    input_schema: Mapped[dict[str, Any] | None] = mapped_column(JsonDoc)
    output_schema: Mapped[dict[str, Any] | None] = mapped_column(JsonDoc)
    last_error: Mapped[str | None] = mapped_column(Text)
    # Kind `torch-export`: loading a .pt2 runs pickle; only an admin may allow it (ARCHITECTURE.md).
    allow_pickle: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    # Set when the version is retired (cleared if it leaves that state): its drain limit counts from it.
    retired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Tuning (scheduler/retune.py): the p99 the batching is tuned to (null: never re-tuned), whether
    # the nightly job may apply its proposal itself, when and on what mix the batching was last
    # tuned, and the job's last proposal.
    p99_budget_ms: Mapped[float | None] = mapped_column(Float)
    auto_tune: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    tuned_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    tuned_on: Mapped[dict[str, Any] | None] = mapped_column(JsonDoc)
    tune_proposal: Mapped[dict[str, Any] | None] = mapped_column(JsonDoc)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now()
    )

    model_row: Mapped[Model] = relationship(back_populates="versions")

    __table_args__ = (
        CheckConstraint(_one_of("state", VersionState), name="version_state"),
        CheckConstraint("max_batch_size >= 1", name="batch_size_positive"),
        CheckConstraint("max_wait_ms >= 0", name="wait_non_negative"),
        CheckConstraint("min_replicas >= 0 AND max_replicas >= min_replicas", name="replica_range"),
        CheckConstraint("cache_ttl_s >= 0", name="cache_ttl_non_negative"),
        CheckConstraint("max_queue_s > 0", name="max_queue_positive"),
        CheckConstraint("run_timeout_s > 0", name="run_timeout_positive"),
        CheckConstraint("p99_budget_ms > 0", name="p99_budget_positive"),
    )


class RoutingWeight(Base):
    __tablename__ = "routing_weights"

    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[str] = mapped_column(String(64), primary_key=True)
    weight: Mapped[float] = mapped_column(Float)

    __table_args__ = (
        ForeignKeyConstraint(
            ["model", "version"], ["model_versions.model", "model_versions.version"], ondelete="CASCADE"
        ),
        CheckConstraint("weight >= 0", name="weight_non_negative"),
    )


class Pin(Base):
    __tablename__ = "pins"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())

    __table_args__ = (
        ForeignKeyConstraint(
            ["model", "version"], ["model_versions.model", "model_versions.version"], ondelete="CASCADE"
        ),
    )


class AuditEntry(Base):
    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now(), index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(64), index=True)
    before: Mapped[Any] = mapped_column(JsonDoc, nullable=True)
    after: Mapped[Any] = mapped_column(JsonDoc, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text)


class QualityAggregate(Base):
    __tablename__ = "quality_aggregates"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(64))
    window_start: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    window_s: Mapped[int] = mapped_column(Integer)
    count: Mapped[int] = mapped_column(Integer, default=0)
    errors: Mapped[int] = mapped_column(Integer, default=0)
    metrics: Mapped[Any] = mapped_column(JsonDoc, default=dict)

    __table_args__ = (
        ForeignKeyConstraint(
            ["model", "version"], ["model_versions.model", "model_versions.version"], ondelete="CASCADE"
        ),
        UniqueConstraint("model", "version", "window_start", "window_s", name="quality_window"),
    )


class MixAggregate(Base):
    """One UTC day of a version's lane: its inputs counted per cost bucket (`sluice.mix`)."""

    __tablename__ = "mix_aggregates"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(64))
    lane: Mapped[str] = mapped_column(String(16))
    day: Mapped[date] = mapped_column(Date)
    total: Mapped[int] = mapped_column(BigInteger, default=0)
    counts: Mapped[Any] = mapped_column(JsonDoc, default=dict)

    __table_args__ = (
        ForeignKeyConstraint(
            ["model", "version"], ["model_versions.model", "model_versions.version"], ondelete="CASCADE"
        ),
        UniqueConstraint("model", "version", "lane", "day", name="mix_day"),
    )


ROLLOUT_ACTIONS = ("start", "continue", "promote", "rollback", "abort")


class Rollout(Base):
    """One canary rollout of a model; at most one is running per model (a partial unique index)."""

    __tablename__ = "rollouts"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(ForeignKey("models.name", ondelete="CASCADE"), index=True)
    canary: Mapped[str] = mapped_column(String(64))
    stable: Mapped[str] = mapped_column(String(64))
    policy: Mapped[Any] = mapped_column(JsonDoc)
    # The model's weights and the canary's state before the start, for abort.
    initial_weights: Mapped[Any] = mapped_column(JsonDoc)
    canary_initial_state: Mapped[str] = mapped_column(String(16))
    step_index: Mapped[int] = mapped_column(Integer)  # into the policy's steps, or rollouts.SHADOW_STEP
    state: Mapped[str] = mapped_column(String(16), default=RolloutState.running)
    actor: Mapped[str] = mapped_column(String(128))
    reason: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    step_started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        ForeignKeyConstraint(["model", "canary"], ["model_versions.model", "model_versions.version"],
                             ondelete="CASCADE"),
        ForeignKeyConstraint(["model", "stable"], ["model_versions.model", "model_versions.version"],
                             ondelete="CASCADE"),
        CheckConstraint(_one_of("state", RolloutState), name="rollout_state"),
        CheckConstraint("canary <> stable", name="rollout_two_versions"),
        Index("one_running_rollout", "model", unique=True, postgresql_where=text(f"state = '{RolloutState.running}'")),
    )


class RolloutDecision(Base):
    """Every look the controller takes, and every start and abort, with its evidence."""

    __tablename__ = "rollout_decisions"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id", ondelete="CASCADE"), index=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    step_index: Mapped[int] = mapped_column(Integer)
    action: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)
    evidence: Mapped[Any] = mapped_column(JsonDoc, default=dict)
    # The audited routing change the decision made, if any.
    audit_id: Mapped[int | None] = mapped_column(ForeignKey("audit_log.id", ondelete="SET NULL"))

    __table_args__ = (CheckConstraint(_one_of("action", ROLLOUT_ACTIONS), name="rollout_action"),)


class Schedule(Base):
    """A cron schedule of batch runs; `next_slot` is the earliest slot not yet dispatched."""

    __tablename__ = "schedules"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(ForeignKey("models.name", ondelete="CASCADE"))
    version: Mapped[str | None] = mapped_column(String(64))
    cron: Mapped[str] = mapped_column(String(128))
    timezone: Mapped[str] = mapped_column(String(64))
    input_uri: Mapped[str] = mapped_column(Text)
    input_format: Mapped[str | None] = mapped_column(String(16))
    text_field: Mapped[str] = mapped_column(String(128))
    output_uri: Mapped[str | None] = mapped_column(Text)
    output_format: Mapped[str] = mapped_column(String(16))
    callback_url: Mapped[str | None] = mapped_column(Text)
    actor: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    next_slot: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    # Why the last dispatch of this schedule failed; the others went on (ARCHITECTURE.md).
    last_error: Mapped[str | None] = mapped_column(Text)
    last_error_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Batch(Base):
    """One batch-scoring run: its input file, its progress, and the feeder's lease and checkpoint.

    `rows_written` rows of output are on disk in `bytes_written` bytes: a feeder that takes over
    truncates the output there and goes on from that row, so no row is lost or written twice.
    """

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(64))
    version: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default=BatchState.queued, server_default=BatchState.queued.value,
                                        index=True)
    total: Mapped[int | None] = mapped_column(BigInteger)
    done: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    failed: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    input_path: Mapped[str] = mapped_column(Text)
    input_format: Mapped[str] = mapped_column(String(16))
    text_field: Mapped[str] = mapped_column(String(128))
    output_format: Mapped[str] = mapped_column(String(16))
    output_path: Mapped[str | None] = mapped_column(Text)
    callback_url: Mapped[str | None] = mapped_column(Text)
    callback_sent: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    metadata_: Mapped[Any] = mapped_column("metadata", JsonDoc, nullable=True)
    error: Mapped[str | None] = mapped_column(Text)
    # No foreign key: a deleted schedule's runs stay listed under its id.
    schedule_id: Mapped[str | None] = mapped_column(String(32))
    slot: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    rows_written: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    bytes_written: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    lease_owner: Mapped[str | None] = mapped_column(String(64))
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    dispatched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        CheckConstraint(_one_of("status", BatchState), name="batch_status"),
        UniqueConstraint("schedule_id", "slot", name="one_run_per_slot"),
        Index("ix_batches_tenant_created", "tenant_id", "created_at"),
    )
