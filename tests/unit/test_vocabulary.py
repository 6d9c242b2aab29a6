"""Kinds and version states are defined once in the kernel; the worker's loaders, the registry's
check constraints and the API's request fields are derived from them and must not drift."""

from __future__ import annotations

import typing

from sqlalchemy import CheckConstraint, Table

from api.routes.models import CreateModel
from sluice.kinds import ModelKind
from sluice.registry.tables import Model
from workers.models.handlers import LOADERS


def _check(table: Table, name: str) -> str:
    found = [c for c in table.constraints if isinstance(c, CheckConstraint) and c.name == name]
    assert len(found) == 1, name
    return str(found[0].sqltext)


def test_every_kind_has_a_loader() -> None:
    assert set(LOADERS) == set(ModelKind)


def test_the_kind_constraint_is_the_one_the_first_migration_wrote() -> None:
    assert _check(Model.__table__, "model_kind") == "kind IN ('embedding', 'classifier', 'synthetic')"


def test_the_api_accepts_exactly_the_kinds() -> None:
    assert typing.get_args(CreateModel.model_fields["kind"].annotation) == tuple(ModelKind)
