"""GET /v1/models, GET /v1/models/{id}; POST /v1/models/load, /unload, /rename; GET /api/models/loaded."""

from __future__ import annotations

import logging
from typing import Annotated, Any

import attrs
from litestar import Request
from msgspec import Meta

from .. import limits
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
            if not isinstance(value, str):
                raise LocalmError(400, f"{name} must be a string", field=name)
            if query[name] is not None and query[name] != value:
                raise LocalmError(400, f"{name} is given twice and differs: ?{name}={query[name]} and "
                                       f"{value!r} in the body", field=name)
            out[name] = value
    for name, value in out.items():
        limits.check_length(name, value, limits.MODEL_NAME_CHARS)
    return out


def _summary(k: Any, entry: Any) -> dict[str, Any]:
    """One model of the list. ``role`` says what it does (chat, embedding, reranker, stt, tts):
    an OpenAI client finds its embedding models here. Open WebUI puts every model of this
    list in its chat picker (it leaves out models by name only for api.openai.com) and reads
    no field that would hide one, so a model that does not chat is left out of Ollama's
    /api/tags instead, and a chat request to it is a 400 not_a_chat_model."""
    return {"id": entry.id, "object": "model", "created": int(entry.created), "owned_by": "localm",
            "role": entry.role, "loaded": entry.id in k.models.resident, "active": k.models.active == entry.id}


@get("/v1/models", scope="models:read", access="open_read", error_family="openai",
     summary="Every registered model")
async def list_models(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    entries = k.models.registry.entries()
    if k.models.locked is not None:  # a locked model is the only one listed
        entries = [e for e in entries if e.id == k.models.locked]
    data = [_summary(k, e) for e in entries]
    by_source: dict[Any, list[Any]] = {}
    for e in entries:  # a plugin's source may add fields (a remote model: whether its server answers now)
        found = k.models.kinds.source(e.source)
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


@get("/v1/models/{model_id:path}", scope="models:read", access="open_read", error_family="openai",
     summary="One registered model's details")
async def read_model(request: Request, model_id: str) -> dict[str, Any]:
    k = kernel_of(request)
    entry = k.models.registry.get(model_id.lstrip("/"))
    from pathlib import Path
    out = _summary(k, entry) | {
        "path": Path(entry.path).name, "source": entry.source if not entry.source.startswith("file:")
        else "file:" + Path(entry.source[5:]).name, "sha256": entry.sha256, "size_bytes": entry.size_bytes,
        "aliases": list(entry.aliases), "model_type": entry.type, "role": entry.role,
    }
    caps = entry.capabilities
    if "vision" in caps:
        out["vision"] = bool(caps["vision"])
        out["audio_input"] = bool(caps.get("audio_input"))
    out["capabilities"] = caps
    resident = k.models.resident.get(entry.id)
    if resident is not None:
        out["engine"] = resident.engine.engine
        out["context_capacity"] = resident.engine.capabilities.context_window  # the window open now
        out["context_max"] = resident.engine.capabilities.context_limit  # the most it grows to
        out["busy"] = resident.engine.busy  # requests running or queued on it
        slots = int(getattr(resident.engine, "slots", 1) or 1)
        if slots > 1:  # it answers that many requests at once
            out["parallel_slots"] = slots
        out["in_flight"] = resident.in_flight  # requests holding it (a load or an unload waits for them)
        out["unloading"] = resident.unloading
    return out


@post("/v1/models/load", scope="models:write", summary="Load a model (the active or default one without ?model=)",
      body=ModelChoice, body_required=False,
      errors={**_PARAMS, 404: "An unregistered model", 503: "No model named and none active, loaded or configured"})
async def load_model(request: Request, model: str | None = None) -> dict[str, Any]:
    k = kernel_of(request)
    model = (await _params(request, model=model))["model"]
    resident, fresh = await k.models.load(model)
    out = {"status": "loaded" if fresh else "already_loaded", "model": resident.entry.id}
    slots = int(getattr(resident.engine, "slots", 1) or 1)
    if slots > 1:  # it answers that many requests at once
        out["parallel_slots"] = slots
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
                    "loaded_at": resident.loaded_at, "until": None})
    return {"models": out}


ROUTES = [list_models, read_model, load_model, unload_model, rename_model, loaded_models]
