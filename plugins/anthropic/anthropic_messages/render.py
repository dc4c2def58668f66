"""The chat service's generation, rendered as an Anthropic message or its server-sent events."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from localm import sdk

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
#: Anthropic's error type for each status; every other 4xx is invalid_request_error, the rest api_error.
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_use_id(call: dict[str, Any]) -> str:
    ident = call.get("id") or ""
    return "toolu_" + (ident[5:] if ident.startswith("call_") else ident or secrets.token_hex(12))


def tool_input(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call["function"].get("arguments") or "{}"
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {}


def stop_reason(outcome: Any) -> str:
    if outcome.finish_reason in STOP_REASONS:
        return STOP_REASONS[outcome.finish_reason]
    return "stop_sequence" if outcome.stop_sequence is not None else "end_turn"


def usage(outcome: Any) -> dict[str, Any]:
    """Anthropic's usage, and localm's ``speculation`` when a draft source was on."""
    out: dict[str, Any] = {"input_tokens": outcome.prompt_tokens, "output_tokens": outcome.completion_tokens}
    if getattr(outcome, "speculation", None) is not None:
        out["speculation"] = outcome.speculation
    return out


def message(ident: str, model: str, text: str, reasoning: str, calls: list[dict[str, Any]],
            outcome: Any) -> dict[str, Any]:
    """A whole reply: a thinking block (when the model thought), its text (left out when it is
    empty and the model called tools) and a tool_use block per call."""
    content: list[dict[str, Any]] = []
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text.strip() or not calls:
        content.append({"type": "text", "text": text})
    content += [{"type": "tool_use", "id": tool_use_id(c), "name": c["function"]["name"], "input": tool_input(c)}
                for c in calls]
    return {"id": ident, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(outcome), "stop_sequence": outcome.stop_sequence, "usage": usage(outcome)}


def event(kind: str, data: dict[str, Any]) -> bytes:
    text = json.dumps({"type": kind, **data}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {text}\n\n".encode()


async def events(gen: Any, chat: Any, ident: str) -> AsyncIterator[bytes]:
    """Anthropic's stream: message_start, ping, each block's start, deltas and stop,
    message_delta (stop reason and usage), message_stop; an error event ends a failed one.

    ``chat`` tells the items apart (``chat.Piece``, ``chat.Reasoning``, ``chat.Call``,
    ``chat.Status``) and redacts error texts.
    """
    outcome = gen.outcome
    yield event("message_start", {"message": {
        "id": ident, "type": "message", "role": "assistant", "model": gen.model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}})
    yield event("ping", {})
    index = -1
    open_kind: str | None = None

    def close() -> list[bytes]:
        nonlocal open_kind
        out = []
        if open_kind == "thinking":
            out.append(event("content_block_delta", {"index": index,
                                                     "delta": {"type": "signature_delta", "signature": ""}}))
        if open_kind is not None:
            out.append(event("content_block_stop", {"index": index}))
        open_kind = None
        return out

    def start(kind: str, block: dict[str, Any]) -> list[bytes]:
        nonlocal index, open_kind
        out = close()
        index += 1
        open_kind = kind
        out.append(event("content_block_start", {"index": index, "content_block": block}))
        return out

    def delta(body: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": index, "delta": body})

    try:
        async for item in gen.items():
            if isinstance(item, chat.Piece):
                if not item.text or outcome.finish_reason == "error":  # an engine failure is told below
                    continue
                if open_kind != "text":
                    for chunk in start("text", {"type": "text", "text": ""}):
                        yield chunk
                yield delta({"type": "text_delta", "text": item.text})
            elif isinstance(item, chat.Reasoning):
                if not item.text:
                    continue
                if open_kind != "thinking":
                    for chunk in start("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield chunk
                yield delta({"type": "thinking_delta", "thinking": item.text})
            elif isinstance(item, chat.Call):
                call = item.call
                block = {"type": "tool_use", "id": tool_use_id(call), "name": call["function"]["name"], "input": {}}
                for chunk in start("tool_use", block):
                    yield chunk
                whole = json.dumps(tool_input(call), separators=(",", ":"), ensure_ascii=False)
                yield delta({"type": "input_json_delta", "partial_json": whole})
                for chunk in close():
                    yield chunk
            elif isinstance(item, chat.Status) and item.code in ("waiting", "loading_model"):
                yield event("ping", {})  # Anthropic's events have no status: a ping while nothing else comes
    except sdk.LocalmError as exc:  # the stream is open: the refusal ends it in band
        yield event("error", {"error": {"type": error_type(exc.status), "message": chat.redact(exc.detail)}})
        return
    if outcome.finish_reason == "error":
        yield event("error", {"error": {"type": "api_error", "message": outcome.error or "Generation failed"}})
        return
    if index < 0 and not outcome.calls:  # an empty reply is one empty text block, as unstreamed
        for chunk in start("text", {"type": "text", "text": ""}):
            yield chunk
    for chunk in close():
        yield chunk
    # the fields chat plugins added to the response ride on the last message_delta
    added = {key: value for key, value in gen.extra.items() if key != "type"}
    delta = {"stop_reason": stop_reason(outcome), "stop_sequence": outcome.stop_sequence}
    yield event("message_delta", {**added, "delta": delta, "usage": usage(outcome)})
    yield event("message_stop", {})
