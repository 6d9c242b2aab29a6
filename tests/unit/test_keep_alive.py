"""The shipped client lets an idle connection go before the API would close it: a request sent on
a connection as the server closes it fails with httpx.ReadError (one of 1,560 requests at 130
jobs/s in `bench.slo_throughput`, where httpx's default expiry equalled the server's 5 s)."""

from __future__ import annotations

import httpx

from api.server import KEEP_ALIVE_S
from sluice_client import client


def test_the_client_expires_idle_connections_a_second_or_more_before_the_server_closes_them() -> None:
    assert client.KEEPALIVE_EXPIRY_S <= KEEP_ALIVE_S - 1


def test_both_clients_open_their_connections_with_that_expiry() -> None:
    made: list[httpx.Limits] = []
    original = httpx.Limits.__init__

    def recording(self: httpx.Limits, **kwargs: float | int | None) -> None:
        original(self, **kwargs)  # type: ignore[arg-type]
        made.append(self)

    httpx.Limits.__init__ = recording  # type: ignore[method-assign]
    try:
        client.SluiceClient(base_url="http://127.0.0.1:9", api_key="k").close()
        client.AsyncClient(base_url="http://127.0.0.1:9", api_key="k", max_connections=20)
    finally:
        httpx.Limits.__init__ = original  # type: ignore[method-assign]
    assert len(made) >= 4 and {limits.keepalive_expiry for limits in made} == {client.KEEPALIVE_EXPIRY_S}
