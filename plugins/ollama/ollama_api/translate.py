"""From Ollama request bodies to the chat service's requests: OpenAI bodies, with the
origins of their places in the Ollama request (so the chat service's refusals name
``options.num_predict``, not ``max_tokens``).

Every Ollama field is used, refused with a 400 that says what to do instead, or named
in ``X-Localm-Ignored-Fields`` and logged (``sdk.report_ignored``): never dropped
silently. ``X-Localm-Strict: true`` turns an ignored field into a 400.
"""

from __future__ import annotations

import math
import re
from typing import Any

from localm import sdk
from localm.sdk.chat import ChatRequest, Origins

FOREVER = math.inf

#: Options passed on as they are (OpenAI names and meanings are the same).
NUMBER_OPTIONS = ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty")
#: The sampling fields of a chat body, for raw generation (a text completion takes the same).
SAMPLING = (*NUMBER_OPTIONS, "top_k", "seed", "max_tokens", "stop")

CHAT_FIELDS = {"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think", "logprobs",
               "top_logprobs"}
GENERATE_FIELDS = {"model", "prompt", "suffix", "system", "template", "context", "stream", "raw", "format", "images",
                   "options", "keep_alive", "think", "logprobs", "top_logprobs"}
MESSAGE_FIELDS = {"role", "content", "images", "tool_calls", "tool_name", "tool_call_id"}
#: The chat body's places Ollama names otherwise (a message's places are added per request).
RENAMED = {**{(key,): f"options.{key}" for key in (*NUMBER_OPTIONS, "top_k", "seed", "num_ctx", "stop")},
           ("max_tokens",): "options.num_predict", ("response_format",): "format",
           ("response_format", "json_schema"): "format", ("response_format", "json_schema", "schema"): "format",
           ("chat_template_kwargs", "enable_thinking"): "think", ("reasoning_effort",): "think"}


def field(body: dict[str, Any], key: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
    """``body[key]`` when of one of ``kinds`` (absent or null: ``default``); otherwise a 400."""
    value = body.get(key)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise sdk.LocalmError(400, f"{key} must be {what}")
    return value


def unread(body: dict[str, Any], read: set[str]) -> dict[str, Any]:
    """The client's top-level fields this surface does not read: the chat plugins see them
    (and may claim them, which takes them off X-Localm-Ignored-Fields)."""
    return {key: value for key, value in body.items() if key not in read}


def present(value: Any) -> bool:
    """A value that asks for something (null, "", [] and {} ask for nothing)."""
    return value is not None and value != "" and value != [] and value != {}


# --- keep_alive --------------------------------------------------------------------

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def keep_alive(value: Any) -> float | None:
    """Seconds (``FOREVER`` for a negative value), or None when absent. A number is seconds;
    a string is a Go duration ("5m", "1h30m", "0", "-1s"), as Ollama reads it."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise sdk.LocalmError(400, "keep_alive must be a number of seconds or a duration such as \"5m\"")
    if isinstance(value, (int, float)):
        return FOREVER if value < 0 else float(value)
    if not isinstance(value, str):
        raise sdk.LocalmError(400, "keep_alive must be a number of seconds or a duration such as \"5m\"")
    text = value.strip()
    negative = text.startswith("-")
    text = text.lstrip("+-")
    if text == "0":
        return 0.0
    total, at = 0.0, 0
    for match in _PART.finditer(text):
        if match.start() != at:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        at = match.end()
    if not text or at != len(text):
        raise sdk.LocalmError(400, f'keep_alive: time: invalid duration "{value}"')
    return FOREVER if negative and total else total


# --- options, format, think ----------------------------------------------------------

#: Ollama's documented defaults for the sampling options a request leaves out, where they
#: differ from localm's own (temperature 0.8 and top_k 40 are the same on both).
OLLAMA_DEFAULTS = {"top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.1}


def read_options(options: Any, out: dict[str, Any], ignored: list[str], entry: Any = None) -> None:
    """Ollama's ``options`` into the OpenAI body ``out`` (Ollama's defaults for those left
    out, unless the model's own defaults set them: the chat service fills those); unknown
    options go to ``ignored``."""
    defaults = getattr(entry, "defaults", None)
    own = defaults.get("options") if isinstance(defaults, dict) else None
    for key, value in OLLAMA_DEFAULTS.items():
        if not (isinstance(own, dict) and own.get(key) is not None):
            out.setdefault(key, value)
    if options is None:
        return
    if not isinstance(options, dict):
        raise sdk.LocalmError(400, "options must be an object")
    for key, value in options.items():
        if value is None:
            continue
        where = f"options.{key}"
        if key in NUMBER_OPTIONS:  # checked by the chat service's reader, named options.KEY
            out[key] = value
        elif key in ("top_k", "seed", "num_predict", "num_ctx"):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise sdk.LocalmError(400, f"{where} must be an integer")
            if key == "top_k":
                out["top_k"] = value
            elif key == "seed":
                if value >= 0:  # a negative seed is Ollama's "random"
                    out["seed"] = value
            elif key == "num_predict":
                if value > 0:  # 0, -1 (no limit) and -2 (fill the context) leave the reply uncapped
                    out["max_tokens"] = value
            elif value > 0:  # the model serves with this window from this request on, as on Ollama
                out["num_ctx"] = value
        elif key == "stop":  # a string or a list of strings, as OpenAI's: the chat service's reader checks it
            if present(value):
                out["stop"] = value
        else:
            ignored.append(where)


def read_format(value: Any) -> dict[str, Any] | None:
    """Ollama's ``format``: "json" or a JSON schema, as an OpenAI response_format."""
    if value is None or value == "":
        return None
    if value == "json":
        return {"type": "json_object"}
    if isinstance(value, dict):
        return {"type": "json_schema", "json_schema": {"schema": value, "strict": False}}
    raise sdk.LocalmError(400, 'format must be "json" or a JSON schema object')


def read_think(value: Any, entry: Any, name: str, out: dict[str, Any]) -> None:
    """``think``: true/false turns the model's reasoning on or off; "low", "medium" and "high"
    turn it on with that reasoning_effort."""
    if value is None:
        return
    if isinstance(value, bool):
        enable = value
    elif value in ("low", "medium", "high"):
        enable = True
        out["reasoning_effort"] = value
    else:
        raise sdk.LocalmError(400, 'think must be true, false, "low", "medium" or "high"')
    if enable and not entry.capabilities.get("reasoning"):
        raise sdk.LocalmError(400, f'"{name}" does not support thinking')
    out["chat_template_kwargs"] = {"enable_thinking": enable}


def read_logprobs(body: dict[str, Any], out: dict[str, Any], *, raw: bool) -> None:
    wanted = field(body, "logprobs", (bool,), "true or false", False)
    top = field(body, "top_logprobs", (int,), "an integer from 0 to 20")
    if top and not wanted:
        raise sdk.LocalmError(400, "top_logprobs needs logprobs: true")
    if not wanted:
        return
    if raw:
        out["logprobs"] = top or 0  # a text completion takes the count itself
    else:
        out["logprobs"] = True
        if top:
            out["top_logprobs"] = top


# --- messages ------------------------------------------------------------------------

def _images(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(i, str) for i in value):
        raise sdk.LocalmError(400, f"{where} must be a list of base64 strings")
    return value


def _with_images(text: str, images: list[str], k: int, text_at: str, images_at: str,
                 names: dict[tuple[Any, ...], str]) -> Any:
    """Content with images as OpenAI image parts: the chat path accepts or refuses them as on
    /v1/chat/completions, naming them as the client sent them (``images_at[n]``)."""
    if not images:
        return text
    names[("messages", k, "content", 0)] = text_at
    names.update({("messages", k, "content", 1 + n): f"{images_at}[{n}]" for n in range(len(images))})
    return [{"type": "text", "text": text},
            *({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{i}"}} for i in images)]


def _call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise sdk.LocalmError(400, f"{where} must be a function call with a name")
    arguments = function.get("arguments")
    return {"id": call.get("id") if isinstance(call.get("id"), str) else None, "type": "function",
            "function": {"name": function["name"], "arguments": {} if arguments is None else arguments}}


def read_messages(messages: Any, ignored: list[str], names: dict[tuple[Any, ...], str]) -> list[dict[str, Any]]:
    """Ollama messages as OpenAI ones (one each, so they keep their places): images as image
    parts, tool_calls with their arguments, tool results named by tool_name."""
    if not isinstance(messages, list):
        raise sdk.LocalmError(400, "messages must be a list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise sdk.LocalmError(400, f"{where} must be an object with a role")
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise sdk.LocalmError(400, f"{where}.content must be a string")
        images = _images(m.get("images"), f"{where}.images")
        message: dict[str, Any] = {"role": m.get("role"),
                                   "content": _with_images(content, images, i, f"{where}.content", f"{where}.images",
                                                           names)}
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise sdk.LocalmError(400, f"{where}.tool_calls must be a list of tool calls")
            message["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        tool_name = field(m, "tool_name", (str,), "a string")
        if tool_name:
            message["name"] = tool_name
        call_id = field(m, "tool_call_id", (str,), "a string")
        if call_id:
            message["tool_call_id"] = call_id
        ignored.extend(f"{where}.{key}" for key, value in m.items() if key not in MESSAGE_FIELDS and present(value))
        out.append(message)
    return out


# --- whole requests ------------------------------------------------------------------

def chat_request(body: dict[str, Any], entry: Any, name: str, ignored: list[str]) -> ChatRequest:
    """POST /api/chat as a chat request."""
    names = dict(RENAMED)
    out: dict[str, Any] = {"model": entry.id, "messages": read_messages(body.get("messages"), ignored, names)}
    tools = body.get("tools")
    if present(tools):
        out["tools"] = tools
    fmt = read_format(body.get("format"))
    if fmt is not None:
        out["response_format"] = fmt
    read_think(body.get("think"), entry, name, out)
    read_logprobs(body, out, raw=False)
    read_options(body.get("options"), out, ignored, entry)
    ignored[:0] = [key for key, value in body.items() if key not in CHAT_FIELDS and present(value)]
    return ChatRequest(body=out, origins=Origins(names), extra=unread(body, CHAT_FIELDS), entry=entry)


def generate_request(body: dict[str, Any], entry: Any, name: str, ignored: list[str]) -> tuple[ChatRequest, bool]:
    """POST /api/generate as a chat request (system + user), or with ``raw`` a text
    completions request (the prompt as written, no template). Returns (request, raw)."""
    prompt = field(body, "prompt", (str,), "a string", "")
    system = field(body, "system", (str,), "a string", "")
    raw = field(body, "raw", (bool,), "true or false", False)
    images = _images(body.get("images"), "images")
    if field(body, "suffix", (str,), "a string"):
        raise sdk.LocalmError(400, "suffix (fill-in-the-middle) is not supported by localm: send the text before "
                                   "the gap as the prompt")
    if field(body, "template", (str,), "a string"):
        raise sdk.LocalmError(400, "template is not supported: localm applies the model's own chat template; send "
                                   "raw: true with a prompt you formatted yourself")
    context = field(body, "context", (list,), "a list of token ids")
    if context:
        raise sdk.LocalmError(400, "context (the deprecated token history) is not supported by localm, which "
                                   "never returns one: send the conversation to /api/chat as messages")
    for key in ("width", "height", "steps"):
        if body.get(key) is not None:
            raise sdk.LocalmError(400, f"{key} is for image generation, which localm's Ollama API does not serve")
    out: dict[str, Any] = {"model": entry.id}
    names = dict(RENAMED)
    if raw:
        if images:
            raise sdk.LocalmError(400, "images need the chat template: send them without raw: true")
        if present(body.get("format")):
            raise sdk.LocalmError(400, "format cannot be combined with raw: true (structured output needs the "
                                       "chat template)")
        out["prompt"] = prompt
        read_logprobs(body, out, raw=True)
        read_options(body.get("options"), out, ignored, entry)
        ignored.extend(key for key in ("system", "think") if present(body.get(key)))  # a raw prompt has neither
    else:
        messages = [{"role": "system", "content": system}] if system else []
        names.update({("messages", 0): "system"} if system else {})
        names[("messages", len(messages))] = "prompt"
        messages.append({"role": "user", "content": _with_images(prompt, images, len(messages), "prompt", "images",
                                                                 names)})
        out["messages"] = messages
        fmt = read_format(body.get("format"))
        if fmt is not None:
            out["response_format"] = fmt
        read_think(body.get("think"), entry, name, out)
        read_logprobs(body, out, raw=False)
        read_options(body.get("options"), out, ignored, entry)
    ignored[:0] = [key for key, value in body.items() if key not in GENERATE_FIELDS and present(value)]
    return ChatRequest(body=out, origins=Origins(names), extra=unread(body, GENERATE_FIELDS), entry=entry), raw
