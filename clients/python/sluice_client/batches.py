"""Batch scoring and schedules in the Python clients, as mixins of `SluiceClient` and `AsyncClient`.

    batch = client.submit_batch("intent", file="calls.parquet", text_field="transcript")
    for progress in client.follow_batch(batch["id"]):
        print(progress["done"], "/", progress["total"])
    client.download_batch(batch["id"], "scores.csv", format="csv")

A file is uploaded as it is read, and an output is written to disk as it arrives: neither is held
in memory whole.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO, Any

import httpx

BATCH_FINAL = frozenset({"succeeded", "failed", "cancelled"})
FOLLOW_POLL_S = 1.0


def _present(**fields: Any) -> dict[str, Any]:
    return {name: value for name, value in fields.items() if value is not None}


def _batch_request(model: str, *, inputs: list[Any] | None, file: str | Path | None, input_uri: str | None,
                   options: dict[str, Any], handle: IO[bytes] | None) -> dict[str, Any]:
    """The keyword arguments of the POST for one of the three ways in."""
    if sum(way is not None for way in (inputs, file, input_uri)) != 1:
        raise ValueError("give exactly one of inputs, file and input_uri")
    if handle is not None and file is not None:
        fields = {name: str(value) for name, value in _present(model=model, **options).items()
                  if name != "metadata"}
        return {"data": fields, "files": {"file": (Path(file).name, handle, "application/octet-stream")}}
    return {"json": _present(model=model, inputs=inputs, input_uri=input_uri, **options)}


def _is_final(batch: dict[str, Any]) -> bool:
    return batch["status"] in BATCH_FINAL and batch.get("finished_at") is not None


class BatchCalls(ABC):
    _http: httpx.Client

    @abstractmethod
    def _call(self, method: str, path: str, **kwargs: Any) -> Any: ...

    def submit_batch(self, model: str, *, inputs: list[Any] | None = None, file: str | Path | None = None,
                     input_uri: str | None = None, version: str | None = None, format: str | None = None,
                     text_field: str | None = None, output_format: str | None = None,
                     callback_url: str | None = None, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        """Create a batch from inline inputs, a local file (uploaded) or an input_uri on the server."""
        options = _present(version=version, format=format, text_field=text_field, output_format=output_format,
                           callback_url=callback_url, metadata=metadata)
        if file is not None:
            with Path(file).open("rb") as handle:
                return dict(self._call("POST", "/v1/batches", **_batch_request(
                    model, inputs=None, file=file, input_uri=None, options=options, handle=handle)))
        return dict(self._call("POST", "/v1/batches", **_batch_request(
            model, inputs=inputs, file=None, input_uri=input_uri, options=options, handle=None)))

    def batch(self, batch_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/batches/{batch_id}"))

    def batches(self, *, limit: int | None = None, schedule_id: str | None = None) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/batches", params=_present(limit=limit, schedule_id=schedule_id))["batches"])

    def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return dict(self._call("DELETE", f"/v1/batches/{batch_id}"))

    def follow_batch(self, batch_id: str, *, poll_s: float = FOLLOW_POLL_S,
                     timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
        """The batch every `poll_s` until it is final (the last one yielded); TimeoutError past `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            batch = self.batch(batch_id)
            yield batch
            if _is_final(batch):
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"batch '{batch_id}' is not final after {timeout_s:g} s")
            time.sleep(poll_s)

    def wait_batch(self, batch_id: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        return deque(self.follow_batch(batch_id, timeout_s=timeout_s), maxlen=1)[0]

    def download_batch(self, batch_id: str, path: str | Path, *, format: str | None = None) -> Path:
        """Write the batch's output (rows in input order) to `path`, as it streams in."""
        target = Path(path)
        with self._http.stream("GET", f"/v1/batches/{batch_id}/output", params=_present(format=format)) as response:
            if response.status_code >= 400:
                response.read()
                self._raise_for(response)
            with target.open("wb") as sink:
                for chunk in response.iter_bytes():
                    sink.write(chunk)
        return target

    @abstractmethod
    def _raise_for(self, response: httpx.Response) -> None: ...

    def create_schedule(self, model: str, *, cron: str, input_uri: str, **options: Any) -> dict[str, Any]:
        """A cron schedule of batch runs (admin); `options` are the body's other fields (timezone,
        version, format, text_field, output_uri, output_format, callback_url, tenant)."""
        return dict(self._call("POST", "/v1/schedules", json={"model": model, "cron": cron, "input_uri": input_uri,
                                                               **_present(**options)}))

    def schedules(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/schedules")["schedules"])

    def delete_schedule(self, schedule_id: str) -> dict[str, Any]:
        return dict(self._call("DELETE", f"/v1/schedules/{schedule_id}"))


class AsyncBatchCalls(ABC):
    @abstractmethod
    async def _call(self, method: str, path: str, **kwargs: Any) -> Any: ...

    async def submit_batch(self, model: str, *, inputs: list[Any] | None = None, file: str | Path | None = None,
                           input_uri: str | None = None, version: str | None = None, format: str | None = None,
                           text_field: str | None = None, output_format: str | None = None,
                           callback_url: str | None = None,
                           metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        options = _present(version=version, format=format, text_field=text_field, output_format=output_format,
                           callback_url=callback_url, metadata=metadata)
        if file is not None:
            handle = await asyncio.to_thread(Path(file).open, "rb")
            try:
                return dict(await self._call("POST", "/v1/batches", **_batch_request(
                    model, inputs=None, file=file, input_uri=None, options=options, handle=handle)))
            finally:
                handle.close()
        return dict(await self._call("POST", "/v1/batches", **_batch_request(
            model, inputs=inputs, file=None, input_uri=input_uri, options=options, handle=None)))

    async def batch(self, batch_id: str) -> dict[str, Any]:
        return dict(await self._call("GET", f"/v1/batches/{batch_id}"))

    async def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        return dict(await self._call("DELETE", f"/v1/batches/{batch_id}"))

    async def follow_batch(self, batch_id: str, *, poll_s: float = FOLLOW_POLL_S,
                           timeout_s: float | None = None) -> AsyncIterator[dict[str, Any]]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            batch = await self.batch(batch_id)
            yield batch
            if _is_final(batch):
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"batch '{batch_id}' is not final after {timeout_s:g} s")
            await asyncio.sleep(poll_s)
