"""The serving processes' registry bounds every statement (real Postgres): one past the statement
timeout, or a lock wait past the lock timeout, is cancelled by Postgres and surfaces as a
SluiceError translated at the boundary (503 `registry_unavailable` over REST), the connection
going back to the pool usable. A registry built without bounds (what `sluice migrate` and the
seed use, whose statements may rightly run long) has none. A Postgres that stops answering
altogether is tests/faults/test_postgres_hang.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from sluice.errors import RegistryTimeout, SluiceError
from sluice.registry.store import Registry
from tests.support import make_settings


@pytest.fixture
def bounded(database_url: str, redis_url: str, tmp_path: Path) -> Iterator[Registry]:
    settings = make_settings(redis_url=redis_url, database_url=database_url, home=tmp_path,
                             registry_statement_timeout_s=0.5, registry_lock_timeout_s=0.3)
    registry = Registry.serving(settings, pool_size=1)
    yield registry
    registry.dispose()


def test_a_statement_past_the_timeout_is_cancelled_as_a_sluice_error(bounded: Registry) -> None:
    started = time.monotonic()
    with pytest.raises(RegistryTimeout, match="timeout") as raised, bounded.session() as session:
        session.execute(text("SELECT pg_sleep(10)"))
    assert time.monotonic() - started < 3.0
    assert isinstance(raised.value, SluiceError)
    with bounded.session() as session:  # the one pooled connection is still good
        assert session.execute(text("SELECT 1")).scalar_one() == 1


def test_a_lock_wait_past_the_lock_timeout_is_cancelled_as_a_sluice_error(
        bounded: Registry, registry: Registry) -> None:
    table = f"bounds_{threading.get_ident()}"
    with registry.session() as session:
        session.execute(text(f"CREATE TABLE IF NOT EXISTS {table} (id int PRIMARY KEY)"))
        session.execute(text(f"INSERT INTO {table} VALUES (1) ON CONFLICT DO NOTHING"))
    try:
        with registry.session() as holder:
            holder.execute(text(f"SELECT * FROM {table} WHERE id = 1 FOR UPDATE"))
            started = time.monotonic()
            with pytest.raises(RegistryTimeout, match="lock"), bounded.session() as session:
                session.execute(text(f"UPDATE {table} SET id = 1 WHERE id = 1"))
            assert time.monotonic() - started < 2.0
    finally:
        with registry.session() as session:
            session.execute(text(f"DROP TABLE {table}"))


def test_the_bounds_are_the_serving_registrys_only(bounded: Registry, database_url: str) -> None:
    with bounded.session() as session:
        assert session.execute(text("SHOW statement_timeout")).scalar_one() == "500ms"
        assert session.execute(text("SHOW lock_timeout")).scalar_one() == "300ms"
    plain = Registry(url=database_url, pool_size=1)
    try:
        with plain.session() as session:
            assert session.execute(text("SHOW statement_timeout")).scalar_one() == "0"
            session.execute(text("SELECT pg_sleep(0.7)"))  # longer than the serving bound, not cancelled
    finally:
        plain.dispose()
