"""`sluice models register`: from a directory on disk to a `staged` version, ready for a rollout.

It hashes the artifact (a directory by the manifest of every file in it), publishes it to the
artifact store (`SLUICE_ARTIFACT_STORE`, by default HOME/artifacts), creates the model when it
does not exist yet, and registers the version through the API, so the audit log and the routing
announcements are the API's own.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from launch.api_client import ApiError, KeyOption, UrlOption, api_client, api_errors
from sluice.errors import ArtifactError, ModelError
from sluice.handler import import_handler, schemas_of
from sluice.kinds import SCHEMA_KINDS, ModelKind
from sluice.settings import Settings
from sluice.versions import Tier, VersionState

console = Console()
models_app = typer.Typer(help="The models by tier (no command), or publish and register a team's own.")

_OWN_KINDS = [kind.value for kind in ModelKind if kind is not ModelKind.synthetic]


@models_app.callback(invoke_without_command=True)
def models(ctx: typer.Context, url: UrlOption = None, key: KeyOption = None) -> None:
    """The models by availability tier, with each version's state and replicas (through the API)."""
    if ctx.invoked_subcommand is not None:
        return
    with api_errors(console), api_client(url, key) as client:
        listed = client.models()
    for tier in Tier:
        members = [model for model in listed if model["tier"] == tier]
        # One line per tier and per version, however narrow the terminal: scripts read them.
        console.print(f"[bold]{tier}[/] tier: {', '.join(m['name'] for m in members) or '(none)'}", soft_wrap=True)
        for model in members:
            for version in model["versions"]:
                replicas = version.get("replicas")
                scaled = (f"{replicas['live']} live of {replicas['desired']} desired: {replicas['reason']}"
                          if replicas else "no scaling decision in the last minute")
                share = model["routing"].get(version["version"], 0)
                console.print(f"  {model['name']} {version['version']} ({version['state']}, {share:g} % of traffic): "
                              f"{scaled}", soft_wrap=True)
                if replicas:
                    console.print(f"    {_placement(replicas)}", soft_wrap=True)


def _placement(replicas: dict[str, Any]) -> str:
    """Where the version runs and with whom: the blast radius of a process that fails."""
    if replicas.get("not_served"):
        return f"not served: {replicas['not_served']}"
    zero = replicas.get("scale_to_zero")
    if zero == "asleep":
        return "scaled to zero (min_replicas 0, idle): placed on no process; the next job wakes it"
    if zero == "waking":
        return "waking from zero: its first worker is starting, jobs queue until it is ready"
    processes = replicas.get("processes") or []
    if not processes:
        return "placed on no process"
    return "; ".join(f"process {p['group']} ({p['tier']}), shared with "
                     f"{', '.join(p['shares_with']) if p['shares_with'] else 'no other version'}" for p in processes)


def _schema_file(path: Path | None, option: str) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        schema = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"{path}: {exc}", param_hint=option) from exc
    if not isinstance(schema, dict):
        raise typer.BadParameter(f"{path} holds no JSON object", param_hint=option)
    return schema


def _handler_schemas(spec: str) -> dict[str, dict[str, Any]]:
    # As `python -m` would: a handler package in the working directory is importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return schemas_of(import_handler(spec))
    except ModelError as exc:
        raise typer.BadParameter(str(exc), param_hint="--handler") from exc


@models_app.command("register")
def register(
    name: str, version: str,
    kind: Annotated[str, typer.Option(help=f"One of {', '.join(_OWN_KINDS)}")],
    path: Annotated[Path, typer.Option(exists=True, help="The artifact: a model directory or a file")],
    handler: Annotated[str | None, typer.Option(help="Kind handler: package.module:Class, importable here "
                                                     "and in the workers' environment")] = None,
    input_schema: Annotated[Path | None, typer.Option(help="Kind torch-export: a JSON Schema file of one "
                                                           "input, one property per tensor, in order")] = None,
    output_schema: Annotated[Path | None, typer.Option(help="Kind torch-export: a JSON Schema file of one "
                                                            "output, one property per tensor, in order")] = None,
    state: Annotated[str, typer.Option(help="staged (no traffic) or shadow (copies of live traffic)")] = "staged",
    max_batch_size: Annotated[int | None, typer.Option(min=1, max=1024)] = None,
    max_wait_ms: Annotated[float | None, typer.Option(min=0)] = None,
    store: Annotated[str | None, typer.Option(help="Where to publish (an fsspec URL; default "
                                                   "SLUICE_ARTIFACT_STORE, else HOME/artifacts)")] = None,
    allow_pickle: Annotated[bool, typer.Option(
        "--allow-pickle", help="Kind torch-export, with an admin key: load the program even though a pickle "
                               "in it could run code in the workers (refused without it)")] = False,
    url: UrlOption = None, key: KeyOption = None,
) -> None:
    """Publish ./my-model to the artifact store and register it as NAME VERSION, `staged`."""
    if kind not in _OWN_KINDS:
        raise typer.BadParameter(f"one of {', '.join(_OWN_KINDS)}", param_hint="--kind")
    if state not in (VersionState.staged, VersionState.shadow):
        raise typer.BadParameter("staged or shadow", param_hint="--state")
    if (handler is not None) != (kind == ModelKind.handler):
        raise typer.BadParameter("--handler goes with --kind handler, and only there", param_hint="--handler")
    schemas = {"input": _schema_file(input_schema, "--input-schema"),
               "output": _schema_file(output_schema, "--output-schema")}
    if handler is not None:
        schemas = {**_handler_schemas(handler), **{k: v for k, v in schemas.items() if v is not None}}
    if kind == ModelKind.torch_export and not (schemas["input"] and schemas["output"]):
        raise typer.BadParameter("a torch-export version declares both schemas: its tensors, one property "
                                 "each, in order", param_hint="--input-schema/--output-schema")
    if kind not in SCHEMA_KINDS and any(schemas.values()):
        raise typer.BadParameter(f"kind {kind} fixes its schemas", param_hint="--input-schema")
    if allow_pickle and kind != ModelKind.torch_export:
        raise typer.BadParameter("only a torch-export program is ever unpickled", param_hint="--allow-pickle")
    from sluice.artifact_store import publish

    settings = Settings()
    target = store or settings.artifact_store_url
    try:
        published = publish(path.resolve(), target, ca_bundle=settings.artifact_ca_bundle)
    except ArtifactError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from exc
    console.print(f"published {path} as {published.uri} (sha256 {published.sha256})", soft_wrap=True)
    body: dict[str, Any] = {"state": state}
    batching = {k: v for k, v in (("max_batch_size", max_batch_size), ("max_wait_ms", max_wait_ms)) if v is not None}
    if batching:
        body["batching"] = batching
    if handler is not None:
        body["handler"] = handler
    if allow_pickle:
        body["allow_pickle"] = True
    body.update({f"{k}_schema": v for k, v in schemas.items() if v is not None})
    with api_errors(console), api_client(url, key) as client:
        try:
            existing = client.model(name)
        except ApiError as exc:
            if exc.status != 404:
                raise
            client.create_model(name, kind)
            console.print(f"created model {name} (kind {kind})")
            first = True
        else:
            if existing["kind"] != kind:
                console.print(f"[red]model {name} is of kind {existing['kind']}, not {kind}[/]")
                raise typer.Exit(1)
            first = not existing["versions"]
        client.create_version(name, version, artifact=published.uri, sha256=published.sha256, **body)
    console.print(f"registered {name} {version} ({state}).", soft_wrap=True)
    if first:
        console.print(f"Next: PATCH …/models/{name}/versions/{version} {{\"state\": \"stable\"}} and PUT "
                      f"…/models/{name}/routing {{\"weights\": {{\"{version}\": 100}}}} give it the traffic.",
                      soft_wrap=True)
    else:
        console.print(f"Next: `sluice rollout start {name} {version}` canaries it; `sluice rollout abort {name}` "
                      f"or `sluice models rollback {name}` takes the traffic back.", soft_wrap=True)


@models_app.command("rollback")
def rollback(name: str, reason: Annotated[str | None, typer.Option(help="Why, for the audit log")] = None,
             url: UrlOption = None, key: KeyOption = None) -> None:
    """Give the model's traffic back to the routing weights before the last change."""
    with api_errors(console), api_client(url, key) as client:
        change = client.rollback(name, reason=reason)
    console.print(f"{name} rolled back; routing {change['routing']}")
