"""A server that answers the connection handshake with something other than a map.

A restarting Valkey node has been seen to answer redis-py's HELLO that way; redis-py then raised
an AttributeError from inside the handshake, which escaped `translate_redis_errors`. Every way
Sluice builds a client must turn it into BrokerUnavailable, as for any moment without Redis.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
from collections.abc import Iterator

import pytest

from sluice.errors import BrokerUnavailable
from sluice.wire.connections import connect, connect_sync, translate_redis_errors


class _Node(socketserver.ThreadingTCPServer):
    """One node that owns every slot and answers the few commands a client's first steps send.
    Once `restarting`, it answers HELLO with an array instead of the map, and drops the
    connections it has."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Session)
        self.restarting = False
        self.sessions: list[socket.socket] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"

    def restart(self) -> None:
        self.restarting = True
        for session in self.sessions:
            with contextlib.suppress(OSError):  # a session the client closed itself
                session.shutdown(socket.SHUT_RDWR)

    def answer(self, command: list[bytes]) -> bytes:
        name = command[0].upper()
        if name == b"HELLO":
            return b"*1\r\n$2\r\nno\r\n" if self.restarting else b"%1\r\n$5\r\nproto\r\n:3\r\n"
        if name == b"CLUSTER":
            port = str(self.server_address[1]).encode()
            return b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:" + port + b"\r\n"
        if name == b"COMMAND":
            return b"*0\r\n"
        return b"+PONG\r\n" if name == b"PING" else b"+OK\r\n"


class _Session(socketserver.StreamRequestHandler):
    server: _Node

    def handle(self) -> None:
        self.server.sessions.append(self.request)
        while (header := self.rfile.readline()).startswith(b"*"):
            command = []
            for _ in range(int(header[1:])):
                length = int(self.rfile.readline()[1:])
                command.append(self.rfile.read(length + 2)[:-2])
            self.wfile.write(self.server.answer(command))


@pytest.fixture
def node() -> Iterator[_Node]:
    server = _Node()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


# A client that reconnects to the node, and one whose first connection meets the restart (not a
# cluster client: its first command learns the slots, which needs the node whole).
@pytest.mark.parametrize(("scheme", "reconnecting"), [("redis", True), ("redis", False), ("redis+cluster", True)])
async def test_the_async_client_reports_a_malformed_handshake_as_redis_unavailable(
        node: _Node, scheme: str, reconnecting: bool) -> None:
    client = connect(f"{scheme}://{node.address}/0", socket_timeout_s=2.0)
    try:
        if reconnecting:
            assert await client.ping()
        node.restart()
        with pytest.raises(BrokerUnavailable), translate_redis_errors():
            await client.ping()
    finally:
        await client.aclose()


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_the_sync_client_reports_a_malformed_handshake_as_redis_unavailable(node: _Node, scheme: str) -> None:
    client = connect_sync(f"{scheme}://{node.address}/0", socket_timeout_s=2.0)
    try:
        assert client.ping()
        node.restart()
        with pytest.raises(BrokerUnavailable), translate_redis_errors():
            client.ping()
    finally:
        client.close()
