"""Batch files per tenant, from outside: two tenants over REST, one naming the other's files by
every spelling we could think of, and getting word for word the answer a missing file gets."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.registry import batches as queries
from sluice.registry.store import Registry
from sluice.settings import Settings
from workers.batches import BatchFeeder

pytestmark = [pytest.mark.usefixtures("batches_ended_after")]


def _folder(settings: Settings, tenant: str) -> Path:
    assert settings.batch_root is not None
    folder = settings.batch_root / "tenants" / tenant
    (folder / "in").mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def model(register_synthetic: Callable[..., str]) -> str:
    return register_synthetic("tfiles")


@pytest.fixture
def owner(new_tenant: Callable[..., tuple[str, httpx.Client]], settings: Settings) -> tuple[str, httpx.Client, Path]:
    tenant, client = new_tenant("owner")
    folder = _folder(settings, tenant)
    (folder / "in" / "secret.csv").write_text("confidential_column,text\nc1,hello\nc2,world\n")
    (folder / "in" / "rows.jsonl").write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(3)))
    (folder / "out").mkdir(exist_ok=True)
    (folder / "out" / "2026-01-31.csv").write_text("row,status,output\n0,succeeded,\"[0.5]\"\n")
    return tenant, client, folder


def _post(client: httpx.Client, model: str, uri: str, **extra: Any) -> tuple[int, Any]:
    response = client.post("/v1/batches", json={"model": model, "input_uri": uri, **extra})
    return response.status_code, response.json()


def test_a_tenant_names_its_own_files_by_relative_path_or_file_uri(
    owner: tuple[str, httpx.Client, Path], model: str
) -> None:
    _, client, folder = owner
    for uri in ("in/rows.jsonl", (folder / "in" / "rows.jsonl").as_uri(), "in/secret.csv"):
        status, body = _post(client, model, uri)
        assert status == 202, (uri, body)
    # The owner may learn its own file's header.
    status, body = _post(client, model, "in/secret.csv", text_field="nope")
    assert status == 422 and "confidential_column" in body["error"]["message"]


def test_every_spelling_of_another_tenants_file_gets_the_answer_a_missing_file_gets(
    owner: tuple[str, httpx.Client, Path], new_tenant: Callable[..., tuple[str, httpx.Client]],
    settings: Settings, model: str, tmp_path: Path,
) -> None:
    victim, _, victim_folder = owner
    stranger, client = new_tenant("stranger")
    own = _folder(settings, stranger)
    assert settings.batch_root is not None
    root = settings.batch_root.resolve()
    secret = (victim_folder / "in" / "secret.csv").resolve()
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text('{"text": "x"}\n')
    (own / "link.csv").symlink_to(secret)
    (own / "linkdir").symlink_to(victim_folder.resolve(), target_is_directory=True)
    (own / "loop").symlink_to(own / "loop")

    baseline = _post(client, model, "in/no-such-file.jsonl")
    assert baseline[0] == 422 and "no-such-file" not in json.dumps(baseline[1])
    spellings = [
        secret.as_uri(),
        f"file://localhost{secret}",
        f"file://otherhost{secret}",
        str(secret),
        f"../{victim}/in/secret.csv",
        f"in/../../{victim}/in/secret.csv",
        f"%2e%2e/{victim}/in/secret.csv",
        f"%2E%2E%2F{victim}%2Fin%2Fsecret.csv",
        f"%252e%252e/{victim}/in/secret.csv",
        f"{own.resolve().as_uri()}/../{victim}/in/secret.csv",
        f"{own.resolve().as_uri()}/%2e%2e/{victim}/in/secret.csv",
        f"file://{root}/tenants/{victim}/out/2026-01-31.csv",
        f"../{victim}/out/2026-01-31.csv",
        "link.csv",
        "linkdir/in/secret.csv",
        "loop",
        "loop/x.jsonl",
        outside.as_uri(),
        "file:///etc/passwd",
        "file:/etc/passwd",
        root.as_uri(),
        f"{root.as_uri()}/tenants",
        ".",
        f"http://127.0.0.1/tenants/{victim}/in/secret.csv",
        f"s3://bucket/tenants/{victim}/in/secret.csv",
        f"ftp://localhost{secret}",
        f"FILE://{secret}",
        f"file://{secret}?x=1",
    ]
    for uri in spellings:
        for extra in ({}, {"text_field": "nope"}, {"format": "csv"}):
            got = _post(client, model, uri, **extra)
            assert got == baseline, (uri, extra, got)
    assert "confidential_column" not in json.dumps(baseline)
    # A NUL is refused as a malformed field before any file is looked at: it names no path either.
    status, body = _post(client, model, f"../{victim}/in/secret.csv%00.jsonl")
    assert status == 422 and victim not in json.dumps(body) and "secret" not in json.dumps(body)


def test_an_admin_may_name_any_file_under_the_batch_root(
    owner: tuple[str, httpx.Client, Path], admin: httpx.Client, model: str, settings: Settings
) -> None:
    _, _, folder = owner
    status, body = _post(admin, model, (folder / "in" / "rows.jsonl").resolve().as_uri())
    assert status == 202, body
    assert settings.batch_root is not None
    status, body = _post(admin, model, (settings.batch_root / "nowhere.jsonl").as_uri())
    assert status == 422


def test_a_schedules_files_stay_in_its_tenants_folder(
    owner: tuple[str, httpx.Client, Path], new_tenant: Callable[..., tuple[str, httpx.Client]],
    admin: httpx.Client, model: str, settings: Settings,
) -> None:
    victim, _, folder = owner
    stranger, _ = new_tenant("sched")
    schedule = {"model": model, "cron": "0 2 * * *", "tenant": stranger}
    ok = admin.post("/v1/schedules", json={**schedule, "input_uri": "in/{date}.jsonl",
                                           "output_uri": "out/{date}.csv"})
    assert ok.status_code == 201, ok.text
    for field, uri in (("input_uri", (folder / "in" / "{date}.jsonl").as_uri()),
                       ("input_uri", f"../{victim}/in/{{date}}.jsonl"),
                       ("output_uri", f"../{victim}/out/{{date}}.csv")):
        body = {**schedule, "input_uri": "in/{date}.jsonl", field: uri}
        refused = admin.post("/v1/schedules", json=body)
        assert refused.status_code == 422, (field, uri, refused.text)
        assert "no such batch file" in refused.json()["error"]["message"]
    admin.delete(f"/v1/schedules/{ok.json()['id']}")


def test_a_link_made_after_submit_does_not_lead_the_feeder_out_of_the_folder(
    owner: tuple[str, httpx.Client, Path], new_tenant: Callable[..., tuple[str, httpx.Client]],
    feeder: Callable[..., BatchFeeder], registry: Registry, model: str, settings: Settings,
) -> None:
    _, _, victim_folder = owner
    tenant, client = new_tenant("swap")
    own = _folder(settings, tenant)
    (own / "in" / "mine.jsonl").write_text('{"text": "a"}\n')
    status, body = _post(client, model, "in/mine.jsonl")
    assert status == 202, body
    (own / "in" / "mine.jsonl").unlink()
    (own / "in" / "mine.jsonl").symlink_to((victim_folder / "in" / "rows.jsonl").resolve())

    assert feeder().run(body["id"]) == "failed"
    with registry.session() as session:
        row = queries.get_batch(session, body["id"], tenant=tenant)
        assert row.status == "failed" and row.rows_written == 0
        assert row.error is not None and "no such batch file" in row.error
