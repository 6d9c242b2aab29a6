"""The shared words live in `sluice.vocabulary` and nowhere else: the registry's columns, the API's
fields and the simulators read them from there."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from api.routes.models import Batching, RegisterVersion
from sluice import vocabulary
from sluice.registry.tables import Batch, ModelVersion, Rollout
from sluice.routing import VersionInfo
from sluice.vocabulary import (
    CLOSE_REASONS,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_REPLICAS,
    DEFAULT_MAX_WAIT_MS,
    DEFAULT_MIN_REPLICAS,
    FINAL_BATCH_STATES,
    LANES,
    BatchState,
    ClaimVerdict,
    RolloutState,
)

REPO = Path(__file__).resolve().parents[2]


def test_each_enum_has_its_members() -> None:
    assert [s.value for s in BatchState] == ["queued", "running", "succeeded", "failed", "cancelled"]
    assert {"succeeded", "failed", "cancelled"} == FINAL_BATCH_STATES
    assert [s.value for s in RolloutState] == ["running", "promoted", "rolled_back", "aborted"]
    assert [v.value for v in ClaimVerdict] == ["run", "expired", "dead", "missing"]
    assert LANES == ("online", "bulk")
    assert CLOSE_REASONS == ("size", "age", "drain")


def test_the_defaults_are_what_a_version_gets_everywhere() -> None:
    assert (DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_WAIT_MS, DEFAULT_MIN_REPLICAS, DEFAULT_MAX_REPLICAS) == (32, 10.0, 1, 4)
    columns = ModelVersion.__table__.columns
    expected = {"max_batch_size": DEFAULT_MAX_BATCH_SIZE, "max_wait_ms": DEFAULT_MAX_WAIT_MS,
                "min_replicas": DEFAULT_MIN_REPLICAS, "max_replicas": DEFAULT_MAX_REPLICAS}
    for name, value in expected.items():
        default = columns[name].default
        assert default is not None and getattr(default, "arg", None) == value, name
        fields = RegisterVersion.model_fields if name.endswith("replicas") else Batching.model_fields
        assert fields[name].default == value, name
        assert VersionInfo.__dataclass_fields__[name].default == value, name
    assert Batch.__table__.columns["status"].default.arg == BatchState.queued  # type: ignore[union-attr]
    assert Rollout.__table__.columns["state"].default.arg == RolloutState.running  # type: ignore[union-attr]


def _batch_state_strings(path: Path) -> list[str]:
    """Batch-state strings spelled other than as a dict key or subscript: those name a field, like
    a batch's `failed` count."""
    tree = ast.parse(path.read_text())
    keys = {id(k) for node in ast.walk(tree) if isinstance(node, ast.Dict) for k in node.keys if k is not None}
    keys |= {id(node.slice) for node in ast.walk(tree) if isinstance(node, ast.Subscript)}
    states = {s.value for s in BatchState}
    return [f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in states and id(node) not in keys]


# The modules that handle batches; elsewhere the same words are job states (`JobStatus`).
BATCH_MODULES = ["sluice/registry/batches.py", "sluice/registry/tables.py",
                 "workers/batches.py", "workers/schedules.py", "api/routes/batches.py", "api/response_models.py",
                 "launch/batch_cli.py"]


@pytest.mark.parametrize("module", BATCH_MODULES)
def test_no_batch_module_spells_a_batch_state(module: str) -> None:
    assert not _batch_state_strings(REPO / module)


def test_no_module_spells_the_batch_states_as_a_set() -> None:
    states = {s.value for s in BatchState}
    found = []
    for package in ("sluice", "api", "workers", "launch", "scheduler"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path == Path(vocabulary.__file__):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Tuple | ast.List | ast.Set):
                    values = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                    if len(values & states) >= 3:
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found
