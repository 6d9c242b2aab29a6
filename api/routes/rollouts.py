"""Canary rollouts over REST (admin): start one, watch the current one, abort it.

The API only writes the rollout's row and its first weights; the controller in the scheduler
takes every later step. A model has at most one running rollout, so "current" names it without
an id: the running one, else the latest finished one.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from api.deps import AdminKey, StateDep, announce_routing
from api.field_types import Name
from api.middleware import StrictJsonRoute
from api.response_models import ErrorResource, RolloutList, RolloutResource
from sluice.errors import InvalidInput, InvalidPolicy
from sluice.registry import rollouts
from sluice.registry.tables import Rollout
from sluice.rollout_policy import Policy

router = APIRouter(prefix="/v1/models", tags=["rollouts"], route_class=StrictJsonRoute)

Percent = Annotated[float, Field(gt=0, le=100)]


class StartRollout(BaseModel):
    model_config = ConfigDict(extra="forbid")
    canary: Name
    stable: Name | None = Field(default=None, description="Compare with this version (default: the most "
                                                          "weighted other serving one)")
    steps: list[Percent] | None = Field(default=None, min_length=2, max_length=100,
                                        description="The canary's percentages, increasing, ending at 100")
    soak_s: float | None = Field(default=None, ge=0, le=30 * 86_400, description="Least seconds per step")
    min_samples: int | None = Field(default=None, ge=1, le=10**9,
                                    description="Least samples per version and step before a promotion")
    reason: str | None = Field(default=None, max_length=500)


_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorResource, "description": "Unknown model or version, or a model that never had a rollout"},
    409: {"model": ErrorResource, "description": "A rollout is already running, or none is (abort)"},
}


def _resource(session: Session, row: Rollout, limit: int = 20) -> dict[str, Any]:
    return rollouts.rollout_resource(row, rollouts.decisions(session, row.id, limit=limit))


@router.post("/{model}/rollouts", status_code=201, response_model=RolloutResource,
             responses={400: {"model": ErrorResource, "description": "The canary and stable are one version, or a "
                                                                     "shadow canary has no shadow weight"},
                        422: {"model": ErrorResource, "description": "The policy is not valid"}, **_ERRORS})
async def start_rollout(model: str, body: StartRollout, key: AdminKey, state: StateDep,
                        response: Response) -> dict[str, Any]:
    """Start a rollout: in the shadow phase when the canary is in state `shadow`, else at the first step."""
    try:
        policy = Policy.chosen(steps=body.steps, soak_s=body.soak_s, min_samples=body.min_samples)
    except InvalidPolicy as exc:
        raise InvalidInput(f"invalid rollout policy: {exc}") from exc

    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            row = rollouts.start_rollout(session, model=model, canary=body.canary, stable=body.stable,
                                         policy=policy.to_dict(), actor=f"key:{key.key_id}",
                                         now=datetime.now(UTC), reason=body.reason)
            return _resource(session, row)

    resource = await to_thread.run_sync(write)
    await announce_routing(state, model)
    response.headers["Location"] = f"/v1/models/{model}/rollouts/current"
    return resource


@router.get("/{model}/rollouts", response_model=RolloutList, responses=_ERRORS)
async def list_rollouts(
    model: str, _: AdminKey, state: StateDep,
    limit: Annotated[int, Query(ge=1, le=100, description="How many of the latest rollouts")] = 20,
    decisions: Annotated[int, Query(ge=0, le=1000, description="How many of each one's latest decisions")] = 20,
) -> dict[str, Any]:
    """The model's rollouts, newest first; an empty list when it never had one (a watcher such as
    the dashboard polls this, where `current` would answer 404)."""
    def read() -> dict[str, Any]:
        with state.registry.session() as session:
            return {"items": [_resource(session, row, decisions)
                              for row in rollouts.recent_rollouts(session, model, limit=limit)]}

    return await to_thread.run_sync(read)


@router.get("/{model}/rollouts/current", response_model=RolloutResource, responses=_ERRORS)
async def current_rollout(
    model: str, _: AdminKey, state: StateDep,
    decisions: Annotated[int, Query(ge=0, le=1000, description="How many of the latest decisions")] = 20,
) -> dict[str, Any]:
    """The model's running rollout, else its latest finished one, with its latest decisions."""
    def read() -> dict[str, Any]:
        with state.registry.session() as session:
            return _resource(session, rollouts.latest_rollout(session, model), decisions)

    return await to_thread.run_sync(read)


@router.delete("/{model}/rollouts/current", response_model=RolloutResource, responses=_ERRORS)
async def abort_rollout(
    model: str, key: AdminKey, state: StateDep,
    reason: Annotated[str | None, Query(max_length=500, description="Why, for the audit log")] = None,
) -> dict[str, Any]:
    """Stop the running rollout and put back the weights and the canary's state from before its start."""
    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            row = rollouts.abort_rollout(session, model=model, actor=f"key:{key.key_id}", now=datetime.now(UTC),
                                         reason=reason)
            return _resource(session, row)

    resource = await to_thread.run_sync(write)
    await announce_routing(state, model)
    return resource
