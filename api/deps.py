"""Annotated dependencies, the whole of what a route may ask the framework for, and the one
step on the app state that routes share: announcing a routing change."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPBearer

from api.admission import Admission
from api.breakers import BreakerBoard
from api.caches import AuthCache, RoutingCache
from api.event_hub import EventHub
from api.placement_view import PlacementView
from sluice.errors import Forbidden, InvalidInput, Unauthenticated
from sluice.registry.store import Registry
from sluice.registry.tenants import KeyInfo
from sluice.settings import Settings
from sluice.tenant_objects import ObjectStore
from sluice.webhooks import CallbackRefused, allowed_networks, check_callback_url
from sluice.wire import events
from sluice.wire.broker import Broker


@dataclass
class AppState:
    settings: Settings
    broker: Broker
    registry: Registry
    routing: RoutingCache
    auth: AuthCache
    hub: EventHub
    admission: Admission
    breakers: BreakerBoard
    placement: PlacementView
    # SLUICE_OBJECT_ROOT's store, for jobs by reference; None without one.
    objects: ObjectStore | None = None
    # Set by the first SIGTERM: /readyz answers 503, new jobs are refused, waits end early.
    draining: asyncio.Event = field(default_factory=asyncio.Event)


async def get_state(request: Request) -> AppState:
    # Async although it never waits: FastAPI runs a plain function dependency on a worker thread,
    # which cost every request a thread hand-off (0.03-0.08 ms of CPU, measured by bench.api_cost).
    state: AppState = request.app.state.sluice
    return state


StateDep = Annotated[AppState, Depends(get_state)]


def checked_callback(state: AppState, url: object | None) -> str | None:
    """A submitted `callback_url` as text, or InvalidInput (422) when the webhook policy refuses
    its address (checked again at send time, after DNS)."""
    if url is None:
        return None
    try:
        check_callback_url(str(url), allowed=allowed_networks(state.settings.webhook_allowed_networks))
    except CallbackRefused as exc:
        raise InvalidInput(str(exc)) from None
    return str(url)


async def announce_routing(state: AppState, model: str) -> None:
    """Reload this replica's routing now, then tell the others (and the scheduler)."""
    await state.routing.reload()
    await state.broker.publish(events.RoutingChanged(model=model))


class _BearerKey(HTTPBearer):
    """The caller's key, checked: the bearer scheme `/openapi.json` documents and the lookup in
    one dependency. Solved as three (the scheme, the app state, the check), they cost every
    request about 15 us more of FastAPI's dependency solving. The header is read here as
    HTTPBearer reads it, without the credentials model it would build for every request."""

    async def __call__(self, request: Request) -> KeyInfo:  # type: ignore[override]
        scheme, _, secret = (request.headers.get("Authorization") or "").partition(" ")
        secret = secret.strip()
        if not secret or scheme.lower() != "bearer":
            raise Unauthenticated("missing 'Authorization: Bearer <key>' header",
                                  headers={"WWW-Authenticate": "Bearer"})
        state: AppState = request.app.state.sluice
        return await state.auth.authenticate(secret)


CurrentKey = Annotated[
    KeyInfo,
    Depends(_BearerKey(auto_error=False, scheme_name="HTTPBearer",
                       description="A tenant's API key: `Authorization: Bearer sk_...`")),
]


async def admin_key(key: CurrentKey) -> KeyInfo:
    if not key.is_admin:
        raise Forbidden("this action needs an admin key")
    return key


AdminKey = Annotated[KeyInfo, Depends(admin_key)]


async def operator_key(key: CurrentKey) -> KeyInfo:
    """An admin key, for the views made of every tenant's jobs (a version's stats, series and
    quality). Refused before the route looks anything up, so a tenant learns nothing from the
    answer, not even whether the model exists."""
    if not key.is_admin:
        raise Forbidden("a version's stats, series and quality count every tenant's jobs: they need an admin key")
    return key


OperatorKey = Annotated[KeyInfo, Depends(operator_key)]
