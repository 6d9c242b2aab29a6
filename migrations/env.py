"""Alembic environment: the URL comes from the caller (`sluice migrate`), never from a file."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from sluice.registry.tables import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    assert url, "sqlalchemy.url must be set by the caller"
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            # Two processes migrating at once (compose restarts, parallel tests) must not race.
            connection.exec_driver_sql("SELECT pg_advisory_xact_lock(7212001)")
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
