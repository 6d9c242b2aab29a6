"""A stand-in for `sluice.client.AsyncClient` until it lands (issue 9, the `waitmany` branch):
the two calls the peer bench makes, with the agreed signatures, over one shared httpx pool.

`bench.peer_client` imports the real class when `sluice.client` has it; delete this module then.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from sluice.client import FINAL, ClientError

# One long-poll ends after this long and the next begins, as the sync client does.
_POLL_S = 20.0


class AsyncClient:
    def __init__(self, *, base_url: str, api_key: str, timeout_s: float = 30.0) -> None:
        # Every job in flight holds one long-poll, so the pool must not close connections back to
        # 20 (httpx's default keep-alive) between a burst's requests.
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        self._http = httpx.AsyncClient(
            base_url=base_url,
            timeout=timeout_s + _POLL_S,
            limits=limits,
            headers={"Authorization": f"Bearer {api_key}"},
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = await self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                raise ClientError(response.status_code, error["code"], error["message"])
            except (ValueError, KeyError, TypeError):
                raise ClientError(response.status_code, "http_error", response.text[:200]) from None
        return dict(response.json())

    async def submit(self, model: str, input: dict[str, Any], **options: Any) -> dict[str, Any]:
        return await self._call("POST", f"/v1/models/{model}/jobs", json={"input": input, **options})

    async def wait(self, job_id: str, *, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            wait = min(_POLL_S, max(0.0, deadline - time.monotonic()))
            job = await self._call("GET", f"/v1/jobs/{job_id}", params={"wait": f"{wait:.3f}"})
            if job["status"] in FINAL or time.monotonic() >= deadline:
                return job
