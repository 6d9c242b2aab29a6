"""Field types more than one route's request bodies share."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
