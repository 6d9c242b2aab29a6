"""A handler that reads its objects itself (``Input = InputFile``): it streams each one and counts
its bytes and lines, holding a megabyte at a time, so an object of any size runs in little memory.

Its artifact is a directory holding one small file: a handler version needs one to publish.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from sluice.handler import Handler, InputFile

_CHUNK = 1 << 20


class Counted(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bytes: int
    lines: int
    sha256: str


class ByteCounter(Handler[InputFile, Counted]):
    Input = InputFile
    Output = Counted

    def load(self, artifact: Path | None, device: str) -> None:
        assert artifact is not None

    def predict(self, batch: list[InputFile]) -> list[Counted]:
        return [self._count(item) for item in batch]

    @staticmethod
    def _count(item: InputFile) -> Counted:
        digest = hashlib.sha256()
        size = lines = 0
        with open(item.path, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                size += len(chunk)
                lines += chunk.count(b"\n")
                digest.update(chunk)
        return Counted(bytes=size, lines=lines, sha256=digest.hexdigest())


def build_counter(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "README").write_text("ByteCounter has no weights.\n")
    return folder
