"""A psycopg connection whose every wait on Postgres has a deadline.

Postgres' `statement_timeout` cancels a slow statement on a server that runs; it does nothing when
the server does not answer at all (stopped, SIGSTOPped, a network that drops packets without a
reset): the kernel still acknowledges what the client sends, so neither TCP keepalives nor
`tcp_user_timeout` notice, and psycopg would wait on the socket forever, holding a thread and a
pooled connection. Every wait of this connection on its socket (a statement, a fetch, a commit,
the pool's pre-ping) gives up after `round_trip_s`; the connection, whose place in the protocol is
then unknown, is closed, and `NoAnswer` raised, which the pool takes for a lost connection.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.abc import RV, PQGen

# psycopg's own default for how often a wait wakes to notice a signal (psycopg.connection).
WAKE_INTERVAL_S = 0.1


class NoAnswer(psycopg.OperationalError):
    """Postgres did not answer within the round-trip bound; the connection is closed."""


class BoundedConnection(psycopg.Connection[Any]):
    round_trip_s: float | None = None  # set on each connection once it is made

    def wait(self, gen: PQGen[RV], interval: float = WAKE_INTERVAL_S, timeout: float | None = None) -> RV:
        if timeout is not None or self.round_trip_s is None:
            return super().wait(gen, interval, timeout)  # a caller's own deadline (notifies) stays theirs
        try:
            return super().wait(gen, interval, self.round_trip_s)
        # psycopg's wait functions raise their private _WaitTimeout for the timeout argument.
        except psycopg.errors._WaitTimeout as exc:
            self.pgconn.finish()
            raise NoAnswer(f"Postgres did not answer within {self.round_trip_s:g} s") from exc
