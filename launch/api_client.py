"""How the operator commands reach the API: `SLUICE_URL` and `SLUICE_API_KEY`, defaulting to the
local `sluice up` and its admin key (`SLUICE_BOOTSTRAP_ADMIN_KEY`, else the one it wrote in
`SLUICE_HOME`, else the demo key there).

`ApiClient` speaks httpx directly, with only the calls the commands make: the server imports
nothing from the `sluice-client` distribution, which a web app installs on its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console

from sluice.backoff import Backoff
from sluice.errors import SluiceError
from sluice.settings import Settings
from sluice.vocabulary import FINAL_BATCH_STATES
from sluice.webhooks import retry_after_s
from sluice.wire.jobs import FINAL_STATES

UrlOption = Annotated[str | None, typer.Option(
    "--url", envvar="SLUICE_URL",
    help="The API (default: http://SLUICE_API_HOST:SLUICE_API_PORT, the local one)")]
KeyOption = Annotated[str | None, typer.Option(
    "--key", envvar="SLUICE_API_KEY",
    help="An API key (default: SLUICE_BOOTSTRAP_ADMIN_KEY, else the admin, else the demo key in SLUICE_HOME)")]

# A 429 or 503 queued nothing, so sending again is safe; this many times, each wait capped.
RETRIES = 3
MAX_RETRY_WAIT_S = 30.0
FOLLOW_POLL_S = 1.0
POLL_S = 20.0


class ApiError(SluiceError):
    """An error answer of the API: its HTTP status, code and message."""

    def __init__(self, status: int, code: str, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


def _present(**fields: Any) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not None}


def _decode(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        wait = retry_after_s(response.headers.get("Retry-After"))
        try:
            error = response.json()["error"]
            code, message = str(error["code"]), str(error["message"])
        except (ValueError, KeyError, TypeError):
            code, message = "http_error", response.text[:200]
        raise ApiError(response.status_code, code, message, retry_after=wait)
    return response.json()


class ApiClient:
    """The API as the `sluice` commands use it; every answer is the API's resource as a dict."""

    def __init__(self, *, base_url: str, api_key: str, timeout_s: float = 30.0) -> None:
        self._timeout_s = timeout_s
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s,
                                  headers={"Authorization": f"Bearer {api_key}"})

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *_: object) -> None:
        self._http.close()

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        backoff = Backoff(base_s=0.5, cap_s=MAX_RETRY_WAIT_S)
        while True:
            try:
                return _decode(self._http.request(method, path, **kwargs))
            except ApiError as error:
                if error.status not in (429, 503) or backoff.failures >= RETRIES:
                    raise
                step = backoff.failed()
                wait = error.retry_after if error.retry_after is not None else step
            time.sleep(min(MAX_RETRY_WAIT_S, wait))

    # --- jobs (the demo of `sluice up`) ---

    def submit(self, model: str, input: dict[str, Any]) -> dict[str, Any]:
        return dict(self.call("POST", f"/v1/models/{model}/jobs", json={"input": input}))

    def wait(self, job_id: str, *, timeout_s: float) -> dict[str, Any]:
        """Long-poll until the job is final or `timeout_s` passes; answer the last resource."""
        deadline = time.monotonic() + timeout_s
        job = dict(self.call("GET", f"/v1/jobs/{job_id}"))
        while job["status"] not in FINAL_STATES and time.monotonic() < deadline:
            wait_s = min(POLL_S, max(0.1, deadline - time.monotonic()))
            job = dict(self.call("GET", f"/v1/jobs/{job_id}", params={"wait": wait_s},
                                 timeout=self._timeout_s + wait_s))
        return job

    # --- models, versions, rollouts, stats ---

    def models(self) -> list[dict[str, Any]]:
        return list(self.call("GET", "/v1/models")["models"])

    def model(self, name: str) -> dict[str, Any]:
        return dict(self.call("GET", f"/v1/models/{name}"))

    def version(self, model: str, version: str) -> dict[str, Any]:
        return dict(self.call("GET", f"/v1/models/{model}/versions/{version}"))

    def create_model(self, name: str, kind: str) -> dict[str, Any]:
        return dict(self.call("POST", "/v1/models", json={"name": name, "kind": kind}))

    def create_version(self, model: str, version: str, *, artifact: str, sha256: str,
                       **options: Any) -> dict[str, Any]:
        return dict(self.call("POST", f"/v1/models/{model}/versions",
                              json={"version": version, "artifact": artifact, "sha256": sha256, **options}))

    def rollback(self, model: str, *, reason: str | None = None) -> dict[str, Any]:
        return dict(self.call("POST", f"/v1/models/{model}/rollback", json=_present(reason=reason)))

    def start_rollout(self, model: str, canary: str, *, stable: str | None = None, steps: list[float] | None = None,
                      soak_s: float | None = None, min_samples: int | None = None,
                      reason: str | None = None) -> dict[str, Any]:
        return dict(self.call("POST", f"/v1/models/{model}/rollouts", json=_present(
            canary=canary, stable=stable, steps=steps, soak_s=soak_s, min_samples=min_samples, reason=reason)))

    def rollout(self, model: str, *, decisions: int) -> dict[str, Any]:
        return dict(self.call("GET", f"/v1/models/{model}/rollouts/current", params={"decisions": decisions}))

    def abort_rollout(self, model: str, *, reason: str | None = None) -> dict[str, Any]:
        return dict(self.call("DELETE", f"/v1/models/{model}/rollouts/current", params=_present(reason=reason)))

    def stats(self, model: str, version: str, *, window_s: float | None = None) -> dict[str, Any]:
        return dict(self.call("GET", f"/v1/models/{model}/versions/{version}/stats",
                              params=_present(window_s=window_s)))

    # --- batches ---

    def submit_batch(self, model: str, *, input_uri: str | None = None, file: Path | None = None,
                     **options: Any) -> dict[str, Any]:
        """A batch of a file on the server (`input_uri`) or of a local file, uploaded as it is read."""
        fields = _present(model=model, **options)
        if file is None:
            return dict(self.call("POST", "/v1/batches", json={**fields, "input_uri": input_uri}))
        with file.open("rb") as handle:
            return dict(self.call("POST", "/v1/batches", data={name: str(value) for name, value in fields.items()},
                                  files={"file": (file.name, handle, "application/octet-stream")}))

    def batch(self, batch_id: str) -> dict[str, Any]:
        return dict(self.call("GET", f"/v1/batches/{batch_id}"))

    def batches(self, *, limit: int | None = None, schedule_id: str | None = None) -> list[dict[str, Any]]:
        return list(self.call("GET", "/v1/batches", params=_present(limit=limit, schedule_id=schedule_id))["batches"])

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return dict(self.call("DELETE", f"/v1/batches/{batch_id}"))

    def follow_batch(self, batch_id: str) -> Iterator[dict[str, Any]]:
        """The batch every second until it is final (the last one yielded)."""
        while True:
            batch = self.batch(batch_id)
            yield batch
            if batch["status"] in FINAL_BATCH_STATES and batch.get("finished_at") is not None:
                return
            time.sleep(FOLLOW_POLL_S)

    def download_batch(self, batch_id: str, path: Path, *, format: str | None = None) -> Path:
        """Write the batch's output to `path` as it streams in."""
        with self._http.stream("GET", f"/v1/batches/{batch_id}/output", params=_present(format=format)) as response:
            if response.status_code >= 400:
                response.read()
                _decode(response)
            with path.open("wb") as sink:
                for chunk in response.iter_bytes():
                    sink.write(chunk)
        return path


def api_client(url: str | None, key: str | None, *, timeout_s: float = 30.0) -> ApiClient:
    settings = Settings()
    if key is None and settings.bootstrap_admin_key is not None:
        key = settings.bootstrap_admin_key.get_secret_value()
    if key is None:
        stored = [path for path in (settings.home / "admin.key", settings.home / "demo.key") if path.exists()]
        if not stored:
            raise typer.BadParameter(f"no key in {settings.home}: pass --key or set SLUICE_API_KEY", param_hint="--key")
        key = stored[0].read_text().strip()
    return ApiClient(base_url=url or f"http://{settings.api_host}:{settings.api_port}", api_key=key,
                     timeout_s=timeout_s)


@contextmanager
def api_errors(console: Console) -> Iterator[None]:
    """An API error or an unreachable API ends the command with its message and exit status 1."""
    try:
        yield
    except (ApiError, httpx.HTTPError) as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from exc
