"""Cron schedules of batch runs (admin). Each due slot becomes one batch (workers/schedules.py),
listed under `GET /v1/batches?schedule_id=`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from anyio import to_thread
from fastapi import APIRouter
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field

from api.deps import AdminKey, StateDep, checked_callback
from api.field_types import FileUri
from api.json_response import JsonResponse
from api.middleware import StrictJsonRoute
from api.response_models import ErrorResource, ScheduleList, ScheduleResource
from sluice import batch_files, tenant_files
from sluice.batch_files import Format
from sluice.registry import batches as queries

router = APIRouter(prefix="/v1", tags=["schedules"], route_class=StrictJsonRoute)

_ERRORS: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorResource, "description": "Not an admin key"},
    404: {"model": ErrorResource, "description": "Unknown model, tenant or schedule"},
    422: {"model": ErrorResource, "description": "Invalid cron expression, time zone or URI template"},
}


class CreateSchedule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=64)
    version: str | None = Field(default=None, min_length=1, max_length=64,
                                description="Default: each run is routed like the tenant's jobs")
    cron: str = Field(min_length=1, max_length=128, description="Five fields (minute to weekday), or six with "
                                                                "seconds last, as croniter reads them")
    timezone: str = Field(default="UTC", min_length=1, max_length=64, description="An IANA zone, e.g. Europe/Paris")
    input_uri: FileUri = Field(description="A path template relative to the tenant's batch folder, "
                                           "e.g. in/{date}.parquet")
    format: Format | None = None
    text_field: str = Field(default="text", min_length=1, max_length=128)
    output_uri: FileUri | None = Field(default=None, description="Where each run's output is also "
                                                                 "written (a template, like input_uri)")
    output_format: Format = "jsonl"
    callback_url: AnyHttpUrl | None = None
    tenant: str | None = Field(default=None, min_length=1, max_length=64,
                               description="Whose batches the runs are (default: the admin key's tenant)")


@router.post("/schedules", status_code=201, response_model=ScheduleResource, responses=_ERRORS)
async def create_schedule(body: CreateSchedule, key: AdminKey, state: StateDep) -> JsonResponse:
    now = datetime.now(UTC)
    root, tenant = state.settings.batch_root, body.tenant or key.tenant
    # Checked now with this moment's date, so a template error is a 422 and not a failed run at night.
    # The runs are the tenant's batches, so their files are in its folder, admin key or not.
    for template in (body.input_uri, body.output_uri):
        if template is not None:
            tenant_files.resolve(batch_files.render_template(template, now), root=root, tenant=tenant, admin=False,
                                 must_exist=False)
    callback_url = checked_callback(state, body.callback_url)
    spec = queries.NewSchedule(
        tenant=tenant, model=body.model, version=body.version, cron=body.cron,
        timezone=body.timezone, input_uri=body.input_uri, input_format=body.format, text_field=body.text_field,
        output_uri=body.output_uri, output_format=body.output_format,
        callback_url=callback_url,
    )

    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            return queries.schedule_resource(queries.create_schedule(session, spec, actor=f"key:{key.key_id}",
                                                                     now=now))

    resource = await to_thread.run_sync(write)
    return JsonResponse(resource, status_code=201, headers={"Location": f"/v1/schedules/{resource['id']}"})


@router.get("/schedules", response_model=ScheduleList)
async def list_schedules(key: AdminKey, state: StateDep) -> dict[str, Any]:
    def read() -> dict[str, Any]:
        with state.registry.session() as session:
            return {"schedules": [queries.schedule_resource(row) for row in queries.list_schedules(session)]}

    return await to_thread.run_sync(read)


@router.get("/schedules/{schedule_id}", response_model=ScheduleResource, responses=_ERRORS)
async def get_schedule(schedule_id: str, key: AdminKey, state: StateDep) -> dict[str, Any]:
    def read() -> dict[str, Any]:
        with state.registry.session() as session:
            return queries.schedule_resource(queries.get_schedule(session, schedule_id))

    return await to_thread.run_sync(read)


@router.delete("/schedules/{schedule_id}", response_model=ScheduleResource, responses=_ERRORS)
async def delete_schedule(schedule_id: str, key: AdminKey, state: StateDep) -> dict[str, Any]:
    """No more runs; runs already made stay (and keep running). Answers the schedule as it was."""
    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            return queries.schedule_resource(queries.delete_schedule(session, schedule_id,
                                                                     actor=f"key:{key.key_id}"))

    return await to_thread.run_sync(write)
