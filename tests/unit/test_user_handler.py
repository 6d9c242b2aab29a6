"""A team's own handler class behind the worker: every way it can fail a batch fails only the guilty
input, with a message naming what went wrong and never the input's values."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.errors import ArtifactError, InferenceError, InvalidInput, ModelError
from sluice.handler import check_spec, import_handler, schemas_of
from sluice.kinds import ModelKind, schema_text, validate_input
from tests.own_models.scorer import TinyScorer, build_scorer
from workers.execution import run_isolating
from workers.models.user_handler import UserHandler, load_user_handler

SPEC = "tests.own_models.scorer:TinyScorer"


@pytest.fixture
def scorer(tmp_path: Path) -> UserHandler:
    schemas = schemas_of(TinyScorer)
    return load_user_handler(SPEC, build_scorer(tmp_path / "scorer", scale=2.0), device="cpu",
                             input_schema=schemas["input"], output_schema=schemas["output"])


def test_a_handler_serves_validated_inputs_and_reports_its_quality_and_cost(scorer: UserHandler) -> None:
    outputs = scorer.run([{"values": [1.0, 3.0]}, {"values": [-4.0]}])
    assert [o["label"] for o in outputs] == ["high", "low"]
    assert 0.5 < outputs[0]["score"] < 1 and outputs[1]["score"] < 0.5
    assert scorer.proxies(outputs[0]) == {"top_p": round(abs(outputs[0]["score"] - 0.5) * 2, 6), "label": "high"}
    assert scorer.cost_of({"values": [1.0, 2.0, 3.0]}) == 3
    assert scorer.cost_of({"values": "not a list"}) is None
    [outcome] = run_isolating(scorer, [{"values": [0.0]}])[0]
    assert outcome.proxies == {"top_p": 0.0, "label": "high"}


@pytest.mark.parametrize(("behave", "message"), [
    ("raise", "raised ValueError: the scorer cannot read this reading"),
    ("miscount", "answered 2 outputs for 1 inputs"),
    ("misshape", "output 0 does not fit Score: label: literal_error"),
])
def test_each_way_a_handler_fails_a_batch_fails_only_the_guilty_input(
    scorer: UserHandler, behave: str, message: str,
) -> None:
    inputs = [{"values": [float(i)]} for i in range(7)]
    inputs[4] = {"values": [123.456], "behave": behave}
    outcomes, _ = run_isolating(scorer, inputs)
    failed = [i for i, outcome in enumerate(outcomes) if outcome.error is not None]
    assert failed == [4]
    error = outcomes[4].error
    assert error is not None and message in error["message"], error
    assert "123.456" not in error["message"]
    assert all(outcome.output is not None for i, outcome in enumerate(outcomes) if i != 4)


def test_an_input_that_does_not_fit_the_handler_fails_without_echoing_it(scorer: UserHandler) -> None:
    with pytest.raises(InferenceError, match="input 1 does not fit Reading: values: list_type") as caught:
        scorer.run([{"values": [1.0]}, {"values": "secret words"}])
    assert "secret" not in str(caught.value)


def test_the_api_checks_inputs_against_the_schemas_the_version_records() -> None:
    schema = schema_text(schemas_of(TinyScorer)["input"])
    canonical, cost = validate_input(ModelKind.handler, {"values": [1.5]}, max_text_chars=10, schema=schema)
    assert canonical == {"values": [1.5]} and cost == 1
    for bad, rule in (({"values": []}, "minItems"), ({"values": [1], "extra": 1}, "additionalProperties"),
                      ({"values": ["a"]}, "type"), ({"values": [1], "behave": "dance"}, "enum")):
        with pytest.raises(InvalidInput, match=rule):
            validate_input(ModelKind.handler, bad, max_text_chars=10, schema=schema)


def test_a_version_whose_recorded_schema_is_not_its_handlers_is_refused(tmp_path: Path) -> None:
    schemas = schemas_of(TinyScorer)
    other = {**schemas["input"], "required": ["values", "behave"]}
    with pytest.raises(ArtifactError, match="records an input schema that differs"):
        load_user_handler(SPEC, build_scorer(tmp_path / "s"), device="cpu", input_schema=other,
                          output_schema=schemas["output"])


@pytest.mark.parametrize(("spec", "message"), [
    ("tests.own_models.scorer:Nope", "has no 'Nope'"),
    ("tests.own_models.nowhere:TinyScorer", "cannot import"),
    ("tests.own_models.scorer:Reading", "not a subclass of sluice.handler.Handler"),
])
def test_a_handler_that_cannot_be_imported_refuses_its_version(tmp_path: Path, spec: str, message: str) -> None:
    with pytest.raises(ArtifactError, match=message):
        load_user_handler(spec, build_scorer(tmp_path / "s"), device="cpu", input_schema=None, output_schema=None)


def test_a_handler_whose_load_raises_refuses_its_version(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ArtifactError, match="load\\(\\) raised"):
        load_user_handler(SPEC, empty, device="cpu", input_schema=None, output_schema=None)


@pytest.mark.parametrize("spec", ["tests.own_models.scorer", "a b:C", ":C", "pkg.mod:", "pkg..mod:C"])
def test_a_handler_spec_must_read_module_colon_class(spec: str) -> None:
    with pytest.raises(ModelError, match="package.module:Class"):
        check_spec(spec)
    assert import_handler(SPEC) is TinyScorer
