"""GET /api/update/check, POST /api/update/apply, GET and POST /api/update/rollback.

The work is :mod:`localm.kernel.updates`'s; these routes run it off the event loop, show a
caller who is not the owner paths as ``<data>/...`` (and the owner-only update_url as
``<update_url>``), and restart the server after an update or rollback that asks for it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from litestar import Request

from ..errors import LocalmError
from ..routing import get, post
from .common import kernel_of, principal_of

log = logging.getLogger("localm")

_SCRUBBED = ("error", "reason", "backup", "asset", "note")


async def _run(request: Request, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``work()`` in a worker thread, its answer and refusals as this caller may see them."""
    k = kernel_of(request)
    owner = principal_of(request).is_owner
    url = str(k.config.get("update_url") or "")
    try:
        out = await asyncio.to_thread(work)
    except LocalmError as exc:
        if owner:
            raise
        raise LocalmError(exc.status, k.updates.scrub(exc.detail, owner=False, url=url), code=exc.code,
                          headers=exc.headers, **exc.extra) from None
    if not owner:
        out = {key: k.updates.scrub(value, owner=False, url=url) if key in _SCRUBBED and isinstance(value, str)
               else value for key, value in out.items()}
    return out


def _restart(request: Request, out: dict[str, Any]) -> dict[str, Any]:
    """Restart in place when ``out`` says so and this server can (``localm serve`` can)."""
    k = kernel_of(request)
    if out.get("restarting"):
        if k.exit_handler is None:
            out["restarting"] = False
            log.warning("the build changed, but this server cannot restart itself: restart it")
        else:
            k.request_exit(restart=True)
    return out


@get("/api/update/check", scope="config:read", summary="Whether a newer build is available (applies nothing)")
async def check(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    return await _run(request, lambda: k.updates.check(k.config))


@post("/api/update/apply", scope="config:write", summary="Download, verify and apply the latest signed build",
      errors={400: "No updater is configured, the release has no downloadable build, or it needs pip "
                   "(a deps-class release)",
              409: "An update or rollback is already running",
              500: "The update failed partway and the old build could not be put back",
              502: "The release feed or the build could not be fetched, or net_mode is off"})
async def apply(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    return _restart(request, await _run(request, lambda: k.updates.apply(k.config)))


@get("/api/update/rollback", scope="config:read", summary="Whether a rollback is possible, and to which build")
async def rollback_info(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    return await _run(request, k.updates.rollback_info)


@post("/api/update/rollback", scope="admin", summary="Restore the build the last update replaced, and restart",
      errors={403: "A key without the admin scope",
              409: "There is no backup, it was made of another build, or an update or rollback is running",
              500: "The restore failed partway (the backup is kept)"})
async def rollback(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    return _restart(request, await _run(request, k.updates.rollback))


ROUTES = [check, apply, rollback_info, rollback]
