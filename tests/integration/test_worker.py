"""A real `sluice worker` process on a synthetic model (no torch, starts in about a second):
bisection of a poisoned batch, expiry before start, the batch-size cap, draining on SIGTERM, and
a busy worker leaving new jobs to an idle one.

Jobs are mostly submitted before the worker starts, so the worker finds them all at once and
the batches it forms do not depend on how fast this test submits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx
import pytest
import redis

from sluice.wire import keys
from sluice.wire.connections import is_cluster
from tests.support import lane_jobs, wait_until

pytestmark = pytest.mark.slow

Jobs = list[dict[str, Any]]


def bulk(client: httpx.Client, model: str, inputs: list[dict[str, Any]], **options: Any) -> list[str]:
    response = client.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": inputs, **options})
    assert response.status_code == 202, response.text
    return list(response.json()["ids"])


def test_a_poison_input_fails_alone_and_the_rest_of_its_batch_succeeds(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    wait_jobs: Callable[..., Jobs], pending: Callable[[str, str], int],
) -> None:
    model = register_synthetic("poison", max_batch_size=32, max_wait_ms=20)
    inputs = [{"text": f"ordinary text {i}"} for i in range(20)]
    inputs[7] = {"text": "__poison__"}
    ids = bulk(demo, model, inputs)
    start_worker(model)

    jobs = wait_jobs(demo, ids)
    statuses = [job["status"] for job in jobs]
    assert statuses == ["succeeded"] * 7 + ["failed"] + ["succeeded"] * 12
    poisoned = jobs[7]
    assert poisoned["error"]["code"] == "inference_error"
    assert "poison" in poisoned["error"]["message"]
    assert "output" not in poisoned
    for job, given in zip(jobs, inputs, strict=True):
        if job["status"] == "succeeded":
            assert job["output"] == {"echo": given}
    # They were one batch: the poison input did not cost the other 19 their results.
    assert {job["batch"]["size"] for job in jobs} == {20}
    assert pending(model, "v1") == 0


def test_a_job_past_its_deadline_expires_without_being_computed(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    wait_jobs: Callable[..., Jobs], pending: Callable[[str, str], int], rds: redis.Redis,
) -> None:
    model = register_synthetic("expiry")
    [doomed] = bulk(demo, model, [{"text": "too late"}], timeout_s=0.001)
    [control] = bulk(demo, model, [{"text": "in time"}])
    time.sleep(0.05)  # well past the 1 ms deadline, and no worker yet
    start_worker(model)

    expired, done = wait_jobs(demo, [doomed, control])
    assert done["status"] == "succeeded"
    assert expired["status"] == "expired"
    assert expired["error"]["code"] == "expired"
    assert "output" not in expired
    assert expired["attempts"] == 0
    assert expired["timings"]["started_at"] is None
    assert expired["batch"] == {"size": None, "close_reason": None}
    # Only the control job reached the model: one latency sample for this version.
    assert rds.xlen(keys.stats(model, "v1")) == 1
    assert pending(model, "v1") == 0


def test_batches_never_exceed_max_batch_size(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    wait_jobs: Callable[..., Jobs], rds: redis.Redis,
) -> None:
    model = register_synthetic("capped", max_batch_size=8, max_wait_ms=50)
    ids = bulk(demo, model, [{"text": f"job number {i}"} for i in range(60)])
    start_worker(model)

    jobs = wait_jobs(demo, ids)
    assert {job["status"] for job in jobs} == {"succeeded"}
    sizes = [job["batch"]["size"] for job in jobs]
    assert all(1 <= size <= 8 for size in sizes), sizes
    # With 60 jobs waiting, full batches close by size.
    assert any(job["batch"] == {"size": 8, "close_reason": "size"} for job in jobs)
    samples = rds.xrange(keys.stats(model, "v1"))
    assert len(samples) == 60
    assert max(int(fields["b"]) for _, fields in samples) == 8  # type: ignore[union-attr]


def test_a_version_whose_batches_hold_one_job_drains_a_bulk_backlog(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    wait_jobs: Callable[..., Jobs],
) -> None:
    model = register_synthetic("one-at-a-time", max_batch_size=1, max_wait_ms=0)
    start_worker(model)
    # A running worker: the bulk jobs past the first are held (queue.lua) for the worker to release.
    ids = bulk(demo, model, [{"text": f"job number {i}"} for i in range(40)])

    jobs = wait_jobs(demo, ids)
    assert {job["status"] for job in jobs} == {"succeeded"}
    assert {job["batch"]["size"] for job in jobs} == {1}


def test_sigterm_drains_what_the_worker_read_and_leaves_nothing_pending(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    pending: Callable[[str, str], int], rds: redis.Redis,
) -> None:
    # 0.25 s a batch of at most 4: the worker holds a few batches when the signal lands.
    model = register_synthetic("drain", cost="fixed_s=0.25&per_item_s=0&per_token_s=0", max_batch_size=4,
                               max_wait_ms=5)
    ids = bulk(demo, model, [{"text": f"drain me {i}"} for i in range(60)])
    worker = start_worker(model)
    deadline = time.monotonic() + 30
    while demo.get(f"/v1/jobs/{ids[0]}").json()["status"] != "succeeded":
        assert time.monotonic() < deadline, worker.log()
        time.sleep(0.02)

    assert worker.terminate(timeout_s=30) == 0, worker.log()

    jobs = [demo.get(f"/v1/jobs/{job_id}").json() for job_id in ids]
    by_status: dict[str, int] = {}
    for job in jobs:
        by_status[job["status"]] = by_status.get(job["status"], 0) + 1
    # Everything it read finished; what it never read is still queued for the next worker.
    assert set(by_status) == {"succeeded", "queued"}, by_status
    assert by_status["queued"] >= 20, by_status
    assert pending(model, "v1") == 0
    assert lane_jobs(rds, model, "v1", "bulk") == by_status["queued"]
    for job in jobs:
        if job["status"] == "succeeded":
            assert 1 <= job["batch"]["size"] <= 4
            assert job["batch"]["close_reason"] in {"size", "age", "drain"}
    # The worker said goodbye: its heartbeat is gone.
    assert not list(rds.scan_iter(match=keys.heartbeat_pattern(model, "v1")))


def _blocked_stream_readers(rds: redis.Redis, model: str) -> int:
    """Clients blocked in XREADGROUP on the node that holds the model's streams (on a cluster,
    CLIENT LIST answers one node's clients)."""
    if is_cluster(rds):
        node = rds.get_node_from_key(keys.stream(model, "v1", "online"))  # type: ignore[attr-defined]
        clients = rds.client_list(target_nodes=node)  # type: ignore[call-arg]
    else:
        clients = rds.client_list()
    return sum(1 for client in clients if client["cmd"] == "xreadgroup" and "b" in client["flags"])


def test_a_worker_whose_model_is_busy_leaves_a_new_job_to_an_idle_one(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    wait_jobs: Callable[..., Jobs], rds: redis.Redis,
) -> None:
    # 1.5 s a batch: the second job arrives while one worker's model is busy with the first.
    model = register_synthetic("idle", cost="fixed_s=1.5&per_item_s=0&per_token_s=0", max_batch_size=4,
                               max_wait_ms=0)
    others_blocked = _blocked_stream_readers(rds, model)
    start_worker(model)
    start_worker(model)
    [first] = bulk(demo, model, [{"text": "first"}])
    deadline = time.monotonic() + 10
    while rds.hget(keys.job(first), "status") != "running":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # The idle worker is blocked on the streams (a loaded machine can still be starting it), so
    # the arrival goes to it rather than to the busy worker's next non-blocking read.
    wait_until(lambda: _blocked_stream_readers(rds, model) > others_blocked, timeout_s=10,
               what="the idle worker's blocking read", interval_s=0.01)
    [second] = bulk(demo, model, [{"text": "second"}])

    jobs = wait_jobs(demo, [first, second])
    assert [job["status"] for job in jobs] == ["succeeded", "succeeded"]
    # It ran beside the first on the other worker, not in the busy one's prefetch after it.
    assert rds.hget(keys.job(first), "worker") != rds.hget(keys.job(second), "worker")
    started = datetime.fromisoformat(jobs[1]["timings"]["started_at"])
    assert started < datetime.fromisoformat(jobs[0]["timings"]["finished_at"]), jobs


class _StreamReads:
    """The XREADGROUP calls on a model's online stream, with their server times (MONITOR)."""

    def __init__(self, rds: redis.Redis, model: str) -> None:
        self.stream = keys.stream(model, "v1", "online")
        self.times: list[float] = []
        self._stop = threading.Event()
        self._monitor = rds.monitor().__enter__()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        for command in self._monitor.listen():
            if self._stop.is_set():
                return
            if command["command"].startswith("XREADGROUP") and self.stream in command["command"]:
                self.times.append(float(command["time"]))

    def stop(self, rds: redis.Redis) -> None:
        self._stop.set()
        rds.ping()  # one more command, so that the listener sees the flag
        self._thread.join(timeout=10)
        self._monitor.__exit__()


def test_a_worker_whose_model_is_busy_reads_again_only_when_its_pass_ends(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    wait_jobs: Callable[..., Jobs], rds: redis.Redis,
) -> None:
    """A read that emptied the streams is not repeated while the model runs: the second job,
    arriving during the first one's pass, is read once that pass ends, by the read that would
    have waited for it anyway. The worker read beside its busy model and at once again after each
    claim, up to five reads a job where one does."""
    if is_cluster(rds):
        pytest.skip("counts reads with MONITOR, which shows the commands of one node")
    # Passes shorter than the reader's 250 ms nap, so that no nap times out during one.
    model = register_synthetic("reads", cost="fixed_s=0.15&per_item_s=0&per_token_s=0", max_batch_size=4,
                               max_wait_ms=0)
    start_worker(model)
    # Past the first blocking read of a worker just started: the runner's first idle signal may
    # still be set until that read times out, and would end the first nap at once.
    time.sleep(0.6)
    reads = _StreamReads(rds, model)
    try:
        [first] = bulk(demo, model, [{"text": "first"}], lane="online")
        wait_until(lambda: rds.hget(keys.job(first), "status") == "running", timeout_s=10,
                   what="the first job's pass", interval_s=0.005)
        [second] = bulk(demo, model, [{"text": "second"}], lane="online")
        jobs = wait_jobs(demo, [first, second])
    finally:
        reads.stop(rds)
    assert [job["status"] for job in jobs] == ["succeeded", "succeeded"]
    started, first_done, second_done = (datetime.fromisoformat(jobs[i]["timings"][field]).timestamp()
                                        for i, field in ((0, "started_at"), (0, "finished_at"), (1, "finished_at")))
    # None while the first job's pass ran; after it, the read that took the second job (and at most
    # one more, should the second arrive only after that read's 250 ms had run out).
    assert [t for t in reads.times if started < t < first_done] == [], reads.times
    assert len([t for t in reads.times if started < t < second_done]) <= 2, reads.times


def _queue_wait_s(job: dict[str, Any]) -> float:
    return float(job["timings"]["queue_wait_ms"]) / 1000


@pytest.mark.parametrize("adaptive", [True, False])
def test_a_lone_job_waits_for_company_only_when_more_are_expected(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    wait_jobs: Callable[..., Jobs], adaptive: bool,
) -> None:
    """With the adaptive window (the default) a job arriving alone starts at once, while jobs
    arriving together still wait out `max_wait_ms` for more; with it off, both wait it out."""
    model = register_synthetic("window", max_batch_size=32, max_wait_ms=1500)
    start_worker(model, env={"SLUICE_BATCH_ADAPTIVE_WAIT": str(adaptive).lower()})
    time.sleep(1.2)  # past the arrival gaps' horizon: nothing recent to wait for
    [lone] = bulk(demo, model, [{"text": "alone"}], lane="online")
    [lone_job] = wait_jobs(demo, [lone])
    together = bulk(demo, model, [{"text": f"together {i}"} for i in range(5)], lane="online")
    jobs = wait_jobs(demo, together)
    assert {job["batch"]["size"] for job in jobs} == {5}
    assert min(_queue_wait_s(job) for job in jobs) >= 1.4, jobs
    if adaptive:
        assert _queue_wait_s(lone_job) < 0.75, lone_job
    else:
        assert _queue_wait_s(lone_job) >= 1.4, lone_job
