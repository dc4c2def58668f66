"""One generation, whatever route asked for it: run the engine, cut at stop sequences,
and report text pieces, status and the end. Surfaces (OpenAI here; Ollama, Anthropic and
Responses in their own plugins) only parse requests and render these events."""

from __future__ import annotations

import contextlib
import re
import time
from typing import Any, AsyncIterator

import attrs

from localm import sdk
from localm.sdk import engines as spec

_ABSOLUTE_PATH = re.compile(r"(?<![\w.])/(?:[\w.+-]+/)+([\w.+-]+)")


@attrs.frozen
class Status:
    code: str
    text: str


@attrs.frozen
class Piece:
    text: str


@attrs.define
class Outcome:
    finish_reason: str = "stop"
    stop_sequence: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float | None = None
    tokens_per_sec: float | None = None
    context_capacity: int = 0
    error: str | None = None


def redact(text: str) -> str:
    """Absolute paths never leave the server: keep the file name only."""
    return _ABSOLUTE_PATH.sub(r"\1", text)


class StopCutter:
    """Holds back just enough text to find a stop sequence split across tokens."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.keep = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """The text that is safe to emit now; sets ``matched`` when a stop sequence appears."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            index, stop = min(hits)
            self.matched = stop
            out, self.pending = self.pending[:index], ""
            return out
        cut = max(0, len(self.pending) - self.keep)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def check_fits(prompt_tokens: int, window: int) -> None:
    if prompt_tokens >= window:
        raise sdk.LocalmError(413, f"The prompt is {prompt_tokens} tokens; the model's context window is "
                                   f"{window} tokens, which leaves no room for a reply",
                              code="context_length_exceeded")


async def run(engine: Any, prompt: list[int], common: Any, received: float, outcome: Outcome,
              metrics: Any = None) -> AsyncIterator[Status | Piece]:
    """Generate, yielding status and text; fills ``outcome`` as it goes (and the metrics, when on)."""
    try:
        async for item in _run(engine, prompt, common, received, outcome):
            yield item
    finally:
        if metrics is not None and outcome.ttft_ms is not None:
            metrics.observe_generation(prompt_tokens=outcome.prompt_tokens,
                                       generated_tokens=outcome.completion_tokens,
                                       ttft=outcome.ttft_ms / 1000, tokens_per_sec=outcome.tokens_per_sec)


async def _run(engine: Any, prompt: list[int], common: Any, received: float,
               outcome: Outcome) -> AsyncIterator[Status | Piece]:
    outcome.prompt_tokens = len(prompt)
    outcome.context_capacity = engine.capabilities.context_window
    cutter = StopCutter(common.stops)
    request = spec.GenerateRequest(prompt=tuple(prompt), sampling=common.sampling, cache_prompt=common.cache_prompt)
    first_at = None
    events = engine.generate(request)
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, spec.Queued):
                yield Status("waiting", "Waiting: another request is running on this model")
            elif isinstance(event, spec.Started):
                yield Status("generating", "Generating")
            elif isinstance(event, spec.Token):
                outcome.completion_tokens += 1
                if first_at is None:
                    first_at = time.perf_counter()
                    outcome.ttft_ms = round((first_at - received) * 1000, 1)
                text = cutter.feed(event.text)
                if text:
                    yield Piece(text)
                if cutter.matched is not None:
                    outcome.finish_reason = "stop"
                    outcome.stop_sequence = cutter.matched
                    break
            elif isinstance(event, spec.Finished):
                rest = cutter.flush()
                if rest:
                    yield Piece(rest)
                if event.reason == "error":
                    outcome.finish_reason = "error"
                    outcome.error = redact(event.error or "generation failed")
                    yield Piece(f"\n[inference error: {outcome.error}]")
                else:
                    outcome.finish_reason = "length" if event.reason == "length" else "stop"
                break
    if first_at is not None and outcome.completion_tokens:
        elapsed = time.perf_counter() - first_at
        if outcome.completion_tokens > 1 and elapsed > 0:
            outcome.tokens_per_sec = round((outcome.completion_tokens - 1) / elapsed, 2)


def usage(outcome: Outcome, *, timings: bool = True, capacity: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
                           "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}
    if timings:
        out["ttft_ms"] = outcome.ttft_ms
        out["tokens_per_sec"] = outcome.tokens_per_sec
    if capacity:
        out["context_capacity"] = outcome.context_capacity
    return out
