"""The chat pipeline's splitter: reasoning, visible text, tool-call blocks and stop sequences,
fed token by token in every possible cut of the text."""

from __future__ import annotations

from typing import Any

import pytest

from localm.sdk.testing import plugin_module


def _pipeline() -> Any:
    # the chat plugin's pipeline module, imported as the plugin host names it
    return plugin_module("chat", "chat.pipeline")


def split(text: str, step: int, **kwargs: Any) -> dict[str, Any]:
    s = _pipeline().Splitter(**kwargs)
    parts: list[tuple[str, int, int]] = []
    for i in range(0, len(text), step):
        parts += s.feed(text[i:i + step])
    parts += s.feed("", final=True)
    out: dict[str, Any] = {"reasoning": "", "content": "", "calls": [], "stop": None}
    for kind, a, b in parts:
        if kind == "stop":
            out["stop"] = kwargs["stops"][b]
        elif kind == "call":
            out["calls"].append(text[a:b].strip())
        else:
            out[kind] += text[a:b]
        if out["stop"]:
            break
    return out


@pytest.mark.parametrize("step", [1, 2, 3, 7, 100])
def test_reasoning_is_split_from_the_answer(step: int) -> None:
    got = split("<think>\nThe user greets.\n</think>\n\nHello!", step, stops=(), reasoning=True)
    assert got == {"reasoning": "\nThe user greets.\n", "content": "Hello!", "calls": [], "stop": None}


@pytest.mark.parametrize("step", [1, 4, 100])
def test_a_prompt_that_opened_the_block(step: int) -> None:
    got = split("Thinking.</think>Answer", step, stops=(), reasoning=True, thinking_open=True)
    assert got["reasoning"] == "Thinking." and got["content"] == "Answer"


@pytest.mark.parametrize("step", [1, 5, 100])
def test_a_reply_without_reasoning(step: int) -> None:
    assert split("Hi <think> is a tag", step, stops=(), reasoning=True)["content"] == "Hi <think> is a tag"
    assert split("  <thin", step, stops=(), reasoning=True)["content"] == "  <thin"


@pytest.mark.parametrize("step", [1, 3, 100])
def test_stop_sequences_apply_to_the_answer_only(step: int) -> None:
    got = split("<think>wait END no</think>fine END more", step, stops=("END",), reasoning=True)
    assert got == {"reasoning": "wait END no", "content": "fine ", "calls": [], "stop": "END"}


@pytest.mark.parametrize("step", [1, 3, 6, 100])
def test_tool_calls_are_cut_out_whole(step: int) -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {"x": "STOP"}}\n</tool_call>'
    got = split(f"Let me check.\n{call}\n{call}", step, stops=("STOP",), call_open="<tool_call>",
                call_close="</tool_call>")
    assert got["content"] == "Let me check." and got["calls"] == [call, call] and got["stop"] is None


@pytest.mark.parametrize("step", [1, 3, 4, 100])
def test_an_unfinished_call_stays_text(step: int) -> None:
    text = 'Hi <tool_call>\n{"name": "f"'
    got = split(text, step, stops=(), call_open="<tool_call>", call_close="</tool_call>")
    assert got["content"] == text and got["calls"] == []
