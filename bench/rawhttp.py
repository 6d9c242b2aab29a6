"""An HTTP/1.1 load generator that costs the machine as little as possible.

Measuring what a server spends per request needs a client cheap enough not to be the bottleneck on
a 2-core machine it shares with that server: httpx spends about a millisecond of CPU per request,
more than the API it would be measuring. This one sends requests prepared in advance as bytes,
over `concurrency` kept-alive connections, each sending its next request when the previous
answer is in (closed loop), or paced: request i is sent no earlier than i intervals after the
start. It understands exactly what the API sends back: a status line, headers with a
`content-length`, and the body. It runs in a process of its own (`drive`), so that its CPU is
never counted as the server's.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def request(method: str, path: str, *, key: str, body: bytes | None = None) -> bytes:
    """One request as it goes on the wire (JSON body if any, bearer key)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {key}"]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


@dataclass(slots=True)
class Driven:
    """What one run of `drive` saw: answers by status, the bodies if asked, each request's round
    trip (s, in request order), its own time and CPU."""

    statuses: Counter[int] = field(default_factory=Counter)
    bodies: list[bytes] = field(default_factory=list)
    round_trips_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    client_cpu_s: float = 0.0


def _content_length(head: bytes) -> int:
    lowered = head.lower()
    at = lowered.find(b"\r\ncontent-length:")
    if at < 0:
        raise RuntimeError(f"an answer without content-length: {head[:200]!r}")
    end = lowered.index(b"\r\n", at + 2)
    return int(lowered[at + 17 : end])


async def drive_async(
    port: int,
    requests: Sequence[bytes],
    concurrency: int,
    *,
    keep_bodies: bool = False,
    on_send: Callable[[int], None] | None = None,
    interval_s: float = 0.0,
) -> Driven:
    """`drive` on the running loop; `on_send(index)` is called as each request goes out."""
    driven = Driven(bodies=[b""] * len(requests) if keep_bodies else [], round_trips_s=[0.0] * len(requests))
    # One iterator shared by every connection: each takes the next request when it is free.
    pending = iter(range(len(requests)))

    async def connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for index in pending:
                if interval_s:
                    await asyncio.sleep(started + index * interval_s - time.perf_counter())
                sent = time.perf_counter()
                writer.write(requests[index])
                if on_send is not None:
                    on_send(index)
                head = await reader.readuntil(b"\r\n\r\n")
                body = await reader.readexactly(_content_length(head))
                driven.round_trips_s[index] = time.perf_counter() - sent
                driven.statuses[int(head[9:12])] += 1
                if keep_bodies:
                    driven.bodies[index] = body
        finally:
            writer.close()
            await writer.wait_closed()

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(connection() for _ in range(max(1, min(concurrency, len(requests))))))
    driven.wall_s = time.perf_counter() - started
    driven.client_cpu_s = time.process_time() - cpu
    return driven


def drive(
    port: int, requests: Sequence[bytes], concurrency: int, keep_bodies: bool = False, interval_s: float = 0.0
) -> Driven:
    """Send every request once to 127.0.0.1:`port`, `concurrency` at a time (and, with `interval_s`,
    request i no earlier than i intervals after the start); answer what came back."""
    return asyncio.run(drive_async(port, requests, concurrency, keep_bodies=keep_bodies, interval_s=interval_s))
