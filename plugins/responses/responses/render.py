"""Rendering a generation as a Responses API object, whole or as server-sent events.

Output items, in the order the model wrote them: a reasoning item (the model's thinking,
whole, as one reasoning_text part; its summary stays empty), a message with one
output_text part, and a function_call item per tool call. A stream opens each item with
response.output_item.added and closes it with response.output_item.done; every event
carries a sequence_number counting from 0.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
from localm import sdk

from .request import Parsed

log = logging.getLogger("localm.plugin.responses")
ROUTE = "responses"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def logprob(entry: dict[str, Any]) -> dict[str, Any]:
    """A chat log-probability entry in the Responses shape."""
    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]}
    return {**one(entry), "top_logprobs": [one(t) for t in entry.get("top", ())]}


def usage(outcome: Any) -> dict[str, Any]:
    """OpenAI's Responses usage, and localm's ``speculation`` when a draft source was on."""
    out = {"input_tokens": outcome.prompt_tokens,
           "input_tokens_details": {"cached_tokens": getattr(outcome, "cached_tokens", 0), "cache_write_tokens": 0},
           "output_tokens": outcome.completion_tokens,
           "output_tokens_details": {"reasoning_tokens": 0},
           "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}
    if getattr(outcome, "speculation", None) is not None:
        out["speculation"] = outcome.speculation
    return out


def status_of(outcome: Any, failed: bool = False) -> str:
    if failed or outcome.finish_reason == "error":
        return "failed"
    return "incomplete" if outcome.finish_reason == "length" else "completed"


def error_marker(outcome: Any) -> str | None:
    """The text the chat path appends to a reply whose generation failed."""
    return f"\n[inference error: {outcome.error}]" if outcome.finish_reason == "error" and outcome.error else None


@attrs.define
class Reply:
    """One response being made: its id and what the response object echoes."""

    parsed: Parsed
    model: str
    response_id: str
    created_at: int

    def obj(self, status: str, output: list[dict[str, Any]], *, outcome: Any = None, store: bool | None = None,
            error: dict[str, Any] | None = None) -> dict[str, Any]:
        done = status in ("completed", "incomplete", "failed")
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "completed_at": int(time.time()) if status == "completed" else None,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model, "output": output,
            **self.parsed.echo,
            "store": self.parsed.store if store is None else store,
            "usage": usage(outcome) if done and outcome is not None else None,
        }


def _message(item_id: str, text: str, logprobs: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def _reasoning(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _call(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    fn = call["function"]
    arguments = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"])
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": fn["name"],
            "arguments": arguments, "status": status}


def assistant_turn(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The reply as the chat message a continuation sends back to the model."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message


async def whole(chat: Any, gen: Any, reply: Reply, keep: Callable[[dict[str, Any] | None, str], bool]
                ) -> dict[str, Any]:
    """A non-streamed request: the finished Response object."""
    got = await gen.reply()
    outcome = gen.outcome
    text = got.text
    marker = error_marker(outcome)
    if marker and text.endswith(marker):
        text = text[: -len(marker)]
    calls = got.calls
    reasoning = "".join(got.reasoning)
    status = status_of(outcome)
    logprobs: list[dict[str, Any]] = []
    if reply.parsed.logprobs:
        if got.rewritten:
            log.info("logprobs left out: a chat plugin rewrote the reply")
        else:
            logprobs = [logprob(e) for e in got.logprobs]
    item_status = "incomplete" if status != "completed" else "completed"
    output: list[dict[str, Any]] = []
    if reasoning:
        output.append(_reasoning(new_id("rs"), reasoning))
    if text or not calls:
        output.append(_message(new_id("msg"), text, logprobs, item_status))
    output.extend(_call(new_id("fc"), c, "completed") for c in calls)
    error = {"code": "server_error", "message": outcome.error} if status == "failed" else None
    stored = keep(assistant_turn(text, calls), status)
    return {**gen.extra, **reply.obj(status, output, outcome=outcome, store=stored, error=error)}


class _Events:
    """Output items opened and closed as the generation goes, as SSE bytes."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.text = ""  # its text (message or reasoning)
        self.logprobs: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    @property
    def index(self) -> int:
        return len(self.output) - 1

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[bytes]:
        self.output.append(item)
        self.open, self.text, self.logprobs = item, "", []
        out = [self.emit("response.output_item.added", output_index=self.index, item=item)]
        if part is not None:
            out.append(self.emit("response.content_part.added", item_id=item["id"], output_index=self.index,
                                 content_index=0, part=part))
        return out

    def message(self) -> list[bytes]:
        """Open a message item unless one is open."""
        if self.open is not None and self.open["type"] == "message":
            return []
        out = self.close("completed")
        out += self._start({"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                            "content": []},
                           {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        return out

    def text_delta(self, text: str, logprobs: list[dict[str, Any]]) -> list[bytes]:
        out = self.message()
        self.text += text
        self.logprobs += logprobs
        out.append(self.emit("response.output_text.delta", item_id=self.open["id"], output_index=self.index,
                             content_index=0, delta=text, logprobs=logprobs))
        return out

    def reasoning_delta(self, text: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "reasoning":
            out += self.close("completed")
            out += self._start({"type": "reasoning", "id": new_id("rs"), "summary": [], "content": []},
                               {"type": "reasoning_text", "text": ""})
        self.text += text
        out.append(self.emit("response.reasoning_text.delta", item_id=self.open["id"], output_index=self.index,
                             content_index=0, delta=text))
        return out

    def call(self, call: dict[str, Any]) -> list[bytes]:
        out = self.close("completed")
        done = _call(new_id("fc"), call, "completed")
        out += self._start({**done, "arguments": "", "status": "in_progress"}, None)
        at = {"item_id": done["id"], "output_index": self.index}
        out.append(self.emit("response.function_call_arguments.delta", **at, delta=done["arguments"]))
        out.append(self.emit("response.function_call_arguments.done", **at, name=done["name"],
                             arguments=done["arguments"]))
        self.output[self.index] = done
        out.append(self.emit("response.output_item.done", output_index=self.index, item=done))
        self.open = None
        return out

    def close(self, status: str) -> list[bytes]:
        """Close the open message or reasoning item (a function call closes itself)."""
        item = self.open
        if item is None:
            return []
        self.open = None
        at = {"item_id": item["id"], "output_index": self.index, "content_index": 0}
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}
            done = _message(item["id"], self.text, self.logprobs, status)
            out = [self.emit("response.output_text.done", **at, text=self.text, logprobs=self.logprobs)]
        else:
            part = {"type": "reasoning_text", "text": self.text}
            done = _reasoning(item["id"], self.text)
            out = [self.emit("response.reasoning_text.done", **at, text=self.text)]
        out.append(self.emit("response.content_part.done", **at, part=part))
        self.output[self.index] = done
        out.append(self.emit("response.output_item.done", output_index=self.index, item=done))
        return out


async def events(chat: Any, gen: Any, reply: Reply, keep: Callable[[dict[str, Any] | None, str], bool]
                 ) -> AsyncIterator[bytes]:
    """A streamed request: response.created ... response.completed (or .incomplete, .failed)."""
    s = _Events()
    outcome = gen.outcome
    yield s.emit("response.created", response=reply.obj("in_progress", []))
    yield s.emit("response.in_progress", response=reply.obj("in_progress", []))
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    failure: str | None = None
    try:
        async for item in gen.items():
            if isinstance(item, chat.Piece):
                if outcome.finish_reason == "error":
                    continue  # the chat path's in-text error note: the error goes in response.failed
                text.append(item.text)
                logprobs = [logprob(e) for e in item.logprobs] if reply.parsed.logprobs else []
                for chunk in s.text_delta(item.text, logprobs):
                    yield chunk
            elif isinstance(item, chat.Reasoning):
                for chunk in s.reasoning_delta(item.text):
                    yield chunk
            elif isinstance(item, chat.Call):
                calls.append(item.call)
                for chunk in s.call(item.call):
                    yield chunk
    except sdk.LocalmError as exc:  # the stream is open: the refusal travels in response.failed
        failure = chat.redact(exc.detail)
    except Exception:
        log.exception("POST /v1/responses: the generation failed")
        failure = "Internal server error"
    if failure is None and outcome.finish_reason == "error":
        failure = outcome.error or "generation failed"
    status = status_of(outcome, failed=failure is not None)
    item_status = "incomplete" if status != "completed" else "completed"
    for chunk in s.close(item_status):
        yield chunk
    if not s.output and status != "failed":  # an empty reply is still one message
        for chunk in s.message() + s.close(item_status):
            yield chunk
    said = "".join(text)
    stored = keep(assistant_turn("" if calls and not said.strip() else said, calls), status)
    error = {"code": "server_error", "message": failure} if failure is not None else None
    final = {**gen.extra, **reply.obj(status, s.output, outcome=outcome, store=stored, error=error)}
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
    yield s.emit(kind, response=final)
