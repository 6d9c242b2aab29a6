"""Jobs by reference, from outside: a tenant names its input by `input_uri` (with a sha256) and its
output's place by `output_uri`, over REST, and a real worker process reads, verifies and writes
them; every reference another tenant may not read is refused as a missing object is."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from sluice.settings import Settings
from sluice.tenant_files import REFUSED
from sluice.wire import keys
from sluice_client import SluiceClient
from tests.support import ApiServer, WorkerProcess, lane_jobs, wait_job

pytestmark = pytest.mark.slow

# The worker's own limit, below the API's: an object within the API's is refused at run time.
WORKER_MAX_BYTES = 8192
Tenant = tuple[str, httpx.Client, Path]


def _folder(settings: Settings, tenant: str) -> Path:
    assert settings.batch_root is not None
    folder = settings.batch_root / "tenants" / tenant
    (folder / "in").mkdir(parents=True, exist_ok=True)
    return folder


def _put(folder: Path, name: str, data: bytes) -> str:
    """Write an object into the tenant's folder; answer its sha256."""
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def owner(new_tenant: Callable[..., tuple[str, httpx.Client]], settings: Settings) -> Tenant:
    tenant, client = new_tenant("refs")
    return tenant, client, _folder(settings, tenant)


@pytest.fixture
def served(register_synthetic: Callable[..., str], start_worker: Callable[..., WorkerProcess],
           settings: Settings) -> str:
    model = register_synthetic("refs")
    start_worker(model, env={"SLUICE_BATCH_ROOT": str(settings.batch_root),
                             "SLUICE_MAX_OBJECT_BYTES": str(WORKER_MAX_BYTES)})
    return model


def _submit(client: httpx.Client, model: str, **body: Any) -> dict[str, Any]:
    response = client.post(f"/v1/models/{model}/jobs", json=body)
    assert response.status_code == 202, response.text
    return dict(response.json())


def test_a_job_reads_its_input_from_an_object_and_writes_its_output_to_one(
    owner: Tenant, served: str, rds: redis.Redis,
) -> None:
    _, client, folder = owner
    text = "hello by reference " * 40
    digest = _put(folder, "in/one.json", json.dumps({"text": text}).encode())

    queued = _submit(client, served, input_uri="in/one.json", sha256=digest.upper(), output_uri="out/one.json")
    assert queued["input_uri"] == "in/one.json" and queued["output_uri"] == "out/one.json"
    # The record holds the reference, not the object.
    assert text not in str(rds.hgetall(keys.job(queued["id"])))

    job = wait_job(client, queued["id"])
    assert job["status"] == "succeeded", job
    assert "output" not in job and job["output_uri"] == "out/one.json"
    written = (folder / "out" / "one.json").read_bytes()
    assert json.loads(written) == {"echo": {"text": text}}
    assert job["output_size"] == len(written) and job["output_sha256"] == hashlib.sha256(written).hexdigest()
    assert [p.name for p in (folder / "out").iterdir()] == ["one.json"], "a partial file was left behind"

    # A file:// URI inside the folder, the output kept in the job as usual.
    inline = wait_job(client, _submit(client, served, input_uri=(folder / "in" / "one.json").as_uri())["id"])
    assert inline["status"] == "succeeded" and inline["output"] == {"echo": {"text": text}}, inline
    assert "output_uri" not in inline


def test_a_bulk_submission_mixes_inline_and_referenced_jobs(owner: Tenant, served: str) -> None:
    _, client, folder = owner
    _put(folder, "in/a.json", b'{"tokens": 3}')
    response = client.post(f"/v1/models/{served}/jobs:bulk", json={"jobs": [
        {"input": {"text": "inline"}},
        {"input_uri": "in/a.json", "output_uri": "out/a.json"},
        {"input": {"text": "inline too"}, "output_uri": "out/b.json"},
    ]})
    assert response.status_code == 202, response.text
    jobs = [wait_job(client, job_id) for job_id in response.json()["ids"]]
    assert [job["status"] for job in jobs] == ["succeeded"] * 3, jobs
    assert jobs[0]["output"] == {"echo": {"text": "inline"}}
    assert json.loads((folder / "out" / "a.json").read_bytes()) == {"echo": {"tokens": 3}}
    assert json.loads((folder / "out" / "b.json").read_bytes()) == {"echo": {"text": "inline too"}}


def test_what_is_wrong_with_an_object_fails_its_job_with_a_clear_code(
    owner: Tenant, register_synthetic: Callable[..., str], start_worker: Callable[..., WorkerProcess],
    settings: Settings,
) -> None:
    _, client, folder = owner
    served = register_synthetic("refsbad")
    _put(folder, "in/good.json", b'{"text": "fine"}')
    _put(folder, "in/not-json.bin", b"\x00\x01 not json")
    _put(folder, "in/wrong-kind.json", b'{"image": "a cat"}')
    _put(folder, "in/large.json", json.dumps({"text": "x " * WORKER_MAX_BYTES}).encode())
    _put(folder, "in/gone.json", b'{"text": "soon gone"}')
    cases = [
        ("input_checksum_mismatch", _submit(client, served, input_uri="in/good.json", sha256="0" * 64)),
        ("invalid_input", _submit(client, served, input_uri="in/not-json.bin")),
        ("invalid_input", _submit(client, served, input_uri="in/wrong-kind.json")),
        ("input_too_large", _submit(client, served, input_uri="in/large.json")),
        ("input_unavailable", _submit(client, served, input_uri="in/gone.json")),
    ]
    (folder / "in" / "gone.json").unlink()
    # Started once everything is queued, so the object is gone before any job runs.
    start_worker(served, env={"SLUICE_BATCH_ROOT": str(settings.batch_root),
                              "SLUICE_MAX_OBJECT_BYTES": str(WORKER_MAX_BYTES)})
    jobs = [wait_job(client, queued["id"]) for _, queued in cases]
    assert [(job["status"], job["error"]["code"]) for job in jobs] == [("failed", code) for code, _ in cases], jobs
    assert jobs[-1]["error"]["message"] == REFUSED


@pytest.mark.parametrize("body", [
    {},
    {"input": {"text": "x"}, "input_uri": "in/a.json"},
    {"input": None, "input_uri": "in/a.json"},
    {"input": {"text": "x"}, "sha256": "0" * 64},
    {"input_uri": "in/a.json", "sha256": "not-hex"},
    {"input_uri": ""},
], ids=["neither", "both", "both-null", "sha-without-uri", "bad-sha", "empty-uri"])
def test_a_job_gives_exactly_one_of_input_and_input_uri(demo: httpx.Client, register_synthetic: Callable[..., str],
                                                        body: dict[str, Any]) -> None:
    model = register_synthetic("refs422")
    response = demo.post(f"/v1/models/{model}/jobs", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_request"
    bulk = demo.post(f"/v1/models/{model}/jobs:bulk", json={"jobs": [{"input": {"text": "ok"}}, body]})
    assert bulk.status_code == 422, bulk.text


def test_a_bulk_submission_gives_exactly_one_of_inputs_and_jobs(demo: httpx.Client,
                                                                register_synthetic: Callable[..., str]) -> None:
    model = register_synthetic("refs422")
    for body in ({}, {"inputs": [{"text": "a"}], "jobs": [{"input": {"text": "b"}}]}, {"jobs": []}):
        response = demo.post(f"/v1/models/{model}/jobs:bulk", json=body)
        assert response.status_code == 422, (body, response.text)


def test_every_reference_a_tenant_may_not_read_gets_the_answer_a_missing_object_gets(
    owner: Tenant, new_tenant: Callable[..., tuple[str, httpx.Client]], settings: Settings,
    register_synthetic: Callable[..., str], tmp_path: Path, rds: redis.Redis,
) -> None:
    victim, _, victim_folder = owner
    model = register_synthetic("refsx")
    stranger, client = new_tenant("stranger")
    own = _folder(settings, stranger)
    assert settings.batch_root is not None
    root = settings.batch_root.resolve()
    secret = (victim_folder / "in" / "secret.json").resolve()
    _put(victim_folder, "in/secret.json", b'{"text": "confidential"}')
    # Over the size limit: refused as missing too, its size told to nobody but its owner.
    with (victim_folder / "in" / "huge.json").open("wb") as handle:
        handle.truncate(settings.max_object_bytes + 1)
    outside = tmp_path / "elsewhere.json"
    outside.write_text('{"text": "x"}')
    (own / "link.json").symlink_to(secret)
    (own / "linkdir").symlink_to(victim_folder.resolve(), target_is_directory=True)

    def answer(**body: Any) -> tuple[int, Any]:
        response = client.post(f"/v1/models/{model}/jobs", json=body)
        return response.status_code, response.json()

    baseline = answer(input_uri="in/no-such-object.json")
    assert baseline[0] == 422 and baseline[1]["error"]["message"] == REFUSED
    spellings = [
        f"../{victim}/in/secret.json", f"..%2F{victim}%2Fin%2Fsecret.json", secret.as_uri(), str(secret),
        f"file://localhost{secret}", (root / "tenants" / victim / "in" / "huge.json").as_uri(),
        outside.as_uri(), "link.json", "linkdir/in/secret.json", "in/../../../elsewhere.json",
        f"s3://bucket/tenants/{victim}/in/secret.json", f"http://127.0.0.1/tenants/{victim}/in/secret.json",
        "file:///etc/passwd", "in/",
    ]
    for uri in spellings:
        assert answer(input_uri=uri) == baseline, uri
        assert answer(input={"text": "mine"}, output_uri=uri) == baseline, uri
    bulk = client.post(f"/v1/models/{model}/jobs:bulk",
                       json={"jobs": [{"input": {"text": "mine"}}, {"input_uri": secret.as_uri()}]})
    assert (bulk.status_code, bulk.json()) == baseline
    assert lane_jobs(rds, model, "v1", "online") == 0 and lane_jobs(rds, model, "v1", "bulk") == 0

    # The owner is told its own object is too large.
    too_large = owner[1].post(f"/v1/models/{model}/jobs", json={"input_uri": "in/huge.json"})
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "payload_too_large"


def test_the_python_client_submits_jobs_by_reference(owner: Tenant, served: str, api: ApiServer) -> None:
    _, client, folder = owner
    _put(folder, "in/c.json", b'{"text": "from the client"}')
    key = str(client.headers["Authorization"]).removeprefix("Bearer ")
    with SluiceClient(base_url=api.url, api_key=key) as sluice:
        job = sluice.run(served, input_uri="in/c.json", output_uri="out/c.json", timeout_s=60)
        [bulk] = sluice.wait_many(sluice.submit_bulk(served, jobs=[{"input_uri": "in/c.json"}]), timeout_s=60)
    assert job["status"] == "succeeded" and job["output_uri"] == "out/c.json", job
    assert json.loads((folder / "out" / "c.json").read_bytes()) == {"echo": {"text": "from the client"}}
    assert bulk["output"] == {"echo": {"text": "from the client"}}, bulk


def test_openapi_documents_the_reference_fields(anon: httpx.Client) -> None:
    schemas = anon.get("/openapi.json").json()["components"]["schemas"]
    for name in ("SubmitJob", "BulkJob"):
        properties = schemas[name]["properties"]
        assert all(properties[field].get("description") for field in ("input_uri", "sha256", "output_uri")), name
    assert schemas["SubmitBulk"]["properties"]["jobs"]["description"]
    job = schemas["JobResource"]["properties"]
    assert all(job[field].get("description") for field in ("input_uri", "output_uri", "output_size", "output_sha256"))
