"""The ``torch-export`` kind: a ``torch.export`` program with a dynamic batch dimension.

A version's artifact is a directory holding ``program.pt2`` (``torch.export.save``); the version
records JSON Schemas for its input and output. One job's input is an object whose properties are
the program's positional tensor inputs, in the order of the input schema's ``properties``, each a
row of that input (a number or nested arrays, without the batch dimension). Output ``i`` of the
program is stored under the ``i``-th property of the output schema, one row per job.

Each input's dtype is read from its schema: ``integer`` leaves are int64, ``number`` leaves
float32, ``boolean`` leaves bool; ``"x-dtype": "float16"`` (or any name in ``_DTYPES``) on the
property overrides it. Its row shape comes from ``minItems == maxItems`` at every array level.

``torch.export.load`` unpickles parts of the archive with ``weights_only=False``, so an archive is
first checked by ``workers/models/pt2_safety.py`` and refused if a pickle in it could run code,
unless the version allows pickles (an admin's choice, recorded in the registry).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.export.passes
from torch.export.graph_signature import InputKind, TensorArgument

from sluice.errors import ArtifactError, InferenceError
from sluice.kinds import ModelKind
from workers.models.protocol import ModelHandler
from workers.models.pt2_safety import check_program

PROGRAM = "program.pt2"

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")
}
_LEAF_DTYPES = {"integer": torch.int64, "number": torch.float32, "boolean": torch.bool}
_DYNAMIC_HINT = 'export it with dynamic_shapes={<input>: {0: torch.export.Dim("batch")}} for every input'


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One positional input of the program: its property name, row shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _properties(schema: Any, which: str) -> dict[str, Any]:
    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        raise ArtifactError(f"the {which} schema must be a JSON Schema of type 'object'")
    properties = schema.get("properties")
    if not isinstance(properties, Mapping) or not properties:
        raise ArtifactError(f"the {which} schema must declare 'properties', one per program {which}")
    return dict(properties)


def _input_spec(name: str, schema: Any) -> InputSpec:
    where = f"input schema property {name!r}"
    node = schema
    shape: list[int] = []
    while isinstance(node, Mapping) and node.get("type") == "array":
        size = node.get("minItems")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1 or node.get("maxItems") != size:
            raise ArtifactError(f"{where}: every array level needs minItems == maxItems (a fixed size)")
        shape.append(size)
        node = node.get("items")
    leaf = node.get("type") if isinstance(node, Mapping) else None
    if leaf not in _LEAF_DTYPES:
        raise ArtifactError(f"{where}: leaves must be of type integer, number or boolean, got {leaf!r}")
    override = schema.get("x-dtype")
    if override is not None and override not in _DTYPES:
        raise ArtifactError(f"{where}: x-dtype {override!r} is not one of {', '.join(_DTYPES)}")
    return InputSpec(name, tuple(shape), _DTYPES[override] if override else _LEAF_DTYPES[leaf])


def _check_signature(program: torch.export.ExportedProgram, specs: list[InputSpec]) -> None:
    """Refuse a program whose positional inputs differ from the schema's in number, row shape,
    dtype or a static batch dimension: fed anyway, it would fail (or silently cast) on every job."""
    args_spec, kwargs_spec = program.call_spec.in_spec.child(0), program.call_spec.in_spec.child(1)
    if kwargs_spec.num_children or not all(child.is_leaf() for child in args_spec.children()):
        raise ArtifactError("the program must take positional tensors only (no keyword or nested arguments)")
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    user = [spec.arg for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    if args_spec.num_children != len(specs):
        raise ArtifactError(f"the program takes {args_spec.num_children} positional inputs, the input schema "
                            f"declares {len(specs)} properties ({', '.join(s.name for s in specs)})")
    if len(user) != len(specs) or not all(isinstance(arg, TensorArgument) for arg in user):
        raise ArtifactError("every positional input of the program must be a tensor")
    for spec, arg in zip(specs, user, strict=True):
        fake = placeholders[arg.name].meta.get("val")
        if not isinstance(fake, torch.Tensor) or fake.dim() == 0:
            raise ArtifactError(f"program input {spec.name!r} must be a tensor with a batch dimension")
        if not isinstance(fake.shape[0], torch.SymInt):
            raise ArtifactError(f"program input {spec.name!r} has a static batch dimension "
                                f"({fake.shape[0]}); {_DYNAMIC_HINT}")
        row = tuple(fake.shape[1:])
        if len(row) != len(spec.shape) or any(
            isinstance(want, int) and want != got for want, got in zip(row, spec.shape, strict=True)
        ):
            raise ArtifactError(f"program input {spec.name!r} takes rows of shape {list(row)}, "
                                f"the input schema declares {list(spec.shape)}")
        if fake.dtype != spec.dtype:
            raise ArtifactError(f"program input {spec.name!r} takes {fake.dtype}, the input schema gives "
                                f"{spec.dtype}; set its 'x-dtype' to {str(fake.dtype).removeprefix('torch.')!r}")


def _row(value: Any, spec: InputSpec) -> torch.Tensor:
    """One input's row as a tensor; raises ValueError when it does not fit ``spec``."""
    if spec.dtype.is_floating_point:
        row = torch.tensor(value, dtype=spec.dtype)
    else:
        # Inferred first, so a float (or a bool for an integer) is refused rather than truncated.
        row = torch.tensor(value)
        expected = torch.bool if spec.dtype == torch.bool else torch.int64
        if row.dtype != expected:
            raise ValueError(f"holds {row.dtype} values where {spec.dtype} is declared")
        row = row.to(spec.dtype)
    if tuple(row.shape) != spec.shape:
        raise ValueError(f"has shape {list(row.shape)}, expected {list(spec.shape)}")
    return row


class ExportedProgramHandler(ModelHandler):
    """Runs a ``torch.export`` program on batches of schema-shaped rows (see the module docstring)."""

    kind = ModelKind.torch_export
    # Every row has the declared shape, so any grouping costs the same: one pass of everything.
    length_buckets = True

    @staticmethod
    def passes(inputs: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        return [list(range(len(inputs)))]

    def __init__(self, *, module: torch.nn.Module, inputs: list[InputSpec], outputs: list[str], device: str) -> None:
        self.module = module
        self.inputs = inputs
        self.outputs = outputs
        self.device = device

    def _forward(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        n = batch[0].shape[0]
        try:
            with torch.inference_mode():
                result = self.module(*(t.to(self.device) for t in batch))
        except (RuntimeError, IndexError, AssertionError) as exc:
            # IndexError: an id past an embedding table; AssertionError: a guard export put in the
            # program (a size it was specialised to). Both are the inputs' fault, as shapes are.
            raise InferenceError(f"the program failed on a batch of {n}: {exc}") from exc
        tensors = list(result) if isinstance(result, tuple | list) else [result]
        if len(tensors) != len(self.outputs) or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise InferenceError(f"the program returned {len(tensors)} values, the output schema declares "
                                 f"{len(self.outputs)} tensors ({', '.join(self.outputs)})")
        for name, tensor in zip(self.outputs, tensors, strict=True):
            if tensor.dim() == 0 or tensor.shape[0] != n:
                raise InferenceError(f"output {name!r} has shape {list(tensor.shape)} for a batch of {n}")
        return tensors

    def warmup(self) -> None:
        """Run batches of 1 and 3 rows of zeros: the check that the batch really is dynamic and
        that the outputs fit the output schema, and the kernels' first run."""
        for n in (1, 3):
            batch = [torch.zeros((n, *spec.shape), dtype=spec.dtype) for spec in self.inputs]
            try:
                self._forward(batch)
            except InferenceError as exc:
                hint = f"; its batch dimension must take any size: {_DYNAMIC_HINT}" if n > 1 else ""
                raise ArtifactError(f"{exc} (rows of zeros of the declared shapes){hint}") from exc

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        if not inputs:
            return []
        columns: list[list[torch.Tensor]] = [[] for _ in self.inputs]
        for i, item in enumerate(inputs):
            for spec, column in zip(self.inputs, columns, strict=True):
                if not isinstance(item, Mapping) or spec.name not in item:
                    raise InferenceError(f"input {i} has no property {spec.name!r}")
                try:
                    column.append(_row(item[spec.name], spec))
                except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
                    raise InferenceError(f"input {i}, property {spec.name!r}: {exc}") from exc
        tensors = self._forward([torch.stack(column) for column in columns])
        rows = [t.detach().cpu().tolist() for t in tensors]
        return [{name: values[j] for name, values in zip(self.outputs, rows, strict=True)} for j in range(len(inputs))]


def load_exported(model_dir: Path, *, device: str, input_schema: dict[str, Any],
                  output_schema: dict[str, Any], allow_pickle: bool = False) -> ExportedProgramHandler:
    """Load ``model_dir/program.pt2`` onto ``device`` (``"cpu"`` or ``"cuda"``), check it against
    the schemas and warm it up. Raises ArtifactError on anything that would fail every job, and
    PickleRefused, before torch reads it, on an archive that could run code, unless ``allow_pickle``."""
    if not model_dir.is_dir():
        raise ArtifactError(f"a torch-export artifact must be a directory holding {PROGRAM}, got {model_dir}")
    path = model_dir / PROGRAM
    if not path.is_file():
        raise ArtifactError(f"{model_dir} has no {PROGRAM} (save one with torch.export.save)")
    specs = [_input_spec(name, schema) for name, schema in _properties(input_schema, "input").items()]
    outputs = list(_properties(output_schema, "output"))
    if not allow_pickle:
        check_program(path)
    try:
        program = torch.export.load(path)
    except Exception as exc:  # a corrupt or foreign file raises anything from zipfile to pickle
        raise ArtifactError(f"torch.export.load cannot read {path}: {exc}") from exc
    _check_signature(program, specs)
    module = torch.export.passes.move_to_device_pass(program, device).module()
    handler = ExportedProgramHandler(module=module, inputs=specs, outputs=outputs, device=device)
    try:
        handler.warmup()
    except ArtifactError as exc:
        raise ArtifactError(f"{path}: {exc}") from exc
    return handler
