"""The proof that a job by reference does not pass through the API or Redis: a 200 MiB input, named
by `input_uri` and verified by its sha256, runs through a `sluice api` process and a worker process
(a handler that streams the object), while the API's resident memory and Redis' `used_memory` each
grow by less than 10 MiB. Once for a file under the batch root, and once (a soak test: the object
goes up to and down from the server) for an object in a local S3 server (moto, through s3fs)."""

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
from typing import IO

import httpx
import pytest
import redis

from launch.seed import Seeded
from sluice.artifact_store import publish
from sluice.settings import Settings
from sluice.wire import keys
from tests.own_models.counter import build_counter
from tests.s3_server import S3Server, s3_server
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


def _write_object(handle: IO[bytes]) -> tuple[str, int]:
    """200 MiB of text lines, written and hashed about a megabyte at a time; answer the sha256 and
    the number of lines."""
    digest = hashlib.sha256()
    line = b"a line of a log too large to send inline, numbered %08d\n"
    written = number = lines = 0
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


class Store:
    """Where the test's objects go: the demo tenant's folder under the batch root, or in S3."""

    def __init__(self, *, folder: Path, s3: S3Server | None) -> None:
        self.folder = folder
        self.s3 = s3

    def uri(self, name: str) -> str:
        return self.s3.tenant_url("demo", name) if self.s3 is not None else name

    def open(self, name: str, mode: str) -> IO[bytes]:
        if self.s3 is not None:
            handle: IO[bytes] = self.s3.filesystem().open(self.uri(name), mode)
            return handle
        (self.folder / name).parent.mkdir(parents=True, exist_ok=True)
        return (self.folder / name).open(mode)

    def read(self, name: str) -> bytes:
        with self.open(name, "rb") as handle:
            return handle.read()


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.soak)])
def store(request: pytest.FixtureRequest, settings: Settings) -> Iterator[Store]:
    """The demo tenant's folder (and, for S3, a server of the test's own), its 200 MiB object
    removed afterwards."""
    assert settings.batch_root is not None
    folder = settings.batch_root / "tenants" / "demo"
    folder.mkdir(parents=True, exist_ok=True)
    if request.param == "file":
        yield Store(folder=folder, s3=None)
        (folder / "large.log").unlink(missing_ok=True)
        return
    with s3_server() as s3:
        yield Store(folder=folder, s3=s3)


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
    admin: httpx.Client, seeded: Seeded, env: dict[str, str], tmp_path: Path, store: Store,
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
    references = {name: env[name] for name in ("SLUICE_BATCH_ROOT", "SLUICE_MAX_OBJECT_BYTES")}
    if store.s3 is not None:
        references.update(store.s3.env)
        env = {**env, **store.s3.env}
    worker = start_worker(model, env=references)

    with store.open("small.log", "wb") as handle:
        handle.write(b"one line\n")
    with store.open("large.log", "wb") as handle:
        digest, lines = _write_object(handle)
    # Started once the model is registered, so it loads it with the rest of the routing table.
    with api_process(env, tmp_path) as (proc, base), httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {seeded.demo_key}"}, timeout=60) as demo:
        def run(**body: str) -> dict[str, object]:
            response = demo.post(f"/v1/models/{model}/jobs", json=body)
            assert response.status_code == 202, response.text
            return wait_job(demo, str(response.json()["id"]), timeout_s=120)

        # Warmed first: the API's first job of a model builds what every later one reuses.
        warm = run(input_uri=store.uri("small.log"), output_uri=store.uri("out/small.json"))
        assert warm["status"] == "succeeded", (warm, worker.log())
        rss_before, redis_before = _rss_bytes(proc.pid), int(rds.info("memory")["used_memory"])

        job = run(input_uri=store.uri("large.log"), sha256=digest, output_uri=store.uri("out/large.json"))

        rss_after, redis_after = _rss_bytes(proc.pid), int(rds.info("memory")["used_memory"])
    figure("api_rss_growth_kib", (rss_after - rss_before) // 1024)
    figure("redis_used_memory_growth_kib", (redis_after - redis_before) // 1024)
    assert job["status"] == "succeeded", (job, worker.log())
    output = store.read("out/large.json")
    assert json.loads(output) == {"bytes": OBJECT_BYTES, "lines": lines, "sha256": digest}
    assert job["output_sha256"] == hashlib.sha256(output).hexdigest()
    assert rss_after - rss_before < GROWTH_LIMIT, (rss_before, rss_after)
    assert redis_after - redis_before < GROWTH_LIMIT, (redis_before, redis_after)
    usage = rds.memory_usage(keys.job(str(job["id"])))
    assert usage is not None and usage < 16 * 1024, usage
