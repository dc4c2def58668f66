"""Reranking: documents scored against a query by a registered reranker, best first.

A reranker is a model registered with the role ``reranker`` (a cross-encoder: a Hugging
Face ``...ForSequenceClassification`` folder, or a GGUF file with rank pooling). Its engine
scores each (query, document) pair with its classifier head (``engine.rerank``). The
openai plugin's POST /v1/rerank serves it in the Jina / Cohere / llama-server shape, and
other plugins (RAG) reach the same path through ``host.chat.rerank(...)``.

One reranker is resident at a time (the model manager unloads one to load another).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from localm import sdk

from . import pipeline
from .request import Invalid

log = logging.getLogger("localm.plugin.chat")

ROLE_NAMES = {"chat": "a chat model", "embedding": "an embedding model"}


def resolve(host: Any, model: str | None) -> Any:
    """The registry entry of the reranker ``model`` names; without a name, the one registered.

    404 for an unknown name (a path is never accepted) or no reranker at all; 400 when
    several are registered and none is named; 422 for a model that is not a reranker.
    """
    if not model:
        found = [e for e in host.models.entries() if e.role == "reranker"]
        if not found:
            raise sdk.LocalmError(404, "No reranker is registered: register a cross-encoder (a Hugging Face "
                                       "...ForSequenceClassification folder or a GGUF reranker) with localm pull",
                                  code="model_not_found")
        if len(found) > 1:
            names = ", ".join(sorted(e.id for e in found))
            raise sdk.LocalmError(400, f"Several rerankers are registered ({names}): name one in model",
                                  code="model_required")
        return found[0]
    if "/" in model or "\\" in model:  # never echoed: it may be a path on this machine
        raise sdk.LocalmError(404, "Model not found: model names a registered reranker, never a path "
                                   "(register the file with localm pull)", code="model_not_found")
    entry = host.models.resolve(model)
    if entry.role != "reranker":
        what = ROLE_NAMES.get(entry.role, f"a {entry.role} model")
        hint = ": use /v1/embeddings" if entry.role == "embedding" else ""
        raise sdk.LocalmError(422, f"{entry.id} is {what}, not a reranker{hint}", code="not_a_reranker")
    return entry


async def rerank(host: Any, model: str | None, query: str, documents: list[str], *,
                 top_n: int | None = None) -> tuple[Any, list[dict[str, Any]], int]:
    """(the registry entry, the results best first, the tokens the model read).

    Each result is ``{"index", "relevance_score"}`` plus ``label_scores`` (a head with
    several outputs) and ``truncated: True`` (a document cut to fit the window). ``top_n``
    keeps the best N. Errors are the route's: see POST /v1/rerank in docs/models.md.
    """
    if not isinstance(query, str) or not query.strip():
        raise sdk.LocalmError(400, "query must not be empty", code="empty_query", field="query")
    if not isinstance(documents, (list, tuple)) or not documents or not all(isinstance(d, str) for d in documents):
        raise Invalid([{"key": "documents", "message": "must be a non-empty list of strings"}])
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise Invalid([{"key": "top_n", "message": "must be an integer of at least 1"}])
    entry = resolve(host, model)
    if not Path(entry.path).exists():
        raise sdk.LocalmError(422, f"The reranker {entry.id} is registered, but its file {Path(entry.path).name} "
                                   "is missing: pull it again", code="model_file_missing")
    try:
        async with host.models.use(entry.id) as resident:
            ranked = await _score(resident.engine, entry, query, list(documents))
    except sdk.LocalmError as exc:
        if exc.code == "no_classifier_head":
            raise sdk.LocalmError(422, pipeline.redact(exc.detail), code=exc.code) from None
        if exc.code == "model_load_failed":  # the reranker cannot be loaded: the service is unavailable
            raise sdk.LocalmError(503, pipeline.redact(exc.detail), code=exc.code) from None
        raise
    order = sorted(range(len(ranked)), key=lambda i: (-ranked[i].score, i))
    results = []
    for i in order[:top_n]:
        item: dict[str, Any] = {"index": i, "relevance_score": ranked[i].score}
        if ranked[i].label_scores is not None:
            item["label_scores"] = list(ranked[i].label_scores)
        if ranked[i].truncated:
            item["truncated"] = True
        results.append(item)
    return entry, results, sum(r.tokens for r in ranked)


async def _score(engine: Any, entry: Any, query: str, documents: list[str]) -> list[Any]:
    """The engine's scores, checked: a refusal of the engine passes on, a failure is a 503."""
    if not getattr(engine.capabilities, "rerank", False) or not hasattr(engine, "rerank"):
        raise sdk.LocalmError(422, f"The {engine.engine} engine cannot rerank with {entry.id}: it found no "
                                   "classifier head", code="no_classifier_head")
    try:
        ranked = await engine.rerank(query, documents)
    except sdk.LocalmError:
        raise
    except Exception as exc:  # the worker failed: reported without paths, logged in full
        log.exception("reranking with %s failed", entry.id)
        reason = " ".join(str(exc).split())[:300] or exc.__class__.__name__
        raise sdk.LocalmError(503, f"The reranker {entry.id} failed: {pipeline.redact(reason)}",
                              code="reranker_failed") from None
    if len(ranked) != len(documents) or not all(math.isfinite(r.score) for r in ranked):
        raise sdk.LocalmError(503, f"The reranker {entry.id} returned no finite score for some documents",
                              code="reranker_failed")
    return ranked
