"""Jobs by reference to an object store, from outside: a platform whose SLUICE_OBJECT_ROOT is a real
local S3 server (moto, through s3fs), a tenant naming its input by an `s3://` URL or a path relative
to its folder there (the platform has no batch root), a real worker process reading, verifying and
writing the objects, and every object another tenant may not read refused as a missing one is."""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from sluice.settings import Settings
from sluice.tenant_files import REFUSED
from sluice.tenant_objects import ObjectStore, ObjectStoreUnavailable
from sluice.wire import keys
from tests.s3_server import S3Server, s3_server
from tests.support import ApiServer, WorkerProcess, make_settings, serving, wait_job
from workers.batches import BatchFeeder

pytestmark = pytest.mark.slow

# The worker's own limit, below the API's: an object within the API's is refused at run time.
API_MAX_BYTES = 64 * 1024
WORKER_MAX_BYTES = 8192


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


@pytest.fixture(scope="module")
def object_api(s3: S3Server, settings: Settings, api: ApiServer) -> Iterator[ApiServer]:
    """An API of the suite's stores whose references live in the S3 server and nowhere else."""
    assert settings.redis_url is not None and settings.database_url is not None
    own = make_settings(redis_url=settings.redis_url, database_url=settings.database_url, home=settings.home,
                        batch_root=None, max_object_bytes=API_MAX_BYTES, **s3.settings)
    with serving(own) as server:
        yield server


Tenant = tuple[str, httpx.Client]


@pytest.fixture
def tenant_on(object_api: ApiServer, new_tenant: Callable[..., Tenant]) -> Iterator[Callable[[str], Tenant]]:
    """A new tenant with a client of the object store's API."""
    clients: list[httpx.Client] = []

    def make(prefix: str) -> Tenant:
        tenant, session_client = new_tenant(prefix)
        client = httpx.Client(base_url=object_api.url, timeout=30,
                              headers={"Authorization": session_client.headers["Authorization"]})
        clients.append(client)
        return tenant, client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def served(register_synthetic: Callable[..., str], start_worker: Callable[..., WorkerProcess],
           s3: S3Server, object_api: ApiServer) -> str:
    model = register_synthetic("objrefs")
    object_api.reload_routing()
    start_worker(model, env={**s3.env, "SLUICE_MAX_OBJECT_BYTES": str(WORKER_MAX_BYTES)})
    return model


def _put(s3: S3Server, tenant: str, name: str, data: bytes) -> str:
    """Put an object into the tenant's folder; answer its sha256."""
    s3.filesystem().pipe_file(s3.tenant_url(tenant, name), data)
    return hashlib.sha256(data).hexdigest()


def _submit(client: httpx.Client, model: str, **body: Any) -> dict[str, Any]:
    response = client.post(f"/v1/models/{model}/jobs", json=body)
    assert response.status_code == 202, response.text
    return dict(response.json())


def test_a_job_reads_its_input_from_s3_and_writes_its_output_there(
    tenant_on: Callable[[str], Tenant], served: str, s3: S3Server, rds: redis.Redis,
) -> None:
    tenant, client = tenant_on("objs")
    text = "hello from an object store " * 40
    digest = _put(s3, tenant, "in/one.json", json.dumps({"text": text}).encode())
    url, out = s3.tenant_url(tenant, "in/one.json"), s3.tenant_url(tenant, "out/one.json")

    queued = _submit(client, served, input_uri=url, sha256=digest.upper(), output_uri=out)
    assert queued["input_uri"] == url and queued["output_uri"] == out
    # The record holds the references, not the object or the output.
    assert text not in str(rds.hgetall(keys.job(queued["id"])))

    job = wait_job(client, queued["id"])
    assert job["status"] == "succeeded", job
    assert "output" not in job and job["output_uri"] == out
    written = s3.filesystem().cat_file(out)
    assert json.loads(written) == {"echo": {"text": text}}
    assert job["output_size"] == len(written) and job["output_sha256"] == hashlib.sha256(written).hexdigest()
    assert "echo" not in str(rds.hgetall(keys.job(queued["id"]))), "the output was kept in Redis too"

    # A path relative to the tenant's folder (no batch root here), the output kept in the job.
    inline = wait_job(client, _submit(client, served, input_uri="in/one.json")["id"])
    assert inline["status"] == "succeeded" and inline["output"] == {"echo": {"text": text}}, inline

    # A bulk submission mixes them.
    bulk = client.post(f"/v1/models/{served}/jobs:bulk", json={"jobs": [
        {"input": {"text": "inline"}, "output_uri": "out/bulk.json"}, {"input_uri": url}]})
    assert bulk.status_code == 202, bulk.text
    jobs = [wait_job(client, job_id) for job_id in bulk.json()["ids"]]
    assert [job["status"] for job in jobs] == ["succeeded"] * 2, jobs
    assert json.loads(s3.filesystem().cat_file(s3.tenant_url(tenant, "out/bulk.json"))) == \
        {"echo": {"text": "inline"}}


def test_a_wrong_sha256_or_an_object_too_large_fails_its_job_with_a_clear_code(
    tenant_on: Callable[[str], Tenant], served: str, s3: S3Server,
) -> None:
    tenant, client = tenant_on("objbad")
    _put(s3, tenant, "in/good.json", b'{"text": "fine"}')
    _put(s3, tenant, "in/large.json", json.dumps({"text": "x " * WORKER_MAX_BYTES}).encode())
    _put(s3, tenant, "in/huge.json", b"x" * (API_MAX_BYTES + 1))
    mismatch = _submit(client, served, input_uri="in/good.json", sha256="0" * 64)
    large = _submit(client, served, input_uri="in/large.json")
    jobs = [wait_job(client, mismatch["id"]), wait_job(client, large["id"])]
    assert [(job["status"], job["error"]["code"]) for job in jobs] == [
        ("failed", "input_checksum_mismatch"), ("failed", "input_too_large")], jobs

    # Over the API's limit: the owner is told at submit, by the store's size, without a read.
    too_large = client.post(f"/v1/models/{served}/jobs", json={"input_uri": "in/huge.json"})
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "payload_too_large"


def test_every_object_a_tenant_may_not_read_gets_the_answer_a_missing_object_gets(
    tenant_on: Callable[[str], Tenant], register_synthetic: Callable[..., str], s3: S3Server,
    object_api: ApiServer, rds: redis.Redis,
) -> None:
    victim, owner = tenant_on("victim")
    stranger, client = tenant_on("stranger")
    model = register_synthetic("objx")
    object_api.reload_routing()
    secret = s3.tenant_url(victim, "in/secret.json")
    _put(s3, victim, "in/secret.json", b'{"text": "confidential"}')
    _put(s3, victim, "in/huge.json", b"x" * (API_MAX_BYTES + 1))
    s3.filesystem().pipe_file(f"s3://{s3.bucket}/outside.json", b'{"text": "x"}')
    s3.filesystem().pipe_file(f"s3://{s3.bucket}/sluice/tenants/{stranger}x/in/a.json", b'{"text": "x"}')

    def answer(**body: Any) -> tuple[int, Any]:
        response = client.post(f"/v1/models/{model}/jobs", json=body)
        return response.status_code, response.json()

    baseline = answer(input_uri="in/no-such-object.json")
    assert baseline[0] == 422 and baseline[1]["error"]["message"] == REFUSED
    own = s3.tenant_url(stranger, "")
    spellings = [
        secret, s3.tenant_url(victim, "in/huge.json"), f"../{victim}/in/secret.json",
        f"..%2F{victim}%2Fin%2Fsecret.json", f"{own}../{victim}/in/secret.json", f"{own}in/../../{victim}/x",
        f"s3://{s3.bucket}/outside.json", f"s3://{s3.bucket}/sluice/tenants/{stranger}x/in/a.json",
        f"s3://other-bucket/sluice/tenants/{stranger}/in/a.json", f"s3a://{s3.bucket}/sluice/tenants/{victim}/in/x",
        f"gs://{s3.bucket}/sluice/tenants/{stranger}/in/a.json", "file:///etc/passwd", f"{own}in/",
        f"{own}in//a.json", "in/a.json?versionId=1", own,
    ]
    for uri in spellings:
        assert answer(input_uri=uri) == baseline, uri
        assert answer(input={"text": "mine"}, output_uri=uri) == baseline, uri
    bulk = client.post(f"/v1/models/{model}/jobs:bulk",
                       json={"jobs": [{"input": {"text": "mine"}}, {"input_uri": secret}]})
    assert (bulk.status_code, bulk.json()) == baseline
    assert rds.xlen(keys.stream(model, "v1", "online")) == 0 and rds.xlen(keys.stream(model, "v1", "bulk")) == 0

    # The owner is told its own object is too large; nobody else learns its size.
    too_large = owner.post(f"/v1/models/{model}/jobs", json={"input_uri": "in/huge.json"})
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "payload_too_large"


def test_a_store_that_does_not_answer_is_unavailable_not_a_refusal() -> None:
    # A closed port: the transport's error, whatever botocore calls it, is a 503 with Retry-After.
    store = ObjectStore(url="s3://bucket/sluice", storage_options={
        "key": "testing", "secret": "testing", "retries": 1,
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{_closed_port()}", "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}})
    with pytest.raises(ObjectStoreUnavailable) as unavailable:
        store.size(store.resolve("in/a.json", tenant="alice", admin=False))
    assert unavailable.value.status == 503 and unavailable.value.headers["Retry-After"]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_batch_copies_its_input_from_s3_and_a_stranger_gets_the_missing_answer(
    tenant_on: Callable[[str], Tenant], served: str, s3: S3Server, feeder: Callable[..., BatchFeeder],
) -> None:
    tenant, client = tenant_on("objbatch")
    _, stranger = tenant_on("objbatchx")
    url = s3.tenant_url(tenant, "in/rows.jsonl")
    _put(s3, tenant, "in/rows.jsonl", "".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(40)).encode())
    response = client.post("/v1/batches", json={"model": served, "input_uri": url})
    assert response.status_code == 202, response.text
    batch = response.json()
    # Copied at creation: the object changed since does not change the batch.
    _put(s3, tenant, "in/rows.jsonl", b'{"text": "changed"}\n')
    assert feeder().run(batch["id"]) == "succeeded"
    rows = [json.loads(line) for line in client.get(f"/v1/batches/{batch['id']}/output").content.splitlines()]
    assert [row["output"] for row in rows] == [{"echo": {"text": f"t{i}"}} for i in range(40)]

    baseline = client.post("/v1/batches", json={"model": served, "input_uri": "in/missing.jsonl"})
    assert baseline.status_code == 422 and baseline.json()["error"]["message"] == REFUSED
    for uri in (url, f"../{tenant}/in/rows.jsonl"):
        refused = stranger.post("/v1/batches", json={"model": served, "input_uri": uri})
        assert (refused.status_code, refused.json()) == (baseline.status_code, baseline.json()), uri
