"""GET/PATCH /v1/config, GET /v1/config/schema, GET/POST /v1/plugins/settings."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request

from ..auth import Principal
from ..config import KERNEL_FIELDS, READ_ONLY_EXTRAS, STATE_KEYS
from ..errors import LocalmError
from ..manifest import legal_id
from ..routing import get, patch, post
from .common import json_body, kernel_of, principal_of


def _patch_schema() -> dict[str, Any]:
    """PATCH /v1/config's body: any of the kernel's settings (null resets one), plugin state
    (owner only), and the read-only values GET adds, which are ignored."""
    properties: dict[str, Any] = {}
    for key, spec in KERNEL_FIELDS.items():
        value = msgspec.json.schema(spec.type)
        value.update({"description": spec.description + (" (owner only)" if spec.owner_only else "")})
        if spec.choices is not None:
            value["enum"] = list(spec.choices)
        if spec.min is not None:
            value["minimum"] = spec.min
        if spec.max is not None:
            value["maximum"] = spec.max
        properties[key] = {"anyOf": [value, {"type": "null"}]}
    properties["plugins_enabled"] = {
        "type": "object", "additionalProperties": {"type": ["boolean", "null"]},
        "description": f"Owner only: plugin name to enabled (null: the manifest's default); {STATE_KEYS['plugins_enabled']}"}
    properties["plugins"] = {
        "type": "object", "additionalProperties": {"type": ["object", "null"]},
        "description": f"Owner only: plugin name to its settings; {STATE_KEYS['plugins']}"}
    for key in READ_ONLY_EXTRAS:
        properties[key] = {"description": "Read-only (GET adds it): ignored"}
    return {"type": "object", "title": "ConfigPatch", "properties": properties, "additionalProperties": False}


@get("/v1/config", scope="config:read", summary="The whole config, with read-only extras")
async def read_config(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    return {**k.config.view(principal_of(request), port=k.port, plugin_fields=_declared(k)), **_context_extras(k)}


def _declared(k: Any) -> dict[str, Any]:
    """Each loaded plugin's settings, by name: what a caller who is not the owner may see."""
    return {p.name: p.fields for p in k.plugins.plugins.values()}


def _context_extras(k: Any) -> dict[str, Any]:
    """effective_ctx_max: the most tokens a prompt and its reply may take on the active model (the
    ceiling its window grows to), and effective_ctx_model: that model; null when none is loaded.
    effective_mode and effective_chat_mode: what the session log keeps of a chat turn."""
    from ..sessionlog import effective_mode
    mode = effective_mode(k.config.get("session_mode"), None, may_lower=False)
    out = {"effective_mode": mode, "effective_chat_mode": mode}
    models = k.models
    resident = models.resident.get(models.active) if models.active else None
    if resident is None or not hasattr(resident.engine, "capabilities"):
        return {**out, "effective_ctx_max": None, "effective_ctx_model": None}
    return {**out, "effective_ctx_max": resident.engine.capabilities.context_limit,
            "effective_ctx_model": resident.entry.id}


@patch("/v1/config", scope="config:write", summary="Change config keys; returns the merged config",
       body=_patch_schema(),
       errors={400: "An unknown key, a value of the wrong type or out of range, or require_auth with no key",
               403: "An owner-only key or plugin state changed by a caller who is not the owner",
               409: "config.json exists but cannot be read"})
async def patch_config(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    caller = principal_of(request)
    body = await json_body(request)
    if body.get("require_auth") is True and not k.keys.any_key():
        raise LocalmError(400, "require_auth needs an API key first: run `localm key generate`")
    before = k.config.enabled_overrides()
    k.config.patch(body, caller)
    if "plugins_enabled" in body and k.config.enabled_overrides() != before:
        await k.plugins.sync()
    return {**k.config.view(caller, port=k.port, plugin_fields=_declared(k)), **_context_extras(k)}


@get("/v1/config/schema", scope="config:read", summary="Every setting: kernel and active plugins")
async def config_schema(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    caller = principal_of(request)
    fields = [f.schema() for f in KERNEL_FIELDS.values() if caller.is_owner or not f.owner_only]
    for p in k.plugins.plugins.values():
        if not p.active:
            continue
        for spec in p.fields.values():
            if spec.owner_only and not caller.is_owner:
                continue
            fields.append(spec.schema() | {"key": f"plugins.{p.name}.{spec.key}", "plugin": p.name})
    return {"fields": fields}


def _plugin_fields(k: Any, caller: Principal, p: Any) -> list[dict[str, Any]]:
    values = k.plugins.resolved_settings(p.name)
    return [spec.schema() | {"value": values[spec.key]} for spec in p.fields.values()
            if caller.is_owner or not spec.owner_only]


@get("/v1/plugins/settings", scope="config:read", summary="Every active plugin's settings with their values")
async def plugin_settings(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    caller = principal_of(request)
    out = []
    for p in sorted(k.plugins.plugins.values(), key=lambda p: p.name):
        if p.active and p.fields:
            label = (p.manifest.label if p.manifest and p.manifest.label else p.name)
            out.append({"plugin": p.name, "label": label, "fields": _plugin_fields(k, caller, p)})
    return {"plugins": out}


@post("/v1/plugins/{name:str}/settings", scope="config:write",
      summary="Merge one plugin's settings; a blank value clears an override",
      body={"type": "object", "title": "PluginSettings", "description": "Setting name to value (null or blank: "
            "back to the default); GET /v1/plugins/settings lists each plugin's fields"},
      errors={400: "An unknown setting or a value of the wrong type", 403: "An owner-only setting",
              404: "No active plugin of this name has settings"})
async def set_plugin_settings(request: Request, name: str) -> dict[str, Any]:
    k = kernel_of(request)
    caller = principal_of(request)
    p = k.plugins.plugins.get(name) if legal_id(name) else None
    if p is None or not p.active or not p.fields:
        raise LocalmError(404, f"No active plugin named {name} has settings")
    body = await json_body(request)
    k.config.set_plugin_values(name, k.plugins.check_settings(name, body, caller=caller))
    return {"plugin": name, "fields": _plugin_fields(k, caller, p)}


ROUTES = [read_config, patch_config, config_schema, plugin_settings, set_plugin_settings]
