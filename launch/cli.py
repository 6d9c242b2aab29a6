"""The `sluice` command line. Heavy imports (FastAPI, torch) happen inside the commands."""

from __future__ import annotations

import asyncio
import getpass
import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from launch.api_client import KeyOption, UrlOption, api_client, api_errors
from sluice.errors import InvalidPolicy, SluiceError
from sluice.redact import configure_logging
from sluice.settings import Settings
from sluice.shutdown import install_two_stage

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Sluice: asynchronous inference.")
console = Console(soft_wrap=True)
log = logging.getLogger(__name__)

# How often `sluice up` looks for a dead embedded store to restart.
SUPERVISE_EVERY_S = 0.5


@app.command()
def migrate() -> None:
    """Apply the registry's Alembic migrations (a step of its own, before services start)."""
    from sluice.migrate import upgrade

    configure_logging(name="migrate")
    upgrade(Settings().require_database_url())
    console.print("registry migrated to head")


@app.command("seed")
def seed_command() -> None:
    """Create the demo tenant and models (and the bootstrap admin key, when set)."""
    from launch.seed import seed
    from sluice.registry.store import Registry

    settings = Settings()
    registry = Registry(url=settings.require_database_url(), pool_size=1)
    admin = settings.bootstrap_admin_key
    seeded = seed(registry, home=settings.home, bootstrap_admin_key=admin.get_secret_value() if admin else None)
    registry.dispose()
    console.print(f"demo key: {seeded.demo_key}")


@app.command()
def api(host: Annotated[str | None, typer.Option()] = None,
        port: Annotated[int | None, typer.Option()] = None) -> None:
    """Serve the REST API (first SIGTERM drains, a second one exits at once)."""
    from api.app import create_app
    from api.server import serve

    settings = Settings()
    configure_logging(name="api")
    serve(create_app(settings=settings), host=host or settings.api_host, port=port or settings.api_port,
          grace_s=settings.shutdown_grace_s)


@app.command()
def worker(model: Annotated[str, typer.Option()], version: Annotated[str, typer.Option()],
           threads: Annotated[int | None, typer.Option(min=1)] = None,
           device: Annotated[str, typer.Option()] = "auto") -> None:
    """Serve one model version from its streams."""
    from workers.main import run_worker

    configure_logging(name=f"worker[{model}/{version}]")
    raise typer.Exit(run_worker(settings=Settings(), model=model, version=version, threads=threads, device=device))


@app.command()
def scheduler(actuator: Annotated[str, typer.Option(help="local: supervise worker processes here; "
                                                         "none: only export desired replicas")] = "local") -> None:
    """Keep every servable version's worker pool at its desired size."""
    from scheduler.main import Scheduler, autoscaler, local_supervisor
    from sluice.registry.store import Registry

    settings = Settings()
    configure_logging(name="scheduler")
    supervisor = (
        local_supervisor(home=settings.home.resolve(), cores=settings.cpu_cores, slots=settings.worker_slots,
                         stop_grace_s=settings.shutdown_grace_s)
        if actuator == "local" else None
    )
    # One connection for each of the scheduler's threads: the loop, the rollout controller and
    # the quality aggregator.
    registry = Registry(url=settings.require_database_url(), pool_size=3)
    runner = Scheduler(registry=registry, redis_url=settings.require_redis_url(), supervisor=supervisor,
                       autoscaler=autoscaler(settings), refresh_s=settings.scale_interval_s)
    install_two_stage(runner.request_stop, force=lambda: sys.exit(1))
    runner.run()
    registry.dispose()


@app.command()
def up(exit_after_demo: Annotated[bool, typer.Option(help="Stop after the demo (for scripts and CI)")] = False,
       demo: Annotated[bool, typer.Option(help="Run the demo once everything is ready")] = True) -> None:
    """Bring the whole platform up on this machine (embedded stores unless URLs are set), run a demo."""
    from launch.launcher import Platform, _printable_home, describe, run_demo

    settings = Settings()
    configure_logging(name="up", level="WARNING")
    platform = Platform(settings=settings)
    stop = threading.Event()
    install_two_stage(stop.set, force=lambda: sys.exit(1))
    try:
        with console.status("starting stores, migrating, seeding…"):
            seeded = platform.start()
        with console.status("waiting for the API and warm workers…"):
            platform.wait_ready()
        console.print(f"[bold green]Sluice is up[/]  home: {_printable_home(platform.home)}")
        console.print(f"  API      {platform.api_url}   (docs: {platform.api_url}/docs)")
        console.print(f"  metrics  {platform.api_url}/metrics")
        console.print(f"  Flower   {platform.flower_url}   (Celery: webhook delivery)")
        console.print(f"  Redis    {platform.stores.redis_url if platform.stores else ''}")
        console.print(f"  demo key {seeded.demo_key}")
        console.print(f"  admin key is in {_printable_home(platform.home / 'admin.key')}"
                      if not settings.bootstrap_admin_key else "  admin key: SLUICE_BOOTSTRAP_ADMIN_KEY")
        if demo:
            for result in run_demo(platform.api_url, seeded.demo_key):
                timings = result["timings"]
                console.print(f"  {result['model']:<7} {result['id'][:14]}… {describe(result)}  "
                              f"(queue {timings['queue_wait_ms']} ms, model {timings['model_ms']} ms, "
                              f"batch {result['batch']['size']}/{result['batch']['close_reason']})")
        if not exit_after_demo:
            console.print("Ctrl-C stops everything.")
            while not stop.wait(SUPERVISE_EVERY_S):
                platform.supervise()
    finally:
        with console.status("stopping…"):
            platform.stop()
    console.print("stopped")


# --- rollouts: straight to the registry; the scheduler's controller does the stepping --------------

rollout_app = typer.Typer(no_args_is_help=True, help="Canary rollouts: start one, watch it, abort it.")
app.add_typer(rollout_app, name="rollout")


def _operator() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no passwd entry, as in some containers
        return "cli"


def _announce(settings: Settings, model: str) -> None:
    """Best effort: API replicas also pick the change up on their periodic routing refresh."""
    if not settings.redis_url:
        return
    from sluice.connections import connect
    from sluice.events import announce_routing

    async def send(url: str) -> None:
        client = connect(url, max_connections=1)
        try:
            await announce_routing(client, model)
        finally:
            await client.aclose()

    try:
        asyncio.run(send(settings.redis_url))
    except SluiceError as exc:
        console.print(f"[yellow]routing change not announced ({exc}); replicas reload it on their refresh[/]")


@contextmanager
def _rollout_session() -> Iterator[Session]:
    from sluice.registry.store import Registry

    registry = Registry(url=Settings().require_database_url(), pool_size=1)
    try:
        with registry.session() as session:
            yield session
    except SluiceError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from exc
    finally:
        registry.dispose()


@rollout_app.command("start")
def rollout_start(
    model: str, canary: str,
    stable: Annotated[str | None, typer.Option(help="Compare with this version (default: the most "
                                                    "weighted other one)")] = None,
    steps: Annotated[str | None, typer.Option(help="Canary percentages, e.g. 1,5,25,100")] = None,
    soak_s: Annotated[float | None, typer.Option("--soak-s", min=0, help="Least seconds per step")] = None,
    min_samples: Annotated[int | None, typer.Option(min=1, help="Least samples per version and step")] = None,
) -> None:
    """Start a canary rollout (in the shadow phase first when the canary is in state `shadow`)."""
    from scheduler.guardrails import Policy
    from sluice.registry import rollouts

    overrides: dict[str, Any] = {}
    if steps is not None:
        try:
            overrides["steps"] = tuple(float(part) for part in steps.split(","))
        except ValueError as exc:
            raise typer.BadParameter("steps must be comma-separated numbers", param_hint="--steps") from exc
    if soak_s is not None:
        overrides["soak_s"] = soak_s
    if min_samples is not None:
        overrides["min_samples"] = min_samples
        overrides["min_test_samples"] = min(Policy().min_test_samples, min_samples)
    try:
        policy = Policy(**overrides)
    except InvalidPolicy as exc:
        raise typer.BadParameter(str(exc)) from exc
    with _rollout_session() as session:
        row = rollouts.start_rollout(session, model=model, canary=canary, stable=stable, policy=policy.to_dict(),
                                     actor=_operator(), now=datetime.now(UTC))
        rollout_id, stable_version, step = row.id, row.stable, row.step_index
    _announce(Settings(), model)
    phase = "the shadow phase" if step < 0 else f"{policy.steps[0]:g} %"
    console.print(f"rollout {rollout_id} of {model}: '{canary}' against '{stable_version}', starting at {phase}")


@rollout_app.command("status")
def rollout_status(model: str,
                   decisions: Annotated[int, typer.Option(min=0, help="How many recent decisions")] = 10,
                   as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False) -> None:
    """The model's latest rollout and its recent decisions."""
    from sluice.registry import rollouts

    with _rollout_session() as session:
        row = rollouts.latest_rollout(session, model)
        resource = rollouts.rollout_resource(row, rollouts.decisions(session, row.id, limit=decisions))
    if as_json:
        console.print_json(data=resource)
        return
    console.print(f"rollout {resource['id']} of {model}: [bold]{resource['state']}[/], canary "
                  f"'{resource['canary']}' at {resource['weight']:g} % (step {resource['step_index']}) against "
                  f"'{resource['stable']}'; step since {resource['step_started_at']}")
    if resource["reason"]:
        console.print(f"  {resource['reason']}")
    for decision in resource["decisions"]:
        console.print(f"  {decision['at']}  step {decision['step_index']:>2}  {decision['action']:<8} "
                      f"{decision['reason']}")


@rollout_app.command("abort")
def rollout_abort(model: str,
                  reason: Annotated[str | None, typer.Option(help="Why, for the audit log")] = None) -> None:
    """Stop the running rollout and restore the weights from before it started."""
    from sluice.registry import rollouts

    with _rollout_session() as session:
        row = rollouts.abort_rollout(session, model=model, actor=_operator(), now=datetime.now(UTC), reason=reason)
        weights = dict(row.initial_weights)
    _announce(Settings(), model)
    console.print(f"rollout of {model} aborted; weights restored to {weights}")


@app.command()
def models(url: UrlOption = None, key: KeyOption = None) -> None:
    """The models by availability tier, with each version's state and replicas (through the API)."""
    from sluice.versions import Tier

    with api_errors(console), api_client(url, key) as client:
        listed = client.models()
    for tier in Tier:
        members = [model for model in listed if model["tier"] == tier]
        console.print(f"[bold]{tier}[/] tier: {', '.join(m['name'] for m in members) or '(none)'}")
        for model in members:
            for version in model["versions"]:
                replicas = version.get("replicas")
                scaled = (f"{replicas['live']} live of {replicas['desired']} desired: {replicas['reason']}"
                          if replicas else "no scaling decision in the last minute")
                console.print(f"  {model['name']} {version['version']} ({version['state']}, "
                              f"{model['routing'].get(version['version'], 0):g} % of traffic): {scaled}")


@app.command()
def simulate(
    trace: Annotated[str, typer.Option(help="steady, diurnal, spike (10x for 3 min) or periodic bursts")] = "spike",
    policy: Annotated[str, typer.Option(help="lag (the scheduler's) or utilization (HPA-like)")] = "lag",
    compare: Annotated[str | None, typer.Option(help="A second policy to run on the same arrivals")] = None,
    rate: Annotated[float, typer.Option(min=0.1, help="Base arrival rate, jobs/s")] = 40.0,
    cold_start_s: Annotated[float, typer.Option(min=0, help="Seconds before a new worker serves")] = 20.0,
    max_replicas: Annotated[int, typer.Option(min=1)] = 16,
    seed: Annotated[int, typer.Option()] = 0,
    png: Annotated[str | None, typer.Option(help="Where to write the plot (default: simulate-TRACE.png)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line per policy")] = False,
) -> None:
    """Autoscaling in simulated time: the real batcher and the real scaling policy on an arrival
    trace, with the synthetic cost model; p50/p95/p99, replica-minutes, scale changes, a PNG."""
    import json
    from pathlib import Path

    from scheduler.capacity_sim import POLICIES, CostModel, SimConfig, plot, simulate, traces

    shapes = traces(rate)
    chosen = [policy, *([compare] if compare else [])]
    if trace not in shapes:
        raise typer.BadParameter(f"one of {', '.join(shapes)}", param_hint="--trace")
    for name in chosen:
        if name not in POLICIES:
            raise typer.BadParameter(f"one of {', '.join(POLICIES)}", param_hint="--policy/--compare")
    cost = CostModel(cold_start_s=cold_start_s)
    config = SimConfig(max_replicas=max_replicas, seed=seed)
    results = [simulate(shapes[trace], name, cost=cost, config=config) for name in chosen]  # type: ignore[arg-type]
    path = plot(results, Path(png or f"simulate-{trace}.png"))
    for result in results:
        if as_json:
            sys.stdout.write(json.dumps(result.line()) + "\n")
        else:
            line = result.line()
            console.print(f"{line['policy']:<12} {trace}: p50 {line['p50_ms']} ms, p95 {line['p95_ms']} ms, "
                          f"p99 {line['p99_ms']} ms; {line['replica_minutes']} replica-minutes, "
                          f"{line['scale_changes']} scale changes, at most {line['max_replicas']} replicas")
    if not as_json:
        console.print(f"plot: {path}")


if __name__ == "__main__":
    app()
