"""The openai plugin: OpenAI's API on localm's port. POST /v1/chat/completions,
/v1/completions, /v1/embeddings and /v1/rerank (:mod:`.rerank`), GET /v1/models, and the error shape of the
``openai`` error family (every route that names it: these, and the audio and image routes of
other plugins); GET /v1/models and /v1/models/{id} (:mod:`.models`).

A surface like the Ollama, Anthropic and Responses plugins: it reads the OpenAI body, asks
the chat service (``host.chat``, the chat plugin's) to generate, embed, rerank or score, and
renders OpenAI responses and server-sent events. The request bodies are the chat service's
own readers' (an OpenAI chat body is what every surface translates into); their OpenAPI
models are in :mod:`.schema`.
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

from localm import sdk
from localm.sdk.chat import Call, ChatRequest, Piece, Reasoning, Status
from localm.sdk.fields import Reader

from . import schema, scoring
from .models import list_models, read_model, route_model, unroute_model
from .rerank import rerank_route

log = logging.getLogger("localm.plugin.openai")

DONE = b"data: [DONE]\n\n"


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def _body(request: sdk.Request) -> Any:
    """Any JSON value: the readers refuse one that is not an object with their 422."""
    return await sdk.json_body(request, require_object=False, missing="The body is not valid JSON")


def _stream(chunks: AsyncIterator[bytes], headers: dict[str, str]) -> sdk.Stream:
    return sdk.EventStream(chunks, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})


def _ending(last: dict[str, Any], usage: dict[str, Any], include_usage: bool) -> list[bytes]:
    """A stream's finish chunk with its usage (or a last usage chunk with empty choices), then [DONE]."""
    if include_usage:
        return [_event(last), _event({**last, "choices": [], "usage": usage}), DONE]
    return [_event({**last, "usage": usage}), DONE]


def _chat_logprob(entry: dict[str, Any], token_ids: bool) -> dict[str, Any]:
    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {"token": f"token_id:{e['id']}" if token_ids else e["token"], "logprob": e["logprob"],
                "bytes": e["bytes"]}
    return {**one(entry), "top_logprobs": [one(t) for t in entry["top"]]}


def _first_wins(pairs: Any) -> dict[str, float]:
    """Two ids that decode to the same text share one entry: the more likely one's."""
    out: dict[str, float] = {}
    for key, value in pairs:
        out.setdefault(key, value)
    return out


def _text_logprobs(entries: list[dict[str, Any]], offset: int, token_ids: bool) -> dict[str, Any]:
    """OpenAI's legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    def key(e: dict[str, Any]) -> str:
        return f"token_id:{e['id']}" if token_ids else e["token"]
    return {"tokens": [key(e) for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [_first_wins((key(t), t["logprob"]) for t in e["top"]) for e in entries],
            "text_offset": [offset + e["at"] for e in entries]}


# --- chat completions ------------------------------------------------------------------

@sdk.post("/v1/chat/completions", scope=None, access="inference", error_family="openai",
          summary="OpenAI chat completions", body=schema.ChatCompletionRequest, errors=schema.GENERATION_ERRORS)
async def chat_completions(request: sdk.Request) -> Any:
    received = time.perf_counter()
    host = sdk.host_of(request)
    body = await _body(request)
    if host.chat.wants_scoring(body):
        return await scoring.serve(request, "chat", body)
    if not isinstance(body, dict):
        body = {"": body}  # the reader refuses it with its 422
    gen = await host.chat.chat(ChatRequest(body=body), route="chat.completions", request=request, report=True,
                               received=received)
    asked, outcome = gen.request, gen.outcome
    ident = "chatcmpl-" + secrets.token_hex(12)
    created = int(time.time())

    if not asked.stream:
        reply = await gen.reply()
        message: dict[str, Any] = {"role": "assistant",
                                   "content": None if reply.calls and not reply.text.strip() else reply.text}
        if reply.reasoning:
            message["reasoning_content"] = "".join(reply.reasoning)
        if reply.calls:
            message["tool_calls"] = reply.calls
        logprobs = None
        if asked.logprobs is not None:
            if reply.rewritten:
                log.info("logprobs left out: a chat plugin rewrote the reply")
            else:
                logprobs = {"content": [_chat_logprob(e, asked.token_ids) for e in reply.logprobs],
                            "refusal": None}
        return sdk.Response({**gen.extra, "id": ident, "object": "chat.completion", "created": created,
                             "model": gen.model, "system_fingerprint": gen.fingerprint,
                             "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                                          "finish_reason": outcome.finish_reason,
                                          "stop_sequence": outcome.stop_sequence}],
                             "usage": host.chat.usage(outcome)}, headers=gen.headers)

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None, **extra: Any) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        choice.update(extra)
        return _event({"id": ident, "object": "chat.completion.chunk", "created": created, "model": gen.model,
                       "choices": [choice]})

    async def chunks() -> AsyncIterator[bytes]:
        yield chunk({"role": "assistant", "content": ""})
        calls = 0
        refused, replied = None, False
        try:
            async for item in gen.items():
                if not replied and not isinstance(item, Status):
                    replied = True
                    late = gen.extra.pop("localm_headers", None)
                    if late:  # headers decided after the stream opened: one chunk before the reply
                        yield _event({"id": ident, "object": "chat.completion.chunk", "created": created,
                                      "model": gen.model, "localm_headers": late,
                                      "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                   "finish_reason": None}]})
                if isinstance(item, Piece):
                    logprobs = None
                    if asked.logprobs is not None:
                        logprobs = {"content": [_chat_logprob(e, asked.token_ids) for e in item.logprobs]}
                    yield chunk({"content": item.text}, logprobs=logprobs)
                elif isinstance(item, Reasoning):
                    yield chunk({"reasoning_content": item.text})
                elif isinstance(item, Call):
                    yield chunk({"tool_calls": [{"index": calls, **item.call}]})
                    calls += 1
                elif item.code != "generating":
                    yield chunk({"status": item.text, "status_code": item.code})
        except sdk.LocalmError as exc:  # the stream is open: a refusal now travels in band
            outcome.finish_reason = "error"
            refused = {"status": exc.status, "detail": exc.detail, "code": exc.code}
            yield chunk({"content": f"\n[inference error: {host.chat.redact(exc.detail)}]"}, localm_error=refused)
        if gen.extra:  # what hooks and readers added: one chunk with empty choices
            yield _event({**gen.extra, "id": ident, "object": "chat.completion.chunk", "created": created,
                          "model": gen.model, "choices": []})
        last = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": gen.model,
                "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": outcome.finish_reason,
                             "stop_sequence": outcome.stop_sequence}]}
        if refused is not None and not replied:  # refused while prepared: the final chunk says so too
            last["choices"][0]["localm_error"] = refused
        for event in _ending(last, host.chat.usage(outcome), asked.include_usage):
            yield event

    return _stream(chunks(), gen.headers)


# --- text completions ------------------------------------------------------------------

@sdk.post("/v1/completions", scope=None, access="inference", error_family="openai",
          summary="OpenAI text completions", body=schema.CompletionRequest, errors=schema.GENERATION_ERRORS)
async def completions(request: sdk.Request) -> Any:
    received = time.perf_counter()
    host = sdk.host_of(request)
    body = await _body(request)
    if host.chat.wants_scoring(body):
        return await scoring.serve(request, "completions", body)
    if not isinstance(body, dict):
        body = {"": body}
    gen = await host.chat.complete(body, route="completions", request=request, report=True, received=received)
    asked, outcome = gen.request, gen.outcome
    prompt_text = body["prompt"] if isinstance(body["prompt"], str) else body["prompt"][0]
    echo = bool(body.get("echo"))
    ident = "cmpl-" + secrets.token_hex(12)
    created = int(time.time())
    offset = len(prompt_text)

    if not asked.stream:
        reply = await gen.reply()
        text = reply.text
        logprobs = None
        if asked.logprobs is not None:
            if reply.rewritten:
                log.info("logprobs left out: a chat plugin rewrote the reply")
            else:
                logprobs = _text_logprobs(reply.logprobs, offset, asked.token_ids)
        return sdk.Response({**gen.extra, "id": ident, "object": "text_completion", "created": created,
                             "model": gen.model, "system_fingerprint": gen.fingerprint,
                             "choices": [{"index": 0, "text": (prompt_text + text) if echo else text,
                                          "logprobs": logprobs, "finish_reason": outcome.finish_reason,
                                          "stop_sequence": outcome.stop_sequence}],
                             "usage": host.chat.usage(outcome, timings=False, capacity=False)},
                            headers=gen.headers)

    def chunk(text: str, finish: str | None = None, logprobs: Any = None, **extra: Any) -> bytes:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish, **extra}
        return _event({"id": ident, "object": "text_completion", "created": created, "model": gen.model,
                       "choices": [choice]})

    async def chunks() -> AsyncIterator[bytes]:
        if echo:
            yield chunk(prompt_text)
        refused, replied = None, False
        try:
            async for item in gen.items():
                replied = replied or not isinstance(item, Status)
                if isinstance(item, Piece):
                    logprobs = None
                    if asked.logprobs is not None:
                        logprobs = _text_logprobs(list(item.logprobs), offset, asked.token_ids)
                    yield chunk(item.text, logprobs=logprobs)
        except sdk.LocalmError as exc:
            outcome.finish_reason = "error"
            refused = {"status": exc.status, "detail": exc.detail, "code": exc.code}
            yield chunk(f"\n[inference error: {host.chat.redact(exc.detail)}]", localm_error=refused)
        if gen.extra:
            yield _event({**gen.extra, "id": ident, "object": "text_completion", "created": created,
                          "model": gen.model, "choices": []})
        last = {"id": ident, "object": "text_completion", "created": created, "model": gen.model,
                "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": outcome.finish_reason,
                             "stop_sequence": outcome.stop_sequence}]}
        if refused is not None and not replied:  # refused while prepared: the final chunk says so too
            last["choices"][0]["localm_error"] = refused
        for event in _ending(last, host.chat.usage(outcome, timings=True, capacity=False), asked.include_usage):
            yield event

    return _stream(chunks(), gen.headers)


# --- embeddings --------------------------------------------------------------------------

@sdk.post("/v1/embeddings", scope=None, access="inference", error_family="openai", summary="OpenAI embeddings",
          body=schema.EmbeddingRequest, errors=schema.EMBEDDING_ERRORS)
async def embeddings(request: sdk.Request) -> sdk.Response:
    host = sdk.host_of(request)
    r = Reader(await _body(request))
    model = r.get("model", (str,), "a string")
    fmt = r.get("encoding_format", (str,), "a string", "float")
    texts = r.body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        r.errors.append({"key": "input", "message": "must be a string or a non-empty list of strings"})
    r.done()
    headers = host.chat.check_fields("embeddings", r.body, request.headers)
    if fmt not in ("float", "base64"):
        raise sdk.LocalmError(400, "encoding_format must be float or base64")
    entry, vectors, tokens = await host.chat.embed(model, texts)

    def encode(vector: list[float]) -> Any:
        if fmt == "float":
            return vector
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

    return sdk.Response({"object": "list", "model": model or entry.id,
                         "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                                  for i, v in enumerate(vectors)],
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, headers=headers)


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


def openai_error(status: int, detail: str, code: str | None, extra: dict[str, Any]) -> sdk.Response:
    """localm's {"detail": ...} plus OpenAI's error object, so OpenAI SDKs show the message."""
    body: dict[str, Any] = {"detail": detail, **({"code": code} if code else {}), **extra,
                            "error": {"message": detail, "type": _ERROR_TYPES.get(status, "server_error"),
                                      "param": extra.get("param", extra.get("field")), "code": code}}
    return sdk.Response(body, status_code=status)


@sdk.hookimpl
def startup(host, plugin):
    host.register_error_renderer("openai", openai_error, plugin=plugin.name)


@sdk.hookimpl
def register_routes(register):
    register(chat_completions, completions, embeddings, rerank_route, list_models, read_model, route_model,
             unroute_model)
