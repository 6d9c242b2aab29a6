"""An httpx transport whose requests can carry a deadline for the whole exchange.

httpx's timeouts are per network operation: a receiver that sends one byte of its status line
every few seconds never trips a read timeout, however long the answer takes. Under `deadline(t)`
(a monotonic time) every connect, TLS handshake, write and read of a request made in this thread
gets at most the time left before `t`, and none starts after it: the exchange raises httpx's
`ConnectTimeout`, `WriteTimeout` or `ReadTimeout` by then whatever the receiver does.

The deadline travels in a context variable, read when the connection is opened: the transport is
meant for clients without keep-alive, whose every request opens its own connection in the thread
that sends it.
"""

from __future__ import annotations

import ssl
import time
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import httpcore
import httpx

_DEADLINE: ContextVar[float | None] = ContextVar("sluice_http_deadline", default=None)
PASSED = "the attempt's deadline passed"


@contextmanager
def deadline(at: float) -> Iterator[None]:
    """Requests made in this block end by `at` (`time.monotonic()`), with a timeout error if need be."""
    token = _DEADLINE.set(at)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _left(at: float | None, timeout: float | None, error: type[Exception]) -> float | None:
    """The timeout for the next operation: the operation's own, cut to what is left before `at`."""
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        raise error(PASSED)
    return left if timeout is None else min(timeout, left)


@contextmanager
def _saying_why(at: float | None, error: type[Exception]) -> Iterator[None]:
    """An operation cut short by the deadline says so (an operator reads it in `last_error`)."""
    try:
        yield
    except error:
        if at is not None and time.monotonic() >= at:
            raise error(PASSED) from None
        raise


class _Stream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream, at: float | None) -> None:
        self._inner = inner
        self._at = at

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        with _saying_why(self._at, httpcore.ReadTimeout):
            return self._inner.read(max_bytes, _left(self._at, timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        with _saying_why(self._at, httpcore.WriteTimeout):
            self._inner.write(buffer, _left(self._at, timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        with _saying_why(self._at, httpcore.ConnectTimeout):
            inner = self._inner.start_tls(ssl_context, server_hostname,
                                          _left(self._at, timeout, httpcore.ConnectTimeout))
        return _Stream(inner, self._at)

    def get_extra_info(self, info: str) -> typing.Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.NetworkStream:
        at = _DEADLINE.get()
        with _saying_why(at, httpcore.ConnectTimeout):
            stream = self._inner.connect_tcp(host, port, _left(at, timeout, httpcore.ConnectTimeout), local_address,
                                             socket_options)
        return _Stream(stream, at)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
                            ) -> httpcore.NetworkStream:
        at = _DEADLINE.get()
        with _saying_why(at, httpcore.ConnectTimeout):
            stream = self._inner.connect_unix_socket(path, _left(at, timeout, httpcore.ConnectTimeout), socket_options)
        return _Stream(stream, at)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class DeadlineTransport(httpx.HTTPTransport):
    """`httpx.HTTPTransport` (no proxy) over a network backend that honours `deadline()`."""

    def __init__(self, *, limits: httpx.Limits, verify: ssl.SSLContext | bool = True) -> None:
        super().__init__(verify=verify, limits=limits, trust_env=False)
        # The pool httpx built, rebuilt the same way with the one difference: its network backend.
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify, trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_Backend(),
        )
