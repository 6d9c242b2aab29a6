"""Refuse a ``torch.export`` archive that could run code while ``torch.export.load`` reads it.

``torch.export.load`` unpickles parts of a ``.pt2`` with ``weights_only=False`` (pickled weights
and tensor constants), with plain ``pickle.loads`` (opaque constants), falls back to
``weights_only=False`` for the sample inputs, and loads AOTInductor shared libraries: each runs
whatever the archive's author wrote, in the worker. This module reads the zip itself, without
torch, before anything is loaded.

What is checked: every member that the loader might unpickle. Raw tensor payloads (the
``weight_N`` and ``tensor_N`` files that no payload config marks as pickled) and the JSON and text
records (outside the payload folders, where a config may point at any name) are read as bytes by
the loader and are skipped, because random tensor bytes can look like pickle opcodes; every other
member is a pickle carrier. A carrier that is a zip (``torch.save``'s
format) has each of its ``.pkl`` members scanned; any other carrier is scanned as back-to-back
pickle streams from its first byte. A stream may name only the globals in ``SAFE_GLOBALS`` (what
``torch.save`` writes for plain tensors and parameters); extension-registry opcodes and a
``STACK_GLOBAL`` whose names cannot be traced to string opcodes are refused, as are compiled
code and TorchScript, and duplicate member names (which zip readers may resolve differently).

The one surprise: a carrier must be nothing but well-formed pickles. Bytes that do not parse are
refused rather than skipped, since ``pickletools`` and the C unpickler might read them differently;
``torch.save`` has written zips, whose ``.pkl`` members are exactly one pickle, since torch 1.6.
"""

from __future__ import annotations

import io
import json
import pickletools
import re
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sluice.errors import ArtifactError, PickleRefused

# "module.name" of every global a plain tensor or parameter saved by torch.save refers to.
SAFE_GLOBALS = frozenset({
    "collections.OrderedDict",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_parameter",
    *(f"torch.{dtype}Storage" for dtype in (
        "Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool",
        "ComplexFloat", "ComplexDouble",
    )),
})

# Records the loader reads as text or JSON, never unpickles (names after the archive's top folder).
_TEXT_NAMES = frozenset({"archive_format", "archive_version", "byteorder", "version", ".data/version",
                         ".data/serialization_id", ".format_version", ".storage_alignment"})
_RAW_PAYLOAD = re.compile(r"data/(weights/weight|constants/tensor)_\d+")
_PAYLOAD_CONFIG = re.compile(r"data/(weights|constants)/[^/]+_config\.json")
_COMPILED = ("data/aotinductor/", "data/executorch/", "data/mtia")
# Constants torch unpickles by their file name's prefix, whatever their config entry says.
_OBJECT_PREFIXES = ("custom_obj_", "opaque_obj_")
_ZIP_MAGIC = b"PK\x03\x04"
_STRING_OPS = frozenset({"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
                         "SHORT_BINUNICODE", "BINUNICODE8"})
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})


def check_program(path: Path) -> None:
    """Raise PickleRefused when the archive at ``path`` holds a pickle that could run code (or
    compiled code); ArtifactError when it is not a zip this module can read."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            if len(set(names)) != len(names):
                raise PickleRefused(f"{path.name} names a member twice, so what is loaded cannot be told")
            records = {name: _record(name) for name in names}
            pickled = _pickled_payloads(archive, records)
            for name, record in records.items():
                if record.startswith(_COMPILED):
                    raise PickleRefused(f"{path.name} holds compiled code ({name}), which loading would run")
                if name.endswith("/") or not _may_be_unpickled(record, pickled):
                    continue
                _check_carrier(archive.read(name), f"{path.name}:{name}")
    except (zipfile.BadZipFile, zlib.error, NotImplementedError, OSError, EOFError, RuntimeError, ValueError) as exc:
        raise ArtifactError(f"{path.name} is not a readable zip archive: {exc}") from exc


def _record(name: str) -> str:
    # torch's archive reader drops the one top folder every member sits under.
    return name.split("/", 1)[1] if "/" in name else name


def _may_be_unpickled(record: str, pickled: set[str]) -> bool:
    """False for the records the loader only ever reads as bytes or text. In the payload folders a
    name proves nothing (a config may point at any file, and the constant prefixes decide how torch
    reads it), so there only an unmarked config or raw payload is skipped."""
    folder, _, base = record.rpartition("/")
    # Anywhere, not only in the payload folders: a path_name may climb out of its folder.
    if base in pickled or base.startswith(_OBJECT_PREFIXES):
        return True
    if folder in ("data/weights", "data/constants"):
        return not (_PAYLOAD_CONFIG.fullmatch(record) or _RAW_PAYLOAD.fullmatch(record))
    return not (record.endswith(".json") or record in _TEXT_NAMES or record.startswith("extra/"))


def _pickled_payloads(archive: zipfile.ZipFile, records: dict[str, str]) -> set[str]:
    """The payload file names some weights or constants config marks as pickled."""
    pickled: set[str] = set()
    for name, record in records.items():
        if not _PAYLOAD_CONFIG.fullmatch(record):
            continue
        try:
            config = json.loads(archive.read(name)).get("config", {})
            entries = [(str(entry["path_name"]), bool(entry.get("use_pickle"))) for entry in config.values()]
        except (ValueError, AttributeError, KeyError, TypeError) as exc:
            raise ArtifactError(f"payload config {name} cannot be read: {exc}") from exc
        # By base name: a path_name that climbs out of its folder must not hide a pickled payload.
        pickled.update(path_name.rsplit("/", 1)[-1] for path_name, use_pickle in entries if use_pickle)
    return pickled


def _check_carrier(data: bytes, where: str) -> None:
    if not data.startswith(_ZIP_MAGIC):
        _check_pickles(data, where)
        return
    with zipfile.ZipFile(io.BytesIO(data)) as inner:
        names = inner.namelist()
        if len(set(names)) != len(names):
            raise PickleRefused(f"{where} names a member twice, so what is loaded cannot be told")
        for name in names:
            if "/code/" in f"/{name}":
                raise PickleRefused(f"{where} holds TorchScript code ({name})")
            if name.endswith(".pkl"):
                _check_pickles(inner.read(name), f"{where}:{name}")


def _check_pickles(data: bytes, where: str) -> None:
    """Check every pickle stream in ``data``, one after another from its first byte."""
    stream = io.BytesIO(data)
    while stream.tell() < len(data):
        for opcode, arg in _opcodes(stream, where):
            _check_opcode(opcode, arg, where)


def _opcodes(stream: io.BytesIO, where: str) -> Iterator[tuple[str, Any]]:
    """One stream's opcodes up to STOP or the first that does not parse, with ``STACK_GLOBAL``'s
    names traced back to the string opcodes that pushed them (None where they cannot be)."""
    # Only strings are followed; anything else pushed is None, which is enough to refuse a
    # STACK_GLOBAL whose two names were not pushed as strings right before it.
    stack: list[Any] = []
    memo: dict[Any, Any] = {}
    ops = pickletools.genops(stream)
    while True:
        try:
            opcode, arg, _ = next(ops)
        except StopIteration:
            return
        except Exception as exc:  # genops raises whatever its argument readers raise
            # pickletools and the C unpickler could disagree on a malformed opcode, so an opcode
            # that does not parse leaves the rest unknown, and unknown is refused.
            raise PickleRefused(f"{where}: not a well-formed pickle ({exc}), so what it would run "
                                "cannot be told") from exc
        name = opcode.name
        if name == "STACK_GLOBAL":
            names = stack[-2:]
            valid = len(names) == 2 and all(isinstance(n, str) for n in names)
            yield name, " ".join(names) if valid else None
            stack.append(None)
            continue
        yield name, arg
        if name in _STRING_OPS:
            stack.append(arg)
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1] if stack else None
        elif name in _PUT_OPS:
            memo[arg] = stack[-1] if stack else None
        elif name in _GET_OPS:
            stack.append(memo.get(arg))
        elif name != "STOP":
            stack.append(None)


def _check_opcode(name: str, arg: Any, where: str) -> None:
    if name in ("GLOBAL", "INST", "STACK_GLOBAL"):
        if arg is None:
            raise PickleRefused(f"{where}: a pickle imports a name it builds at load time")
        qualified = ".".join(str(arg).split(" ", 1))
        if qualified not in SAFE_GLOBALS:
            raise PickleRefused(f"{where}: a pickle imports {qualified}, which could run code")
    elif name.startswith("EXT"):
        raise PickleRefused(f"{where}: a pickle imports through the extension registry")
