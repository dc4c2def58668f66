"""Helpers the kernel's route modules share: the kernel, the caller, JSON bodies, SSE."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, AsyncIterator

from litestar import Request
from litestar.response import Stream

from ..app import principal_of
from ..errors import LocalmError

if TYPE_CHECKING:
    from ..runtime import Kernel

__all__ = ["kernel_of", "principal_of", "json_body", "sse"]

KEEPALIVE_SECONDS = 15.0


def kernel_of(request: Request) -> "Kernel":
    return request.app.state.kernel


async def json_body(request: Request, *, required: bool = True, status: int = 400) -> Any:
    """The request's JSON body; an empty body is None unless ``required``."""
    raw = await request.body()
    if not raw.strip():
        if required:
            raise LocalmError(status, "A JSON body is required")
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise LocalmError(status, "The body is not valid JSON") from exc


async def json_object(request: Request, *, required: bool = True) -> dict[str, Any]:
    body = await json_body(request, required=required)
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise LocalmError(400, "The body must be a JSON object")
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
