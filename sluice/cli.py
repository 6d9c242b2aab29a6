"""The `sluice` command line. Heavy imports (FastAPI, torch) happen inside the commands."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Annotated

import typer
from rich.console import Console

from sluice.redact import configure_logging
from sluice.settings import Settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Sluice: asynchronous inference.")
console = Console(soft_wrap=True)
log = logging.getLogger("sluice.cli")


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
    from sluice.registry.store import Registry
    from sluice.seed import seed

    settings = Settings()
    registry = Registry(url=settings.require_database_url(), pool_size=1)
    admin = settings.bootstrap_admin_key
    seeded = seed(registry, home=settings.home, bootstrap_admin_key=admin.get_secret_value() if admin else None)
    registry.dispose()
    console.print(f"demo key: {seeded.demo_key}")


@app.command()
def api(host: Annotated[str | None, typer.Option()] = None,
        port: Annotated[int | None, typer.Option()] = None) -> None:
    """Serve the REST API."""
    import uvicorn

    from api.app import create_app

    settings = Settings()
    configure_logging(name="api")
    uvicorn.run(
        create_app(settings=settings), host=host or settings.api_host, port=port or settings.api_port,
        log_config=None, access_log=False, timeout_graceful_shutdown=int(settings.shutdown_grace_s),
    )


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
    from scheduler.main import Scheduler, local_supervisor
    from sluice.registry.store import Registry

    settings = Settings()
    configure_logging(name="scheduler")
    supervisor = (
        local_supervisor(home=settings.home.resolve(), cores=settings.cpu_cores,
                         stop_grace_s=settings.shutdown_grace_s)
        if actuator == "local" else None
    )
    registry = Registry(url=settings.require_database_url(), pool_size=1)
    runner = Scheduler(registry=registry, redis_url=settings.require_redis_url(), supervisor=supervisor)
    _two_stage_signals(runner.request_stop)
    runner.run()
    registry.dispose()


def _two_stage_signals(stop: object) -> None:
    seen = 0

    def handler(signum: int, _: object) -> None:
        nonlocal seen
        seen += 1
        if seen == 1:
            threading.Thread(target=stop, daemon=True).start()  # type: ignore[arg-type]
        else:
            sys.exit(1)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


@app.command()
def up(exit_after_demo: Annotated[bool, typer.Option(help="Stop after the demo (for scripts and CI)")] = False,
       demo: Annotated[bool, typer.Option(help="Run the demo once everything is ready")] = True) -> None:
    """Bring the whole platform up on this machine (embedded stores unless URLs are set), run a demo."""
    from sluice.launcher import Platform, _printable_home, describe, run_demo

    settings = Settings()
    configure_logging(name="up", level="WARNING")
    platform = Platform(settings=settings)
    stop = threading.Event()
    _two_stage_signals(stop.set)
    try:
        with console.status("starting stores, migrating, seeding…"):
            seeded = platform.start()
        with console.status("waiting for the API and warm workers…"):
            platform.wait_ready()
        console.print(f"[bold green]Sluice is up[/]  home: {_printable_home(platform.home)}")
        console.print(f"  API      {platform.api_url}   (docs: {platform.api_url}/docs)")
        console.print(f"  metrics  {platform.api_url}/metrics")
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
            stop.wait()
    finally:
        with console.status("stopping…"):
            platform.stop()
    console.print("stopped")


if __name__ == "__main__":
    app()
