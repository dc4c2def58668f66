"""Remote models: an engine that answers chats by asking another OpenAI-compatible server.

A model registered with ``localm pull openai+http://host:port/v1#model`` (vLLM, SGLang,
llama.cpp's llama-server, llama-cpp-python's server, any OpenAI-compatible endpoint) is served
by :class:`RemoteEngine`: an engine whose capabilities say ``messages``, so it gets each chat
request whole (the OpenAI body after the chat inlet hooks) and streams the upstream's
``/v1/chat/completions`` (``/v1/completions`` for a text prompt) back as token events.

- Generations go upstream through the plugin's own HTTP/1.1 client (:mod:`.wire`; httpx where a
  proxy stands between, and for everything else the engine asks an upstream).
- Many requests run at once: there is no queue of one; at most ``concurrency`` requests are in
  flight to one upstream (the rest wait in line, told so with Queued).
- A client that goes away closes the upstream stream.
- Sampling fields, seed, stop, logprobs/top_logprobs, response_format and tools go to the upstream
  as the client wrote them (``response_format`` in the upstream's own form). What the kind of
  upstream does not honour is refused with 400 ``field_not_honoured``, never dropped.
- Upstream failures: connection refused is 502 (naming the upstream, never its key), no answer in
  time 504, the upstream's own 4xx passes through with its message (a prompt too long for the
  upstream's window is 413 ``context_length_exceeded``); a failure mid-stream ends the reply
  in-band.
- Tokenising (token counts) uses the upstream's tokenize endpoint where it has one
  (llama-server ``/tokenize``, llama-cpp-python ``/extras/tokenize``, vLLM and SGLang
  ``/tokenize``), else an estimate of 4 characters a token (``RemoteEngine.estimated``). A
  whole chat request is counted as the upstream templates it (``count_request``: what
  Anthropic's count_tokens answers).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, AsyncIterator

import attrs
import httpx

from localm import sdk
from localm.sdk import engines as spec

from . import wire

log = logging.getLogger("localm.plugin.remote")

#: What each kind of upstream honours, beyond plain chat. ``json_schema``: response_format
#: json_schema (llama-cpp-python as its json_object-with-schema form); ``tokenize``: an endpoint
#: that counts tokens.
HONOURS: dict[str, frozenset[str]] = {
    "llama-server": frozenset({"logprobs", "json_schema", "json_object", "tools", "seed", "embeddings", "tokenize",
                               "usage"}),
    "llama-cpp-python": frozenset({"logprobs", "json_schema", "json_object", "seed", "embeddings", "tokenize"}),
    "vllm": frozenset({"logprobs", "json_schema", "json_object", "tools", "seed", "embeddings", "tokenize", "usage"}),
    "sglang": frozenset({"logprobs", "json_schema", "json_object", "tools", "seed", "embeddings", "tokenize",
                         "usage"}),
    "openai": frozenset({"logprobs", "json_schema", "json_object", "tools", "seed", "embeddings", "usage"}),
    # another localm instance on this machine (a peer route: peers.py)
    "localm": frozenset({"logprobs", "json_schema", "json_object", "tools", "seed", "embeddings", "usage"}),
}

#: The request fields that go to the upstream as the client wrote them.
FORWARDED = ("messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
             "seed", "stop", "presence_penalty", "frequency_penalty", "repeat_penalty", "repetition_penalty",
             "logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls",
             "logit_bias", "user", "n", "suffix", "echo")

#: Synthetic token ids (for an upstream that names none) start here.
_SYNTHETIC = 1 << 30


@attrs.frozen
class Settings:
    concurrency: int = sdk.setting(8, min=1, max=4096, description="Requests in flight at once to one upstream "
                                                                    "server; more wait in line")
    connect_timeout_s: float = sdk.setting(5.0, min=0.1, description="Seconds to wait for an upstream to accept "
                                                                      "a connection (then 502)")
    timeout_s: float = sdk.setting(300.0, min=1, description="Seconds an upstream may stay silent (before its "
                                                             "first token, or between two) before the request "
                                                             "fails (504)")


#: One line of turns per upstream base URL, shared by every model on it.
_TURNS: dict[str, spec.Turns] = {}


def _turns(base: str, capacity: int) -> spec.Turns:
    turns = _TURNS.get(base)
    if turns is None:
        turns = _TURNS[base] = spec.Turns(capacity)
    turns.capacity = max(1, int(capacity))
    return turns


def _root(base: str) -> str:
    return base[:-3] if base.endswith("/v1") else base


def _message_of(answer: httpx.Response) -> tuple[str, str | None]:
    """The upstream's error message and code/type, from its JSON body or text."""
    try:
        data = answer.json()
    except ValueError:
        return answer.text.strip()[:500] or answer.reason_phrase, None
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        message = error.get("message") or error.get("detail") or json.dumps(error)[:500]
        kind = error.get("type") or error.get("code")
        return str(message), str(kind) if kind is not None else None
    return str(error)[:500], None


class RemoteEngine:
    """A model another server runs (see the module's docstring)."""

    engine = "remote"

    def __init__(self, entry: Any, settings: dict[str, Any], key: str | None) -> None:
        caps = dict(entry.capabilities or {})
        self.id = entry.id
        self.base = caps.get("upstream") or entry.path
        self.model = caps.get("upstream_model") or entry.id
        self.kind = caps.get("upstream_kind") or "openai"
        self.honours = HONOURS.get(self.kind, HONOURS["openai"])
        window = caps.get("context_window")
        self.capabilities = spec.Capabilities(
            context_window=int(window) if isinstance(window, int) else 0, messages=True,
            logprobs="logprobs" in self.honours, tool_use="tools" in self.honours,
            embeddings="embeddings" in self.honours)
        self._key = key
        self._settings = settings
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        concurrency = int(settings.get("concurrency", 8))
        self._timeout = httpx.Timeout(float(settings.get("timeout_s", 300.0)),
                                      connect=float(settings.get("connect_timeout_s", 5.0)))
        self._client = httpx.AsyncClient(headers=headers, timeout=self._timeout,
                                         limits=httpx.Limits(max_connections=concurrency + 8,
                                                             max_keepalive_connections=concurrency + 8))
        self._sync_headers = headers
        #: The streamed generations' own client (httpx where a proxy stands between; see wire.py).
        self._wire = None if wire.proxied(self.base) else wire.Upstream(
            self.base, headers=headers, connect_timeout=float(settings.get("connect_timeout_s", 5.0)),
            timeout=float(settings.get("timeout_s", 300.0)))
        self._turns = _turns(self.base, concurrency)
        self._busy = 0
        self._ids: dict[bytes, int] = {}
        self._bytes: dict[int, bytes] = {}
        self._counted: dict[tuple[str, bool], list[int]] = {}
        #: True once a token count was estimated (the upstream has no tokenize endpoint, or it failed).
        self.estimated = False
        #: The tokenizer on this machine the entry names (``?tokenizer=`` when pulled), loaded on first use.
        self._tokenizer_path: str | None = caps.get("tokenizer")
        self._local: _LocalTokenizer | None = None

    # --- the engine protocol ----------------------------------------------------------------
    @property
    def busy(self) -> int:
        return self._busy

    def _refuse(self, what: str) -> Any:
        raise sdk.LocalmError(400, f"{self.id} is a remote model ({self.base}): it has no {what} here",
                              code="not_supported")

    def render_chat(self, messages: list[dict], **_: Any) -> str:
        self._refuse("chat template")

    def detokenize(self, ids: Any) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return self._bytes.get(token, b"")

    def check_constraint(self, constraint: Any) -> None:
        self._refuse("grammar engine (ask with response_format instead)")

    async def next_token_logprobs(self, prompt: Any) -> list[float]:
        self._refuse("next-token distribution")

    async def next_token_logits(self, prompt: Any) -> Any:
        self._refuse("next-token distribution")

    def close(self) -> None:
        if self._wire is not None:
            self._wire.close()
        client = self._client
        try:
            import asyncio
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            loop.create_task(client.aclose())

    # --- errors ----------------------------------------------------------------------------
    def _failure(self, exc: Exception) -> sdk.LocalmError:
        if isinstance(exc, wire.ConnectFailed):
            return sdk.LocalmError(502, f"{self.id}: cannot reach the upstream {self.base} ({_said(exc)})",
                                   code="upstream_unreachable")
        if isinstance(exc, wire.TimedOut):
            return sdk.LocalmError(504, f"{self.id}: the upstream {self.base} did not answer in time",
                                   code="upstream_timeout")
        if isinstance(exc, wire.UpstreamError):
            return sdk.LocalmError(502, f"{self.id}: the upstream {self.base} failed ({_said(exc)})",
                                   code="upstream_error")
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            said = "connection refused" if isinstance(exc, httpx.ConnectError) else "no connection in time"
            return sdk.LocalmError(502, f"{self.id}: cannot reach the upstream {self.base} ({said})",
                                   code="upstream_unreachable")
        if isinstance(exc, httpx.TimeoutException):
            return sdk.LocalmError(504, f"{self.id}: the upstream {self.base} did not answer in time",
                                   code="upstream_timeout")
        return sdk.LocalmError(502, f"{self.id}: the upstream {self.base} failed ({type(exc).__name__})",
                               code="upstream_error")

    def _refusal(self, answer: httpx.Response) -> sdk.LocalmError:
        message, kind = _message_of(answer)
        status = answer.status_code
        if self._key:
            message = message.replace(self._key, "[key]")
        low = message.lower()
        if status == 400 and ("exceed_context" in (kind or "") or "context length" in low
                              or "context size" in low or "context window" in low):
            return sdk.LocalmError(413, f"{self.id}: the prompt does not fit the upstream's window: {message}",
                                   code="context_length_exceeded")
        if status >= 500:
            return sdk.LocalmError(502, f"{self.id}: the upstream {self.base} failed ({status}): {message}",
                                   code="upstream_error")
        return sdk.LocalmError(status, f"{self.id}: the upstream {self.base} answered {status}: {message}",
                               code=kind if kind and kind.replace("_", "").isalnum() else "upstream_error")

    # --- generation --------------------------------------------------------------------------
    def _not_honoured(self, field: str, what: str) -> sdk.LocalmError:
        return sdk.LocalmError(400, f"{self.id}'s upstream ({self.kind}, {self.base}) does not honour {what}",
                               code="field_not_honoured", field=field)

    def body_for(self, request: spec.GenerateRequest) -> tuple[str, dict[str, Any]]:
        """The upstream route and body for a request; what the upstream cannot honour raises
        400 field_not_honoured."""
        if request.chat is None:
            raise sdk.LocalmError(400, f"{self.id} is a remote model: it answers whole chat requests")
        if request.interventions or request.reads:
            raise self._not_honoured("steering", "steering")
        asked = request.chat.body
        body: dict[str, Any] = {k: asked[k] for k in FORWARDED if asked.get(k) is not None}
        text = "prompt" in body and "messages" not in body
        logprobs = body.get("logprobs")
        if logprobs not in (None, False) and "logprobs" not in self.honours:
            raise self._not_honoured("logprobs", "logprobs")
        if body.get("seed") is not None and "seed" not in self.honours:
            raise self._not_honoured("seed", "seed")
        if body.get("tools") and "tools" not in self.honours:
            raise self._not_honoured("tools", "tools")
        fmt = body.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            kind = fmt.get("type")
            if kind not in ("json_schema", "json_object") or kind not in self.honours:
                raise self._not_honoured("response_format", f"response_format {kind}")
            if kind == "json_schema" and self.kind == "llama-cpp-python":
                schema = (fmt.get("json_schema") or {}).get("schema")
                body["response_format"] = {"type": "json_object", **({"schema": schema} if schema else {})}
        if not any(k in body for k in ("max_tokens", "max_completion_tokens")) and request.sampling.max_tokens:
            body["max_tokens"] = request.sampling.max_tokens
        body["model"] = self.model
        body["stream"] = True
        if "usage" in self.honours:
            body["stream_options"] = {"include_usage": True}
        return ("/completions" if text else "/chat/completions"), body

    def _token_id(self, entry: dict[str, Any]) -> int:
        raw = entry.get("bytes")
        data = bytes(raw) if isinstance(raw, list) else str(entry.get("token", "")).encode("utf-8")
        ident = entry.get("id")
        if not isinstance(ident, int) or isinstance(ident, bool):
            ident = self._ids.get(data)
            if ident is None:
                ident = self._ids[data] = _SYNTHETIC + len(self._ids)
        self._bytes.setdefault(ident, data)
        return ident

    def _tokens(self, text: str, choice: dict[str, Any]) -> list[spec.Token]:
        """The token events of one streamed piece of text (one per logprob entry when they spell it)."""
        lp = choice.get("logprobs")
        entries: list[dict[str, Any]] = []
        if isinstance(lp, dict):
            content = lp.get("content")
            if isinstance(content, list):
                entries = [e for e in content if isinstance(e, dict)]
            elif isinstance(lp.get("tokens"), list):  # /completions: parallel lists
                tops = lp.get("top_logprobs") or []
                for i, tok in enumerate(lp["tokens"]):
                    values = lp.get("token_logprobs") or []
                    top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
                    entries.append({"token": tok, "logprob": values[i] if i < len(values) else None,
                                    "top_logprobs": [{"token": t, "logprob": v} for t, v in top.items()]})
        if not entries:
            return [spec.Token(id=-1, text=text)] if text else []

        def one(entry: dict[str, Any], piece: str) -> spec.Token:
            value = entry.get("logprob")
            top = tuple((self._token_id(t), float(t.get("logprob", -9999.0)))
                        for t in entry.get("top_logprobs") or [] if isinstance(t, dict))
            return spec.Token(id=self._token_id(entry), text=piece,
                              logprob=float(value) if isinstance(value, (int, float)) else -9999.0, top=top)

        pieces = [str(e.get("token", "")) for e in entries]
        if "".join(pieces) == text:
            return [one(e, p) for e, p in zip(entries, pieces)]
        return [one(entries[0], text)] + [one(e, "") for e in entries[1:]]

    async def generate(self, request: spec.GenerateRequest) -> AsyncIterator[spec.Event]:
        route, body = self.body_for(request)
        self._busy += 1
        try:
            turns = self._turns
            if turns.held >= turns.capacity or turns.waiting:
                yield spec.Queued(ahead=turns.held + turns.waiting)
            async with turns(request.background):
                async for event in self._stream(route, body):
                    yield event
        finally:
            self._busy -= 1

    async def _stream(self, route: str, body: dict[str, Any]) -> AsyncIterator[spec.Event]:
        began = time.perf_counter()
        if self._wire is None:  # through a proxy: httpx
            async for event in self._stream_httpx(route, body, began):
                yield event
            return
        try:
            answer = await self._wire.post(route, json.dumps(body, ensure_ascii=False,
                                                              separators=(",", ":")).encode("utf-8"))
        except wire.UpstreamError as exc:
            raise self._failure(exc) from None
        try:
            if answer.status >= 400:
                try:
                    said = await answer.read()
                except wire.UpstreamError:
                    said = b""
                raise self._refusal(httpx.Response(answer.status, content=said, headers=answer.headers))
            async for event in self._events(answer.lines(), began, wire.UpstreamError):
                yield event
        finally:
            answer.release()  # read to its end: kept for the next; else closed (the upstream stops)

    async def _stream_httpx(self, route: str, body: dict[str, Any], began: float) -> AsyncIterator[spec.Event]:
        try:
            context = self._client.stream("POST", self.base + route, json=body)
            answer = await context.__aenter__()
        except httpx.HTTPError as exc:
            raise self._failure(exc) from None
        try:
            if answer.status_code >= 400:
                await answer.aread()
                raise self._refusal(answer)
            async for event in self._events(answer.aiter_lines(), began, httpx.HTTPError):
                yield event
        finally:
            await context.__aexit__(None, None, None)  # a client that left closes the upstream stream

    async def _events(self, lines: AsyncIterator[str], began: float,
                      failures: type[Exception]) -> AsyncIterator[spec.Event]:
        """The engine events of an upstream's event stream (``failures``: what the reader raises
        when the connection fails mid-answer, which ends the reply in-band)."""
        yield spec.Started(prompt_tokens=0)
        first = None
        counted = 0
        prompt_tokens = completion_tokens = 0
        finish = None
        calls: dict[int, dict[str, Any]] = {}
        try:
            async for line in lines:
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":  # read on to the body's end: an upstream that keeps the
                    continue            # connection open gets it back in the pool (llama-server closes it)
                try:
                    data = json.loads(payload)
                except ValueError:
                    continue
                if not isinstance(data, dict):
                    continue
                if "error" in data and not data.get("choices"):
                    message = _message_of_dict(data)
                    yield spec.Finished(reason="error", prompt_tokens=prompt_tokens, completion_tokens=counted,
                                        error=f"the upstream {self.base} failed: {message}")
                    return
                usage = data.get("usage")
                if isinstance(usage, dict):
                    prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    completion_tokens = int(usage.get("completion_tokens") or 0)
                for choice in data.get("choices") or []:
                    if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                        continue
                    delta = choice.get("delta")
                    if isinstance(delta, dict):
                        text = delta.get("content") or ""
                        for call in delta.get("tool_calls") or []:
                            at = calls.setdefault(int(call.get("index", len(calls))), {"name": "", "arguments": ""})
                            function = call.get("function") or {}
                            at["name"] += function.get("name") or ""
                            at["arguments"] += function.get("arguments") or ""
                    else:
                        text = choice.get("text") or ""
                    for token in self._tokens(text, choice):
                        counted += 1
                        if first is None:
                            first = time.perf_counter()
                        yield token
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
        except failures as exc:
            yield spec.Finished(reason="error", prompt_tokens=prompt_tokens, completion_tokens=counted,
                                error=f"the upstream {self.base} broke off the reply ({_said(exc)})")
            return
        for call in (calls[i] for i in sorted(calls)):
            try:
                arguments = json.loads(call["arguments"] or "{}")
            except ValueError:
                arguments = call["arguments"]
            yield spec.Token(id=-1, text="<tool_call>" + json.dumps({"name": call["name"], "arguments": arguments})
                             + "</tool_call>")
        if finish is None:
            yield spec.Finished(reason="error", prompt_tokens=prompt_tokens, completion_tokens=counted,
                                error=f"the upstream {self.base} ended the reply without finishing it")
            return
        now = time.perf_counter()
        yield spec.Finished(reason="length" if finish == "length" else "stop", prompt_tokens=prompt_tokens,
                            completion_tokens=completion_tokens or counted,
                            prompt_seconds=(first or now) - began, generate_seconds=now - (first or now))

    # --- tokens and embeddings -----------------------------------------------------------------
    def _tokenize_call(self, text: str, add_special: bool) -> tuple[str, dict[str, Any]] | None:
        root = _root(self.base)
        if "tokenize" not in self.honours:
            return None
        if self.kind == "llama-server":
            return f"{root}/tokenize", {"content": text, "add_special": add_special, "parse_special": True}
        if self.kind == "llama-cpp-python":
            return f"{root}/extras/tokenize", {"input": text, "model": self.model}
        return f"{root}/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": add_special}

    def _estimate(self, text: str, add_special: bool = True) -> list[int]:
        """The tokens of ``text`` by the local tokenizer the entry names, else the estimate."""
        local = self._local_tokenizer()
        if local is not None:
            return local.tokenize(text, add_special=add_special)
        self.estimated = True
        return [0] * max(1, math.ceil(len(text) / 4))

    def _local_tokenizer(self) -> _LocalTokenizer | None:
        if self._tokenizer_path and self._local is None:
            try:
                self._local = _LocalTokenizer(self._tokenizer_path)
            except Exception as exc:  # noqa: BLE001 - counted by the estimate instead, once said
                log.warning("%s: the tokenizer %s could not be loaded (%s); token counts are estimated",
                            self.id, self._tokenizer_path, exc)
                self._tokenizer_path = None
        return self._local

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """The upstream's tokens for ``text`` (counted by its tokenize endpoint), or an estimate
        (``estimated`` turns True) where it has none."""
        cached = self._counted.get((text, add_special))
        if cached is not None:
            return cached
        call = self._tokenize_call(text, add_special)
        if call is None:
            return self._estimate(text, add_special)
        try:
            with httpx.Client(headers=self._sync_headers, timeout=self._timeout) as client:
                answer = client.post(call[0], json=call[1])
        except httpx.HTTPError:
            answer = None
        return self._counted_tokens(text, add_special, answer)

    async def count(self, text: str, add_special: bool = True) -> list[int]:
        """:meth:`tokenize` without blocking the event loop."""
        cached = self._counted.get((text, add_special))
        if cached is not None:
            return cached
        call = self._tokenize_call(text, add_special)
        if call is None:
            return self._estimate(text, add_special)
        try:
            answer = await self._client.post(call[0], json=call[1])
        except httpx.HTTPError:
            answer = None
        return self._counted_tokens(text, add_special, answer)

    def _counted_tokens(self, text: str, add_special: bool, answer: Any) -> list[int]:
        """The tokens a tokenize answer holds (remembered, at most 4096 texts), or the estimate."""
        try:
            tokens = answer.json().get("tokens") if answer is not None and answer.status_code < 400 else None
        except (ValueError, AttributeError):
            tokens = None
        if not isinstance(tokens, list):
            return self._estimate(text, add_special)
        out = [t if isinstance(t, int) else 0 for t in tokens]
        if len(self._counted) > 4096:
            self._counted.clear()
        self._counted[(text, add_special)] = out
        return out

    async def count_request(self, body: dict[str, Any]) -> int:
        """The prompt tokens the upstream reads for a whole request ``body`` (a chat's
        ``messages``, or a text ``prompt``): counted by the upstream where it can template a chat
        (llama-server's ``/apply-template`` then ``/tokenize``; vLLM's and SGLang's ``/tokenize``
        with the messages), else each message's text counted with 4 tokens a message for the
        template, or the estimate (``estimated`` turns True for both)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return len(await self.count(prompt))
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        root = _root(self.base)
        try:
            if self.kind == "llama-server":
                extra = {k: body[k] for k in ("tools",) if body.get(k)}
                answer = await self._client.post(f"{root}/apply-template", json={"messages": messages, **extra})
                rendered = answer.json().get("prompt") if answer.status_code < 400 else None
                if isinstance(rendered, str):
                    return len(await self.count(rendered))
            elif self.kind in ("vllm", "sglang"):
                extra = {k: body[k] for k in ("tools",) if body.get(k)}
                answer = await self._client.post(f"{root}/tokenize", json={
                    "model": self.model, "messages": messages, "add_generation_prompt": True, **extra})
                data = answer.json() if answer.status_code < 400 else None
                if isinstance(data, dict) and isinstance(data.get("count"), int):
                    return int(data["count"])
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        local = self._local_tokenizer()
        if local is not None:
            counted = local.count_chat(messages, body.get("tools"))
            if counted is not None:
                return counted
        texts = []
        for message in messages:
            content = _text_of(message.get("content") if isinstance(message, dict) else None, skip_other=True)
            texts.append(content if content is not None else json.dumps(message))
        self.estimated = True
        counted = [len(await self.count(text)) if text else 0 for text in texts]
        return sum(counted) + 4 * len(messages) + 1

    async def embed(self, texts: list[str]) -> list[list[float]]:
        """One L2-normalised vector per text, from the upstream's /v1/embeddings."""
        if "embeddings" not in self.honours:
            raise sdk.LocalmError(422, f"{self.id}'s upstream does not embed", code="not_an_embedding_model")
        try:
            answer = await self._client.post(f"{self.base}/embeddings", json={"model": self.model, "input": texts})
        except httpx.HTTPError as exc:
            raise self._failure(exc) from None
        if answer.status_code >= 400:
            raise self._refusal(answer)
        try:
            items = sorted(answer.json()["data"], key=lambda d: d.get("index", 0))
            vectors = [_pooled(item["embedding"]) for item in items]
        except (ValueError, KeyError, TypeError):
            raise sdk.LocalmError(502, f"{self.id}: the upstream {self.base} answered /embeddings with no vectors",
                                  code="upstream_error") from None
        if len(vectors) != len(texts):
            raise sdk.LocalmError(502, f"{self.id}: the upstream {self.base} answered {len(vectors)} vectors for "
                                       f"{len(texts)} inputs", code="upstream_error")
        for text in texts:  # the counts the embeddings route asks for next
            await self.count(text)
        out = []
        for vector in vectors:
            norm = math.sqrt(sum(x * x for x in vector)) or 1.0
            out.append([x / norm for x in vector])
        return out

    async def reachable(self) -> bool:
        """Whether the upstream answers GET /models now (a short wait)."""
        try:
            answer = await self._client.get(f"{self.base}/models", timeout=2.0)
            return answer.status_code < 500
        except httpx.HTTPError:
            return False


class _LocalTokenizer:
    """A tokenizer on this machine for a remote model: a GGUF file's (llama-cpp-python, its
    vocabulary only; it also templates a chat with the file's own chat template) or a
    tokenizer.json (the ``tokenizers`` package)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._llama: Any = None
        self._json: Any = None
        self._meta: dict[str, str] = {}
        if path.endswith(".gguf"):  # the vocabulary and metadata only: no weights, no context
            import llama_cpp
            from llama_cpp._internals import LlamaModel
            params = llama_cpp.llama_model_default_params()
            params.vocab_only = True
            self._llama = LlamaModel(path_model=path, params=params, verbose=False)
            self._meta = self._llama.metadata()
        else:
            from tokenizers import Tokenizer
            self._json = Tokenizer.from_file(path)

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        if self._llama is not None:
            return list(self._llama.tokenize(text.encode("utf-8"), add_bos=add_special, special=True))
        return list(self._json.encode(text, add_special_tokens=add_special).ids)

    def count_chat(self, messages: list[Any], tools: Any = None) -> int | None:
        """The tokens of ``messages`` as the GGUF's chat template lays them out (None: no template)."""
        if self._llama is None:
            return None
        template = self._meta.get("tokenizer.chat_template")
        if not template:
            return None
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        def special(ident: int) -> str:
            return self._llama.token_to_piece(ident, special=True).decode("utf-8", "replace") if ident >= 0 else ""

        def flat(message: Any) -> Any:  # text parts joined: the template takes a string
            content = message.get("content") if isinstance(message, dict) else None
            text = _text_of(content) if isinstance(content, list) else None
            return {**message, "content": text} if text is not None else message
        try:
            formatted = Jinja2ChatFormatter(template=template, eos_token=special(self._llama.token_eos()),
                                            bos_token=special(self._llama.token_bos()))(
                messages=[flat(m) for m in messages], tools=tools or None)
        except Exception:  # noqa: BLE001 - a template that cannot lay these messages out: counted apart
            return None
        return len(self.tokenize(formatted.prompt, add_special=not formatted.added_special))


def _text_of(content: Any, *, skip_other: bool = False) -> str | None:
    """A message's content as one string: a string, or a list of parts with their text joined
    (None for anything else, or for parts that are not all text unless ``skip_other``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    parts = [p for p in content if isinstance(p, dict)]
    text = [p for p in parts if p.get("type", "text") == "text"]
    if len(text) != len(content) and not skip_other:
        return None
    return "".join(str(p.get("text", "")) for p in text)


def _said(exc: Exception) -> str:
    """What a failure says of itself, or its kind."""
    return str(exc).lower() if str(exc) else type(exc).__name__


def _pooled(vector: Any) -> list[float]:
    """An embedding as one vector: a list of per-token vectors (llama-cpp-python on a model without
    pooling) is averaged."""
    if vector and isinstance(vector[0], list):
        n = len(vector)
        return [sum(column) / n for column in zip(*vector)]
    return [float(x) for x in vector]


def _message_of_dict(data: dict[str, Any]) -> str:
    error = data.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)[:500]
    return str(error)[:500]


def read_key(data_dir: Path, model: str) -> str | None:
    """The key stored for a remote model's source (``plugin-data/remote/keys.json``, by
    ``openai+URL#model``: a copy or a rename keeps it), or None."""
    try:
        keys = json.loads((Path(data_dir) / "keys.json").read_text())
    except (OSError, ValueError):
        return None
    key = keys.get(model) if isinstance(keys, dict) else None
    return key if isinstance(key, str) and key else None


@sdk.hookimpl
def register_settings(register):
    register(Settings)


@sdk.hookimpl
def register_engines(register, plugin):
    def load(entry: Any, options: dict[str, Any]) -> RemoteEngine:
        return RemoteEngine(entry, {**plugin.settings, **options}, read_key(plugin.data_dir, entry.source))

    register("remote", load)


@sdk.hookimpl
def register_model_providers(register, plugin):
    """``localm pull openai+http://[:KEY@]host:port/v1#model`` (and https): see source.py."""
    from . import source

    data_dir = plugin.data_dir

    def pull(src: str, *, registry: Any, name: str | None = None, log: Any = lambda line: None) -> list[Any]:
        return [source.pull_remote(registry, src, data_dir, name=name, log=log)]

    def forget(entry: Any) -> None:  # the last model from that upstream left the registry: its key goes too
        source.store_key(data_dir, entry.source, None)

    for scheme in ("openai+http", "openai+https"):
        register(scheme, pull, forget=forget, describe=source.describe)


from .peers import startup  # noqa: E402,F401 - provides the peers service (peers.py), hooked from the entry module
