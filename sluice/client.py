"""A small Python client for the REST API (httpx; sync)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from sluice.errors import SluiceError

FINAL = {"succeeded", "failed", "expired", "cancelled"}


class ClientError(SluiceError):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


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
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                raise ClientError(response.status_code, error["code"], error["message"])
            except (ValueError, KeyError, TypeError):
                raise ClientError(response.status_code, "http_error", response.text[:200]) from None
        return response.json()

    def submit(self, model: str, input: dict[str, Any], *, idempotency_key: str | None = None,
               **options: Any) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return dict(self._call("POST", f"/v1/models/{model}/jobs", json={"input": input, **options},
                               headers=headers))

    def submit_bulk(self, model: str, inputs: list[dict[str, Any]], **options: Any) -> list[str]:
        body = self._call("POST", f"/v1/models/{model}/jobs:bulk", json={"inputs": inputs, **options})
        return list(body["ids"])

    def job(self, job_id: str, *, wait_s: float = 0) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/jobs/{job_id}", params={"wait": wait_s} if wait_s else None))

    def wait(self, job_id: str, *, timeout_s: float = 60.0, poll_s: float = 20.0) -> dict[str, Any]:
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


__all__ = ["ClientError", "SluiceClient"]
