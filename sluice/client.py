"""Python clients for the REST API (httpx): `SluiceClient` (sync) and `AsyncClient`.

Both answer plain dicts (the API's resources) and raise `ClientError` for every error answer,
decoded by one function. A client waiting for a job holds one long-poll at a time and re-issues
it until the job is final.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from sluice.errors import SluiceError

FINAL = {"succeeded", "failed", "expired", "cancelled"}

# The longest single long-poll a client asks for; the API may cap it lower (`max_wait_s`).
POLL_S = 20.0


class ClientError(SluiceError):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


class WaitTimeout(SluiceError, TimeoutError):
    """Jobs still not final when a client's wait ran out; `pending` names them."""

    def __init__(self, pending: list[str], timeout_s: float) -> None:
        shown = ", ".join(pending[:5]) + (", ..." if len(pending) > 5 else "")
        super().__init__(f"{len(pending)} job(s) not final after {timeout_s:g} s: {shown}")
        self.pending = pending


def _decode(response: httpx.Response) -> Any:
    """The body of a successful answer; the API's error body as ClientError otherwise."""
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
            raise ClientError(response.status_code, error["code"], error["message"])
        except (ValueError, KeyError, TypeError):
            raise ClientError(response.status_code, "http_error", response.text[:200]) from None
    return response.json()


def _job_params(wait_s: float) -> dict[str, float] | None:
    return {"wait": wait_s} if wait_s else None


class SluiceClient:
    def __init__(self, *, base_url: str, api_key: str, timeout_s: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s, transport=transport,
                                  headers={"Authorization": f"Bearer {api_key}"})

    def __enter__(self) -> SluiceClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        return _decode(self._http.request(method, path, **kwargs))

    def submit(self, model: str, input: dict[str, Any], *, idempotency_key: str | None = None,
               **options: Any) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return dict(self._call("POST", f"/v1/models/{model}/jobs", json={"input": input, **options},
                               headers=headers))

    def submit_bulk(self, model: str, inputs: list[dict[str, Any]], **options: Any) -> list[str]:
        body = self._call("POST", f"/v1/models/{model}/jobs:bulk", json={"inputs": inputs, **options})
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

    def cancel(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("DELETE", f"/v1/jobs/{job_id}"))

    def model(self, name: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/models/{name}"))

    def set_routing(self, model: str, weights: dict[str, float], reason: str | None = None) -> dict[str, Any]:
        return dict(self._call("PUT", f"/v1/models/{model}/routing", json={"weights": weights, "reason": reason}))


class AsyncClient:
    """The asyncio client: one connection pool shared by every call, so many jobs can be in
    flight from one event loop. Use it as an async context manager (or call `aclose`).

    `wait` raises WaitTimeout when the job is not final in time (the sync `wait` answers the
    last resource instead). A long-poll's own HTTP timeout is `timeout_s` plus its wait.
    """

    def __init__(self, *, base_url: str, api_key: str, timeout_s: float = 30.0,
                 max_connections: int = 100) -> None:
        self._timeout_s = timeout_s
        self._http = httpx.AsyncClient(
            base_url=base_url, timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"},
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, *, wait_s: float = 0, **kwargs: Any) -> Any:
        timeout = self._timeout_s + wait_s
        return _decode(await self._http.request(method, path, timeout=timeout, **kwargs))

    async def submit(self, model: str, input: dict[str, Any], *, idempotency_key: str | None = None,
                     **options: Any) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return dict(await self._call("POST", f"/v1/models/{model}/jobs", json={"input": input, **options},
                                     headers=headers))

    async def submit_bulk(self, model: str, inputs: list[dict[str, Any]], **options: Any) -> list[str]:
        body = await self._call("POST", f"/v1/models/{model}/jobs:bulk", json={"inputs": inputs, **options})
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

    async def cancel(self, job_id: str) -> dict[str, Any]:
        return dict(await self._call("DELETE", f"/v1/jobs/{job_id}"))


__all__ = ["AsyncClient", "ClientError", "SluiceClient", "WaitTimeout"]
