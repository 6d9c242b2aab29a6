"""The torch-export kind: torch.export programs with a dynamic batch, checked against their schemas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sluice.errors import ArtifactError, InferenceError
from sluice.kinds import ModelKind
from tests.exported_models import (
    PROGRAM,
    build_exported_program,
    linear_softmax,
    object_schema,
    save_program,
    vector_schema,
)
from workers.models.exported import ExportedProgramHandler, load_exported
from workers.models.protocol import ModelHandler


class TwoInTwoOut(nn.Module):
    """Float features and integer token ids in; a float projection and integer sums out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.linear = nn.Linear(4, 2)
        self.table = nn.Embedding(10, 4)

    def forward(self, features: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(features + self.table(ids).sum(dim=1)), ids.sum(dim=1)


FEATURES = object_schema({"features": vector_schema(4)})
TWO_INPUTS = object_schema({"features": vector_schema(4), "ids": vector_schema(3, "integer")})
TWO_OUTPUTS = object_schema({"projection": vector_schema(2), "total": {"type": "integer"}})


@pytest.fixture(scope="module")
def linear(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    return build_exported_program(tmp_path_factory.mktemp("linear") / "model")


@pytest.fixture(scope="module")
def two_io(tmp_path_factory: pytest.TempPathFactory) -> Path:
    example = (torch.zeros(2, 4), torch.zeros(2, 3, dtype=torch.int64))
    return save_program(tmp_path_factory.mktemp("two") / "model", TwoInTwoOut().eval(), example)


def load(model_dir: Path, input_schema: dict[str, Any], output_schema: dict[str, Any]) -> ExportedProgramHandler:
    return load_exported(model_dir, device="cpu", input_schema=input_schema, output_schema=output_schema)


def rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [1, 3, 17])
def test_outputs_equal_the_eager_module_at_any_batch_size(linear: tuple[Path, dict, dict], n: int) -> None:
    handler = load(*linear)
    x = rows(n, seed=n)
    out = handler.run([{"features": row} for row in x.tolist()])
    with torch.inference_mode():
        expected = linear_softmax(0)(x)
    assert len(out) == n
    assert list(out[0]) == ["probabilities"]
    torch.testing.assert_close(torch.tensor([o["probabilities"] for o in out]), expected)


def test_the_handler_is_a_model_handler_of_its_kind_with_one_pass(linear: tuple[Path, dict, dict]) -> None:
    handler = load(*linear)
    assert isinstance(handler, ModelHandler)
    assert handler.kind is ModelKind.torch_export
    assert handler.length_buckets is True
    assert handler.passes([{}] * 4) == [[0, 1, 2, 3]]
    assert handler.run([]) == []


def test_two_inputs_and_two_outputs_follow_the_schemas_property_order(two_io: Path) -> None:
    handler = load(two_io, TWO_INPUTS, TWO_OUTPUTS)
    features, ids = rows(5), torch.randint(0, 10, (5, 3), generator=torch.Generator().manual_seed(2))
    out = handler.run([{"ids": i, "features": f} for f, i in zip(features.tolist(), ids.tolist(), strict=True)])
    with torch.inference_mode():
        projection, total = TwoInTwoOut().eval()(features, ids)
    torch.testing.assert_close(torch.tensor([o["projection"] for o in out]), projection)
    assert [o["total"] for o in out] == total.tolist()
    assert all(type(o["total"]) is int for o in out)


def test_a_statically_exported_program_is_refused_with_how_to_export_it(
    linear: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    _, inputs, outputs = linear
    static = save_program(tmp_path / "static", linear_softmax(0), (torch.zeros(2, 4),), dynamic=False)
    with pytest.raises(ArtifactError, match=r"'features' has a static batch dimension \(2\).*"
                       r'dynamic_shapes=\{<input>: \{0: torch.export.Dim\("batch"\)\}\}'):
        load(static, inputs, outputs)


def test_a_program_whose_batch_is_capped_below_three_is_refused_by_the_warmup(
    linear: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    _, inputs, outputs = linear
    program = torch.export.export(linear_softmax(0), (torch.zeros(2, 4),),
                                  dynamic_shapes=({0: torch.export.Dim("batch", max=2)},))
    (tmp_path / "capped").mkdir()
    torch.export.save(program, tmp_path / "capped" / PROGRAM)
    with pytest.raises(ArtifactError, match=r"failed on a batch of 3: .*must take any size: export it with "
                       r'dynamic_shapes=\{<input>: \{0: torch.export.Dim\("batch"\)\}\}'):
        load(tmp_path / "capped", inputs, outputs)


def test_a_row_of_the_wrong_shape_fails_naming_its_index_and_property(linear: tuple[Path, dict, dict]) -> None:
    handler = load(*linear)
    good = {"features": [0.1, 0.2, 0.3, 0.4]}
    with pytest.raises(InferenceError, match=r"input 2, property 'features': has shape \[3\], expected \[4\]"):
        handler.run([good, good, {"features": [1.0, 2.0, 3.0]}, good])
    with pytest.raises(InferenceError, match=r"input 1, property 'features'"):
        handler.run([good, {"features": [[1.0, 2.0], [3.0]]}])
    with pytest.raises(InferenceError, match=r"input 0 has no property 'features'"):
        handler.run([{"feature": [0.0] * 4}])
    # The good rows alone still run: the worker's bisection fails only the bad job.
    assert len(handler.run([good, good])) == 2


def test_rows_that_do_not_fit_an_integer_input_fail_and_program_errors_become_inference_errors(two_io: Path) -> None:
    handler = load(two_io, TWO_INPUTS, TWO_OUTPUTS)
    features = [0.0] * 4
    with pytest.raises(InferenceError, match=r"input 1, property 'ids': holds torch.float32 values"):
        handler.run([{"features": features, "ids": [1, 2, 3]}, {"features": features, "ids": [1.5, 2, 3]}])
    # An id past the embedding table raises inside the program: the input's fault, not the worker's.
    with pytest.raises(InferenceError, match=r"the program failed on a batch of 1"):
        handler.run([{"features": features, "ids": [1, 2, 99]}])


def test_a_property_count_that_differs_from_the_programs_inputs_is_refused(
    linear: tuple[Path, dict, dict], two_io: Path
) -> None:
    model_dir, _, outputs = linear
    with pytest.raises(ArtifactError, match=r"takes 1 positional inputs, the input schema declares 2 properties"):
        load(model_dir, TWO_INPUTS, outputs)
    with pytest.raises(ArtifactError, match=r"takes 2 positional inputs, the input schema declares 1 properties"):
        load(two_io, FEATURES, TWO_OUTPUTS)


class Nested(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return pair[0] + pair[1]


class Scaled(nn.Module):
    def forward(self, features: torch.Tensor, scale: int) -> torch.Tensor:
        return features * scale


class Scalar(nn.Module):
    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features + 1


@pytest.mark.parametrize(
    ("module", "example", "inputs", "message"),
    [
        (Nested(), ((torch.zeros(2, 4), torch.zeros(2, 4)),), FEATURES, "positional tensors only"),
        (Scaled(), (torch.zeros(2, 4), 3), object_schema({"features": vector_schema(4), "scale": {"type": "integer"}}),
         "every positional input of the program must be a tensor"),
        (Scalar(), (torch.zeros(()),), FEATURES, "'features' must be a tensor with a batch dimension"),
    ],
)
def test_programs_that_take_more_than_batched_tensors_are_refused(
    tmp_path: Path, module: nn.Module, example: tuple[Any, ...], inputs: dict[str, Any], message: str
) -> None:
    torch.export.save(torch.export.export(module, example), tmp_path / PROGRAM)
    with pytest.raises(ArtifactError, match=message):
        load(tmp_path, inputs, object_schema({"out": vector_schema(4)}))


def test_outputs_that_do_not_fit_the_output_schema_are_refused(linear: tuple[Path, dict, dict]) -> None:
    model_dir, inputs, _ = linear
    with pytest.raises(ArtifactError, match=r"returned 1 values, the output schema declares 2 tensors"):
        load(model_dir, inputs, TWO_OUTPUTS)


def test_a_program_that_loses_the_batch_dimension_is_refused(tmp_path: Path) -> None:
    class Total(nn.Module):
        def forward(self, features: torch.Tensor) -> torch.Tensor:
            return features.sum()

    model_dir = save_program(tmp_path, Total(), (torch.zeros(2, 4),))
    with pytest.raises(ArtifactError, match=r"output 'total' has shape \[\] for a batch of 1"):
        load(model_dir, FEATURES, object_schema({"total": {"type": "number"}}))


def test_missing_unreadable_or_misplaced_programs_are_refused(linear: tuple[Path, dict, dict], tmp_path: Path) -> None:
    model_dir, inputs, outputs = linear
    with pytest.raises(ArtifactError, match=rf"has no {PROGRAM} \(save one with torch.export.save\)"):
        load(tmp_path, inputs, outputs)
    with pytest.raises(ArtifactError, match="must be a directory"):
        load(model_dir / PROGRAM, inputs, outputs)
    (tmp_path / PROGRAM).write_bytes(b"not a program")
    # The pickle check reads the zip before torch does, so it is the one that says so.
    with pytest.raises(ArtifactError, match="is not a readable zip archive"):
        load(tmp_path, inputs, outputs)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "array"}, "must be a JSON Schema of type 'object'"),
        ({"type": "object", "properties": {}}, "must declare 'properties'"),
        (object_schema({"features": {"type": "array", "items": {"type": "number"}}}), "minItems == maxItems"),
        (object_schema({"features": {**vector_schema(4), "maxItems": 5}}), "minItems == maxItems"),
        (object_schema({"features": vector_schema(4, "string")}), "integer, number or boolean, got 'string'"),
        (object_schema({"features": {**vector_schema(4), "x-dtype": "float8"}}), "x-dtype 'float8' is not one of"),
        (object_schema({"features": vector_schema(5)}), r"rows of shape \[4\], the input schema declares \[5\]"),
        (object_schema({"features": vector_schema(4, "integer")}), r"takes torch.float32.*'x-dtype' to 'float32'"),
    ],
)
def test_input_schemas_that_do_not_describe_the_program_are_refused(
    linear: tuple[Path, dict, dict], schema: dict[str, Any], message: str
) -> None:
    model_dir, _, outputs = linear
    with pytest.raises(ArtifactError, match=message):
        load(model_dir, schema, outputs)


def test_x_dtype_overrides_the_leaf_type(tmp_path: Path) -> None:
    class Double(nn.Module):
        def forward(self, grid: torch.Tensor) -> torch.Tensor:
            return grid * 2

    model_dir = save_program(tmp_path, Double(), (torch.zeros(2, 2, 3, dtype=torch.float64),))
    grid = {"type": "array", "items": vector_schema(3), "minItems": 2, "maxItems": 2}
    handler = load(model_dir, object_schema({"grid": {**grid, "x-dtype": "float64"}}), object_schema({"doubled": grid}))
    value = [[0.1, 0.2, 0.3], [1e-12, 2.0, 3.0]]
    # float64 end to end: through float32, 0.1 * 2 would come back as 0.20000000298023224.
    assert handler.run([{"grid": value}]) == [{"doubled": [[v * 2 for v in r] for r in value]}]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_program_runs_on_cuda(linear: tuple[Path, dict, dict]) -> None:
    model_dir, inputs, outputs = linear
    handler = load_exported(model_dir, device="cuda", input_schema=inputs, output_schema=outputs)
    x = rows(3)
    out = handler.run([{"features": row} for row in x.tolist()])
    with torch.inference_mode():
        expected = linear_softmax(0)(x)
    torch.testing.assert_close(torch.tensor([o["probabilities"] for o in out]), expected, atol=1e-4, rtol=1e-3)
