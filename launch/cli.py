"""The `sluice` command line. Heavy imports (FastAPI, torch) happen inside the commands."""

from __future__ import annotations

import logging
import sys
import threading
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.console import Console

from launch.api_client import KeyOption, UrlOption, api_client, api_errors
from launch.batch_cli import batch_app
from launch.bench_cli import bench_app, plan
from launch.models_cli import models_app
from launch.tune_cli import tune_app
from sluice.errors import InvalidPolicy
from sluice.logs import configure_logging
from sluice.settings import Settings
from sluice.shutdown import install_two_stage

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Sluice: asynchronous inference.")
app.add_typer(batch_app, name="batch")
app.add_typer(tune_app, name="tune")
console = Console(soft_wrap=True)
log = logging.getLogger(__name__)

# How often `sluice up` looks for a dead embedded store to restart.
SUPERVISE_EVERY_S = 0.5


@app.command()
def migrate() -> None:
    """Apply the registry's Alembic migrations (a step of its own, before services start)."""
    from sluice.migrate import upgrade

    settings = Settings()
    configure_logging(settings.log_level, name="migrate", fmt=settings.log_format)
    upgrade(settings.require_database_url())
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
    configure_logging(settings.log_level, name="api", fmt=settings.log_format)
    serve(create_app(settings=settings), host=host or settings.api_host, port=port or settings.api_port,
          grace_s=settings.shutdown_grace_s)


@app.command()
def worker(group: Annotated[str | None, typer.Option(help="Serve the versions the scheduler places on this "
                                                            "placement group")] = None,
           model: Annotated[str | None, typer.Option(help="Serve this one model's --version instead")] = None,
           version: Annotated[str | None, typer.Option()] = None,
           threads: Annotated[int | None, typer.Option(min=1)] = None,
           device: Annotated[str, typer.Option()] = "auto") -> None:
    """Serve the versions of a placement group (or one given version) from their streams."""
    from workers.main import run_worker

    if (group is None) == (model is None or version is None) or (model is None) != (version is None):
        console.print("[red]give either --group, or both --model and --version[/]")
        raise typer.Exit(2)
    settings = Settings()
    configure_logging(settings.log_level, name=f"worker[{group or f'{model}/{version}'}]", fmt=settings.log_format)
    raise typer.Exit(run_worker(settings=settings, model=model, version=version, group=group, threads=threads,
                                device=device))


class Actuator(StrEnum):
    """What carries out the scheduler's decisions; any other name is a usage error, not `none`."""

    local = "local"
    kubernetes = "kubernetes"
    none = "none"


@app.command()
def scheduler(actuator: Annotated[Actuator, typer.Option(help="local: supervise worker processes here; "
                                                              "kubernetes: a Deployment per placement group; "
                                                              "none: only publish the plan and decisions")]
              = Actuator.local) -> None:
    """Place every servable version on worker processes and size them to its load."""
    from scheduler.main import Actuator as PoolActuator
    from scheduler.main import Scheduler, autoscaler, local_supervisor
    from sluice import exposition
    from sluice.errors import ActuatorError
    from sluice.registry.store import Registry

    settings = Settings()
    configure_logging(settings.log_level, name="scheduler", fmt=settings.log_format)
    supervisor: PoolActuator | None = None
    if actuator is Actuator.local:
        supervisor = local_supervisor(home=settings.home.resolve(), stop_grace_s=settings.shutdown_grace_s)
    elif actuator is Actuator.kubernetes:
        # Imported here: the official client is heavy and only this actuator needs it.
        from scheduler.kubernetes import connect

        try:
            supervisor = connect(namespace=settings.kubernetes_namespace,
                                 template=settings.kubernetes_worker_template)
        except ActuatorError as exc:
            console.print(f"[red]{exc}[/]")
            raise typer.Exit(1) from exc
    endpoint = exposition.serve_metrics(host=settings.metrics_host, port=settings.metrics_port)
    # One connection for each of the scheduler's threads: the loop, the rollout controller and
    # the quality aggregator.
    registry = Registry.serving(settings, pool_size=3)
    runner = Scheduler(registry=registry, redis_url=settings.require_redis_url(), supervisor=supervisor,
                       autoscaler=autoscaler(settings), refresh_s=settings.scale_interval_s,
                       retire_drain_s=settings.retire_drain_s, sweep_s=settings.deadline_sweep_s,
                       scrape_target=exposition.ScrapeTarget(address=endpoint.address, process="scheduler"))
    install_two_stage(runner.request_stop, force=lambda: sys.exit(1))
    runner.run()
    registry.dispose()


@app.command()
def up(exit_after_demo: Annotated[bool, typer.Option(help="Stop after the demo (for scripts and CI)")] = False,
       demo: Annotated[bool, typer.Option(help="Run the demo once everything is ready")] = True) -> None:
    """Bring the whole platform up on this machine (embedded stores unless URLs are set), run a demo."""
    from launch.launcher import Platform, _printable_home, describe, run_demo

    settings = Settings()
    # The terminal of the person who ran it: their messages go to the console, as text.
    configure_logging("WARNING", name="up", fmt="text")
    platform = Platform(settings=settings)
    stop = threading.Event()
    install_two_stage(stop.set, force=lambda: sys.exit(1))
    try:
        with console.status("starting stores, migrating, seeding…"):
            seeded = platform.start()
        with console.status("waiting for the API and warm workers…"):
            platform.wait_ready()
        # Writes the Prometheus targets file now, not a supervision tick later.
        platform.supervise()
        console.print(f"[bold green]Sluice is up[/]  home: {_printable_home(platform.home)}")
        console.print(f"  API      {platform.api_url}   (docs: {platform.api_url}/docs)")
        console.print(f"  metrics  {platform.api_url}/metrics; every process: "
                      f"prometheus --config.file={_printable_home(platform.write_prometheus_config())}")
        console.print(f"  Flower   {platform.flower_url}   (Celery: webhooks, batch scoring, schedules)")
        console.print(f"  batches  each tenant's input_uri and schedule files under "
                      f"{platform.batch_root.as_uri()}/tenants/<tenant>/")
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


# --- rollouts: through the API; the scheduler's controller does the stepping -----------------------

rollout_app = typer.Typer(no_args_is_help=True, help="Canary rollouts: start one, watch it, abort it.")
app.add_typer(rollout_app, name="rollout")


@rollout_app.command("start")
def rollout_start(
    model: str, canary: str,
    stable: Annotated[str | None, typer.Option(help="Compare with this version (default: the most "
                                                    "weighted other one)")] = None,
    steps: Annotated[str | None, typer.Option(help="Canary percentages, e.g. 1,5,25,100")] = None,
    soak_s: Annotated[float | None, typer.Option("--soak-s", min=0, help="Least seconds per step")] = None,
    min_samples: Annotated[int | None, typer.Option(min=1, help="Least samples per version and step")] = None,
    reason: Annotated[str | None, typer.Option(help="Why, for the audit log")] = None,
    url: UrlOption = None, key: KeyOption = None,
) -> None:
    """Start a canary rollout (in the shadow phase first when the canary is in state `shadow`)."""
    from sluice.rollout_policy import Policy

    percentages = None
    if steps is not None:
        try:
            percentages = [float(part) for part in steps.split(",")]
        except ValueError as exc:
            raise typer.BadParameter("steps must be comma-separated numbers", param_hint="--steps") from exc
    # The API checks the policy too; checking it here first makes a bad one a usage error.
    try:
        Policy.chosen(steps=percentages, soak_s=soak_s, min_samples=min_samples)
    except InvalidPolicy as exc:
        raise typer.BadParameter(str(exc)) from exc
    with api_errors(console), api_client(url, key) as client:
        rollout = client.start_rollout(model, canary, stable=stable, steps=percentages, soak_s=soak_s,
                                       min_samples=min_samples, reason=reason)
    phase = "the shadow phase" if rollout["step_index"] < 0 else f"{rollout['weight']:g} %"
    console.print(f"rollout {rollout['id']} of {model}: '{canary}' against '{rollout['stable']}', "
                  f"starting at {phase}")


@rollout_app.command("status")
def rollout_status(model: str,
                   decisions: Annotated[int, typer.Option(min=0, max=1000, help="How many recent decisions")] = 10,
                   as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
                   url: UrlOption = None, key: KeyOption = None) -> None:
    """The model's latest rollout and its recent decisions."""
    with api_errors(console), api_client(url, key) as client:
        resource = client.rollout(model, decisions=decisions)
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
                  reason: Annotated[str | None, typer.Option(help="Why, for the audit log")] = None,
                  url: UrlOption = None, key: KeyOption = None) -> None:
    """Stop the running rollout and restore the weights from before it started."""
    with api_errors(console), api_client(url, key) as client:
        rollout = client.abort_rollout(model, reason=reason)
    weights = rollout["decisions"][-1]["evidence"]["restored_weights"]
    console.print(f"rollout of {model} aborted; weights restored to {weights}")


@app.command()
def stats(model: str,
          version: Annotated[str | None, typer.Argument(help="Only this version (default: every one not retired)")]
          = None,
          window_s: Annotated[float, typer.Option("--window-s", min=1, help="Over the last this many seconds")] = 300.0,
          watch: Annotated[bool, typer.Option("--watch", help="Redraw every --every seconds until Ctrl-C")] = False,
          every_s: Annotated[float, typer.Option("--every", min=0.5, help="Seconds between redraws")] = 2.0,
          as_json: Annotated[bool, typer.Option("--json", help="Print the stats resources as JSON")] = False,
          url: UrlOption = None, key: KeyOption = None) -> None:
    """Exact latency percentiles, error rate, throughput and batches, versions side by side (through the API,
    with an admin key: the figures count every tenant's jobs)."""
    from rich.live import Live

    from launch.stats_view import shown_versions, stats_table

    with api_errors(console), api_client(url, key) as client:
        def read() -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
            resource = client.model(model)
            return resource, {name: client.stats(model, name, window_s=window_s)
                              for name in shown_versions(resource, version)}

        resource, bodies = read()
        if as_json:
            console.print_json(data=bodies)
            return
        if not watch:
            console.print(stats_table(model, resource, bodies, window_s=window_s))
            return
        stop = threading.Event()
        install_two_stage(stop.set, force=lambda: sys.exit(1))
        with Live(stats_table(model, resource, bodies, window_s=window_s), console=console,
                  auto_refresh=False) as live:
            while not stop.wait(every_s):
                live.update(stats_table(model, *read(), window_s=window_s), refresh=True)


@app.command()
def simulate_capacity(
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

    from scheduler.planning.capacity_sim import POLICIES, CostModel, SimConfig, plot, simulate, traces

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


app.add_typer(bench_app, name="bench")
app.add_typer(models_app, name="models")
app.command()(plan)


if __name__ == "__main__":
    app()
