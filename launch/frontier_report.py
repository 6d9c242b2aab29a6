"""The frontier's table (markdown and rich) and plot, from a frontier.json document alone, so a
saved run can be drawn again (`python -m launch.frontier_report PATH`)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HEADERS = ("batch", "wait ms", "capacity/s", "sustained/s", "p50 ms", "p95 ms", "p99 ms", "jobs", "mean batch",
           "within budget /s (p99 ms)", "sim sustained/s", "sim p99 ms", "sim within budget /s (p99 ms)", "mark")
# The same columns in a terminal's width.
SHORT_HEADERS = ("batch", "wait", "cap/s", "sust/s", "p50", "p95", "p99", "jobs", "mean b", "budget/s (p99)",
                 "sim/s", "sim p99", "sim budget/s", "")
BEST_REAL, BEST_SIM = "best", "best (sim)"


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _at(point: Mapping[str, Any] | None) -> str:
    return "-" if point is None else f"{point['throughput_rps']:.1f} ({point['p99_ms']:.0f})"


def _same(point: Mapping[str, Any] | None, config: Mapping[str, Any]) -> bool:
    return point is not None and (point["max_batch_size"], point["max_wait_ms"]) == (
        config["max_batch_size"], config["max_wait_ms"])


def rows(document: Mapping[str, Any]) -> list[list[str]]:
    """One row per configuration: the real sweep's sustained rung and best rung within the
    budget, the same for the simulator, and which configuration is the best of each."""
    series = document["series"]
    sims = {(c["max_batch_size"], c["max_wait_ms"]): c for c in series.get("sim", {}).get("configs", [])}
    out: list[list[str]] = []
    for config in series["real"]["configs"]:
        top = config["sustained"] or {}
        sim = sims.get((config["max_batch_size"], config["max_wait_ms"]), {})
        sim_top = sim.get("sustained") or {}
        marks = [mark for mark, best in ((BEST_REAL, series["real"]["best"]), (BEST_SIM, series.get("sim", {}).get(
            "best"))) if _same(best, config)]
        out.append([
            str(config["max_batch_size"]), f"{config['max_wait_ms']:g}", _number(config["capacity_rps"]),
            _number(top.get("throughput_rps")), _number(top.get("p50_ms")), _number(top.get("p95_ms")),
            _number(top.get("p99_ms")), str(top.get("jobs", "-")), _number(top.get("mean_batch")),
            _at(config["at_budget"]), _number(sim_top.get("throughput_rps")), _number(sim_top.get("p99_ms")),
            _at(sim.get("at_budget")), ", ".join(marks),
        ])
    return out


def _best_line(name: str, best: Mapping[str, Any] | None, budget: float) -> str:
    if best is None:
        return f"{name}: no configuration kept p99 within {budget:g} ms"
    return (f"{name}: batch {best['max_batch_size']}, wait {best['max_wait_ms']:g} ms: "
            f"{best['throughput_rps']:.1f} jobs/s at p99 {best['p99_ms']:.0f} ms (budget {budget:g} ms)")


def notes(document: Mapping[str, Any]) -> list[str]:
    budget = document["p99_budget_ms"]
    series = document["series"]
    fit = document["cost_fit"]
    lines = [_best_line("best within the budget, real worker", series["real"]["best"], budget)]
    if "sim" in series:
        lines.append(_best_line("best within the budget, simulator", series["sim"]["best"], budget))
    lines.append(f"simulator cost, fitted to {fit['batches']} measured forward passes: "
                 f"{fit['fixed_s'] * 1000:.2f} ms + {fit['per_item_s'] * 1000:.3f} ms/job + "
                 f"{fit['per_token_s'] * 1e6:.1f} us/padded token (R^2 {fit['r2']:.3f}, median error "
                 f"{fit['median_abs_error']:.0%})")
    return lines


def markdown(document: Mapping[str, Any]) -> str:
    model = document["model"]
    options = document["options"]
    head = (f"# Batching frontier: {model['label']} ({model['kind']})\n\n"
            f"`{document['command']}`, {options['phase_s']:g} s phases, rates at "
            f"{', '.join(f'{f:g}' for f in options['fractions'])} of each batch size's capacity; "
            f"{document['machine']['cores']} cores ({document['machine']['cpu']}), load average at start "
            f"{', '.join(f'{x:.2f}' for x in document['machine']['loadavg_at_start'])}.\n\n")
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join("---" for _ in HEADERS) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows(document)]
    return head + "\n".join(lines) + "\n\n" + "\n".join(f"* {line}" for line in notes(document)) + "\n"


def rich_table(document: Mapping[str, Any]) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(title=f"batching frontier: {document['model']['label']} (latencies in ms, p99 budget "
                        f"{document['p99_budget_ms']:g} ms)", caption="\n".join(notes(document)),
                  box=box.SIMPLE_HEAD, pad_edge=False, caption_justify="left")
    for index, header in enumerate(SHORT_HEADERS):
        table.add_column(header, justify="left" if index == len(SHORT_HEADERS) - 1 else "right", no_wrap=True)
    for row in rows(document):
        table.add_row(*row, style="bold green" if row[-1].startswith(BEST_REAL) else None)
    return table


# --- the plot -----------------------------------------------------------------------------------------

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _points(config: Mapping[str, Any]) -> tuple[list[float], list[float]]:
    kept = [r for r in config["rungs"] if r["kept_up"] and r["p99_ms"] is not None]
    return [r["throughput_rps"] for r in kept], [r["p99_ms"] for r in kept]


def _panel(ax: Any, name: str, document: Mapping[str, Any], colours: Mapping[int, Any],
           markers: Mapping[float, str]) -> None:
    from matplotlib.ticker import LogFormatter

    series = document["series"][name]
    budget = document["p99_budget_ms"]
    for config in series["configs"]:
        xs, ys = _points(config)
        ax.plot(xs, ys, color=colours[config["max_batch_size"]], marker=markers[config["max_wait_ms"]],
                markersize=6, linewidth=1.2, alpha=0.8)
    other = "sim" if name == "real" else "real"
    if other in document["series"]:
        front = document["series"][other]["front"]
        ax.plot([p["throughput_rps"] for p in front], [p["p99_ms"] for p in front], color="grey", linestyle="--",
                linewidth=1.2, label=f"{'simulator' if other == 'sim' else 'real worker'} front")
    front = series["front"]
    ax.plot([p["throughput_rps"] for p in front], [p["p99_ms"] for p in front], color="black", linewidth=2.2,
            zorder=4, label="Pareto front")
    ax.axhline(budget, color="red", linestyle=":", linewidth=1.5, label=f"p99 budget {budget:g} ms")
    best = series["best"]
    if best is not None:
        ax.scatter([best["throughput_rps"]], [best["p99_ms"]], marker="*", s=380, color="gold", edgecolor="black",
                   linewidth=1.2, zorder=5, label="best within budget")
        ax.annotate(f"batch {best['max_batch_size']}, wait {best['max_wait_ms']:g} ms\n"
                    f"{best['throughput_rps']:.1f}/s, p99 {best['p99_ms']:.0f} ms",
                    (best["throughput_rps"], best["p99_ms"]), xytext=(-12, -34), textcoords="offset points",
                    ha="right", fontsize=9, bbox={"boxstyle": "round", "facecolor": "lightyellow", "alpha": 0.9},
                    arrowprops={"arrowstyle": "-", "color": "black"}, zorder=6)
    ax.set_yscale("log")
    # Plain numbers, and the minor ticks labelled too when the axis spans a decade or two.
    ax.yaxis.set_major_formatter(LogFormatter())
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.set_xlabel("sustained throughput (jobs/s, one replica)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)


def plot(document: Mapping[str, Any], path: Path) -> Path:
    """p99 against throughput for every rung kept up with, one line per configuration (colour:
    batch size, marker: wait); real worker and simulator side by side on the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    names = [name for name in ("real", "sim") if name in document["series"]]
    configs: Sequence[Mapping[str, Any]] = document["series"]["real"]["configs"]
    sizes = sorted({c["max_batch_size"] for c in configs})
    waits = sorted({c["max_wait_ms"] for c in configs})
    palette = plt.get_cmap("tab10")
    colours = {size: palette(i % 10) for i, size in enumerate(sizes)}
    markers = {wait: _MARKERS[i % len(_MARKERS)] for i, wait in enumerate(waits)}
    fig, axes = plt.subplots(1, len(names), figsize=(7.5 * len(names), 6.2), sharex=True, sharey=True, squeeze=False)
    titles = {"real": f"real worker ({document['options']['threads']} thread(s), {document['options']['device']})",
              "sim": "simulator (cost fitted to the real passes)"}
    for ax, name in zip(axes[0], names, strict=True):
        _panel(ax, name, document, colours, markers)
        ax.set_title(titles[name])
    axes[0][0].set_ylabel("p99 latency, arrival to result (ms, log)")
    handles = [Line2D([], [], color=colours[s], linewidth=2, label=f"batch {s}") for s in sizes]
    handles += [Line2D([], [], color="grey", marker=markers[w], linestyle="", label=f"wait {w:g} ms") for w in waits]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
    model = document["model"]
    fig.suptitle(f"{model['label']}: p99 against throughput per (max_batch_size, max_wait_ms); "
                 f"{document['options']['phase_s']:g} s open-loop phases", fontsize=12)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(document: Mapping[str, Any], out: Path) -> dict[str, Path]:
    """frontier.json, frontier.md and frontier.png under `out`."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "frontier.json", "table": out / "frontier.md", "plot": out / "frontier.png"}
    paths["json"].write_text(json.dumps(document, indent=2) + "\n")
    paths["table"].write_text(markdown(document))
    plot(document, paths["plot"])
    return paths


if __name__ == "__main__":
    import json

    source = Path(sys.argv[1] if len(sys.argv) > 1 else "frontier/frontier.json")
    sys.stdout.write(f"wrote {write(json.loads(source.read_text()), source.parent)}\n")
