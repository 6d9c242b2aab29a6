"""Dependencies point down: the composition root (`launch`) uses the parts (`api`, `workers`,
`scheduler`), the parts use the kernel (`sluice`), and nothing imports upward or sideways. Routes
share through `api.field_types` and `api.deps`, never through each other: a route module that imports
another drags its router and its request models along. Imports inside functions count too.

The Python client (`clients/python/sluice_client`, the `sluice-client` distribution) stands
apart: it imports nothing of the server, and the server nothing of it, so a web app that installs
it gets httpx and nothing else."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROUTES = REPO / "api" / "routes"
# What each package may not import (a prefix match on the dotted name).
# `launch` may import every part; only tests (and benchmarks, which drive it as a user does) import
# it. No product package imports `bench`: a shipped command must run without the benchmark folder.
FORBIDDEN = {
    "sluice": ("api", "workers", "scheduler", "launch", "bench", "torch", "fastapi", "celery"),
    "api": ("workers", "scheduler", "launch", "bench", "torch"),
    "workers": ("api", "scheduler", "launch", "bench"),
    "scheduler": ("api", "workers", "launch", "bench", "torch"),
    "launch": ("bench",),
    "migrations": ("api", "workers", "scheduler", "launch", "bench"),
}


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


def _modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _reaches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_above_or_beside_it(package: str) -> None:
    found = {
        f"{path.relative_to(REPO)}: {name}"
        for path in _modules(package)
        for name in _imported(path)
        if any(_reaches(name, prefix) for prefix in FORBIDDEN[package])
    }
    assert not found


CLIENT = REPO / "clients" / "python" / "sluice_client"
SERVER_PACKAGES = ("sluice", "api", "workers", "scheduler", "launch", "bench")
# The benchmarks measure the client itself (`bench/peer_client.py`, `bench/wait_many.py`): they
# are its users, run from the dev install, not a part of the server that would need it.
CLIENT_USERS = ("bench",)


def _client_modules() -> list[Path]:
    return sorted(CLIENT.rglob("*.py"))


def test_the_client_imports_nothing_of_the_server() -> None:
    assert _client_modules()
    found = {
        f"{path.relative_to(REPO)}: {name}"
        for path in _client_modules()
        for name in _imported(path)
        if any(_reaches(name, prefix) for prefix in SERVER_PACKAGES)
    }
    assert not found


def test_the_client_needs_httpx_and_the_standard_library_alone() -> None:
    found = {
        f"{path.relative_to(REPO)}: {name}"
        for path in _client_modules()
        for name in _imported(path)
        if name.split(".")[0] not in {*sys.stdlib_module_names, "httpx", "sluice_client", "__future__"}
    }
    assert not found


@pytest.mark.parametrize("package", [p for p in SERVER_PACKAGES if p not in CLIENT_USERS])
def test_the_server_imports_nothing_of_the_client(package: str) -> None:
    found = {
        f"{path.relative_to(REPO)}: {name}"
        for path in _modules(package)
        for name in _imported(path)
        if _reaches(name, "sluice_client")
    }
    assert not found


def test_the_image_copies_every_package_the_project_installs() -> None:
    # A package missing from the image breaks the `sluice` entry point only inside the container.
    with (REPO / "pyproject.toml").open("rb") as f:
        packages = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    dockerfile = (REPO / "docker" / "Dockerfile").read_text().splitlines()
    missing = [p.rstrip("*") for p in packages if f"COPY {p.rstrip('*')} ./{p.rstrip('*')}" not in dockerfile]
    assert not missing
