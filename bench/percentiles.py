"""Exact percentiles of a benchmark's samples."""

from __future__ import annotations

from collections.abc import Sequence

PERCENTILE_METHOD = ("exact over all samples: numpy.percentile(method='linear'), i.e. Hyndman-Fan type 7 "
                     "(linear interpolation between closest ranks)")
MIN_SAMPLES_P99 = 300


def percentiles(samples: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float | None]:
    """Exact percentiles (type 7). A p99 (or higher) from fewer than MIN_SAMPLES_P99 samples is None."""
    import numpy as np

    out: dict[str, float | None] = {}
    data = np.asarray(samples, dtype=float)
    for q in qs:
        key = f"p{q:g}"
        if len(data) == 0 or (q >= 99 and len(data) < MIN_SAMPLES_P99):
            out[key] = None
        else:
            out[key] = float(np.percentile(data, q, method="linear"))
    out["n"] = float(len(data))
    return out
