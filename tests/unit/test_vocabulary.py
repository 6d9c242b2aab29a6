"""Kinds and version states are defined once in the kernel; the worker's loaders, the registry's
check constraints and the API's request fields are derived from them and must not drift."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError
from sqlalchemy import CheckConstraint, Table

from api.routes.models import CreateModel, RegisterVersion, UpdateVersion
from sluice.kinds import ModelKind
from sluice.registry.tables import Model, ModelVersion
from sluice.versions import PRIMARY_STATES, SERVING_STATES, VersionState
from workers.models.loading import LOADERS


def _check(table: Table, name: str) -> str:
    found = [c for c in table.constraints if isinstance(c, CheckConstraint) and c.name == name]
    assert len(found) == 1, name
    return str(found[0].sqltext)


def test_every_kind_has_a_loader() -> None:
    assert set(LOADERS) == set(ModelKind)


def test_the_kind_constraint_is_the_one_migration_0005_wrote() -> None:
    assert _check(Model.__table__, "model_kind") == ("kind IN ('embedding', 'classifier', 'synthetic', 'hf-embedding', "
                                                     "'hf-classifier', 'torch-export', 'handler')")


def test_the_api_accepts_exactly_the_kinds() -> None:
    assert typing.get_args(CreateModel.model_fields["kind"].annotation) == tuple(ModelKind)


def test_the_state_constraint_is_the_one_the_first_migration_wrote() -> None:
    assert (_check(ModelVersion.__table__, "version_state")
            == "state IN ('staged', 'shadow', 'canary', 'stable', 'retired')")


def test_the_derived_state_sets() -> None:
    assert VersionState.retired not in SERVING_STATES
    assert set(SERVING_STATES - PRIMARY_STATES) == {VersionState.shadow}
    assert "stable" in PRIMARY_STATES  # the registry hands the router plain strings


def test_a_version_may_be_patched_into_any_state_but_registered_only_to_serve() -> None:
    states = typing.get_args(typing.get_args(UpdateVersion.model_fields["state"].annotation)[0])
    assert states == tuple(VersionState)
    assert typing.get_args(RegisterVersion.model_fields["state"].annotation) == tuple(
        s for s in VersionState if s in SERVING_STATES)
    body = {"version": "v1", "artifact": "synthetic:", "sha256": "0" * 64}
    assert RegisterVersion.model_validate(body).state == "staged"
    with pytest.raises(ValidationError):
        RegisterVersion.model_validate({**body, "state": "retired"})
