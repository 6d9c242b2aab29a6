"""The migrations and the ORM describe the same schema: a migrated database differs from
`sluice.registry.tables` in nothing Alembic can compare (columns, types, defaults, constraints)."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from sluice.registry.tables import Base
from tests.support import normalise_url


def test_the_migrated_schema_is_the_orm_s(database_url: str) -> None:
    engine = create_engine(normalise_url(database_url))
    try:
        with engine.connect() as conn:
            differences = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()
    assert differences == []
