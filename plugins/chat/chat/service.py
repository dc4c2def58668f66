"""The chat service: one generation path for every surface.

The chat plugin provides it to other plugins as ``host.chat``. A surface (the OpenAI,
Ollama, Anthropic and Responses plugins) parses its own request
into an OpenAI chat-completions body, hands it to :meth:`ChatService.chat` as an
``sdk.chat.ChatRequest`` (the body, and the origins of its places in the client's request),
or a prompt to :meth:`ChatService.complete`, and renders what the returned
:class:`Generation` yields:

- :class:`pipeline.Status` while waiting or starting, :class:`pipeline.Piece` for visible
  text (with its tokens' log probabilities when asked), :class:`pipeline.Reasoning` for the
  model's ``<think>`` text, :class:`pipeline.Call` for each whole tool call;
- at the end, ``generation.outcome`` holds the finish reason, the stop sequence, the calls
  and the token counts (``pipeline.usage(outcome)`` renders OpenAI's usage block).

Every refusal before generation (a malformed field, an unknown model, a prompt that does
not fit) is a :class:`sdk.LocalmError` raised by ``chat``/``complete``, with the status the
OpenAI routes would answer, naming each field as the request's origins say the client
calls it; a surface renders it in its own error shape. Fields are read by the same
readers as the OpenAI routes, so a field means the same on every surface.

The chat hooks run here for every surface: the chat_inlet hooks inside ``chat`` and
``complete``, the chat_stream hooks on each item of ``generation.items()`` (a streamed
reply), and the chat_outlet hooks when the reply ends, in ``items()`` or ``reply()``.
What hooks add to the response is in ``generation.headers`` (send them) and
``generation.extra`` (fields for the body, or for one last chunk of a stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any, NamedTuple

import attrs
from localm import sdk
from localm.sdk import engines as spec
from localm.sdk.chat import ChatRequest, Origins, Scores

from . import compaction, constrained, defaults, fields, hooks, pipeline, routing, scoring
from . import rerank as reranking

log = logging.getLogger("localm.plugin.chat")
#: Model types whose load reads weights here (seconds to minutes): a stream to one that is not
#: loaded opens before it loads.
LOADS_WEIGHTS = ("gguf", "hf")
#: a streamed request still being prepared this long after it arrived opens its stream
#: (seconds): statuses go out while it is prepared, and a refusal from then on travels in band
OPEN_AFTER = 0.5
#: The request header that lowers, and the response header that says, what the session log keeps.
SESSION_HEADER = "X-Localm-Session-Mode"
from .prompt import chat_tokens
from .request import Common, Options, Reader, media_of, read_common, read_messages, read_options

#: The response header that names a server-side reply cap applied to a request with none of its own.
CAPPED = "X-Localm-Capped"
#: What a registered model of each role other than chat is, and what serves it.
_NOT_CHAT = {"embedding": ("an embedding model", "embeds text at /v1/embeddings"),
             "reranker": ("a reranker", "scores documents at /v1/rerank"),
             "stt": ("a speech-to-text model", "transcribes audio at /v1/audio/transcriptions"),
             "tts": ("a text-to-speech voice", "speaks at /v1/audio/speech")}


def fingerprint(entry: Any, engine: Any) -> str:
    """localm:<model>@<revision>:<dtype>/<quantization>:<engine>; an unknown part reads unrecorded."""
    caps = engine.capabilities
    revision = entry.sha256[:8] if entry.sha256 else None
    dtype = caps.dtype or entry.capabilities.get("dtype")
    quantization = caps.quantization or entry.capabilities.get("quantization")
    parts = [p or "unrecorded" for p in (revision, dtype, quantization)]
    return f"localm:{entry.id}@{parts[0]}:{parts[1]}/{parts[2]}:{engine.engine}"


@attrs.define
class Reply:
    """A whole reply, for a non-streaming request, as the chat_outlet hooks left it."""
    content: list[str] = attrs.Factory(list)
    reasoning: list[str] = attrs.Factory(list)
    logprobs: list[dict[str, Any]] = attrs.Factory(list)
    calls: list[dict[str, Any]] = attrs.Factory(list)
    #: an outlet hook changed the message (its log probabilities no longer spell it)
    rewritten: bool = False

    @property
    def text(self) -> str:
        return "".join(self.content)


def _message(content: str, reasoning: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message the outlet hooks see."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


class Live:
    """A streamed request being prepared (the inlet hooks, resolving, steering, checking,
    loading), watched so that its stream can open before preparing ends: what the request
    looked like before the inlet hooks (to open the stream with), what preparing is doing now
    (a status), and an event set whenever a status waits to be sent."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.chain: hooks.Chain | None = None
        self.asked: ChatRequest | None = None
        self.parsed: Parsed | None = None
        self.found: Any = None
        self.phase: pipeline.Status | None = None
        self.changed = asyncio.Event()
        #: the generation has begun (an upstream was sent the request): its refusal is still an
        #: HTTP status, so the stream no longer opens early
        self.generating = False
        self.opened = False
        self.adopted = False
        #: the X-Localm-Session-Mode the reply carries (None: a request of the service's own)
        self.session: str | None = None

    def attach(self, chain: hooks.Chain, asked: ChatRequest, parsed: Parsed, found: Any) -> None:
        self.chain, self.asked, self.parsed, self.found = chain, asked, parsed, found
        chain.state.live = self

    def enter(self, code: str, text: str) -> None:
        """Preparing moved on to ``code``: an open stream says so now."""
        self.phase = pipeline.Status(code, text)
        if self.opened and self.chain is not None:
            self.chain.state.statuses.append(self.phase)
            self.changed.set()

    def may_open(self) -> bool:
        return (self.chain is not None and self.parsed is not None and not self.generating
                and not isinstance(self.found, sdk.LocalmError))


def _abandon(task: Any) -> None:
    """A preparation nobody will use: stopped, and the model it held released."""
    task.cancel()

    def release(done: Any) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        ready = done.result()
        if ready.hold is not None:
            ready.hold.release()
    task.add_done_callback(release)


def _abandon_unadopted(task: Any, live: Live) -> None:
    if not live.adopted:
        live.adopted = True
        _abandon(task)


@attrs.define
class Generation:
    """A request checked, its model loaded and its prompt tokenised; nothing generated yet."""

    host: Any
    entry: Any  # the registry entry of the model that answers
    prompt: list[int]
    fingerprint: str  # system_fingerprint
    plan: pipeline.Plan
    common: Common
    options: Options
    model: str  # the model name to show: the one asked for, or the model that answers
    received: float  # time.perf_counter() when the request arrived
    chain: hooks.Chain  # this request's chat hooks
    request: ChatRequest  # the request as read (after the inlet hooks)
    messages: list[dict[str, Any]] | None = None  # the messages after the inlet hooks (chat only)
    outcome: pipeline.Outcome = attrs.Factory(pipeline.Outcome)
    reads: list[tuple[Any, Any]] = attrs.Factory(list)  # (ActivationRead, done) from forward_interventions
    #: the model held since the request was prepared (released when the generation ends), so
    #: an unload cannot begin between the checks and the first token
    hold: Any = None
    #: what prime() read ahead: the items, and the generation they came from
    primed: tuple[list[Any], Any] | None = None
    #: a streamed reply opened before its model loaded: the rest of its preparation (returns the
    #: prepared generation), run by items() after a loading_model status
    pending: Any = None
    #: a streamed reply opened while the request was still being prepared (inlet hooks
    #: included): the task preparing it, and the headers its stream was opened with
    preparing: Any = None
    sent_headers: dict[str, str] | None = None

    async def _awaited(self) -> AsyncIterator[pipeline.Status]:
        """Finish a preparation that outlasted the stream's opening: the statuses it sends
        meanwhile, as they come. A refusal is raised (the surfaces send it in band); headers set
        after the stream opened go to the last chunk; what was prepared becomes this
        generation's."""
        task, self.preparing = self.preparing, None
        state = self.chain.state
        live = state.live
        try:
            while not task.done():
                live.changed.clear()
                for status in self.chain.statuses():
                    yield status
                waiter = asyncio.ensure_future(live.changed.wait())
                try:
                    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
        except BaseException:
            _abandon_unadopted(task, live)
            raise
        live.adopted = True
        for status in self.chain.statuses():
            yield status
        ready = task.result()
        sent = self.sent_headers or {}
        for name, value in ready.headers.items():
            if sent.get(name) != value:
                state.fields.setdefault("localm_headers", {})[name] = value
        for name in ("entry", "prompt", "fingerprint", "plan", "common", "options", "messages", "reads", "hold",
                     "primed", "pending", "request"):
            setattr(self, name, getattr(ready, name))

    async def _prepared(self) -> AsyncIterator[pipeline.Status]:
        """Finish a pending preparation (load the model, render and check the prompt): a
        loading_model status first. A refusal now is raised from items(), where the surfaces
        send it in band; headers it adds go to the last chunk (the stream's are sent)."""
        prepare, self.pending = self.pending, None
        yield pipeline.Status("loading_model", f"Loading {self.entry.id}")
        state = self.chain.state
        before = dict(state.headers)
        state.outcome_to_fill = self.outcome  # a generation primed while prepared fills the one surfaces read
        ready = await prepare()
        for name, value in state.headers.items():
            if before.get(name) != value:
                state.fields.setdefault("localm_headers", {})[name] = value
        for name in ("entry", "prompt", "fingerprint", "plan", "common", "options", "messages", "reads", "hold",
                     "primed"):
            setattr(self, name, getattr(ready, name))

    @property
    def context(self) -> hooks.ChatContext:
        """The request's chat context (what the chat hooks saw)."""
        return self.chain.context

    @property
    def headers(self) -> dict[str, str]:
        """The response headers every surface sends (seed echo, constraint, ignored fields, hooks')."""
        return self.chain.state.headers

    @property
    def extra(self) -> dict[str, Any]:
        """The fields added to the response: by the chat hooks (context.field, a header added
        once a stream was open) and, when the generation ends, by the forward_interventions readers."""
        return self.chain.state.fields

    async def _generate(self) -> AsyncIterator[pipeline.Status | pipeline.Piece | pipeline.Reasoning | pipeline.Call]:
        """The engine's items; when they end (or the client leaves), the request log's line
        gets the tokens in and out, and the code of a refusal met on the way."""
        async with contextlib.aclosing(self._engine_items()) as items:
            try:
                async for item in items:
                    yield item
            except sdk.LocalmError as exc:
                sdk.annotate(code=exc.code)
                raise
            finally:
                sdk.annotate(tokens_in=self.outcome.prompt_tokens, tokens_cached=self.outcome.cached_tokens or None,
                             tokens_out=self.outcome.completion_tokens)

    async def _engine_items(self) -> AsyncIterator[pipeline.Status | pipeline.Piece | pipeline.Reasoning
                                                   | pipeline.Call]:
        """The engine's items. A constrained document the model ended itself is validated at
        the end: a failure raises 500 constrained_output_invalid after the last item."""
        content: list[str] = []
        async with contextlib.AsyncExitStack() as stack:
            if self.hold is not None:
                stack.callback(self.hold.release)
                resident = self.hold.resident
            else:
                resident = await stack.enter_async_context(self.host.models.use(self.entry.id))
            async for item in pipeline.run(resident.engine, self.prompt, self.common, self.received, self.outcome,
                                           self.host.metrics, self.plan):
                if isinstance(item, pipeline.Piece):
                    content.append(item.text)
                yield item
        fmt = self.options.fmt
        if fmt is not None and self.plan.chat is None and self.outcome.ended_by_model and not self.outcome.calls:
            constrained.validate_output("".join(content), fmt)
        activations = self.outcome.activations or {}
        for read, done in self.reads:
            rows = activations.get((read.layer, read.point))
            if rows is not None:  # a reader's work (an SAE encoding) runs off the event loop
                self.extra.update(await asyncio.to_thread(done, rows, list(self.prompt),
                                                          list(self.outcome.token_ids)) or {})

    async def prime(self) -> None:
        """Start the generation and read its first item (the engine's first event) ahead, for
        a streamed reply from an engine that answers whole requests: the request reaches the
        engine (an upstream server) before the response opens, and a refusal it meets before
        it begins (the upstream's 413, an unreachable upstream's 502) is raised here, where it
        is still an HTTP status. items() and reply() go on from what was read."""
        live = self.chain.state.live
        if live is not None:
            live.generating = True
        source = self._generate()
        try:
            ahead = [await source.__anext__()]
        except StopAsyncIteration:
            ahead = []
        self.primed = (ahead, source)

    def _generated(self) -> AsyncIterator[Any]:
        """The engine's items: a primed generation's read-ahead items first, then the rest."""
        if self.primed is None:
            return self._generate()
        (ahead, source), self.primed = self.primed, None

        async def ahead_then_rest() -> AsyncIterator[Any]:
            async with contextlib.aclosing(source):
                for item in ahead:
                    yield item
                async for item in source:
                    yield item
        return ahead_then_rest()

    async def items(self) -> AsyncIterator[pipeline.Status | pipeline.Piece | pipeline.Reasoning | pipeline.Call]:
        """Generate a streamed reply: each item as the chat_stream hooks leave it (the inlet
        hooks' status events first); when the reply ends the chat_outlet hooks run on the whole
        message as it was sent, and the text or reasoning they append is sent last."""
        chain = self.chain
        chain.state.opened = True
        said_text: list[str] = []
        said_reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        through = chain.stream if chain.streams else None

        def said(one: Any) -> Any:
            if isinstance(one, pipeline.Piece):
                said_text.append(one.text)
            elif isinstance(one, pipeline.Reasoning):
                said_reasoning.append(one.text)
            elif isinstance(one, pipeline.Call):
                calls.append(one.call)
            return one

        async def sent(item: Any) -> list[Any]:
            return [said(one) for one in (await through(item) if through is not None else [item])]

        if self.preparing is not None:  # refused while prepared: no turn to tell the outlet hooks of
            async for status in self._awaited():
                for out in await sent(status):
                    yield out
        try:
            for status in chain.statuses():
                for out in await sent(status):
                    yield out
            if self.pending is not None:
                async for status in self._prepared():
                    for out in await sent(status):
                        yield out
                for status in chain.statuses():  # compacting, while it was prepared
                    for out in await sent(status):
                        yield out
            async with contextlib.aclosing(self._generated()) as generated:
                async for item in generated:
                    for out in await sent(item):
                        yield out
                    for status in chain.statuses():  # a stream hook asked for one
                        for out in await sent(status):
                            yield out
            if self.outcome.finish_reason != "error":
                if chain.stream_ends:  # what stream hooks held back, through the later plugins' stream hooks
                    for item in await chain.stream_end():
                        yield said(item)
                    for status in chain.statuses():
                        for out in await sent(status):
                            yield out
        except BaseException as exc:  # failed, or the client left: the outlet hooks still learn of the turn
            await self._outlet_after(_message("".join(said_text), "".join(said_reasoning), calls), exc)
            raise
        if self.outcome.finish_reason == "error":
            await self._outlet_after(_message("".join(said_text), "".join(said_reasoning), calls))
            return
        text, reasoning = "".join(said_text), "".join(said_reasoning)
        message, _ = await chain.outlet(self._ended(_message(text, reasoning, calls)))
        await self._record(message)
        for status in chain.statuses():
            yield status
        for item in _appended(message, text, reasoning):
            yield item

    def _ended(self, message: dict[str, Any], *, abandoned: bool = False) -> dict[str, Any]:
        """Tell the outlet hooks how the reply ended (``context.outcome``); returns ``message``."""
        outcome = self.outcome
        self.chain.state.outcome = {"finish_reason": "abandoned" if abandoned else outcome.finish_reason,
                                    "error": outcome.error if outcome.finish_reason == "error" else None,
                                    "completion_tokens": outcome.completion_tokens}
        return message

    async def _outlet_after(self, message: dict[str, Any], cause: BaseException | None = None) -> None:
        """Run the outlet hooks after a reply that failed (``cause``: what ended it, when it
        was raised) or that its client left: what they return reaches nobody, and a hook that
        fails is logged. The session log gets the turn."""
        abandoned = isinstance(cause, (asyncio.CancelledError, GeneratorExit, ConnectionError))
        if cause is not None and not abandoned:
            self.outcome.finish_reason = "error"
            self.outcome.error = self.outcome.error or (cause.detail if isinstance(cause, sdk.LocalmError)
                                                        else f"{type(cause).__name__}: {cause}")
        self._ended(message, abandoned=abandoned)
        if self.chain.outlets:
            try:
                await self.chain.outlet(message)
            except BaseException as exc:  # noqa: BLE001 - the reply is over; the cause stays the reply's own
                log.warning("a chat_outlet hook failed after a %s reply: %s", "left" if abandoned else "failed",
                            exc)
        await self._record(message)

    async def _record(self, message: dict[str, Any]) -> None:
        """Keep the turn in the session log as its mode says (before the reply's last chunk
        goes out: a turn a client saw end is on disk). A log that cannot be written is logged."""
        state = self.chain.state
        if state.session_mode == "none":
            return
        outcome = state.outcome or {}
        body = state.request or self.request.body
        user = "\n".join(_own_words(body.get("messages"))[-1:]) if "messages" in body else \
            (body.get("prompt") if isinstance(body.get("prompt"), str) else None)
        reply = message.get("content") if isinstance(message.get("content"), str) else None
        write = asyncio.ensure_future(asyncio.to_thread(
            self.host.session_log.record, mode=state.session_mode, route=state.route,
            model=self.entry.id if self.entry is not None else self.common.model,
            owner=self.chain.context.owner_tag, finish_reason=outcome.get("finish_reason"),
            prompt_tokens=self.outcome.prompt_tokens, completion_tokens=self.outcome.completion_tokens,
            user=user, reply=reply))
        try:
            await asyncio.shield(write)  # a client that leaves now does not stop the write
        except asyncio.CancelledError:
            write.add_done_callback(_logged_failure)
            raise
        except Exception as exc:  # noqa: BLE001 - the reply stands; the log says what was not kept
            log.warning("the session log did not keep a turn: %s", exc)

    async def reply(self) -> Reply:
        """The whole reply (for a non-streaming request), after the chat_outlet hooks."""
        reply = Reply()
        try:
            async with contextlib.aclosing(self._generated()) as generated:
                async for item in generated:
                    if isinstance(item, pipeline.Piece):
                        reply.content.append(item.text)
                        reply.logprobs.extend(item.logprobs)
                    elif isinstance(item, pipeline.Reasoning):
                        reply.reasoning.append(item.text)
        except BaseException as exc:  # failed, or the client left: the outlet hooks still learn of the turn
            await self._outlet_after(_message(reply.text, "".join(reply.reasoning), list(self.outcome.calls)), exc)
            raise
        reply.calls = list(self.outcome.calls)
        if self.outcome.finish_reason == "error":
            await self._outlet_after(_message(reply.text, "".join(reply.reasoning), reply.calls))
        else:
            message, reply.rewritten = await self.chain.outlet(
                self._ended(_message(reply.text, "".join(reply.reasoning), reply.calls)))
            await self._record(message)
            if reply.rewritten:
                reply.content = [message.get("content") or ""]
                reasoning = message.get("reasoning_content") or ""
                reply.reasoning = [reasoning] if reasoning else []
                reply.calls = list(message.get("tool_calls") or [])
        self.chain.statuses()  # status events have nowhere to go in a whole reply
        return reply


def _asked(body: ChatRequest | dict[str, Any], extra: dict[str, Any] | None) -> ChatRequest:
    """The request a surface handed over: a bare body is an OpenAI request (no origins)."""
    if isinstance(body, dict):
        return ChatRequest(body=body, extra=extra or {})
    return attrs.evolve(body, extra={**body.extra, **extra}) if extra else body


def _read(asked: ChatRequest, common: Common, options: Options, found: Any,
          messages: list[dict[str, Any]] | None = None) -> ChatRequest:
    """The request with what the readers made of it (after the inlet hooks) filled in."""
    entry = None if isinstance(found, sdk.LocalmError) else found
    return attrs.evolve(asked, model=common.model, entry=entry, stream=common.stream, messages=messages,
                        sampling=common.sampling, stops=common.stops, tools=options.tools, format=options.fmt,
                        logprobs=options.logprobs, thinking=options.thinking, include_usage=common.include_usage,
                        token_ids=options.token_ids)


@contextlib.contextmanager
def _released_on_error(hold: Any) -> Iterator[Any]:
    """The held model's resident; the hold is released if preparing the request fails."""
    try:
        yield hold.resident
    except BaseException:
        hold.release()
        raise


class _Longer(Exception):
    """The conversation is too long for the model it would go to: ``route`` leads to one
    trained for a longer window."""

    def __init__(self, route: Any) -> None:
        super().__init__("routed for a longer context")
        self.route = route


def _logged_failure(write: Any) -> None:
    if not write.cancelled() and write.exception() is not None:
        log.warning("the session log did not keep a turn: %s", write.exception())


#: Messages a client marks as not the user's own words (a tool result, its own prompt).
_ORIGINS = ("tool", "client")


def _own_words(messages: Any) -> list[str]:
    """The user's own messages' text, oldest first: user messages not marked with an origin."""
    out = []
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict) or m.get("role") != "user" or m.get("origin") in _ORIGINS:
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        if isinstance(content, str) and content.strip():
            out.append(content.strip())
    return out


def _appended(message: dict[str, Any], text: str, reasoning: str) -> list[Any]:
    """What outlet hooks added to a reply already streamed: the end of its reasoning and of its
    text (a footer). Other edits cannot reach a client that has the text already."""
    out: list[Any] = []
    new_reasoning = message.get("reasoning_content") or ""
    if new_reasoning != reasoning and new_reasoning.startswith(reasoning):
        out.append(pipeline.Reasoning(new_reasoning[len(reasoning):]))
    new_text = message.get("content") or ""
    if new_text != text and new_text.startswith(text):
        out.append(pipeline.Piece(new_text[len(text):]))
    elif new_text != text or (new_reasoning != reasoning and not new_reasoning.startswith(reasoning)):
        log.info("a chat_outlet hook rewrote a streamed reply; only what it appends reaches the client")
    return out


class Parsed(NamedTuple):
    """A request as the chat readers read it: the fields every kind has, what the model is
    given (a chat's messages, a completion's prompt) and the kind's options."""
    common: Common
    content: Any
    options: Options


@attrs.frozen
class ModelView:
    """What the forward_interventions hook is told about the model that will answer."""
    id: str
    type: str
    engine: str
    capabilities: dict[str, Any]


class Interventions:
    """The ``register`` of the forward_interventions hook: deltas, fields read, headers."""

    def __init__(self) -> None:
        self.items: list[spec.Intervention] = []
        self.fields: set[str] = set()
        self.headers: dict[str, str] = {}
        self.reads: list[tuple[spec.ActivationRead, Any]] = []

    def __call__(self, layer: int, delta: Any) -> None:
        self.items.append(spec.Intervention(layer=layer, delta=delta))

    def use(self, field: str) -> None:
        self.fields.add(field)

    def header(self, name: str, value: str) -> None:
        self.headers[name] = value

    def read(self, layer: int, point: str, done: Any) -> None:
        """Read the residual at ``layer``'s output (``point`` "pre" or "post" this request's
        interventions); after the generation ``done(activations, prompt_ids, generated_ids)``
        gets the rows (a float32 array, positions × hidden) and returns a dict of fields to
        add to the response (for example ``{"millm": {...}}``)."""
        self.reads.append((spec.ActivationRead(layer=layer, point=point), done))


class ChatService:
    """What other surfaces call; see the module docstring.

    A surface may not import the chat plugin's modules, so the item classes it tells apart
    (``isinstance(item, chat.Piece)``) and the usage renderer are attributes here.
    """

    Status = pipeline.Status
    Piece = pipeline.Piece
    Reasoning = pipeline.Reasoning
    Call = pipeline.Call
    TOOL_OPEN, TOOL_CLOSE = constrained.TOOL_OPEN, constrained.TOOL_CLOSE

    def __init__(self, host: Any, settings: Any = None) -> None:
        self.host = host
        self.compactor = compaction.Compactor()
        #: the chat plugin's settings (a mapping, read on each request)
        self._settings = settings if settings is not None else {}

    def _setting(self, name: str, default: Any) -> Any:
        settings = self._settings() if callable(self._settings) else self._settings
        value = settings.get(name)
        return default if value is None else value

    def _budget(self) -> compaction.Budget:
        """What one request's compaction may spend (the chat plugin's settings)."""
        return compaction.Budget(max_tokens=int(self._setting("compaction_max_tokens", compaction.MAX_TOKENS)),
                                 seconds=float(self._setting("compaction_timeout", compaction.TIMEOUT)))

    def _capped(self, common: Common, headers: dict[str, str]) -> Common:
        """A request that sends no max_tokens gets the chat plugin's cap for its kind: a front
        end's background task ``task_max_tokens``, any other ``default_max_tokens`` (0: none).
        A cap applied is named in ``X-Localm-Capped`` (``task_max_tokens=256``), so a reply it
        ends (finish reason ``length``) is not taken for the model's or the client's doing."""
        if common.sampling.max_tokens is not None:
            return common
        setting = "task_max_tokens" if common.background else "default_max_tokens"
        cap = self._setting(setting, 0) or None
        if cap is None:
            return common
        headers[CAPPED] = f"{setting}={cap}"
        return attrs.evolve(common, sampling=attrs.evolve(common.sampling, max_tokens=cap))

    @staticmethod
    def check_embedding_model(entry: Any) -> None:
        """A 422 ``not_an_embedding_model`` for a model that embeds nothing (a reranker, a speech
        model); a surface calls it before loading the model for embeddings."""
        if entry.role == "reranker":
            raise sdk.LocalmError(422, f"{entry.id} is a reranker: it scores documents against a query "
                                       "(use /v1/rerank) and embeds nothing", code="not_an_embedding_model")
        if entry.role in ("stt", "tts"):
            what, does = _NOT_CHAT[entry.role]
            raise sdk.LocalmError(422, f"model {entry.id} is {what}: it {does} and embeds nothing",
                                  code="not_an_embedding_model")

    @staticmethod
    def check_chat_model(entry: Any) -> None:
        """A 400 ``not_a_chat_model`` for a registered model that does not chat (an embedding
        model, a reranker, a speech model), naming what it is and the route that serves it; a
        surface calls it before loading the model for a chat."""
        found = _NOT_CHAT.get(entry.role)
        if found is not None:
            what, does = found
            raise sdk.LocalmError(400, f"model {entry.id} is {what}: it {does} and does not chat",
                                  code="not_a_chat_model")

    @staticmethod
    def wants_scoring(body: Any) -> bool:
        """Whether an OpenAI completions or chat-completions body (any JSON value) asks for
        scoring mode rather than a generation: ``allowed_token_ids``, or log probabilities with
        max_tokens 1 and no streaming (see scoring.py)."""
        return scoring.wanted(body)

    async def score(self, body: dict[str, Any], *, kind: str, request: Any = None,
                    received: float | None = None) -> Scores:
        """Answer a scoring request, an OpenAI ``kind`` body ("completions" or "chat"): each
        prompt's next-token candidates, most likely first, and what the response reports
        (sdk.chat.Scores). No chat hooks run and nothing is steered. ``request`` is the HTTP
        request (its headers: the ignored-fields report and X-Localm-Strict). Refusals: 400
        invalid_scoring_request (the scoring rule, an unknown token id, an empty prompt), 400
        field_not_honoured (a steering or constraining field, an engine that cannot score),
        500 non_finite_logits."""
        return await scoring.score(self.host, request, kind, body, received)

    @staticmethod
    def check_fields(kind: str, body: dict[str, Any], headers: Any) -> dict[str, str]:
        """For an OpenAI body of ``kind`` ("chat", "completions", "embeddings" or "rerank"), as the
        client sent it: 400 field_not_honoured for an output-changing field the route cannot
        honour, then the ignored-fields report's response headers (maybe none; X-Localm-Strict
        refuses instead). ``chat`` and ``complete`` make this check themselves."""
        return fields.check(kind, body, headers)

    @staticmethod
    def usage(outcome: pipeline.Outcome, *, timings: bool = True, capacity: bool = True) -> dict[str, Any]:
        """OpenAI's usage block for a finished generation."""
        return pipeline.usage(outcome, timings=timings, capacity=capacity)

    @staticmethod
    def redact(text: str) -> str:
        """An error text with absolute paths cut to file names, as every surface sends it."""
        return pipeline.redact(text)

    async def chat(self, body: ChatRequest | dict[str, Any], *, route: str = "chat.completions",
                   request: Any = None, report: bool | None = None, ignored: list[str] | None = None,
                   extra: dict[str, Any] | None = None, request_headers: Any = None, received: float | None = None,
                   compact: bool = True) -> Generation:
        """Prepare a chat generation from a ChatRequest (or a bare OpenAI chat-completions body,
        whose places keep their OpenAI names); ``generation.request`` is the request as read.

        ``route`` names the surface to the chat hooks (``context.route``). ``request`` is the
        HTTP request: the caller, and the headers X-Localm-Strict is read from. ``report``
        turns on the ignored-fields report (X-Localm-Ignored-Fields, and X-Localm-Strict's
        refusal): on an OpenAI body the service finds the unused fields itself; a surface that
        translated its request passes its own list as ``ignored`` (locations in its words).
        ``extra`` holds the client's fields the surface did not read (with a ChatRequest's own
        ``extra``): the inlet hooks see them in the request, and a hook that claims one takes
        it off the report.
        ``request_headers`` (the older spelling) turns the report on with those headers.
        A conversation too long for the model's window is compacted (``compact=False``:
        refused with a 413 instead).
        """
        received = time.perf_counter() if received is None else received
        asked = _asked(body, extra)
        return await self._early(asked, received, lambda live: self._chat(
            asked, route=route, request=request, report=report, ignored=ignored, request_headers=request_headers,
            received=received, compact=compact, live=live))

    async def _chat(self, asked: ChatRequest, *, route: str, request: Any, report: bool | None,
                    ignored: list[str] | None, request_headers: Any, received: float, compact: bool,
                    live: Live | None = None) -> Generation:
        def read(r: Reader) -> Parsed:
            return Parsed(read_common(r), read_messages(r), read_options(r, "chat"))

        (common, messages, options), chain, steering, headers, found = await self._admit(
            "chat", asked, read, route=route, request=request, report=report, ignored=ignored,
            request_headers=request_headers, live=live)
        asked = _read(asked, common, options, found, messages)

        budget = self._budget()

        def render(engine: Any) -> tuple[list[int], bool]:
            if compact:  # more messages than any compaction could make fit: refused before rendering
                compaction.check_count(messages, engine.capabilities.context_limit, budget)
            return chat_tokens(engine, messages, tools=options.tools, thinking=options.thinking)

        compacted: list[list[dict[str, Any]]] = []

        async def fit(engine: Any, entry: Any, window: int, room: int) -> tuple[list[int], bool] | None:
            """The prompt of the conversation compacted to fit (None: nothing to compact)."""
            chain.context.status("compacting", "Compacting: older messages are being summarised to fit the "
                                               "context window")
            found = await self.compactor.fit(engine, entry.id, messages, tools=options.tools,
                                             thinking=options.thinking, window=window, room=room, budget=budget)
            if found is None:
                chain.statuses()  # nothing was compacted after all
                return None
            prompt, opened, shorter = found
            compacted.append(shorter)
            headers["X-Localm-Context-Compacted"] = "1"
            return prompt, opened

        async def prepare() -> Generation:
            try:
                generation = await self._prepare(asked, found, common, options, render, headers, received, chain,
                                                 steering, fit=fit if compact else None, media=media_of(messages),
                                                 reroute=True)
            except _Longer as longer:  # too long for the model: one trained for a longer window answers
                chain.state.routing = longer.route
                headers["X-Localm-Model-Routing"] = routing.header_value(longer.route.header)
                generation = await self._prepare(asked, longer.route.entry, common, options, render, headers,
                                                 received, chain, steering, fit=fit if compact else None,
                                                 media=media_of(messages))
            generation.messages = compacted[0] if compacted else messages
            return generation

        return self._opening(asked, found, common, options, headers, received, chain, prepare) or await prepare()

    async def complete(self, body: ChatRequest | dict[str, Any], *, route: str = "completions", request: Any = None,
                       report: bool | None = None, ignored: list[str] | None = None,
                       extra: dict[str, Any] | None = None, request_headers: Any = None,
                       received: float | None = None) -> Generation:
        """Prepare a text completion from an OpenAI completions ``body`` (``prompt`` one string),
        bare or in a ChatRequest with its origins: the prompt goes to the model as written, with
        no chat template. The chat hooks run as for ``chat``; the inlet hooks see ``prompt``
        where a chat has ``messages``."""
        received = time.perf_counter() if received is None else received
        asked = _asked(body, extra)
        return await self._early(asked, received, lambda live: self._complete(
            asked, route=route, request=request, report=report, ignored=ignored, request_headers=request_headers,
            received=received, live=live))

    async def _complete(self, asked: ChatRequest, *, route: str, request: Any, report: bool | None,
                        ignored: list[str] | None, request_headers: Any, received: float,
                        live: Live | None = None) -> Generation:
        def read(r: Reader) -> Parsed:
            common = read_common(r)
            prompt_text = r.body.get("prompt")
            if isinstance(prompt_text, list) and len(prompt_text) == 1 and isinstance(prompt_text[0], str):
                prompt_text = prompt_text[0]
            if isinstance(prompt_text, list):
                raise sdk.LocalmError(400, "prompt must be one string (a list of one string is accepted)",
                                      field="prompt")
            if not isinstance(prompt_text, str):
                r.errors.append({"key": "prompt", "message": "must be a string"})
            echo = r.get("echo", (bool,), "true or false", False)
            options = read_options(r, "completions")
            if echo and options.logprobs is not None:  # the prompt's tokens are not scored
                raise sdk.LocalmError(400, "echo cannot be honoured with logprobs on /v1/completions: the prompt's "
                                           "tokens are not scored (ask for logprobs without echo)",
                                      code="field_not_honoured", field="echo")
            return Parsed(common, prompt_text, options)

        (common, prompt_text, options), chain, steering, headers, found = await self._admit(
            "completions", asked, read, route=route, request=request, report=report, ignored=ignored,
            request_headers=request_headers, live=live)

        def render(engine: Any) -> tuple[list[int], bool]:
            return engine.tokenize(prompt_text, add_special=options.add_special), False

        read = _read(asked, common, options, found)

        async def prepare() -> Generation:
            return await self._prepare(read, found, common, options, render, headers, received, chain, steering)

        return self._opening(read, found, common, options, headers, received, chain, prepare) or await prepare()

    async def embed(self, model: str | None, texts: list[str]) -> tuple[Any, list[list[float]], int]:
        """The registry entry, one normalised vector per text, and the tokens they took. No
        texts, or an empty one, is a 400 (code empty_input) before any engine sees them."""
        empty = [i for i, t in enumerate(texts) if not t]
        if not texts or empty:  # nothing to embed: an engine's decode fails on zero tokens
            where = "input is empty" if not texts or len(texts) == 1 else f"input[{empty[0]}] is an empty string"
            raise sdk.LocalmError(400, f"{where}: each input must be a non-empty string", code="empty_input",
                                  field="input")
        entry = self.host.models.resolve(model)
        self.check_embedding_model(entry)
        async with self.host.models.use(entry.id) as resident:
            vectors = await resident.engine.embed(texts)
            tokens = sum(len(resident.engine.tokenize(t)) for t in texts)
        sdk.annotate(model=entry.id, tokens_in=tokens)
        return entry, vectors, tokens

    async def rerank(self, model: str | None, query: str, documents: list[str], *,
                     top_n: int | None = None) -> tuple[Any, list[dict[str, Any]], int]:
        """Score ``documents`` against ``query`` with a registered reranker: (the registry entry,
        the results best first, the tokens the model read).

        ``model`` names the reranker; None (or "") takes the one registered. Each result is
        ``{"index": position in documents, "relevance_score": float}``, plus ``label_scores``
        (every output of a classifier head with several) and ``truncated: True`` (a document
        cut to fit the model's window); ``top_n`` keeps the best N. Refusals: 400 for an empty
        query, a query too long for the window, or several rerankers and no model; 404 for an
        unknown model or no reranker at all; 422 for empty documents, a top_n below 1, a model
        that is not a reranker, a missing file or one without a classifier head; 503 when the
        model cannot be loaded or its worker fails.
        """
        entry, results, tokens = await reranking.rerank(self.host, model, query, documents, top_n=top_n)
        sdk.annotate(model=entry.id, tokens_in=tokens)
        return entry, results, tokens

    async def count_tokens(self, body: ChatRequest | dict[str, Any], *, route: str = "anthropic.count_tokens",
                           request: Any = None, extra: dict[str, Any] | None = None,
                           headers: dict[str, str] | None = None) -> int:
        """The prompt tokens a chat request (or a bare chat ``body``) would take (its messages,
        tools and template, after the chat_inlet hooks), loading the model that would answer it. An engine that answers
        whole chat requests counts them with its ``count_request(body)`` where it has one (the
        remote engine asks its upstream); else the request's messages are estimated at 4
        characters a token. ``headers``, when given, receives the response headers a reply to
        this request would carry (the model routing's)."""
        generation = await self._chat(_asked(body, extra), route=route, request=request, report=None, ignored=None,
                                      request_headers=None, received=time.perf_counter(), compact=False)
        if headers is not None:  # what the reply would say of itself (X-Localm-Model-Routing)
            headers.update(generation.headers)
        try:
            if generation.plan.chat is None:
                return len(generation.prompt)
            whole = generation.plan.chat.body
            counter = getattr(generation.hold.resident.engine, "count_request", None) \
                if generation.hold is not None else None
            if counter is not None:
                return int(await counter(whole))
            return max(1, -(-len(json.dumps(whole.get("messages") or whole.get("prompt") or "")) // 4))
        finally:
            if generation.hold is not None:  # nothing is generated: the model is free to unload
                generation.hold.release()

    # --- the steps of chat and complete -------------------------------------------------------
    async def _admit(self, kind: str, asked: ChatRequest, read: Any, *, route: str, request: Any,
                     report: bool | None, ignored: list[str] | None, request_headers: Any,
                     live: Live | None = None) -> tuple[Parsed, hooks.Chain, Interventions, dict[str, str], Any]:
        """Read the client's request, run the inlet hooks and read what they left, resolve the
        model, ask for steering, then check the fields against what was claimed: (the request
        as read, the hooks, the steering, headers, the model's registry entry or the refusal
        to raise for it)."""
        body = asked.body
        r = Reader(body, asked.origins)
        parsed = read(r)
        r.done()
        # the asked model's defaults (a Modelfile's system prompt, options, messages) fill what
        # the request leaves out, before the inlet hooks see it (defaults.py)
        asked_model = parsed.common.model
        resolved = self._resolve(asked, asked_model)  # resolved once: again only if an inlet hook changes it
        filled = defaults.apply(body, resolved, kind)
        if filled is not body:
            body = filled
            r = Reader(body, asked.origins)
            parsed = read(r)
            r.done()
        media = r.media
        caller = sdk.caller(request) if request is not None else None
        chain = hooks.Chain(self.host, route=route, streamed=parsed.common.stream, caller=caller)
        if request is not None:  # a client's turn (the service's own calls are no one's): the session log's
            chain.state.session_mode = self.host.session_mode(caller, request.headers.get(SESSION_HEADER))

        def check(hooked: dict[str, Any], plugin: str) -> Any:
            return self._reread(hooked, asked.origins, read, plugin, parsed.common)

        if live is not None:
            live.attach(chain, asked, parsed, resolved)
            live.session = chain.state.session_mode if request is not None else None
            if chain.inlets:
                live.enter("chat_hooks", "Running the chat plugins' inlet hooks")
        hooked, changed_by, checked = await chain.inlet(self._hooked(body, asked.extra, kind, chain), check)
        if live is not None:
            live.enter("processing", "Preparing the request")
        if changed_by:
            parsed, media = checked
        chain.state.media = media
        if parsed.common.model != asked_model:
            resolved = self._resolve(asked, parsed.common.model)
        found = self._route(resolved, parsed, chain)
        steering = await self._interventions(hooked, found)
        headers = self._fields(kind, asked, request, request_headers, report, ignored, chain, steering)
        if request is not None:
            headers[SESSION_HEADER] = chain.state.session_mode
        if chain.state.routing is not None and chain.state.routing.header is not None:
            headers["X-Localm-Model-Routing"] = routing.header_value(chain.state.routing.header)
        self._check_stream(parsed.options, parsed.common, chain, asked.origins)
        return parsed, chain, steering, headers, found

    def _route(self, found: Any, parsed: Parsed, chain: hooks.Chain) -> Any:
        """The model that answers: ``found`` (the one asked for, or the active one), or an
        installed model that has what the request needs when it is not pinned (routing.py)."""
        if isinstance(found, sdk.LocalmError):
            return found
        common, options = parsed.common, parsed.options
        parts = media_of(parsed.content) if isinstance(parsed.content, list) else []
        tools = options.tools is not None and options.tools.choice != "none"
        needs = routing.needs_of(images=any(p["type"] == "image" for p in parts),
                                 audio=any(p["type"] == "audio" for p in parts), tools=tools,
                                 required=common.required, min_context=common.min_context)
        if not needs:
            return found
        named = common.model not in (None, "", "localm")
        pinned = common.pin_model if common.pin_model is not None else named
        models = self.host.models
        route = routing.choose(found, models.registry.entries(), needs, pinned=pinned, requested=common.model,
                               loaded=models.resident)
        chain.state.routing = route
        return route.entry

    def _longer(self, entry: Any, common: Common, needed: int) -> Any:
        """The route to a model trained for a window of ``needed`` tokens, for a conversation too
        long for ``entry`` in a request that may be routed; None when it is pinned or none holds it."""
        named = common.model not in (None, "", "localm")
        if (common.pin_model if common.pin_model is not None else named):
            return None
        needs = routing.Needs(min_context=needed)
        route = routing.choose(entry, self.host.models.registry.entries(), needs, pinned=False,
                               requested=common.model, loaded=self.host.models.resident)
        return route if route.routed else None

    async def _early(self, asked: ChatRequest, received: float, run: Any) -> Generation:
        """Prepare a request with ``run(live)``. A streamed one still being prepared after
        OPEN_AFTER seconds opens its stream then: the generation returned sends the statuses
        of what preparing does (chat_hooks, processing, loading_model and the hooks' own) as
        they come, and a refusal from then on travels in band. Before that, and for a request
        not streamed, a refusal is raised here (an HTTP status)."""
        if asked.body.get("stream") is not True:
            return await run(None)
        live = Live("chat" if "messages" in asked.body else "completions")
        task = asyncio.ensure_future(run(live))
        try:
            await asyncio.wait({task}, timeout=OPEN_AFTER)
        except BaseException:
            _abandon(task)
            raise
        if task.done() or not live.may_open():
            return await task
        return self._opened_early(live, task, received)

    def _opened_early(self, live: Live, task: Any, received: float) -> Generation:
        """The generation of a stream that opens while its request is prepared by ``task``:
        named and shaped by the request as the client sent it (before the inlet hooks)."""
        chain, parsed, found = live.chain, live.parsed, live.found
        assert chain is not None and parsed is not None and live.asked is not None
        common, options = parsed.common, parsed.options
        state = chain.state
        if live.session is not None:
            state.answer_with({SESSION_HEADER: live.session})
        state.opened = True
        live.opened = True
        if live.phase is not None:  # what preparing does now (the inlet hooks' statuses came while they ran)
            state.statuses.insert(0 if live.phase.code == "chat_hooks" else len(state.statuses), live.phase)
        shown = common.model if common.model not in (None, "", "localm") else found.id
        messages = parsed.content if live.kind == "chat" else None
        generation = Generation(host=self.host, entry=found, prompt=[], fingerprint="", plan=pipeline.Plan(),
                                common=common, options=options, model=shown, received=received, chain=chain,
                                request=_read(live.asked, common, options, found, messages), preparing=task,
                                sent_headers=dict(state.headers))
        state.outcome_to_fill = generation.outcome  # a generation primed meanwhile fills the one surfaces read
        weakref.finalize(generation, _abandon_unadopted, task, live)  # a stream never read stops it
        return generation

    def _opening(self, asked: ChatRequest, found: Any, common: Common, options: Options, headers: dict[str, str],
                 received: float, chain: hooks.Chain, prepare: Any) -> Generation | None:
        """A streamed reply whose model is not loaded opens before it loads: a generation whose
        items() send a loading_model status, then finish ``prepare`` (refusals from then on
        travel in band). None when the request is prepared now: not streamed, a model already
        loaded, one a routing decision may change, or a refusal that is still an HTTP status."""
        if not common.stream or isinstance(found, sdk.LocalmError) or found.id in self.host.models.resident:
            return None
        if found.id in getattr(self.host.models, "forwards", {}):  # another instance answers it: no load here
            return None
        if getattr(found, "type", None) not in LOADS_WEIGHTS:  # an upstream or a Pipe: nothing to wait for,
            return None                                       # and its refusal is still an HTTP status (prime)
        if chain.state.routing is not None and chain.state.routing.routed:
            return None
        self.check_chat_model(found)  # refused before it loads, as an HTTP status
        chain.state.answer_with(headers)
        shown = common.model if common.model not in (None, "", "localm") else found.id
        return Generation(host=self.host, entry=found, prompt=[], fingerprint="", plan=pipeline.Plan(),
                          common=common, options=options, model=shown, received=received, chain=chain,
                          request=asked, pending=prepare)

    async def _hold(self, entry: Any, chain: hooks.Chain) -> tuple[Any, Any]:
        """(the hold on the model that answers, its entry): a model routed to is loaded for this
        request without becoming the active model; one that fails to load gives way to the next
        capable one, then to the model the request would otherwise use (``load_errors`` in the
        routing header says why)."""
        route = chain.state.routing
        if route is None or not route.routed:
            return await self.host.models.hold(entry.id), entry
        failures: dict[str, str] = {}
        live = chain.state.live
        for candidate in (route.entry, *route.fallbacks):
            if live is not None and candidate.id not in self.host.models.resident:
                live.enter("loading_model", f"Loading {candidate.id}")
            try:
                hold = await self.host.models.hold(candidate.id, activate=False)
            except sdk.LocalmError as exc:
                failures[candidate.id] = exc.detail
                continue
            if failures:
                self._reroute(chain, candidate, failures)
            return hold, candidate
        default = self.host.models.resolve(None)
        self._reroute(chain, default, failures)
        return await self.host.models.hold(default.id), default

    @staticmethod
    def _reroute(chain: hooks.Chain, entry: Any, failures: dict[str, str]) -> None:
        header = dict(chain.state.routing.header)
        header.update(resolved=entry.id, load_errors=failures)
        chain.state.routing = attrs.evolve(chain.state.routing, entry=entry, header=header)
        chain.state.headers["X-Localm-Model-Routing"] = routing.header_value(header)

    def _resolve(self, asked: ChatRequest, model: str | None) -> Any:
        """The registry entry for ``model``, the one request's resolve: the surface's own when
        it resolved this model; an unknown model's refusal is returned, to be raised where a
        generation is prepared (after the fields are checked, as before)."""
        if asked.entry is not None and model == asked.entry.id:
            return asked.entry
        try:
            return self.host.models.resolve(model)
        except sdk.LocalmError as exc:
            return exc

    @staticmethod
    def _hooked(body: dict[str, Any], extra: dict[str, Any] | None, kind: str, chain: hooks.Chain) -> dict[str, Any]:
        """The request the inlet hooks get: a copy of the body, with the client's fields the
        surface did not read (those the chat readers would take for their own stay out)."""
        if not chain.inlets:
            return body
        hooked = copy.deepcopy(body)
        for key, value in (extra or {}).items():
            if key not in hooked and key not in fields.USED[kind]:
                hooked[key] = copy.deepcopy(value)
        return hooked

    def _reread(self, hooked: dict[str, Any], origins: Origins, read: Any, plugin: str, before: Common) -> Any:
        """Read a request an inlet hook changed, as the client's was read (raising
        hooks.Unreadable with the reason when it cannot be), its places named by the client's
        origins still. A model it names must be registered. ``stream`` stays what the client
        asked for: the surface has already chosen how to answer."""
        try:
            r = Reader(hooked, origins)
            out = read(r)
            r.done()
        except Exception as exc:  # a refusal of the reader, or a value it could not handle at all
            raise hooks.Unreadable(exc.detail if isinstance(exc, sdk.LocalmError)
                                   else f"{type(exc).__name__}: {exc}") from None
        if out.common.model != before.model:
            try:
                self.host.models.resolve(out.common.model)
            except sdk.LocalmError as exc:
                raise sdk.LocalmError(exc.status, f"The {plugin} plugin changed the model to {out.common.model!r}: "
                                                  f"{exc.detail}", code=exc.code) from None
        common = attrs.evolve(out.common, stream=before.stream, include_usage=before.include_usage)
        return out._replace(common=common), r.media

    async def _interventions(self, body: dict[str, Any], entry: Any) -> Interventions:
        """Ask the forward_interventions hook for this request's steering (before any load)."""
        collected = Interventions()
        if isinstance(entry, sdk.LocalmError):
            return collected  # an unknown model: refused as such when the generation is prepared
        try:
            engine = self.host.models.engine_name(entry)
        except sdk.LocalmError:
            engine = ""  # no engine for this model: _prepare refuses it
        view = ModelView(id=entry.id, type=entry.type, engine=engine, capabilities=dict(entry.capabilities))
        await self.host.run_hook("forward_interventions", request=body, model=view, register=collected)
        return collected

    @staticmethod
    def _fields(kind: str, asked: ChatRequest, request: Any, request_headers: Any, report: bool | None,
                ignored: list[str] | None, chain: hooks.Chain, steering: Interventions) -> dict[str, str]:
        """Refuse what no one honours; the ignored-fields report's headers (maybe none)."""
        headers = request_headers if request_headers is not None else getattr(request, "headers", None)
        if report is None:
            report = request_headers is not None
        if not report or headers is None:
            return {}
        claims = chain.claims | steering.fields
        if ignored is None:  # an OpenAI body, as the client sent it
            used = fields.USED[kind] | claims
            fields.refuse_not_honoured(kind, asked.body, used, asked.origins)
            unused = fields.unused(kind, asked.body, used, asked.origins)
        else:
            unused = [where for where in ignored if not fields.claimed(where, claims)]
        where = request.url.path if request is not None else fields.ROUTE_NAMES[kind]
        return sdk.report_ignored(unused, headers, where, log=log)

    @staticmethod
    async def _place_media(engine: Any, media: list[dict[str, Any]], places: list[str], live: Live | None = None
                           ) -> tuple[tuple[spec.Media, int], ...]:
        """Ask the engine how many positions each image or sound takes (it encodes them now),
        numbering the parts for the prompt's placeholders: the Plan's media table. A model that
        cannot see (or hear) what the request holds is a 400 naming the first such part."""
        if not places:
            return ()
        caps = engine.capabilities
        for part in media:
            if not isinstance(engine, spec.MediaEngine) or not (caps.vision if part["type"] == "image"
                                                                  else caps.audio):
                said = "takes text only" if not (caps.vision or caps.audio) else \
                    f"does not take {'images' if part['type'] == 'image' else 'audio'}"
                raise sdk.LocalmError(400, f"{part['at']}: this model {said}", param=part["at"],
                                      code="media_unsupported")
        if len(media) != len(places):  # a place the reader found but no part: cannot happen; said if it does
            raise sdk.LocalmError(400, f"{places[0]}: this model takes text only", param=places[0])
        table = []
        for slot, part in enumerate(media):
            if "media" not in part:  # a clip, read now that a model that hears takes it
                fmt = part["format"]
                part["media"] = sdk.media.audio_from_base64(part["data"], fmt if isinstance(fmt, str) else "",
                                                            part["at"])
            if live is not None:  # an open stream says so while it encodes
                device = getattr(engine, "media_device", None)
                kind = "image" if part["type"] == "image" else "audio"
                live.enter(f"encoding_{kind}_{device}" if device in ("gpu", "cpu") else
                           "encoding_image" if kind == "image" else "encoding_audio_cpu",
                           f"Encoding {'an image' if kind == 'image' else 'audio'}"
                           + (f" on the {device.upper()}" if device in ("gpu", "cpu") else ""))
            try:
                tokens = await engine.media_tokens(part["media"])
            except spec.EngineError as exc:
                code = "invalid_image" if part["type"] == "image" else "invalid_audio"
                raise sdk.LocalmError(400, f"{part['at']}: {exc}", code=code, param=part["at"]) from None
            part["slot"], part["tokens"] = slot, tokens
            table.append((part["media"], tokens))
        if live is not None:
            live.enter("processing", "Preparing the request")
        return tuple(table)

    @staticmethod
    def _check_stream(options: Options, common: Common, chain: hooks.Chain, origins: Origins) -> None:
        """Log probabilities spell the text the model wrote: a stream a plugin may rewrite has none."""
        if options.logprobs is not None and common.stream and chain.streams:
            names = ", ".join(dict.fromkeys(impl.plugin for impl, _ in chain.streams))
            where = origins.name("logprobs")
            raise sdk.LocalmError(400, f"{where} cannot be honoured on a streamed reply while a chat plugin "
                                       f"rewrites the stream ({names}): ask for them without stream",
                                  code="field_not_honoured", field=where)

    def _prepare_messages(self, chat_request: ChatRequest, entry: Any, engine: Any, common: Common, options: Options,
                          headers: dict[str, str], received: float, chain: hooks.Chain,
                          steering: Interventions) -> Generation:
        """A generation for an engine that answers whole chat requests (an Open WebUI Pipe): it
        gets the request as the inlet hooks left it. What it cannot be told is refused."""
        caps = engine.capabilities
        if options.logprobs is not None and not caps.logprobs:
            raise sdk.LocalmError(400, f"{entry.id} does not report log probabilities",
                                  code="field_not_honoured", field=chat_request.origins.name("logprobs"))
        if steering.items or steering.reads:
            raise sdk.LocalmError(400, f"{entry.id} cannot be steered", code="field_not_honoured",
                                  field=min(steering.fields) if steering.fields else "steering")
        body = copy.deepcopy(chain.state.request)
        body["model"], body["stream"] = entry.id, common.stream
        chain.state.answer_with(headers)
        chain.state.model = entry.id
        routed = chain.state.routing is not None and chain.state.routing.routed
        shown = common.model if common.model not in (None, "", "localm") and not routed else entry.id
        return Generation(host=self.host, entry=entry, prompt=[], fingerprint=fingerprint(entry, engine),
                          plan=pipeline.Plan(chat=spec.ChatInput(body=body, context=chain.context),
                                             logprobs=options.logprobs, tools=options.tools,
                                             num_ctx=common.num_ctx, background=common.background),
                          common=common, options=options, model=shown, received=received,
                          chain=chain, request=chat_request)

    async def _prepare(self, chat_request: ChatRequest, entry: Any, common: Common, options: Options, render: Any,
                       headers: dict[str, str], received: float, chain: hooks.Chain, steering: Interventions,
                       fit: Any = None, media: list[dict[str, Any]] | None = None,
                       reroute: bool = False) -> Generation:
        host = self.host
        asked = common.sampling.max_tokens  # the client's own cap, checked against the window
        common = self._capped(common, headers)
        if isinstance(entry, sdk.LocalmError):
            raise entry
        sdk.annotate(model=entry.id, tokens_in=None)  # not the tokens an inlet hook's embedding read
        self.check_chat_model(entry)  # refused before it loads (and unloads another model)
        hold, entry = await self._hold(entry, chain)
        sdk.annotate(model=entry.id)
        with _released_on_error(hold) as resident:
            engine = resident.engine
            caps = engine.capabilities
            if caps.messages:  # it gets the request itself, images and audio included
                generation = self._prepare_messages(chat_request, entry, engine, common, options, headers, received,
                                                    chain, steering)
                generation.hold = hold
                if chain.state.outcome_to_fill is not None:  # an opened stream's, which its surface reads
                    generation.outcome = chain.state.outcome_to_fill
                if common.stream:
                    await generation.prime()
                return generation
            placed = await self._place_media(engine, media or [], chain.state.media, chain.state.live)
            constraint = options.constraint()
            if constraint is not None:
                if not caps.grammar:
                    raise sdk.LocalmError(400, f"The {engine.engine} engine cannot constrain output",
                                          code="response_format_unsupported")
                live = chain.state.live
                if live is not None:
                    live.enter("checking_grammar", "Checking the output grammar")
                engine.check_constraint(constraint)
                if live is not None:
                    live.enter("processing", "Preparing the request")
            if options.logprobs is not None and not caps.logprobs:
                raise sdk.LocalmError(400, f"The {engine.engine} engine does not report log probabilities",
                                      code="field_not_honoured", field=chat_request.origins.name("logprobs"))
            if (steering.items or steering.reads) and not caps.interventions:
                raise sdk.LocalmError(400, f"The {engine.engine} engine cannot steer a generation",
                                      code="field_not_honoured", field=min(steering.fields) if steering.fields
                                      else "steering")
            prompt, opened = render(engine)
            # the window grows up to the model's ceiling; past it the conversation goes to a model
            # trained for a longer one (when it may be routed), or is compacted, leaving room for
            # the whole reply the client asked for
            limit = caps.context_limit
            cap_name = chat_request.origins.name("max_tokens")
            if reroute and len(prompt) + max(asked or 0, 1) >= limit:
                longer = self._longer(entry, common, len(prompt) + (asked or compaction.reply_room(None, limit)))
                if longer is not None:
                    raise _Longer(longer)
            if asked is not None and asked >= limit:  # no prompt, however compacted, leaves that room
                pipeline.check_reply_fits(len(prompt), asked, limit, cap_name)
            room = asked if asked is not None else compaction.reply_room(common.sampling.max_tokens, limit)
            shortened = False
            if fit is not None and len(prompt) + room > limit:  # too long for the model: compact it
                try:
                    shorter = await fit(engine, entry, limit, room)
                except compaction.TooLong as exc:
                    if asked is not None and exc.least < limit:  # the prompt fits; the reply's room does not
                        pipeline.check_reply_fits(exc.least, asked, limit, cap_name, compacted=exc.compactable)
                    raise
                if shorter is not None:
                    (prompt, opened), shortened = shorter, True
            pipeline.check_fits(len(prompt), limit)
            if asked is not None:
                pipeline.check_reply_fits(len(prompt), asked, limit, cap_name, compacted=shortened)
        plan = pipeline.Plan(constraint=constraint, logprobs=options.logprobs, tools=options.tools,
                             reasoning=caps.reasoning and options.thinking is not False, thinking_open=opened,
                             interventions=tuple(steering.items), reads=tuple(r for r, _ in steering.reads),
                             window=min(limit, len(prompt) + room), num_ctx=common.num_ctx,
                             background=common.background, media=placed)
        headers.update(steering.headers)
        seed = common.sampling.seed
        if seed is not None:
            # the promise: the same seed and body repeat the reply, unless a reused prompt cache
            # can change the numbers on this engine
            scope = "request" if caps.cache_exact or not common.cache_prompt else "best-effort"
            headers.update({name: f'{seed};scope="{scope}"' for name in ("X-Localm-Seed", "X-miLLM-Seed")})
        if options.fmt is not None or options.grammar is not None:
            label = options.fmt.label if options.fmt is not None else "grammar"
            headers.update({"X-Localm-Constrained": label, "X-miLLM-Constrained": label})
        chain.state.answer_with(headers)
        chain.state.model = entry.id
        routed = chain.state.routing is not None and chain.state.routing.routed
        shown = common.model if common.model not in (None, "", "localm") and not routed else entry.id
        return Generation(host=host, entry=entry, prompt=prompt, fingerprint=fingerprint(entry, engine), plan=plan,
                          common=common, options=options, model=shown, received=received,
                          chain=chain, request=chat_request, reads=list(steering.reads), hold=hold)
