"""GET /v1/models and GET /v1/models/{id}: OpenAI's model list and one model's details, from
the model manager's registry (``host.models``). Loading, unloading and renaming are the
kernel's own routes (POST /v1/models/load, /unload, /rename; GET /api/models/loaded)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from localm import sdk
from localm.sdk.engines import placement_of

log = logging.getLogger("localm.plugin.openai")


def _summary(models: Any, entry: Any) -> dict[str, Any]:
    """One model of the list. ``role`` says what it does (chat, embedding, reranker, stt, tts):
    an OpenAI client finds its embedding models here. Open WebUI puts every model of this
    list in its chat picker (it leaves out models by name only for api.openai.com) and reads
    no field that would hide one, so a model that does not chat is left out of Ollama's
    /api/tags instead, and a chat request to it is a 400 not_a_chat_model."""
    return {"id": entry.id, "object": "model", "created": int(entry.created), "owned_by": "localm",
            "role": entry.role, "loaded": entry.id in models.resident, "active": models.active == entry.id}


@sdk.get("/v1/models", scope="models:read", access="open_read", error_family="openai",
         summary="Every registered model")
async def list_models(request: sdk.Request) -> dict[str, Any]:
    models = sdk.host_of(request).models
    entries = models.registry.entries()
    if models.locked is not None:  # a locked model is the only one listed
        entries = [e for e in entries if e.id == models.locked]
    data = [_summary(models, e) for e in entries]
    by_source: dict[Any, list[Any]] = {}
    for e in entries:  # a plugin's source may add fields (a remote model: whether its server answers now)
        found = models.kinds.source(e.source)
        if found is not None and found.describe is not None:
            by_source.setdefault(found, []).append(e)
    for found, mine in by_source.items():
        try:
            extra = await found.describe(mine)
        except Exception:  # noqa: BLE001 - a listing never fails for one plugin's description
            log.exception("the %s plugin could not describe its models", found.plugin)
            continue
        for item in data:
            item.update(extra.get(item["id"], {}))
    return {"object": "list", "data": data}


#: The peer-route paths under a model (``/v1/models/{model}/peer-offer`` and ``/peer-route``): a
#: model's id takes the rest of the path here, so they are answered through the ``peers`` service
#: (the remote plugin's) from this plugin's routes.
PEER_OFFER, PEER_ROUTE = "/peer-offer", "/peer-route"


def _peers(request: sdk.Request) -> Any:
    host = sdk.host_of(request)
    if not host.has_service("peers"):
        raise sdk.LocalmError(404, "Peer routes need the remote plugin (localm plugin enable remote)",
                              code="not_found")
    return host.service("peers")


def _peer_path(model_id: str, suffix: str) -> str | None:
    name = model_id.lstrip("/")
    return name[: -len(suffix)] if name.endswith(suffix) and len(name) > len(suffix) else None


_PEER_ROUTE_ERRORS = {400: "An empty instance_id, or no model to route", 403: "That instance refused the key, or did "
                      "not answer the check", 409: "That instance is not live, no longer has the model loaded, is not "
                      "on loopback, or would record chats in a mode this instance's does not allow",
                      422: "No instance_id field", 504: "A check took too long"}


@sdk.post("/v1/models/{model_id:path}", scope="models:write", error_family="openai",
          summary="POST /v1/models/{model}/peer-route: forward this model's chats to another instance on this machine",
          errors={**_PEER_ROUTE_ERRORS, 404: "Not a peer-route path"},
          subpaths={"/v1/models/{model}/peer-route": "Accept a peer offer: forward this model's chats to another "
                                                     "instance on this machine"})
async def route_model(request: sdk.Request, model_id: str) -> dict[str, Any]:
    """Body ``{"instance_id", "api_key"}`` (api_key empty for an instance with no key): an offer
    from GET /v1/models/{model}/peer-offer, accepted. The route lives in memory only."""
    model = _peer_path(model_id, PEER_ROUTE)
    if model is None:
        raise sdk.LocalmError(404, f"No route POST /v1/models/{model_id.lstrip('/')}", code="not_found")
    body = await sdk.json_body(request, max_bytes=65536)
    return await _peers(request).route(model, body)


@sdk.delete("/v1/models/{model_id:path}", scope="models:write", error_family="openai",
            summary="DELETE /v1/models/{model}/peer-route: stop forwarding this model to another instance",
            errors={404: "Not a peer-route path"},
            subpaths={"/v1/models/{model}/peer-route": "Stop forwarding this model to another instance"})
async def unroute_model(request: sdk.Request, model_id: str) -> dict[str, Any]:
    model = _peer_path(model_id, PEER_ROUTE)
    if model is None:
        raise sdk.LocalmError(404, f"No route DELETE /v1/models/{model_id.lstrip('/')}", code="not_found")
    return await _peers(request).unroute(model)


@sdk.get("/v1/models/{model_id:path}", scope="models:read", access="open_read", error_family="openai",
         summary="One registered model's details (and GET /v1/models/{model}/peer-offer: whether another "
                 "instance on this machine has it loaded)",
         errors={504: "peer-offer: the lookup took too long"},
         subpaths={"/v1/models/{model}/peer-offer": "Whether another instance on this machine has this model loaded"})
async def read_model(request: sdk.Request, model_id: str) -> dict[str, Any]:
    offered = _peer_path(model_id, PEER_OFFER)
    if offered is not None and sdk.host_of(request).models.registry.find(model_id.lstrip("/")) is None:
        return await _peers(request).offer(offered)
    models = sdk.host_of(request).models
    entry = models.registry.get(model_id.lstrip("/"))
    out = _summary(models, entry) | {
        "path": Path(entry.path).name, "source": entry.source if not entry.source.startswith("file:")
        else "file:" + Path(entry.source[5:]).name, "sha256": entry.sha256, "size_bytes": entry.size_bytes,
        "aliases": list(entry.aliases), "model_type": entry.type, "role": entry.role,
    }
    caps = dict(entry.capabilities)
    if caps.get("projector"):  # a file name, as path and source are: no absolute path leaves the server
        caps["projector"] = Path(caps["projector"]).name
    if "vision" in caps:
        out["vision"] = bool(caps["vision"])
        out["audio_input"] = bool(caps.get("audio_input"))
    out["capabilities"] = caps
    routed = getattr(models, "forward_info", {}).get(entry.id)
    if routed is not None:  # an accepted peer route forwards it to another instance
        out["peer_route"] = routed["peer"]
    resident = models.resident.get(entry.id)
    applied = getattr(resident.engine, "adapters", None) if resident is not None else None
    if applied or entry.adapters:  # the LoRA adapters it loads with (applied now, when loaded): each
        # file by its name, as path is: no absolute path leaves the server
        out["adapters"] = [{"name": a.get("name"), "scale": a.get("scale"),
                            "path": Path(str(a.get("path", ""))).name} for a in (applied or entry.adapters)]
    if resident is not None:
        engine = resident.engine
        out["engine"] = engine.engine
        out["context_capacity"] = engine.capabilities.context_window  # the window open now
        out["context_max"] = engine.capabilities.context_limit  # the most it grows to
        out["busy"] = engine.busy  # requests running or queued on it
        slots = int(getattr(engine, "slots", 1) or 1)
        if slots > 1:  # it answers that many requests at once
            out["parallel_slots"] = slots
        out["in_flight"] = resident.in_flight  # requests holding it (a load or an unload waits for them)
        out["unloading"] = resident.unloading
        placed = placement_of(engine)
        if placed is not None:  # where it runs: device, GPU layers, VRAM, as the engine reports them
            out.update(placed.public())
    return out
