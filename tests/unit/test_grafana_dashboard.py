"""The Grafana dashboard asks only for series the code exports, by labels those series carry, and
never sums versions together. A renamed metric or label otherwise leaves an empty panel, which
nothing else would notice; a `sum by (model)` over a per-version series hides one version's
regression behind another's traffic.

The PromQL reader below is a tokenizer, not a parser: enough to tell metric names from functions,
keywords, label names, strings and ranges, and to find what each aggregation sums over."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

from sluice import metrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "docker" / "grafana" / "dashboards" / "sluice.json"
PROVISIONING = REPO / "docker" / "grafana" / "provisioning"
COMPOSE = REPO / "compose.yaml"

# The series names each family type puts on the wire (prometheus_client also exposes `_created`).
# Every type the client has, not only sluice.metrics' three: other modules in the same test run
# may register theirs in the default registry.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}
# Added by Prometheus at scrape time, not by the code: `process` comes from the file-SD groups
# `sluice up` writes and from docker/prometheus.yml's relabelling.
TARGET_LABELS = frozenset({"job", "instance", "process"})
AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                          "bottomk", "topk", "quantile", "limitk", "limit_ratio"})
# Identifiers that are never a metric name when no `(` follows them.
KEYWORDS = AGGREGATIONS | {"and", "or", "unless", "atan2", "bool", "offset", "inf", "nan"}
GROUPING = frozenset({"by", "without"})
MATCHING = frozenset({"on", "ignoring", "group_left", "group_right"})

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<variable>\$\{?\w+\}?)
  | (?P<number>\.?\d[\w.]*)
  | (?P<ident>[A-Za-z_:][\w:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}@])
""", re.VERBOSE)
_QUANTILE = re.compile(r"histogram_quantile\(\s*([\d.]+)\s*,")
_LABEL_VALUES = re.compile(r"\s*label_values\((?P<expr>.+),\s*(?P<label>\w+)\s*\)\s*")


@dataclass(frozen=True)
class Selector:
    name: str
    position: int
    matchers: tuple[str, ...]


@dataclass(frozen=True)
class Aggregation:
    op: str
    mode: str
    labels: tuple[str, ...]
    body: tuple[int, int]


@dataclass
class Query:
    selectors: list[Selector] = field(default_factory=list)
    aggregations: list[Aggregation] = field(default_factory=list)
    matching: list[str] = field(default_factory=list)

    def names(self) -> set[str]:
        return {selector.name for selector in self.selectors}

    def summed(self, aggregation: Aggregation) -> set[str]:
        start, end = aggregation.body
        return {selector.name for selector in self.selectors if start < selector.position < end}


def _tokens(expr: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    position = 0
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        if match is None:
            raise ValueError(f"cannot read {expr[position:]!r} in {expr!r}")
        assert match.lastgroup is not None
        if match.lastgroup != "space":
            found.append((match.lastgroup, match.group()))
        position = match.end()
    return found


def _closing(toks: list[tuple[str, str]], opening: int) -> int:
    assert toks[opening][1] == "(", f"expected ( at token {opening}: {toks}"
    depth = 0
    for index in range(opening, len(toks)):
        depth += {"(": 1, ")": -1}.get(toks[index][1], 0)
        if depth == 0:
            return index
    raise ValueError(f"unbalanced parentheses: {toks}")


def _label_list(toks: list[tuple[str, str]], index: int) -> tuple[tuple[str, ...], int]:
    """The labels of `(a, b)` at index (none when no list follows, as after a bare group_left)."""
    if index >= len(toks) or toks[index][1] != "(":
        return (), index
    end = _closing(toks, index)
    return tuple(text for kind, text in toks[index + 1:end] if kind == "ident"), end + 1


def parse(expr: str) -> Query:
    toks = _tokens(expr)
    query = Query()
    index = 0
    while index < len(toks):
        kind, text = toks[index]
        following = toks[index + 1][1] if index + 1 < len(toks) else ""
        if kind == "op" and text == "{":
            raise ValueError(f"a selector without a metric name is not checked: {expr}")
        if kind != "ident":
            index += 1
        elif text in AGGREGATIONS and following in GROUPING | {"("}:
            query.aggregations.append(_aggregation(toks, index))
            index += 1
        elif text in GROUPING:
            index = _label_list(toks, index + 1)[1]
        elif text in MATCHING:
            labels, index = _label_list(toks, index + 1)
            query.matching.extend(labels)
        elif following == "(" or text in KEYWORDS:
            index += 1
        else:
            matchers: tuple[str, ...] = ()
            end = index + 1
            if following == "{":
                end = next(i for i in range(index + 1, len(toks)) if toks[i][1] == "}") + 1
                matchers = tuple(t for k, t in toks[index + 2:end - 1] if k == "ident")
            query.selectors.append(Selector(text, index, matchers))
            index = end
    return query


def _aggregation(toks: list[tuple[str, str]], index: int) -> Aggregation:
    """`op by (labels) (body)` or `op (body) by (labels)`; no clause keeps no label at all."""
    op, mode, labels, opening = toks[index][1], "by", (), index + 1
    if toks[opening][1] in GROUPING:
        mode = toks[opening][1]
        labels, opening = _label_list(toks, opening + 1)
    end = _closing(toks, opening)
    if end + 1 < len(toks) and toks[end + 1][1] in GROUPING:
        mode = toks[end + 1][1]
        labels = _label_list(toks, end + 2)[0]
    return Aggregation(op, mode, labels, (opening, end))


@pytest.fixture(scope="module")
def catalog() -> dict[str, frozenset[str]]:
    """Every series name this code base exposes, with the labels a scraped series of it carries."""
    # prometheus_client has no public accessor for a parent metric's label names.
    labelnames = {m._name: frozenset(m._labelnames) for m in vars(metrics).values()
                  if isinstance(m, MetricWrapperBase)}
    exported: dict[str, frozenset[str]] = {}
    for family in REGISTRY.collect():
        for suffix in SUFFIXES[family.type]:
            bucket = {"le"} if suffix == "_bucket" else set()
            exported[family.name + suffix] = labelnames.get(family.name, frozenset()) | bucket | TARGET_LABELS
    return exported


def problems(expr: str, catalog: dict[str, frozenset[str]]) -> list[str]:
    query = parse(expr)
    found = [f"{s.name} is not a series the code exports" for s in query.selectors if s.name not in catalog]
    known = query.names() & catalog.keys()
    found += [f"{s.name} has no label {label!r}" for s in query.selectors if s.name in known
              for label in s.matchers if label not in catalog[s.name]]
    for aggregation in query.aggregations:
        summed = query.summed(aggregation) & known
        found += [f"{aggregation.op} {aggregation.mode} {label!r}: {name} has no such label"
                  for name in sorted(summed) for label in aggregation.labels if label not in catalog[name]]
        kept = set(aggregation.labels) if aggregation.mode == "by" else {"model", "version"} - set(aggregation.labels)
        if summed and all("version" in catalog[name] for name in summed) and not {"model", "version"} <= kept:
            found.append(f"{aggregation.op} {aggregation.mode} {aggregation.labels} blends versions of "
                         f"{sorted(summed)}")
    found += [f"on/ignoring/group {label!r}: no series here has it" for label in query.matching
              if not any(label in catalog[name] for name in known)]
    return found


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Panels at any depth: a collapsed row holds its panels inside it."""
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield panel, target


def _variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {variable["name"]: variable for variable in dashboard["templating"]["list"]}


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Host path (resolved) to container path, for the bind mounts of a service."""
    mounts = {}
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[str((REPO / source).resolve())] = target
    return mounts


def test_every_query_names_exported_series_and_their_labels(dashboard, catalog):
    found = [f"{panel['title']}: {problem}" for panel, target in _targets(dashboard)
             for problem in problems(target["expr"], catalog)]
    assert not found, "\n".join(found)


def test_variables_read_exported_series_and_labels(dashboard, catalog):
    variables = _variables(dashboard)
    assert {"model", "version"} <= variables.keys()
    for name, variable in variables.items():
        match = _LABEL_VALUES.fullmatch(variable["query"])
        assert match, f"${name}: expected label_values(metric, label), got {variable['query']!r}"
        assert not problems(match["expr"], catalog), (name, problems(match["expr"], catalog))
        series = parse(match["expr"]).names()
        assert series and all(match["label"] in catalog[s] for s in series), (name, match["label"], series)


def test_a_legend_names_the_version_of_every_per_version_series(dashboard, catalog):
    for panel, target in _targets(dashboard):
        if "legendFormat" in target and any("version" in catalog.get(s, ()) for s in parse(target["expr"]).names()):
            assert {"{{model}}", "{{version}}"} <= set(re.findall(r"\{\{\w+\}\}", target["legendFormat"])), (
                panel["title"], target["legendFormat"])


def test_queue_wait_and_model_time_percentiles_sit_side_by_side(dashboard):
    def percentiles_of(histogram: str) -> dict[str, Any]:
        for panel in _panels(dashboard["panels"]):
            quantiles = {float(q) for target in panel.get("targets", []) if histogram in parse(target["expr"]).names()
                         for q in _QUANTILE.findall(target["expr"])}
            if {0.5, 0.95, 0.99} <= quantiles:
                return panel
        raise AssertionError(f"no panel shows p50, p95 and p99 of {histogram}")

    queue_wait = percentiles_of("sluice_queue_wait_seconds_bucket")
    model_time = percentiles_of("sluice_model_seconds_bucket")
    assert queue_wait["gridPos"]["y"] == model_time["gridPos"]["y"]
    assert queue_wait["gridPos"]["x"] != model_time["gridPos"]["x"]


def test_every_panel_uses_the_provisioned_datasource(dashboard):
    provisioned = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [(d["uid"], d["url"]) for d in provisioned] == [("prometheus", "http://prometheus:9090")]
    for panel in _panels(dashboard["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "prometheus", panel["title"]
            assert all(t["datasource"]["uid"] == "prometheus" for t in panel["targets"]), panel["title"]


def test_compose_mounts_the_provisioning_where_grafana_reads_it():
    mounts = _mounts(yaml.safe_load(COMPOSE.read_text())["services"]["grafana"])
    assert mounts[str(PROVISIONING)] == "/etc/grafana/provisioning"
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "sluice.yml").read_text())["providers"]
    assert [p["options"]["path"] for p in providers] == [mounts[str(DASHBOARD.parent)]]


def test_compose_grafana_has_no_default_password_and_listens_on_loopback_only():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    environment = services["grafana"]["environment"]
    assert environment["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    assert environment["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    for name in ("grafana", "prometheus"):
        assert all(port.startswith("127.0.0.1:") for port in services[name]["ports"]), name


@pytest.mark.parametrize(("expr", "flagged"), [
    ('sum by (model, version) (rate(sluice_not_a_metric_total{model="m"}[5m]))', "sluice_not_a_metric_total"),
    ("histogram_quantile(0.99, sum by (le, model, version) (rate(sluice_queue_wait_seconds[5m])))",
     "sluice_queue_wait_seconds is not"),
    ('sum by (model, version) (rate(sluice_jobs_finished_total{tenant="t"}[5m]))', "'tenant'"),
    ("sum by (model, version, lane) (rate(sluice_jobs_finished_total[5m]))", "'lane'"),
    ("sum by (model) (rate(sluice_jobs_finished_total[5m]))", "blends versions"),
    ("sum(rate(sluice_model_seconds_count[5m]))", "blends versions"),
    ("max without (version) (sluice_stream_lag)", "blends versions"),
])
def test_the_check_flags_what_would_leave_a_panel_empty_or_blended(expr, flagged, catalog):
    assert any(flagged in problem for problem in problems(expr, catalog)), problems(expr, catalog)


def test_the_reader_tells_metrics_from_functions_labels_strings_and_ranges():
    query = parse('histogram_quantile(0.99, sum by (le, model) (rate(sluice_model_seconds_bucket'
                  '{model=~"$model", lane!="bulk"}[$__rate_interval] offset 5m))) > bool 0.5 '
                  'or on (model) group_left vector(0)')
    assert [(s.name, s.matchers) for s in query.selectors] == [("sluice_model_seconds_bucket", ("model", "lane"))]
    assert [(a.op, a.mode, a.labels) for a in query.aggregations] == [("sum", "by", ("le", "model"))]
    assert query.summed(query.aggregations[0]) == {"sluice_model_seconds_bucket"}
    assert query.matching == ["model"]
