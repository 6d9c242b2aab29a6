"""A torch-export version's allow_pickle over REST: only an admin key sets it, the audit log records
it, the version resource shows it, and without it a worker refuses an archive whose pickle would
run code (the version's last_error says why, and the code never runs)."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from launch.cli import app
from launch.seed import Seeded
from sluice.artifact_store import publish
from tests.exported_models import WritesMarker, build_exported_program, pickled_weight
from tests.support import ApiServer, WorkerProcess, unique


@pytest.fixture
def store(tmp_path: Path) -> str:
    return (tmp_path / "store").as_uri()


def _model(admin: httpx.Client, kind: str = "torch-export") -> str:
    name = unique("pickle")
    created = admin.post("/v1/models", json={"name": name, "kind": kind})
    assert created.status_code == 201, created.text
    return name


def _version_body(program: Path, store: str, input_schema: dict[str, Any], output_schema: dict[str, Any],
                  **fields: Any) -> dict[str, Any]:
    published = publish(program, store)
    return {"version": "v1", "artifact": published.uri, "sha256": published.sha256, "input_schema": input_schema,
            "output_schema": output_schema, **fields}


def test_an_admin_sets_allow_pickle_audited_and_shown(admin: httpx.Client, tmp_path: Path, store: str) -> None:
    model = _model(admin)
    program, input_schema, output_schema = build_exported_program(tmp_path / "program")
    registered = admin.post(f"/v1/models/{model}/versions",
                            json=_version_body(program, store, input_schema, output_schema, allow_pickle=True))
    assert registered.status_code == 201, registered.text
    assert registered.json()["allow_pickle"] is True
    assert admin.get(f"/v1/models/{model}/versions/v1").json()["allow_pickle"] is True
    assert admin.get(f"/v1/models/{model}").json()["versions"][0]["allow_pickle"] is True
    revoked = admin.patch(f"/v1/models/{model}/versions/v1", json={"allow_pickle": False, "reason": "rebuilt"})
    assert revoked.status_code == 200, revoked.text
    assert revoked.json()["allow_pickle"] is False
    entries = admin.get(f"/v1/models/{model}/audit").json()["entries"]
    update, register = entries[0], entries[1]
    assert update["action"] == "version.update" and update["reason"] == "rebuilt"
    assert (update["before"]["allow_pickle"], update["after"]["allow_pickle"]) == (True, False)
    assert register["action"] == "version.register" and register["after"]["allow_pickle"] is True


def test_a_tenant_key_cannot_set_allow_pickle(
    admin: httpx.Client, new_tenant: Callable[..., tuple[str, httpx.Client]], tmp_path: Path, store: str,
) -> None:
    model = _model(admin)
    program, input_schema, output_schema = build_exported_program(tmp_path / "program")
    body = _version_body(program, store, input_schema, output_schema)
    _, tenant = new_tenant("pickle")
    assert tenant.post(f"/v1/models/{model}/versions", json={**body, "allow_pickle": True}).status_code == 403
    assert admin.post(f"/v1/models/{model}/versions", json=body).status_code == 201
    patched = tenant.patch(f"/v1/models/{model}/versions/v1", json={"allow_pickle": True})
    assert patched.status_code == 403, patched.text
    assert admin.get(f"/v1/models/{model}/versions/v1").json()["allow_pickle"] is False
    assert [e["action"] for e in admin.get(f"/v1/models/{model}/audit").json()["entries"]] == [
        "version.register", "model.create"]


def test_allow_pickle_is_refused_for_a_kind_that_never_unpickles(admin: httpx.Client) -> None:
    model = _model(admin, "synthetic")
    refused = admin.post(f"/v1/models/{model}/versions", json={
        "version": "v1", "artifact": "synthetic:?fixed_s=0", "sha256": "0" * 64, "allow_pickle": True})
    assert refused.status_code == 400, refused.text
    assert "torch-export" in refused.json()["error"]["message"]


@pytest.mark.slow
def test_a_worker_refuses_a_pickle_that_would_run_code(
    admin: httpx.Client, start_worker: Callable[..., WorkerProcess], tmp_path: Path, store: str,
) -> None:
    model = _model(admin)
    program, input_schema, output_schema = build_exported_program(tmp_path / "program")
    marker = tmp_path / "ran"
    pickled_weight(program, pickle.dumps(WritesMarker(marker)))
    registered = admin.post(f"/v1/models/{model}/versions", json=_version_body(
        program, store, input_schema, output_schema, state="stable"))
    assert registered.status_code == 201, registered.text
    with pytest.raises(AssertionError, match="worker exited with 3"):
        start_worker(model)
    assert not marker.exists(), "the archive's pickle ran in the worker"
    version = admin.get(f"/v1/models/{model}/versions/v1").json()
    assert "builtins.exec" in (version["last_error"] or ""), version


def test_the_register_command_sets_allow_pickle_with_an_admin_key_only(
    api: ApiServer, seeded: Seeded, admin: httpx.Client, tmp_path: Path,
) -> None:
    program, input_schema, output_schema = build_exported_program(tmp_path / "program")
    (tmp_path / "in.json").write_text(json.dumps(input_schema))
    (tmp_path / "out.json").write_text(json.dumps(output_schema))
    name = _model(admin)

    def register(version: str, key: str, *extra: str) -> tuple[int, str]:
        done = CliRunner().invoke(app, [
            "models", "register", name, version, "--kind", "torch-export", "--path", str(program),
            "--input-schema", str(tmp_path / "in.json"), "--output-schema", str(tmp_path / "out.json"), *extra,
            "--url", api.url, "--key", key], env={"SLUICE_ARTIFACT_STORE": (tmp_path / "store").as_uri()})
        return done.exit_code, " ".join(done.output.split())

    status, output = register("v1", seeded.admin_key, "--allow-pickle")
    assert status == 0, output
    assert admin.get(f"/v1/models/{name}/versions/v1").json()["allow_pickle"] is True
    status, output = register("v2", seeded.admin_key)
    assert status == 0, output
    assert admin.get(f"/v1/models/{name}/versions/v2").json()["allow_pickle"] is False
    tenant_key = admin.post("/v1/tenants", json={"id": unique("pickle")}).json()["key"]["secret"]
    status, output = register("v3", tenant_key, "--allow-pickle")
    assert status != 0 and "403" in output, output
    assert admin.get(f"/v1/models/{name}/versions/v3").status_code == 404
