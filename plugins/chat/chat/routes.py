"""The chat plugin's own route: POST /api/chat/extract, a chat attachment's text (scope ``chat``)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from localm import sdk
from msgspec import Meta

#: A request holds one file of at most 30 MB, as base64 (4/3 of it) with room for the JSON around it.
MAX_BODY_BYTES = 42 * 1024 * 1024


class Extract(sdk.Struct, kw_only=True):
    filename: Annotated[str, Meta(description="The file's name; its extension says how to read it")]
    content_b64: Annotated[str, Meta(description="The file's bytes, base64 (at most 30 MB decoded: 413)")]
    max_chars: Annotated[int, Meta(description="Clamped to 500..200,000; left out: the whole text")] | None = None


@sdk.post("/api/chat/extract", scope="chat", summary="A chat attachment's plain text, extracted in memory",
          request_max_body_size=MAX_BODY_BYTES, body=Extract,
          errors={400: "No filename or content_b64, content that is not base64 (invalid_base64), or a max_chars "
                       "that is not an integer",
                  413: "A file over 30 MB (file_too_large), or one that unpacks past a limit (document_too_large)",
                  422: "A file with no text to read: binary, corrupt, encrypted, or of a kind whose reader is not "
                       "installed (extractor_missing)"})
async def extract_text(request: sdk.Request) -> dict[str, Any]:
    from localm.sdk import extract  # the readers load with the first file
    body = await sdk.json_body(request, max_bytes=MAX_BODY_BYTES)
    return await asyncio.to_thread(extract.upload, body)


HANDLERS = [extract_text]
