"""Path resolution per tenant (sluice/tenant_files.py) on a real directory tree: what a tenant
may name, that every refusal is the same, what an admin may name, and the check before use."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.settings import Settings
from sluice.tenant_files import REFUSED, FileRefused, NoBatchRoot, recheck, resolve, tenant_root


@pytest.fixture
def root(tmp_path: Path) -> Path:
    base = tmp_path / "batch-root"
    for tenant in ("alice", "bob"):
        (base / "tenants" / tenant / "in").mkdir(parents=True)
        (base / "tenants" / tenant / "in" / "data.csv").write_text("private,text\n1,a\n")
    (base / "shared.jsonl").write_text('{"text": "x"}\n')
    return base.resolve()


def _refused(uri: str, root: Path, *, tenant: str = "bob", admin: bool = False, must_exist: bool = True) -> str:
    with pytest.raises(FileRefused) as caught:
        resolve(uri, root=root, tenant=tenant, admin=admin, must_exist=must_exist)
    return caught.value.message


def test_a_tenant_names_its_files_relative_to_its_folder_or_by_a_file_uri_inside_it(root: Path) -> None:
    own = root / "tenants" / "alice" / "in" / "data.csv"
    for uri in ("in/data.csv", "in/./data.csv", "in%2Fdata.csv", own.as_uri(), f"file://localhost{own}"):
        assert resolve(uri, root=root, tenant="alice", admin=False, must_exist=True) == own
    # An output that does not exist yet, in a folder that does not exist yet.
    out = resolve("out/2026-01-31.csv", root=root, tenant="alice", admin=False, must_exist=False)
    assert out == root / "tenants" / "alice" / "out" / "2026-01-31.csv"


@pytest.mark.parametrize("uri", [
    "in/missing.csv", "../alice/in/data.csv", "in/../../alice/in/data.csv", "%2e%2e/alice/in/data.csv",
    "%2E%2E%2Falice%2Fin%2Fdata.csv", "ROOT/tenants/alice/in/data.csv", "file://ROOT/tenants/alice/in/data.csv",
    "file://ROOT/tenants/bob/../alice/in/data.csv", "file://ROOT/tenants/bob/%2e%2e/alice/in/data.csv",
    "file://ROOT/shared.jsonl", "file://otherhost/ROOT/shared.jsonl", "file:in/data.csv", "file:///etc/passwd",
    "http://host/in/data.csv", "s3://bucket/in/data.csv", "ftp://ROOT/tenants/alice/in/data.csv", "",
    ".", "in", "in/data.csv\x00", "in/data.csv%00", "file://ROOT/tenants/alice/in/data.csv?x",
    "file://ROOT", "file://ROOT/tenants", "link", "linkdir/in/data.csv", "loop", "loop/x",
])
def test_every_refusal_says_the_same_thing(root: Path, uri: str) -> None:
    bob = root / "tenants" / "bob"
    (bob / "link").symlink_to(root / "tenants" / "alice" / "in" / "data.csv")
    (bob / "linkdir").symlink_to(root / "tenants" / "alice", target_is_directory=True)
    (bob / "loop").symlink_to(bob / "loop")
    assert _refused(uri.replace("ROOT", str(root)), root) == REFUSED
    assert str(FileRefused()) == REFUSED and "alice" not in REFUSED


def test_an_output_path_may_not_leave_the_folder_either(root: Path) -> None:
    (root / "tenants" / "bob" / "out").symlink_to(root / "tenants" / "alice", target_is_directory=True)
    for uri in ("out/x.csv", "../alice/out/x.csv", (root / "elsewhere.csv").as_uri()):
        assert _refused(uri, root, must_exist=False) == REFUSED


def test_an_admin_may_name_any_file_under_the_root_and_nothing_outside(root: Path, tmp_path: Path) -> None:
    alice = root / "tenants" / "alice" / "in" / "data.csv"
    assert resolve(alice.as_uri(), root=root, tenant="admin", admin=True, must_exist=True) == alice
    assert resolve((root / "shared.jsonl").as_uri(), root=root, tenant="admin", admin=True,
                   must_exist=True) == root / "shared.jsonl"
    (tmp_path / "outside.jsonl").write_text("{}\n")
    assert _refused((tmp_path / "outside.jsonl").as_uri(), root, tenant="admin", admin=True) == REFUSED
    assert _refused("../../../outside.jsonl", root, tenant="admin", admin=True) == REFUSED


def test_a_platform_without_a_batch_root_refuses_every_path() -> None:
    with pytest.raises(NoBatchRoot):
        resolve("in/data.csv", root=None, tenant="alice", admin=True, must_exist=True)
    with pytest.raises(NoBatchRoot):
        recheck(Path("/x"), root=None, tenant="alice")


@pytest.mark.parametrize("tenant", ["", ".", "..", "a/b", "a\x00"])
def test_a_tenant_id_that_is_not_one_folder_name_has_no_folder(tmp_path: Path, tenant: str) -> None:
    with pytest.raises(FileRefused):
        tenant_root(tmp_path, tenant)


def test_the_check_before_use_keeps_a_tenants_path_in_its_folder(root: Path) -> None:
    bob_file = root / "tenants" / "bob" / "in" / "data.csv"
    assert recheck(bob_file, root=root, tenant="bob") == bob_file
    # An admin's batch of a file outside every tenant folder, or in one, stays valid.
    assert recheck(root / "shared.jsonl", root=root, tenant="admin") == root / "shared.jsonl"
    assert recheck(bob_file, root=root, tenant="admin") == bob_file
    # The file swapped for a link to another tenant's after submit: refused, to the tenant and
    # to an admin's batch that named the file in bob's folder.
    bob_file.unlink()
    bob_file.symlink_to(root / "tenants" / "alice" / "in" / "data.csv")
    for tenant in ("bob", "admin"):
        with pytest.raises(FileRefused):
            recheck(bob_file, root=root, tenant=tenant)
    (root / "link.jsonl").symlink_to("/etc/passwd")
    with pytest.raises(FileRefused):
        recheck(root / "link.jsonl", root=root, tenant="admin")
    with pytest.raises(FileRefused):
        recheck(Path("/etc/passwd"), root=root, tenant="admin")


def test_a_tenant_folder_that_is_a_link_to_other_storage_works(root: Path, tmp_path: Path) -> None:
    mounted = tmp_path / "volume-of-carol"
    (mounted / "in").mkdir(parents=True)
    (mounted / "in" / "rows.jsonl").write_text("{}\n")
    (root / "tenants" / "carol").symlink_to(mounted, target_is_directory=True)
    path = resolve("in/rows.jsonl", root=root, tenant="carol", admin=False, must_exist=True)
    assert path == (mounted / "in" / "rows.jsonl").resolve()
    assert recheck(path, root=root, tenant="carol") == path
    assert _refused(path.as_uri(), root, tenant="bob") == REFUSED


def test_the_batch_store_may_not_lie_inside_the_batch_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="SLUICE_BATCH_DIR"):
        Settings(home=tmp_path, batch_root=tmp_path / "root", batch_dir=tmp_path / "root" / "tenants" / "a")
    with pytest.raises(ValueError, match="SLUICE_BATCH_DIR"):
        Settings(home=tmp_path / "root", batch_root=tmp_path)  # the default store, HOME/batches
    assert Settings(home=tmp_path, batch_root=tmp_path / "root").batch_storage == (tmp_path / "batches").resolve()
