"""`sluice models register`: hash a directory by every file, publish it to the store, and register
the version through the API as `staged`, for each kind a team brings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from launch.cli import app
from launch.seed import Seeded
from sluice.artifacts import MANIFEST_NAME, artifact_sha256
from sluice.handler import schemas_of
from tests.exported_models import build_exported_program
from tests.hf_models import build_tiny_classifier, build_tiny_encoder
from tests.own_models.scorer import TinyScorer, build_scorer
from tests.support import ApiServer, unique

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Registrar:
    """`sluice models register ...` against the suite's API, publishing to `store`."""

    api_url: str
    admin_key: str
    store: Path

    def __call__(self, *args: str) -> tuple[int, str]:
        done = CliRunner().invoke(app, ["models", "register", *args, "--url", self.api_url, "--key", self.admin_key],
                                  env={"SLUICE_ARTIFACT_STORE": self.store.as_uri()})
        return done.exit_code, " ".join(done.output.split())  # as read, whatever the terminal's width


@pytest.fixture
def register(api: ApiServer, seeded: Seeded, tmp_path: Path) -> Registrar:
    return Registrar(api_url=api.url, admin_key=seeded.admin_key, store=tmp_path / "store")


def test_a_hugging_face_directory_is_published_by_its_manifest_and_registered_staged(
    register: Registrar, admin: httpx.Client, tmp_path: Path,
) -> None:
    name = unique("cli-enc")
    model_dir = build_tiny_encoder(tmp_path / "my-model")
    status, output = register(name, "v1", "--kind", "hf-embedding", "--path", str(model_dir))
    assert status == 0, output
    assert f"created model {name} (kind hf-embedding)" in output and f"registered {name} v1 (staged)" in output
    assert "give it the traffic" in output, output
    model = admin.get(f"/v1/models/{name}").json()
    [version] = model["versions"]
    assert (model["kind"], version["state"]) == ("hf-embedding", "staged")
    assert version["sha256"] == artifact_sha256(model_dir)
    published = Path(version["artifact"].removeprefix("file://"))
    assert published.is_relative_to(register.store)
    assert (published / MANIFEST_NAME).is_file() and (published / "tokenizer.json").is_file()
    assert artifact_sha256(published) == version["sha256"]

    status, output = register(name, "v2", "--kind", "hf-classifier", "--path",
                              str(build_tiny_classifier(tmp_path / "cls")))
    assert status == 1 and "is of kind hf-embedding, not hf-classifier" in output, output
    status, output = register(name, "v1", "--kind", "hf-embedding", "--path", str(model_dir))
    assert status == 1 and "409" in output, output


def test_a_handler_class_is_registered_with_its_own_schemas(
    register: Registrar, admin: httpx.Client, tmp_path: Path,
) -> None:
    name = unique("cli-handler")
    status, output = register(name, "v1", "--kind", "handler", "--handler",
                              "tests.own_models.scorer:TinyScorer", "--path", str(build_scorer(tmp_path / "s")))
    assert status == 0, output
    version = admin.get(f"/v1/models/{name}/versions/v1").json()
    assert version["handler"] == "tests.own_models.scorer:TinyScorer"
    assert (version["input_schema"], version["output_schema"]) == tuple(schemas_of(TinyScorer).values())

    status, output = register(name, "v2", "--kind", "handler", "--handler",
                              "tests.own_models.scorer:Nowhere", "--path", str(tmp_path / "s"))
    assert status == 2 and "has no 'Nowhere'" in output, output


def test_an_exported_program_is_registered_with_its_declared_schemas(
    register: Registrar, admin: httpx.Client, tmp_path: Path,
) -> None:
    name = unique("cli-export")
    program, input_schema, output_schema = build_exported_program(tmp_path / "program")
    (tmp_path / "in.json").write_text(json.dumps(input_schema))
    (tmp_path / "out.json").write_text(json.dumps(output_schema))
    status, output = register(name, "v1", "--kind", "torch-export", "--path", str(program))
    assert status == 2 and "declares both schemas" in output, output
    schemas = ("--input-schema", str(tmp_path / "in.json"), "--output-schema", str(tmp_path / "out.json"))
    status, output = register(name, "v1", "--kind", "torch-export", "--path", str(program), *schemas)
    assert status == 0, output
    version = admin.get(f"/v1/models/{name}/versions/v1").json()
    assert (version["input_schema"], version["output_schema"]) == (input_schema, output_schema)
    status, output = register(unique("cli-bad"), "v1", "--kind", "hf-embedding", "--path",
                              str(program), "--input-schema", str(tmp_path / "in.json"))
    assert status == 2 and "fixes its schemas" in output, output
