"""Payloads by reference: a job whose input is an object named by `input_uri`, or whose output is
written to `output_uri`, instead of JSON carried in the request and the job record.

The API checks a reference and stores only it (`InputRef`, `OutputRef`, in the job record's
`input_ref` and `output_ref` fields); the worker reads the object when the job runs and writes
the output (workers/references.py). Which paths a key may name is `sluice.tenant_files`, the
rules of batch files: a path relative to the tenant's folder under SLUICE_BATCH_ROOT or a
`file://` URI inside it (an admin key: anywhere under the root).

The surprises: every reference a tenant may not use (another tenant's folder, `..`, a symlink
out, another scheme) is refused word for word as one to an object that does not exist
(`FileRefused`), and the size is checked before the checksum, which the API never computes:
hashing is the reading it must not do. The real path is stored, and checked again before each
use, so a link made in the folder after submit cannot lead the worker out of it.
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
    """An input object as checked at submit: the URI as the client spelled it, the real path, its
    size then, and the sha256 the client gave (lower case), if any."""

    uri: str
    path: str
    size: int
    sha256: str | None = None


@dataclass(frozen=True, slots=True)
class OutputRef(_RecordField):
    """Where a job's output goes: the URI as the client spelled it, and the real path."""

    uri: str
    path: str


@dataclass(frozen=True, slots=True)
class Written(_RecordField):
    """A written output object: its size and sha256, which the job resource shows."""

    size: int
    sha256: str


def check_input(uri: str, sha256: str | None, *, root: Path | None, tenant: str, admin: bool,
                max_bytes: int) -> InputRef:
    """The reference `uri` makes, if the key may read it, it is a regular file and it holds at
    most `max_bytes` (413 otherwise, told only to a key that may read it). Never reads it."""
    path = resolve(uri, root=root, tenant=tenant, admin=admin, must_exist=True)
    try:
        size = os.stat(path).st_size
    except OSError:
        raise FileRefused() from None
    if size > max_bytes:
        raise PayloadTooLarge(f"the object at input_uri holds {size} bytes; the limit is {max_bytes} "
                              "(SLUICE_MAX_OBJECT_BYTES)")
    return InputRef(uri=uri, path=str(path), size=size, sha256=sha256.lower() if sha256 else None)


def check_output(uri: str, *, root: Path | None, tenant: str, admin: bool) -> OutputRef:
    """Where `uri` says to write an output, if the key may write there: a path in its folder that
    is a regular file or nothing yet (its folders are made when the output is written)."""
    path = resolve(uri, root=root, tenant=tenant, admin=admin, must_exist=False)
    if path.exists() and not path.is_file():
        raise FileRefused()
    return OutputRef(uri=uri, path=str(path))


def cost_hint(ref: InputRef) -> int:
    """The batcher's cost of a referenced input, before anyone reads it: about a token per four
    bytes, so a large object does not share a batch with short texts."""
    return max(1, min(ref.size // 4, 10_000_000))
