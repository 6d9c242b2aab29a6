"""A torch-export artifact whose archive holds a pickle that could run code is refused before
torch reads it, unless its version allows pickles; a plain program still loads."""

from __future__ import annotations

import io
import json
import pickle
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from sluice.artifacts import artifact_sha256
from sluice.errors import ArtifactError, PickleRefused
from tests.exported_models import PROGRAM, build_exported_program
from workers.models.exported import load_exported
from workers.models.loading import Sources, load_handler
from workers.models.pt2_safety import check_program


class WritesMarker:
    """Unpickling it creates ``path``: the stand-in for any code an archive's author could run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return exec, (f"open({str(self.path)!r}, 'w').close()",)


def _rewrite(program_dir: Path, replace: dict[str, bytes], *, add: dict[str, bytes] | None = None) -> None:
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


def _pickled_weight(program_dir: Path, payload: bytes) -> None:
    """Mark the first weight as pickled in the weights config (as torch.save does for a tensor
    subclass) and make its payload ``payload``."""
    with zipfile.ZipFile(program_dir / PROGRAM) as archive:
        config_name = next(n for n in archive.namelist() if n.endswith("_weights_config.json"))
        config = json.loads(archive.read(config_name))
    for entry in config["config"].values():
        if entry["path_name"] == "weight_0":
            entry["use_pickle"] = True
    _rewrite(program_dir, {config_name.split("/", 1)[1]: json.dumps(config).encode(),
                           "data/weights/weight_0": payload})


@pytest.fixture
def linear(tmp_path: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    return build_exported_program(tmp_path / "model")


def test_a_pickled_weight_that_runs_code_is_refused_and_never_runs(
    linear: tuple[Path, dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    program, input_schema, output_schema = linear
    marker = tmp_path / "ran"
    _pickled_weight(program, pickle.dumps(WritesMarker(marker)))
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
    _rewrite(program, {"data/sample_inputs/model.pt": buffer.getvalue()})
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
    _pickled_weight(program, pickle.dumps(WritesMarker(marker)))
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
    _pickled_weight(program, pickle.dumps(WritesMarker(tmp_path / "ran"), protocol=protocol))
    with pytest.raises(PickleRefused, match="exec"):
        check_program(program / PROGRAM)


def test_code_before_a_broken_opcode_is_still_found(tmp_path: Path) -> None:
    """An unpickler runs the REDUCE before it meets the byte that does not parse."""
    program, _, _ = build_exported_program(tmp_path / "model")
    _pickled_weight(program, pickle.dumps(WritesMarker(tmp_path / "ran"), protocol=0)[:-1] + b"\xff")
    with pytest.raises(PickleRefused, match="exec"):
        check_program(program / PROGRAM)


def test_an_opaque_constant_is_scanned_whatever_its_flag(tmp_path: Path) -> None:
    program, _, _ = build_exported_program(tmp_path / "model")
    _rewrite(program, {}, add={"program/data/constants/opaque_obj_0": pickle.dumps(WritesMarker(tmp_path / "x"))})
    with pytest.raises(PickleRefused):
        check_program(program / PROGRAM)


def test_compiled_code_and_duplicate_members_are_refused(tmp_path: Path) -> None:
    compiled, _, _ = build_exported_program(tmp_path / "compiled")
    _rewrite(compiled, {}, add={"program/data/aotinductor/model/model.so": b"\x7fELF"})
    with pytest.raises(PickleRefused, match="compiled code"):
        check_program(compiled / PROGRAM)
    twice, _, _ = build_exported_program(tmp_path / "twice")
    with pytest.warns(UserWarning, match="Duplicate name"):
        _rewrite(twice, {}, add={"program/data/weights/weight_0": pickle.dumps(WritesMarker(tmp_path / "x"))})
    with pytest.raises(PickleRefused, match="twice"):
        check_program(twice / PROGRAM)


def test_raw_weights_are_not_read_as_pickles(tmp_path: Path) -> None:
    """Tensor bytes can look like pickle opcodes (a 'c' then a newline reads as GLOBAL); unmarked
    payloads are not scanned, so no model is refused by chance."""
    program, _, _ = build_exported_program(tmp_path / "model")
    with zipfile.ZipFile(program / PROGRAM) as archive:
        weight = archive.read("program/data/weights/weight_0")
    _rewrite(program, {"data/weights/weight_0": b"cos\nsystem\n" + weight[11:]})
    check_program(program / PROGRAM)


def test_a_file_that_is_not_a_zip_is_an_artifact_error(tmp_path: Path) -> None:
    program, _, _ = build_exported_program(tmp_path / "model")
    shutil.copyfile(__file__, program / PROGRAM)
    with pytest.raises(ArtifactError, match="not a readable zip"):
        check_program(program / PROGRAM)
