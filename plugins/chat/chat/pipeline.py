"""One generation, whatever route asked for it: run the engine, cut at stop sequences,
and report text pieces, status and the end. Surfaces (OpenAI here; Ollama, Anthropic and
Responses in their own plugins) only parse requests and render these events."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import AsyncIterator
from typing import Any, Sequence

import attrs
from localm import sdk
from localm.sdk import chat as chat_types
from localm.sdk import engines as spec

_ABSOLUTE_PATH = re.compile(r"(?<![\w.])/(?:[\w.+-]+/)+([\w.+-]+)")


# the reply's items, and a generation's end: the SDK's, so other plugins can name them
Status, Piece, Reasoning, Call = chat_types.Status, chat_types.Piece, chat_types.Reasoning, chat_types.Call


@attrs.frozen
class Plan:
    """What a generation needs besides the prompt and sampling."""
    constraint: spec.Constraint | None = None
    logprobs: int | None = None  # None: none; k: each content token with its k most likely alternatives
    tools: Any = None  # constrained.Tools: calls are read from the reply
    reasoning: bool = False  # the model may open a <think> block at the start of its reply
    thinking_open: bool = False  # the prompt already opened one
    interventions: tuple[spec.Intervention, ...] = ()  # steering for this request (forward_interventions)
    reads: tuple[spec.ActivationRead, ...] = ()  # residual reads for this request (forward_interventions)
    chat: spec.ChatInput | None = None  # the whole request, for an engine that answers messages
    window: int | None = None  # the window the prompt and its reply need (a growable engine opens it)
    num_ctx: int | None = None  # the window the client asked for
    background: bool = False  # a front end's background task: queued after interactive requests
    #: the request's images and sounds by slot: (Media, the positions it takes); the prompt holds
    #: each as a run of placeholder ids -(slot + 1) (see prompt.Prompt.tokens)
    media: tuple[tuple[spec.Media, int], ...] = ()


Outcome = chat_types.Outcome


def media_spans(prompt: Sequence[int], media: Sequence[tuple[spec.Media, int]]
                ) -> tuple[tuple[int, ...], tuple[spec.MediaSpan, ...]]:
    """A prompt whose media are placeholder runs (``-(slot + 1)``, as many as the media takes) as
    the engine takes it: the text's token ids, and a MediaSpan where each media sits."""
    if not media:
        return tuple(prompt), ()
    ids: list[int] = []
    spans: list[spec.MediaSpan] = []
    i = 0
    while i < len(prompt):
        token = prompt[i]
        if token >= 0:
            ids.append(token)
            i += 1
            continue
        item, tokens = media[-token - 1]
        spans.append(spec.MediaSpan(at=len(ids), media=item, tokens=tokens))
        i += tokens
    return tuple(ids), tuple(spans)


def redact(text: str) -> str:
    """Absolute paths never leave the server: keep the file name only."""
    return _ABSOLUTE_PATH.sub(r"\1", text)


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Splitter:
    """Splits the generated text into reasoning, visible content and tool-call blocks, and
    finds stop sequences in the visible text only.

    ``feed`` takes more text and returns what is decided, as ``(kind, start, end)`` ranges
    of the whole generated text: kind is "reasoning", "content", "call" or "stop" (then
    ``start`` is the stop sequence's index and ``end`` the stop's own index in ``stops``).
    Just enough text is held back to find a marker or stop sequence split across tokens.
    """

    def __init__(self, stops: tuple[str, ...], *, reasoning: bool = False, thinking_open: bool = False,
                 call_open: str | None = None, call_close: str | None = None) -> None:
        self.stops = stops
        self.call_open, self.call_close = call_open, call_close
        self.text = ""
        self.pos = 0
        self.mode = "think" if thinking_open else ("start" if reasoning else "content")
        self.trim = thinking_open  # leading whitespace after </think> is not content
        self.call_start = 0
        markers = [*stops, *([call_open] if call_open else [])]
        self.hold = max((len(m) for m in markers), default=1) - 1
        self.done = False

    def feed(self, more: str, final: bool = False) -> list[tuple[str, int, int]]:
        self.text += more
        out: list[tuple[str, int, int]] = []
        while not self.done:
            before = (self.mode, self.pos)
            getattr(self, "_" + self.mode)(out, final)
            if (self.mode, self.pos) == before:
                break
        return out

    def _start(self, out: list, final: bool) -> None:
        head = self.text[self.pos:].lstrip()
        if head.startswith(THINK_OPEN):
            self.pos = self.text.index(THINK_OPEN, self.pos) + len(THINK_OPEN)
            self.mode, self.trim = "think", True
        elif final or not THINK_OPEN.startswith(head):
            self.mode = "content"

    def _think(self, out: list, final: bool) -> None:
        at = self.text.find(THINK_CLOSE, self.pos)
        if at >= 0:
            if at > self.pos:
                out.append(("reasoning", self.pos, at))
            self.pos, self.mode = at + len(THINK_CLOSE), "content"
            return
        end = len(self.text) if final else max(self.pos, len(self.text) - (len(THINK_CLOSE) - 1))
        if end > self.pos:
            out.append(("reasoning", self.pos, end))
            self.pos = end

    def _content(self, out: list, final: bool) -> None:
        text = self.text
        if self.trim:
            while self.pos < len(text) and text[self.pos].isspace():
                self.pos += 1
            if self.pos == len(text):
                return
            self.trim = False
        hits = [(i, n) for n, s in enumerate(self.stops) if (i := text.find(s, self.pos)) >= 0]
        opened = text.find(self.call_open, self.pos) if self.call_open else -1
        stop = min(hits) if hits else None
        if stop is not None and (opened < 0 or stop[0] <= opened):
            if stop[0] > self.pos:
                out.append(("content", self.pos, stop[0]))
            out.append(("stop", stop[0], stop[1]))
            self.pos, self.done = stop[0], True
            return
        if opened >= 0:
            kept = len(text[self.pos:opened].rstrip())  # whitespace before a call is not content
            if kept:
                out.append(("content", self.pos, self.pos + kept))
            # the block's range starts with that whitespace, so a block left as text keeps it
            self.call_start, self.pos, self.mode = self.pos + kept, opened + len(self.call_open), "call"
            return
        end = len(text) if final else max(self.pos, len(text) - self.hold)
        if not final and self.call_open:  # trailing whitespace waits: a call may follow it
            end = self.pos + len(text[self.pos:end].rstrip())
        if end > self.pos:
            out.append(("content", self.pos, end))
            self.pos = end

    def _call(self, out: list, final: bool) -> None:
        at = self.text.find(self.call_close, self.pos)
        if at >= 0:
            self.pos, self.mode = at + len(self.call_close), "content"
            out.append(("call", self.call_start, self.pos))
        elif final:  # an unfinished call is left as text
            out.append(("content", self.call_start, len(self.text)))
            self.pos, self.mode = len(self.text), "content"


def check_fits(prompt_tokens: int, window: int) -> None:
    """A prompt that alone fills the window (the ceiling it can grow to) is a 413."""
    if prompt_tokens >= window:
        raise sdk.LocalmError(413, f"The prompt is {prompt_tokens} tokens; the model's context window is "
                                   f"{window} tokens, which leaves no room for a reply",
                              code="context_length_exceeded")


def check_reply_fits(prompt_tokens: int, max_tokens: int, window: int, name: str = "max_tokens", *,
                     compacted: bool = False) -> None:
    """A prompt that fits, with a client's reply cap (``name`` in the client's words) that does
    not fit beside it, is a 400: the reply would end at the window, short of what was asked."""
    if prompt_tokens + max_tokens <= window:
        return
    prompt = (f"Even after compaction the prompt takes {prompt_tokens} tokens" if compacted
              else f"The prompt is {prompt_tokens} tokens")
    room = window - prompt_tokens
    fix = f"set {name} to at most {room}" if room > 0 else f"lower {name}"
    raise sdk.LocalmError(400, f"{prompt} and {name} is {max_tokens}: {prompt_tokens + max_tokens} tokens, more than "
                               f"the model's context window of {window} tokens; {fix} or shorten the prompt",
                          code="context_length_exceeded", field=name)


async def run(engine: Any, prompt: list[int], common: Any, received: float, outcome: Outcome,
              metrics: Any = None, plan: Plan = Plan()) -> AsyncIterator[Status | Piece | Reasoning | Call]:
    """Generate, yielding status, text, reasoning and calls; fills ``outcome`` as it goes (and the
    metrics, when on)."""
    try:
        async for item in _run(engine, prompt, common, received, outcome, plan):
            yield item
    finally:
        if metrics is not None and outcome.ttft_ms is not None:
            metrics.observe_generation(prompt_tokens=outcome.prompt_tokens,
                                       generated_tokens=outcome.completion_tokens,
                                       ttft=outcome.ttft_ms / 1000, tokens_per_sec=outcome.tokens_per_sec)


def _entry(engine: Any, token: spec.Token) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        raw = engine.token_bytes(token_id)
        return {"id": token_id, "token": raw.decode("utf-8", errors="replace"), "bytes": list(raw),
                "logprob": logprob}
    entry = one(token.id, token.logprob if token.logprob is not None else -9999.0)
    entry["top"] = [one(i, lp) for i, lp in token.top]
    return entry


class _Ledger:
    """Which tokens spell which characters, so content pieces carry their tokens' probabilities."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int, dict[str, Any]]] = []
        self.next = 0

    def add(self, start: int, end: int, entry: dict[str, Any]) -> None:
        entry["at"] = start
        self.spans.append((start, max(end, start + 1), entry))  # a partial character counts as its next one

    def take(self, start: int, end: int) -> tuple[dict[str, Any], ...]:
        out = []
        while self.next < len(self.spans):
            a, b, entry = self.spans[self.next]
            if a >= end:
                break
            if b > start:
                out.append(entry)
            self.next += 1
        return tuple(out)


async def _run(engine: Any, prompt: list[int], common: Any, received: float, outcome: Outcome,
               plan: Plan) -> AsyncIterator[Status | Piece | Reasoning | Call]:
    from .constrained import TOOL_CLOSE, TOOL_OPEN, parse_calls

    outcome.prompt_tokens = len(prompt)
    outcome.context_capacity = engine.capabilities.context_window
    tools = plan.tools
    reading_calls = tools is not None and tools.choice != "none"
    splitter = Splitter(common.stops, reasoning=plan.reasoning, thinking_open=plan.thinking_open,
                        call_open=TOOL_OPEN if reading_calls else None, call_close=TOOL_CLOSE)
    ledger = _Ledger() if plan.logprobs is not None else None
    ids, spans = media_spans(prompt, plan.media)
    request = spec.GenerateRequest(prompt=ids, media=spans, sampling=common.sampling, cache_prompt=common.cache_prompt,
                                   constraint=plan.constraint, logprobs=plan.logprobs,
                                   interventions=plan.interventions, reads=plan.reads, chat=plan.chat,
                                   window=plan.window, num_ctx=plan.num_ctx, background=plan.background,
                                   speculation=common.spec_source)
    outcome.speculation = unspeculated(engine, common.spec_source)
    first_at = None
    ended = False

    def decided(parts: list[tuple[str, int, int]]) -> list[Any]:
        nonlocal ended
        items: list[Any] = []
        for kind, a, b in parts:
            if kind == "content":
                items.append(Piece(splitter.text[a:b], ledger.take(a, b) if ledger else ()))
            elif kind == "reasoning":
                items.append(Reasoning(splitter.text[a:b]))
            elif kind == "stop":
                outcome.finish_reason, outcome.stop_sequence = "stop", common.stops[b]
                ended = True
            elif kind == "call":
                block = splitter.text[a:b]
                text, calls = parse_calls(block, tools)
                if calls and (tools.parallel or not outcome.calls):
                    outcome.calls.extend(calls[:1] if not tools.parallel else calls)
                    items.extend(Call(c) for c in (calls[:1] if not tools.parallel else calls))
                    if not tools.parallel:
                        ended = True  # one call is the whole reply
                elif text.strip() and not outcome.calls:
                    items.append(Piece(text, ledger.take(a, b) if ledger else ()))
        return items

    events = engine.generate(request)
    held: list[Any] = []  # what the tokens read so far decided, while more tokens that came with them wait
    async with contextlib.aclosing(events):
        async for event in events:
            if held and not isinstance(event, spec.Token):
                for item in _joined(held):
                    yield item
                held = []
            if isinstance(event, spec.Queued):
                yield Status("waiting", "Waiting: another request is running on this model")
            elif isinstance(event, spec.Started):
                yield Status("generating", "Generating")
            elif isinstance(event, spec.Status):
                yield Status(event.code, event.text)
            elif isinstance(event, spec.Token):
                outcome.completion_tokens += 1
                outcome.token_ids.append(event.id)
                if first_at is None:
                    first_at = time.perf_counter()
                    outcome.ttft_ms = round((first_at - received) * 1000, 1)
                    outcome.context_capacity = engine.capabilities.context_window  # grown for this request
                if ledger is not None:
                    at = len(splitter.text)
                    ledger.add(at, at + len(event.text), _entry(engine, event))
                held.extend(decided(splitter.feed(event.text)))
                if held and (ended or not getattr(events, "ready", 0)):  # tokens that came together: one piece
                    for item in _joined(held):
                        yield item
                    held = []
                if ended:
                    if engine.capabilities.speculation and hasattr(events, "athrow"):
                        await _finish_quietly(events, outcome)
                    break
            elif isinstance(event, spec.Finished):
                outcome.activations = event.activations
                outcome.cached_tokens = event.cached_tokens
                if getattr(event, "speculation", None) is not None:
                    outcome.speculation = event.speculation
                outcome.context_capacity = engine.capabilities.context_window
                if plan.chat is not None:  # an engine that answers messages counts (or not) itself
                    outcome.prompt_tokens, outcome.completion_tokens = event.prompt_tokens, event.completion_tokens
                for item in decided(splitter.feed("", final=True)):
                    yield item
                if event.reason == "error":
                    outcome.finish_reason = "error"
                    outcome.error = redact(event.error or "generation failed")
                    yield Piece(f"\n[inference error: {outcome.error}]")
                elif not ended:
                    outcome.finish_reason = "length" if event.reason == "length" else "stop"
                    outcome.ended_by_model = event.reason == "stop"
                break
        for item in _joined(held):  # an event stream that ended without its Finished
            yield item
    if outcome.calls and outcome.finish_reason not in ("error", "length"):
        outcome.finish_reason, outcome.stop_sequence = "tool_calls", None
    if first_at is not None and outcome.completion_tokens:
        elapsed = time.perf_counter() - first_at
        if outcome.completion_tokens > 1 and elapsed > 0:
            outcome.tokens_per_sec = round((outcome.completion_tokens - 1) / elapsed, 2)


def _joined(items: list[Any]) -> list[Any]:
    """Consecutive pieces of text joined into one (and reasoning likewise): the tokens an engine
    handed over together travel as one message."""
    out: list[Any] = []
    for item in items:
        last = out[-1] if out else None
        if isinstance(item, Piece) and isinstance(last, Piece):
            out[-1] = Piece(last.text + item.text, last.logprobs + item.logprobs)
        elif isinstance(item, Reasoning) and isinstance(last, Reasoning):
            out[-1] = Reasoning(last.text + item.text)
        else:
            out.append(item)
    return out


async def _finish_quietly(events: Any, outcome: Outcome) -> None:
    """After a stop sequence: end the generation, and read its Finished for what drafting did
    (``usage.speculation``); the tokens decoded meanwhile are dropped."""
    try:
        event = await events.athrow(spec.Stop())
        while not isinstance(event, spec.Finished):
            event = await events.__anext__()
    except (spec.Stop, StopAsyncIteration):
        return
    if event.speculation is not None:
        outcome.speculation = event.speculation


def unspeculated(engine: Any, source: str | None) -> dict[str, Any] | None:
    """``usage.speculation`` for a request that asked for a draft source its engine does not
    draft with (the engine's own report replaces it when it speculates); None otherwise."""
    if source in (None, "off") or source in engine.capabilities.speculation:
        return None
    if source == "mtp":
        reason = "no-mtp-heads: this model has no Multi-Token Prediction heads its engine runs"
    else:
        reason = f"engine-unsupported: the {engine.engine} engine does not draft with {source}"
    return {"source": source, "state": "unavailable", "drafted": 0, "accepted": 0, "paused_steps": 0,
            "reason": reason}


def usage(outcome: Outcome, *, timings: bool = True, capacity: bool = True) -> dict[str, Any]:
    """OpenAI's usage block, with localm's fields: ``speculation`` (null unless a draft source
    was on), ``ttft_ms`` and ``tokens_per_sec`` (``timings``), ``context_capacity``."""
    out: dict[str, Any] = {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
                           "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
                           "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
                           "speculation": getattr(outcome, "speculation", None)}
    if timings:
        out["ttft_ms"] = outcome.ttft_ms
        out["tokens_per_sec"] = outcome.tokens_per_sec
    if capacity:
        out["context_capacity"] = outcome.context_capacity
    return out
