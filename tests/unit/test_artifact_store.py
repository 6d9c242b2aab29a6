"""Directory manifests (every file of a model directory is hashed), and artifacts published to a
store and fetched into a cache (sluice.artifacts, sluice.artifact_store), over real files and
fsspec's memory:// filesystem; nothing is mocked."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from sluice.artifact_store import PublishedArtifact, fetch, publish, resolve_and_verify, store_uri
from sluice.artifacts import (
    DIR_WEIGHTS_FILE,
    INTENT_HEAD_URI,
    MANIFEST_NAME,
    MINILM_URI,
    ArtifactRef,
    artifact_files,
    artifact_sha256,
    file_sha256,
    manifest_lines,
    manifest_text,
    parse_artifact,
    parse_manifest,
    resolve_artifact,
    text_sha256,
    verify_artifact,
)
from sluice.errors import ArtifactError, ArtifactMismatch

# A small model directory: what MiniLM's holds, in miniature.
FILES = {
    "config.json": b'{"hidden_size": 4}\n',
    "tokenizer.json": b'{"model": {"vocab": {}}}\n',
    "vocab.txt": b"[PAD]\n[UNK]\nhello\n",
    DIR_WEIGHTS_FILE: b"\x08\x00\x00\x00\x00\x00\x00\x00{}      weights",
    "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}\n',
}
# The manifest hash of FILES, pinned: a change to the manifest format changes every recorded sha256.
FILES_SHA256 = "23cf9d4ec1c796fdc05163637e2ef16eddf61458c911da5722e507ba8af32fb7"
# The bundled MiniLM directory's manifest hash (what `sluice seed` records for the demo version),
# and the sha256 of its model.safetensors alone (what the intent head's base_sha256 records).
MINILM_SHA256 = "04b1622bdf2efd1182cf06be234900d203a263b6617ef5cc7919ce719d64fee1"
MINILM_WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"


def make_dir(root: Path, files: dict[str, bytes] = FILES, order: list[str] | None = None) -> Path:
    for name in order or list(files):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(files[name])
    return root


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return make_dir(tmp_path / "model")


@pytest.fixture
def memory_store() -> Iterator[str]:
    """A memory:// store of this test's own, emptied afterwards (fsspec keeps memory:// per process)."""
    url = f"memory://sluice-test-{uuid.uuid4().hex}/store"
    yield url
    fs = fsspec.filesystem("memory")
    root = fs._strip_protocol(url).rsplit("/", 1)[0]
    if fs.exists(root):
        fs.rm(root, recursive=True)


def store_path(uri: str, tmp: Path | None = None) -> Path:
    assert uri.startswith("file://")
    return Path(uri[len("file://") :])


# --- the manifest -------------------------------------------------------------------------------


def test_manifest_format_and_pinned_hash(model_dir: Path) -> None:
    lines = manifest_lines(model_dir)
    expected = [f"{hashlib.sha256(FILES[name]).hexdigest()}  {name}\n" for name in sorted(FILES)]
    assert lines == expected
    assert [line.split("  ", 1)[1].rstrip("\n") for line in lines] == artifact_files(model_dir)
    assert manifest_text(model_dir) == "".join(expected)
    assert artifact_sha256(model_dir) == hashlib.sha256("".join(expected).encode()).hexdigest() == FILES_SHA256
    assert parse_manifest(manifest_text(model_dir)) == {n: hashlib.sha256(b).hexdigest() for n, b in FILES.items()}


def test_manifest_is_independent_of_creation_order_times_and_modes(tmp_path: Path) -> None:
    first = make_dir(tmp_path / "a")
    second = make_dir(tmp_path / "b", order=list(reversed(FILES)))
    os.utime(second / "vocab.txt", (1, 1))
    (second / "config.json").chmod(0o600)
    assert artifact_sha256(first) == artifact_sha256(second) == FILES_SHA256


def test_a_file_hashes_its_bytes(tmp_path: Path) -> None:
    f = tmp_path / "x.bin"
    f.write_bytes(b"abc")
    assert artifact_sha256(f) == file_sha256(f) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_the_bundled_minilm_is_hashed_whole_and_its_head_records_the_weights_file() -> None:
    model_dir = resolve_artifact(MINILM_URI)
    assert artifact_sha256(model_dir) == MINILM_SHA256
    assert {"config.json", "tokenizer.json", "vocab.txt", DIR_WEIGHTS_FILE} <= set(artifact_files(model_dir))
    # The head check compares the head's base_sha256 with the weights file alone.
    assert file_sha256(model_dir / DIR_WEIGHTS_FILE) == MINILM_WEIGHTS_SHA256
    blob = resolve_artifact(INTENT_HEAD_URI).read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    metadata = json.loads(blob[8 : 8 + size])["__metadata__"]
    assert metadata["base_sha256"] == MINILM_WEIGHTS_SHA256


def test_litter_and_the_published_manifest_are_left_out(model_dir: Path) -> None:
    (model_dir / "__pycache__").mkdir()
    (model_dir / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"bytecode")
    (model_dir / "1_Pooling" / "__pycache__").mkdir()
    (model_dir / ".DS_Store").write_bytes(b"finder")
    (model_dir / "1_Pooling" / ".DS_Store").write_bytes(b"finder")
    (model_dir / MANIFEST_NAME).write_text("anything")
    (model_dir / "empty").mkdir()
    assert artifact_sha256(model_dir) == FILES_SHA256
    # A MANIFEST.sha256 below the top is an ordinary file.
    (model_dir / "1_Pooling" / MANIFEST_NAME).write_text("counted")
    assert artifact_sha256(model_dir) != FILES_SHA256


# --- tampered-file tests: any change to any file is refused --------------------------------------


def _edit(model_dir: Path, change: str, name: str) -> None:
    path = model_dir / name
    if change == "changed":
        path.write_bytes(path.read_bytes() + b" ")
    elif change == "removed":
        path.unlink()
    elif change == "added":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"extra")
    elif change == "renamed":
        path.rename(path.with_name(path.name + ".bak"))


TAMPERING = [
    *[("changed", name) for name in FILES],
    ("removed", "tokenizer.json"),
    ("removed", "1_Pooling/config.json"),
    ("added", "special_tokens_map.json"),
    ("added", "1_Pooling/extra.json"),
    ("added", "deeper/still/file.txt"),
    ("renamed", "vocab.txt"),
]


@pytest.mark.parametrize(("change", "name"), TAMPERING, ids=[f"{c}-{n}" for c, n in TAMPERING])
def test_any_change_to_a_directory_changes_its_hash_and_is_refused(model_dir: Path, change: str, name: str) -> None:
    _edit(model_dir, change, name)
    actual = artifact_sha256(model_dir)
    assert actual != FILES_SHA256
    with pytest.raises(ArtifactMismatch) as info:
        resolve_and_verify(str(model_dir), FILES_SHA256)
    message = str(info.value)
    assert str(model_dir) in message and FILES_SHA256 in message and actual in message


@pytest.mark.parametrize(("change", "name"), TAMPERING, ids=[f"{c}-{n}" for c, n in TAMPERING])
def test_any_change_in_the_store_is_refused_on_fetch(tmp_path: Path, model_dir: Path, change: str,
                                                     name: str) -> None:
    """A changed file fails its line of the manifest; a file added, removed or renamed in the store,
    with the store's MANIFEST.sha256 rewritten to match, fails the manifest's own hash."""
    published = publish(model_dir, f"file://{tmp_path / 'store'}")
    stored = store_path(published.uri)
    _edit(stored, change, name)
    if change != "changed":
        (stored / MANIFEST_NAME).write_text(manifest_text(stored))
    cache = tmp_path / "cache"
    with pytest.raises(ArtifactMismatch) as info:
        fetch(published.uri, published.sha256, cache_dir=cache)
    message = str(info.value)
    assert published.uri in message and published.sha256 in message
    assert (name in message) == (change == "changed")  # a changed file is named
    assert not any(cache.iterdir())  # nothing kept, not even the temporary folder


def test_a_file_missing_from_the_store_is_not_found(tmp_path: Path, model_dir: Path) -> None:
    published = publish(model_dir, f"file://{tmp_path / 'store'}")
    (store_path(published.uri) / "vocab.txt").unlink()
    with pytest.raises(ArtifactError, match=f"artifact not found at {published.uri}/vocab.txt"):
        fetch(published.uri, published.sha256, cache_dir=tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir())


def test_a_file_the_manifest_does_not_name_is_not_fetched(tmp_path: Path, model_dir: Path) -> None:
    published = publish(model_dir, f"file://{tmp_path / 'store'}")
    (store_path(published.uri) / "extra.py").write_text("import os")
    path = fetch(published.uri, published.sha256, cache_dir=tmp_path / "cache")
    assert not (path / "extra.py").exists() and artifact_sha256(path) == published.sha256


def test_a_mismatch_names_the_files_that_differ_from_the_kept_manifest(tmp_path: Path, model_dir: Path) -> None:
    published = publish(model_dir, f"file://{tmp_path / 'store'}")
    stored = store_path(published.uri)
    _edit(stored, "changed", "tokenizer.json")
    _edit(stored, "added", "new.txt")
    _edit(stored, "removed", "vocab.txt")
    with pytest.raises(ArtifactMismatch) as info:
        verify_artifact(stored, published.sha256)
    message = str(info.value)
    assert "changed: tokenizer.json" in message and "added: new.txt" in message and "removed: vocab.txt" in message


# --- what is refused ------------------------------------------------------------------------------


def test_symlinks_are_refused(tmp_path: Path, model_dir: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (model_dir / "linked.json").symlink_to(outside)
    with pytest.raises(ArtifactError, match="symlink"):
        artifact_sha256(model_dir)
    with pytest.raises(ArtifactError, match="symlink"):
        publish(model_dir, f"file://{tmp_path / 'store'}")
    (model_dir / "linked.json").unlink()
    (model_dir / "linked_dir").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(ArtifactError, match="symlink"):
        resolve_and_verify(str(model_dir), FILES_SHA256)


def test_special_files_bad_names_and_empty_directories_are_refused(tmp_path: Path, model_dir: Path) -> None:
    os.mkfifo(model_dir / "pipe")
    with pytest.raises(ArtifactError, match="not a regular file"):
        artifact_sha256(model_dir)
    (model_dir / "pipe").unlink()
    (model_dir / "two\nlines").write_bytes(b"x")
    with pytest.raises(ArtifactError, match="newline"):
        artifact_sha256(model_dir)
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(ArtifactError, match="no file"):
        artifact_sha256(tmp_path / "empty")


@pytest.mark.parametrize("bad", ["../evil.txt", "/etc/evil", "a/../../evil", "./a", "a//b", "a\\..\\b",
                                 MANIFEST_NAME, "__pycache__/x.pyc", "sub/.DS_Store"])
def test_manifest_paths_that_could_escape_are_refused(bad: str) -> None:
    with pytest.raises(ArtifactError):
        parse_manifest(f"{'0' * 64}  {bad}\n")


def test_malformed_manifests_are_refused() -> None:
    for text in (f"{'0' * 64}  b\n{'0' * 64}  a\n", f"{'0' * 64}  a", f"{'0' * 64} a\n", "",
                 f"{'0' * 64}  a\n{'0' * 64}  a\n", f"{'0' * 64}  a\n{'0' * 64}  a/b\n", f"{'G' * 64}  a\n"):
        with pytest.raises(ArtifactError):
            parse_manifest(text)


def _plant(store: str, manifest: str) -> str:
    """A directory in ``store`` whose MANIFEST.sha256 is ``manifest`` (with one file for it); its URI."""
    sha = text_sha256(manifest)
    uri = store_uri(store, sha)
    with fsspec.open(f"{uri}/{MANIFEST_NAME}", "wb") as fh:
        fh.write(manifest.encode())
    return uri


@pytest.mark.parametrize("bad", ["../evil.txt", "/tmp/evil.txt", "ok/../../evil.txt"])
def test_fetch_refuses_a_manifest_that_leaves_the_artifact(tmp_path: Path, memory_store: str, bad: str) -> None:
    manifest = f"{hashlib.sha256(b'evil').hexdigest()}  {bad}\n"
    uri = _plant(memory_store, manifest)
    with fsspec.open(f"{memory_store}/sha256/evil.txt", "wb") as fh:
        fh.write(b"evil")
    cache = tmp_path / "cache" / "sub"
    with pytest.raises(ArtifactError, match="refused"):
        fetch(uri, text_sha256(manifest), cache_dir=cache)
    assert not (tmp_path / "cache" / "evil.txt").exists() and not Path("/tmp/evil.txt").exists()
    assert list(cache.iterdir()) == []


def test_a_manifest_of_another_hash_is_refused_before_any_download(tmp_path: Path, memory_store: str,
                                                                    model_dir: Path) -> None:
    published = publish(model_dir, memory_store)
    wrong = "f" * 64
    with pytest.raises(ArtifactMismatch) as info:
        fetch(published.uri, wrong, cache_dir=tmp_path / "cache")
    assert published.uri in str(info.value) and wrong in str(info.value) and published.sha256 in str(info.value)


def test_bad_hashes_uris_and_stores(tmp_path: Path, memory_store: str, model_dir: Path) -> None:
    with pytest.raises(ArtifactError, match="not a sha256"):
        fetch(f"{memory_store}/x", "../../etc", cache_dir=tmp_path)
    with pytest.raises(ArtifactError, match="artifact not found at"):
        fetch(f"{memory_store}/sha256/{'0' * 64}/x.bin", "0" * 64, cache_dir=tmp_path)
    with pytest.raises(ArtifactError, match="no filesystem"):
        fetch("nosuchproto://bucket/x", "0" * 64, cache_dir=tmp_path)
    with pytest.raises(ArtifactError, match="read-only"):
        publish(model_dir, "https://example.invalid/store")
    with pytest.raises(ArtifactError, match="not found"):
        publish(tmp_path / "missing", memory_store)


# --- publish and fetch ----------------------------------------------------------------------------


@pytest.fixture(params=["file", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path, memory_store: str) -> str:
    return f"file://{tmp_path / 'store'}" if request.param == "file" else memory_store


def test_a_directory_round_trips_through_a_store(tmp_path: Path, store: str, model_dir: Path) -> None:
    published = publish(model_dir, store)
    assert published == PublishedArtifact(uri=f"{store}/sha256/{FILES_SHA256}", sha256=FILES_SHA256)
    assert published.uri == store_uri(store, FILES_SHA256)
    with fsspec.open(f"{published.uri}/{MANIFEST_NAME}", "rb") as fh:
        assert fh.read().decode() == manifest_text(model_dir)
    assert publish(model_dir, store) == published  # the same bytes again: nothing to do
    cache = tmp_path / "cache"
    path = fetch(published.uri, published.sha256, cache_dir=cache)
    assert path == cache / FILES_SHA256
    assert {name: (path / name).read_bytes() for name in FILES} == FILES
    assert artifact_sha256(path) == FILES_SHA256 and (path / MANIFEST_NAME).is_file()
    assert sorted(p.name for p in cache.iterdir()) == [FILES_SHA256]  # no temporary folder left


def test_a_file_round_trips_through_a_store(tmp_path: Path, store: str) -> None:
    head = tmp_path / "head.safetensors"
    head.write_bytes(b"head bytes")
    sha = hashlib.sha256(b"head bytes").hexdigest()
    published = publish(head, store)
    assert published == PublishedArtifact(uri=f"{store}/sha256/{sha}/head.safetensors", sha256=sha)
    assert publish(head, store) == published
    path = fetch(published.uri, sha, cache_dir=tmp_path / "cache")
    assert path == tmp_path / "cache" / sha / "head.safetensors" and path.read_bytes() == b"head bytes"


def test_publishing_to_a_file_store_is_a_no_op_the_second_time(tmp_path: Path, model_dir: Path) -> None:
    published = publish(model_dir, f"file://{tmp_path / 'store'}")
    stored = store_path(published.uri)
    before = {p: p.stat().st_mtime_ns for p in stored.rglob("*")}
    assert publish(model_dir, f"file://{tmp_path / 'store'}/") == published
    assert {p: p.stat().st_mtime_ns for p in stored.rglob("*")} == before
    assert [p.name for p in (tmp_path / "store" / "sha256").iterdir()] == [FILES_SHA256]


def test_a_damaged_copy_in_a_file_store_is_replaced_on_publish(tmp_path: Path, model_dir: Path) -> None:
    published = publish(model_dir, f"file://{tmp_path / 'store'}")
    _edit(store_path(published.uri), "changed", "config.json")
    assert publish(model_dir, f"file://{tmp_path / 'store'}") == published
    verify_artifact(store_path(published.uri), published.sha256)


def test_a_cache_hit_does_not_need_the_store(tmp_path: Path, model_dir: Path) -> None:
    published = publish(model_dir, f"file://{tmp_path / 'store'}")
    first = fetch(published.uri, published.sha256, cache_dir=tmp_path / "cache")
    shutil.rmtree(tmp_path / "store")
    assert fetch(published.uri, published.sha256, cache_dir=tmp_path / "cache") == first


@pytest.mark.parametrize(("change", "name"), [("changed", "config.json"), ("added", "x.txt"),
                                              ("removed", DIR_WEIGHTS_FILE), ("removed", MANIFEST_NAME)])
def test_a_tampered_cache_is_fetched_again(tmp_path: Path, store: str, model_dir: Path, change: str,
                                           name: str) -> None:
    published = publish(model_dir, store)
    cache = tmp_path / "cache"
    path = fetch(published.uri, published.sha256, cache_dir=cache)
    _edit(path, change, name)
    assert fetch(published.uri, published.sha256, cache_dir=cache) == path
    verify_artifact(path, published.sha256)
    assert sorted(p.name for p in cache.iterdir()) == [FILES_SHA256]


def test_a_tampered_cache_is_refused_when_the_store_cannot_replace_it(tmp_path: Path, model_dir: Path) -> None:
    published = publish(model_dir, f"file://{tmp_path / 'store'}")
    path = fetch(published.uri, published.sha256, cache_dir=tmp_path / "cache")
    _edit(path, "changed", "tokenizer.json")
    shutil.rmtree(tmp_path / "store")
    with pytest.raises(ArtifactError, match="artifact not found at"):
        fetch(published.uri, published.sha256, cache_dir=tmp_path / "cache")
    assert not path.exists()  # the tampered copy is gone, not loaded


def test_a_tampered_cached_file_is_fetched_again(tmp_path: Path, memory_store: str) -> None:
    head = tmp_path / "head.bin"
    head.write_bytes(b"weights")
    published = publish(head, memory_store)
    path = fetch(published.uri, published.sha256, cache_dir=tmp_path / "cache")
    path.write_bytes(b"tampered")
    assert fetch(published.uri, published.sha256, cache_dir=tmp_path / "cache").read_bytes() == b"weights"


# --- resolve_and_verify ---------------------------------------------------------------------------


def test_resolve_and_verify_fetches_store_uris_into_the_cache(tmp_path: Path, memory_store: str,
                                                              model_dir: Path) -> None:
    published = publish(model_dir, memory_store)
    with pytest.raises(ArtifactError, match="cache"):
        resolve_and_verify(published.uri, published.sha256)
    with pytest.raises(ArtifactError, match="no sha256"):
        resolve_and_verify(published.uri, None, cache_dir=tmp_path)
    with pytest.raises(ArtifactError, match="in a store"):
        resolve_artifact(published.uri)
    path = resolve_and_verify(f"{published.uri}?quantize=int8", published.sha256, cache_dir=tmp_path / "c")
    assert path == tmp_path / "c" / published.sha256
    with pytest.raises(ArtifactMismatch):
        resolve_and_verify(published.uri, "e" * 64, cache_dir=tmp_path / "c")


def test_local_uris_are_verified_in_place(tmp_path: Path, model_dir: Path) -> None:
    assert resolve_and_verify(f"file://{model_dir}?quantize=int8", FILES_SHA256) == model_dir
    assert resolve_and_verify(str(model_dir), FILES_SHA256.upper()) == model_dir
    published = publish(model_dir, f"file://{tmp_path / 'store'}")
    # A file:// store URI is a local directory: used in place, its MANIFEST.sha256 not hashed.
    assert resolve_and_verify(published.uri, published.sha256) == store_path(published.uri)


def test_load_options_on_store_uris() -> None:
    assert parse_artifact("https://h/store/sha256/ab?quantize=int8") == ArtifactRef("https://h/store/sha256/ab", "int8")
    assert parse_artifact("s3://b/k") == ArtifactRef("s3://b/k")
    with pytest.raises(ArtifactError, match="unknown artifact option"):
        parse_artifact("https://h/x?X-Amz-Signature=abc")
