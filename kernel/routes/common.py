"""Helpers the kernel's route modules share: the kernel, the caller, JSON bodies, SSE."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from litestar import Request
from litestar.response import Stream

from ..app import principal_of
from ..errors import LocalmError

if TYPE_CHECKING:
    from ..runtime import Kernel

__all__ = ["kernel_of", "principal_of", "json_body", "REQUIRED", "sse"]

KEEPALIVE_SECONDS = 15.0


def kernel_of(request: Request) -> "Kernel":
    return request.app.state.kernel


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: ``json_body(empty=REQUIRED)``, the default: an empty body is refused.
REQUIRED: Any = _Required()
#: A body over this size is parsed off the event loop (a large upload takes a while).
PARSE_INLINE_BYTES = 256 * 1024
_MB = 1024 * 1024


async def json_body(request: Request, *, empty: Any = REQUIRED, require_object: bool = True,
                    max_bytes: int | None = None, missing: str = "A JSON body is required",
                    not_object: str = "The body must be a JSON object",
                    refuse: Callable[[str, str], Exception] | None = None) -> Any:
    """The request's JSON body, read once for every route (the kernel's and the plugins').

    - ``empty``: what an empty or blank body reads as (``{}``, ``None``, ...); left out, such
      a body is refused with ``missing``.
    - ``require_object``: a body that is not a JSON object is refused with ``not_object``;
      ``False`` returns any JSON value.
    - ``max_bytes``: a larger body is refused with 413 ``request_too_large`` before it is parsed.
    - Invalid JSON is refused with "The body is not valid JSON".
    - ``refuse(reason, message)`` builds the error for a refusal, where ``reason`` is
      ``"missing"``, ``"invalid"``, ``"not_object"`` or ``"too_large"``; by default a
      ``LocalmError`` (400, or 413 for ``too_large``), which the route's error family shapes.

    A body over 256 KiB is parsed in a worker thread.
    """
    def error(reason: str, message: str, status: int = 400, code: str | None = None) -> Exception:
        return refuse(reason, message) if refuse is not None else LocalmError(status, message, code=code)

    raw = await request.body()
    if max_bytes is not None and len(raw) > max_bytes:
        size = f"{max_bytes // _MB} MB" if max_bytes >= _MB else f"{max_bytes} bytes"
        raise error("too_large", f"The request is over {size}", 413, "request_too_large")
    if not raw.strip():
        if empty is REQUIRED:
            raise error("missing", missing)
        return empty
    try:
        body = json.loads(raw) if len(raw) <= PARSE_INLINE_BYTES else await asyncio.to_thread(json.loads, raw)
    except ValueError:
        raise error("invalid", "The body is not valid JSON") from None
    if require_object and not isinstance(body, dict):
        raise error("not_object", not_object)
    return body


def sse(events: AsyncIterator[dict[str, Any]], *, ids: bool = True) -> Stream:
    """Server-sent events: one ``data:`` line per event, ``: keepalive`` while idle."""

    async def body() -> AsyncIterator[bytes]:
        iterator = events.__aiter__()
        pending: asyncio.Future[Any] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(iterator.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_SECONDS)
                if not done:
                    yield b": keepalive\n\n"
                    continue
                try:
                    event = pending.result()
                except StopAsyncIteration:
                    return
                finally:
                    if pending.done():
                        pending = None
                head = f"id: {event['seq']}\n" if ids and "seq" in event else ""
                yield f"{head}data: {json.dumps(event)}\n\n".encode()
        finally:
            if pending is not None:
                pending.cancel()

    return EventStream(body(), media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class EventStream(Stream):
    """A ``text/event-stream`` response, whatever media type the route handler declares."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = "text/event-stream"
        return super().to_asgi_response(*args, **kwargs)
