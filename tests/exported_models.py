"""torch.export programs built on the fly, for the ``torch-export`` kind's tests, and archives
tampered to run code when torch unpickles them."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

PROGRAM = "program.pt2"


class LinearSoftmax(nn.Module):
    """Four features in, three class probabilities out."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.linear(features), dim=-1)


def linear_softmax(seed: int = 0) -> LinearSoftmax:
    """The eager module ``build_exported_program(seed=seed)`` exports."""
    torch.manual_seed(seed)
    return LinearSoftmax().eval()


def vector_schema(size: int, leaf: str = "number") -> dict[str, Any]:
    return {"type": "array", "items": {"type": leaf}, "minItems": size, "maxItems": size}


def object_schema(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def save_program(path: Path, module: nn.Module, example: tuple[torch.Tensor, ...], *, dynamic: bool = True) -> Path:
    """Export ``module`` on ``example`` (batch first) into ``path/program.pt2``; ``dynamic``
    makes dimension 0 of every input one shared ``batch`` Dim."""
    path.mkdir(parents=True, exist_ok=True)
    shapes = None
    if dynamic:
        batch = torch.export.Dim("batch")
        shapes = tuple({0: batch} for _ in example)
    program = torch.export.export(module, example, dynamic_shapes=shapes)
    torch.export.save(program, path / PROGRAM)
    return path


def build_exported_program(path: Path, *, seed: int = 0) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """A Linear(4, 3) + softmax program with a dynamic batch in directory ``path``: its directory,
    input schema (``features``: 4 numbers) and output schema (``probabilities``: 3 numbers)."""
    save_program(path, linear_softmax(seed), (torch.zeros(2, 4),))
    return path, object_schema({"features": vector_schema(4)}), object_schema({"probabilities": vector_schema(3)})


class WritesMarker:
    """Unpickling it creates ``path``: the stand-in for any code an archive's author could run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return exec, (f"open({str(self.path)!r}, 'w').close()",)


def rewrite_program(program_dir: Path, replace: dict[str, bytes], *, add: dict[str, bytes] | None = None) -> None:
    """Rewrite ``program.pt2`` with the members whose names end with a key of ``replace`` swapped."""
    path = program_dir / PROGRAM
    with zipfile.ZipFile(path) as source:
        members = [(info, source.read(info)) for info in source.infolist()]
    with zipfile.ZipFile(path, "w") as target:
        for info, data in members:
            swapped = next((new for suffix, new in replace.items() if info.filename.endswith(suffix)), data)
            target.writestr(info, swapped)
        for name, data in (add or {}).items():
            target.writestr(name, data)


def pickled_weight(program_dir: Path, payload: bytes) -> None:
    """Mark the first weight as pickled in the weights config (as torch.save does for a tensor
    subclass) and make its payload ``payload``."""
    with zipfile.ZipFile(program_dir / PROGRAM) as archive:
        config_name = next(n for n in archive.namelist() if n.endswith("_weights_config.json"))
        config = json.loads(archive.read(config_name))
    for entry in config["config"].values():
        if entry["path_name"] == "weight_0":
            entry["use_pickle"] = True
    rewrite_program(program_dir, {config_name.split("/", 1)[1]: json.dumps(config).encode(),
                                  "data/weights/weight_0": payload})
