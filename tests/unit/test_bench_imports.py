"""Every benchmark module still imports: bench/ is no installed package and no product code
imports it, so a module or name it relies on that moves away would otherwise go unnoticed until
someone runs that benchmark."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.stem)
def test_the_bench_module_imports(path: Path) -> None:
    importlib.import_module(f"bench.{path.stem}")
