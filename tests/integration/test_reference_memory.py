"""The proof that a job by reference does not pass through the API or Redis: a 200 MiB input, named
by `input_uri` and verified by its sha256, runs through a `sluice api` process and a worker process
(a handler that streams the object), while the API's resident memory and Redis' `used_memory` each
grow by less than 10 MiB."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis

from launch.seed import Seeded
from sluice.artifact_store import publish
from sluice.settings import Settings
from sluice.wire import keys
from tests.own_models.counter import build_counter
from tests.support import REPO, WorkerProcess, stop_process, unique, wait_job, wait_until

# About 10 s on the 2-core machine: under the 20 s past which a test is a soak test.
pytestmark = pytest.mark.slow

OBJECT_BYTES = 200 * 1024**2
GROWTH_LIMIT = 10 * 1024**2
COUNTER = "tests.own_models.counter:ByteCounter"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _write_object(path: Path) -> tuple[str, int]:
    """200 MiB of text lines, written and hashed about a megabyte at a time; answer the sha256 and
    the number of lines."""
    digest = hashlib.sha256()
    line = b"a line of a log too large to send inline, numbered %08d\n"
    written = number = lines = 0
    with path.open("wb") as handle:
        while written < OBJECT_BYTES:
            chunk = b"".join(line % (number + i) for i in range(16384))[:OBJECT_BYTES - written]
            number += 16384
            handle.write(chunk)
            digest.update(chunk)
            written += len(chunk)
            lines += chunk.count(b"\n")
    return digest.hexdigest(), lines


@pytest.fixture
def env(redis_url: str, database_url: str, home: Path, settings: Settings) -> dict[str, str]:
    values = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    values.update({"SLUICE_REDIS_URL": redis_url, "SLUICE_DATABASE_URL": database_url, "SLUICE_HOME": str(home),
                   "SLUICE_BATCH_ROOT": str(settings.batch_root), "SLUICE_MAX_OBJECT_BYTES": str(256 * 1024**2),
                   "PYTHONUNBUFFERED": "1"})
    return values


@pytest.fixture
def demo_folder(settings: Settings) -> Iterator[Path]:
    """The demo tenant's folder, its 200 MiB object removed afterwards."""
    assert settings.batch_root is not None
    folder = settings.batch_root / "tenants" / "demo"
    folder.mkdir(parents=True, exist_ok=True)
    yield folder
    (folder / "large.log").unlink(missing_ok=True)


@contextmanager
def api_process(env: dict[str, str], tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`sluice api` on a port of its own, once ready."""
    port = _free_port()
    log_path = tmp_path / "api.log"
    with log_path.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "api", "--port", str(port)], cwd=REPO,
                                env=env, stdout=sink, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, log_path.read_text()
        try:
            return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, timeout_s=60, what="the API to be ready")
        yield proc, base
    finally:
        stop_process(proc, signal.SIGTERM)


def test_a_200_mib_input_by_reference_grows_neither_the_api_nor_redis(
    admin: httpx.Client, seeded: Seeded, env: dict[str, str], tmp_path: Path, demo_folder: Path,
    start_worker: Callable[..., WorkerProcess], rds: redis.Redis, figure: Callable[[str, object], None],
) -> None:
    model = unique("counter")
    assert admin.post("/v1/models", json={"name": model, "kind": "handler"}).status_code == 201
    published = publish(build_counter(tmp_path / "counter"), (tmp_path / "store").as_uri())
    registered = admin.post(f"/v1/models/{model}/versions", json={
        "version": "v1", "artifact": published.uri, "sha256": published.sha256, "state": "stable",
        "handler": COUNTER, "batching": {"max_batch_size": 1, "max_wait_ms": 1}})
    assert registered.status_code == 201, registered.text
    assert admin.put(f"/v1/models/{model}/routing", json={"weights": {"v1": 100}, "reason": "test"}).status_code == 200
    worker = start_worker(model, env={name: env[name] for name in ("SLUICE_BATCH_ROOT", "SLUICE_MAX_OBJECT_BYTES")})

    folder = demo_folder
    (folder / "small.log").write_bytes(b"one line\n")
    digest, lines = _write_object(folder / "large.log")
    # Started once the model is registered, so it loads it with the rest of the routing table.
    with api_process(env, tmp_path) as (proc, base), httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {seeded.demo_key}"}, timeout=60) as demo:
        def run(**body: str) -> dict[str, object]:
            response = demo.post(f"/v1/models/{model}/jobs", json=body)
            assert response.status_code == 202, response.text
            return wait_job(demo, str(response.json()["id"]), timeout_s=120)

        # Warmed first: the API's first job of a model builds what every later one reuses.
        warm = run(input_uri="small.log", output_uri="out/small.json")
        assert warm["status"] == "succeeded", (warm, worker.log())
        rss_before, redis_before = _rss_bytes(proc.pid), int(rds.info("memory")["used_memory"])

        job = run(input_uri="large.log", sha256=digest, output_uri="out/large.json")

        rss_after, redis_after = _rss_bytes(proc.pid), int(rds.info("memory")["used_memory"])
    figure("api_rss_growth_kib", (rss_after - rss_before) // 1024)
    figure("redis_used_memory_growth_kib", (redis_after - redis_before) // 1024)
    assert job["status"] == "succeeded", (job, worker.log())
    counted = json.loads((folder / "out" / "large.json").read_bytes())
    assert counted == {"bytes": OBJECT_BYTES, "lines": lines, "sha256": digest}
    assert job["output_sha256"] == hashlib.sha256((folder / "out" / "large.json").read_bytes()).hexdigest()
    assert rss_after - rss_before < GROWTH_LIMIT, (rss_before, rss_after)
    assert redis_after - redis_before < GROWTH_LIMIT, (redis_before, redis_after)
    usage = rds.memory_usage(keys.job(str(job["id"])))
    assert usage is not None and usage < 16 * 1024, usage
