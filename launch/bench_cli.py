"""`sluice bench frontier` and `sluice plan`: the batching frontier of a model, and the replicas and
cost it implies per device type. Everything past typer and rich (numpy, torch, the worker,
matplotlib) is imported inside the commands, so registering them costs `sluice` nothing at start.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from launch.api_client import KeyOption, UrlOption, api_client, api_errors

if TYPE_CHECKING:
    from scheduler.planning.capacity_plan import PlanRow
    from scheduler.planning.frontier import Series

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print a table and write a plot.")

# Relative: a folder in the directory the command runs in, wherever `sluice` is installed.
DEFAULT_OUT = Path("frontier")


def _console() -> Console:
    """The terminal's width, or 160 columns into a file or a pipe (where rich would take 80 and
    cut the tables' columns)."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def _numbers(text: str, option: str, cast: type[float] | type[int] = float) -> tuple[Any, ...]:
    try:
        values = tuple(cast(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"comma-separated {cast.__name__}s, got {text!r}", param_hint=option) from None
    if not values or any(value < 0 for value in values):
        raise typer.BadParameter(f"one number or more, none below 0, got {text!r}", param_hint=option)
    return values


@bench_app.command()
def frontier(
    model: Annotated[str, typer.Option(help="minilm, intent, synthetic (or a synthetic:?fixed_s=..&per_item_s=..&"
                                            "per_token_s=.. URI), or a registered model (read from "
                                            "SLUICE_DATABASE_URL)")],
    version: Annotated[str | None, typer.Option(help="A registered model's version (default: its most "
                                                     "weighted)")] = None,
    batch_sizes: Annotated[str, typer.Option(help="max_batch_size values, comma-separated")] = "1,4,8,16,32",
    waits_ms: Annotated[str, typer.Option("--waits-ms", help="max_wait_ms values, comma-separated")] = "2,5,10,25",
    fractions: Annotated[str, typer.Option(help="Offered rates, as fractions of each batch size's measured "
                                                "capacity, climbed until one is not kept up with")] = "0.5,0.75,0.9",
    phase_s: Annotated[float, typer.Option("--phase-s", min=0.5, help="Seconds of arrivals per rate")] = 4.0,
    p99_budget_ms: Annotated[float, typer.Option("--p99-budget-ms", min=0.001,
                                                 help="Mark the best configuration within this p99")] = 200.0,
    threads: Annotated[int, typer.Option(min=1, help="torch threads of the replica")] = 1,
    device: Annotated[str, typer.Option(help="cpu, cuda or auto")] = "cpu",
    seed: Annotated[int, typer.Option()] = 0,
    texts: Annotated[int, typer.Option(min=16, help="Size of the skewed-mix text pool")] = 1024,
    min_ratio: Annotated[float, typer.Option(min=0.5, max=1.0, help="Kept up: finished at least this share of "
                                                                    "the offered rate")] = 0.95,
    redis_url: Annotated[str | None, typer.Option(help="Redis to run on (default: a private Valkey)")] = None,
    out: Annotated[Path, typer.Option(help="Where frontier.json, frontier.md and frontier.png go")] = DEFAULT_OUT,
) -> None:
    """p99 against sustained throughput for every (max_batch_size, max_wait_ms) of a grid, on one
    real worker replica (real handler, real Redis, open-loop Poisson load of the skewed length mix)
    and in the simulator at a cost fitted to the real run; a table, frontier.json and frontier.png."""
    from launch.frontier_report import rich_table, write
    from launch.frontier_run import Options, run

    options = Options(
        model=model, version=version, batch_sizes=tuple(int(b) for b in _numbers(batch_sizes, "--batch-sizes", int)),
        waits_ms=_numbers(waits_ms, "--waits-ms"), fractions=_numbers(fractions, "--fractions"), phase_s=phase_s,
        p99_budget_ms=p99_budget_ms, threads=threads, device=device, seed=seed, texts=texts, min_ratio=min_ratio,
        redis_url=redis_url)
    if 0 in options.batch_sizes or 0 in options.fractions:
        raise typer.BadParameter("batch sizes and fractions must be > 0")
    console = _console()
    console.print(f"writing to {out.resolve()}")
    try:
        document = run(options, log=console.print)
    except LookupError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from None
    paths = write(document, out)
    console.print(rich_table(document))
    console.print(f"table {paths['table']}\nplot  {paths['plot']}\ndata  {paths['json']}")


def _series(path: Path, name: str) -> Series:
    from scheduler.planning.frontier import load_series

    try:
        return load_series(json.loads(path.read_text()), name)
    except (OSError, ValueError, KeyError) as exc:
        raise typer.BadParameter(f"{path}: not a frontier.json with a {name!r} series ({exc})") from None


def _plan_table(rows: list[PlanRow], *, budget: float, peak: float, headroom: float) -> Table:
    table = Table(title=f"{peak:g} jobs/s at peak, +{headroom:.0%} headroom, p99 within {budget:g} ms",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("device", "price/h", "speed", "config", "per replica/s", "p99 ms", "replicas", "cost/h",
                   "per 1M at peak", "per 1M at full use"):
        table.add_column(header, justify="left" if header in ("device", "config") else "right")
    for row in rows:
        if row.point is None:
            table.add_row(row.device, f"{row.price_per_hour:g}", f"x{row.speedup:g}", "no config within budget",
                          *["-"] * 6)
            continue
        table.add_row(row.device, f"{row.price_per_hour:g}", f"x{row.speedup:g}", row.point.label,
                      f"{row.point.throughput_rps:.1f}", f"{row.point.p99_ms:.0f}", str(row.replicas),
                      f"{row.cost_per_hour:.2f}", f"{row.cost_per_million_at_peak:.3f}",
                      f"{row.cost_per_million_at_full:.3f}")
    return table


def plan(
    frontier: Annotated[Path, typer.Option(help="frontier.json of `sluice bench frontier` (the base frontier)")],
    p99_budget_ms: Annotated[float, typer.Option("--p99-budget-ms", help="p99 each replica must stay within")],
    peak_rps: Annotated[float, typer.Option("--peak-rps", help="Peak arrival rate to serve, jobs/s")],
    device: Annotated[list[str], typer.Option(
        metavar="NAME=PRICE[:SOURCE]",
        help="A device type, repeatable: NAME=PRICE[:SOURCE]. PRICE is one replica's cost per hour (one "
             "currency for all); SOURCE is a frontier.json measured on that device, or a speed factor "
             "against --frontier (2.5 or x2.5), which scales it in time (throughput x factor, latency / "
             "factor); without SOURCE, --frontier is the device's own. E.g. --device cpu=0.10 --device "
             "h100=4.00:h100/frontier.json --device a10=1.20:x6")],
    headroom: Annotated[float, typer.Option(min=0.0, help="Spare capacity over the peak (0.3: 30 %)")] = 0.3,
    series: Annotated[str, typer.Option(help="Which sweep of the frontier to plan from: real or sim")] = "real",
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON")] = False,
    measured: Annotated[str | None, typer.Option(
        "--measured", metavar="MODEL/VERSION",
        help="Beside the plan, what the running version measured: its /stats cost figures (padding, core- and "
             "GPU-seconds per job, cost per 1,000 jobs at the API's prices), through the API with an admin key")
    ] = None,
    window_s: Annotated[float, typer.Option("--window-s", min=1, help="--measured over this many seconds")] = 3600.0,
    url: UrlOption = None, key: KeyOption = None,
) -> None:
    """Replicas and cost per device type for a peak rate: each replica at the frontier's best
    throughput within the p99 budget, replicas = ceil(peak x (1 + headroom) / that), and the cost per
    million requests at the peak rate and at full per-replica use."""
    from scheduler.planning.capacity_plan import parse_device, plan_device
    from scheduler.planning.frontier import SERIES

    if series not in SERIES:
        raise typer.BadParameter(f"one of {', '.join(SERIES)}", param_hint="--series")
    try:
        specs = [parse_device(text) for text in device]
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--device") from None
    base = _series(frontier, series)
    try:
        rows = [plan_device(_series(spec.frontier, series) if spec.frontier else base, spec,
                            p99_budget_ms=p99_budget_ms, peak_rps=peak_rps, headroom=headroom) for spec in specs]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    figures = _measured(measured, window_s=window_s, url=url, key=key) if measured else None
    if as_json:
        body = {"p99_budget_ms": p99_budget_ms, "peak_rps": peak_rps, "headroom": headroom, "series": series,
                "frontier": str(frontier), "devices": [row.to_dict() for row in rows]}
        if figures is not None:
            body["measured"] = figures
        sys.stdout.write(json.dumps(body, indent=2) + "\n")
        return
    console = _console()
    console.print(_plan_table(rows, budget=p99_budget_ms, peak=peak_rps, headroom=headroom))
    if figures is not None:
        console.print(measured_line(figures))


def _measured(name: str, *, window_s: float, url: str | None, key: str | None) -> dict[str, Any]:
    model, _, version = name.partition("/")
    if not model or not version:
        raise typer.BadParameter("MODEL/VERSION", param_hint="--measured")
    with api_errors(Console(stderr=True)), api_client(url, key) as client:
        return measured_figures(client.stats(model, version, window_s=window_s))


def measured_figures(stats: dict[str, Any]) -> dict[str, Any]:
    """The cost figures of a version's `/stats` (sluice/cost.py), per job where the plan's are per request."""
    cost, jobs = stats["cost"], stats["count"]
    return {"model": stats["model"], "version": stats["version"], "window_s": stats["window_s"], "jobs": jobs,
            "padding_ratio": cost["padding_ratio"], "idle_slot_s": cost["idle_slot_s"],
            "core_s_per_job": cost["core_s"] / jobs if jobs else None,
            "gpu_s_per_job": cost["gpu_s"] / jobs if jobs else None,
            "cost_per_1k_jobs": cost["per_1k_jobs"], "cost_per_million_jobs":
                None if cost["per_1k_jobs"] is None else cost["per_1k_jobs"] * 1000}


def measured_line(figures: dict[str, Any]) -> str:
    def shown(value: float | None, spec: str) -> str:
        return "—" if value is None else format(value, spec)

    return (f"measured {figures['model']}/{figures['version']}, {figures['jobs']} jobs in the last "
            f"{figures['window_s']:g} s: padding {shown(figures['padding_ratio'], '.2f')}x, "
            f"{shown(figures['core_s_per_job'], '.4g')} core-s and {shown(figures['gpu_s_per_job'], '.4g')} GPU-s "
            f"per job ({figures['idle_slot_s']:g} s of idle slot included), per 1M jobs "
            f"{shown(figures['cost_per_million_jobs'], '.3f')} at the API's prices")

