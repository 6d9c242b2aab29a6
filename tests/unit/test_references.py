"""Jobs by reference on a real directory tree: what the API's check lets through (sluice/references.py)
and what the worker does with it (workers/references.py): read, verify, hand over, write, refuse."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from sluice.batcher import Item
from sluice.errors import PayloadTooLarge
from sluice.kinds import ModelKind
from sluice.references import InputRef, OutputRef, Written, check_input, check_output, cost_hint
from sluice.tenant_files import REFUSED, FileRefused
from workers.models.protocol import ModelHandler
from workers.references import References
from workers.results import Delivery

LIMIT = 4096


class Echo(ModelHandler):
    """Answers each input as it was handed over, and keeps what it was handed."""

    kind = ModelKind.synthetic
    length_buckets = True

    def __init__(self, *, takes_files: bool = False) -> None:
        self.takes_files = takes_files
        self.seen: list[dict[str, Any]] = []

    def passes(self, inputs: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        return [list(range(len(inputs)))]

    def warmup(self) -> None:
        pass

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        outputs = []
        for item in inputs:
            seen = dict(item)
            if self.takes_files:
                seen["content"] = Path(item["path"]).read_text()
            self.seen.append(seen)
            outputs.append({"echo": seen})
        return outputs


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for tenant in ("alice", "bob"):
        (tmp_path / "root" / "tenants" / tenant / "in").mkdir(parents=True)
    return tmp_path / "root"


def _put(root: Path, tenant: str, name: str, data: bytes) -> Path:
    path = root / "tenants" / tenant / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _item(tenant: str, *, input_ref: InputRef | None = None, output_ref: OutputRef | None = None,
          given: dict[str, Any] | None = None) -> Item[Delivery]:
    delivery = Delivery(job_id="job_x", lane="online", input=given or {}, attempts=1, input_ref=input_ref,
                        output_ref=output_ref)
    return Item(id="0-1", tenant=tenant, cost=1, enqueued_at=0.0, payload=delivery)


def _ref(root: Path, uri: str, sha256: str | None = None, tenant: str = "alice") -> InputRef:
    return check_input(uri, sha256, root=root, tenant=tenant, admin=False, max_bytes=LIMIT)


def test_the_api_check_stores_the_real_path_and_size_and_never_the_bytes(root: Path) -> None:
    path = _put(root, "alice", "in/a.json", b'{"text": "hi"}')
    ref = _ref(root, "in/a.json", "AB" * 32)
    assert ref == InputRef(uri="in/a.json", path=str(path.resolve()), size=14, sha256="ab" * 32)
    assert InputRef.parse(ref.encode()) == ref and cost_hint(ref) == 3
    assert OutputRef.parse(check_output("out/new.json", root=root, tenant="alice", admin=False).encode()) == \
        OutputRef(uri="out/new.json", path=str((root / "tenants" / "alice" / "out" / "new.json").resolve()))
    assert Written.parse(Written(size=3, sha256="c" * 64).encode()) == Written(size=3, sha256="c" * 64)


def test_a_large_object_is_too_large_for_its_owner_and_missing_for_anyone_else(root: Path) -> None:
    with (root / "tenants" / "alice" / "in" / "big.bin").open("wb") as handle:
        handle.truncate(LIMIT + 1)
    with pytest.raises(PayloadTooLarge, match=f"limit is {LIMIT}"):
        _ref(root, "in/big.bin")
    with pytest.raises(FileRefused):
        _ref(root, "../alice/in/big.bin", tenant="bob")
    with pytest.raises(FileRefused):
        check_output("in", root=root, tenant="alice", admin=False)  # a folder, not an object


def test_the_worker_reads_verifies_and_validates_a_referenced_input(root: Path) -> None:
    data = b'{"text": "by reference"}'
    _put(root, "alice", "in/a.json", data)
    _put(root, "alice", "in/bad.json", b'{"text": 3}')
    _put(root, "alice", "in/list.json", b"[1, 2]")
    references = References(root=root, max_bytes=LIMIT)
    items = [
        _item("alice", input_ref=_ref(root, "in/a.json", hashlib.sha256(data).hexdigest())),
        _item("alice", given={"text": "inline"}),
        _item("alice", input_ref=_ref(root, "in/a.json", "0" * 64)),
        _item("alice", input_ref=_ref(root, "in/bad.json")),
        _item("alice", input_ref=_ref(root, "in/list.json")),
    ]
    outcomes, _ = references.run(Echo(), items)
    assert outcomes[0].output == {"echo": {"text": "by reference"}}
    assert outcomes[1].output == {"echo": {"text": "inline"}}
    assert [o.error["code"] if o.error else None for o in outcomes[2:]] == [
        "input_checksum_mismatch", "invalid_input", "invalid_input"]
    assert outcomes[2].error is not None and "0" * 64 in outcomes[2].error["message"]


def test_an_object_grown_or_swapped_for_a_link_out_since_submit_is_refused(root: Path) -> None:
    path = _put(root, "alice", "in/a.json", b'{"text": "small"}')
    secret = _put(root, "bob", "in/secret.json", b'{"text": "bob only"}')
    _put(root, "alice", "in/b.json", b"{}")
    grown, swapped = _ref(root, "in/a.json"), _ref(root, "in/b.json")
    path.write_bytes(b'{"text": "' + b"x" * LIMIT + b'"}')
    (root / "tenants" / "alice" / "in" / "b.json").unlink()
    (root / "tenants" / "alice" / "in" / "b.json").symlink_to(secret)
    outcomes, _ = References(root=root, max_bytes=LIMIT).run(Echo(), [_item("alice", input_ref=grown),
                                                                      _item("alice", input_ref=swapped)])
    assert [o.error for o in outcomes] == [
        {"code": "input_too_large", "message": f"the object at input_uri holds more than {LIMIT} bytes "
                                               "(SLUICE_MAX_OBJECT_BYTES)"},
        {"code": "input_unavailable", "message": REFUSED}]


def test_a_handler_that_takes_files_gets_the_checked_descriptor_and_no_inline_input(root: Path) -> None:
    data = b"line one\nline two\n"
    _put(root, "alice", "in/log.txt", data)
    handler = Echo(takes_files=True)
    outcomes, _ = References(root=root, max_bytes=LIMIT).run(handler, [
        _item("alice", input_ref=_ref(root, "in/log.txt")), _item("alice", given={"path": "/etc/passwd"})])
    [seen] = handler.seen
    assert seen["content"] == data.decode() and seen["size"] == len(data)
    assert seen["sha256"] == hashlib.sha256(data).hexdigest()
    assert seen["path"].startswith("/proc/self/fd/"), "the descriptor checked, not the path named"
    assert outcomes[0].output is not None
    assert outcomes[1].error is not None and outcomes[1].error["code"] == "input_uri_required"


def test_an_output_is_written_whole_to_its_object_with_its_size_and_sha256(root: Path) -> None:
    ref = check_output("out/deep/result.json", root=root, tenant="alice", admin=False)
    outcomes, _ = References(root=root, max_bytes=LIMIT).run(Echo(), [
        _item("alice", given={"text": "to a file"}, output_ref=ref)])
    written = (root / "tenants" / "alice" / "out" / "deep" / "result.json").read_bytes()
    assert json.loads(written) == {"echo": {"text": "to a file"}}
    assert outcomes[0].written == Written(size=len(written), sha256=hashlib.sha256(written).hexdigest())
    assert os.listdir(root / "tenants" / "alice" / "out" / "deep") == ["result.json"]

    too_large = References(root=root, max_bytes=16).run(Echo(), [
        _item("alice", given={"text": "to a file"}, output_ref=ref)])[0][0]
    assert too_large.error is not None and too_large.error["code"] == "output_too_large"
    assert json.loads((root / "tenants" / "alice" / "out" / "deep" / "result.json").read_bytes()) == \
        json.loads(written), "a refused output leaves the object as it was"


def test_an_output_folder_swapped_for_a_link_out_since_submit_is_not_written(root: Path) -> None:
    folder = root / "tenants" / "alice" / "gate"
    folder.mkdir()
    ref = check_output("gate/result.json", root=root, tenant="alice", admin=False)
    folder.rmdir()
    folder.symlink_to(root / "tenants" / "bob", target_is_directory=True)
    [outcome], _ = References(root=root, max_bytes=LIMIT).run(Echo(), [
        _item("alice", given={"text": "x"}, output_ref=ref)])
    assert outcome.error is not None and outcome.error["code"] == "output_unwritable"
    assert not (root / "tenants" / "bob" / "result.json").exists()


def test_without_a_batch_root_a_reference_is_unavailable(root: Path) -> None:
    _put(root, "alice", "in/a.json", b"{}")
    ref = _ref(root, "in/a.json")
    [outcome], _ = References(root=None).run(Echo(), [_item("alice", input_ref=ref)])
    assert outcome.error == {"code": "input_unavailable", "message": REFUSED}
