"""Pipes as models: what ``pipe()`` returns, turned into reply text on every chat API.

A Pipe's ``pipes`` (a list, or a sync or async method returning one) names its models,
``<function id>.<sub id>``; without ``pipes`` the Function is one model named by its id.
They are provided to the model registry while the Function's plugin is active and answered
by :class:`PipeEngine`, an engine that takes whole chat requests: ``pipe(body)`` gets the
OpenAI body as the inlet hooks left it, with ``model`` the full model id, and may return a
string, a dict (a ``chat.completion`` or a chunk), a pydantic model, a sync or async
generator of those (or of SSE ``data:`` lines, or NDJSON), or a streaming response with a
``body_iterator`` (a proxy forwarding an upstream's server-sent events).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from typing import Any, AsyncIterator

from localm.sdk import engines as spec

_DONE = object()


class PipeFailed(Exception):
    """A Pipe answered with an error object (``{"error": ...}``)."""


def _dict_text(data: dict[str, Any]) -> str:
    """The reply text a dict carries: a chat.completion's message, a chunk's delta, Ollama's
    message or response. An ``error`` object raises PipeFailed."""
    if "error" in data and not data.get("choices"):
        error = data["error"]
        detail = error.get("detail") or error.get("message") if isinstance(error, dict) else error
        raise PipeFailed(str(detail or error))
    choices = data.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        first = choices[0]
        for key in ("delta", "message"):
            part = first.get(key)
            if isinstance(part, dict) and isinstance(part.get("content"), str):
                return part["content"]
        return first.get("text") if isinstance(first.get("text"), str) else ""
    message = data.get("message")
    if isinstance(message, dict) and isinstance(message.get("content"), str):
        return message["content"]
    if isinstance(data.get("response"), str):
        return data["response"]
    if isinstance(data.get("content"), str):
        return data["content"]
    return ""


def _line_text(line: str) -> str | None:
    """A line a Pipe yielded: an SSE ``data:`` line or an NDJSON object is read for its text;
    ``[DONE]`` and blank lines say nothing; any other text is reply text itself."""
    stripped = line.strip()
    if not stripped:
        return None
    if stripped.startswith("data:"):
        payload = stripped[5:].strip()
        if payload in ("", "[DONE]"):
            return None
        try:
            data = json.loads(payload)
        except ValueError:
            return payload
        return _dict_text(data) if isinstance(data, dict) else str(data)
    if stripped.startswith(("event:", "id:", "retry:", ":")) and "\n" not in stripped:
        return None
    if stripped.startswith("{") and stripped.endswith("}"):
        try:
            data = json.loads(stripped)
        except ValueError:
            return line
        if isinstance(data, dict) and ({"choices", "message", "response", "error"} & set(data)):
            return _dict_text(data)
    return line


def item_text(item: Any) -> str | None:
    """One item of a Pipe's output as reply text (None: nothing to say)."""
    if item is None:
        return None
    if hasattr(item, "model_dump") and callable(item.model_dump):
        item = item.model_dump()
    if isinstance(item, (bytes, bytearray)):
        item = bytes(item).decode("utf-8", errors="replace")
    if isinstance(item, dict):
        return _dict_text(item) or None
    if isinstance(item, str):
        if item.startswith("data:"):  # one or more server-sent events
            parts = [t for t in (_line_text(line) for line in item.split("\n")) if t]
            return "".join(parts) or None
        if item.startswith("{") and item.rstrip().endswith("}"):
            return _line_text(item)
        return item or None
    return str(item)


async def _sync_items(iterator: Any) -> AsyncIterator[Any]:
    """A sync iterator's items, each one pulled in a worker thread."""
    try:
        while True:
            item = await asyncio.to_thread(next, iterator, _DONE)
            if item is _DONE:
                return
            yield item
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            await asyncio.to_thread(close)


async def _stream_lines(body: Any) -> AsyncIterator[str]:
    """The lines of a streaming response's body (bytes or text chunks, split on newlines)."""
    buffer = ""
    iterator = body.__aiter__() if hasattr(body, "__aiter__") else _sync_items(iter(body))
    async for chunk in iterator:
        buffer += chunk.decode("utf-8", errors="replace") if isinstance(chunk, (bytes, bytearray)) else str(chunk)
        *lines, buffer = buffer.split("\n")
        for line in lines:
            yield line
    if buffer:
        yield buffer


async def texts(result: Any) -> AsyncIterator[str]:
    """The reply text of whatever ``pipe()`` returned, piece by piece."""
    if result is None:
        return
    if hasattr(result, "body_iterator"):  # a StreamingResponse forwarding an upstream's events
        async for line in _stream_lines(result.body_iterator):
            text = _line_text(line)
            if text:
                yield text
        return
    if isinstance(result, (str, bytes, bytearray, dict)) or hasattr(result, "model_dump"):
        text = item_text(result)
        if text:
            yield text
        return
    if hasattr(result, "__aiter__"):
        iterator = result.__aiter__()
        try:
            async for item in iterator:
                text = item_text(item)
                if text:
                    yield text
        finally:
            close = getattr(iterator, "aclose", None)
            if close is not None:
                await close()
        return
    if hasattr(result, "__iter__"):
        async for item in _sync_items(iter(result)):
            text = item_text(item)
            if text:
                yield text
        return
    yield str(result)


class PipeEngine:
    """One Pipe model: an engine that answers whole chat requests by calling ``pipe()``."""

    engine = "openwebui"

    def __init__(self, runtime: Any, plugin: str, model: str) -> None:
        self._runtime = runtime
        self.plugin = plugin
        self.model = model
        self.capabilities = spec.Capabilities(context_window=0, messages=True)
        self._busy = 0

    @property
    def busy(self) -> int:
        return self._busy

    def _refuse(self, what: str) -> Any:
        from localm import sdk
        raise sdk.LocalmError(400, f"{self.model} is an Open WebUI Pipe: it answers chats, and has no {what}",
                              code="not_supported")

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        self._refuse("tokenizer")

    def detokenize(self, ids: Any) -> str:
        self._refuse("tokenizer")

    def render_chat(self, messages: list[dict], **_: Any) -> str:
        self._refuse("chat template")

    def token_bytes(self, token: int) -> bytes:
        self._refuse("tokenizer")

    def check_constraint(self, constraint: Any) -> None:
        self._refuse("grammar")

    async def embed(self, texts: list[str]) -> list[list[float]]:
        from localm import sdk
        raise sdk.LocalmError(422, f"{self.model} is an Open WebUI Pipe: it embeds nothing",
                              code="not_an_embedding_model")

    async def next_token_logprobs(self, prompt: Any) -> list[float]:
        self._refuse("token probabilities")

    async def next_token_logits(self, prompt: Any) -> Any:
        self._refuse("token probabilities")

    async def generate(self, request: spec.GenerateRequest) -> AsyncIterator[spec.Event]:
        self._busy += 1
        started = time.perf_counter()
        n = 0
        try:
            yield spec.Started(prompt_tokens=0)
            try:
                async for text in self._runtime.run_pipe(self.plugin, self.model, request.chat):
                    n += 1
                    yield spec.Token(id=-1, text=text)
            except Exception as exc:  # the Pipe's own failure: the reply says so, the server goes on
                from .calls import refusal_text
                yield spec.Finished(reason="error", prompt_tokens=0, completion_tokens=0,
                                    error=f"{self.model}: {refusal_text(exc)}")
                return
            yield spec.Finished(reason="stop", prompt_tokens=0, completion_tokens=0,
                                generate_seconds=time.perf_counter() - started)
        finally:
            self._busy -= 1

    def close(self) -> None:
        pass


def is_async_callable(fn: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(fn, "__func__", fn))
