"""A multipart/form-data upload read into memory as it arrives, with its limits enforced on
the way: nothing is spooled to disk (Litestar's own form reader would spool a large file),
and a body too large is refused before it has been read.

The file's name is kept only to be shown; it is never used as a path.
"""

from __future__ import annotations

from typing import Any

import attrs
import multipart
from localm import sdk

MiB = 1024 * 1024
MAX_FILE = 25 * MiB
MAX_FIELD = 64 * 1024
MAX_PARTS = 64
#: The whole body: the file, the other fields and the multipart framing.
MAX_BODY = MAX_FILE + 256 * 1024


@attrs.frozen
class Form:
    fields: dict[str, list[str]]
    file: bytes | None
    filename: str | None


def too_large(what: str) -> sdk.LocalmError:
    return sdk.LocalmError(413, f"{what} is larger than the {MAX_FILE // MiB} MB a transcription accepts",
                           code="file_too_large")


async def read_form(request: sdk.Request, *, file_field: str = "file") -> Form:
    """The fields and the one file of a multipart upload (415 for another body, 413 when too
    large: from Content-Length before reading anything, else as soon as the count passes it)."""
    mime, params = multipart.parse_options_header(request.headers.get("content-type", ""))
    if mime != "multipart/form-data":
        raise sdk.LocalmError(415, "The body must be multipart/form-data with the audio as its file field "
                                   f"(got {mime or 'no content type'})", code="unsupported_media_type")
    boundary = params.get("boundary")
    if not boundary:
        raise sdk.LocalmError(400, "The multipart/form-data content type has no boundary", code="invalid_body")
    announced = request.headers.get("content-length")
    if announced is not None and announced.isdigit() and int(announced) > MAX_BODY:
        raise too_large(f"The upload ({int(announced) / MiB:.1f} MB)")
    fields: dict[str, list[str]] = {}
    file: list[bytes] | None = None
    filename: str | None = None
    current: Any = None
    chunks: list[bytes] = []
    size = received = 0
    try:
        with multipart.PushMultipartParser(boundary, max_segment_count=MAX_PARTS) as parser:
            async for chunk in request.stream():
                received += len(chunk)
                if received > MAX_BODY:
                    raise too_large("The upload")
                for event in parser.parse(chunk):
                    if isinstance(event, multipart.MultipartSegment):
                        current, chunks, size = event, [], 0
                        if event.name == file_field and file is not None:
                            raise sdk.LocalmError(400, f"Send one {file_field}, not several", code="invalid_body")
                    elif event:
                        size += len(event)
                        if current.name == file_field:
                            if size > MAX_FILE:
                                raise too_large(f"The {file_field}")
                        elif size > MAX_FIELD:
                            raise sdk.LocalmError(400, f"The field {current.name} is longer than "
                                                       f"{MAX_FIELD // 1024} KB", code="invalid_body")
                        chunks.append(bytes(event))
                    else:
                        if current.name == file_field:
                            file, filename = chunks, current.filename
                        else:
                            text = b"".join(chunks).decode("utf-8", errors="replace")
                            fields.setdefault(current.name, []).append(text)
                        current, chunks = None, []
                if parser.closed:
                    break
    except (multipart.ParserError, multipart.ParserLimitReached) as exc:
        raise sdk.LocalmError(400, f"The multipart body cannot be read: {exc}", code="invalid_body") from None
    return Form(fields=fields, file=b"".join(file) if file is not None else None, filename=filename)
