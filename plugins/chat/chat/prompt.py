"""From the request's messages to prompt tokens.

- Tools are described in the system message; earlier assistant tool calls and tool
  results are written out as text, in order (tool results as a user turn, since most chat
  templates know no tool role).
- Untrusted text (a message's ``untrusted_spans``, every tool result) is tokenised with
  special-token parsing off, so a control token spelled inside it stays ordinary text. The
  template is rendered with a private-use marker in place of each untrusted piece; the
  rendered text is then tokenised piece by piece.
- ``enable_thinking`` is handed to the template; a reasoning model whose template ignores
  it is given an empty ``<think>`` block to answer without reasoning.
- An image or a sound (a media part, whose ``tokens`` and ``slot`` the chat service set) is
  handed to the template as ``{"type": "image"}`` / ``{"type": "audio"}``; the engine's template
  writes its ``media_marker`` there, and the prompt holds ``tokens`` placeholder ids
  ``-(slot + 1)`` in its place, so counting the prompt counts the positions the media take.
  :func:`localm.plugins.chat.pipeline.media_spans` turns them into the engine's MediaSpans.
"""

from __future__ import annotations

import json
import re
from typing import Any

from localm import sdk

from .constrained import TOOL_CLOSE, TOOL_OPEN, tools_prompt

_MARK = re.compile("\ue000(\\d+)\ue001")
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
EMPTY_THINK = "<think>\n\n</think>\n\n"


class Prompt:
    """The messages as the template sees them, with untrusted pieces set aside."""

    def __init__(self) -> None:
        self.untrusted: list[str] = []
        self.media: list[dict[str, Any]] = []  # the media parts shown to the template, in order

    def parts(self, content: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A content list as the template sees it: text parts, and a bare part for each media."""
        out = []
        for part in content:
            if part["type"] == "text":
                out.append({"type": "text", "text": part["text"]})
            else:
                self.media.append(part)
                out.append({"type": part["type"]})
        return out

    def mark(self, text: str) -> str:
        self.untrusted.append(text)
        return f"\ue000{len(self.untrusted) - 1}\ue001"

    def spans(self, content: str, spans: list[list[int]]) -> str:
        out, at = [], 0
        for a, b in spans:
            a = max(a, at)
            if b <= a:
                continue
            out += [content[at:a], self.mark(content[a:b])]
            at = b
        return "".join(out) + content[at:]

    def messages(self, messages: list[dict[str, Any]], tools: Any = None) -> list[dict[str, str]]:
        out: list[dict[str, Any]] = []
        names: dict[str, str] = {}
        for m in messages:
            content = m["content"]
            if isinstance(content, list):
                content = self.parts(content)
            elif m.get("untrusted_spans"):
                content = self.spans(content, m["untrusted_spans"])
            if m["role"] == "tool":
                name = m.get("name") or names.get(m.get("tool_call_id") or "")
                head = f'<tool_response name="{name}">' if name else RESULT_OPEN
                # a result cannot close its own fence
                result = self.mark(m["content"].replace(RESULT_CLOSE, "<\\/tool_response>"))
                text = f"{head}\n{result}\n{RESULT_CLOSE}"
                if out and out[-1].get("results"):
                    out[-1]["content"] += "\n" + text
                else:
                    out.append({"role": "user", "content": text, "results": True})
                continue
            if m["role"] == "assistant" and m.get("tool_calls"):
                blocks = []
                for call in m["tool_calls"]:
                    if call.get("id"):
                        names[call["id"]] = call["name"]
                    arguments = call["arguments"]
                    written = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
                    blocks.append(f'{TOOL_OPEN}\n{{"name": {json.dumps(call["name"])}, "arguments": {written}}}\n'
                                  f"{TOOL_CLOSE}")
                if isinstance(content, list):
                    content = [*content, {"type": "text", "text": "\n" + "\n".join(blocks)}]
                else:
                    content = "\n".join(x for x in (content, *blocks) if x)
            out.append({"role": m["role"], "content": content})
        if tools is not None and tools.choice != "none":
            described = tools_prompt(tools)
            if out and out[0]["role"] == "system" and isinstance(out[0]["content"], list):
                out[0]["content"] = [*out[0]["content"], {"type": "text", "text": f"\n\n{described}"}]
            elif out and out[0]["role"] == "system":
                out[0]["content"] = f"{out[0]['content']}\n\n{described}" if out[0]["content"] else described
            else:
                out.insert(0, {"role": "system", "content": described})
        return [{"role": m["role"], "content": m["content"]} for m in out]

    def tokens(self, engine: Any, text: str) -> list[int]:
        ids: list[int] = []
        at = 0
        marks = _MARK
        if self.media:  # the engine's template wrote its marker where each media part was
            marks = re.compile(f"{_MARK.pattern}|(?P<media>{re.escape(engine.media_marker)})")
        seen = 0
        for match in marks.finditer(text):
            if match.start() > at:
                ids += engine.tokenize(text[at:match.start()], add_special=not ids and at == 0, parse_special=True)
            at = match.end()
            if match.group(1) is None:  # a media marker
                if seen < len(self.media):
                    part = self.media[seen]
                    ids += [-(part["slot"] + 1)] * part["tokens"]
                seen += 1
                continue
            piece = self.untrusted[int(match.group(1))]
            if piece:
                ids += engine.tokenize(piece, add_special=False, parse_special=False)
        if seen != len(self.media):
            raise sdk.LocalmError(400, f"This model's chat template placed {seen} of the request's {len(self.media)} "
                                       "image or audio parts", code="chat_template_error")
        if at < len(text):
            ids += engine.tokenize(text[at:], add_special=not ids and at == 0, parse_special=True)
        return ids


def continued(messages: list[dict[str, Any]]) -> str | None:
    """The partial reply a conversation ends with (a trailing assistant message with text and
    no tool calls, after at least one other message: a front end's Continue, Anthropic's
    prefill), which the model continues; None for a conversation that asks for a new reply."""
    if len(messages) < 2:
        return None
    last = messages[-1]
    content = last.get("content")
    if last.get("role") != "assistant" or last.get("tool_calls") or not isinstance(content, str) or not content:
        return None
    return content


def chat_tokens(engine: Any, messages: list[dict[str, Any]], *, tools: Any = None,
                thinking: bool | None = None) -> tuple[list[int], bool]:
    """The prompt's tokens, and whether the reply starts inside a reasoning block. A trailing
    partial reply (see ``continued``) follows the generation prompt as the start of the reply,
    read as plain text (a control token spelled in it stays text), so the model continues it."""
    prompt = Prompt()
    prefill = continued(messages)
    if prefill is not None:
        messages = messages[:-1]
    shown = prompt.messages(messages, tools)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    text = engine.render_chat(shown, template_kwargs=kwargs)
    tail = text.rstrip()
    if thinking is False and engine.capabilities.reasoning and not tail.endswith("</think>"):
        if tail.endswith("<think>"):
            text = text + "\n</think>\n\n"
        else:
            text += EMPTY_THINK
    opened = text.rstrip().endswith("<think>")
    if prefill is not None:
        opened = opened and "</think>" not in prefill
        text += prompt.mark(prefill)
    return prompt.tokens(engine, text), opened
