"""The registry's connection: one engine per process, sessions that translate driver errors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from sluice.errors import BadRequest, Conflict, RegistryError, RegistryUnavailable


def normalise_url(url: str) -> str:
    """Accept `postgresql://` and `postgres://` too; Sluice always speaks psycopg 3."""
    parsed = make_url(url.replace("postgres://", "postgresql://", 1))
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


class Registry:
    """Owns the engine; `session()` commits on success and maps driver errors to SluiceError."""

    def __init__(self, *, url: str, pool_size: int = 5, connect_timeout_s: float = 3.0) -> None:
        self.url = normalise_url(url)
        self.engine: Engine = create_engine(
            self.url,
            pool_size=pool_size,
            max_overflow=pool_size,
            pool_pre_ping=True,
            pool_recycle=1800,
            connect_args={"connect_timeout": max(1, int(connect_timeout_s))},
        )
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._disposed = False
        event.listen(self.engine, "checkin", self._close_if_disposed)

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
