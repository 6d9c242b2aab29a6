"""What a benchmark prints and keeps: plain-text tables, the JSON result under bench/results/, and
the command line that repeats the run."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# How the results' percentiles are computed (`sluice.stats.percentiles`), recorded beside them.
PERCENTILE_METHOD = ("exact over all samples: numpy.percentile(method='linear'), i.e. Hyndman-Fan type 7 "
                     "(linear interpolation between closest ranks)")


def fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("x%"))
    except ValueError:
        return False
    return True


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], max_width: int = 110) -> str:
    """A plain-text table: numbers right-aligned, text left-aligned, long cells cut."""
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in row] for row in rows]
    cells = [[c if len(c) <= max_width else c[: max_width - 3] + "..." for c in row] for row in cells]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [line, "| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)) + " |", line]
    for row in cells[1:]:
        out.append("| " + " | ".join(c.rjust(w) if _is_number(c) else c.ljust(w)
                                     for c, w in zip(row, widths, strict=True)) + " |")
    out.append(line)
    return "\n".join(out)


def write_json(name: str, data: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / name
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    return path


def command_line(module: str) -> str:
    """The command that reproduces this run (from the repository root, venv active)."""
    import shlex

    return f"python -m {module}" + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "")
