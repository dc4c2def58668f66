"""POST /v1/rerank: documents scored against a query, best first, in the Jina / Cohere /
llama-server shape. The chat service (``host.chat.rerank``) picks the reranker and scores;
this route reads the body and renders the answer.
"""

from __future__ import annotations

from typing import Any

from localm import sdk
from localm.sdk.fields import Invalid, Reader

from .schema import RERANK_ERRORS, RerankRequest


def _not_json(reason: str, message: str) -> Invalid:
    return Invalid([{"key": "body", "message": "is not valid JSON"}])


def read_body(body: Any) -> tuple[dict[str, Any], str | None, str, list[str], int | None, bool]:
    """(body, model, query, document texts, top_n, return_documents) from the parsed body; a
    body that is not an object, or a field of the wrong type, is a 422 naming every such field."""
    r = Reader(body)
    model = r.get("model", (str,), "a string")
    query = r.body.get("query")
    if not isinstance(query, str):
        r.errors.append({"key": "query", "message": "must be a string"})
    top_n = r.get("top_n", (int,), "an integer of at least 1")
    if top_n is not None and top_n < 1:
        r.errors.append({"key": "top_n", "message": "must be an integer of at least 1"})
    back = r.get("return_documents", (bool,), "true or false", False)
    raw_documents = r.body.get("documents")
    texts: list[str] = []
    if not isinstance(raw_documents, list) or not raw_documents:
        r.errors.append({"key": "documents", "message": "must be a non-empty list of strings or {\"text\": ...} "
                                                        "objects"})
    else:
        for i, item in enumerate(raw_documents):
            text = item.get("text") if isinstance(item, dict) else item
            if not isinstance(text, str):
                r.errors.append({"key": f"documents[{i}]", "message": "must be a string or {\"text\": string}"})
            texts.append(text if isinstance(text, str) else "")
    r.done()
    return body, model, query, texts, top_n, back


@sdk.post("/v1/rerank", scope=None, access="inference", error_family="openai",
          summary="Rerank documents against a query (Jina / Cohere / llama-server shape)",
          body=RerankRequest, errors=RERANK_ERRORS)
async def rerank_route(request: sdk.Request) -> sdk.Response:
    host = sdk.host_of(request)
    body, model, query, texts, top_n, back = read_body(await sdk.json_body(request, require_object=False,
                                                                          refuse=_not_json))
    headers = host.chat.check_fields("rerank", body, request.headers)
    entry, results, tokens = await host.chat.rerank(model, query, texts, top_n=top_n)
    if back:
        for item in results:
            item["document"] = {"text": texts[item["index"]]}
    return sdk.Response({"object": "list", "model": model or entry.id,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results},
                        headers=headers)
