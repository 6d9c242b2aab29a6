"""A Redis Cluster master killed under load (issue 14): its replica takes over and the platform
carries on, through redis-py's cluster client alone.

Three masters with a replica each (tests/redis_cluster.py), a failure detected after 1 s. The API
and a worker run on the cluster; submissions go on from several threads while the master that
holds the version's slot gets `kill -9`. While the cluster has not yet promoted the replica the
API answers 503 with Retry-After (never a 500); once it has, submissions are accepted again and
the worker carries on from the replica's copy of the stream and its consumer group.

Redis replicates asynchronously, so a job answered 202 in the last moment before the kill may
not have reached the replica: that count is reported, not asserted (SLUICE_DURABLE_ACCEPT waits
for the local fsync, not for a replica). Every job the new master holds must finish.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from sluice import keys
from tests.redis_cluster import LocalCluster
from tests.support import http_client, make_settings, register_synthetic_model, serving, spawn_worker, unique

pytestmark = pytest.mark.soak

THREADS = 4
COST = "fixed_s=0.001&per_item_s=0.0002"


@dataclass
class Answer:
    at: float
    status: int
    job_id: str | None = None


@dataclass
class Load:
    client_for: Callable[[], httpx.Client]
    url: str
    answers: list[Answer] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)

    def run(self, n: int) -> None:
        with self.client_for() as client:
            i = 0
            while not self.stopping.is_set():
                i += 1
                try:
                    response = client.post(self.url, json={"input": {"text": f"load {n} {i}"}})
                except httpx.HTTPError:
                    self.answers.append(Answer(time.monotonic(), 0))
                    continue
                job_id = response.json()["id"] if response.status_code == 202 else None
                self.answers.append(Answer(time.monotonic(), response.status_code, job_id))
                if response.status_code != 202:
                    time.sleep(0.05)


def test_a_master_killed_under_load_fails_over_and_every_job_it_kept_finishes(
    admin: httpx.Client, database_url: str, tmp_path: Path, figure: Callable[[str, object], None],
) -> None:
    response = admin.post("/v1/tenants", json={"id": unique("failover"), "rate_limit_per_s": 1e6})
    assert response.status_code == 201, response.text
    secret = response.json()["key"]["secret"]
    model = register_synthetic_model(admin, unique("failover"), cost=COST)
    cluster = LocalCluster(directory=tmp_path / "cluster", replicas=1, node_timeout_ms=1000)
    worker = None
    try:
        cluster.start()
        settings = make_settings(redis_url=cluster.url, database_url=database_url, home=tmp_path)
        worker = spawn_worker(redis_url=cluster.url, database_url=database_url, home=tmp_path,
                              log_path=tmp_path / "worker.log", model=model)
        with serving(settings) as api:
            load = Load(lambda: http_client(api.url, secret, timeout_s=30), f"/v1/models/{model}/jobs")
            threads = [threading.Thread(target=load.run, args=(n,), daemon=True) for n in range(THREADS)]
            for thread in threads:
                thread.start()
            time.sleep(3)
            master = cluster.nodes[cluster.node_of(keys.stream(model, "v1", "online"))]
            master.kill()
            killed_at = time.monotonic()
            time.sleep(12)
            load.stopping.set()
            for thread in threads:
                thread.join(timeout=40)

            with http_client(api.url, secret, timeout_s=30) as client:
                accepted = [a.job_id for a in load.answers if a.job_id]
                deadline = time.monotonic() + 90
                pending = set(accepted)
                kept: dict[str, str] = {}
                while pending and time.monotonic() < deadline:
                    for job_id in list(pending):
                        got = client.get(f"/v1/jobs/{job_id}")
                        assert got.status_code in (200, 404), got.text
                        status = got.json()["status"] if got.status_code == 200 else "lost"
                        if status in ("succeeded", "failed", "lost"):
                            kept[job_id] = status
                            pending.discard(job_id)
                    time.sleep(0.2)
    finally:
        if worker is not None:
            worker.terminate()
        cluster.stop()

    statuses: dict[int, int] = {}
    for answer in load.answers:
        statuses[answer.status] = statuses.get(answer.status, 0) + 1
    after = [a for a in load.answers if a.at > killed_at]
    recovered = next((a.at - killed_at for a in after if a.status == 202), None)
    outcome: dict[str, int] = {}
    for status in kept.values():
        outcome[status] = outcome.get(status, 0) + 1
    figure("answers", statuses)
    figure("accepted", len(accepted))
    figure("accepting_again_after_s", None if recovered is None else round(recovered, 2))
    figure("outcomes", outcome)
    assert set(statuses) <= {202, 503}, statuses  # down for a moment is 503, never a 500
    assert recovered is not None and recovered < 10, recovered
    assert not pending, f"{len(pending)} jobs still unfinished: {sorted(pending)[:5]}"
    assert outcome.get("failed", 0) == 0, outcome
    # Only jobs answered in the instant before the kill may be missing from the promoted replica.
    lost = [job_id for job_id, status in kept.items() if status == "lost"]
    late = {a.job_id for a in load.answers if a.job_id and a.at > killed_at - 1.0}
    assert set(lost) <= late, len(set(lost) - late)
