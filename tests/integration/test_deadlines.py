"""A job's own limits through the REST API (ARCHITECTURE, "Deadlines, run limits and retries"):
`start_by` expires a job no worker serves, webhook and all, within one sweep of its instant; a
batch past a job's `run_timeout_s` fails it (`run_timeout`) while the worker lives on; `retry`
re-queues listed failures and shows every attempt's error; bad values are a 422 that queues
nothing; another tenant reaches none of it.

Real Redis and Postgres, the in-process API, real `sluice worker` processes, the scheduler's own
sweeper thread, a real Celery worker process and an HTTP receiver on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from launch.seed import Seeded
from scheduler.main import Scheduler, autoscaler
from sluice.kinds import ModelKind
from sluice.registry.store import Registry
from sluice.settings import Settings
from sluice.webhooks import verify
from sluice.wire import keys
from sluice.wire.connections import connect
from sluice.wire.jobs import JobRecord, JobStatus
from sluice.wire.keys import new_job_id
from sluice.wire.streams import queue_jobs
from tests.support import (
    ApiServer,
    CeleryWorker,
    Receiver,
    WorkerProcess,
    celery_worker_env,
    celery_worker_process,
    claim_one,
    drive,
    http_client,
    lane_jobs,
    receiving,
    serving,
    wait_job,
)
from workers.models.protocol import ModelHandler
from workers.worker import Worker

pytestmark = pytest.mark.slow

# A synthetic cost model whose `{"tokens": 3000}` input takes three seconds on the model.
SLOW_SYNTHETIC = "fixed_s=0.001&per_item_s=0.0002&per_token_s=0.001"
SLOW_INPUT = {"tokens": 3000}
SLOW_PASS_S = 3.0


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, tz=UTC).isoformat()


# --- start_by without any worker, webhook and all ----------------------------------------------------


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with receiving() as state:
        yield state


@pytest.fixture(scope="module")
def hooks_api(settings: Settings, seeded: Seeded) -> Iterator[ApiServer]:
    """An API replica that lets callbacks reach 127.0.0.0/8."""
    with serving(settings.model_copy(update={"webhook_allowed_networks": ["127.0.0.0/8"]})) as server:
        yield server


@pytest.fixture(scope="module")
def celery_worker(redis_url: str, database_url: str, home: Path, seeded: Seeded,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[CeleryWorker]:
    env = celery_worker_env(redis_url=redis_url, database_url=database_url, home=home, SLUICE_WEBHOOK_SWEEP_S="1")
    log_path = tmp_path_factory.mktemp("celery") / "celery.log"
    with celery_worker_process(env, log_path=log_path, name="deadlines") as worker:
        yield worker
    assert worker.proc.returncode == 0, worker.log()[-4000:]


@pytest.fixture
def sweeping(registry: Registry, redis_url: str) -> Iterator[Scheduler]:
    """The scheduler's deadline sweeper on its own thread, as `Scheduler.run` starts it, over the
    versions one tick saw (call `tick()` after registering)."""
    runner = Scheduler(registry=registry, redis_url=redis_url, supervisor=None,
                       autoscaler=autoscaler(Settings(worker_slots=2)))
    thread = threading.Thread(target=runner.run_sweeper, name="test-sweeper", daemon=True)
    thread.start()
    yield runner
    runner.request_stop()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_job_past_its_start_by_expires_without_a_worker_and_its_webhook_arrives(
    hooks_api: ApiServer, admin: httpx.Client, celery_worker: CeleryWorker, receiver: Receiver,
    register_synthetic: Callable[..., str], sweeping: Scheduler, rds: redis.Redis,
) -> None:
    created = admin.post("/v1/tenants", json={"id": f"deadline-{secrets.token_hex(3)}"}).json()
    model = register_synthetic("startby")
    hooks_api.reload_routing()
    sweeping.tick()
    with http_client(hooks_api.url, created["key"]["secret"]) as client:
        submitted_at = time.time()
        start_by = submitted_at + 2.0
        response = client.post(f"/v1/models/{model}/jobs", json={
            "input": {"text": "nobody serves me"}, "start_by": _iso(start_by),
            "callback_url": receiver.plan("/expired", 200)})
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        shown = datetime.fromisoformat(response.json()["start_by"]).timestamp()
        assert abs(shown - start_by) < 0.002, response.json()
        job = client.get(f"/v1/jobs/{job_id}", params={"wait": 5}).json()
        seen_at = time.time()
    assert job["status"] == "expired" and job["error"]["code"] == "expired", job
    assert seen_at - submitted_at < 3.0, f"expired {seen_at - submitted_at:.2f} s after submission"
    finished_at = datetime.fromisoformat(job["timings"]["finished_at"]).timestamp()
    assert finished_at >= start_by - 0.001, "expired before its start_by"
    [request] = receiver.wait_for("/expired", 1, timeout_s=30)
    assert verify(created["webhook_secret"], request.headers["sluice-signature"], request.body)
    assert json.loads(request.body)["status"] == "expired"
    assert rds.zscore(keys.deadlines(model, "v1"), keys.job(job_id)) is None


# --- what the API takes --------------------------------------------------------------------------------


def test_the_earlier_of_timeout_s_and_start_by_is_the_job_s_deadline(
    demo: httpx.Client, register_synthetic: Callable[..., str], rds: redis.Redis,
) -> None:
    model = register_synthetic("earlier")
    now = time.time()
    east = timezone(timedelta(hours=2))
    cases: list[tuple[dict[str, Any], float]] = [
        ({"timeout_s": 60, "start_by": _iso(now + 3600)}, now + 60),
        ({"timeout_s": 3600, "start_by": _iso(now + 30)}, now + 30),
        ({"start_by": datetime.fromtimestamp(now + 90, tz=east).isoformat()}, now + 90)]
    for limits, expected in cases:
        response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "x"}, **limits})
        assert response.status_code == 202, response.text
        job = response.json()
        deadline = datetime.fromisoformat(job["start_by"]).timestamp()
        assert abs(deadline - expected) < 2.0, (limits, job["start_by"])
        assert rds.zscore(keys.deadlines(model, "v1"), keys.job(job["id"])) == pytest.approx(deadline, abs=0.002)
    plain = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "x"}}).json()
    assert not {"start_by", "run_timeout_s", "retry", "attempt_errors"} & set(plain), plain


AHEAD = datetime.now(UTC) + timedelta(hours=1)


@pytest.mark.parametrize("limits, says", [
    ({"start_by": "2020-01-01T00:00:00Z"}, "has passed"),
    ({"start_by": (AHEAD + timedelta(days=30)).isoformat()}, "7 days"),
    ({"start_by": AHEAD.replace(tzinfo=None).isoformat()}, "timezone"),
    ({"start_by": AHEAD.timestamp()}, "ISO 8601"),
    ({"start_by": "tomorrow"}, "start_by"),
    ({"run_timeout_s": 0}, "run_timeout_s"),
    ({"run_timeout_s": 121}, "per-batch timeout"),
    ({"retry": {"max_attempts": 6, "on": ["run_timeout"]}}, "at most 5"),
    ({"retry": {"max_attempts": 0, "on": ["run_timeout"]}}, "max_attempts"),
    ({"retry": {"max_attempts": 2, "on": []}}, "retry.on"),
    ({"retry": {"max_attempts": 2, "on": ["inference_error"]}}, "retry.on"),
    ({"retry": {"max_attempts": 2}}, "retry.on"),
    ({"retry": {"max_attempts": 2, "on": ["timeout"], "backoff": 1}}, "backoff"),
], ids=["past", "too-far", "naive", "number", "not-a-time", "zero-run", "over-batch-timeout", "too-many",
        "no-attempt", "empty-on", "unknown-on", "missing-on", "unknown-key"])
def test_a_bad_limit_is_a_422_saying_which_and_queues_nothing(
    demo: httpx.Client, register_synthetic: Callable[..., str], rds: redis.Redis, limits: dict[str, Any], says: str,
) -> None:
    model = register_synthetic("badlimit")
    for path, body in ((f"/v1/models/{model}/jobs", {"input": {"text": "x"}, **limits}),
                       (f"/v1/models/{model}/jobs:bulk", {"inputs": [{"text": "x"}], **limits})):
        response = demo.post(path, json=body)
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] in {"invalid_input", "invalid_request"} and says in error["message"], error
    assert lane_jobs(rds, model, "v1", "online") == 0 and lane_jobs(rds, model, "v1", "bulk") == 0


def test_the_published_schema_documents_every_new_field(anon: httpx.Client) -> None:
    schemas = anon.get("/openapi.json").json()["components"]["schemas"]
    for request in ("SubmitJob", "SubmitBulk"):
        properties = schemas[request]["properties"]
        for name in ("start_by", "run_timeout_s", "retry", "timeout_s"):
            assert properties[name].get("description"), (request, name)
    job = schemas["JobResource"]["properties"]
    for name in ("start_by", "run_timeout_s", "attempt_errors", "attempts"):
        assert job[name].get("description"), name
    assert set(schemas["Retry"]["properties"]["on"]["items"]["enum"]) == {"worker_error", "timeout", "run_timeout"}
    assert all(field.get("description") for field in schemas["Retry"]["properties"].values())


# --- run_timeout_s and retry with a real worker --------------------------------------------------------


def _finished_s(job: dict[str, Any]) -> float:
    timings = job["timings"]
    return (datetime.fromisoformat(timings["finished_at"]).timestamp()
            - datetime.fromisoformat(timings["started_at"]).timestamp())


@pytest.mark.soak  # three-second passes that outlive their run timeout, and the retry's: about 11 s
def test_a_batch_past_a_job_s_run_timeout_fails_it_and_a_retry_runs_it_again(
    demo: httpx.Client, admin: httpx.Client, register_synthetic: Callable[..., str],
    start_worker: Callable[..., WorkerProcess],
) -> None:
    model = register_synthetic("runlimit", cost=SLOW_SYNTHETIC, max_wait_ms=5.0)
    worker = start_worker(model)

    once = demo.post(f"/v1/models/{model}/jobs", json={"input": SLOW_INPUT, "run_timeout_s": 0.5}).json()
    job = wait_job(demo, once["id"], timeout_s=30)
    assert job["status"] == "failed" and job["error"]["code"] == "run_timeout", job
    assert "0.5" in job["error"]["message"] and job["run_timeout_s"] == 0.5 and job["attempts"] == 1
    # Failed at its limit, not when the three-second pass ended.
    assert 0.45 <= _finished_s(job) < SLOW_PASS_S - 1.0, job["timings"]
    assert "attempt_errors" not in job and "retry" not in job

    policy = {"max_attempts": 2, "on": ["run_timeout"]}
    retried = demo.post(f"/v1/models/{model}/jobs",
                        json={"input": SLOW_INPUT, "run_timeout_s": 0.5, "retry": policy}).json()
    assert retried["retry"] == policy
    job = wait_job(demo, retried["id"], timeout_s=60)
    assert job["status"] == "failed" and job["error"]["code"] == "run_timeout", job
    assert job["attempts"] == 2 and job["retry"] == policy
    [first] = job["attempt_errors"]
    assert first["attempt"] == 1 and first["error"]["code"] == "run_timeout", first
    assert datetime.fromisoformat(first["at"]) <= datetime.fromisoformat(job["timings"]["finished_at"])

    # The worker lived through all of it: the model, free again, runs the next job.
    quick = demo.post(f"/v1/models/{model}/jobs",
                      json={"input": {"tokens": 1}, "run_timeout_s": 5, "retry": policy}).json()
    job = wait_job(demo, quick["id"], timeout_s=30)
    assert job["status"] == "succeeded" and job["attempts"] == 1 and "attempt_errors" not in job, job
    assert worker.proc.poll() is None, worker.log()
    assert "run_timeout_s of 0.5 s" in worker.log() and "Traceback" not in worker.log(), worker.log()


MARK = "the marked input"


class FaultingHandler(ModelHandler):
    """Echoes its inputs, but a batch holding MARK raises what a broken device would: the
    worker's failure (`worker_error`), not the input's."""

    kind = ModelKind.synthetic
    length_buckets = True

    def warmup(self) -> None:
        """Nothing to warm."""

    @staticmethod
    def passes(inputs: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        return [list(range(len(inputs)))]

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        if any(item["text"] == MARK for item in inputs):
            raise RuntimeError(f"device lost while running {MARK!r}")
        return [{"echo": dict(item)} for item in inputs]


async def _served_by_a_faulting_worker(redis_url: str, model: str, ids: list[str]) -> None:
    """A worker in this process, over real Redis, whose reclaim comes after 0.3 s, until `ids` are final."""
    client = connect(redis_url, max_connections=8)
    try:
        worker = Worker(redis=client, model=model, version="v1", handler=FaultingHandler(), max_batch_size=4,
                        max_wait_ms=5, claim_after_s=0.3, max_deliveries=3, shutdown_grace_s=5)
        await drive([worker], client, ids, timeout_s=30)
    finally:
        await client.aclose()


def test_a_run_lost_to_a_worker_error_is_retried_as_the_job_s_policy_says(
    demo: httpx.Client, register_synthetic: Callable[..., str], redis_url: str,
) -> None:
    model = register_synthetic("workererror")
    policy = {"max_attempts": 2, "on": ["worker_error"]}
    capped = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": MARK}, "retry": policy}).json()["id"]
    plain = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": MARK}}).json()["id"]
    asyncio.run(_served_by_a_faulting_worker(redis_url, model, [capped, plain]))
    for job_id, starts in ((capped, 2), (plain, 3)):  # its policy's starts; else max_deliveries
        job = demo.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "failed" and job["error"]["code"] == "max_deliveries", job
        assert job["attempts"] == starts, job
        noted = job["attempt_errors"]
        assert [(each["attempt"], each["error"]["code"]) for each in noted] == [
            (n, "worker_error") for n in range(1, starts + 1)], noted
        assert "RuntimeError: device lost while running '[input]'" in noted[0]["error"]["message"], noted
        assert MARK not in json.dumps(job["attempt_errors"])


# --- the claim script's cap on starts ------------------------------------------------------------------


def _running(rds: redis.Redis, model: str, *, attempts: int, retry: str | None) -> str:
    """A job as a worker that died mid-run leaves it: `running`, started `attempts` times."""
    record = JobRecord(id=new_job_id(model, "v1"), tenant="demo", model=model, version="v1", lane="online",
                       status=JobStatus.running, input={"text": "x"}, enqueued_at=time.time(), attempts=attempts,
                       retry=retry)
    pipe = rds.pipeline(transaction=False)
    queue_jobs(pipe, [record], result_ttl_s=600)
    pipe.execute()
    return record.id


@pytest.mark.parametrize("retry, attempts, verdict", [
    (None, 2, "run"),  # max_deliveries (3) starts
    (None, 3, "dead"),
    ("2:worker_error,run_timeout", 1, "run"),
    ("2:worker_error,run_timeout", 2, "dead"),  # listing worker_error: exactly max_attempts starts
    ("5:run_timeout", 4, "run"),  # a larger policy is not cut short by max_deliveries
    ("5:run_timeout", 5, "dead"),
])
def test_a_job_s_retry_policy_sets_its_cap_on_starts_and_a_lost_run_is_noted(
    rds: redis.Redis, retry: str | None, attempts: int, verdict: str,
) -> None:
    model = f"capped-{secrets.token_hex(3)}"
    job_id = _running(rds, model, attempts=attempts, retry=retry)
    assert claim_one(rds, model, job_id, "demo")[0] == verdict
    noted = json.loads(rds.hget(keys.job(job_id), "attempt_errors") or "[]")  # type: ignore[arg-type]
    assert [each["error"] for each in noted] == [{"code": "worker_error",
                                                  "message": "its worker died while running it"}]
    if verdict == "dead":
        assert json.loads(rds.hget(keys.job(job_id), "error"))["code"] == "max_deliveries"  # type: ignore[arg-type]


# --- another tenant ------------------------------------------------------------------------------------


def test_another_tenant_reaches_none_of_a_job_s_limits(
    demo: httpx.Client, new_tenant: Callable[..., tuple[str, httpx.Client]],
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("limits-tenancy")
    job_id = demo.post(f"/v1/models/{model}/jobs", json={
        "input": {"text": "mine"}, "start_by": _iso(time.time() + 600), "run_timeout_s": 1,
        "retry": {"max_attempts": 2, "on": ["worker_error"]}}).json()["id"]
    _, other = new_tenant("limits-other")
    for answer, unknown in ((other.get(f"/v1/jobs/{job_id}"), other.get("/v1/jobs/job_nothing")),
                            (other.get(f"/v1/jobs/{job_id}", params={"wait": 0.2}),
                             other.get("/v1/jobs/job_nothing", params={"wait": 0.2})),
                            (other.delete(f"/v1/jobs/{job_id}"), other.delete("/v1/jobs/job_nothing"))):
        assert answer.status_code == unknown.status_code == 404
        assert answer.json()["error"]["code"] == unknown.json()["error"]["code"]
    listed = other.get("/v1/jobs", params={"ids": job_id}).json()
    assert listed["not_found"] == [job_id] and listed["jobs"] == [], listed
    assert demo.get(f"/v1/jobs/{job_id}").json()["retry"]["on"] == ["worker_error"]


# --- a version's defaults --------------------------------------------------------------------------------


def _version(admin: httpx.Client, model: str, version: str = "v1") -> dict[str, Any]:
    response = admin.get(f"/v1/models/{model}/versions/{version}")
    assert response.status_code == 200, response.text
    resource: dict[str, Any] = response.json()
    return resource


def test_an_admin_sets_a_version_s_job_limits_audited_and_null_clears_one(
    admin: httpx.Client, demo: httpx.Client, anon: httpx.Client, register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("vlimits")
    assert {k: _version(admin, model)[k] for k in ("max_queue_s", "run_timeout_s")} == {
        "max_queue_s": None, "run_timeout_s": None}
    patched = admin.patch(f"/v1/models/{model}/versions/v1",
                          json={"max_queue_s": 30, "run_timeout_s": 5, "reason": "defaults"})
    assert patched.status_code == 200, patched.text
    assert (patched.json()["max_queue_s"], patched.json()["run_timeout_s"]) == (30, 5)
    # Left out, a default is kept; null clears it.
    assert admin.patch(f"/v1/models/{model}/versions/v1", json={"cache_ttl_s": 0}).status_code == 200
    cleared = admin.patch(f"/v1/models/{model}/versions/v1", json={"run_timeout_s": None, "reason": "no limit"})
    assert cleared.status_code == 200, cleared.text
    shown = _version(admin, model)
    assert (shown["max_queue_s"], shown["run_timeout_s"]) == (30, None), shown
    assert admin.get(f"/v1/models/{model}").json()["versions"][0]["max_queue_s"] == 30
    entries = admin.get(f"/v1/models/{model}/audit").json()["entries"]
    assert [e["action"] for e in entries[:3]] == ["version.update"] * 3
    set_, cleared_entry = entries[2], entries[0]
    assert set_["reason"] == "defaults" and set_["before"]["max_queue_s"] is None
    assert (set_["after"]["max_queue_s"], set_["after"]["run_timeout_s"]) == (30, 5)
    assert cleared_entry["reason"] == "no limit"
    assert (cleared_entry["before"]["run_timeout_s"], cleared_entry["after"]["run_timeout_s"]) == (5, None)
    assert cleared_entry["after"]["max_queue_s"] == 30

    # A tenant key gets what it gets on any admin route, and changes nothing.
    refused = demo.patch(f"/v1/models/{model}/versions/v1", json={"max_queue_s": 1})
    other_admin_route = demo.patch(f"/v1/models/{model}/versions/v1", json={"state": "retired"})
    assert refused.status_code == other_admin_route.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == other_admin_route.json()["error"]["code"]
    assert demo.post(f"/v1/models/{model}/versions", json={
        "version": "v9", "artifact": "synthetic:", "sha256": "0" * 64, "max_queue_s": 1}).status_code == 403
    assert _version(admin, model)["max_queue_s"] == 30
    assert len(admin.get(f"/v1/models/{model}/audit").json()["entries"]) == len(entries)

    registered = admin.post(f"/v1/models/{model}/versions", json={
        "version": "v2", "artifact": "synthetic:", "sha256": "0" * 64, "max_queue_s": 60, "run_timeout_s": 2.5})
    assert registered.status_code == 201, registered.text
    assert (registered.json()["max_queue_s"], registered.json()["run_timeout_s"]) == (60, 2.5)
    assert (_version(admin, model, "v2")["max_queue_s"], _version(admin, model, "v2")["run_timeout_s"]) == (60, 2.5)

    schemas = anon.get("/openapi.json").json()["components"]["schemas"]
    for schema in ("RegisterVersion", "UpdateVersion", "VersionResource"):
        for name in ("max_queue_s", "run_timeout_s"):
            assert schemas[schema]["properties"][name].get("description"), (schema, name)


@pytest.mark.parametrize("limits, says", [
    ({"max_queue_s": 0}, "max_queue_s"),
    ({"max_queue_s": -5}, "max_queue_s"),
    ({"max_queue_s": 8 * 24 * 3600}, "max_queue_s"),
    ({"max_queue_s": "soon"}, "max_queue_s"),
    ({"run_timeout_s": 0}, "run_timeout_s"),
    ({"run_timeout_s": 121}, "per-batch timeout"),
], ids=["zero-queue", "negative-queue", "queue-over-7-days", "queue-not-a-number", "zero-run",
        "run-over-batch-timeout"])
def test_a_bad_version_limit_is_a_422_saying_which_and_changes_nothing(
    admin: httpx.Client, register_synthetic: Callable[..., str], limits: dict[str, Any], says: str,
) -> None:
    model = register_synthetic("badvlimit")
    entries = admin.get(f"/v1/models/{model}/audit").json()["entries"]
    for response in (admin.patch(f"/v1/models/{model}/versions/v1", json=limits),
                     admin.post(f"/v1/models/{model}/versions",
                                json={"version": "v2", "artifact": "synthetic:", "sha256": "0" * 64, **limits})):
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] in {"invalid_input", "invalid_request"} and says in error["message"], error
    shown = _version(admin, model)
    assert (shown["max_queue_s"], shown["run_timeout_s"]) == (None, None)
    assert [v["version"] for v in admin.get(f"/v1/models/{model}").json()["versions"]] == ["v1"]
    assert admin.get(f"/v1/models/{model}/audit").json()["entries"] == entries


def test_a_job_naming_no_start_deadline_expires_at_its_version_s_max_queue_s(
    api: ApiServer, admin: httpx.Client, demo: httpx.Client, register_synthetic: Callable[..., str],
    sweeping: Scheduler,
) -> None:
    model = register_synthetic("vqueue")
    assert admin.patch(f"/v1/models/{model}/versions/v1", json={"max_queue_s": 1}).status_code == 200
    api.reload_routing()
    sweeping.tick()
    submitted_at = time.time()
    response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "nobody serves me"}})
    assert response.status_code == 202, response.text
    shown = datetime.fromisoformat(response.json()["start_by"]).timestamp()
    assert submitted_at - 0.002 <= shown - 1.0 <= time.time(), response.json()
    job = demo.get(f"/v1/jobs/{response.json()['id']}", params={"wait": 5}).json()
    seen_at = time.time()
    assert job["status"] == "expired" and job["error"]["code"] == "expired", job
    assert seen_at - submitted_at < 2.5, f"expired {seen_at - submitted_at:.2f} s after submission"


def test_a_job_takes_its_version_s_defaults_and_its_own_limits_win(
    api: ApiServer, admin: httpx.Client, demo: httpx.Client, register_synthetic: Callable[..., str],
    rds: redis.Redis,
) -> None:
    model = register_synthetic("vdefaults")
    assert admin.patch(f"/v1/models/{model}/versions/v1",
                       json={"max_queue_s": 600, "run_timeout_s": 7}).status_code == 200
    api.reload_routing()
    now = time.time()
    cases: list[tuple[dict[str, Any], float, float]] = [
        ({}, now + 600, 7),
        ({"timeout_s": 3600, "run_timeout_s": 60}, now + 3600, 60),
        ({"start_by": _iso(now + 30), "run_timeout_s": 0.5}, now + 30, 0.5)]
    for limits, start_by, run_timeout_s in cases:
        response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "x"}, **limits})
        assert response.status_code == 202, response.text
        for job in (response.json(), demo.get(f"/v1/jobs/{response.json()['id']}").json()):
            deadline = datetime.fromisoformat(job["start_by"]).timestamp()
            assert abs(deadline - start_by) < 2.0 and job["run_timeout_s"] == run_timeout_s, (limits, job)
        assert rds.zscore(keys.deadlines(model, "v1"), keys.job(job["id"])) == pytest.approx(deadline, abs=0.002)
    bulk = demo.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": [{"text": "a"}, {"text": "b"}]})
    assert bulk.status_code == 202, bulk.text
    for job_id in bulk.json()["ids"]:
        job = demo.get(f"/v1/jobs/{job_id}").json()
        assert abs(datetime.fromisoformat(job["start_by"]).timestamp() - (now + 600)) < 2.0, job
        assert job["run_timeout_s"] == 7, job

    assert admin.patch(f"/v1/models/{model}/versions/v1",
                       json={"max_queue_s": None, "run_timeout_s": None}).status_code == 200
    api.reload_routing()
    plain = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "x"}}).json()
    assert not {"start_by", "run_timeout_s"} & set(plain), plain
