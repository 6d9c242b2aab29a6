"""Field types of the request bodies, the ones routes share and the ones the kernel's
vocabulary dictates."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Annotated, Any, Literal
from urllib.parse import unquote

from pydantic import AfterValidator, Field

from sluice.kinds import ModelKind
from sluice.versions import SERVING_STATES, VersionState

Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]


def _no_nul(uri: str) -> str:
    # No file name holds one, and the file system refuses the path rather than answering "no such file".
    if "\x00" in unquote(uri):
        raise ValueError("a URI may not hold a NUL character (%00)")
    return uri


# A `file://` URI or template of a batch's or a schedule's input or output.
FileUri = Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(_no_nul)]


def one_of(members: Iterable[StrEnum]) -> Any:
    """A `Literal` of the members' values, built at import: OpenAPI lists the values inline, and
    a value outside them is a 422 like any other invalid field."""
    return Literal.__getitem__(tuple(m.value for m in members))


Kind = one_of(ModelKind)
State = one_of(VersionState)
# A version is registered to serve: retiring one is a change of state, never a start.
ServingState = one_of(s for s in VersionState if s in SERVING_STATES)
