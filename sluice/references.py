"""Payloads by reference: a job whose input is an object named by `input_uri`, or whose output is
written to `output_uri`, instead of JSON carried in the request and the job record.

The API checks a reference and stores only it (`InputRef`, `OutputRef`, in the job record's
`input_ref` and `output_ref` fields); the worker reads the object when the job runs and writes
the output (workers/references.py). Which objects a key may name is `sluice.tenant_files` for
files, the rules of batch files (a path relative to the tenant's folder under SLUICE_BATCH_ROOT or
a `file://` URI inside it; an admin key: anywhere under the root), and `sluice.tenant_objects` for
an object store (a URL in SLUICE_OBJECT_ROOT's scheme inside the tenant's folder there). A
relative path names the batch root's folder, or the object root's on a platform without a batch
root.

The surprises: every reference a tenant may not use (another tenant's folder, `..`, a symlink
out, another scheme or bucket) is refused word for word as one to an object that does not exist
(`FileRefused`), and the size is checked before the checksum, which the API never computes:
hashing is the reading it must not do. A file's real path is stored, and checked again before
each use, so a link made in the folder after submit cannot lead the worker out of it; an object's
URL is stored as is (`is_object_url` tells them apart).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from sluice.errors import PayloadTooLarge
from sluice.tenant_files import FileRefused, resolve
from sluice.tenant_objects import ObjectStore, in_store

# The record fields that hold a job's references, and the facts of a written output.
INPUT_REF_FIELD = "input_ref"
OUTPUT_REF_FIELD = "output_ref"
WRITTEN_FIELD = "output_written"

SHA256_PATTERN = r"^[0-9a-fA-F]{64}$"


class _RecordField:
    """A dataclass kept in one field of the job record, as compact JSON of its fields in order."""

    def encode(self) -> str:
        # Only dataclasses derive from it, which mypy cannot tell from the mixin itself.
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))  # type: ignore[call-overload]

    @classmethod
    def parse(cls, text: str | bytes | None) -> Self | None:
        return cls(**json.loads(text)) if text else None


@dataclass(frozen=True, slots=True)
class InputRef(_RecordField):
    """An input object as checked at submit: the URI as the client spelled it, the real path (or
    the object's URL), its size then, and the sha256 the client gave (lower case), if any."""

    uri: str
    path: str
    size: int
    sha256: str | None = None


@dataclass(frozen=True, slots=True)
class OutputRef(_RecordField):
    """Where a job's output goes: the URI as the client spelled it, and the real path (or the
    object's URL)."""

    uri: str
    path: str


@dataclass(frozen=True, slots=True)
class Written(_RecordField):
    """A written output object: its size and sha256, which the job resource shows."""

    size: int
    sha256: str


def check_input(uri: str, sha256: str | None, *, root: Path | None, tenant: str, admin: bool,
                max_bytes: int, objects: ObjectStore | None = None) -> InputRef:
    """The reference `uri` makes, if the key may read it, it is a regular file or an object and it
    holds at most `max_bytes` (413 otherwise, told only to a key that may read it). Never reads it."""
    if in_store(uri, batch_root=root, objects=objects):
        assert objects is not None
        path = objects.resolve(uri, tenant=tenant, admin=admin)
        size = objects.size(path)
    else:
        local = resolve(uri, root=root, tenant=tenant, admin=admin, must_exist=True)
        try:
            size = os.stat(local).st_size
        except OSError:
            raise FileRefused() from None
        path = str(local)
    if size > max_bytes:
        raise PayloadTooLarge(f"the object at input_uri holds {size} bytes; the limit is {max_bytes} "
                              "(SLUICE_MAX_OBJECT_BYTES)")
    return InputRef(uri=uri, path=path, size=size, sha256=sha256.lower() if sha256 else None)


def check_output(uri: str, *, root: Path | None, tenant: str, admin: bool,
                 objects: ObjectStore | None = None) -> OutputRef:
    """Where `uri` says to write an output, if the key may write there: a path in its folder that
    is a regular file or nothing yet (its folders are made when the output is written), or an
    object in its folder of the object store that is not a "folder"."""
    if in_store(uri, batch_root=root, objects=objects):
        assert objects is not None
        url = objects.resolve(uri, tenant=tenant, admin=admin)
        objects.check_writable(url)
        return OutputRef(uri=uri, path=url)
    path = resolve(uri, root=root, tenant=tenant, admin=admin, must_exist=False)
    if path.exists() and not path.is_file():
        raise FileRefused()
    return OutputRef(uri=uri, path=str(path))


def cost_hint(ref: InputRef) -> int:
    """The batcher's cost of a referenced input, before anyone reads it: about a token per four
    bytes, so a large object does not share a batch with short texts."""
    return max(1, min(ref.size // 4, 10_000_000))
