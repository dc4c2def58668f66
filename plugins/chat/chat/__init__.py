"""The chat plugin: POST /v1/chat/completions, /v1/completions and /v1/embeddings.

It parses OpenAI requests, runs the chat pipeline (inlet hooks, template, the engine,
stop sequences, outlet hooks) and renders OpenAI responses and server-sent events.
Other surfaces reach the same pipeline through the ``chat`` host service.
"""

from __future__ import annotations

import base64
import json
import secrets
import struct
import time
from typing import Any, AsyncIterator

from localm import sdk

from . import fields, pipeline
from .request import Reader, read_common, read_messages

DONE = b"data: [DONE]\n\n"


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def _body(request: sdk.Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise sdk.LocalmError(400, "The body is not valid JSON") from exc


def _stream(chunks: AsyncIterator[bytes], headers: dict[str, str]) -> sdk.Stream:
    return sdk.EventStream(chunks, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})


async def _prepared(host: Any, name: str | None, render: Any, common: Any,
                    headers: dict[str, str]) -> tuple[Any, list[int], str]:
    """Load the model and tokenize the prompt: every refusal here is an HTTP status.

    Returns the entry, the prompt's tokens and the system_fingerprint; adds the seed echo
    to ``headers``.
    """
    entry = host.models.resolve(name)
    async with host.models.use(entry.id) as resident:
        engine = resident.engine
        prompt = render(engine)
        pipeline.check_fits(len(prompt), engine.capabilities.context_window)
    caps = engine.capabilities
    seed = common.sampling.seed
    if seed is not None:
        # the promise: the same seed and body repeat the reply, unless a reused prompt cache
        # can change the numbers on this engine
        scope = "request" if caps.cache_exact or not common.cache_prompt else "best-effort"
        headers.update({name: f'{seed};scope="{scope}"' for name in ("X-Localm-Seed", "X-miLLM-Seed")})
    return entry, prompt, fingerprint(entry, engine)


def fingerprint(entry: Any, engine: Any) -> str:
    """localm:<model>@<revision>:<dtype>/<quantization>:<engine>; an unknown part reads unrecorded."""
    caps = engine.capabilities
    revision = entry.sha256[:8] if entry.sha256 else None
    dtype = caps.dtype or entry.capabilities.get("dtype")
    quantization = caps.quantization or entry.capabilities.get("quantization")
    parts = [p or "unrecorded" for p in (revision, dtype, quantization)]
    return f"localm:{entry.id}@{parts[0]}:{parts[1]}/{parts[2]}:{engine.engine}"


def _ending(last: dict[str, Any], usage: dict[str, Any], include_usage: bool) -> list[bytes]:
    """A stream's finish chunk with its usage (or a last usage chunk with empty choices), then [DONE]."""
    if include_usage:
        return [_event(last), _event({**last, "choices": [], "usage": usage}), DONE]
    return [_event({**last, "usage": usage}), DONE]


async def _collect(host: Any, model: str, prompt: list[int], common: Any, received: float,
                   outcome: pipeline.Outcome) -> str:
    """A whole reply, for a non-streaming request."""
    async with host.models.use(model) as resident:
        pieces = pipeline.run(resident.engine, prompt, common, received, outcome, host.metrics)
        return "".join([item.text async for item in pieces if isinstance(item, pipeline.Piece)])


# --- chat completions ------------------------------------------------------------------

@sdk.post("/v1/chat/completions", scope=None, access="inference", error_family="openai",
          summary="OpenAI chat completions")
async def chat_completions(request: sdk.Request) -> Any:
    received = time.perf_counter()
    host = sdk.host_of(request)
    r = Reader(await _body(request))
    common = read_common(r)
    messages = read_messages(r)
    r.done()
    headers = fields.check("chat", r.body, request.headers)
    body = {"messages": messages, "model": common.model}
    for _, changed in await host.run_hook("chat_inlet", request=body, context={"route": "chat.completions"}):
        if isinstance(changed, dict):
            body = changed
    messages = body["messages"]

    def render(engine: Any) -> list[int]:
        return engine.tokenize(engine.render_chat(messages), add_special=True, parse_special=True)

    entry, prompt, system_fingerprint = await _prepared(host, common.model, render, common, headers)
    ident = "chatcmpl-" + secrets.token_hex(12)
    created = int(time.time())
    shown = common.model if common.model not in (None, "", "localm") else entry.id
    outcome = pipeline.Outcome()

    if not common.stream:
        text = await _collect(host, entry.id, prompt, common, received, outcome)
        message = {"role": "assistant", "content": text}
        for _, changed in await host.run_hook("chat_outlet", response=message, context={"route": "chat.completions"}):
            if isinstance(changed, dict):
                message = changed
        return sdk.Response({"id": ident, "object": "chat.completion", "created": created, "model": shown,
                             "system_fingerprint": system_fingerprint,
                             "choices": [{"index": 0, "message": message, "logprobs": None,
                                          "finish_reason": outcome.finish_reason,
                                          "stop_sequence": outcome.stop_sequence}],
                             "usage": pipeline.usage(outcome)}, headers=headers)

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        choice.update(extra)
        return _event({"id": ident, "object": "chat.completion.chunk", "created": created, "model": shown,
                       "choices": [choice]})

    async def chunks() -> AsyncIterator[bytes]:
        yield chunk({"role": "assistant", "content": ""})
        try:
            async with host.models.use(entry.id) as resident:
                async for item in pipeline.run(resident.engine, prompt, common, received, outcome, host.metrics):
                    if isinstance(item, pipeline.Piece):
                        yield chunk({"content": item.text})
                    elif item.code == "waiting":
                        yield chunk({"status": item.text, "status_code": item.code})
        except sdk.LocalmError as exc:  # the stream is open: a refusal now travels in band
            outcome.finish_reason = "error"
            yield chunk({"content": f"\n[inference error: {pipeline.redact(exc.detail)}]"},
                        localm_error={"status": exc.status, "detail": exc.detail})
        last = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": shown,
                "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": outcome.finish_reason,
                             "stop_sequence": outcome.stop_sequence}]}
        for event in _ending(last, pipeline.usage(outcome), common.include_usage):
            yield event

    return _stream(chunks(), headers)


# --- text completions ------------------------------------------------------------------

@sdk.post("/v1/completions", scope=None, access="inference", error_family="openai",
          summary="OpenAI text completions")
async def completions(request: sdk.Request) -> Any:
    received = time.perf_counter()
    host = sdk.host_of(request)
    r = Reader(await _body(request))
    common = read_common(r)
    prompt_text = r.body.get("prompt")
    if isinstance(prompt_text, list) and len(prompt_text) == 1 and isinstance(prompt_text[0], str):
        prompt_text = prompt_text[0]
    if isinstance(prompt_text, list):
        raise sdk.LocalmError(400, "prompt must be one string (a list of one string is accepted)")
    if not isinstance(prompt_text, str):
        r.errors.append({"key": "prompt", "message": "must be a string"})
    echo = r.get("echo", (bool,), "true or false", False)
    r.done()
    headers = fields.check("completions", r.body, request.headers)
    entry, prompt, system_fingerprint = await _prepared(
        host, common.model, lambda e: e.tokenize(prompt_text, add_special=True), common, headers)
    ident = "cmpl-" + secrets.token_hex(12)
    created = int(time.time())
    shown = common.model if common.model not in (None, "", "localm") else entry.id
    outcome = pipeline.Outcome()

    if not common.stream:
        text = await _collect(host, entry.id, prompt, common, received, outcome)
        return sdk.Response({"id": ident, "object": "text_completion", "created": created, "model": shown,
                             "system_fingerprint": system_fingerprint,
                             "choices": [{"index": 0, "text": (prompt_text + text) if echo else text,
                                          "logprobs": None, "finish_reason": outcome.finish_reason,
                                          "stop_sequence": outcome.stop_sequence}],
                             "usage": pipeline.usage(outcome, timings=False, capacity=False)}, headers=headers)

    def chunk(text: str, finish: str | None = None, **extra: Any) -> bytes:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, **extra}
        return _event({"id": ident, "object": "text_completion", "created": created, "model": shown,
                       "choices": [choice]})

    async def chunks() -> AsyncIterator[bytes]:
        if echo:
            yield chunk(prompt_text)
        try:
            async with host.models.use(entry.id) as resident:
                async for item in pipeline.run(resident.engine, prompt, common, received, outcome, host.metrics):
                    if isinstance(item, pipeline.Piece):
                        yield chunk(item.text)
        except sdk.LocalmError as exc:
            outcome.finish_reason = "error"
            yield chunk(f"\n[inference error: {pipeline.redact(exc.detail)}]",
                        localm_error={"status": exc.status, "detail": exc.detail})
        last = {"id": ident, "object": "text_completion", "created": created, "model": shown,
                "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": outcome.finish_reason,
                             "stop_sequence": outcome.stop_sequence}]}
        for event in _ending(last, pipeline.usage(outcome, timings=True, capacity=False), common.include_usage):
            yield event

    return _stream(chunks(), headers)


# --- embeddings --------------------------------------------------------------------------

@sdk.post("/v1/embeddings", scope=None, access="inference", error_family="openai", summary="OpenAI embeddings")
async def embeddings(request: sdk.Request) -> sdk.Response:
    host = sdk.host_of(request)
    r = Reader(await _body(request))
    model = r.get("model", (str,), "a string")
    fmt = r.get("encoding_format", (str,), "a string", "float")
    texts = r.body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        r.errors.append({"key": "input", "message": "must be a string or a non-empty list of strings"})
    r.done()
    headers = fields.check("embeddings", r.body, request.headers)
    if fmt not in ("float", "base64"):
        raise sdk.LocalmError(400, "encoding_format must be float or base64")
    entry = host.models.resolve(model)
    async with host.models.use(entry.id) as resident:
        vectors = await resident.engine.embed(texts)
        tokens = sum(len(resident.engine.tokenize(t)) for t in texts)

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
                                      "param": None, "code": code}}
    return sdk.Response(body, status_code=status)


@sdk.hookimpl
def startup(host, plugin):
    host.register_error_renderer("openai", openai_error, plugin=plugin.name)


@sdk.hookimpl
def register_routes(register):
    register(chat_completions, completions, embeddings)
