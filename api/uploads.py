"""A batch's multipart upload, streamed from the socket to one file with a hard byte limit.

Starlette's form parser spools a whole body before the route sees any of it, so a chunked upload
with no Content-Length could not be refused until it had all arrived. Here python-multipart's
parser is fed `request.stream()` one chunk at a time and the limit is checked before each chunk
is parsed: the 413 comes as soon as the limit is passed, and the caller removes the partial file.

The surprise: the form fields may come before or after the file, so the file goes to a fixed
name (`upload.part`) and the caller renames it once the fields (its format) are known.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from anyio import to_thread
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from sluice.errors import InvalidInput, PayloadTooLarge

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

FILE_FIELD = "file"
PART_NAME = "upload.part"
# Everything around the file (boundaries, part headers, the other fields) may add this much.
FORM_OVERHEAD_BYTES = 1 << 20
MAX_FIELDS = 16
MAX_FIELD_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class Upload:
    fields: dict[str, str]
    filename: str
    path: Path
    size: int


@dataclass(slots=True)
class _Part:
    name: str = ""
    filename: str | None = None
    data: bytearray = field(default_factory=bytearray)


class _Form:
    """python-multipart's callbacks: fields kept (bounded), the file's bytes handed on to be written."""

    def __init__(self, *, limit: int) -> None:
        self.limit = limit
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.file_done = False
        self.file_bytes = 0
        self.pending: list[bytes] = []
        self._part = _Part()
        self._header_name = b""
        self._header_value = b""
        self._disposition = b""

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self._begin, "on_part_data": self._data, "on_part_end": self._end,
            "on_header_field": self._header_field, "on_header_value": self._header_value_part,
            "on_header_end": self._header_end, "on_headers_finished": self._headers_finished,
        }

    def _begin(self) -> None:
        self._part, self._disposition = _Part(), b""

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value_part(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name = self._header_value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise InvalidInput("each multipart part needs a Content-Disposition name")
        self._part.name = _text(options[b"name"])
        if b"filename" in options:
            if self._part.name != FILE_FIELD or self.filename is not None:
                raise InvalidInput(f"a batch upload has one file, in the '{FILE_FIELD}' part")
            self._part.filename = self.filename = _text(options[b"filename"])
        elif len(self.fields) >= MAX_FIELDS:
            raise InvalidInput(f"at most {MAX_FIELDS} form fields")

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._part.filename is not None:
            self.file_bytes += end - start
            if self.file_bytes > self.limit:
                raise PayloadTooLarge(f"the upload exceeds {self.limit} bytes")
            self.pending.append(data[start:end])
        else:
            self._part.data += data[start:end]
            if len(self._part.data) > MAX_FIELD_BYTES:
                raise PayloadTooLarge(f"the form field '{self._part.name}' exceeds {MAX_FIELD_BYTES} bytes")

    def _end(self) -> None:
        if self._part.filename is not None:
            self.file_done = True
        else:
            self.fields[self._part.name] = _text(bytes(self._part.data))


def _text(value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput("multipart field names and values must be UTF-8") from None


async def receive_upload(request: Request, *, folder: Path, limit: int) -> Upload:
    """Read the multipart body: its fields, and its one file written to `folder/upload.part`
    (the folder is made when the file starts). Raises PayloadTooLarge as soon as the file passes
    `limit` bytes or the body passes it by more than the form's overhead."""
    _, params = parse_options_header(request.headers.get("content-type"))
    boundary = params.get(b"boundary")
    if not boundary:
        raise InvalidInput("the multipart body has no boundary")
    form = _Form(limit=limit)
    parser = MultipartParser(boundary, form.callbacks())
    path = folder / PART_NAME
    handle: IO[bytes] | None = None
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit + FORM_OVERHEAD_BYTES:
                raise PayloadTooLarge(f"the upload exceeds {limit} bytes")
            try:
                parser.write(chunk)
            except FormParserError as exc:
                raise InvalidInput(f"the multipart body is malformed: {exc}") from None
            if form.pending:
                if handle is None:
                    handle = await to_thread.run_sync(_open, path)
                data, form.pending = b"".join(form.pending), []
                await to_thread.run_sync(handle.write, data)
        try:
            parser.finalize()
        except FormParserError as exc:
            raise InvalidInput(f"the multipart body is malformed: {exc}") from None
    finally:
        if handle is not None:
            await to_thread.run_sync(handle.close)
    if form.filename is None or not form.file_done:
        raise InvalidInput(f"the multipart body needs a '{FILE_FIELD}' part")
    if handle is None:  # an empty file: still a file, of no rows
        await to_thread.run_sync(lambda: _open(path).close())
    return Upload(fields=form.fields, filename=form.filename, path=path, size=form.file_bytes)


def _open(path: Path) -> IO[bytes]:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("wb")
