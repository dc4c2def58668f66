"""The chat plugin: POST /v1/chat/completions, /v1/completions and /v1/embeddings.

It parses OpenAI requests, runs the chat pipeline (inlet hooks, template, the engine,
stop sequences, outlet hooks) and renders OpenAI responses and server-sent events.
Other surfaces reach the same pipeline through the ``chat`` host service.
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

import attrs
from localm import sdk

from . import constrained, fields, pipeline, scoring
from .prompt import chat_tokens
from .request import Reader, read_common, read_messages, read_options

log = logging.getLogger("localm.plugin.chat")

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


async def _prepared(host: Any, name: str | None, render: Any, common: Any, headers: dict[str, str],
                    options: Any = None) -> tuple[Any, list[int], str, pipeline.Plan]:
    """Load the model, tokenize the prompt and check the constraint: every refusal here is an
    HTTP status.

    ``render(engine)`` returns the prompt's tokens and whether the reply starts inside a
    reasoning block. Returns the entry, the prompt's tokens, the system_fingerprint and the
    generation plan; adds the seed echo and the constraint label to ``headers``.
    """
    entry = host.models.resolve(name)
    plan = pipeline.Plan()
    async with host.models.use(entry.id) as resident:
        engine = resident.engine
        caps = engine.capabilities
        if options is not None:
            constraint = options.constraint()
            if constraint is not None:
                if not caps.grammar:
                    raise sdk.LocalmError(400, f"The {engine.engine} engine cannot constrain output",
                                          code="response_format_unsupported")
                engine.check_constraint(constraint)
            if options.logprobs is not None and not caps.logprobs:
                raise sdk.LocalmError(400, f"The {engine.engine} engine does not report log probabilities",
                                      code="field_not_honoured", field="logprobs")
            plan = pipeline.Plan(constraint=constraint, logprobs=options.logprobs, tools=options.tools,
                                 reasoning=caps.reasoning and options.thinking is not False)
        prompt, opened = render(engine)
        plan = attrs.evolve(plan, thinking_open=opened)
        pipeline.check_fits(len(prompt), caps.context_window)
    seed = common.sampling.seed
    if seed is not None:
        # the promise: the same seed and body repeat the reply, unless a reused prompt cache
        # can change the numbers on this engine
        scope = "request" if caps.cache_exact or not common.cache_prompt else "best-effort"
        headers.update({name: f'{seed};scope="{scope}"' for name in ("X-Localm-Seed", "X-miLLM-Seed")})
    if options is not None and (options.fmt is not None or options.grammar is not None):
        label = options.fmt.label if options.fmt is not None else "grammar"
        headers.update({"X-Localm-Constrained": label, "X-miLLM-Constrained": label})
    return entry, prompt, fingerprint(entry, engine), plan


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


@attrs.define
class Reply:
    """A whole reply, for a non-streaming request."""
    content: list[str] = attrs.Factory(list)
    reasoning: list[str] = attrs.Factory(list)
    logprobs: list[dict[str, Any]] = attrs.Factory(list)

    @property
    def text(self) -> str:
        return "".join(self.content)


async def _collect(host: Any, model: str, prompt: list[int], common: Any, received: float,
                   outcome: pipeline.Outcome, plan: pipeline.Plan) -> Reply:
    reply = Reply()
    async with host.models.use(model) as resident:
        async for item in pipeline.run(resident.engine, prompt, common, received, outcome, host.metrics, plan):
            if isinstance(item, pipeline.Piece):
                reply.content.append(item.text)
                reply.logprobs.extend(item.logprobs)
            elif isinstance(item, pipeline.Reasoning):
                reply.reasoning.append(item.text)
    return reply


def _validated(options: Any, outcome: pipeline.Outcome, text: str) -> None:
    """A constrained document the model ended itself must parse and validate (500 otherwise)."""
    if options.fmt is not None and outcome.ended_by_model and not outcome.calls:
        constrained.validate_output(text, options.fmt)


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
          summary="OpenAI chat completions")
async def chat_completions(request: sdk.Request) -> Any:
    received = time.perf_counter()
    host = sdk.host_of(request)
    body = await _body(request)
    if scoring.wanted(body):
        return await scoring.serve(request, "chat", body)
    r = Reader(body)
    common = read_common(r)
    messages = read_messages(r)
    options = read_options(r, "chat")
    r.done()
    headers = fields.check("chat", r.body, request.headers)
    hooked = {"messages": messages, "model": common.model}
    for _, changed in await host.run_hook("chat_inlet", request=hooked, context={"route": "chat.completions"}):
        if isinstance(changed, dict):
            hooked = changed
    messages = hooked["messages"]

    def render(engine: Any) -> tuple[list[int], bool]:
        return chat_tokens(engine, messages, tools=options.tools, thinking=options.thinking)

    entry, prompt, system_fingerprint, plan = await _prepared(host, common.model, render, common, headers, options)
    ident = "chatcmpl-" + secrets.token_hex(12)
    created = int(time.time())
    shown = common.model if common.model not in (None, "", "localm") else entry.id
    outcome = pipeline.Outcome()

    if not common.stream:
        reply = await _collect(host, entry.id, prompt, common, received, outcome, plan)
        _validated(options, outcome, reply.text)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": None if outcome.calls and not reply.text.strip() else reply.text}
        if reply.reasoning:
            message["reasoning_content"] = "".join(reply.reasoning)
        if outcome.calls:
            message["tool_calls"] = outcome.calls
        before = dict(message)
        for _, changed in await host.run_hook("chat_outlet", response=message, context={"route": "chat.completions"}):
            if isinstance(changed, dict):
                message = changed
        logprobs = None
        if options.logprobs is not None:
            if message != before:
                log.info("logprobs left out: a chat plugin rewrote the reply")
            else:
                logprobs = {"content": [_chat_logprob(e, options.token_ids) for e in reply.logprobs],
                            "refusal": None}
        return sdk.Response({"id": ident, "object": "chat.completion", "created": created, "model": shown,
                             "system_fingerprint": system_fingerprint,
                             "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                                          "finish_reason": outcome.finish_reason,
                                          "stop_sequence": outcome.stop_sequence}],
                             "usage": pipeline.usage(outcome)}, headers=headers)

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None, **extra: Any) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        choice.update(extra)
        return _event({"id": ident, "object": "chat.completion.chunk", "created": created, "model": shown,
                       "choices": [choice]})

    async def chunks() -> AsyncIterator[bytes]:
        yield chunk({"role": "assistant", "content": ""})
        content: list[str] = []
        try:
            async with host.models.use(entry.id) as resident:
                async for item in pipeline.run(resident.engine, prompt, common, received, outcome, host.metrics,
                                               plan):
                    if isinstance(item, pipeline.Piece):
                        content.append(item.text)
                        logprobs = None
                        if options.logprobs is not None:
                            logprobs = {"content": [_chat_logprob(e, options.token_ids) for e in item.logprobs]}
                        yield chunk({"content": item.text}, logprobs=logprobs)
                    elif isinstance(item, pipeline.Reasoning):
                        yield chunk({"reasoning_content": item.text})
                    elif isinstance(item, pipeline.Call):
                        index = outcome.calls.index(item.call)
                        yield chunk({"tool_calls": [{"index": index, **item.call}]})
                    elif item.code == "waiting":
                        yield chunk({"status": item.text, "status_code": item.code})
            _validated(options, outcome, "".join(content))
        except sdk.LocalmError as exc:  # the stream is open: a refusal now travels in band
            outcome.finish_reason = "error"
            yield chunk({"content": f"\n[inference error: {pipeline.redact(exc.detail)}]"},
                        localm_error={"status": exc.status, "detail": exc.detail, "code": exc.code})
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
    body = await _body(request)
    if scoring.wanted(body):
        return await scoring.serve(request, "completions", body)
    r = Reader(body)
    common = read_common(r)
    prompt_text = r.body.get("prompt")
    if isinstance(prompt_text, list) and len(prompt_text) == 1 and isinstance(prompt_text[0], str):
        prompt_text = prompt_text[0]
    if isinstance(prompt_text, list):
        raise sdk.LocalmError(400, "prompt must be one string (a list of one string is accepted)")
    if not isinstance(prompt_text, str):
        r.errors.append({"key": "prompt", "message": "must be a string"})
    echo = r.get("echo", (bool,), "true or false", False)
    options = read_options(r, "completions")
    r.done()
    headers = fields.check("completions", r.body, request.headers)

    def render(engine: Any) -> tuple[list[int], bool]:
        return engine.tokenize(prompt_text, add_special=options.add_special), False

    entry, prompt, system_fingerprint, plan = await _prepared(host, common.model, render, common, headers, options)
    ident = "cmpl-" + secrets.token_hex(12)
    created = int(time.time())
    shown = common.model if common.model not in (None, "", "localm") else entry.id
    outcome = pipeline.Outcome()
    offset = len(prompt_text)

    if not common.stream:
        reply = await _collect(host, entry.id, prompt, common, received, outcome, plan)
        text = reply.text
        logprobs = None if options.logprobs is None else _text_logprobs(reply.logprobs, offset, options.token_ids)
        return sdk.Response({"id": ident, "object": "text_completion", "created": created, "model": shown,
                             "system_fingerprint": system_fingerprint,
                             "choices": [{"index": 0, "text": (prompt_text + text) if echo else text,
                                          "logprobs": logprobs, "finish_reason": outcome.finish_reason,
                                          "stop_sequence": outcome.stop_sequence}],
                             "usage": pipeline.usage(outcome, timings=False, capacity=False)}, headers=headers)

    def chunk(text: str, finish: str | None = None, logprobs: Any = None, **extra: Any) -> bytes:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish, **extra}
        return _event({"id": ident, "object": "text_completion", "created": created, "model": shown,
                       "choices": [choice]})

    async def chunks() -> AsyncIterator[bytes]:
        if echo:
            yield chunk(prompt_text)
        try:
            async with host.models.use(entry.id) as resident:
                async for item in pipeline.run(resident.engine, prompt, common, received, outcome, host.metrics,
                                               plan):
                    if isinstance(item, pipeline.Piece):
                        logprobs = None
                        if options.logprobs is not None:
                            logprobs = _text_logprobs(list(item.logprobs), offset, options.token_ids)
                        yield chunk(item.text, logprobs=logprobs)
        except sdk.LocalmError as exc:
            outcome.finish_reason = "error"
            yield chunk(f"\n[inference error: {pipeline.redact(exc.detail)}]",
                        localm_error={"status": exc.status, "detail": exc.detail, "code": exc.code})
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
