"""POST /v1/models/load, /unload, /rename; GET /api/models/loaded. (GET /v1/models and
/v1/models/{id}, OpenAI's model list, are the openai plugin's.)"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import attrs
from litestar import Request
from msgspec import Meta

from .. import limits
from ..engines import placement_of
from ..errors import LocalmError
from ..routing import get, post
from .common import json_body, kernel_of

log = logging.getLogger("localm.models")


ModelName = Annotated[str, Meta(max_length=limits.MODEL_NAME_CHARS, description="A registered model's name")]


@attrs.define
class ModelChoice:
    """The model, in the body instead of ?model= (both: they must agree)."""

    closed = True

    model: ModelName | None = None


@attrs.define
class LoadChoice:
    """The model, in the body instead of ?model= (both: they must agree), and how many of its
    layers go to the GPU for this load (-1: all that fit; 0: none; llama.cpp engine)."""

    closed = True

    model: ModelName | None = None
    gpu_layers: Annotated[int, Meta(ge=-1, le=100000)] | None = None


@attrs.define
class Rename:
    """The model and its new name, in the body instead of the query string (both: they must agree)."""

    closed = True

    model: ModelName | None = None
    new_name: ModelName | None = None


_PARAMS = {400: "A body that is not an object, an unknown field, a field that is not a string, a value "
                "that differs from the query string's, or a name over its limit (code limit_exceeded)"}


async def _params(request: Request, **query: str | None) -> dict[str, str | None]:
    """The route's parameters, from the query string or a JSON object body holding the same
    fields (both: they must agree). A body field the route does not read is a 400, never ignored."""
    body = await json_body(request, empty=None, require_object=False)
    out = dict(query)
    if body is not None:
        if not isinstance(body, dict):
            raise LocalmError(400, "The body must be a JSON object")
        unknown = sorted(set(body) - set(query))
        if unknown:
            raise LocalmError(400, f"Unknown field {unknown[0]!r}: this route reads {', '.join(query)} "
                                   "(in the query string or the body)", code="unknown_field", field=unknown[0])
        for name, value in body.items():
            if value is None:
                continue
            if name in _INTEGERS:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise LocalmError(400, f"{name} must be an integer", field=name)
                value = str(value)
            elif not isinstance(value, str):
                raise LocalmError(400, f"{name} must be a string", field=name)
            if query[name] is not None and query[name] != value:
                raise LocalmError(400, f"{name} is given twice and differs: ?{name}={query[name]} and "
                                       f"{value!r} in the body", field=name)
            out[name] = value
    for name, value in out.items():
        limits.check_length(name, value, limits.MODEL_NAME_CHARS)
    return out


#: the parameters that are integers (a string in the query, a number in the body)
_INTEGERS = {"gpu_layers"}


def _gpu_layers(value: str | None) -> dict[str, Any]:
    if value is None:
        return {}
    try:
        layers = int(value)
    except ValueError:
        raise LocalmError(400, "gpu_layers must be an integer (-1: all that fit, 0: none)", field="gpu_layers") from None
    if not -1 <= layers <= 100000:
        raise LocalmError(400, "gpu_layers must be -1 (all that fit), 0 (none) or a layer count", field="gpu_layers")
    return {"n_gpu_layers": layers}


def placement_fields(engine: Any) -> dict[str, Any]:
    """Where a loaded model runs (device, GPU layers, VRAM), as its engine reports it."""
    found = placement_of(engine)
    return found.public() if found is not None else {}


@post("/v1/models/load", scope="models:write", summary="Load a model (the active or default one without ?model=)",
      body=LoadChoice, body_required=False,
      errors={**_PARAMS, 404: "An unregistered model", 503: "No model named and none active, loaded or configured"})
async def load_model(request: Request, model: str | None = None, gpu_layers: str | None = None) -> dict[str, Any]:
    """Where the model runs comes with the answer: ``device``, and for a model placed layer by
    layer on a GPU ``gpu_layers_offloaded``, ``gpu_layers_total`` and ``degraded`` (fewer than all
    of its layers fit). ``gpu_layers`` sets this load's layer count; a model already loaded keeps
    its own (unload it first)."""
    k = kernel_of(request)
    given = await _params(request, model=model, gpu_layers=gpu_layers)
    routed = k.models.forwarded(given["model"])
    if routed is not None:  # another instance answers it: nothing loads here
        return {"status": "peer_routed", "model": routed["model"], "peer": routed["peer"]}
    resident, fresh = await k.models.load(given["model"], options=_gpu_layers(given["gpu_layers"]))
    out = {"status": "loaded" if fresh else "already_loaded", "model": resident.entry.id,
           **placement_fields(resident.engine)}
    slots = int(getattr(resident.engine, "slots", 1) or 1)
    if slots > 1:  # it answers that many requests at once
        out["parallel_slots"] = slots
    adapters = getattr(resident.engine, "adapters", None)
    if adapters:  # the LoRA adapters applied: names and scales (no path leaves the server)
        out["adapters"] = [{"name": a["name"], "scale": a["scale"]} for a in adapters]
    return out


@post("/v1/models/unload", scope="models:write", summary="Unload a model, or every loaded model",
      body=ModelChoice, body_required=False, errors={**_PARAMS, 404: "An unregistered model"})
async def unload_model(request: Request, model: str | None = None) -> dict[str, Any]:
    k = kernel_of(request)
    model = (await _params(request, model=model))["model"]
    if model:
        return await k.models.unload_one(model)
    return await k.models.unload_all()


@post("/v1/models/rename", scope="models:write", summary="Rename a registered model in place",
      body=Rename, body_required=False,
      errors={**_PARAMS, 404: "An unregistered model", 409: "The new name is taken",
              422: "model or new_name missing"})
async def rename_model(request: Request, model: str | None = None, new_name: str | None = None) -> dict[str, Any]:
    given = await _params(request, model=model, new_name=new_name)
    model, new_name = given["model"], given["new_name"]
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise LocalmError(422, f"{missing[0]} is required (in the query string or the body)", field=missing[0])
    if not new_name.strip():
        raise LocalmError(400, "new_name must not be empty")
    return kernel_of(request).models.rename(model, new_name)


@get("/api/models/loaded", scope="models:read", access="open_read",
     summary="The loaded models: size, engine, slots, requests and how long they stay loaded")
async def loaded_models(request: Request) -> dict[str, Any]:
    """What ``localm ps`` shows. A model stays loaded until it is unloaded (``until`` is null):
    localm has no idle timer. ``slots`` is how many requests the engine runs at once."""
    k = kernel_of(request)
    out = []
    for resident in list(k.models.resident.values()):
        entry, engine = resident.entry, resident.engine
        out.append({"id": entry.id, "role": entry.role, "size_bytes": entry.size_bytes, "engine": engine.engine,
                    "context_window": engine.capabilities.context_window,
                    "context_max": engine.capabilities.context_limit, "active": k.models.active == entry.id,
                    "slots": int(getattr(engine, "slots", 1) or 1), "busy": engine.busy,
                    "in_flight": resident.in_flight, "unloading": resident.unloading,
                    "loaded_at": resident.loaded_at, "until": None, **placement_fields(engine)})
    peers = [{"id": model_id, "peer": info["peer"], "in_flight": k.models.forwards[model_id].in_flight}
             for model_id, info in list(k.models.forward_info.items()) if model_id in k.models.forwards]
    return {"models": out, "peer_served": peers}


@get("/api/models", scope="models:read", access="open_read",
     summary="The registered models, which are loaded, and the accepted peer routes")
async def list_models(request: Request) -> dict[str, Any]:
    """``peer_routes`` lists the models this instance forwards to another instance on this
    machine (kept in this process's memory only)."""
    k = kernel_of(request)
    entries = k.models.entries()
    return {"models": [{"id": e.id, "role": e.role, "type": e.type, "loaded": e.id in k.models.resident,
                        "active": k.models.active == e.id, "peer_routed": e.id in k.models.forward_info}
                       for e in entries],
            "active": k.models.active,
            "peer_routes": [{"model": m, **info} for m, info in list(k.models.forward_info.items())]}


ROUTES = [load_model, unload_model, rename_model, loaded_models, list_models]
