"""Routes share through `api.schemas` and `api.deps`, never through each other: a route module
that imports another drags its router and its request models along."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROUTES = Path(__file__).resolve().parents[2] / "api" / "routes"


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", sorted(ROUTES.glob("*.py")), ids=lambda p: p.name)
def test_a_route_module_imports_no_other_route_module(path: Path) -> None:
    assert not {name for name in _imported(path) if name.startswith("api.routes")}
