"""The instance routes: what another localm instance on this machine asks this one. They take
no bearer key; each request carries an instance vouch instead (kernel/instances.py), and
anything else is a 403 ``vouch_refused``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from litestar import Request

from ..errors import LocalmError
from ..routing import get, post
from .common import kernel_of

_VOUCH = {403: "No instance vouch, or one that does not verify: a stale or replayed one, or one from an instance "
               "not in this user's instance registry (code vouch_refused)"}


async def _caller(request: Request) -> Any:
    """The instance a request's vouch proves (403 otherwise)."""
    k = kernel_of(request)
    body = await request.body()
    path = request.scope.get("raw_path", b"").decode("latin-1") or request.url.path
    query = request.scope.get("query_string", b"").decode("latin-1")
    if query:
        path = f"{path}?{query}"
    return k.instances.check_vouch(request.headers, request.method, path, body)


def file_identity(entry: Any) -> dict[str, Any]:
    """What a model's weights are, for matching by file: path, sha256 (when known), file name, size."""
    path = str(entry.path or "")
    out: dict[str, Any] = {"path": None, "sha256": entry.sha256 or None, "file": None,
                           "size_bytes": entry.size_bytes or None}
    if path and "://" not in path:  # weights on this machine (not an upstream's URL)
        try:
            resolved = Path(path).resolve()
            if resolved.exists():
                out["path"] = str(resolved)
                out["file"] = resolved.name
                if not out["size_bytes"] and resolved.is_file():
                    out["size_bytes"] = os.path.getsize(resolved)
        except OSError:
            pass
    return out


@get("/v1/instances/status", access="public", cancel_on_disconnect=True,
     summary="For another instance on this machine: who this instance is and which models it has loaded",
     errors={**_VOUCH, 400: "No nonce, or one over 128 characters"})
async def instance_status(request: Request, nonce: str | None = None) -> dict[str, Any]:
    """``proof`` answers the caller's ``nonce`` under this instance's secret (the caller checks
    it with the secret in this instance's registry file). ``models`` are the loaded models with
    their file identity; a model this instance itself forwards elsewhere is not listed."""
    caller = await _caller(request)
    if not nonce or len(nonce) > 128:
        raise LocalmError(400, "nonce is required (at most 128 characters)", field="nonce")
    k = kernel_of(request)
    models = []
    for resident in list(k.models.resident.values()):
        if resident.unloading:
            continue
        entry = resident.entry
        models.append({"model": entry.id, "role": entry.role, "type": entry.type, **file_identity(entry),
                       "context_window": resident.engine.capabilities.context_window,
                       "in_flight": resident.in_flight, "active": k.models.active == entry.id})
    return {"instance_id": k.instances.instance_id, "proof": k.instances.proof(nonce, caller.instance_id),
            "requires_key": k.auth_required(), "session_mode": k.config.get("session_mode"),
            "active": k.models.active, "models": models}


@post("/v1/instances/vouch", access="public",
      summary="Check an instance vouch: which instance on this machine this request comes from",
      errors=_VOUCH)
async def instance_vouch(request: Request) -> dict[str, Any]:
    """The cheapest proof of the pair: an instance that gets a 200 here knows this one accepts
    its vouches (same user, same registry folder, clocks in step)."""
    caller = await _caller(request)
    k = kernel_of(request)
    return {"status": "vouched", "caller": caller.public(), "instance_id": k.instances.instance_id}


@post("/v1/instances/cooperate-unload", access="public",
      summary="Another instance on this machine asks for memory: unload the models no request is using",
      errors=_VOUCH)
async def cooperate_unload(request: Request) -> dict[str, Any]:
    """``freed`` lists the models unloaded, ``kept_in_use`` those a running request still holds,
    ``freed_bytes`` the size of the freed models' files."""
    caller = await _caller(request)
    k = kernel_of(request)
    out = await k.models.unload_idle()
    out["asked_by"] = caller.instance_id
    return out


ROUTES = [instance_status, instance_vouch, cooperate_unload]
