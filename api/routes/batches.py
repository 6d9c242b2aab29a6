"""Batch scoring: create a batch (inline inputs, an uploaded file or an `input_uri`), follow it,
download its output in input order, cancel it. The Celery feeder (workers/batches.py) runs it.

The input is on disk before the 202: uploads are streamed to the batch store a chunk at a time
(api/uploads.py), inline inputs are written there as JSONL, and an `input_uri` must name a file
in the key's tenant folder under SLUICE_BATCH_ROOT (sluice/tenant_files.py), or an object in its
folder of the object store (sluice/tenant_objects.py), which is copied there as an upload is. The batch is
routed once, at creation, so all its rows run on one version."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from anyio import to_thread
from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, ValidationError

from api.deps import AppState, CurrentKey, StateDep, checked_callback
from api.field_types import FileUri
from api.json_response import JsonResponse
from api.response_models import BatchList, BatchResource, ErrorResource
from api.uploads import receive_upload
from sluice import batch_files, batch_rows, tenant_files
from sluice.batch_files import FORMATS, BatchFileError, Format
from sluice.errors import InvalidInput, InvalidJson, NotFound, NotServed, PayloadTooLarge
from sluice.registry import batches as queries
from sluice.registry.tenants import KeyInfo
from sluice.routing import route
from sluice.tenant_objects import ObjectStore, in_store

router = APIRouter(prefix="/v1", tags=["batches"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorResource, "description": "Not entitled to the version"},
    404: {"model": ErrorResource, "description": "Unknown model, version or batch"},
    409: {"model": ErrorResource, "description": "Retired version; a batch already final"},
    413: {"model": ErrorResource, "description": "Too many inline inputs or too large an upload"},
    422: {"model": ErrorResource, "description": "Invalid fields, format, column or input_uri"},
    503: {"model": ErrorResource, "description": "No servable version, or `not_served`: the version routed to "
                                                 "cannot be served now, with why"},
}


class _BatchOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=64)
    version: str | None = Field(default=None, min_length=1, max_length=64)
    format: Format | None = Field(default=None, description="The input's format; by default the file name's "
                                                             "suffix says (.jsonl, .csv, .parquet)")
    text_field: str = Field(default="text", min_length=1, max_length=128,
                            description="The column or JSON field that holds each row's text")
    output_format: Format = Field(default="jsonl", description="The default format of GET …/output")
    callback_url: AnyHttpUrl | None = Field(default=None, description="Called once, signed like job webhooks, "
                                                                      "when the batch is final")
    metadata: dict[str, str | int | float | bool | None] | None = Field(default=None, max_length=32)


class CreateBatch(_BatchOptions):
    """A JSON body: exactly one of `inputs` and `input_uri`."""

    inputs: list[Any] | None = Field(default=None, min_length=1, description="Inline inputs, e.g. "
                                                                             "[{\"text\": \"...\"}]")
    input_uri: FileUri | None = Field(default=None,
                                      description="A path relative to the tenant's batch folder, or a file:// URI "
                                                  "inside it (an admin key: anywhere under SLUICE_BATCH_ROOT); or "
                                                  "an object's URL in the tenant's folder of the object store, "
                                                  "<SLUICE_OBJECT_ROOT>/tenants/<tenant>/, copied at creation")


_CREATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": CreateBatch.model_json_schema(ref_template="#/components/schemas/{model}")},
            "multipart/form-data": {"schema": {
                "type": "object", "required": ["model", "file"],
                "properties": {
                    "file": {"type": "string", "format": "binary", "description": "JSONL, CSV or Parquet"},
                    "model": {"type": "string"}, "version": {"type": "string"},
                    "format": {"type": "string", "enum": list(FORMATS)}, "text_field": {"type": "string"},
                    "output_format": {"type": "string", "enum": list(FORMATS)},
                    "callback_url": {"type": "string", "format": "uri"},
                },
            }},
        },
    },
}


def _now() -> datetime:
    return datetime.now(UTC)


def _options(model: type[_BatchOptions], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


@router.post("/batches", status_code=202, response_model=BatchResource, openapi_extra=_CREATE_BODY,
             responses=_ERRORS)
async def create_batch(request: Request, key: CurrentKey, state: StateDep) -> JsonResponse:
    """Create a batch from inline `inputs`, an `input_uri` (JSON body) or an uploaded `file`
    (multipart/form-data); 202 with the batch, which runs on the version's bulk lane."""
    batch_id = queries.new_batch_id()
    folder = state.settings.batch_storage / batch_id
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    try:
        if content_type == "multipart/form-data":
            options, path, fmt = await _from_upload(request, state, folder)
        elif content_type == "application/json" or content_type.endswith("+json"):
            options, path, fmt = await _from_json(request, state, key, folder)
        else:
            raise InvalidInput("send application/json (inputs or input_uri) or multipart/form-data (a file)")
        spec = _routed(state, key, options, path, fmt)
        await to_thread.run_sync(_check_readable, path, fmt, options.text_field,
                                 state.settings.batch_max_line_bytes)
        resource = await to_thread.run_sync(_insert, state, batch_id, spec)
    except BaseException:
        await to_thread.run_sync(lambda: shutil.rmtree(folder, ignore_errors=True))
        raise
    return JsonResponse(resource, status_code=202, headers={"Location": f"/v1/batches/{batch_id}"})


async def _from_json(request: Request, state: AppState, key: KeyInfo, folder: Path
                     ) -> tuple[CreateBatch, Path, Format]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise InvalidJson(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object")
    options: CreateBatch = _options(CreateBatch, body)
    if (options.inputs is None) == (options.input_uri is None):
        raise InvalidInput("give exactly one of 'inputs' and 'input_uri'")
    if options.input_uri is not None:
        if in_store(options.input_uri, batch_root=state.settings.batch_root, objects=state.objects):
            assert state.objects is not None
            return await _from_object(state.objects, options, state, key, folder)
        path = tenant_files.resolve(options.input_uri, root=state.settings.batch_root, tenant=key.tenant,
                                    admin=key.is_admin, must_exist=True)
        return options, path, batch_files.format_of(path.name, options.format)
    inputs = options.inputs or []
    if len(inputs) > state.settings.max_batch_inputs:
        raise PayloadTooLarge(f"{len(inputs)} inline inputs; at most {state.settings.max_batch_inputs}: "
                              "upload a file or name an input_uri for more")
    path = folder / "input.jsonl"
    limit = state.settings.batch_max_line_bytes

    def write() -> None:
        folder.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as handle:
            for number, item in enumerate(inputs):
                line = json.dumps({"input": item}, separators=(",", ":")).encode() + b"\n"
                # The feeder's reader fails a batch on a longer line: refused now, not after the 202.
                if len(line) > limit:
                    raise PayloadTooLarge(f"input {number} is longer than {limit} bytes as a JSON line "
                                          "(SLUICE_BATCH_MAX_LINE_BYTES)")
                handle.write(line)

    await to_thread.run_sync(write)
    return options, path, "jsonl"


async def _from_object(objects: ObjectStore, options: CreateBatch, state: AppState, key: KeyInfo, folder: Path
                       ) -> tuple[CreateBatch, Path, Format]:
    """An object store's object, copied into the batch store as an upload is: the feeder then reads
    a local file, and a later change to the object does not change the batch."""
    assert options.input_uri is not None
    url = objects.resolve(options.input_uri, tenant=key.tenant, admin=key.is_admin)
    fmt = batch_files.format_of(url.rsplit("/", 1)[-1], options.format)
    path = folder / f"input.{fmt}"

    def copy() -> None:
        folder.mkdir(parents=True, exist_ok=True)
        objects.copy_to(url, path, max_bytes=state.settings.max_batch_upload_bytes,
                        limit_name="SLUICE_MAX_BATCH_UPLOAD_BYTES")

    await to_thread.run_sync(copy)
    return options, path, fmt


async def _from_upload(request: Request, state: AppState, folder: Path) -> tuple[_BatchOptions, Path, Format]:
    upload = await receive_upload(request, folder=folder, limit=state.settings.max_batch_upload_bytes)
    fields = {name: value for name, value in upload.fields.items() if value != ""}
    if "metadata" in fields:
        raise InvalidInput("metadata is a JSON-body option")
    options: _BatchOptions = _options(_BatchOptions, fields)
    fmt = batch_files.format_of(upload.filename, options.format)
    path = folder / f"input.{fmt}"
    await to_thread.run_sync(upload.path.rename, path)
    return options, path, fmt


def _routed(state: AppState, key: KeyInfo, options: _BatchOptions, path: Path, fmt: Format) -> queries.NewBatch:
    callback_url = checked_callback(state, options.callback_url)
    decision = route(state.routing.current(), model=options.model, tenant=key.tenant, routing_key=None,
                     version=options.version, blocked=state.breakers.blocked(options.model), admin=key.is_admin)
    unserved = state.placement.not_served(options.model, decision.version.version)
    if unserved is not None:
        raise NotServed(f"{options.model}/{decision.version.version} cannot be served now: {unserved}",
                        headers={"Retry-After": "30"})
    return queries.NewBatch(
        tenant=key.tenant, model=options.model, version=decision.version.version, input_path=str(path),
        input_format=fmt, text_field=options.text_field, output_format=options.output_format,
        callback_url=callback_url,
        metadata=dict(options.metadata) if options.metadata else None,
        # Inline inputs are counted now: a batch cancelled before its feeder starts still has its total.
        total=len(options.inputs) if isinstance(options, CreateBatch) and options.inputs is not None else None,
    )


def _check_readable(path: Path, fmt: Format, text_field: str, max_line_bytes: int) -> None:
    """Refuse now what would fail the whole batch later: a CSV or Parquet file without the column."""
    if fmt == "jsonl":
        return
    rows = batch_rows.read_rows(path, fmt, text_field=text_field, max_line_bytes=max_line_bytes)
    try:
        next(rows, None)
    except UnicodeDecodeError as exc:
        raise BatchFileError(f"the file is not UTF-8 text: {exc}") from None
    finally:
        rows.close()


def _insert(state: AppState, batch_id: str, spec: queries.NewBatch) -> dict[str, Any]:
    with state.registry.session() as session:
        return queries.batch_resource(queries.create_batch(session, spec, batch_id=batch_id))


@router.get("/batches", response_model=BatchList, response_model_exclude_unset=True)
async def list_batches(
    key: CurrentKey, state: StateDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    schedule_id: Annotated[str | None, Query(max_length=32, description="Runs of this schedule")] = None,
) -> dict[str, Any]:
    """The caller's batches, newest first (an admin listing a schedule's runs sees every tenant's)."""
    tenant = None if key.is_admin and schedule_id is not None else key.tenant

    def read() -> dict[str, Any]:
        with state.registry.session() as session:
            rows = queries.list_batches(session, tenant=tenant, schedule_id=schedule_id, limit=limit)
            return {"batches": [queries.batch_resource(row) for row in rows]}

    return await to_thread.run_sync(read)


@router.get("/batches/{batch_id}", response_model=BatchResource, response_model_exclude_unset=True,
            responses=_ERRORS)
async def get_batch(batch_id: str, key: CurrentKey, state: StateDep) -> dict[str, Any]:
    def read() -> dict[str, Any]:
        with state.registry.session() as session:
            return queries.batch_resource(queries.get_batch(session, batch_id, tenant=_reader(key)))

    return await to_thread.run_sync(read)


def _reader(key: KeyInfo) -> str | None:
    """Whose batches the key reads: an admin reads any (a schedule's runs belong to its tenant)."""
    return None if key.is_admin else key.tenant


@router.get("/batches/{batch_id}/output", response_class=StreamingResponse, responses={
    200: {"description": "The rows in input order: JSONL `{row, status, output | error}` per line, or CSV or "
                         "Parquet with columns row, status, output (JSON), error_code, error_message",
          "content": {batch_files.media_type(fmt): {} for fmt in FORMATS}},
    **_ERRORS,
})
async def batch_output(
    batch_id: str, key: CurrentKey, state: StateDep,
    format: Annotated[Literal["jsonl", "csv", "parquet"] | None, Query(
        description="Default: the batch's output_format")] = None,
) -> StreamingResponse:
    """The rows written so far (all of them once the batch is final), in input order."""
    def read() -> tuple[str, int, str, str | None]:
        with state.registry.session() as session:
            row = queries.get_batch(session, batch_id, tenant=_reader(key))
            return (row.output_format, row.bytes_written, row.status,
                    row.finished_at.isoformat() if row.finished_at else None)

    default_format, size, status, finished = await to_thread.run_sync(read)
    fmt: Format = format or default_format  # type: ignore[assignment]
    path = state.settings.batch_storage / batch_id / "output.jsonl"
    if size and not path.is_file():
        raise NotFound(f"the output of batch '{batch_id}' is no longer stored")
    chunks = batch_files.convert_output(path, fmt, size=size)
    headers = {"Content-Disposition": f'attachment; filename="{batch_id}.{fmt}"', "X-Batch-Status": status}
    if finished is None:
        headers["X-Batch-Partial"] = "true"
    return StreamingResponse(chunks, media_type=batch_files.media_type(fmt), headers=headers)


@router.delete("/batches/{batch_id}", response_model=BatchResource, response_model_exclude_unset=True,
               responses=_ERRORS)
async def cancel_batch(batch_id: str, key: CurrentKey, state: StateDep) -> dict[str, Any]:
    """Cancel what has not started: rows not yet queued never run, queued ones end `cancelled`. An
    admin key cancels any tenant's batch (a schedule's run is its tenant's), audited."""
    actor = f"key:{key.key_id}" if key.is_admin else None

    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            return queries.batch_resource(queries.cancel_batch(session, batch_id, tenant=_reader(key), now=_now(),
                                                               audit_actor=actor))

    return await to_thread.run_sync(write)
