"""Python clients for the REST API (httpx): `SluiceClient` (sync) and `AsyncClient`.

Both answer plain dicts (the API's resources) and raise a `ClientError` for every error answer,
decoded by one function into its kind (`InvalidRequest`, `AuthError`, `NotFoundError`,
`ConflictError`, `RateLimited`, `Unavailable`), with the API's code, message and details. A 429 or
503 is retried `retries` times, after its `Retry-After` (or a doubling backoff), capped at
`max_retry_wait_s`: such an answer queued nothing, so sending again cannot make a second job.
A client waiting for a job holds one long-poll at a time and re-issues it until the job is
final; waiting on many jobs (`wait_many`, `as_completed`) holds one long-poll for all of them
(`GET /v1/jobs?ids=`), re-issued with the ids still pending. A webhook receiver checks the
`Sluice-Signature` with `sluice_client.verify`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from sluice_client.admin import AdminCalls, AsyncAdminCalls
from sluice_client.batches import AsyncBatchCalls, BatchCalls
from sluice_client.jobs import FINAL, MAX_WAIT_IDS
from sluice_client.webhooks import retry_after_s

# The longest single long-poll a client asks for; the API may cap it lower (`max_wait_s`).
POLL_S = 20.0
# Connections per httpx pool of the AsyncClient (`_Pools`).
POOL_CONNECTIONS = 8
# A connection idle this long is closed here rather than reused: the API closes one idle for 5 s,
# and a request sent on a connection as the server closes it fails (httpx.ReadError), which a
# submission cannot retry blindly. httpx's own default equals the server's 5 s.
KEEPALIVE_EXPIRY_S = 3.0


class SluiceError(Exception):
    """Root of every error the client raises on purpose. The client shares no code with the
    server, so this is its own root, not the server's `sluice.errors.SluiceError`."""


class ClientError(SluiceError):
    """An error answer of the API: its HTTP status, code, message, any details it carried (such as
    `retry_with`), and its `Retry-After` in seconds."""

    def __init__(self, status: int, code: str, message: str, *, details: dict[str, Any] | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details or {}
        self.retry_after_s = retry_after_s


class InvalidRequest(ClientError):
    """400, 413 or 422: the request itself is wrong; sending it again cannot help."""


class AuthError(ClientError):
    """401 or 403: no valid key, or the key may not do this."""


class NotFoundError(ClientError):
    """404: no such job, model or version (or another tenant's)."""


class ConflictError(ClientError):
    """409: the resource is in a state that forbids this (a retired version, a key in flight)."""


class RateLimited(ClientError):
    """429: rate limit, quota or load shedding; nothing was queued."""


class Unavailable(ClientError):
    """502, 503 or 504: a replica draining, no servable version, an open breaker; nothing queued."""


_KINDS: dict[int, type[ClientError]] = {
    400: InvalidRequest, 413: InvalidRequest, 422: InvalidRequest, 401: AuthError, 403: AuthError,
    404: NotFoundError, 409: ConflictError, 429: RateLimited, 502: Unavailable, 503: Unavailable, 504: Unavailable,
}


class WaitTimeout(SluiceError, TimeoutError):
    """Jobs still not final when a client's wait ran out; `pending` names them."""

    def __init__(self, pending: list[str], timeout_s: float) -> None:
        shown = ", ".join(pending[:5]) + (", ..." if len(pending) > 5 else "")
        super().__init__(f"{len(pending)} job(s) not final after {timeout_s:g} s: {shown}")
        self.pending = pending


def _decode(response: httpx.Response) -> Any:
    """The body of a successful answer; the API's error body as its kind of ClientError otherwise."""
    if response.status_code >= 400:
        kind = _KINDS.get(response.status_code, ClientError)
        wait = retry_after_s(response.headers.get("Retry-After"))
        try:
            error = dict(response.json()["error"])
            code, message = str(error.pop("code")), str(error.pop("message"))
        except (ValueError, KeyError, TypeError):
            raise kind(response.status_code, "http_error", response.text[:200], retry_after_s=wait) from None
        raise kind(response.status_code, code, message, details=error, retry_after_s=wait)
    return response.json()


def _retry_wait(error: ClientError, attempt: int, *, retries: int, cap_s: float) -> float | None:
    """Seconds to wait before sending again after `attempt` failed tries, or None to give up."""
    if not isinstance(error, RateLimited | Unavailable) or attempt >= retries:
        return None
    backoff = 0.5 * 2 ** attempt
    return min(cap_s, error.retry_after_s if error.retry_after_s is not None else backoff)


def _job_body(input: dict[str, Any] | None, options: dict[str, Any]) -> dict[str, Any]:
    """A job's body: its `input`, or (None) the `input_uri` (and `sha256`, `output_uri`) in the options."""
    return dict(options) if input is None else {"input": input, **options}


def _bulk_body(inputs: list[dict[str, Any]] | None, options: dict[str, Any]) -> dict[str, Any]:
    """A bulk body: `inputs`, or (None) `jobs=[{"input_uri": ...}, ...]` in the options."""
    return dict(options) if inputs is None else {"inputs": inputs, **options}


def _job_params(wait_s: float) -> dict[str, float] | None:
    return {"wait": wait_s} if wait_s else None


class _EventStream:
    """Server-sent events read line by line: `feed` answers an event's parsed data once the blank
    line that ends it arrives. The API sends one `data:` line per event (the job resource), but
    the format allows several, joined by newlines."""

    def __init__(self) -> None:
        self.data: list[str] = []

    def feed(self, line: str) -> dict[str, Any] | None:
        if line.startswith("data:"):
            self.data.append(line[5:].removeprefix(" "))
        elif not line and self.data:
            data, self.data = "\n".join(self.data), []
            return dict(json.loads(data))
        return None


class _Waiting:
    """One wait on many jobs, whichever client makes the requests: what to ask next and what each
    answer settled. A request names at most MAX_WAIT_IDS jobs, the first still pending in the
    order given, so with more a job further back is noticed once it is among them."""

    def __init__(self, ids: Iterable[str], timeout_s: float) -> None:
        self.ids = list(ids)
        self.pending = list(dict.fromkeys(self.ids))
        self.done: dict[str, dict[str, Any]] = {}
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.asked = False

    def next_request(self) -> tuple[dict[str, Any], float]:
        """The next long-poll's query and its wait; WaitTimeout once the time is up (the first
        request is always made, so jobs already final are answered even with no time to wait)."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0 and self.asked:
            raise WaitTimeout(list(self.pending), self.timeout_s)
        self.asked = True
        wait_s = min(POLL_S, max(0.0, remaining))
        return {"ids": ",".join(self.pending[:MAX_WAIT_IDS]), "wait": wait_s}, wait_s

    def settle(self, body: Any) -> list[dict[str, Any]]:
        """The jobs an answer found final, in the order they finished; ClientError (404) when it
        says a job does not exist, as `wait` on that job would."""
        if body["not_found"]:
            raise ClientError(404, "not_found", f"job '{body['not_found'][0]}' does not exist")
        finished = [dict(job) for job in body["jobs"] if job["id"] not in self.done]
        finished.sort(key=lambda job: job["timings"].get("finished_at") or "")
        self.done.update((job["id"], job) for job in finished)
        self.pending = [job_id for job_id in self.pending if job_id not in self.done]
        return finished

    def results(self) -> list[dict[str, Any]]:
        return [self.done[job_id] for job_id in self.ids]


class SluiceClient(AdminCalls, BatchCalls):
    def __init__(self, *, base_url: str, api_key: str, timeout_s: float = 30.0, retries: int = 3,
                 max_retry_wait_s: float = 30.0, transport: httpx.BaseTransport | None = None) -> None:
        self._timeout_s = timeout_s
        self._retries = retries
        self._max_retry_wait_s = max_retry_wait_s
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s, transport=transport,
                                  headers={"Authorization": f"Bearer {api_key}"},
                                  limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))

    def __enter__(self) -> SluiceClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        attempt = 0
        while True:
            try:
                return _decode(self._http.request(method, path, **kwargs))
            except ClientError as error:
                wait = _retry_wait(error, attempt, retries=self._retries, cap_s=self._max_retry_wait_s)
                if wait is None:
                    raise
            time.sleep(wait)
            attempt += 1

    def submit(self, model: str, input: dict[str, Any] | None = None, *, idempotency_key: str | None = None,
               **options: Any) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return dict(self._call("POST", f"/v1/models/{model}/jobs", json=_job_body(input, options),
                               headers=headers))

    def run(self, model: str, input: dict[str, Any] | None = None, *, timeout_s: float = 60.0,
            idempotency_key: str | None = None, **options: Any) -> dict[str, Any]:
        """Submit one job and answer it final (one request when it finishes within the server's
        wait), or as it is once `timeout_s` has passed."""
        deadline = time.monotonic() + timeout_s
        wait_s = min(POLL_S, timeout_s)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        job = dict(self._call("POST", f"/v1/models/{model}/jobs", json=_job_body(input, options),
                              headers=headers, params=_job_params(wait_s), timeout=self._timeout_s + wait_s))
        if job["status"] in FINAL:
            return job
        return self.wait(job["id"], timeout_s=max(0.0, deadline - time.monotonic()))

    def submit_bulk(self, model: str, inputs: list[dict[str, Any]] | None = None, **options: Any) -> list[str]:
        body = self._call("POST", f"/v1/models/{model}/jobs:bulk", json=_bulk_body(inputs, options))
        return list(body["ids"])

    def job(self, job_id: str, *, wait_s: float = 0) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/jobs/{job_id}", params=_job_params(wait_s)))

    def wait(self, job_id: str, *, timeout_s: float = 60.0, poll_s: float = POLL_S) -> dict[str, Any]:
        """Long-poll until the job is final or `timeout_s` passes; answer the last resource."""
        deadline = time.monotonic() + timeout_s
        job = self.job(job_id)
        while job["status"] not in FINAL and time.monotonic() < deadline:
            job = self.job(job_id, wait_s=min(poll_s, max(0.1, deadline - time.monotonic())))
        return job

    def wait_many(self, ids: Iterable[str], *, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Every job final, in the order of `ids`; WaitTimeout naming those that are not in time."""
        waiting = _Waiting(ids, timeout_s)
        for _ in self._completed(waiting):
            pass
        return waiting.results()

    def as_completed(self, ids: Iterable[str], *, timeout_s: float = 60.0) -> Iterator[dict[str, Any]]:
        """Each job's final resource as it finishes; WaitTimeout when some are not in time."""
        return self._completed(_Waiting(ids, timeout_s))

    def _completed(self, waiting: _Waiting) -> Iterator[dict[str, Any]]:
        while waiting.pending:
            params, wait_s = waiting.next_request()
            yield from waiting.settle(self._call("GET", "/v1/jobs", params=params, timeout=self._timeout_s + wait_s))

    def cancel(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("DELETE", f"/v1/jobs/{job_id}"))

    def _raise_for(self, response: httpx.Response) -> None:
        _decode(response)

    def events(self, job_id: str) -> Iterator[dict[str, Any]]:
        """The job resource at each of its state changes (server-sent events), the current state
        first, until it is final; the stream's keep-alives are skipped."""
        with self._http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            if response.status_code >= 400:
                response.read()
                _decode(response)
            events = _EventStream()
            for line in response.iter_lines():
                job = events.feed(line)
                if job is not None:
                    yield job


class _Pools:
    """`max_connections` split over httpx clients of at most POOL_CONNECTIONS each, a call taking
    a place in the first with one free.

    httpx's pool scans its connections for every request it holds, and for each idle one counts
    them all, each time a request starts or ends: with 128 connections that bookkeeping was 60 %
    of the client's CPU once they were busy (py-spy, `bench.slo_throughput` at 190 jobs/s), and its
    CPU per job grew from 2 to 8-11 ms, taking the cores the server needed (bench/README.md).
    Small pools keep each scan short; filling the first ones first lets the others' connections
    expire when traffic is light.
    """

    def __init__(self, make: Callable[[int], httpx.AsyncClient], *, max_connections: int, timeout_s: float) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        sizes = [min(POOL_CONNECTIONS, max_connections - start)
                 for start in range(0, max_connections, POOL_CONNECTIONS)]
        self._clients = [make(size) for size in sizes]
        self._free = sizes
        self._places = asyncio.Semaphore(max_connections)
        self._timeout_s = timeout_s

    @asynccontextmanager
    async def place(self) -> AsyncIterator[httpx.AsyncClient]:
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._places.acquire()
        except TimeoutError:
            raise httpx.PoolTimeout(f"no connection free within {self._timeout_s:g} s") from None
        # A place was free, so some pool has one.
        index = next(i for i, free in enumerate(self._free) if free)
        self._free[index] -= 1
        try:
            yield self._clients[index]
        finally:
            self._free[index] += 1
            self._places.release()

    async def aclose(self) -> None:
        for http in self._clients:
            await http.aclose()


class AsyncClient(AsyncAdminCalls, AsyncBatchCalls):
    """The asyncio client: one set of `max_connections` shared by every call, so many jobs can be
    in flight from one event loop. Use it as an async context manager (or call `aclose`).

    `wait` raises WaitTimeout when the job is not final in time (the sync `wait` answers the
    last resource instead). A long-poll's own HTTP timeout is `timeout_s` plus its wait.

    The connections are split over small httpx pools (`_Pools`), and calls beyond
    `max_connections` in flight wait for a place in arrival order (httpx.PoolTimeout after
    `timeout_s`, as httpx's own pool would).
    """

    def __init__(self, *, base_url: str, api_key: str, timeout_s: float = 30.0, retries: int = 3,
                 max_retry_wait_s: float = 30.0, max_connections: int = 100) -> None:
        self._timeout_s = timeout_s
        self._retries = retries
        self._max_retry_wait_s = max_retry_wait_s
        self._pools = _Pools(lambda size: httpx.AsyncClient(
            base_url=base_url, timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"},
            limits=httpx.Limits(max_connections=size, max_keepalive_connections=size,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S),
        ), max_connections=max_connections, timeout_s=timeout_s)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._pools.aclose()

    async def _call(self, method: str, path: str, *, wait_s: float = 0, **kwargs: Any) -> Any:
        timeout = self._timeout_s + wait_s
        attempt = 0
        while True:
            try:
                async with self._pools.place() as http:
                    response = await http.request(method, path, timeout=timeout, **kwargs)
                return _decode(response)
            except ClientError as error:
                wait = _retry_wait(error, attempt, retries=self._retries, cap_s=self._max_retry_wait_s)
                if wait is None:
                    raise
            await asyncio.sleep(wait)
            attempt += 1

    async def submit(self, model: str, input: dict[str, Any] | None = None, *, idempotency_key: str | None = None,
                     **options: Any) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return dict(await self._call("POST", f"/v1/models/{model}/jobs", json=_job_body(input, options),
                                     headers=headers))

    async def run(self, model: str, input: dict[str, Any] | None = None, *, timeout_s: float = 60.0,
                  idempotency_key: str | None = None, **options: Any) -> dict[str, Any]:
        """Submit one job and answer it final: one request when it finishes within the server's
        wait, then long-polls; WaitTimeout if it is not final within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        wait_s = min(POLL_S, timeout_s)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        job = dict(await self._call("POST", f"/v1/models/{model}/jobs", json=_job_body(input, options),
                                    headers=headers, params=_job_params(wait_s), wait_s=wait_s))
        if job["status"] in FINAL:
            return job
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WaitTimeout([job["id"]], timeout_s)
        return await self.wait(job["id"], timeout_s=remaining)

    async def submit_bulk(self, model: str, inputs: list[dict[str, Any]] | None = None, **options: Any) -> list[str]:
        body = await self._call("POST", f"/v1/models/{model}/jobs:bulk", json=_bulk_body(inputs, options))
        return list(body["ids"])

    async def job(self, job_id: str, *, wait_s: float = 0) -> dict[str, Any]:
        return dict(await self._call("GET", f"/v1/jobs/{job_id}", params=_job_params(wait_s), wait_s=wait_s))

    async def wait(self, job_id: str, *, timeout_s: float = 60.0) -> dict[str, Any]:
        """Long-poll until the job is final; WaitTimeout if it is not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        job = await self.job(job_id, wait_s=min(POLL_S, timeout_s))
        while job["status"] not in FINAL:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout([job_id], timeout_s)
            job = await self.job(job_id, wait_s=min(POLL_S, remaining))
        return job

    async def wait_many(self, ids: Iterable[str], *, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Every job final, in the order of `ids`, through one long-poll at a time for all of
        them; WaitTimeout naming those that are not final within `timeout_s`."""
        waiting = _Waiting(ids, timeout_s)
        async for _ in self._completed(waiting):
            pass
        return waiting.results()

    def as_completed(self, ids: Iterable[str], *, timeout_s: float = 60.0) -> AsyncIterator[dict[str, Any]]:
        """Each job's final resource as it finishes (`async for`); WaitTimeout when some are not
        final within `timeout_s`."""
        return self._completed(_Waiting(ids, timeout_s))

    async def _completed(self, waiting: _Waiting) -> AsyncIterator[dict[str, Any]]:
        while waiting.pending:
            params, wait_s = waiting.next_request()
            for job in waiting.settle(await self._call("GET", "/v1/jobs", params=params, wait_s=wait_s)):
                yield job

    async def cancel(self, job_id: str) -> dict[str, Any]:
        return dict(await self._call("DELETE", f"/v1/jobs/{job_id}"))

    async def events(self, job_id: str) -> AsyncIterator[dict[str, Any]]:
        """The job resource at each of its state changes (server-sent events), the current state
        first, until it is final; the stream's keep-alives are skipped."""
        async with self._pools.place() as http, http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            if response.status_code >= 400:
                await response.aread()
                _decode(response)
            events = _EventStream()
            async for line in response.aiter_lines():
                job = events.feed(line)
                if job is not None:
                    yield job


# The name the README and most callers use.
Client = SluiceClient
