"""A torch-export artifact whose archive holds a pickle that could run code is refused before
torch reads it, unless its version allows pickles; a plain program still loads."""

from __future__ import annotations

import io
import json
import pickle
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.artifacts import artifact_sha256
from sluice.errors import ArtifactError, PickleRefused
from tests.exported_models import PROGRAM, WritesMarker, build_exported_program, pickled_weight, rewrite_program
from workers.models.exported import load_exported
from workers.models.loading import Sources, load_handler
from workers.models.pt2_safety import check_program


@pytest.fixture
def linear(tmp_path: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    return build_exported_program(tmp_path / "model")


def test_a_pickled_weight_that_runs_code_is_refused_and_never_runs(
    linear: tuple[Path, dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    program, input_schema, output_schema = linear
    marker = tmp_path / "ran"
    pickled_weight(program, pickle.dumps(WritesMarker(marker)))
    with pytest.raises(ArtifactError) as refused:
        load_exported(program, device="cpu", input_schema=input_schema, output_schema=output_schema)
    assert not marker.exists(), "the archive's pickle ran"
    assert isinstance(refused.value, PickleRefused)
    assert "builtins.exec" in str(refused.value)


def test_sample_inputs_that_run_code_are_refused_and_never_run(
    linear: tuple[Path, dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    """torch.export.load retries the sample inputs with weights_only=False when the safe load fails."""
    program, input_schema, output_schema = linear
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save((WritesMarker(marker),), buffer)
    rewrite_program(program, {"data/sample_inputs/model.pt": buffer.getvalue()})
    with pytest.raises(ArtifactError) as refused:
        load_exported(program, device="cpu", input_schema=input_schema, output_schema=output_schema)
    assert not marker.exists(), "the archive's pickle ran"
    assert isinstance(refused.value, PickleRefused)


def test_the_registry_row_decides_through_load_handler(
    linear: tuple[Path, dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    """Refused by default; with the version's allow_pickle the archive reaches torch, which runs
    it: the opt-in is the only gate, and trusts the archive whole."""
    program, input_schema, output_schema = linear
    marker = tmp_path / "ran"
    pickled_weight(program, pickle.dumps(WritesMarker(marker)))
    artifact, sha = f"file://{program}", artifact_sha256(program)

    def load(allow_pickle: bool) -> None:
        load_handler(kind="torch-export", artifact=artifact, sha256=sha, sources=Sources(
            input_schema=input_schema, output_schema=output_schema, allow_pickle=allow_pickle))

    with pytest.raises(PickleRefused):
        load(False)
    assert not marker.exists()
    with pytest.raises(Exception):  # noqa: B017 - the pickle is not a tensor, so torch fails after running it
        load(True)
    assert marker.exists()


def test_a_plain_program_passes_and_serves(linear: tuple[Path, dict[str, Any], dict[str, Any]]) -> None:
    program, input_schema, output_schema = linear
    check_program(program / PROGRAM)
    handler = load_exported(program, device="cpu", input_schema=input_schema, output_schema=output_schema)
    [row] = handler.run([{"features": [0.0, 1.0, 2.0, 3.0]}])
    assert sum(row["probabilities"]) == pytest.approx(1.0)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_every_pickle_protocol_is_traced(tmp_path: Path, protocol: int) -> None:
    """Protocol 4 names globals with STACK_GLOBAL from strings on the stack, often memoized."""
    program, _, _ = build_exported_program(tmp_path / "model")
    pickled_weight(program, pickle.dumps(WritesMarker(tmp_path / "ran"), protocol=protocol))
    with pytest.raises(PickleRefused, match="exec"):
        check_program(program / PROGRAM)


def test_code_before_a_broken_opcode_is_still_found(tmp_path: Path) -> None:
    """An unpickler runs the REDUCE before it meets the byte that does not parse."""
    program, _, _ = build_exported_program(tmp_path / "model")
    pickled_weight(program, pickle.dumps(WritesMarker(tmp_path / "ran"), protocol=0)[:-1] + b"\xff")
    with pytest.raises(PickleRefused, match="exec"):
        check_program(program / PROGRAM)


def test_an_opaque_constant_is_scanned_whatever_its_flag(tmp_path: Path) -> None:
    """torch unpickles an ``opaque_obj_`` constant with pickle.loads even when its config entry
    says ``use_pickle: false``."""
    program, _, _ = build_exported_program(tmp_path / "model")
    config = {"config": {"obj": {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": False,
                                 "tensor_meta": None}}}
    rewrite_program(program, {"data/constants/model_constants_config.json": json.dumps(config).encode()},
                    add={"program/data/constants/opaque_obj_0": pickle.dumps(WritesMarker(tmp_path / "ran"))})
    with pytest.raises(PickleRefused, match="exec"):
        check_program(program / PROGRAM)


def test_a_pickled_payload_named_like_json_is_scanned(tmp_path: Path) -> None:
    """A config may point a pickled weight at any file name: the name does not make it text."""
    program, _, _ = build_exported_program(tmp_path / "model")
    config = {"config": {"obj": {"path_name": "evil.json", "is_param": False, "use_pickle": True,
                                 "tensor_meta": None}}}
    rewrite_program(program, {"data/weights/model_weights_config.json": json.dumps(config).encode()},
                    add={"program/data/weights/evil.json": pickle.dumps(WritesMarker(tmp_path / "ran"))})
    with pytest.raises(PickleRefused, match="exec"):
        check_program(program / PROGRAM)


def test_a_pickled_payload_outside_its_folder_is_scanned(tmp_path: Path) -> None:
    """A path_name that climbs out of data/weights names a member the loader would look up as is."""
    program, _, _ = build_exported_program(tmp_path / "model")
    config = {"config": {"obj": {"path_name": "../../models/x.json", "is_param": False, "use_pickle": True,
                                 "tensor_meta": None}}}
    rewrite_program(program, {"data/weights/model_weights_config.json": json.dumps(config).encode()}, add={
        "program/data/weights/../../models/x.json": pickle.dumps(WritesMarker(tmp_path / "ran"))})
    with pytest.raises(PickleRefused, match="exec"):
        check_program(program / PROGRAM)


def test_bytes_after_a_pickle_that_do_not_parse_are_refused(tmp_path: Path) -> None:
    """pickletools and the C unpickler might read malformed bytes differently, so none are skipped."""
    program, _, _ = build_exported_program(tmp_path / "model")
    pickled_weight(program, pickle.dumps(None, protocol=2) + b"\xff")
    with pytest.raises(PickleRefused, match="not a well-formed pickle"):
        check_program(program / PROGRAM)


def test_compiled_code_and_duplicate_members_are_refused(tmp_path: Path) -> None:
    compiled, _, _ = build_exported_program(tmp_path / "compiled")
    rewrite_program(compiled, {}, add={"program/data/aotinductor/model/model.so": b"\x7fELF"})
    with pytest.raises(PickleRefused, match="compiled code"):
        check_program(compiled / PROGRAM)
    twice, _, _ = build_exported_program(tmp_path / "twice")
    with pytest.warns(UserWarning, match="Duplicate name"):
        rewrite_program(twice, {}, add={"program/data/weights/weight_0": pickle.dumps(WritesMarker(tmp_path / "x"))})
    with pytest.raises(PickleRefused, match="twice"):
        check_program(twice / PROGRAM)


def test_raw_weights_are_not_read_as_pickles(tmp_path: Path) -> None:
    """Tensor bytes can look like pickle opcodes (a 'c' then a newline reads as GLOBAL); unmarked
    payloads are not scanned, so no model is refused by chance."""
    program, _, _ = build_exported_program(tmp_path / "model")
    with zipfile.ZipFile(program / PROGRAM) as archive:
        weight = archive.read("program/data/weights/weight_0")
    rewrite_program(program, {"data/weights/weight_0": b"cos\nsystem\n" + weight[11:]})
    check_program(program / PROGRAM)


def test_a_file_that_is_not_a_zip_is_an_artifact_error(tmp_path: Path) -> None:
    program, _, _ = build_exported_program(tmp_path / "model")
    shutil.copyfile(__file__, program / PROGRAM)
    with pytest.raises(ArtifactError, match="not a readable zip"):
        check_program(program / PROGRAM)
