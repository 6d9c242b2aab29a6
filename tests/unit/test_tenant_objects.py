"""References to an object store, on fsspec's memory:// filesystem: which URLs a tenant may name
(sluice/tenant_objects.py), what the API's check stores (sluice/references.py) and what the worker
does with it (workers/references.py). The same against a real S3 server is
tests/integration/test_object_references.py."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from pydantic import SecretStr

from sluice.errors import PayloadTooLarge
from sluice.references import InputRef, OutputRef, Written, check_input, check_output
from sluice.settings import Settings
from sluice.tenant_files import REFUSED, FileRefused, NoBatchRoot
from sluice.tenant_objects import NoObjectFilesystem, ObjectStore, is_object_url
from tests.unit.test_references import LIMIT, Echo, _item
from workers.references import NoObjectStore, References


@pytest.fixture
def store() -> Iterator[ObjectStore]:
    """A memory:// store of this test's own, emptied afterwards (fsspec keeps memory:// per process)."""
    bucket = f"sluice-objects-{uuid.uuid4().hex}"
    yield ObjectStore(url=f"memory://{bucket}/prefix/")
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{bucket}"):
        fs.rm(f"/{bucket}", recursive=True)


def _put(store: ObjectStore, tenant: str, name: str, data: bytes) -> str:
    url = f"{store.tenant_url(tenant)}/{name}"
    store.filesystem().pipe_file(url, data)
    return url


def _ref(store: ObjectStore, uri: str, sha256: str | None = None, tenant: str = "alice") -> InputRef:
    return check_input(uri, sha256, root=None, tenant=tenant, admin=False, max_bytes=LIMIT, objects=store)


def test_a_tenant_names_objects_in_its_folder_only_and_every_other_name_is_refused_alike(
        store: ObjectStore) -> None:
    bucket = store.url.removeprefix("memory://").split("/")[0]
    own = f"memory://{bucket}/prefix/tenants/alice"
    assert store.url == f"memory://{bucket}/prefix" and store.tenant_url("alice") == own
    assert store.resolve("in/a.json", tenant="alice", admin=False) == f"{own}/in/a.json"
    assert store.resolve(f"{own}/in/a.json", tenant="alice", admin=False) == f"{own}/in/a.json"
    assert store.resolve("in/a%20b.json", tenant="alice", admin=False) == f"{own}/in/a b.json"
    refused = [
        f"memory://{bucket}/prefix/tenants/bob/in/a.json", "../bob/in/a.json", "..%2Fbob%2Fin%2Fa.json",
        f"{own}/../bob/in/a.json", f"{own}/./in/a.json", f"{own}//in/a.json", f"{own}/in/", own, f"{own}/",
        "memory://other-bucket/prefix/tenants/alice/in/a.json", f"memory://{bucket}/tenants/alice/in/a.json",
        f"memory://{bucket}/prefix/tenants/alice2/in/a.json", "s3://bucket/prefix/tenants/alice/in/a.json",
        "file:///etc/passwd", "/in/a.json", "", "in/a.json?versionId=1", "in/a.json#x", "in/\0.json",
        f"memory:///{bucket}/prefix/tenants/alice/in/a.json",
    ]
    for uri in refused:
        with pytest.raises(FileRefused):
            store.resolve(uri, tenant="alice", admin=False)
    for tenant in ("", "..", "a/b"):
        with pytest.raises(FileRefused):
            store.resolve("in/a.json", tenant=tenant, admin=False)
    # An admin names anything under the root, nothing outside it.
    assert store.resolve(f"memory://{bucket}/prefix/tenants/bob/in/a.json", tenant="admin", admin=True) == \
        f"memory://{bucket}/prefix/tenants/bob/in/a.json"
    with pytest.raises(FileRefused):
        store.resolve(f"memory://{bucket}/elsewhere.json", tenant="admin", admin=True)
    assert store.recheck(f"{own}/in/a.json") == f"{own}/in/a.json"
    with pytest.raises(FileRefused):
        store.recheck(f"memory://{bucket}/elsewhere.json")
    assert is_object_url(f"{own}/in/a.json") and not is_object_url("/srv/root/tenants/alice/in/a.json")


def test_the_api_check_stores_the_url_and_size_and_refuses_a_stranger_as_a_missing_object(
        store: ObjectStore) -> None:
    url = _put(store, "alice", "in/a.json", b'{"text": "hi"}')
    _put(store, "alice", "in/big.bin", b"x" * (LIMIT + 1))
    assert _ref(store, "in/a.json", "AB" * 32) == InputRef(uri="in/a.json", path=url, size=14, sha256="ab" * 32)
    assert _ref(store, url).path == url
    with pytest.raises(PayloadTooLarge, match=f"limit is {LIMIT}"):
        _ref(store, "in/big.bin")
    for uri, tenant in (("in/missing.json", "alice"), ("in", "alice"), (url, "bob"), ("../alice/in/a.json", "bob"),
                        (f"{store.tenant_url('alice')}/in/big.bin", "bob"), ("file:///etc/passwd", "alice")):
        with pytest.raises(FileRefused) as refused:
            _ref(store, uri, tenant=tenant)
        assert refused.value.message == REFUSED, uri
    out = check_output("out/new.json", root=None, tenant="alice", admin=False, objects=store)
    assert out == OutputRef(uri="out/new.json", path=f"{store.tenant_url('alice')}/out/new.json")
    with pytest.raises(FileRefused):
        check_output("in", root=None, tenant="alice", admin=False, objects=store)  # a "folder"


def test_with_a_batch_root_too_a_relative_path_is_a_file_and_a_url_an_object(store: ObjectStore,
                                                                            tmp_path: Path) -> None:
    (tmp_path / "tenants" / "alice" / "in").mkdir(parents=True)
    (tmp_path / "tenants" / "alice" / "in" / "a.json").write_bytes(b"{}")
    url = _put(store, "alice", "in/a.json", b'{"text": "object"}')
    def check(uri: str) -> InputRef:
        return check_input(uri, None, root=tmp_path, tenant="alice", admin=False, max_bytes=LIMIT, objects=store)

    assert check("in/a.json").path == str((tmp_path / "tenants" / "alice" / "in" / "a.json").resolve())
    assert check(url).path == url and check(url).size == 18
    with pytest.raises(NoBatchRoot):
        check_input("in/a.json", None, root=None, tenant="alice", admin=False, max_bytes=LIMIT)


def test_the_worker_reads_verifies_copies_and_writes_objects(store: ObjectStore) -> None:
    data = b'{"text": "by reference"}'
    _put(store, "alice", "in/a.json", data)
    _put(store, "alice", "in/gone.json", b"{}")
    references = References(root=None, objects=store, max_bytes=LIMIT)
    out = check_output("out/deep/a.json", root=None, tenant="alice", admin=False, objects=store)
    items = [
        _item("alice", input_ref=_ref(store, "in/a.json", hashlib.sha256(data).hexdigest()), output_ref=out),
        _item("alice", input_ref=_ref(store, "in/a.json", "0" * 64)),
        _item("alice", input_ref=_ref(store, "in/gone.json")),
    ]
    store.filesystem().rm(f"{store.tenant_url('alice')}/in/gone.json")
    outcomes, _ = references.run(Echo(), items)
    written = store.filesystem().cat_file(out.path)
    assert json.loads(written) == {"echo": {"text": "by reference"}}
    assert outcomes[0].written == Written(size=len(written), sha256=hashlib.sha256(written).hexdigest())
    assert [o.error for o in outcomes[1:]] == [
        {"code": "input_checksum_mismatch", "message": f"the object at input_uri has sha256 "
                                                       f"{hashlib.sha256(data).hexdigest()}, not the {'0' * 64} "
                                                       "submitted"},
        {"code": "input_unavailable", "message": REFUSED}]

    # A handler that reads files gets a local copy of the object, checked and hashed as it was made.
    handler = Echo(takes_files=True)
    [copied], _ = references.run(handler, [_item("alice", input_ref=_ref(store, "in/a.json"))])
    [seen] = handler.seen
    assert seen["content"] == data.decode() and seen["sha256"] == hashlib.sha256(data).hexdigest()
    assert seen["size"] == len(data) and copied.output is not None

    # Grown past the limit since submit: refused while it is read.
    grown = _ref(store, "in/a.json")
    _put(store, "alice", "in/a.json", b"x" * (LIMIT + 1))
    [large], _ = references.run(Echo(), [_item("alice", input_ref=grown)])
    assert large.error is not None and large.error["code"] == "input_too_large"


def test_a_worker_without_the_object_store_leaves_the_job_for_another(store: ObjectStore) -> None:
    _put(store, "alice", "in/a.json", b"{}")
    [outcome], _ = References(root=None).run(Echo(), [_item("alice", input_ref=_ref(store, "in/a.json"))])
    assert outcome.fault is not None and outcome.error is None
    assert NoObjectStore().args[0] in outcome.fault


def test_settings_take_the_store_and_keep_its_options_secret() -> None:
    settings = Settings(object_root="s3://bucket/prefix",
                        object_storage_options=SecretStr('{"secret": "s3cr3t-value"}'))
    store = ObjectStore.from_settings(settings)
    assert store is not None and store.url == "s3://bucket/prefix" and store.protocol == "s3"
    assert "s3cr3t" not in repr(settings) and "s3cr3t" not in repr(store)
    assert ObjectStore.from_settings(Settings()) is None
    with pytest.raises(NoObjectFilesystem, match="no-such-scheme://"):
        ObjectStore.from_settings(Settings(object_root="no-such-scheme://bucket/prefix"))
    for bad in ({"object_root": "file:///srv/objects"}, {"object_root": "s3:///no-bucket"},
                {"object_storage_options": '["s3cr3t-value"]'}, {"object_storage_options": "s3cr3t-value"}):
        with pytest.raises(ValueError) as refused:
            Settings(**bad)  # type: ignore[arg-type]
        assert "s3cr3t" not in str(refused.value)


def test_a_copy_streams_the_object_to_a_local_file_within_its_limit(store: ObjectStore, tmp_path: Path) -> None:
    url = _put(store, "alice", "in/rows.jsonl", b'{"text": "a"}\n' * 100)
    store.copy_to(url, tmp_path / "copy.jsonl", max_bytes=LIMIT, limit_name="LIMIT")
    assert (tmp_path / "copy.jsonl").read_bytes() == b'{"text": "a"}\n' * 100
    big = _put(store, "alice", "in/big.jsonl", b"x" * (LIMIT + 1))
    with pytest.raises(PayloadTooLarge, match=f"limit is {LIMIT} \\(LIMIT\\)"):
        store.copy_to(big, tmp_path / "big.jsonl", max_bytes=LIMIT, limit_name="LIMIT")
    with pytest.raises(FileRefused):
        store.copy_to(f"{store.tenant_url('alice')}/in/gone.jsonl", tmp_path / "gone.jsonl", max_bytes=LIMIT,
                      limit_name="LIMIT")
