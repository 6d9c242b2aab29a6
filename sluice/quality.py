"""Quality proxies: what a finished job's output says about its version's health.

A new version can be fast, error-free and wrong. These proxies are computed by the workers on
the serving path, one small dict per job (`proxies`), carried in the per-version samples and
summarised per window (`summarise_quality`) for `/stats`, the rollout controller and the
quality aggregates in Postgres. They never carry the output itself: a label is a class name
the model declares, not user text.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

# Below this top probability a classifier answer counts as low-confidence.
LOW_CONFIDENCE_P = 0.5


def proxies(output: Mapping[str, Any] | None, *, encoded_size: int) -> dict[str, Any]:
    """The proxies of one successful output; `encoded_size` is its JSON size in bytes."""
    found: dict[str, Any] = {"size": encoded_size}
    if not output:
        return found
    scores = output.get("scores")
    if isinstance(scores, Mapping) and scores:
        found["top_p"] = round(max(float(p) for p in scores.values()), 6)
        found["label"] = str(output.get("label", ""))
    return found


def agreement(primary: Mapping[str, Any], shadow: Mapping[str, Any]) -> float | None:
    """How far a shadow output agrees with the primary's on the same input, in [0, 1].

    Embeddings: cosine similarity (clamped at 0). Classifiers: 1.0 when the labels match.
    Any other kind: 1.0 when the outputs are equal. None when two embeddings cannot be compared.
    """
    first, second = primary.get("embedding"), shadow.get("embedding")
    if isinstance(first, list) and isinstance(second, list):
        if len(first) != len(second) or not first:
            return None
        dot = sum(a * b for a, b in zip(first, second, strict=True))
        norms = math.sqrt(sum(a * a for a in first)) * math.sqrt(sum(b * b for b in second))
        return round(max(0.0, dot / norms), 6) if norms > 0 else None
    if "label" in primary and "label" in shadow:
        return 1.0 if primary["label"] == shadow["label"] else 0.0
    return 1.0 if primary == shadow else 0.0


def summarise_quality(samples: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Aggregate per-job proxies over a window; keys appear only when some job carried them."""
    sizes: list[float] = []
    tops: list[float] = []
    agreements: list[float] = []
    labels: Counter[str] = Counter()
    for proxy in samples:
        if "size" in proxy:
            sizes.append(float(proxy["size"]))
        if "top_p" in proxy:
            tops.append(float(proxy["top_p"]))
        if "label" in proxy:
            labels[str(proxy["label"])] += 1
        if "agreement" in proxy:
            agreements.append(float(proxy["agreement"]))
    summary: dict[str, Any] = {}
    if sizes:
        summary["output_size_mean"] = round(sum(sizes) / len(sizes), 3)
    if tops:
        summary["mean_top_p"] = round(sum(tops) / len(tops), 6)
        summary["low_confidence_rate"] = round(sum(1 for p in tops if p < LOW_CONFIDENCE_P) / len(tops), 6)
        summary["low_confidence_threshold"] = LOW_CONFIDENCE_P
    if labels:
        total = sum(labels.values())
        summary["label_counts"] = dict(sorted(labels.items()))
        summary["label_distribution"] = {label: round(n / total, 6) for label, n in sorted(labels.items())}
    if agreements:
        ordered = sorted(agreements)
        summary["mean_agreement"] = round(sum(ordered) / len(ordered), 6)
        summary["min_agreement"] = ordered[0]
        summary["agreement_n"] = len(ordered)
    return summary
