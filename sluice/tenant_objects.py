"""Which objects in the platform's object store a tenant may name: the one owner of turning an
`input_uri` or `output_uri` in an object store into an object's URL, and of touching that object.

The store is one fsspec URL, SLUICE_OBJECT_ROOT (`s3://bucket/prefix`, `gs://...`, `memory://...`;
its fsspec package installed, e.g. s3fs by the `objects` extra), with its storage options from
SLUICE_OBJECT_STORAGE_OPTIONS (credentials, endpoint), which only `filesystem()` reads. Each tenant
has a folder, `<object_root>/tenants/<tenant>/`, as under the batch root (sluice/tenant_files.py):
a tenant names an object by its full URL inside that folder, or by a path relative to it when the
platform has no batch root; an admin key may name any object under the object root.

The surprises: every object a tenant may not use (another tenant's, `..`, another bucket, a scheme
other than the root's, a "folder", a missing one) is refused word for word as a missing object is
(`FileRefused`). Names are not normalized but refused: an empty, `.` or `..` segment would mean
one object to a person and another to the store. An object store has no links, so a URL checked
at submit names the same object when the worker uses it; the worker checks only that it is still
under the root. The filesystem is made once per store, lazily, and its listings cache is dropped
before each look, so a size or an existence is never an old answer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlparse

from sluice.errors import PayloadTooLarge, ServiceUnavailable, SluiceError
from sluice.settings import Settings
from sluice.tenant_files import TENANTS_DIR, FileRefused

log = logging.getLogger(__name__)

# How much of an object a copy reads at once.
_COPY_CHUNK = 8 << 20
# What a store answers for an object that is not there or not the caller's to see; anything else
# it raises (botocore's, aiohttp's and fsspec's own trees included) is the store being down.
_MISSING = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


class ObjectStoreUnavailable(ServiceUnavailable):
    """The object store did not answer (a transport error, not a missing object): a 503."""

    def __init__(self) -> None:
        super().__init__("the object store did not answer; try again later", headers={"Retry-After": "5"})


class NoObjectFilesystem(SluiceError):
    """SLUICE_OBJECT_ROOT names a scheme this install has no fsspec filesystem for."""


def is_object_url(path: str) -> bool:
    """Whether a stored reference's path is an object's URL rather than a real local path (which is
    always absolute)."""
    return not path.startswith("/")


def in_store(uri: str, *, batch_root: Path | None, objects: ObjectStore | None) -> bool:
    """Whether `uri` names an object of the object store rather than a file under the batch root.
    Without a batch root every URI is the store's to refuse (a relative path names its folder), so
    a `file://` one is refused as a missing object is, not as a platform without a batch root."""
    return objects is not None and (batch_root is None or objects.owns(uri))


class ObjectStore:
    """The object root and its filesystem; built by `from_settings`, or directly in tests."""

    def __init__(self, *, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        parsed = urlparse(url)
        if not parsed.scheme or parsed.scheme == "file" or not parsed.netloc or parsed.query or parsed.fragment:
            raise ValueError("the object root must be an fsspec URL with a bucket, e.g. s3://bucket/prefix")
        self.protocol = parsed.scheme
        self._root = [parsed.netloc, *(part for part in parsed.path.split("/") if part)]
        self.url = self._url(self._root)
        self._options = dict(storage_options or {})
        self._fs: Any = None
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> ObjectStore | None:
        """The platform's store, or None when it has no SLUICE_OBJECT_ROOT."""
        if settings.object_root is None:
            return None
        store = cls(url=settings.object_root, storage_options=settings.object_options)
        # Checked at start, not at the first job: a missing package is the operator's to fix.
        try:
            import fsspec

            fsspec.get_filesystem_class(store.protocol)
        except (ImportError, ValueError) as exc:
            raise NoObjectFilesystem(f"SLUICE_OBJECT_ROOT is a {store.protocol}:// URL and this install has no "
                                     f"fsspec filesystem for it ({exc}); for s3://, pip install 'sluice[objects]'"
                                     ) from None
        return store

    def __repr__(self) -> str:
        # The storage options hold credentials: never in a repr, a log or an error.
        return f"ObjectStore(url={self.url!r})"

    # --- naming (no I/O) ---------------------------------------------------------------------------

    def owns(self, uri: str) -> bool:
        """Whether `uri` is spelled in this store's scheme (it may still be refused)."""
        return urlparse(uri).scheme == self.protocol

    def tenant_url(self, tenant: str) -> str:
        return self._url(self._tenant_parts(tenant))

    def resolve(self, uri: str, *, tenant: str, admin: bool) -> str:
        """The URL of the object `uri` names, if `tenant` (or an admin, anywhere under the root) may
        use it: a URL in this store's scheme, or a path relative to the tenant's folder."""
        own = self._tenant_parts(tenant)
        parts = self._named(uri, own)
        if not self._inside(parts, self._root if admin else own) or parts == own:
            raise FileRefused()
        return self._url(parts)

    def recheck(self, url: str) -> str:
        """A URL resolved at submit, checked again before use: still under this store's root (the
        root may have changed since). Which tenant's folder it is in was settled at submit."""
        parts = self._named(url, None)
        if not self._inside(parts, self._root):
            raise FileRefused()
        return self._url(parts)

    # --- the objects ---------------------------------------------------------------------------------

    def filesystem(self) -> Any:
        """The fsspec filesystem, made on first use and kept (a new client per call would cost a
        connection and a credential lookup per request)."""
        with self._lock:
            if self._fs is None:
                try:
                    import fsspec

                    self._fs = fsspec.filesystem(self.protocol, skip_instance_cache=True, **self._options)
                except (ImportError, ValueError, TypeError) as exc:
                    # The type only: the message may quote the options, which hold credentials.
                    log.error("the object store %s cannot be opened: %s", self.url, type(exc).__name__)
                    raise ObjectStoreUnavailable() from None
            return self._fs

    def size(self, url: str) -> int:
        """The size of the object at `url`, refused unless it is one (a "folder" is not)."""
        info = self._info(url)
        if info is None or info.get("type") != "file" or not isinstance(info.get("size"), int):
            raise FileRefused()
        return int(info["size"])

    def check_writable(self, url: str) -> None:
        """Refused when `url` is a "folder": an object written there could not be read back by name."""
        info = self._info(url)
        if info is not None and info.get("type") != "file":
            raise FileRefused()

    def open_read(self, url: str, *, block_size: int) -> IO[bytes]:
        """The object, read as a stream `block_size` bytes ahead; FileRefused if it is gone."""
        fs = self.filesystem()
        try:
            fs.invalidate_cache(url)
            handle: IO[bytes] = fs.open(url, "rb", block_size=block_size, cache_type="readahead")
        except _MISSING:
            raise FileRefused() from None
        return handle

    def copy_to(self, url: str, path: Path, *, max_bytes: int, limit_name: str) -> None:
        """Stream the object at `url` into the local file `path` a chunk at a time (never whole in
        memory), refused past `max_bytes` by its size before the first byte and while it is read."""
        size = self.size(url)
        if size > max_bytes:
            raise PayloadTooLarge(f"the object at input_uri holds {size} bytes; the limit is {max_bytes} "
                                  f"({limit_name})")
        try:
            source = self.open_read(url, block_size=_COPY_CHUNK)
        except FileRefused:
            raise
        except Exception:  # the store's transport, whatever its library raises
            raise ObjectStoreUnavailable() from None
        copied = 0
        with source, path.open("xb") as sink:
            while True:
                try:
                    chunk = source.read(_COPY_CHUNK)
                except _MISSING:
                    raise FileRefused() from None
                except Exception:
                    raise ObjectStoreUnavailable() from None
                if not chunk:
                    return
                copied += len(chunk)
                if copied > max_bytes:
                    raise PayloadTooLarge(f"the object at input_uri holds more than {max_bytes} bytes ({limit_name})")
                sink.write(chunk)

    def write(self, url: str, data: bytes) -> None:
        """Put the object whole: a reader sees all of it or what was there before (an object store
        makes a put visible at once, so no partial object is left on failure)."""
        fs = self.filesystem()
        try:
            fs.pipe_file(url, data)
        except _MISSING:
            raise FileRefused() from None
        finally:
            fs.invalidate_cache(url)

    def _info(self, url: str) -> dict[str, Any] | None:
        fs = self.filesystem()
        try:
            fs.invalidate_cache(url)
            info: dict[str, Any] = fs.info(url)
        except _MISSING:
            return None
        except Exception:  # the store's transport, whatever its library raises
            raise ObjectStoreUnavailable() from None
        return info

    # --- helpers ---------------------------------------------------------------------------------

    def _tenant_parts(self, tenant: str) -> list[str]:
        if tenant in ("", ".", "..") or "/" in tenant or "\\" in tenant or "\0" in tenant:
            raise FileRefused()
        return [*self._root, TENANTS_DIR, tenant]

    def _named(self, uri: str, own: list[str] | None) -> list[str]:
        """The segments of the object `uri` spells: its bucket and key, or, relative, `own`'s."""
        if "\0" in uri:
            raise FileRefused()
        parsed = urlparse(uri)
        if parsed.params or parsed.query or parsed.fragment:
            raise FileRefused()
        if own is not None and parsed.scheme == "" and parsed.netloc == "":
            return [*own, *self._segments(unquote(parsed.path))]
        if parsed.scheme == self.protocol and parsed.netloc:
            return [parsed.netloc, *self._segments(unquote(parsed.path).removeprefix("/"))]
        raise FileRefused()

    @staticmethod
    def _inside(parts: list[str], scope: list[str]) -> bool:
        return len(parts) > len(scope) and parts[:len(scope)] == scope

    @staticmethod
    def _segments(path: str) -> list[str]:
        parts = path.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise FileRefused()
        return parts

    def _url(self, parts: list[str]) -> str:
        return f"{self.protocol}://{'/'.join(parts)}"
