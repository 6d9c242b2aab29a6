"""The intent classifier head: a linear layer (optionally one hidden layer) over MiniLM vectors.

Stored as safetensors; the metadata carries what the tensors cannot:

* ``labels``: JSON list of label names, in output-row order;
* ``base``: the encoder the head was trained on (``all-MiniLM-L6-v2``);
* ``base_sha256`` (optional): sha256 of that encoder's ``model.safetensors``, checked on load
  so a head is never silently run over a different encoder.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from sluice.errors import ArtifactError

BASE_MODEL = "all-MiniLM-L6-v2"


class IntentHead(nn.Module):
    def __init__(self, in_dim: int, n_labels: int, hidden: int = 0) -> None:
        super().__init__()
        self.hidden: nn.Linear | None = nn.Linear(in_dim, hidden) if hidden else None
        self.out = nn.Linear(hidden or in_dim, n_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hidden is not None:
            x = torch.relu(self.hidden(x))
        logits: torch.Tensor = self.out(x)
        return logits


def _write_canonical(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """save_file, then rewrite the JSON header with sorted keys.

    safetensors serialises its header from a hash map, so the same tensors and metadata give
    different bytes (and a different sha256) on every run; sorting makes the artifact
    reproducible. Data offsets are relative to the end of the header, so they stay valid.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)
    blob = path.read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + size])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to 8-byte alignment
    path.write_bytes(struct.pack("<Q", len(text)) + text + blob[8 + size :])
    # safetensors creates the file 0600; a shipped artifact must be readable by the workers.
    path.chmod(0o644)


def save_head(
    head: IntentHead,
    path: Path,
    *,
    labels: list[str],
    base_sha256: str | None = None,
    extra: dict[str, str] | None = None,
) -> None:
    if len(labels) != head.out.out_features:
        raise ValueError(f"{len(labels)} labels for a head with {head.out.out_features} outputs")
    metadata = {"labels": json.dumps(labels), "base": BASE_MODEL, **(extra or {})}
    if base_sha256:
        metadata["base_sha256"] = base_sha256
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in head.state_dict().items()}
    _write_canonical(tensors, path, metadata)


def read_head(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a head file; never unpickles."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            metadata = dict(fh.metadata() or {})
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 - safe_open is not a Mapping  # noqa: SIM118 (not a dict)
    except FileNotFoundError as exc:
        raise ArtifactError(f"head file not found: {path}") from exc
    except (SafetensorError, OSError) as exc:
        raise ArtifactError(f"unreadable head file {path}: {exc}") from exc
    return tensors, metadata


def load_head(path: Path, *, in_dim: int) -> tuple[IntentHead, list[str], dict[str, str]]:
    """Build the head stored at ``path``; returns (head in eval mode, labels, metadata)."""
    tensors, metadata = read_head(path)
    if metadata.get("base") != BASE_MODEL:
        raise ArtifactError(f"{path}: base {metadata.get('base')!r}, expected {BASE_MODEL!r}")
    try:
        labels = json.loads(metadata["labels"])
    except (KeyError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: metadata 'labels' missing or not JSON") from exc
    if not (isinstance(labels, list) and labels and all(isinstance(x, str) for x in labels)):
        raise ArtifactError(f"{path}: metadata 'labels' must be a non-empty list of str")
    if "out.weight" not in tensors:
        raise ArtifactError(f"{path}: no 'out.weight' tensor")
    hidden = tensors["hidden.weight"].shape[0] if "hidden.weight" in tensors else 0
    head = IntentHead(in_dim, len(labels), hidden)
    try:
        head.load_state_dict(tensors, strict=True)
    except RuntimeError as exc:
        raise ArtifactError(f"{path}: tensors do not fit a head over {in_dim} dims: {exc}") from exc
    return head.eval(), labels, metadata


def write_degraded_head(src: Path, dst: Path, seed: int) -> None:
    """Write a copy of the head at ``src`` that answers confidently and wrongly.

    The output rows are permuted by a derangement (no label keeps its own row), so every
    prediction moves to another label with the original's confidence. Used to exercise canary
    rollback: quality drops while latency and the output shape stay the same.
    """
    tensors, metadata = read_head(src)
    weight, bias = tensors.get("out.weight"), tensors.get("out.bias")
    if weight is None or bias is None:
        raise ArtifactError(f"{src}: not a head file (no out.weight/out.bias)")
    n = weight.shape[0]
    if n < 2:
        raise ArtifactError(f"{src}: a single-label head cannot be deranged")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    # Shift along a random cycle: row order[i] takes order[i+1]'s weights, a derangement.
    perm = torch.empty(n, dtype=torch.long)
    perm[order] = order.roll(-1)
    tensors["out.weight"] = weight[perm].contiguous()
    tensors["out.bias"] = bias[perm].contiguous()
    metadata["degraded"] = json.dumps({"seed": seed, "permutation": perm.tolist()})
    _write_canonical(tensors, dst, metadata)
