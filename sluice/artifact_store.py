"""Artifacts in a store: published by content hash, fetched into a local cache, verified before use.

A store is any URL fsspec can write or read: ``file:///srv/artifacts``, ``s3://bucket/prefix``,
``gs://...``, ``memory://...`` (each needs its fsspec filesystem package, e.g. s3fs), and
``https://`` / ``http://`` for reading (a web server in front of a store's files; fsspec's
HTTPFileSystem over aiohttp). The layout is content addressed, so what a URI names never changes:

* a file: ``<store>/sha256/<sha256 of its bytes>/<file name>``;
* a directory: ``<store>/sha256/<sha256 of its manifest>/`` holding its files under their
  relative paths, and its manifest as ``MANIFEST.sha256`` (see :mod:`sluice.artifacts` for the
  format). The manifest lets a plain HTTP server, which cannot list, serve a directory file by
  file; a URI whose ``MANIFEST.sha256`` exists is a directory artifact.

:func:`fetch` downloads into ``<cache_dir>/<sha256>/`` (a directory artifact is that folder, with
its ``MANIFEST.sha256``; a file is ``<cache_dir>/<sha256>/<file name>``), through a temporary
folder in ``cache_dir`` that is renamed into place only once its content has the expected
sha256. A cached copy is verified again before every use; one that fails is deleted and fetched
again. The manifest is checked against the expected sha256 before any file is downloaded, and a
manifest path that could leave the folder (absolute, ``..``) is refused.

TLS: ``https://`` uses the system trust store unless ``ca_bundle`` names a PEM bundle, which then
replaces it (as ``REQUESTS_CA_BUNDLE`` does); for ``s3://`` the bundle is passed to the client as
``verify``; other protocols take theirs through ``storage_options``. Filesystems are made for
each call (never fsspec's instance cache) and their HTTP sessions closed on return. Transport
errors (fsspec, aiohttp, OSError) become ArtifactError; a missing object is "artifact not found
at <uri>".
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import ssl
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any
from urllib.parse import quote, unquote, urlparse

from sluice.artifacts import (
    MANIFEST_NAME,
    file_sha256,
    is_remote,
    manifest_text,
    normalized_sha256,
    parse_artifact,
    parse_manifest,
    resolve_artifact,
    text_sha256,
    verify_artifact,
)
from sluice.errors import ArtifactError, ArtifactMismatch

log = logging.getLogger(__name__)

STORE_PREFIX = "sha256"
HTTP_PROTOCOLS = ("http", "https")
# Schemes whose URLs carry percent-encoded paths (object-store keys are taken as they are).
_QUOTED_PROTOCOLS = ("file", *HTTP_PROTOCOLS)
CONNECT_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 120.0  # between two reads of a body, not for the whole download
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class PublishedArtifact:
    """Where :func:`publish` put an artifact, and the sha256 to register with it."""

    uri: str
    sha256: str


# --- URLs -----------------------------------------------------------------------------------------


def _protocol(url: str) -> str:
    scheme, sep, _ = url.partition("://")
    if not sep or not scheme:
        raise ArtifactError(f"not a store URL (scheme://...): {url!r}")
    return scheme.lower()


def _join(base: str, relative: str, protocol: str) -> str:
    """``base/relative``, the relative part percent-encoded where ``protocol``'s URLs are."""
    rel = quote(relative, safe="/") if protocol in _QUOTED_PROTOCOLS else relative
    return f"{base.rstrip('/')}/{rel}"


def _child(root: str, relative: str, protocol: str) -> str:
    """``relative`` under ``root``, a path on a filesystem from :func:`_filesystem` (a URL for HTTP)."""
    rel = quote(relative, safe="/") if protocol in HTTP_PROTOCOLS else relative
    return f"{root.rstrip('/')}/{rel}"


def store_uri(store_url: str, sha256: str, filename: str | None = None) -> str:
    """The URI of an artifact in the store at ``store_url``: a directory's when ``filename`` is
    None, else that file's. The same relative part works under any URL that serves the store
    (publish to ``file:///srv/store``, fetch from ``https://host/store``)."""
    relative = f"{STORE_PREFIX}/{normalized_sha256(sha256)}"
    if filename is not None:
        relative += f"/{filename}"
    return _join(store_url, relative, _protocol(store_url))


def _local_path(url: str) -> Path:
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ArtifactError(f"file URL on another host not supported: {url!r}")
    return Path(unquote(parsed.path))


def _file_name(uri: str, protocol: str) -> str | None:
    """The last part of ``uri``'s path, when it can name a file in the cache."""
    path = urlparse(uri).path if protocol in _QUOTED_PROTOCOLS else uri.partition("://")[2]
    name = path.rstrip("/").rpartition("/")[2]
    if protocol in _QUOTED_PROTOCOLS:
        name = unquote(name)
    if name in ("", ".", "..", MANIFEST_NAME) or any(c in name for c in "/\\\n\r\0"):
        return None
    return name


# --- filesystems and their errors ---------------------------------------------------------------


def _ssl_context(ca_bundle: Path | None) -> ssl.SSLContext:
    if ca_bundle is None:
        return ssl.create_default_context()
    try:
        return ssl.create_default_context(cafile=str(ca_bundle))
    except OSError as exc:  # ssl.SSLError is an OSError
        raise ArtifactError(f"CA bundle {ca_bundle} unreadable: {exc}") from exc


def _http_client_factory(context: ssl.SSLContext) -> Callable[..., Awaitable[Any]]:
    """fsspec's ``get_client``: an aiohttp session that trusts ``context``, made in fsspec's loop."""

    async def get_client(**kwargs: Any) -> Any:
        import aiohttp

        kwargs.pop("loop", None)
        kwargs.setdefault("timeout", aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S,
                                                           sock_read=READ_TIMEOUT_S))
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context), **kwargs)

    return get_client


def _close(fs: Any) -> None:
    session = getattr(fs, "_session", None)
    loop = getattr(fs, "loop", None)
    if session is None or loop is None or getattr(session, "closed", True):
        return
    from fsspec.asyn import sync

    sync(loop, session.close)


@contextmanager
def _filesystem(url: str, *, ca_bundle: Path | None,
                storage_options: Mapping[str, Any] | None) -> Iterator[tuple[Any, str]]:
    """A filesystem for ``url`` made for this call, and ``url``'s path on it."""
    protocol = _protocol(url)
    options = dict(storage_options or {})
    try:
        import fsspec

        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        raise ArtifactError(f"no filesystem for {protocol}:// here ({exc}); install its fsspec package") from exc
    if protocol in HTTP_PROTOCOLS:
        options.setdefault("get_client", _http_client_factory(_ssl_context(ca_bundle)))
    elif ca_bundle is not None and protocol in ("s3", "s3a"):
        client_kwargs = dict(options.get("client_kwargs") or {})
        client_kwargs.setdefault("verify", str(ca_bundle))
        options["client_kwargs"] = client_kwargs
    path = str(_local_path(url)) if protocol == "file" else cls._strip_protocol(url)
    try:
        fs = cls(skip_instance_cache=True, **options)
    except (TypeError, ValueError, OSError) as exc:
        raise ArtifactError(f"cannot open the store at {url}: {exc}") from exc
    try:
        yield fs, path
    finally:
        _close(fs)


def _transport_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError]  # TimeoutError and ssl errors included
    try:
        import aiohttp

        errors.append(aiohttp.ClientError)
    except ImportError:
        pass
    return tuple(errors)


def _describe(exc: BaseException) -> str:
    cert = getattr(exc, "certificate_error", None)
    if isinstance(exc, ssl.SSLCertVerificationError) or isinstance(cert, ssl.SSLCertVerificationError):
        return (f"the server's TLS certificate is not trusted ({cert or exc}); if the store uses a "
                "private CA, set its CA bundle")
    try:
        from aiohttp import ClientConnectorError

        if isinstance(exc, ClientConnectorError):
            return f"the store is unreachable ({exc})"
    except ImportError:
        pass
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return f"HTTP {status} {getattr(exc, 'message', '')}".rstrip()
    return f"{type(exc).__name__}: {exc}"


@contextmanager
def _translated(action: str, uri: str) -> Iterator[None]:
    try:
        yield
    except ArtifactError:
        raise
    except FileNotFoundError as exc:
        raise ArtifactError(f"artifact not found at {uri}") from exc
    except _transport_errors() as exc:
        raise ArtifactError(f"{action} {uri} failed: {_describe(exc)}") from exc


# --- local helpers --------------------------------------------------------------------------------


def _stream(source: Path, out: IO[bytes]) -> str:
    """Copy ``source`` into ``out``; the sha256 of what was copied."""
    digest = hashlib.sha256()
    try:
        with source.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
    except FileNotFoundError as exc:
        raise ArtifactError(f"artifact file not found: {source}") from exc
    return digest.hexdigest()


def _changed(source: Path, expected: str, actual: str) -> ArtifactError:
    return ArtifactError(f"{source} changed while it was published (sha256 {expected} when hashed, "
                         f"{actual} when copied): publish it again")


def _copy_local(source: Path, target: Path, expected: str) -> None:
    """Copy ``source`` to the new file ``target`` (synced), checking it is what was hashed."""
    with target.open("xb") as out:
        actual = _stream(source, out)
        out.flush()
        os.fsync(out.fileno())
    if actual != expected:
        raise _changed(source, expected, actual)


def _discard(path: Path) -> None:
    """Remove a file, symlink or folder; a folder is first renamed aside, so nobody sees half of it."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
        return
    trash = path.with_name(f".trash-{path.name[:16]}-{uuid.uuid4().hex}")
    try:
        path.rename(trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _temp_dir(parent: Path, sha256: str) -> Path:
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f".tmp-{sha256[:16]}-{uuid.uuid4().hex}"
        tmp.mkdir()
    except OSError as exc:
        raise ArtifactError(f"cannot write under {parent}: {exc}") from exc
    return tmp


# --- publish --------------------------------------------------------------------------------------


def publish(local: Path | str, store_url: str, *, ca_bundle: Path | None = None,
            storage_options: Mapping[str, Any] | None = None) -> PublishedArtifact:
    """Copy the file or directory ``local`` into the store at ``store_url`` (see the module
    docstring for the layout); its URI and sha256. Publishing the same bytes again changes nothing.

    ``file://`` stores are written atomically (a directory is assembled in a temporary folder and
    renamed into place); object stores write each object whole and the manifest last, so a
    directory without its ``MANIFEST.sha256`` is incomplete and cannot be fetched. HTTP(S)
    stores are read-only here: publish to the storage behind them.
    """
    source = Path(local)
    protocol = _protocol(store_url)
    if protocol in HTTP_PROTOCOLS:
        raise ArtifactError(f"cannot publish to {store_url}: HTTP stores are read-only here; publish to the "
                            "file:// or object-store URL behind it")
    store_url = store_url.rstrip("/")
    if source.is_dir():
        text = manifest_text(source)
        sha = text_sha256(text)
        files = parse_manifest(text)
        uri = store_uri(store_url, sha)
        with _translated("publishing", uri):
            if protocol == "file":
                _publish_dir_local(source, _local_path(store_url) / STORE_PREFIX, sha, text, files)
            else:
                _publish_dir_remote(source, store_url, sha, text, files, ca_bundle, storage_options)
    elif source.is_file():
        name = source.name
        if name == MANIFEST_NAME:
            raise ArtifactError(f"a file artifact cannot be named {MANIFEST_NAME}: {source}")
        sha = file_sha256(source)
        uri = store_uri(store_url, sha, name)
        with _translated("publishing", uri):
            if protocol == "file":
                _publish_file_local(source, _local_path(store_url) / STORE_PREFIX / sha, sha)
            else:
                _publish_file_remote(source, store_url, sha, ca_bundle, storage_options)
    else:
        raise ArtifactError(f"artifact to publish not found: {source}")
    log.info("published %s as %s", source, uri)
    return PublishedArtifact(uri=uri, sha256=sha)


def _publish_dir_local(source: Path, root: Path, sha: str, text: str, files: Mapping[str, str]) -> None:
    dest = root / sha
    if (dest / MANIFEST_NAME).is_file():
        try:
            verify_artifact(dest, sha)
            return
        except ArtifactError as exc:
            log.warning("replacing a damaged copy in the store: %s", exc)
    tmp = _temp_dir(root, sha)
    try:
        for relative, digest in files.items():
            target = tmp.joinpath(*PurePosixPath(relative).parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            _copy_local(source / relative, target, digest)
        (tmp / MANIFEST_NAME).write_bytes(text.encode("utf-8"))
        if dest.exists() or dest.is_symlink():
            _discard(dest)
        try:
            tmp.rename(dest)
        except OSError:
            verify_artifact(dest, sha)  # published by someone else meanwhile
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish_file_local(source: Path, folder: Path, sha: str) -> None:
    dest = folder / source.name
    if dest.is_file() and not dest.is_symlink() and file_sha256(dest) == sha:
        return
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".tmp-{uuid.uuid4().hex}"
    try:
        _copy_local(source, tmp, sha)
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)


def _upload(fs: Any, source: Path, rpath: str, expected: str) -> None:
    fs.makedirs(fs._parent(rpath), exist_ok=True)
    with fs.open(rpath, "wb") as out:
        actual = _stream(source, out)
    if actual != expected:
        fs.rm_file(rpath)
        raise _changed(source, expected, actual)


def _publish_dir_remote(source: Path, store_url: str, sha: str, text: str, files: Mapping[str, str],
                        ca_bundle: Path | None, storage_options: Mapping[str, Any] | None) -> None:
    with _filesystem(store_url, ca_bundle=ca_bundle, storage_options=storage_options) as (fs, root):
        base = f"{root.rstrip('/')}/{STORE_PREFIX}/{sha}"
        if fs.exists(f"{base}/{MANIFEST_NAME}"):
            return
        for relative, digest in files.items():
            _upload(fs, source / relative, f"{base}/{relative}", digest)
        fs.pipe_file(f"{base}/{MANIFEST_NAME}", text.encode("utf-8"))


def _publish_file_remote(source: Path, store_url: str, sha: str, ca_bundle: Path | None,
                         storage_options: Mapping[str, Any] | None) -> None:
    with _filesystem(store_url, ca_bundle=ca_bundle, storage_options=storage_options) as (fs, root):
        rpath = f"{root.rstrip('/')}/{STORE_PREFIX}/{sha}/{source.name}"
        if fs.exists(rpath) and fs.size(rpath) == source.stat().st_size:
            return
        _upload(fs, source, rpath, sha)


# --- fetch ----------------------------------------------------------------------------------------


def fetch(uri: str, sha256: str, *, cache_dir: Path, ca_bundle: Path | None = None,
          storage_options: Mapping[str, Any] | None = None) -> Path:
    """The local path of the artifact at ``uri`` with sha256 ``sha256``: from ``cache_dir`` when a
    copy there still verifies, else downloaded into it and verified before it is kept.

    Raises ArtifactMismatch when what the store serves has another sha256 (nothing is kept), and
    ArtifactError when the store cannot be reached, has no artifact at ``uri``, or serves a
    manifest naming paths outside the artifact.
    """
    expected = normalized_sha256(sha256)
    uri = uri.rstrip("/")
    protocol = _protocol(uri)
    filename = _file_name(uri, protocol)
    cache_dir = Path(cache_dir)
    entry = cache_dir / expected
    cached = _from_cache(entry, expected, filename, uri)
    if cached is not None:
        return cached
    tmp = _temp_dir(cache_dir, expected)
    try:
        with _filesystem(uri, ca_bundle=ca_bundle, storage_options=storage_options) as (fs, root):
            manifest = _read_manifest(fs, _child(root, MANIFEST_NAME, protocol), uri)
            if manifest is None:
                if filename is None:
                    raise ArtifactError(f"artifact not found at {uri}: no file name there, and no {MANIFEST_NAME}")
                _download(fs, root, tmp / filename, uri)
                verify_artifact(tmp / filename, expected, name=uri)
            else:
                _download_directory(fs, root, protocol, manifest, tmp, uri, expected)
                verify_artifact(tmp, expected, name=uri)
        return _install(tmp, entry, expected, None if manifest is not None else filename, uri)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _from_cache(entry: Path, expected: str, filename: str | None, uri: str) -> Path | None:
    """The cached artifact under ``entry`` if it verifies; a copy that does not is deleted."""
    if not (entry.exists() or entry.is_symlink()):
        return None
    target = entry if (entry / MANIFEST_NAME).is_file() else (entry / filename if filename else None)
    try:
        if entry.is_symlink() or target is None or not target.exists():
            raise ArtifactError(f"cache entry {entry} does not hold {uri}")
        verify_artifact(target, expected, name=f"{uri} cached at {target}")
        return target
    except ArtifactError as exc:
        log.warning("discarding a cached artifact that fails verification, to fetch it again: %s", exc)
        _discard(entry)
        return None


def _read_manifest(fs: Any, url: str, uri: str) -> bytes | None:
    """The ``MANIFEST.sha256`` at ``url``; None where there is none (``uri`` is a file)."""
    try:
        with _translated("fetching", uri):
            data: bytes = fs.cat_file(url)
    except ArtifactError as exc:
        cause = exc.__cause__
        if isinstance(cause, FileNotFoundError | NotADirectoryError | PermissionError):
            return None
        raise
    return data


def _download(fs: Any, rpath: str, target: Path, uri: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with _translated("downloading", uri):
        fs.get_file(rpath, str(target))
    if not target.is_file() or target.is_symlink():  # get_file mirrors a folder as a folder
        raise ArtifactError(f"artifact not found at {uri}: a folder without a {MANIFEST_NAME}")


def _download_directory(fs: Any, root: str, protocol: str, manifest: bytes, tmp: Path, uri: str,
                        expected: str) -> None:
    try:
        text = manifest.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ArtifactError(f"{MANIFEST_NAME} of {uri} is not UTF-8") from exc
    try:
        files = parse_manifest(text)
    except ArtifactError as exc:
        raise ArtifactError(f"{MANIFEST_NAME} of {uri} refused: {exc}") from exc
    actual = text_sha256(manifest)
    if actual != expected:
        raise ArtifactMismatch(f"sha256 mismatch for directory artifact {uri}: expected {expected}, actual "
                               f"{actual} (the sha256 of its {MANIFEST_NAME})")
    for relative, digest in files.items():
        target = tmp.joinpath(*PurePosixPath(relative).parts)
        if not target.resolve().is_relative_to(tmp.resolve()):  # parse_manifest refused '..' already
            raise ArtifactError(f"{MANIFEST_NAME} of {uri} names {relative!r}, outside the artifact")
        url = _join(uri, relative, protocol)
        _download(fs, _child(root, relative, protocol), target, url)
        got = file_sha256(target)
        if got != digest:
            raise ArtifactMismatch(f"sha256 mismatch for {url} (file {relative} of directory artifact {uri}, "
                                   f"sha256 {expected}): expected {digest}, actual {got}")
    (tmp / MANIFEST_NAME).write_bytes(manifest)


def _install(tmp: Path, entry: Path, expected: str, filename: str | None, uri: str) -> Path:
    """Rename the verified ``tmp`` to ``entry``; the artifact's path there."""
    try:
        tmp.rename(entry)
    except OSError as exc:
        # Another fetch of the same artifact got there first: use its copy if it verifies.
        cached = _from_cache(entry, expected, filename, uri)
        if cached is None:
            raise ArtifactError(f"cannot put {uri} into the artifact cache at {entry}: {exc}") from exc
        return cached
    log.info("fetched %s into %s", uri, entry)
    return entry / filename if filename is not None else entry


def resolve_and_verify(uri: str, sha256: str | None, *, cache_dir: Path | None = None,
                       ca_bundle: Path | None = None) -> Path:
    """Resolve ``uri`` and check its hash; a missing hash is refused for real artifacts.

    Local URIs (``pkg:``, ``file:``, paths) are verified in place. Store URIs (``https://``,
    ``s3://``, ...) are fetched into ``cache_dir`` (required for them) and verified there before
    the path is returned; ``ca_bundle`` replaces the system trust store for ``https://``.
    """
    if not sha256:
        raise ArtifactError(f"no sha256 recorded for artifact {uri!r}; refusing to load it")
    location = parse_artifact(uri).location
    if is_remote(location):
        if cache_dir is None:
            raise ArtifactError(f"artifact {location!r} is in a store, and no artifact cache directory is set "
                                "to fetch it into")
        return fetch(location, sha256, cache_dir=cache_dir, ca_bundle=ca_bundle)
    path = resolve_artifact(location)
    verify_artifact(path, sha256, name=f"{location} ({path})" if location != str(path) else None)
    return path
