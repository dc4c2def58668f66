"""One image request: its fields checked, then generated as a job of kind ``image``.

``parse`` reads a request body (the OpenAI Images fields, plus ``seed`` and
``negative_prompt``) and refuses a bad one before anything starts; ``plan`` checks it
against the active workflow; ``start`` runs it as a job that submits the workflow to
ComfyUI once per image, follows its progress, and keeps each PNG in the gallery (or, in
privacy mode, in memory only).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import secrets
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localm import sdk

from . import Images, workflows
from .comfy import Run
from .gallery import png_size

log = logging.getLogger("localm.plugin.images")

MAX_PROMPT = 32000
MAX_N = 4
MAX_SEED = 2**64 - 1
SIDES = (64, 2048)
OPENAI_IGNORED = ("model", "quality", "style", "user", "moderation")
KNOWN = {"prompt", "negative_prompt", "n", "size", "seed", "response_format", "output_format", "background",
         "output_compression", "stream", "partial_images", *OPENAI_IGNORED}


@dataclass
class Spec:
    prompt: str
    negative_prompt: str | None = None
    n: int = 1
    size: tuple[int, int] | None = None
    seed: int | None = None
    response_format: str | None = None
    private: bool = False
    workflow: workflows.Workflow | None = None
    #: filled by the job: the LocalmError that failed it, and in privacy mode the images
    failure: sdk.LocalmError | None = None
    pngs: list[bytes] = field(default_factory=list)


def _invalid(key: str, message: str) -> sdk.LocalmError:
    return sdk.LocalmError(422, f"{key}: {message}", errors=[{"key": key, "message": message}], param=key)


def _refuse(reason: str, message: str) -> sdk.LocalmError:
    if reason == "invalid":
        return sdk.LocalmError(400, message, code="invalid_json")
    return _invalid("body", message)


async def read_body(request: sdk.Request) -> dict[str, Any]:
    return await sdk.json_body(request, missing="a JSON object with a prompt is required",
                               not_object="must be a JSON object", refuse=_refuse)


def parse(body: dict[str, Any], *, openai: bool) -> Spec:
    """The request's fields, each checked: 422 for a wrong type or an n outside 1 to 4, 400
    for a value this server refuses (an empty or over-long prompt, a bad size...)."""
    allowed = KNOWN if openai else {"prompt", "negative_prompt", "n", "size", "seed"}
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise sdk.LocalmError(400, f"Unknown field(s): {', '.join(unknown)}", code="unknown_field",
                              param=unknown[0])
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise _invalid("prompt", "a string is required")
    if not prompt.strip():
        raise sdk.LocalmError(400, "prompt must not be empty", code="empty_prompt", param="prompt")
    if len(prompt) > MAX_PROMPT:
        raise sdk.LocalmError(400, f"prompt is {len(prompt)} characters; at most {MAX_PROMPT}",
                              code="prompt_too_long", param="prompt")
    spec = Spec(prompt=prompt)
    negative = body.get("negative_prompt")
    if negative is not None:
        if not isinstance(negative, str):
            raise _invalid("negative_prompt", "must be a string")
        if len(negative) > MAX_PROMPT:
            raise sdk.LocalmError(400, f"negative_prompt is over {MAX_PROMPT} characters",
                                  code="prompt_too_long", param="negative_prompt")
        spec.negative_prompt = negative or None
    n = body.get("n")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise _invalid("n", "must be an integer from 1 to 4")
        if not 1 <= n <= MAX_N:
            raise _invalid("n", f"must be from 1 to {MAX_N} (got {n})")
        spec.n = n
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise _invalid("seed", "must be an integer")
        if not 0 <= seed <= MAX_SEED:
            raise _invalid("seed", f"must be from 0 to {MAX_SEED}")
        spec.seed = seed
    size = body.get("size")
    if size is not None:
        if not isinstance(size, str):
            raise _invalid("size", "must be a string: WIDTHxHEIGHT or auto")
        spec.size = parse_size(size)
    for key in ("response_format", "output_format", "background", *OPENAI_IGNORED):
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise _invalid(key, "must be a string")
    fmt = body.get("response_format")
    if fmt is not None and fmt not in ("b64_json", "url"):
        raise sdk.LocalmError(400, f"response_format must be b64_json or url, not {fmt!r}",
                              code="invalid_response_format", param="response_format")
    spec.response_format = fmt
    out_fmt = body.get("output_format")
    if out_fmt is not None and out_fmt != "png":
        raise sdk.LocalmError(400, f"output_format {out_fmt!r} is not made here: only png",
                              code="unsupported_output_format", param="output_format")
    if body.get("background") not in (None, "auto"):
        raise sdk.LocalmError(400, "background: only auto (the workflow decides)", code="unsupported_background",
                              param="background")
    if body.get("output_compression") is not None:
        raise sdk.LocalmError(400, "output_compression applies to jpeg and webp; this server makes png only",
                              code="unsupported_output_compression", param="output_compression")
    stream = body.get("stream")
    if stream not in (None, False):
        raise sdk.LocalmError(400, "Streamed image generation is not supported (follow POST /api/imagine's job "
                                   "for progress)", code="unsupported_stream", param="stream")
    if body.get("partial_images") not in (None, 0):
        raise sdk.LocalmError(400, "partial_images is not supported", code="unsupported_partial_images",
                              param="partial_images")
    return spec


def parse_size(size: str) -> tuple[int, int] | None:
    if size == "auto":
        return None
    w, sep, h = size.partition("x")
    if not sep or not w.isdigit() or not h.isdigit():
        raise sdk.LocalmError(400, f"size must be WIDTHxHEIGHT (such as 512x512) or auto, not {size!r}",
                              code="invalid_size", param="size")
    width, height = int(w), int(h)
    for side in (width, height):
        if not SIDES[0] <= side <= SIDES[1] or side % 8:
            raise sdk.LocalmError(400, f"size {size}: each side must be {SIDES[0]} to {SIDES[1]} and a multiple "
                                       "of 8", code="invalid_size", param="size")
    return width, height


def plan(state: Images, spec: Spec) -> Spec:
    """Check the request against the active workflow (400 for a field it cannot take)."""
    name = state.settings["workflow"]
    wf = workflows.load(state.workflows, name)
    if not wf.takes("prompt"):
        raise sdk.LocalmError(400, f"The workflow {name} has no prompt input: map one in {name}.map.json",
                              code="workflow_takes_no_prompt")
    if spec.size is not None and not (wf.takes("width") and wf.takes("height")):
        raise sdk.LocalmError(400, f"The workflow {name} cannot take a size: it has no EmptyLatentImage or "
                                   "EmptySD3LatentImage node (nor a width and height in its sidecar); leave size "
                                   "out or send auto", code="workflow_takes_no_size", param="size")
    if spec.negative_prompt and not wf.takes("negative_prompt"):
        raise sdk.LocalmError(400, f"The workflow {name} has no negative prompt input",
                              code="workflow_takes_no_negative_prompt", param="negative_prompt")
    if spec.seed is not None and not wf.takes("seed"):
        raise sdk.LocalmError(400, f"The workflow {name} has no seed input", code="workflow_takes_no_seed",
                              param="seed")
    if state.comfy.external_url() is None and not state.comfy.launch_mode():
        raise sdk.LocalmError(503, "No ComfyUI is configured: set comfy_url to a running ComfyUI, or comfy_path "
                                   "(and comfy_python) for localm to start one (POST /v1/media/config/images)",
                              code="comfy_unavailable")
    spec.private = bool(state.settings["privacy_mode"])
    if spec.private and state.comfy.external_url() is not None and state.comfy.output_dir() is None:
        raise sdk.LocalmError(503, "Privacy mode deletes each image where ComfyUI saved it: set comfy_output_dir "
                                   "to the output folder of the ComfyUI at comfy_url", code="privacy_unavailable")
    spec.workflow = wf
    return spec


# --- the job -----------------------------------------------------------------------------

async def _seeds(state: Images, url: str, spec: Spec) -> list[int | None]:
    wf = spec.workflow
    assert wf is not None
    if not wf.takes("seed"):
        return [None] * spec.n
    if spec.seed is not None:
        return [spec.seed + i for i in range(spec.n)]
    node, inp = wf.mapping["seed"][0]
    opts = await state.comfy.object_input(url, wf.graph[node]["class_type"], inp)
    low = int(opts.get("min", 0) or 0)
    high = min(int(opts.get("max", 2**32 - 1)), 2**32 - 1) - (spec.n - 1)
    first = random.randint(low, max(low, high))
    return [first + i for i in range(spec.n)]


def _progress(ctx: sdk.JobContext, graph: dict[str, Any], index: int, n: int) -> Any:
    done: set[str] = set()
    partial: dict[str, float] = {}

    def report(kind: str, data: dict[str, Any]) -> None:
        node = None
        if kind == "execution_cached":
            done.update(str(x) for x in data.get("nodes") or [])
        elif kind == "progress_state":
            for node_id, st in (data.get("nodes") or {}).items():
                if not isinstance(st, dict):
                    continue
                if st.get("state") == "finished":
                    done.add(str(node_id))
                    partial.pop(str(node_id), None)
                elif st.get("max"):
                    partial[str(node_id)] = float(st.get("value") or 0) / float(st["max"])
                    node = str(node_id)
        elif kind == "progress":  # a sampler's steps (older ComfyUI)
            node = str(data.get("node")) if data.get("node") is not None else None
            if node and data.get("max"):
                partial[node] = float(data.get("value") or 0) / float(data["max"])
        elif kind == "executing" and data.get("node") is not None:
            node = str(data["node"])
        else:
            return
        total = max(1, len(graph))
        within = (len(done & set(graph)) + sum(v for k, v in partial.items() if k not in done)) / total
        detail: dict[str, Any] = {"image": index + 1, "images": n}
        message = f"image {index + 1} of {n}"
        if node is not None and node in graph:
            detail.update(node=node, node_type=graph[node]["class_type"])
            message += f": {graph[node]['class_type']} (node {node})"
            if node in partial:
                detail["node_progress"] = round(partial[node], 4)
        ctx.progress((index + min(within, 1.0)) / n, message, **detail)
    return report


async def _free_chat_models(state: Images, ctx: sdk.JobContext) -> list[str]:
    models = state.host.models
    resident = [r for r in list(models.resident.values()) if r.entry.role == "chat"]
    active = models.active
    unloaded = []
    for r in sorted(resident, key=lambda r: r.entry.id == active):  # the active one last: reloaded last
        out = await models.unload_one(r.entry.id)
        if out.get("status") == "unloaded":
            unloaded.append(r.entry.id)
            ctx.log(f"Unloaded {r.entry.id}: ComfyUI gets the memory while it draws")
        else:
            ctx.log(f"{r.entry.id} stays loaded: {out.get('detail') or out.get('status')}")
    return unloaded


async def _restore(state: Images, names: list[str]) -> None:
    try:
        for name in names:
            try:
                await state.host.models.load(name)
                log.info("loaded %s again after an image generation", name)
            except Exception as exc:  # noqa: BLE001 - the next chat loads it on demand
                log.warning("could not load %s again after an image generation: %s", name, exc)
    finally:
        state.turn.release()


def _pick(run: Run) -> dict[str, Any]:
    saved = [i for i in run.images if i.get("type") == "output"] or run.images
    if not saved:
        raise sdk.LocalmError(502, "The workflow produced no image (it needs a SaveImage node)",
                              code="generation_failed")
    return saved[0]


async def run_job(state: Images, ctx: sdk.JobContext, spec: Spec, owner: str, *, keep_b64: bool) -> dict[str, Any]:
    wf = spec.workflow
    assert wf is not None
    if state.turn.locked():
        ctx.progress(0.0, "waiting for another image generation to finish")
    await state.turn.acquire()
    unloaded: list[str] = []
    private_dir: Path | None = None
    url = ""
    prompt_ids: list[str] = []
    leftovers: list[Path] = []  # in privacy mode, every file ComfyUI wrote
    try:
        ctx.progress(0.0, "connecting to ComfyUI")
        url = await state.comfy.url()
        if state.settings["unload_chat_models"]:
            unloaded = await _free_chat_models(state, ctx)
        seeds = await _seeds(state, url, spec)
        private_tag = "localm-private-" + secrets.token_hex(8) if spec.private else None
        if private_tag is not None:
            root = state.comfy.output_dir()
            assert root is not None
            private_dir = root / private_tag
        images: list[dict[str, Any]] = []
        for i in range(spec.n):
            ctx.check_cancelled()
            values: dict[str, Any] = {"prompt": spec.prompt, "batch_size": 1}
            if spec.negative_prompt:
                values["negative_prompt"] = spec.negative_prompt
            if seeds[i] is not None:
                values["seed"] = seeds[i]
            if spec.size is not None:
                values["width"], values["height"] = spec.size
            if state.settings["checkpoint"]:
                values["checkpoint"] = state.settings["checkpoint"]
            prefix = f"{private_tag}/image" if private_tag else f"localm/{ctx.job_id}-{i + 1}"
            graph = wf.apply(values, prefix=prefix)
            ctx.progress(i / spec.n, f"image {i + 1} of {spec.n}: queued in ComfyUI", image=i + 1, images=spec.n)
            prompt_ids.append(str(uuid.uuid4()))
            run = await state.comfy.run(url, graph, timeout=float(state.settings["timeout"]), prompt_id=prompt_ids[-1],
                                        on_event=_progress(ctx, graph, i, spec.n))
            image = _pick(run)
            png = await state.comfy.view(url, image)
            size = png_size(png)
            if size is None:
                raise sdk.LocalmError(502, f"The workflow saved {image['filename']}, which is not a PNG (only png "
                                           "is served)", code="generation_failed")
            item: dict[str, Any] = {"seed": seeds[i], "width": size[0], "height": size[1]}
            if spec.private:
                spec.pngs.append(png)
                if keep_b64:
                    item["b64_json"] = base64.b64encode(png).decode()
            else:
                record = await asyncio.to_thread(state.gallery.add, png, {
                    "prompt": spec.prompt, "negative_prompt": spec.negative_prompt, "workflow": wf.name,
                    "seed": seeds[i], "owner": owner, "job_id": ctx.job_id})
                item.update(name=record["name"], url=f"/api/imagine/file/{record['name']}")
            for made in run.images:  # ComfyUI's copies: the gallery holds the image now
                path = state.comfy.file_of(made)
                if path is not None and spec.private:
                    leftovers.append(path)
                elif path is not None and state.comfy.launched_by_localm:
                    path.unlink(missing_ok=True)
            images.append(item)
            ctx.progress((i + 1) / spec.n, f"image {i + 1} of {spec.n} done", image=i + 1, images=spec.n)
        out: dict[str, Any] = {"images": images, "workflow": wf.name}
        if spec.private:
            out["private"] = True
        return out
    finally:
        try:
            if private_dir is not None:
                await _forget(state, url, prompt_ids, private_dir, leftovers, spec)
        finally:
            if unloaded:
                asyncio.get_running_loop().create_task(_restore(state, unloaded))
            else:
                state.turn.release()


async def _forget(state: Images, url: str, prompt_ids: list[str], private_dir: Path, leftovers: list[Path],
                  spec: Spec) -> None:
    """Privacy mode: delete every file the runs wrote and their entries in ComfyUI's history;
    a file that stays means the images are not returned (500)."""
    for pid in prompt_ids:
        await state.comfy.forget(url, pid)

    def delete() -> bool:
        for path in leftovers:
            path.unlink(missing_ok=True)
        shutil.rmtree(private_dir, ignore_errors=True)
        return private_dir.exists() or any(path.exists() for path in leftovers)
    if await asyncio.to_thread(delete):
        spec.pngs.clear()
        raise sdk.LocalmError(500, "Privacy mode: the generated image could not be deleted, so it was not returned",
                              code="privacy_delete_failed")


def start(request: sdk.Request, state: Images, spec: Spec, *, keep_b64: bool) -> Any:
    host = sdk.host_of(request)
    if host.jobs is None:
        raise sdk.LocalmError(503, "This server has no background job registry", code="no_jobs")
    owner = sdk.caller(request).owner_tag
    title = "Generate an image" if spec.private else f"Image: {spec.prompt[:80]}"

    async def work(ctx: sdk.JobContext) -> dict[str, Any]:
        try:
            return await run_job(state, ctx, spec, owner, keep_b64=keep_b64)
        except sdk.LocalmError as exc:
            spec.failure = exc
            exc.result = {"status": exc.status, "code": exc.code}  # type: ignore[attr-defined]
            raise
    return sdk.plugin_of(request).start_job(work, kind="image", title=title, owner=owner)
