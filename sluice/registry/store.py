"""The registry's connection: one engine per process, sessions that translate driver errors.

A serving process's registry (`Registry.serving`) bounds every statement: Postgres cancels one past
`statement_timeout` or a lock wait past `lock_timeout`, and the client gives up on a Postgres that
does not answer at all one second later (sluice/registry/bounded.py); both surface as
`RegistryTimeout`. `sluice migrate` builds its own engine (migrations/env.py) and has no bound.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from sluice.errors import BadRequest, Conflict, RegistryError, RegistryTimeout, RegistryUnavailable
from sluice.registry.bounded import BoundedConnection, NoAnswer
from sluice.settings import Settings

# After Postgres' own statement timeout, which it answers with an error, the client waits this much
# more before it takes the silence for a server that does not answer.
NO_ANSWER_AFTER_S = 1.0
DEFAULT_POOL_TIMEOUT_S = 30.0  # SQLAlchemy's
# query_canceled (statement_timeout) and lock_not_available (lock_timeout).
CANCELLED_BY_TIMEOUT = frozenset({"57014", "55P03"})


def normalise_url(url: str) -> str:
    """Accept `postgresql://` and `postgres://` too; Sluice always speaks psycopg 3."""
    parsed = make_url(url.replace("postgres://", "postgresql://", 1))
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def _set_bounds(connection: Any, bounds: dict[str, float]) -> None:
    """Session settings, committed so that no rollback takes them back."""
    with connection.cursor() as cursor:
        for name, seconds in bounds.items():
            cursor.execute(f"SET {name} = {max(1, round(seconds * 1000))}")
    connection.commit()


class Registry:
    """Owns the engine; `session()` commits on success and maps driver errors to SluiceError."""

    def __init__(self, *, url: str, pool_size: int = 5, connect_timeout_s: float = 3.0,
                 statement_timeout_s: float | None = None, lock_timeout_s: float | None = None) -> None:
        self.url = normalise_url(url)
        self.round_trip_s = statement_timeout_s + NO_ANSWER_AFTER_S if statement_timeout_s is not None else None
        self.engine: Engine = create_engine(
            self.url,
            pool_size=pool_size,
            max_overflow=pool_size,
            pool_pre_ping=True,
            pool_recycle=1800,
            # A request waits for a pooled connection no longer than one bounded round trip.
            pool_timeout=self.round_trip_s or DEFAULT_POOL_TIMEOUT_S,
            connect_args={"connect_timeout": max(1, int(connect_timeout_s))},
        )
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._disposed = False
        event.listen(self.engine, "checkin", self._close_if_disposed)
        if statement_timeout_s is not None:
            event.listen(self.engine, "do_connect", self._connect_bounded)
            bounds = {"statement_timeout": statement_timeout_s, "lock_timeout": lock_timeout_s or statement_timeout_s}
            event.listen(self.engine, "connect", lambda connection, _record: _set_bounds(connection, bounds))

    @classmethod
    def serving(cls, settings: Settings, *, pool_size: int) -> Registry:
        """The registry of a process that serves (API, worker, scheduler, Celery), every statement bounded."""
        return cls(url=settings.require_database_url(), pool_size=pool_size,
                   connect_timeout_s=settings.registry_connect_timeout_s,
                   statement_timeout_s=settings.registry_statement_timeout_s,
                   lock_timeout_s=settings.registry_lock_timeout_s)

    def __repr__(self) -> str:
        return f"Registry({make_url(self.url).render_as_string(hide_password=True)})"

    @contextmanager
    def session(self) -> Iterator[Session]:
        session = self._sessions()
        try:
            yield session
            session.commit()
        except IntegrityError as exc:
            session.rollback()
            raise Conflict(f"the registry refused the change: {exc.orig}") from exc
        except DataError as exc:
            # A value Postgres cannot hold (a NUL in a name from a URL path, a number out of
            # range) is the caller's mistake, not an outage.
            session.rollback()
            raise BadRequest(f"the registry refused a value: {exc.orig}") from exc
        except OperationalError as exc:
            session.rollback()
            if isinstance(exc.orig, NoAnswer):
                raise RegistryTimeout(str(exc.orig)) from exc
            if getattr(exc.orig, "sqlstate", None) in CANCELLED_BY_TIMEOUT:
                raise RegistryTimeout(f"Postgres cancelled a registry statement: {exc.orig}") from exc
            raise RegistryUnavailable(f"Postgres is unreachable: {exc.orig}") from exc
        except DBAPIError as exc:
            session.rollback()
            if exc.connection_invalidated:
                raise RegistryUnavailable(f"Postgres connection lost: {exc.orig}") from exc
            raise RegistryError(f"registry query failed: {exc.orig}") from exc
        except SQLAlchemyError as exc:
            session.rollback()
            raise RegistryError(f"registry query failed: {exc}") from exc
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    def _connect_bounded(self, _dialect: Any, _record: Any, cargs: Any, cparams: Any) -> BoundedConnection:
        connection = BoundedConnection.connect(*cargs, **cparams)
        connection.round_trip_s = self.round_trip_s
        return connection

    def ping(self) -> None:
        with self.session() as session:
            session.execute(text("SELECT 1"))

    def dispose(self) -> None:
        self._disposed = True
        self.engine.dispose()

    def _close_if_disposed(self, dbapi_connection: Any, _record: Any) -> None:
        # A query still running in a thread when the registry is disposed (a routing refresh at an
        # API's shutdown) checks its connection into the pool that dispose() replaced and nobody
        # closes: close it here rather than leave it to the garbage collector.
        if self._disposed and dbapi_connection is not None:
            dbapi_connection.close()
