"""Which batch files a tenant may name: the one owner of turning an `input_uri` or `output_uri`
into a path.

Each tenant has a folder of its own, `<batch_root>/tenants/<tenant>/`, for its inputs and its
schedules' inputs and outputs. A tenant names a file by a path relative to that folder
(`in/2026-01-31.jsonl`) or by a `file://` URI inside it; an admin key may name any file under the
batch root. Uploads and inline inputs are not here: they live in the batch store, keyed by batch.

The surprise: every refusal is the same `FileRefused`, word for word, whether the file does not
exist, lies outside the folder, is another tenant's, escapes through a symlink or `..`, or is
spelled with a scheme that is not `file`. A different message per case would tell a stranger
which paths exist.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlparse

from sluice.batch_files import BatchFileError

TENANTS_DIR = "tenants"
REFUSED = ("no such batch file: name a file by its path relative to your tenant's batch folder "
           "(a file:// URI must lie inside it)")


class FileRefused(BatchFileError):
    """A path a key may not use, or that does not exist: one message for every reason."""

    def __init__(self) -> None:
        super().__init__(REFUSED)


class NoBatchRoot(BatchFileError):
    """The platform has no SLUICE_BATCH_ROOT, so no `input_uri` or `output_uri` is accepted."""

    def __init__(self) -> None:
        super().__init__("input_uri and output_uri are refused: this platform has no SLUICE_BATCH_ROOT")


def tenant_root(root: Path, tenant: str) -> Path:
    """The folder of `tenant`'s batch files (it need not exist yet)."""
    if tenant in ("", ".", "..") or "/" in tenant or "\\" in tenant or "\0" in tenant:
        raise FileRefused()
    return root / TENANTS_DIR / tenant


def resolve(uri: str, *, root: Path | None, tenant: str, admin: bool, must_exist: bool) -> Path:
    """The real path `uri` names, if `tenant` (or an admin, anywhere under `root`) may use it.

    Symlinks are followed before the check, so a link inside the folder that points out of it
    is refused like the path it points to. With `must_exist`, the path must be a regular file.
    """
    if root is None:
        raise NoBatchRoot()
    base = _real(root)
    own = _real(tenant_root(base, tenant))
    path = _real(_named(uri, own))
    if not path.is_relative_to(base if admin else own) or path in (base, own):
        raise FileRefused()
    if must_exist and not _is_file(path):
        raise FileRefused()
    return path


def recheck(path: Path, *, root: Path | None, tenant: str) -> Path:
    """A path resolved at submit for `tenant`'s batch, checked again just before use: a link made
    in a folder after the check must not lead the worker out of it. The path stays in the
    tenant's folder; one an admin named in another tenant's folder stays in that folder, and one
    an admin named outside every tenant's folder stays under the batch root."""
    if root is None:
        raise NoBatchRoot()
    base = _real(root)
    real = _real(path)
    if real.is_relative_to(_real(tenant_root(base, tenant))):
        return real
    tenants = base / TENANTS_DIR
    if path.is_relative_to(tenants) and path != tenants:
        scope = _real(tenant_root(base, path.relative_to(tenants).parts[0]))
    elif path.is_relative_to(base):
        scope = base
    else:
        raise FileRefused()
    if not real.is_relative_to(scope):
        raise FileRefused()
    return real


def _named(uri: str, own: Path) -> Path:
    """The path `uri` spells: relative to the tenant's folder, or an absolute `file://` path."""
    if "\0" in uri:
        raise FileRefused()
    parsed = urlparse(uri)
    if parsed.scheme == "" and parsed.netloc == "":
        relative = unquote(parsed.path)
        if relative.startswith("/") or "\0" in relative:
            raise FileRefused()
        return own / PurePosixPath(relative)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost") or parsed.params or parsed.query:
        raise FileRefused()
    absolute = unquote(parsed.path)
    if not absolute.startswith("/") or "\0" in absolute:
        raise FileRefused()
    return Path(absolute)


def _real(path: Path) -> Path:
    # A symlink loop (RuntimeError) or an unreadable component (OSError) is a refusal, not a 500.
    try:
        return path.resolve()
    except (OSError, RuntimeError, ValueError):
        raise FileRefused() from None


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False
