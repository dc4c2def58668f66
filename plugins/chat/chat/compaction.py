"""Compaction: a conversation too long for the answering model's context window is made to
fit, for this request only.

The system prompt (the leading system or developer messages) and the tool definitions are
kept whole; so are the most recent turns that fit beside them, the latest message always.
Everything older is summarised by the answering model itself (greedy, a few hundred
tokens), in pieces that fit its window when there is more of it than one pass can read,
each piece summarised together with the summary so far. The summary joins the system
prompt. Summaries are kept (per model, by the messages they cover), so the next turn of
the same conversation summarises only what became older since.

What cannot fit even then (the tool definitions and the latest message alone fill the
window) is refused with a 413 that says so.

Compaction's own work is bounded before it starts (:class:`Budget`): one request may have
at most ``max_tokens`` tokens of older conversation summarised, or one pass of the model
when that is more (summaries kept from earlier turns cost nothing, so a chat that grows a
turn at a time keeps compacting), and may spend at most ``seconds`` doing so; a
conversation that would take more is refused with a 413 naming the bound, before the
model reads any of it. A
conversation of more messages than the window and that bound could hold together is
refused before it is even rendered (:func:`check_count`). A client's max_tokens is room the compacted
prompt must leave whole; when even the shortest prompt cannot leave it, the chat service
refuses the request with a 400 that names the cap (TooLong.least).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from typing import Any

import attrs

from localm import sdk
from localm.sdk import engines as spec

from .prompt import chat_tokens

#: Tokens of a compacted prompt's window left for the reply when the request sets no max_tokens.
REPLY_ROOM = 256
#: The most tokens a summary may take.
SUMMARY_TOKENS = 192
#: Kept for the template's own tokens around the summary and each message.
MARGIN = 48
SUMMARY_HEAD = "Summary of the earlier conversation (compacted to fit the context window):"
INSTRUCTION = ("You summarise conversations for an assistant that will continue them. Write a short summary of "
               "the conversation you are given: who said what, names, numbers, decisions, and what the user still "
               "wants. Write only the summary, in at most 120 words.")
CACHE_SIZE = 128

_SPEAKERS = {"user": "User", "assistant": "Assistant", "tool": "Tool result", "system": "System",
             "developer": "System"}


def reply_room(max_tokens: int | None, window: int) -> int:
    """The room a prompt must leave for a reply whose cap the client did not set (the chat
    plugin's default cap, or none) before it is compacted."""
    return max(1, min(max_tokens if max_tokens else REPLY_ROOM, window // 4))


def _text(message: dict[str, Any]) -> str:
    """A message as the summary reads it; an image or a sound in it is named, never split: a
    message kept whole keeps its media, a summarised one leaves them out."""
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "".join(p["text"] if p["type"] == "text" else f"[{p['type']}]" for p in content)
    calls = message.get("tool_calls") or []
    if calls:
        content = "\n".join([content, *(f"[called {c.get('name')} with {c.get('arguments')}]" for c in calls)])
    return f"{_SPEAKERS.get(message.get('role'), message.get('role'))}: {content.strip()}"


#: Defaults of the chat plugin's compaction_max_tokens and compaction_timeout settings.
MAX_TOKENS = 8192
TIMEOUT = 600.0


@attrs.frozen
class Budget:
    """What one request's compaction may spend: ``max_tokens`` of older conversation read
    by the model (at least one pass of it; 0: compaction is off) and ``seconds`` of its time."""
    max_tokens: int = MAX_TOKENS
    seconds: float = TIMEOUT


def _over_budget(detail: str) -> sdk.LocalmError:
    return sdk.LocalmError(413, f"{detail}: send a shorter conversation (or start a new one), or raise the chat "
                                "plugin's compaction_max_tokens", code="context_length_exceeded")


def check_count(messages: list[Any], window: int, budget: Budget) -> None:
    """Refuse, before anything is rendered, a conversation of more messages than the window
    and compaction's budget could hold together (each message takes at least one token)."""
    if len(messages) > window + budget.max_tokens:
        raise _over_budget(f"The conversation holds {len(messages)} messages: more than the model's window "
                           f"({window} tokens) and what compaction summarises for one request "
                           f"({budget.max_tokens} tokens) could hold even at one token a message")


class TooLong(sdk.LocalmError):
    """``least``: the fewest tokens the prompt could take (by compaction's estimate);
    ``compactable``: False when there was nothing older to summarise."""

    def __init__(self, detail: str, least: int, compactable: bool = True) -> None:
        super().__init__(413, detail, code="context_length_exceeded")
        self.least, self.compactable = least, compactable


class Compactor:
    """One per chat service: the summaries it has made, most recent last."""

    def __init__(self) -> None:
        self.summaries: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()

    async def fit(self, engine: Any, model: str, messages: list[dict[str, Any]], *, tools: Any, thinking: Any,
                  window: int, room: int, budget: Budget = Budget()
                  ) -> tuple[list[int], bool, list[dict[str, Any]]] | None:
        """(the prompt, whether it opened a reasoning block, the compacted messages) of a
        conversation that fits ``window`` with ``room`` left; None when there is nothing older
        to summarise. Raises TooLong when it cannot fit, and a 413 when fitting it would cost
        more than ``budget``."""
        try:
            async with asyncio.timeout(budget.seconds):
                return await self._fit(engine, model, messages, tools=tools, thinking=thinking, window=window,
                                       room=room, budget=budget)
        except TimeoutError:
            raise _over_budget(f"Compaction did not finish within {budget.seconds:g} seconds (the chat plugin's "
                               "compaction_timeout)") from None

    async def _fit(self, engine: Any, model: str, messages: list[dict[str, Any]], *, tools: Any, thinking: Any,
                   window: int, room: int, budget: Budget) -> tuple[list[int], bool, list[dict[str, Any]]] | None:
        lead = 0
        while lead < len(messages) and messages[lead].get("role") in ("system", "developer"):
            lead += 1
        head, rest = messages[:lead], messages[lead:]
        if len(rest) < 2:  # nothing older to summarise
            raise self._too_long(engine, head, rest[-1] if rest else {"role": "user", "content": ""}, tools,
                                 thinking, window, room, compactable=False)
        stub = self._with_summary(head, "x " * SUMMARY_TOKENS)
        fixed, _ = chat_tokens(engine, [*stub, rest[-1]], tools=tools, thinking=thinking)
        if len(fixed) + room > window:
            raise self._too_long(engine, head, rest[-1], tools, thinking, window, room, least=len(fixed))
        space = window - room - len(fixed) - MARGIN
        # the latest messages that fit beside the system prompt, the tools and a summary
        sizes = [len(engine.tokenize(_text(m), add_special=False, parse_special=False)) + 8 for m in rest]
        keep, used = 1, 0
        while keep < len(rest) and used + sizes[-keep - 1] <= space:
            used += sizes[-keep - 1]
            keep += 1
        while keep > 1 and rest[-keep].get("role") == "tool":  # a result goes with the call before it
            keep -= 1
        older, tail = rest[:-keep], rest[-keep:]
        if not older:  # everything fits beside the summary's room: compacting gains nothing
            return None
        # tokens the model may still be given to summarise: the setting, or one pass when more
        left = [max(budget.max_tokens, self._pass_tokens(engine, window)) if budget.max_tokens else 0]
        summary = await self.summarise(engine, model, older, window, left)
        compacted = [*self._with_summary(head, summary), *tail]
        prompt, opened = chat_tokens(engine, compacted, tools=tools, thinking=thinking)
        while len(prompt) + room > window and len(tail) > 1:  # the estimate was short: keep fewer turns
            over = len(prompt) + room - window
            while len(tail) > 1 and over > 0:  # as many of the oldest kept turns as the excess takes
                over -= sizes[len(rest) - len(tail)]
                older, tail = [*older, tail[0]], tail[1:]
            summary = await self.summarise(engine, model, older, window, left)
            compacted = [*self._with_summary(head, summary), *tail]
            prompt, opened = chat_tokens(engine, compacted, tools=tools, thinking=thinking)
        if len(prompt) >= window:
            raise self._too_long(engine, head, rest[-1], tools, thinking, window, room, least=len(prompt))
        return prompt, opened, compacted

    @staticmethod
    def _with_summary(head: list[dict[str, Any]], summary: str) -> list[dict[str, Any]]:
        note = f"{SUMMARY_HEAD}\n{summary.strip()}"
        if head:
            first = dict(head[0])
            if isinstance(first.get("content"), list):  # a system message with an image in it
                first["content"] = [*first["content"], {"type": "text", "text": f"\n\n{note}"}]
            else:
                first["content"] = f"{first.get('content') or ''}\n\n{note}".lstrip()
            return [first, *head[1:]]
        return [{"role": "system", "content": note}]

    @staticmethod
    def _too_long(engine: Any, head: list[dict[str, Any]], last: dict[str, Any], tools: Any, thinking: Any,
                  window: int, room: int, least: int | None = None, compactable: bool = True) -> TooLong:
        alone, _ = chat_tokens(engine, [*head, last], tools=tools, thinking=thinking)
        parts = "the system prompt, the tool definitions and the latest message" if tools is not None else \
            "the system prompt and the latest message"
        return TooLong(f"The conversation does not fit the model's context window even after compaction: {parts} "
                       f"alone take {len(alone)} tokens, and the window is {window} tokens with {room} left for "
                       f"the reply", max(len(alone), least or 0), compactable)

    async def summarise(self, engine: Any, model: str, older: list[dict[str, Any]], window: int,
                        left: list[int] | None = None) -> str:
        """The summary of ``older``, written a pass of the model at a time: each pass reads the
        summary so far and the messages after it that fit. A summary is kept for the messages
        up to where each pass ended, so a later turn of the same conversation summarises only
        the messages that became older since. ``left`` holds the tokens the model may still be
        given to read: more than it holds is a 413, before the model reads anything."""
        per_pass = self._pass_tokens(engine, window)
        texts = [self._clipped(engine, _text(m), per_pass) for m in older]
        rolling = hashlib.sha256(model.encode())
        keys = []
        for text, _ in texts:  # keys[i]: the first i + 1 messages
            rolling.update(b"\0" + text.encode())
            keys.append((model, rolling.hexdigest()))
        start = next((i + 1 for i in range(len(keys) - 1, -1, -1) if keys[i] in self.summaries), 0)
        summary = self.summaries[keys[start - 1]] if start else ""
        if start:
            self.summaries.move_to_end(keys[start - 1])
        if left is not None:
            needed = sum(tokens for _, tokens in texts[start:])
            if needed > left[0]:
                raise _over_budget(f"Compacting this conversation means summarising {needed} tokens of it, more "
                                   f"than the {left[0]} one request may have summarised")
            left[0] -= needed
        i = start
        while i < len(texts):
            block, size = [], 0
            while i < len(texts) and (not block or size + texts[i][1] <= per_pass):
                block.append(texts[i][0])
                size += texts[i][1]
                i += 1
            joined = "\n".join(block)
            asked = (f"Summary so far:\n{summary}\n\nThe conversation continued:\n{joined}" if summary
                     else f"The conversation:\n{joined}")
            summary = await self._generate(engine, [{"role": "system", "content": INSTRUCTION},
                                                    {"role": "user", "content": asked}])
            self.summaries[keys[i - 1]] = summary
            while len(self.summaries) > CACHE_SIZE:
                self.summaries.popitem(last=False)
        return summary

    @staticmethod
    def _pass_tokens(engine: Any, window: int) -> int:
        """How many tokens of conversation one summarising pass of the model reads."""
        overhead = len(chat_tokens(engine, [{"role": "system", "content": INSTRUCTION},
                                            {"role": "user", "content": SUMMARY_HEAD}])[0])
        return max(64, window - overhead - 2 * SUMMARY_TOKENS - MARGIN)

    @staticmethod
    def _clipped(engine: Any, text: str, per_pass: int) -> tuple[str, int]:
        """A message's text and its tokens; one longer than a pass keeps its beginning and end."""
        ids = engine.tokenize(text, add_special=False, parse_special=False)
        if len(ids) > per_pass:
            half = per_pass // 2 - 4
            text = engine.detokenize(ids[:half]) + " [...] " + engine.detokenize(ids[-half:])
            return text, 2 * half + 6
        return text, len(ids) + 2

    @staticmethod
    async def _generate(engine: Any, messages: list[dict[str, Any]]) -> str:
        prompt, _ = chat_tokens(engine, messages, thinking=False)
        request = spec.GenerateRequest(prompt=tuple(prompt), cache_prompt=False, window=len(prompt) + SUMMARY_TOKENS,
                                       sampling=spec.Sampling(max_tokens=SUMMARY_TOKENS, temperature=0.0,
                                                              repeat_penalty=1.1))
        out: list[str] = []
        async for event in engine.generate(request):
            if isinstance(event, spec.Token):
                out.append(event.text)
            elif isinstance(event, spec.Finished):
                if event.reason == "error":
                    raise sdk.LocalmError(500, f"Compaction failed: the model could not summarise the earlier "
                                               f"conversation ({event.error})", code="compaction_failed")
                break
        text = "".join(out).strip()
        return text or "(nothing to note)"
