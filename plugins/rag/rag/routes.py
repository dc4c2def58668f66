"""The knowledge routes, /api/rag/* (scope ``rag``)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from localm import sdk
from localm.sdk import extract

from . import policy, schema
from .service import (DEFAULT_EMBEDDER, INTERNAL, MAX_FILE_BYTES, MAX_PATHS, MAX_QUERY_CHARS, MAX_UPLOAD_BYTES,
                      Source, plain_paths)


async def _body(request: sdk.Request, limit: int | None = None) -> dict[str, Any]:
    """The JSON object (``{}`` for no body); one over ``limit`` bytes is a 413."""
    return await sdk.json_body(request, empty={}, max_bytes=limit)


def _flag(body: dict[str, Any], key: str, default: bool | None) -> bool | None:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise sdk.LocalmError(400, f"{key} must be true or false", code="invalid_parameter")
    return value


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value.strip():
        raise sdk.LocalmError(400, f"{key} must be a non-empty string", code="invalid_parameter")
    return value


def _job(request: sdk.Request, fn: Any, *, kind: str, title: str) -> dict[str, Any]:
    host = sdk.host_of(request)
    if host.jobs is None:
        raise sdk.LocalmError(503, "This server has no job registry", code="no_jobs")
    job = sdk.plugin_of(request).start_job(fn, kind=kind, title=title, owner=sdk.caller(request).owner_tag)
    return {"job_id": job.id}


def _decode(item: Any, index: int) -> tuple[str, bytes]:
    """One uploaded file: its name and bytes (413 over 30 MB, checked before decoding)."""
    return extract.decode(item, f"files[{index}]")


# --- collections ------------------------------------------------------------------------

@sdk.get("/api/rag/collections", summary="List knowledge collections with their stats")
async def list_collections(request: sdk.Request) -> dict[str, Any]:
    k = sdk.service_of(request)
    return {"collections": await asyncio.to_thread(k.listing, sdk.caller(request))}


@sdk.post("/api/rag/collections", summary="Create an empty knowledge collection", body=schema.NewCollection,
          errors={400: "An invalid collection name (invalid_collection_name)", 409: "It exists (collection_exists)"})
async def create_collection(request: sdk.Request) -> dict[str, Any]:
    k = sdk.service_of(request)
    body = await _body(request)
    col = await asyncio.to_thread(k.store.create, body.get("name"))
    return await asyncio.to_thread(k.stats, col, k.find_model(k.embedder_name()))


@sdk.get("/api/rag/collections/{name:str}", summary="One collection's stats and documents", params=schema.NAME,
         errors=schema.COLLECTION)
async def get_collection(request: sdk.Request, name: str) -> dict[str, Any]:
    k = sdk.service_of(request)
    col = await asyncio.to_thread(k.open, name, sdk.caller(request))

    caller = sdk.caller(request)

    def detail() -> dict[str, Any]:
        out = k.stats(col, k.find_model(k.embedder_name()), caller)
        out["docs"] = [{"path": d["path"], "kind": d["kind"], "filename": d["filename"], "format": d["format"],
                        "size": d["size"], "mtime": d["mtime"], "sha256": d["sha256"], "chunks": d["n_chunks"],
                        "indexed": d["indexed"], "missing": d["missing"]} for d in col.docs(k.present(caller))]
        return out
    return await asyncio.to_thread(detail)


@sdk.delete("/api/rag/collections/{name:str}", summary="Delete a collection and its index", params=schema.NAME,
            errors=schema.COLLECTION)
async def delete_collection(request: sdk.Request, name: str) -> dict[str, Any]:
    k = sdk.service_of(request)
    await asyncio.to_thread(k.open, name, sdk.caller(request))
    await asyncio.to_thread(k.store.delete, name)
    return {"status": "deleted", "name": name}


@sdk.post("/api/rag/collections/{name:str}/add", summary="Index files and folders into a collection (a job)",
          params=schema.NAME, body=schema.AddPaths,
          errors={**schema.COLLECTION, 400: "No paths, more than 50 (too_many_paths), a path that does not exist "
                                           "(path_not_found), a flag that is not true or false",
                  409: "Paths outside the allowed folders that need consent, or the collection is being written"})
async def add(request: sdk.Request, name: str) -> dict[str, Any]:
    k = sdk.service_of(request)
    body = await _body(request)
    col = await asyncio.to_thread(k.store.get, name)
    paths = body.get("paths")
    if isinstance(paths, str):
        paths = [paths]
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p.strip() for p in paths):
        raise sdk.LocalmError(400, "paths must be a list of 1 to 50 paths", code="invalid_parameter")
    if len(paths) > MAX_PATHS:
        raise sdk.LocalmError(400, f"At most {MAX_PATHS} paths per add ({len(paths)} given)", code="too_many_paths")
    embed, reindex = _flag(body, "embed", True), _flag(body, "reindex", False)
    consent = _flag(body, "consent", False)
    caller = sdk.caller(request)

    def check() -> tuple[list[Any], Any]:
        # the rules first, on resolved paths: whether a path the caller may not add exists is not told
        resolved = plain_paths(paths)
        policy.check_paths(resolved, caller, k.settings, data_dir=sdk.host_of(request).data_dir,
                           consent=bool(consent))
        for path in resolved:
            if not path.exists():
                raise sdk.LocalmError(400, f"No such file or folder: {path.name or path}", code="path_not_found")
        k.open(name, caller)
        return resolved, k.rules(caller)
    resolved, rules = await asyncio.to_thread(check)
    sources, skipped = await asyncio.to_thread(k.expand, resolved, rules)

    async def run(ctx: sdk.JobContext) -> dict[str, Any]:
        return await k.index(ctx, col, sources, rules=rules, embed=bool(embed), reindex=bool(reindex),
                             roots=[str(p) for p in resolved], skipped=skipped)
    return _job(request, run, kind="rag.add", title=f"Index {len(sources)} file(s) into {name}")


@sdk.post("/api/rag/collections/{name:str}/upload", summary="Index uploaded files into a collection (a job)",
          request_max_body_size=MAX_UPLOAD_BYTES * 2, params=schema.NAME, body=schema.Upload,
          errors={**schema.COLLECTION, 400: "No files, more than 50 (too_many_files), a file without filename or "
                                           "content_b64, content that is not base64 (invalid_base64)",
                  413: "A body over 100 MB (request_too_large) or a file over 30 MB (file_too_large)"})
async def upload(request: sdk.Request, name: str) -> dict[str, Any]:
    k = sdk.service_of(request)
    body = await _body(request, limit=MAX_UPLOAD_BYTES)
    col = await asyncio.to_thread(k.open, name, sdk.caller(request))
    files = body.get("files")
    if not isinstance(files, list) or not files:
        raise sdk.LocalmError(400, "files must be a list of 1 to 50 {filename, content_b64}", code="invalid_parameter")
    if len(files) > MAX_PATHS:
        raise sdk.LocalmError(400, f"At most {MAX_PATHS} files per upload ({len(files)} given)",
                              code="too_many_files")
    embed, reindex = _flag(body, "embed", True), _flag(body, "reindex", False)

    def decode() -> list[Source]:
        return [Source(f"upload:{filename}", "upload", None, filename, data)
                for filename, data in (_decode(item, i) for i, item in enumerate(files))]
    sources = await asyncio.to_thread(decode)
    rules = k.rules(sdk.caller(request))

    async def run(ctx: sdk.JobContext) -> dict[str, Any]:
        return await k.index(ctx, col, sources, rules=rules, embed=bool(embed), reindex=bool(reindex), roots=[])
    return _job(request, run, kind="rag.upload", title=f"Index {len(sources)} uploaded file(s) into {name}")


@sdk.post("/api/rag/collections/{name:str}/query", summary="Search a collection", params=schema.NAME,
          body=schema.Query, errors={**schema.COLLECTION, 400: "An empty query (empty_query), or a field of the "
                                                               "wrong type or value (invalid_parameter)"})
async def query(request: sdk.Request, name: str) -> dict[str, Any]:
    k = sdk.service_of(request)
    body = await _body(request)
    col = await asyncio.to_thread(k.open, name, sdk.caller(request))
    text = body.get("query")
    if not isinstance(text, str) or not text.strip():
        raise sdk.LocalmError(400, "query must be a non-empty string", code="empty_query")
    if len(text) > MAX_QUERY_CHARS:
        raise sdk.LocalmError(400, f"query is at most {MAX_QUERY_CHARS} characters ({len(text)} given)",
                              code="query_too_long")
    size = body.get("k", 4)
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not math.isfinite(size):
        raise sdk.LocalmError(400, "k must be a number", code="invalid_parameter")
    rerank = body.get("rerank")
    if rerank is not None and not isinstance(rerank, bool):
        raise sdk.LocalmError(400, "rerank must be true, false or null", code="invalid_parameter")
    context = body.get("context")
    if context is not None and not isinstance(context, str):
        raise sdk.LocalmError(400, "context must be a string", code="invalid_parameter")
    mode = body.get("mode", "hybrid")
    if mode not in ("hybrid", "vector", "lexical"):
        raise sdk.LocalmError(400, "mode must be hybrid, vector or lexical", code="invalid_parameter")
    return await k.search(col, text, k=max(1, min(20, int(size))),
                          relevant_only=bool(_flag(body, "relevant_only", False)), rerank=rerank, context=context,
                          mode=mode)


@sdk.post("/api/rag/collections/{name:str}/reembed", summary="Recompute a collection's vectors (a job)",
          params=schema.NAME, errors={**schema.COLLECTION, 400: "No embedding model is available (no_embedder)"})
async def reembed(request: sdk.Request, name: str) -> dict[str, Any]:
    k = sdk.service_of(request)
    col = await asyncio.to_thread(k.open, name, sdk.caller(request))
    entry, reason = await k.embedder()
    if entry is None:
        raise sdk.LocalmError(400, f"No embedding model is available: {reason}", code="no_embedder")

    async def run(ctx: sdk.JobContext) -> dict[str, Any]:
        return await k.reembed(ctx, col, entry)
    return _job(request, run, kind="rag.reembed", title=f"Re-embed {name} with {entry.id}")


@sdk.post("/api/rag/collections/{name:str}/repair", summary="Re-index every rebuildable document (a job)",
          params=schema.NAME, body=schema.Repair, body_required=False,
          errors={**schema.COLLECTION, 400: "Nothing to repair (nothing_to_repair), or a flag that is not true or "
                                           "false"})
async def repair(request: sdk.Request, name: str) -> dict[str, Any]:
    k = sdk.service_of(request)
    body = await _body(request)
    caller = sdk.caller(request)
    col = await asyncio.to_thread(k.open, name, caller)
    embed, confirm = _flag(body, "embed", True), _flag(body, "confirm", False)
    rules = k.rules(caller)
    docs = await asyncio.to_thread(col.docs, rules.present)
    if not docs:
        raise sdk.LocalmError(400, f"Collection {name} has no documents to repair", code="nothing_to_repair")
    files = [d for d in docs if d["kind"] == "file"]
    if not files:
        raise sdk.LocalmError(400, f"Every document in {name} was uploaded; uploads cannot be rebuilt (their bytes "
                                   "are not kept)", code="nothing_to_repair")
    stats = await asyncio.to_thread(col.stats, rules.present)
    if not embed and stats["has_vectors"] and not confirm:
        return {"needs_confirm": True, "collection": name, "n_chunks": stats["n_chunks"],
                "detail": "Repairing without embeddings removes the collection's vectors: it will be searched "
                          "lexically only. Re-send with \"confirm\": true to proceed."}
    rebuildable = [d for d in files if not d["missing"]]
    report = {"uploads_not_rebuilt": [d["path"] for d in docs if d["kind"] == "upload"],
              "missing_not_rebuilt": [d["path"] for d in files if d["missing"]]}
    sources = [Source(d["path"], "file", d["root"], d["filename"]) for d in rebuildable]

    async def run(ctx: sdk.JobContext) -> dict[str, Any]:
        if not embed and stats["has_vectors"]:
            await k.drop_vectors(col, "repaired without embeddings: lexical search only")
        swept = 0
        try:
            swept = await asyncio.to_thread(col.sweep)
        except Exception as exc:  # a vector store that cannot be read is what repair works around
            ctx.log(f"vectors not swept: {exc}")
        result = await k.index(ctx, col, sources, rules=rules, embed=bool(embed), reindex=True, roots=[])
        return {**result, **report, "orphan_vectors_removed": swept}
    return _job(request, run, kind="rag.repair", title=f"Repair {name}")


@sdk.post("/api/rag/collections/{name:str}/remove-doc", summary="Remove one document from a collection",
          params=schema.NAME, body=schema.RemoveDoc,
          errors={**schema.COLLECTION, 404: "No such collection, or the document is not in it (doc_not_found)"})
async def remove_doc(request: sdk.Request, name: str) -> dict[str, Any]:
    k = sdk.service_of(request)
    body = await _body(request)
    col = await asyncio.to_thread(k.open, name, sdk.caller(request))
    path = _text(body, "path")

    def run() -> bool:
        with col.writing():
            found = col.remove(path)
            if not found and not path.startswith("upload:") and "\0" not in path:  # no file is named so
                found = col.remove(str(policy.real(path)))
            return found
    if not await asyncio.to_thread(run):
        raise sdk.LocalmError(404, f"{path} is not indexed in {name}", code="doc_not_found")
    return {"status": "removed", "path": path}


# --- extraction, reranking, the embedder ----------------------------------------------------

@sdk.post("/api/rag/extract", summary="Extract the plain text of an uploaded file (in memory)",
          request_max_body_size=MAX_FILE_BYTES * 2, body=schema.Extract,
          errors={400: "No filename or content_b64, content that is not base64, a file that cannot be read",
                  413: "A file over 30 MB (file_too_large)"})
async def extract_text(request: sdk.Request) -> dict[str, Any]:
    body = await _body(request)
    return await asyncio.to_thread(extract.upload, body)


@sdk.get("/api/rag/rerank", summary="Whether knowledge results are reranked, and by what")
async def rerank_state(request: sdk.Request) -> dict[str, Any]:
    k = sdk.service_of(request)
    model, note = k.rerank_choice()
    enabled = bool(k.settings.get("rerank", False))
    return {"enabled": enabled, "installed": k.rerankers(), "model": model,
            "candidates": int(k.settings.get("rerank_candidates", 20)),
            "note": note if (enabled or model is None) else None}


@sdk.get("/api/rag/embedding", summary="The embedding model and whether it is ready")
async def embedding_state(request: sdk.Request) -> dict[str, Any]:
    k = sdk.service_of(request)
    name = k.embedder_name()
    try:
        entry = await asyncio.to_thread(k.find_model, name)
    except sdk.LocalmError as exc:
        raise sdk.LocalmError(504, f"The embedder's state cannot be read: {exc.detail}", code="embedder_unknown") from None
    internal = name in INTERNAL
    if entry is None and not internal and not policy.is_owner(sdk.caller(request)):
        return {"model": None, "default": DEFAULT_EMBEDDER, "internal": False, "installed": False, "dim": None,
                "error": "withheld", "gpu_fallback_reason": None, "status": "unknown", "can_download": False}
    installed = entry is not None or k.package_installed(name)
    error = None
    if entry is not None and entry.role == "reranker":
        error = f"{name} is a reranker, not an embedding model"
    elif not installed:
        error = f"the embedding model {name} is not installed"
    return {"model": name, "default": DEFAULT_EMBEDDER, "internal": internal, "installed": installed,
            "dim": k.known_dim(entry), "error": error, "gpu_fallback_reason": None,
            "status": "ready" if installed and error is None else ("not_installed" if not installed else "unknown"),
            "can_download": internal and not installed}


def _pull_job(k: Any, source: str, name: str, *, then: Any = None) -> Any:
    async def run(ctx: sdk.JobContext) -> dict[str, Any]:
        if k.find_model(name) is None:
            async for step in k.host.models.pull(source):
                ctx.progress(None if "total" not in step else step["completed"] / max(1, step["total"]),
                             step.get("status"))
        out = {"model": name, "installed": k.find_model(name) is not None}
        if then is not None:
            out.update(await then(ctx))
        return out
    return run


@sdk.post("/api/rag/embedding/download", scope="config:write",
          summary="Install the configured embedding model once (a job)")
async def embedding_download(request: sdk.Request) -> dict[str, Any]:
    k = sdk.service_of(request)
    name = k.embedder_name()
    if name not in INTERNAL:
        raise sdk.LocalmError(409, f"{name} is not one of localm's downloadable embedding models "
                                   f"({', '.join(INTERNAL)})", code="not_downloadable")
    if k.find_model(name) is not None:
        return {"status": "already_installed", "model": name}
    out = _job(request, _pull_job(k, INTERNAL[name], name), kind="rag.embedding", title=f"Install {name}")
    return {**out, "model": name}


@sdk.post("/api/rag/embedding", summary="Choose the embedding model (dry run, then confirm: a job)",
          body=schema.ChooseEmbedder,
          errors={400: "No model named", 403: "A caller who is not the owner (owner_only)",
                  404: "An unregistered model that localm cannot install (model_not_found)",
                  409: "A setup is already running (setup_running)", 422: "A reranker (not_an_embedder)"})
async def embedding_select(request: sdk.Request) -> dict[str, Any]:
    k = sdk.service_of(request)
    if not policy.is_owner(sdk.caller(request)):
        raise sdk.LocalmError(403, "Changing the embedding model needs the owner (an admin key)", code="owner_only")
    body = await _body(request)
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise sdk.LocalmError(400, "model must be a non-empty string", code="invalid_parameter")
    model = model.strip()
    entry = k.find_model(model)
    if entry is None and model not in INTERNAL:
        raise sdk.LocalmError(404, f"Model not found: {model} (localm pull it first)", code="model_not_found")
    if entry is not None and entry.role == "reranker":
        raise sdk.LocalmError(422, f"{model} is a reranker, not an embedding model", code="not_an_embedder")
    affected = [s["name"] for s in await asyncio.to_thread(k.listing, None)
                if s["has_vectors"] and s.get("embedding_model") not in (None, entry.id if entry else model)]
    if not _flag(body, "confirm", False):
        return {"needs_confirm": True, "model": model, "collections": affected,
                "note": (f"Collections built with another model keep working lexically until re-embedded: "
                         f"{', '.join(affected)}." if affected else "No collection needs re-embedding.")
                        + " Re-send with \"confirm\": true to switch."}
    if k.setup_job is not None and not k.setup_job.done:
        raise sdk.LocalmError(409, "An embedding model setup is already running", code="setup_running")
    plugin = sdk.plugin_of(request)

    async def switch(ctx: sdk.JobContext) -> dict[str, Any]:
        chosen = k.find_model(model)
        if chosen is None:
            raise sdk.LocalmError(404, f"{model} could not be installed")
        ctx.progress(None, f"checking {chosen.id}")
        _, vectors, _ = await k.host.chat.embed(chosen.id, ["localm"])
        plugin.save_settings({"embedding_model": model})
        return {"dim": len(vectors[0]) if vectors else None, "reembed": affected}

    source = INTERNAL.get(model, "")
    run = _pull_job(k, source, model, then=switch)
    out = _job(request, run, kind="rag.embedding", title=f"Switch the embedding model to {model}")
    k.setup_job = sdk.host_of(request).jobs.get(out["job_id"])
    return out


HANDLERS = [list_collections, create_collection, get_collection, delete_collection, add, upload, query, reembed,
            repair, remove_doc, extract_text, rerank_state, embedding_state, embedding_download, embedding_select]
