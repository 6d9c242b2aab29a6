"""Jobs by reference on the worker: read each referenced input just before its batch runs, write
each output to its `output_uri` just after (sluice/references.py is what the API checked).

It all runs on the batch's thread, inside the per-batch timeout: a large object is read and
hashed off the event loop, and only while its batch is on the model, never while it waits in the
prefetch. What goes wrong with a reference is the job's own problem, not the worker's: the job
fails for good with a code, since another delivery would find the same object.

| code | when |
|---|---|
| `input_unavailable` | the object is gone or no longer the tenant's (the message a missing one gets) |
| `input_too_large` | it outgrew SLUICE_MAX_OBJECT_BYTES since submit |
| `input_checksum_mismatch` | its sha256 is not the one submitted |
| `invalid_input` | not JSON, or not an input of the version's kind |
| `input_uri_required` | an inline input to a handler that reads files itself |
| `output_too_large`, `output_unwritable` | the output exceeds the limit, or cannot be written |

The one surprise: a handler that reads files itself (`takes_files`) is handed the object as
`/proc/self/fd/N` of the descriptor that was checked and hashed, held open while its batch runs,
so a link swapped in after the check cannot point it at another file. An object in an object
store (sluice/tenant_objects.py) is streamed into a local temporary file for such a handler, the
copy hashed as it is written; any other handler gets the bytes in memory, as for a file. A
missing object fails the job; a store that does not answer is the worker's fault (the job is
delivered again).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import tempfile
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from sluice.batch_files import BatchFileError
from sluice.batcher import Item
from sluice.errors import InvalidInput, SluiceError
from sluice.kinds import validate_input
from sluice.references import InputRef, OutputRef, Written
from sluice.tenant_files import REFUSED, FileRefused, recheck
from sluice.tenant_objects import ObjectStore, is_object_url
from workers.execution import Outcome, fault_message, run_isolating
from workers.models.protocol import ModelHandler
from workers.results import Delivery

_CHUNK = 1 << 20
# How far ahead an object store's object is fetched: a few requests per chunk read would cost more.
_OBJECT_BLOCK = 8 * _CHUNK
_PROC_FDS = Path("/proc/self/fd")


class _Refused(Exception):
    """A job's reference cannot be used: the job fails with this code and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.body = {"code": code, "message": message}


class NoObjectStore(SluiceError):
    """A job names an object store's object and this worker has no SLUICE_OBJECT_ROOT."""

    def __init__(self) -> None:
        super().__init__("a job names an object in an object store and this worker has no SLUICE_OBJECT_ROOT")


def _local_copy() -> IO[bytes]:
    """A local file for an object's copy, deleted when it is closed (with its batch)."""
    return tempfile.NamedTemporaryFile(prefix="sluice-object-")


@dataclass(frozen=True, slots=True, kw_only=True)
class References:
    """The tenants' root (SLUICE_BATCH_ROOT), the object store (SLUICE_OBJECT_ROOT), the limit of
    one object, and the text limit the API applies to inline inputs, which a referenced input meets
    too."""

    root: Path | None
    objects: ObjectStore | None = None
    max_bytes: int = 64 * 1024**2
    max_text_chars: int = 20_000

    def run(self, handler: ModelHandler, items: Sequence[Item[Delivery]]) -> tuple[list[Outcome], float]:
        """Run a batch as `run_isolating` does, its references read before and written after; the
        seconds count the reading and the writing too, which hold the model's slot."""
        if not handler.takes_files and not any(
                item.payload.input_ref is not None or item.payload.output_ref is not None for item in items):
            return run_isolating(handler, [item.payload.input for item in items])
        started = time.perf_counter()
        outcomes: list[Outcome | None] = [None] * len(items)
        ready: dict[int, Mapping[str, Any]] = {}
        with ExitStack() as held:
            for index, item in enumerate(items):
                try:
                    ready[index] = self._input(handler, item, held)
                except _Refused as exc:
                    outcomes[index] = Outcome(error=exc.body)
                except Exception as exc:  # the worker's side (as a handler's bug): left for another delivery
                    outcomes[index] = Outcome(fault=fault_message(exc, {}))
            ran, _ = run_isolating(handler, list(ready.values()))
        for index, outcome in zip(ready, ran, strict=True):
            try:
                outcomes[index] = self._stored(items[index], outcome)
            except Exception as exc:
                outcomes[index] = Outcome(fault=fault_message(exc, {}))
        return [outcome for outcome in outcomes if outcome is not None], time.perf_counter() - started

    # --- inputs ------------------------------------------------------------------------------------

    def _input(self, handler: ModelHandler, item: Item[Delivery], held: ExitStack) -> Mapping[str, Any]:
        ref = item.payload.input_ref
        if ref is None:
            if handler.takes_files:
                raise _Refused("input_uri_required", "this version reads its input from an object: submit the job "
                                                     "with input_uri")
            return item.payload.input
        handle = held.enter_context(self._open(ref, item.tenant))
        # A handler that reads files gets an object store's object as a local copy, made as it is read.
        remote = is_object_url(ref.path)
        copy = held.enter_context(_local_copy()) if handler.takes_files and remote else None
        data, size, digest = self._read(handle, keep=not handler.takes_files, remote=remote, copy=copy)
        if ref.sha256 is not None and digest != ref.sha256:
            raise _Refused("input_checksum_mismatch", f"the object at input_uri has sha256 {digest}, not the "
                                                      f"{ref.sha256} submitted")
        if handler.takes_files:
            local = copy if copy is not None else handle
            name = local.name if copy is not None else ref.path
            path = _PROC_FDS / str(local.fileno()) if _PROC_FDS.is_dir() else Path(name)
            return {"path": str(path), "size": size, "sha256": digest}
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise _Refused("invalid_input", "the object at input_uri is not JSON") from None
        try:
            canonical, _ = validate_input(handler.kind, payload, max_text_chars=self.max_text_chars)
        except InvalidInput as exc:
            raise _Refused("invalid_input", f"the object at input_uri: {exc.message}") from None
        return canonical

    def _open(self, ref: InputRef, tenant: str) -> IO[bytes]:
        if is_object_url(ref.path):
            try:
                return self._store().open_read(self._store().recheck(ref.path), block_size=_OBJECT_BLOCK)
            except FileRefused:
                raise _Refused("input_unavailable", REFUSED) from None
        try:
            path = recheck(Path(ref.path), root=self.root, tenant=tenant)
            return path.open("rb")
        except (BatchFileError, OSError):
            raise _Refused("input_unavailable", REFUSED) from None

    def _read(self, handle: IO[bytes], *, keep: bool, remote: bool,
              copy: IO[bytes] | None) -> tuple[bytes, int, str]:
        """The object's bytes (when `keep`), size and sha256, refused past the limit whatever the
        size said at submit: the object may have grown since. Each chunk also goes to `copy`."""
        digest = hashlib.sha256()
        chunks: list[bytes] = []
        size = 0
        try:
            while chunk := handle.read(_CHUNK):
                size += len(chunk)
                if size > self.max_bytes:
                    raise _Refused("input_too_large", f"the object at input_uri holds more than {self.max_bytes} "
                                                      "bytes (SLUICE_MAX_OBJECT_BYTES)")
                digest.update(chunk)
                if keep:
                    chunks.append(chunk)
                if copy is not None:
                    copy.write(chunk)
        except (FileNotFoundError, PermissionError):
            raise _Refused("input_unavailable", REFUSED) from None
        except OSError:
            if remote:  # the store's transport or the local copy's disk: the worker's side
                raise
            raise _Refused("input_unavailable", REFUSED) from None
        if copy is not None:
            copy.flush()
            copy.seek(0)
        return b"".join(chunks), size, digest.hexdigest()

    def _store(self) -> ObjectStore:
        if self.objects is None:
            # A job by an object's URL on a worker without SLUICE_OBJECT_ROOT: a misconfigured worker,
            # so the job is left for another one.
            raise NoObjectStore()
        return self.objects

    # --- outputs -----------------------------------------------------------------------------------

    def _stored(self, item: Item[Delivery], outcome: Outcome) -> Outcome:
        """The outcome as stored: a success with an output_uri has its output written there."""
        ref = item.payload.output_ref
        if ref is None or outcome.output is None or outcome.error is not None or outcome.fault is not None:
            return outcome
        data = orjson.dumps(outcome.output)
        if len(data) > self.max_bytes:
            return Outcome(error={"code": "output_too_large", "message": f"the output holds {len(data)} bytes; the "
                                  f"limit is {self.max_bytes} (SLUICE_MAX_OBJECT_BYTES)"})
        try:
            self._write(ref, item.tenant, data)
        except _Refused as exc:
            return Outcome(error=exc.body)
        return Outcome(output=outcome.output, proxies=outcome.proxies,
                       written=Written(size=len(data), sha256=hashlib.sha256(data).hexdigest()))

    def _write(self, ref: OutputRef, tenant: str, data: bytes) -> None:
        """Write atomically: a reader of the object sees the whole output or what was there before.
        A partial file of its own per write, since a job taken over may be written twice at once."""
        refused = _Refused("output_unwritable", "the output could not be written to output_uri: " + REFUSED)
        if is_object_url(ref.path):
            try:
                self._store().write(self._store().recheck(ref.path), data)
            except FileRefused:
                raise refused from None
            return
        try:
            path = recheck(Path(ref.path), root=self.root, tenant=tenant)
        except BatchFileError:
            raise refused from None
        partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Checked again once its folders exist: one made as a link meanwhile must not lead out.
            if recheck(path.parent, root=self.root, tenant=tenant) != path.parent:
                raise refused
            with partial.open("xb") as handle:
                handle.write(data)
            os.replace(partial, path)
        except (BatchFileError, OSError):
            partial.unlink(missing_ok=True)
            raise refused from None
