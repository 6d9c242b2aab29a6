"""The Lua scripts of the Redis wire contract, read from sluice/wire/lua/.

Each script is one file there, whose header names its KEYS, its ARGV and what it returns; the
modules that build a script's arguments (`script_calls`, `quota`, `broker`, workers/delivery.py) say
which file they feed. Functions several scripts share live in sluice/wire/lua/lib/ and are pulled
in by a line `--!include lib/NAME.lua`, which this loader replaces by that file's text: what
Redis runs is the file as written, with its includes in place, and nothing else.

Every script touches the keys of one Redis Cluster slot only (docs/ARCHITECTURE.md, "Redis
Cluster"); each header says which slot.
"""

from __future__ import annotations

from importlib.resources import files
from importlib.resources.abc import Traversable

from sluice.errors import SluiceError

INCLUDE = "--!include "
_ROOT = files("sluice.wire") / "lua"


class ScriptError(SluiceError):
    """A script file, or a file it includes, is missing or includes itself."""


def _read(path: str) -> str:
    file: Traversable = _ROOT
    for part in path.split("/"):
        file = file / part
    try:
        return file.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ScriptError(f"no Lua file sluice/wire/lua/{path}") from exc


def load(path: str, *, including: tuple[str, ...] = ()) -> str:
    """The text of sluice/wire/lua/`path`, each include line replaced by the file it names
    (relative to sluice/wire/lua/), recursively."""
    if path in including:
        raise ScriptError(f"sluice/wire/lua/{path} includes itself: {' -> '.join((*including, path))}")
    parts = []
    for line in _read(path).splitlines(keepends=True):
        if line.startswith(INCLUDE):
            parts.append(load(line[len(INCLUDE):].strip(), including=(*including, path)))
        else:
            parts.append(line)
    return "".join(parts)


def script_files() -> list[str]:
    """Every script's file name (sluice/wire/lua/*.lua; lib/ holds only what they include)."""
    return sorted(entry.name for entry in _ROOT.iterdir() if entry.is_file() and entry.name.endswith(".lua"))


# The stream protocol (`sluice.wire.streams`).
QUEUE = load("queue.lua")
CLAIM = load("claim.lua")
FINISH = load("finish.lua")
REFRESH = load("refresh.lua")
CANCEL = load("cancel.lua")
SETTLE = load("settle.lua")
WITHDRAW = load("withdraw.lua")
RELEASE = load("release.lua")
# A tenant's admission (`sluice.wire.quota`) and its Idempotency-Keys (`sluice.wire.idempotency`).
ADMIT = load("admit.lua")
ADMIT_QUEUE = load("admit_queue.lua")
IDEMPOTENCY_RELEASE = load("idempotency_release.lua")
IDEMPOTENCY_COMPLETE = load("idempotency_complete.lua")
# Webhook delivery attempts (workers/delivery.py).
DELIVERY_BEGIN = load("delivery_begin.lua")
DELIVERY_END = load("delivery_end.lua")
