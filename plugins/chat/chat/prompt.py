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
"""

from __future__ import annotations

import json
import re
from typing import Any

from .constrained import TOOL_CLOSE, TOOL_OPEN, tools_prompt

_MARK = re.compile("\ue000(\\d+)\ue001")
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
EMPTY_THINK = "<think>\n\n</think>\n\n"


class Prompt:
    """The messages as the template sees them, with untrusted pieces set aside."""

    def __init__(self) -> None:
        self.untrusted: list[str] = []

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
            if m.get("untrusted_spans"):
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
                content = "\n".join(x for x in (content, *blocks) if x)
            out.append({"role": m["role"], "content": content})
        if tools is not None and tools.choice != "none":
            described = tools_prompt(tools)
            if out and out[0]["role"] == "system":
                out[0]["content"] = f"{out[0]['content']}\n\n{described}" if out[0]["content"] else described
            else:
                out.insert(0, {"role": "system", "content": described})
        return [{"role": m["role"], "content": m["content"]} for m in out]

    def tokens(self, engine: Any, text: str) -> list[int]:
        ids: list[int] = []
        at = 0
        for match in _MARK.finditer(text):
            if match.start() > at:
                ids += engine.tokenize(text[at:match.start()], add_special=not ids and at == 0, parse_special=True)
            piece = self.untrusted[int(match.group(1))]
            if piece:
                ids += engine.tokenize(piece, add_special=False, parse_special=False)
            at = match.end()
        if at < len(text):
            ids += engine.tokenize(text[at:], add_special=not ids and at == 0, parse_special=True)
        return ids


def chat_tokens(engine: Any, messages: list[dict[str, Any]], *, tools: Any = None,
                thinking: bool | None = None) -> tuple[list[int], bool]:
    """The prompt's tokens, and whether the reply starts inside a reasoning block."""
    prompt = Prompt()
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
    return prompt.tokens(engine, text), opened
