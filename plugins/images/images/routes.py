"""The images routes: the OpenAI Images API, /api/imagine (jobs, gallery, workflows),
/v1/comfy/* and /v1/media/config."""

from __future__ import annotations

import asyncio
import base64
import time
import typing
from typing import Any

import attrs
from localm import sdk

from . import Settings, generate, workflows

STATUS_TIMEOUT = 15.0
STOP_TIMEOUT = 30.0
SAVE_TIMEOUT = 30.0


# --- waiting for a job while the client stays -------------------------------------------------

async def _wait(request: sdk.Request, job: Any) -> None:
    """Wait for ``job``. A client that leaves cancels this handler (the kernel does, on an
    inference route), and the job with it: ComfyUI is interrupted."""
    try:
        async for _ in job.follow():
            pass
    except asyncio.CancelledError:
        sdk.host_of(request).jobs.cancel(job)
        raise


def _outcome(job: Any, spec: generate.Spec) -> dict[str, Any]:
    if job.status == "cancelled":
        raise sdk.LocalmError(409, "The image generation was cancelled", code="cancelled")
    if job.status != "done":
        if spec.failure is not None:
            raise spec.failure
        raise sdk.LocalmError(502, f"The image generation failed: {job.error}", code="generation_failed")
    return job.result


def _base_url(request: sdk.Request) -> str:
    host = request.headers.get("host")
    if not host:
        server = request.scope.get("server")
        if not server:
            raise sdk.LocalmError(503, "This server could not determine its own address for the image's url; ask "
                                       "for b64_json", code="no_address")
        host = f"{server[0]}:{server[1]}"
    scheme = request.scope.get("scheme", "http")
    return f"{scheme}://{host}"


def _format(spec: generate.Spec, host: Any) -> str:
    keyed = bool(host.auth_required)
    if spec.private:
        if spec.response_format == "url":
            raise sdk.LocalmError(400, "Privacy mode keeps no image to serve: ask for b64_json (the default here)",
                                  code="url_unavailable", param="response_format")
        return "b64_json"
    if spec.response_format == "url" and not keyed:
        raise sdk.LocalmError(400, "No API key is configured, so the gallery cannot be fetched by an API client: ask "
                                   "for b64_json (the default without a key)", code="url_unavailable",
                              param="response_format")
    return spec.response_format or ("url" if keyed else "b64_json")


# --- generation -------------------------------------------------------------------------------

@sdk.post("/v1/images/generations", access="inference", error_family="openai",
          summary="Generate images from a prompt with the active ComfyUI workflow (OpenAI Images API)")
async def generations(request: sdk.Request) -> sdk.Response:
    state = sdk.service_of(request)
    spec = generate.parse(await generate.read_body(request), openai=True)
    generate.plan(state, spec)
    fmt = _format(spec, sdk.host_of(request))
    base = _base_url(request) if fmt == "url" else ""
    job = generate.start(request, state, spec, keep_b64=False)
    await _wait(request, job)
    result = _outcome(job, spec)
    data = []
    for i, item in enumerate(result["images"]):
        if fmt == "url":
            data.append({"url": base + item["url"]})
        elif spec.private:
            data.append({"b64_json": base64.b64encode(spec.pngs[i]).decode()})
        else:
            path, _ = await asyncio.to_thread(state.gallery.find, item["name"], sdk.caller(request))
            png = await asyncio.to_thread(path.read_bytes)
            data.append({"b64_json": base64.b64encode(png).decode()})
    spec.pngs.clear()
    headers = {"X-Localm-Job-Id": job.id}
    seeds = [str(item["seed"]) for item in result["images"] if item.get("seed") is not None]
    if seeds:
        headers["X-Localm-Seed"] = ", ".join(seeds)
    return sdk.Response({"created": int(time.time()), "data": data}, headers=headers)


@sdk.post("/api/imagine", summary="Generate images as a background job; follow /api/jobs/{id}/events")
async def imagine(request: sdk.Request) -> dict[str, Any]:
    state = sdk.service_of(request)
    spec = generate.parse(await generate.read_body(request), openai=False)
    generate.plan(state, spec)
    job = generate.start(request, state, spec, keep_b64=True)
    return {"job_id": job.id, "private": spec.private}


# --- the gallery ------------------------------------------------------------------------------

@sdk.get("/api/imagine/gallery", summary="The images this key made (every image, for the owner), newest first")
async def gallery(request: sdk.Request) -> dict[str, Any]:
    items = await asyncio.to_thread(sdk.service_of(request).gallery.listing, sdk.caller(request))
    return {"images": [{**item, "url": f"/api/imagine/file/{item['name']}"} for item in items]}


@sdk.get("/api/imagine/file/{name:str}", summary="One gallery image (to the key that made it, or the owner)")
async def gallery_file(request: sdk.Request, name: str) -> sdk.Response:
    path, _ = await asyncio.to_thread(sdk.service_of(request).gallery.find, name, sdk.caller(request))
    png = await asyncio.to_thread(path.read_bytes)
    return sdk.Response(png, media_type="image/png",
                        headers={"Content-Disposition": f'inline; filename="{name}"', "Cache-Control": "private"})


@sdk.delete("/api/imagine/gallery/{name:str}", summary="Delete a gallery image and its sidecar")
async def gallery_delete(request: sdk.Request, name: str) -> dict[str, Any]:
    await asyncio.to_thread(sdk.service_of(request).gallery.delete, name, sdk.caller(request))
    return {"status": "deleted", "name": name}


@sdk.get("/api/imagine/workflows", summary="The workflows, which is active, and which input takes each field")
async def list_workflows(request: sdk.Request) -> dict[str, Any]:
    state = sdk.service_of(request)
    return {"active": state.settings["workflow"],
            "workflows": await asyncio.to_thread(workflows.listing, state.workflows)}


# --- ComfyUI ----------------------------------------------------------------------------------

async def _timed(coro: Any, seconds: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(coro, seconds)
    except asyncio.TimeoutError:
        raise sdk.LocalmError(504, f"Timed out {what}", code="comfy_timeout") from None


@sdk.get("/v1/comfy/status", scope="config:read", summary="Whether ComfyUI answers, and whether localm started it")
async def comfy_status(request: sdk.Request) -> dict[str, Any]:
    return await _timed(sdk.service_of(request).comfy.status(), STATUS_TIMEOUT, "asking ComfyUI for its status")


@sdk.post("/v1/comfy/stop", scope="config:write", summary="Stop the ComfyUI localm started")
async def comfy_stop(request: sdk.Request) -> dict[str, Any]:
    return await _timed(sdk.service_of(request).comfy.stop(), STOP_TIMEOUT, "stopping ComfyUI")


@sdk.post("/v1/comfy/restart", scope="config:write", summary="Start (again) the ComfyUI localm launches")
async def comfy_restart(request: sdk.Request) -> dict[str, Any]:
    state = sdk.service_of(request)
    seconds = STOP_TIMEOUT + float(state.settings["start_timeout"]) + 5
    return await _timed(state.comfy.restart(), seconds, "restarting ComfyUI")


# --- /v1/media/config -------------------------------------------------------------------------

def _specs() -> list[sdk.FieldSpec]:
    hints = typing.get_type_hints(Settings)
    out = []
    for f in attrs.fields(Settings):
        meta = f.metadata.get("localm", {})
        default = f.default.factory() if isinstance(f.default, attrs.Factory) else f.default  # type: ignore
        out.append(sdk.FieldSpec(key=f.name, type=hints[f.name], default=default,
                                 description=meta.get("description", ""), label=meta.get("label"),
                                 owner_only=bool(meta.get("owner_only")), min=meta.get("min"), max=meta.get("max"),
                                 choices=tuple(meta["choices"]) if meta.get("choices") is not None else None,
                                 secret=bool(meta.get("secret"))))
    return out


def _fields(plugin: Any, caller: Any) -> list[dict[str, Any]]:
    values = plugin.settings
    return [spec.schema() | {"value": values.get(spec.key, spec.default)} for spec in _specs()
            if caller.is_owner or not spec.owner_only]


def _label(plugin: Any) -> str:
    return (plugin.manifest.label if plugin.manifest and plugin.manifest.label else None) or plugin.name


@sdk.get("/v1/media/config", scope="config:read", summary="The media plugins' settings (images)")
async def media_config(request: sdk.Request) -> dict[str, Any]:
    plugin = sdk.plugin_of(request)
    return {"plugins": [{"plugin": plugin.name, "label": _label(plugin),
                         "fields": _fields(plugin, sdk.caller(request))}]}


@sdk.post("/v1/media/config/{name:str}", scope="config:write",
          summary="Merge one media plugin's settings; a blank value clears an override")
async def set_media_config(request: sdk.Request, name: str) -> dict[str, Any]:
    plugin = sdk.plugin_of(request)
    if name != plugin.name:
        raise sdk.LocalmError(404, f"No media plugin named {name} (images is the one running)", code="unknown_plugin")
    body = await sdk.json_body(request, empty={}, not_object="The body must be a JSON object of settings")
    caller = sdk.caller(request)
    owner_only = {spec.key for spec in _specs() if spec.owner_only}
    refused = sorted(k for k in body if k in owner_only)
    if refused and not caller.is_owner:
        raise sdk.LocalmError(403, f"{', '.join(refused)} {'is' if len(refused) == 1 else 'are'} owner-only: "
                                   "it needs an admin key", code="owner_only")
    await _timed(asyncio.to_thread(plugin.save_settings, body), SAVE_TIMEOUT, "saving the settings")
    return {"plugin": plugin.name, "fields": _fields(plugin, caller)}


HANDLERS = [generations, imagine, gallery, gallery_file, gallery_delete, list_workflows, comfy_status, comfy_stop,
            comfy_restart, media_config, set_media_config]
