"""Server control (shutdown, restart) and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response

from ..routing import get, post
from .common import kernel_of


@post("/v1/server/shutdown", scope="config:write", summary="Unload everything and exit")
async def shutdown(request: Request) -> dict[str, Any]:
    kernel_of(request).request_exit(restart=False)
    return {"stopping": True}


@post("/v1/server/restart", scope="config:write", summary="Restart the process in place on the same port")
async def restart(request: Request) -> dict[str, Any]:
    kernel_of(request).request_exit(restart=True)
    return {"restarting": True}


@get("/metrics", scope="admin", opt={"gate": True}, summary="Prometheus text-format metrics")
async def metrics(request: Request) -> Response:
    k = kernel_of(request)
    m = k.metrics
    assert m is not None  # the route is mounted only when metrics are on
    m.observe_engines([resident.engine for resident in list(k.models.resident.values())])
    return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


ROUTES = [shutdown, restart]
METRICS_ROUTES = [metrics]
