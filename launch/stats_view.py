"""`sluice stats MODEL`: the stats resource of each version, side by side, never blended."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rich.table import Table

from sluice.versions import VersionState


def shown_versions(resource: Mapping[str, Any], wanted: str | None) -> list[str]:
    """The version asked for, else every version not retired, stable first."""
    if wanted is not None:
        return [wanted]
    order = {VersionState.stable: 0, VersionState.canary: 1, VersionState.shadow: 2, VersionState.staged: 3}
    live = [v for v in resource["versions"] if v["state"] != VersionState.retired]
    return [v["version"] for v in sorted(live, key=lambda v: (order.get(v["state"], 9), v["version"]))]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _figure(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _cut(series: str, cut: str) -> Callable[[dict[str, Any]], str]:
    return lambda body: _ms(body[series][cut])


_ROWS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("jobs", lambda body: str(body["count"])),
    ("errors", lambda body: f"{body['errors']} ({body['error_rate']:.2%})"),
    ("throughput /s", lambda body: f"{body['throughput_per_s']:.2f}"),
    *[(f"{label} {cut}", _cut(series, cut))
      for series, label in (("queue_wait_ms", "queue wait ms"), ("model_ms", "model ms"), ("total_ms", "total ms"))
      for cut in ("p50", "p95", "p99")],
    ("batch size mean", lambda body: f"{body['batch_size']['mean']:.2f}"),
    ("batches closed on", lambda body: ", ".join(f"{reason} {n}" for reason, n in body["close_reasons"].items())),
    ("time to fill ms p50", _cut("fill_ms", "p50")),
    ("padded / real tokens", lambda body: _figure(body["cost"]["padding_ratio"], ".2f")),
    ("idle slot s", lambda body: f"{body['cost']['idle_slot_s']:.1f}"),
    ("core-s / GPU-s", lambda body: f"{body['cost']['core_s']:.1f} / {body['cost']['gpu_s']:.1f}"),
    ("cost per 1,000 jobs", lambda body: _figure(body["cost"]["per_1k_jobs"], ".4g")),
]


def stats_table(model: str, resource: Mapping[str, Any], bodies: Mapping[str, dict[str, Any]], *,
                window_s: float) -> Table:
    """One column per version: its state, traffic share and replicas, then its stats."""
    versions = {v["version"]: v for v in resource["versions"]}
    table = Table(title=f"{model} {', '.join(bodies)} over {window_s:g} s", title_justify="left")
    table.add_column("")
    for name in bodies:
        info = versions.get(name, {})
        weight = resource.get("routing", {}).get(name, 0)
        table.add_column(f"{name}\n{info.get('state', '?')}, {weight:g} %", justify="right")
    replicas = [versions.get(name, {}).get("replicas") for name in bodies]
    table.add_row("replicas live/desired",
                  *[f"{r['live']}/{r['desired']}" if r else "-" for r in replicas])
    for label, cell in _ROWS:
        table.add_row(label, *[cell(body) for body in bodies.values()])
    short = [name for name, body in bodies.items() if body["count"] < body["p99_min_samples"]]
    if short:
        minimum = next(iter(bodies.values()))["p99_min_samples"]
        table.caption = f"p99 needs at least {minimum} jobs in the window ({', '.join(short)} had fewer)"
    return table
