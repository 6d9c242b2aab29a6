"""Artifacts fetched over HTTPS: a store published to file:// and served by a local HTTPS server
(http.server in a thread, a self-signed certificate made by openssl for 127.0.0.1), fetched by
sluice.artifact_store through fsspec's HTTP filesystem (aiohttp)."""

from __future__ import annotations

import hashlib
import http.server
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.artifact_store import fetch, publish, resolve_and_verify, store_uri
from sluice.artifacts import MANIFEST_NAME, artifact_sha256
from sluice.errors import ArtifactError, ArtifactMismatch
from tests.hf_models import build_tiny_encoder
from tests.support import WorkerProcess, unique, wait_job

FILES = {
    "config.json": b'{"hidden_size": 4}\n',
    "tokenizer.json": b'{"model": {"vocab": {}}}\n',
    "vocab.txt": b"[PAD]\n[UNK]\nhello\n",
    "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      weights" * 1000,
    "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}\n',
    "with space/name #1.txt": b"quoted in URLs",
}


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *_: Any) -> None:
        pass


class QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, *_: Any) -> None:  # a client that refuses the certificate hangs up
        pass


@dataclass
class Store:
    root: Path  # the published store, as files
    https_url: str  # the same store served over HTTPS
    cert: Path  # the server's self-signed certificate: its own CA bundle
    dir_sha256: str
    file_sha256: str


def _certificate(folder: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    model = tmp_path / "model"
    for name, data in FILES.items():
        (model / name).parent.mkdir(parents=True, exist_ok=True)
        (model / name).write_bytes(data)
    head = tmp_path / "head.safetensors"
    head.write_bytes(b"head weights")
    root = tmp_path / "store"
    dir_sha = publish(model, f"file://{root}").sha256
    file_sha = publish(head, f"file://{root}").sha256
    cert, key = _certificate(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    server = QuietServer(("127.0.0.1", 0), partial(QuietHandler, directory=str(root)))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, name="https-store", daemon=True)
    thread.start()
    try:
        yield Store(root, f"https://127.0.0.1:{server.server_address[1]}", cert, dir_sha, file_sha)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_directory_and_a_file_are_fetched_over_https_with_the_ca_bundle(tmp_path: Path, store: Store) -> None:
    cache = tmp_path / "cache"
    uri = store_uri(store.https_url, store.dir_sha256)
    path = fetch(uri, store.dir_sha256, cache_dir=cache, ca_bundle=store.cert)
    assert path == cache / store.dir_sha256
    assert {name: (path / name).read_bytes() for name in FILES} == FILES
    assert artifact_sha256(path) == store.dir_sha256 and (path / MANIFEST_NAME).is_file()
    # The same through resolve_and_verify, load options and all; a cache hit this time.
    assert resolve_and_verify(f"{uri}?quantize=int8", store.dir_sha256, cache_dir=cache, ca_bundle=store.cert) == path
    head_uri = store_uri(store.https_url, store.file_sha256, "head.safetensors")
    head = fetch(head_uri, store.file_sha256, cache_dir=cache, ca_bundle=store.cert)
    assert head.read_bytes() == b"head weights" and head.name == "head.safetensors"


def test_without_the_ca_bundle_the_self_signed_store_is_refused(tmp_path: Path, store: Store) -> None:
    uri = store_uri(store.https_url, store.dir_sha256)
    with pytest.raises(ArtifactError) as info:
        fetch(uri, store.dir_sha256, cache_dir=tmp_path / "cache")
    assert not isinstance(info.value, ArtifactMismatch)
    message = str(info.value)
    assert uri in message and "certificate is not trusted" in message and "CA bundle" in message
    assert not any((tmp_path / "cache").iterdir())


def test_a_file_changed_on_the_server_after_publishing_is_refused(tmp_path: Path, store: Store) -> None:
    changed = store.root / "sha256" / store.dir_sha256 / "tokenizer.json"
    changed.write_bytes(b'{"model": {"vocab": {"evil": 0}}}\n')
    uri = store_uri(store.https_url, store.dir_sha256)
    with pytest.raises(ArtifactMismatch) as info:
        fetch(uri, store.dir_sha256, cache_dir=tmp_path / "cache", ca_bundle=store.cert)
    message = str(info.value)
    assert f"{uri}/tokenizer.json" in message and store.dir_sha256 in message
    assert hashlib.sha256(changed.read_bytes()).hexdigest() in message
    assert not any((tmp_path / "cache").iterdir())
    # A single file changed on the server: its own hash differs.
    head = store.root / "sha256" / store.file_sha256 / "head.safetensors"
    head.write_bytes(b"other weights")
    head_uri = store_uri(store.https_url, store.file_sha256, "head.safetensors")
    with pytest.raises(ArtifactMismatch, match=hashlib.sha256(b"other weights").hexdigest()):
        fetch(head_uri, store.file_sha256, cache_dir=tmp_path / "cache", ca_bundle=store.cert)


def test_a_missing_artifact_is_not_found(tmp_path: Path, store: Store) -> None:
    missing = store_uri(store.https_url, "0" * 64, "head.safetensors")
    with pytest.raises(ArtifactError, match=f"artifact not found at {missing}"):
        fetch(missing, "0" * 64, cache_dir=tmp_path / "cache", ca_bundle=store.cert)
    (store.root / "sha256" / store.dir_sha256 / "vocab.txt").unlink()
    uri = store_uri(store.https_url, store.dir_sha256)
    with pytest.raises(ArtifactError, match=f"artifact not found at {uri}/vocab.txt"):
        fetch(uri, store.dir_sha256, cache_dir=tmp_path / "cache", ca_bundle=store.cert)


def test_an_unreachable_store_is_a_clear_error(tmp_path: Path, store: Store) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    uri = store_uri(f"https://127.0.0.1:{port}", store.dir_sha256)
    with pytest.raises(ArtifactError, match="the store is unreachable") as info:
        fetch(uri, store.dir_sha256, cache_dir=tmp_path / "cache", ca_bundle=store.cert)
    assert uri in str(info.value)
    with pytest.raises(ArtifactError, match="CA bundle"):
        fetch(uri, store.dir_sha256, cache_dir=tmp_path / "cache", ca_bundle=tmp_path / "missing.pem")


@pytest.mark.slow
def test_a_worker_serves_a_version_whose_artifact_is_on_an_https_store(
    tmp_path: Path, store: Store, admin: httpx.Client, demo: httpx.Client,
    start_worker: Callable[..., WorkerProcess], home: Path,
) -> None:
    """The whole path: published to the store, registered over REST with its https:// URI, fetched
    by the worker into its cache (trusting the store's CA from its settings), verified, served."""
    published = publish(build_tiny_encoder(tmp_path / "encoder"), f"file://{store.root}")
    name = unique("https")
    assert admin.post("/v1/models", json={"name": name, "kind": "hf-embedding"}).status_code == 201
    registered = admin.post(f"/v1/models/{name}/versions", json={
        "version": "v1", "artifact": store_uri(store.https_url, published.sha256), "sha256": published.sha256,
        "state": "stable"})
    assert registered.status_code == 201, registered.text
    assert admin.put(f"/v1/models/{name}/routing", json={"weights": {"v1": 100}}).status_code == 200
    start_worker(name, env={"SLUICE_ARTIFACT_CA_BUNDLE": str(store.cert)})
    response = demo.post(f"/v1/models/{name}/jobs", json={"input": {"text": "fetched over https"}})
    assert response.status_code == 202, response.text
    job = wait_job(demo, response.json()["id"])
    assert job["status"] == "succeeded" and job["output"]["dim"] > 0, job
    cached = home / "cache" / "artifacts" / published.sha256
    assert artifact_sha256(cached) == published.sha256
