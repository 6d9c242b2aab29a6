"""The Python client of the Sluice REST API, a distribution of its own (`sluice-client`) that
needs httpx alone: `SluiceClient` (sync) and `AsyncClient`, their errors, and `verify` for a
webhook receiver."""

from sluice_client.client import (
    AsyncClient,
    AuthError,
    Client,
    ClientError,
    ConflictError,
    InvalidRequest,
    NotFoundError,
    RateLimited,
    SluiceClient,
    SluiceError,
    Unavailable,
    WaitTimeout,
)
from sluice_client.webhooks import verify

__all__ = [
    "AsyncClient",
    "AuthError",
    "Client",
    "ClientError",
    "ConflictError",
    "InvalidRequest",
    "NotFoundError",
    "RateLimited",
    "SluiceClient",
    "SluiceError",
    "Unavailable",
    "WaitTimeout",
    "verify",
]
