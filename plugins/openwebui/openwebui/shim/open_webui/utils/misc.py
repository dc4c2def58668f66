"""The message helpers of Open WebUI's ``open_webui.utils.misc`` that Functions use, with the
same names, arguments and results: reading the last user or assistant message, the system
message, and OpenAI chat-completion templates for what a Pipe returns."""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any


def get_content_from_message(message: dict[str, Any]) -> str | None:
    """A message's text: its string content, or the first text part of a list of parts."""
    content = message.get("content")
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                return part.get("text")
        return None
    return content


def _last(messages: list[dict[str, Any]], role: str) -> dict[str, Any] | None:
    for message in reversed(messages or []):
        if message.get("role") == role:
            return message
    return None


def get_last_user_message_item(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    return _last(messages, "user")


def get_last_user_message(messages: list[dict[str, Any]]) -> str | None:
    message = _last(messages, "user")
    return get_content_from_message(message) if message is not None else None


def get_last_assistant_message_item(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    return _last(messages, "assistant")


def get_last_assistant_message(messages: list[dict[str, Any]]) -> str | None:
    message = _last(messages, "assistant")
    return get_content_from_message(message) if message is not None else None


def get_messages_content(messages: list[dict[str, Any]]) -> str:
    """The conversation as text, one ``ROLE: text`` line per message."""
    return "\n".join(f"{m.get('role', '').upper()}: {get_content_from_message(m)}" for m in messages)


def get_system_message(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    for message in messages or []:
        if message.get("role") == "system":
            return message
    return None


def remove_system_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m.get("role") != "system"]


def pop_system_message(messages: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the system message or None, the other messages)."""
    return get_system_message(messages), remove_system_message(messages)


def prepend_to_first_user_message_content(content: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for message in messages:
        if message.get("role") == "user":
            if isinstance(message.get("content"), list):
                for part in message["content"]:
                    if isinstance(part, dict) and part.get("type") == "text":
                        part["text"] = f"{content}\n{part['text']}"
                        break
            else:
                message["content"] = f"{content}\n{message.get('content') or ''}"
            break
    return messages


def add_or_update_system_message(content: str, messages: list[dict[str, Any]], append: bool = False
                                 ) -> list[dict[str, Any]]:
    """Put ``content`` in the first message when it is the system message (before its text, or
    after it with ``append``), else insert a system message first. Changes ``messages`` too."""
    if messages and messages[0].get("role") == "system":
        old = get_content_from_message(messages[0]) or ""
        messages[0]["content"] = f"{old}\n{content}" if append else f"{content}\n{old}"
    else:
        messages.insert(0, {"role": "system", "content": content})
    return messages


def add_or_update_user_message(content: str, messages: list[dict[str, Any]], append: bool = True
                               ) -> list[dict[str, Any]]:
    """Add ``content`` to the last message when it is the user's, else append a user message."""
    if messages and messages[-1].get("role") == "user":
        old = get_content_from_message(messages[-1]) or ""
        messages[-1]["content"] = f"{old}\n{content}" if append else f"{content}\n{old}"
    else:
        messages.append({"role": "user", "content": content})
    return messages


def openai_chat_message_template(model: str) -> dict[str, Any]:
    return {"id": f"{model}-{uuid.uuid4()}", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "logprobs": None, "finish_reason": None}]}


def openai_chat_chunk_message_template(model: str, content: str | None = None, reasoning_content: str | None = None,
                                       tool_calls: list[dict[str, Any]] | None = None,
                                       usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk (a ``chat.completion.chunk``); with nothing in it, the finishing one."""
    template = openai_chat_message_template(model)
    template["object"] = "chat.completion.chunk"
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if reasoning_content:
        delta["reasoning_content"] = reasoning_content
    if tool_calls:
        delta["tool_calls"] = tool_calls
    template["choices"][0]["delta"] = delta
    if not content and not reasoning_content and not tool_calls:
        template["choices"][0]["finish_reason"] = "stop"
    if usage:
        template["usage"] = usage
    return template


def openai_chat_completion_message_template(model: str, message: str | None = None,
                                            reasoning_content: str | None = None,
                                            tool_calls: list[dict[str, Any]] | None = None,
                                            usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """A whole ``chat.completion`` holding ``message`` as the assistant's reply."""
    template = openai_chat_message_template(model)
    template["object"] = "chat.completion"
    reply: dict[str, Any] = {"role": "assistant", "content": message}
    if reasoning_content:
        reply["reasoning_content"] = reasoning_content
    if tool_calls:
        reply["tool_calls"] = tool_calls
    template["choices"][0]["message"] = reply
    template["choices"][0]["finish_reason"] = "tool_calls" if tool_calls else "stop"
    if usage:
        template["usage"] = usage
    return template


def calculate_sha256_string(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def deep_update(d: dict[str, Any], u: dict[str, Any]) -> dict[str, Any]:
    for key, value in u.items():
        if isinstance(value, dict) and isinstance(d.get(key), dict):
            d[key] = deep_update(d[key], value)
        else:
            d[key] = value
    return d
