"""Compaction: a conversation too long for the answering model's context window is made to
fit, for this request only.

The system prompt (the leading system or developer messages) and the tool definitions are
kept whole; so are the most recent turns that fit beside them, the latest message always.
Everything older is summarised by the answering model itself (greedy, a few hundred
tokens), in pieces that fit its window when there is more of it than one pass can read,
each piece summarised together with the summary so far. The summary joins the system
prompt. Summaries are kept (per model, by the text they summarise), so the next turn of
the same conversation does not pay for them again.

What cannot fit even then (the tool definitions and the latest message alone fill the
window) is refused with a 413 that says so. A client's max_tokens is room the compacted
prompt must leave whole; when even the shortest prompt cannot leave it, the chat service
refuses the request with a 400 that names the cap (TooLong.least).
"""

from __future__ import annotations

import collections
import hashlib
from typing import Any

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
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if calls:
        content = "\n".join([content, *(f"[called {c.get('name')} with {c.get('arguments')}]" for c in calls)])
    return f"{_SPEAKERS.get(message.get('role'), message.get('role'))}: {content.strip()}"


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
                  window: int, room: int) -> tuple[list[int], bool, list[dict[str, Any]]] | None:
        """(the prompt, whether it opened a reasoning block, the compacted messages) of a
        conversation that fits ``window`` with ``room`` left; None when there is nothing older
        to summarise. Raises TooLong when it cannot fit."""
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
        budget = window - room - len(fixed) - MARGIN
        # the latest messages that fit beside the system prompt, the tools and a summary
        sizes = [len(engine.tokenize(_text(m), add_special=False, parse_special=False)) + 8 for m in rest]
        keep, used = 1, 0
        while keep < len(rest) and used + sizes[-keep - 1] <= budget:
            used += sizes[-keep - 1]
            keep += 1
        while keep > 1 and rest[-keep].get("role") == "tool":  # a result goes with the call before it
            keep -= 1
        older, tail = rest[:-keep], rest[-keep:]
        if not older:  # everything fits beside the summary's room: compacting gains nothing
            return None
        summary = await self.summarise(engine, model, older, window)
        compacted = [*self._with_summary(head, summary), *tail]
        prompt, opened = chat_tokens(engine, compacted, tools=tools, thinking=thinking)
        while len(prompt) + room > window and len(tail) > 1:  # the estimate was short: keep fewer turns
            older, tail = [*older, tail[0]], tail[1:]
            summary = await self.summarise(engine, model, older, window)
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

    async def summarise(self, engine: Any, model: str, older: list[dict[str, Any]], window: int) -> str:
        """The summary of ``older``, in pieces that each fit one pass of the model."""
        overhead = len(chat_tokens(engine, [{"role": "system", "content": INSTRUCTION},
                                            {"role": "user", "content": SUMMARY_HEAD}])[0])
        piece_budget = max(64, window - overhead - 2 * SUMMARY_TOKENS - MARGIN)
        pieces: list[list[str]] = [[]]
        size = 0
        for message in older:
            text = _text(message)
            ids = engine.tokenize(text, add_special=False, parse_special=False)
            if len(ids) > piece_budget:  # one message longer than a pass: its beginning and its end
                half = piece_budget // 2 - 4
                text = engine.detokenize(ids[:half]) + " [...] " + engine.detokenize(ids[-half:])
                ids = ids[:2 * half + 4]
            if size + len(ids) > piece_budget and pieces[-1]:
                pieces.append([])
                size = 0
            pieces[-1].append(text)
            size += len(ids) + 2
        summary = ""
        for piece in pieces:
            block = "\n".join(piece)
            key = (model, hashlib.sha256(f"{summary}\0{block}".encode()).hexdigest())
            found = self.summaries.get(key)
            if found is None:
                asked = (f"Summary so far:\n{summary}\n\nThe conversation continued:\n{block}" if summary
                         else f"The conversation:\n{block}")
                found = await self._generate(engine, [{"role": "system", "content": INSTRUCTION},
                                                      {"role": "user", "content": asked}])
                self.summaries[key] = found
                while len(self.summaries) > CACHE_SIZE:
                    self.summaries.popitem(last=False)
            else:
                self.summaries.move_to_end(key)
            summary = found
        return summary

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
