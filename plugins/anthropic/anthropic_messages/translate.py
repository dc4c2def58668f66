"""An Anthropic Messages request, read into the chat request the chat service takes: an
OpenAI chat-completions body, with the origins of its places in the Anthropic request.

Every field is used, accepted with no effect (named in the debug log when unknown), or
refused with a 400 naming its place the way Anthropic does (``messages.1.content.0``).
Fields the chat service reads itself (``temperature``, ``top_k``, a tool's
``input_schema``, an image the model cannot see...) are refused by it in Anthropic's names
too, through the origins; its 422 (a field of the wrong type) this surface answers as a
400 like every other body that fails validation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from localm import sdk
from localm.sdk.chat import ChatRequest, Origins

log = logging.getLogger("localm.plugin.anthropic")

#: Accepted and without effect here.
NO_EFFECT = ("metadata", "service_tier", "cache_control", "inference_geo")
#: Read by this module.
READ = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
        "tools", "tool_choice", "thinking", "output_config", "mcp_servers"}
#: localm's own chat fields, passed on as they are (an SDK sends them through extra_body).
LOCALM = ("cache_prompt", "seed", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "pin_model",
          "required_capabilities", "min_context", "spec_source")
THINKING_ON = ("enabled", "adaptive", "between_tools")
DROPPED_BLOCKS = ("thinking", "redacted_thinking")
#: The most messages a request may hold (the chat plugin's bound, counted before turns are joined).
MAX_MESSAGES = 10_000


#: The chat body's places Anthropic names otherwise (its tools' places depend on the request).
RENAMED = {("stop",): "stop_sequences", ("response_format",): "output_config.format",
           ("response_format", "json_schema"): "output_config.format", ("tool_choice", "function"): "tool_choice",
           ("parallel_tool_calls",): "tool_choice.disable_parallel_tool_use",
           ("chat_template_kwargs", "enable_thinking"): "thinking"}


def bad(message: str) -> sdk.LocalmError:
    return sdk.LocalmError(400, message)


class Places:
    """The chat messages built so far, and where each (and each of its parts and tool calls)
    came from in the Anthropic request."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.names: dict[tuple[Any, ...], str] = {}

    def add(self, message: dict[str, Any], where: str, parts: Sequence[str] = (), calls: Sequence[str] = ()) -> None:
        k = len(self.messages)
        self.names[("messages", k)] = where
        self.names.update({("messages", k, "content", j): at for j, at in enumerate(parts)})
        for c, at in enumerate(calls):  # a call's name and arguments are its tool_use block's
            self.names[("messages", k, "tool_calls", c)] = self.names[("messages", k, "tool_calls", c, "function")] = at
        self.messages.append(message)


def to_chat_request(body: Any, *, counting: bool = False) -> ChatRequest:
    """The chat request for a /v1/messages request (``counting``: a count_tokens request,
    which has no max_tokens and never streams), with the client's fields it does not read."""
    if not isinstance(body, dict):
        raise bad("The request body must be a JSON object")
    out: dict[str, Any] = {}
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model: must be a string")
    out["model"] = model or None
    if not counting:
        cap = body.get("max_tokens")
        if cap is None:
            raise bad("max_tokens: Field required")
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise bad(f"max_tokens: must be a positive integer, got {cap!r}")
        out["max_tokens"] = cap
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise bad("stream: must be true or false")
        out["stream"] = bool(stream)
    places = Places()
    _system(body.get("system"), places)
    _messages(body.get("messages"), places)
    out["messages"] = places.messages
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("stop_sequences: must be a list of strings")
        out["stop"] = stops
    for key in ("temperature", "top_p", "top_k", *LOCALM):
        if body.get(key) is not None:
            out[key] = body[key]
    out.update(_tools(body))
    out["chat_template_kwargs"] = {"enable_thinking": _thinking(body.get("thinking"))}
    fmt = _output_format(body.get("output_config"))
    if fmt is not None:
        out["response_format"] = fmt
    unknown = sorted(set(body) - READ - set(NO_EFFECT) - set(LOCALM))
    if unknown:
        log.debug("/v1/messages: fields with no effect here: %s", ", ".join(unknown))
    names = {**RENAMED, **places.names}
    for j in range(len(out.get("tools", []))):
        names[("tools", j, "function")] = f"tools.{j}"
        names[("tools", j, "function", "parameters")] = f"tools.{j}.input_schema"
    return ChatRequest(body=out, origins=Origins(names, dotted=True), extra=unread(body))


def unread(body: dict[str, Any]) -> dict[str, Any]:
    """The client's fields this surface neither reads nor knows: the chat plugins see them in
    the request (a plugin's own field, such as ``rag``, sent through ``extra_body``)."""
    return {key: value for key, value in body.items() if key not in READ and key not in NO_EFFECT
            and key not in LOCALM}


# --- messages ------------------------------------------------------------------------

def _system(system: Any, places: Places) -> None:
    if system is None or system == "":
        return
    if isinstance(system, str):
        places.add({"role": "system", "content": system}, "system")
        return
    if not isinstance(system, list):
        raise bad("system: must be a string or a list of text blocks")
    parts = []
    for j, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad(f"system.{j}: must be a text block ({{\"type\": \"text\", \"text\": \"...\"}})")
        parts.append({"type": "text", "text": block["text"]})
    if parts:
        places.add({"role": "system", "content": parts}, "system", [f"system.{j}" for j in range(len(parts))])


def _messages(raw: Any, places: Places) -> None:
    """User and assistant turns; consecutive turns of one role are joined into one turn (named
    by its first message)."""
    if not isinstance(raw, list) or not raw:
        raise bad("messages: must be a non-empty list of messages")
    if len(raw) > MAX_MESSAGES:  # counted as sent: turns of one role are joined below
        raise bad(f"messages: holds {len(raw)} items; at most {MAX_MESSAGES} are accepted")
    turns: list[tuple[str, str, list[tuple[str, Any]]]] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad(f"messages.{i}: must be an object with role and content")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"messages.{i}.role: must be \"user\" or \"assistant\", got {role!r}")
        content = m.get("content")
        if isinstance(content, str):
            blocks = [(f"messages.{i}.content", {"type": "text", "text": content})]
        elif isinstance(content, list):
            blocks = [(f"messages.{i}.content.{j}", b) for j, b in enumerate(content)]
        else:
            raise bad(f"messages.{i}.content: must be a string or a list of content blocks")
        if turns and turns[-1][0] == role:
            last, first = turns[-1][2][-1][1] if turns[-1][2] else None, blocks[0][1] if blocks else None
            if all(isinstance(b, dict) and b.get("type") == "text" for b in (last, first)):
                # two turns' texts stay apart: the chat path joins a message's text parts as they are
                blocks = [(f"messages.{i}.content", {"type": "text", "text": "\n\n"}), *blocks]
            turns[-1][2].extend(blocks)
        else:
            turns.append((role, f"messages.{i}", blocks))
    for role, where, blocks in turns:
        (_user if role == "user" else _assistant)(where, blocks, places)


def _kind(where: str, block: Any) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad(f"{where}: must be a content block with a type")
    return block["type"]


def _text(where: str, block: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(block.get("text"), str):
        raise bad(f"{where}.text: must be a string")
    return {"type": "text", "text": block["text"]}


def _image(where: str, block: dict[str, Any]) -> dict[str, Any]:
    """An image block as an OpenAI image part, so the chat path treats it as it treats one sent there."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad(f"{where}.source: must be an object")
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise bad(f"{where}.source: a base64 source needs media_type and data strings")
        url = f"data:{media};base64,{data}"
    elif kind == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise bad(f"{where}.source.url: must be a string")
    else:
        raise bad(f"{where}.source.type: {kind!r} is not supported here (base64 and url are)")
    return {"type": "image_url", "image_url": {"url": url}}


def _refused(where: str, kind: str) -> sdk.LocalmError:
    return bad(f"{where}: {kind!r} blocks are not supported here (text, image, tool_use, tool_result and "
               "thinking blocks are)")


def _user(turn: str, blocks: list[tuple[str, Any]], places: Places) -> None:
    """Tool results become OpenAI tool messages; the turn's text and images (and the images
    tool results hold) follow them in one user message."""
    results: list[tuple[dict[str, Any], str]] = []
    images: list[tuple[dict[str, Any], str]] = []
    parts: list[tuple[dict[str, Any], str]] = []
    for where, block in blocks:
        kind = _kind(where, block)
        if kind == "text":
            parts.append((_text(where, block), where))
        elif kind == "image":
            parts.append((_image(where, block), where))
        elif kind == "tool_result":
            ident = block.get("tool_use_id")
            if not isinstance(ident, str):
                raise bad(f"{where}.tool_use_id: must be a string")
            text, shown = _result_content(where, block.get("content"))
            failed = block.get("is_error")
            if failed is not None and not isinstance(failed, bool):
                raise bad(f"{where}.is_error: must be true or false")
            if failed:
                text = f"(error) {text}" if text else "(error)"
            results.append(({"role": "tool", "tool_call_id": ident, "content": text}, where))
            images.extend(shown)
        elif kind in DROPPED_BLOCKS:
            continue
        elif kind == "tool_use":
            raise bad(f"{where}: a tool_use block belongs in an assistant turn")
        else:
            raise _refused(where, kind)
    for message, where in results:
        places.add(message, where)
    if images or parts or not results:
        shown = images + parts
        places.add({"role": "user", "content": [part for part, _ in shown]}, turn, [at for _, at in shown])


def _result_content(where: str, content: Any) -> tuple[str, list[tuple[dict[str, Any], str]]]:
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise bad(f"{where}.content: must be a string or a list of text and image blocks")
    texts, images = [], []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = _kind(at, block)
        if kind == "text":
            texts.append(_text(at, block)["text"])
        elif kind == "image":
            images.append((_image(at, block), at))
        else:
            raise bad(f"{at}: {kind!r} blocks are not supported in a tool result (text and image are)")
    return "".join(texts), images


def _assistant(turn: str, blocks: list[tuple[str, Any]], places: Places) -> None:
    parts: list[tuple[dict[str, Any], str]] = []
    calls: list[tuple[dict[str, Any], str]] = []
    for where, block in blocks:
        kind = _kind(where, block)
        if kind == "text":
            parts.append((_text(where, block), where))
        elif kind == "tool_use":
            ident, name, given = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(ident, str) or not isinstance(name, str):
                raise bad(f"{where}: a tool_use block needs id and name strings")
            if not isinstance(given, dict):
                raise bad(f"{where}.input: must be an object")
            calls.append(({"id": ident, "type": "function",
                           "function": {"name": name, "arguments": json.dumps(given, ensure_ascii=False)}}, where))
        elif kind in DROPPED_BLOCKS:
            continue
        elif kind in ("image", "tool_result"):
            raise bad(f"{where}: a {kind} block belongs in a user turn")
        else:
            raise _refused(where, kind)
    message: dict[str, Any] = {"role": "assistant", "content": [part for part, _ in parts]}
    if calls:
        message["tool_calls"] = [call for call, _ in calls]
    places.add(message, turn, [at for _, at in parts], [at for _, at in calls])


# --- tools, thinking, output ------------------------------------------------------------

def _tools(body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if body.get("mcp_servers") not in (None, []):
        raise bad("mcp_servers: MCP connectors are not available on localm; send their tools as custom tools")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools: must be a list of tools")
        functions = []
        for j, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise bad(f"tools.{j}: must be an object")
            kind = tool.get("type")
            if kind not in (None, "custom"):
                raise bad(f"tools.{j}: {kind!r} is a server tool, which localm does not run; only custom tools "
                          "(name, description, input_schema) are available")
            name, schema = tool.get("name"), tool.get("input_schema")
            if not isinstance(name, str):
                raise bad(f"tools.{j}.name: must be a string")
            if not isinstance(schema, dict):
                raise bad(f"tools.{j}.input_schema: must be a JSON schema object")
            function: dict[str, Any] = {"name": name, "parameters": schema}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            functions.append({"type": "function", "function": function})
        out["tools"] = functions
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict):
            raise bad("tool_choice: must be an object such as {\"type\": \"auto\"}")
        kind = choice.get("type")
        if kind in ("auto", "none"):
            out["tool_choice"] = kind
        elif kind == "any":
            out["tool_choice"] = "required"
        elif kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise bad("tool_choice.name: must be a string")
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise bad(f"tool_choice.type: must be auto, any, tool or none, got {kind!r}")
        single = choice.get("disable_parallel_tool_use")
        if single is not None and not isinstance(single, bool):
            raise bad("tool_choice.disable_parallel_tool_use: must be true or false")
        if single:
            out["parallel_tool_calls"] = False
    return out


def _thinking(value: Any) -> bool:
    """Whether the model may think: {"type": "enabled"} (or adaptive, between_tools) lets it."""
    if value is None:
        return False
    if not isinstance(value, dict):
        raise bad("thinking: must be an object such as {\"type\": \"enabled\"}")
    kind = value.get("type")
    if kind in THINKING_ON:
        return True
    if kind == "disabled":
        return False
    raise bad(f"thinking.type: must be enabled, adaptive, between_tools or disabled, got {kind!r}")


def _output_format(config: Any) -> dict[str, Any] | None:
    """output_config.format as a strict json_schema response_format; effort has no effect."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise bad("output_config: must be an object")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad("output_config.format: must be {\"type\": \"json_schema\", \"schema\": {...}}")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise bad("output_config.format.schema: must be a JSON schema object")
    return {"type": "json_schema", "json_schema": {"schema": schema, "strict": True}}
