from __future__ import annotations

from litestar import Request, Response

from ..routing import get
from .common import kernel_of


@get("/health", access="public", summary="Is the server up, and which model does it serve")
async def health(request: Request) -> Response:
    status, body = kernel_of(request).health()
    return Response(body, status_code=status)


ROUTES = [health]
