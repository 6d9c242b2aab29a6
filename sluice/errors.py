"""One exception tree for the whole platform.

Every transport error (redis-py, psycopg/SQLAlchemy) is translated into one of these at the
boundary where it is raised, so callers above it never catch a driver's exception type.
API errors carry the HTTP status and the machine-readable code of the REST contract.
"""

from __future__ import annotations

from typing import Any


class SluiceError(Exception):
    """Root of every error Sluice raises on purpose."""


# --- transport / infrastructure -------------------------------------------------------------


class BrokerError(SluiceError):
    """Redis (the job broker) failed."""


class BrokerUnavailable(BrokerError):
    """Redis cannot be reached: connection refused, reset or timed out."""


class RegistryError(SluiceError):
    """The Postgres registry failed."""


class RegistryUnavailable(RegistryError):
    """Postgres cannot be reached."""


class RegistryTimeout(RegistryUnavailable):
    """A statement or lock wait ran past the serving registry's bound (Postgres cancelled it), or
    Postgres did not answer at all within it (the client gave up and closed the connection)."""


# --- models and artifacts -------------------------------------------------------------------


class ModelError(SluiceError):
    """A model could not be loaded or run."""


class ArtifactError(ModelError):
    """An artifact is missing, unreadable or in a format Sluice refuses to load."""


class ArtifactMismatch(ArtifactError):
    """The artifact's sha256 differs from the one recorded in the registry."""


class PickleRefused(ArtifactError):
    """An artifact holds a pickle (or compiled code) that could run code when loaded, and its
    version does not allow pickles."""


# How a worker process tells its supervisor that it refused its version's artifact: a restart
# cannot help until an operator fixes the version, so the supervisor waits much longer.
EXIT_ARTIFACT_REFUSED = 3
# A worker whose own loop died, or whose model hung past the per-batch timeout: restarted at once.
EXIT_WORKER_FAILED = 1


class InferenceError(ModelError):
    """The model raised on a batch."""


class WorkerFailed(SluiceError):
    """One of a worker's own loops (running batches, heartbeats, refreshing what it holds) stopped:
    the worker stops rather than hold jobs it can no longer run."""


class HandlerHung(WorkerFailed):
    """A batch ran past the per-batch timeout: its jobs failed, and the model's thread, which
    cannot be stopped, is left to the process's exit."""


# --- scheduler and actuators ----------------------------------------------------------------


class ActuatorError(SluiceError):
    """An actuator could not read or set a version's replicas (the Kubernetes API refused or was
    unreachable): the scheduler keeps the pools as they are and tries again on its next tick."""


# --- rollouts -------------------------------------------------------------------------------


class InvalidPolicy(SluiceError):
    """A rollout policy's values are out of range or contradict each other."""


# --- API-facing errors: each maps to one status and code of the REST API --------------------


class ApiError(SluiceError):
    """`details` are extra members of the error body beside `code` and `message`, for a client to
    act on (a 429 of the online lane names the lane to use instead)."""

    status: int = 400
    code: str = "bad_request"

    def __init__(
        self, message: str, *, headers: dict[str, str] | None = None, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}
        self.details = details or {}


class InvalidInput(ApiError):
    status, code = 422, "invalid_input"


class InvalidJson(InvalidInput):
    """A body that is not JSON, where the route reads it itself (the JSON check covers the rest)."""

    code = "invalid_json"


class BadRequest(ApiError):
    status, code = 400, "bad_request"


class Unauthenticated(ApiError):
    status, code = 401, "unauthenticated"


class Forbidden(ApiError):
    status, code = 403, "forbidden"


class NotServable(Forbidden):
    """A tenant named a version that takes no callers' traffic (staged, shadow); admins may."""

    code = "not_servable"


class NotFound(ApiError):
    status, code = 404, "not_found"


class JobExpired(NotFound):
    """An Idempotency-Key replay whose jobs' records have outlived `result_ttl_s`."""

    code = "job_expired"


class Conflict(ApiError):
    status, code = 409, "conflict"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"


class TooManyRequests(ApiError):
    status, code = 429, "too_many_requests"


class StoredJobsLimit(TooManyRequests):
    """The tenant stores as many jobs answered from the response cache as it may
    (`max_answered_jobs`): more wait until the oldest records expire."""

    code = "stored_jobs_limit"


class ServiceUnavailable(ApiError):
    status, code = 503, "service_unavailable"


class NoServableVersion(ServiceUnavailable):
    """The model has no version with routing weight in a serving state (503): nothing can
    run its jobs until an admin routes it. Its own code, so a client (and a test) can tell it
    from a store that is down."""

    code = "no_servable_version"


class NotServed(ServiceUnavailable):
    """The version the job was routed to cannot be served now (no placement possible, its artifact
    refused): refused at once rather than accepted for a worker that will never come."""

    code = "not_served"


class NotDurable(ServiceUnavailable):
    """Durable accept: the store did not confirm the job's fsync in time; the job was withdrawn."""

    code = "not_durable"
