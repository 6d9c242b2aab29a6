"""`/readyz` tells anyone which dependency is unavailable, and only an admin why: the driver's
message names hosts, ports and accounts, and the probe answers anonymous callers."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from launch.seed import Seeded
from tests.support import ApiServer, http_client, make_settings


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def redis_port() -> int:
    return closed_port()


@pytest.fixture
def no_redis_api(database_url: str, tmp_path: Path, redis_port: int, seeded: Seeded) -> Iterator[ApiServer]:
    """The API over the session's registry and a Redis URL on which nothing listens."""
    settings = make_settings(redis_url=f"redis://127.0.0.1:{redis_port}/0", database_url=database_url, home=tmp_path)
    server = ApiServer(app=create_app(settings=settings))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def readyz(api: ApiServer, key: str | None) -> httpx.Response:
    with http_client(api.url, key, timeout_s=15) as client:
        return client.get("/readyz")


@pytest.mark.parametrize("who", ["anonymous", "tenant", "unknown key"])
def test_a_non_admin_caller_sees_which_dependency_is_unavailable_but_not_why(
    no_redis_api: ApiServer, seeded: Seeded, redis_port: int, who: str
) -> None:
    key = {"anonymous": None, "tenant": seeded.demo_key, "unknown key": "sk_not_a_key_0123456789abcdef"}[who]
    response = readyz(no_redis_api, key)
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["status"] == "unready"
    assert body["checks"]["redis"] == "unavailable" and body["checks"]["postgres"] == "ok", body
    assert "detail" not in body, body
    for leak in (str(redis_port), "127.0.0.1", "Error", "refused", "connect"):
        assert leak not in response.text, f"{leak!r} in {response.text}"


def test_an_admin_also_sees_the_drivers_message(no_redis_api: ApiServer, seeded: Seeded, redis_port: int) -> None:
    response = readyz(no_redis_api, seeded.admin_key)
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["checks"]["redis"] == "unavailable"
    assert set(body["detail"]) == {"redis"}, body
    assert str(redis_port) in body["detail"]["redis"], body


def test_a_ready_api_shows_no_detail_even_to_an_admin(api: ApiServer, admin: httpx.Client) -> None:
    body = admin.get("/readyz").json()
    assert body["status"] == "ok" and "detail" not in body, body
