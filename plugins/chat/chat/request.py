"""Reading an OpenAI request body: every field used, refused with its reason, or typed wrong (422)."""

from __future__ import annotations

import json
from typing import Any

import attrs
from localm import sdk
from localm.sdk import engines as spec
from localm.sdk.chat import EFFORTS, MAX_MESSAGES, MAX_NUM_CTX, MAX_STOP_CHARS, MAX_STOPS, Origins  # noqa: F401
from localm.sdk.fields import Invalid  # noqa: F401  (the 422 the readers raise)
from localm.sdk.fields import Reader as _FieldReader


@attrs.frozen
class Common:
    model: str | None
    stream: bool
    include_usage: bool
    sampling: spec.Sampling
    stops: tuple[str, ...]
    cache_prompt: bool
    #: the context window the client asked for (Ollama's options.num_ctx, or ``num_ctx`` on any route)
    num_ctx: int | None = None
    #: a front end's background task (a title, tags or follow-ups): capped and queued after interactive requests
    background: bool = False
    #: capability routing (see routing.py): whether the model is pinned (None: a named one is),
    #: the capabilities the answering model must have, and the trained window it must hold
    pin_model: bool | None = None
    required: tuple[str, ...] = ()
    min_context: int | None = None
    #: the draft source asked for (``spec_source``: off, ngram, draft, mtp); None: the engine's setting
    spec_source: str | None = None


class Reader(_FieldReader):
    """The SDK's field reader (``localm.sdk.fields.Reader``: one 422 naming every field of the
    wrong type), noting where the messages hold media."""

    def __init__(self, body: Any, origins: Origins | None = None) -> None:
        super().__init__(body, origins)
        #: where the messages hold image or audio parts: a chat plugin may turn them into text
        #: (a transcript), and what is left goes to a model that sees or hears, or is refused
        self.media: list[str] = []
        self.counted = sdk.media.Counter()  # the request's images and clips, bounded in number


def read_common(r: Reader) -> Common:
    model = r.get("model", (str,), "a string")
    stream = r.get("stream", (bool,), "true or false", False)
    cache_prompt = r.get("cache_prompt", (bool,), "true or false", True)
    options = r.get("stream_options", (dict,), "an object", {}) or {}
    include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
    n = r.get("n", (int,), "an integer", 1)
    if n != 1:
        raise sdk.LocalmError(400, f"{r.name('n')} must be 1: localm returns one choice per request",
                              field=r.name("n"))
    max_tokens = r.get("max_tokens", (int,), "an integer")
    max_completion = r.get("max_completion_tokens", (int,), "an integer")
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise sdk.LocalmError(400, f"{r.name('max_tokens')} and {r.name('max_completion_tokens')} differ: "
                                   "send one of them")
    cap = max_tokens if max_tokens is not None else max_completion
    if cap is not None and cap < 1:
        raise sdk.LocalmError(400, f"{r.name('max_tokens' if max_tokens is not None else 'max_completion_tokens')} "
                                   "must be at least 1")
    defaults = spec.Sampling()
    seed = r.get("seed", (int,), "an integer")
    if seed is not None and not 0 <= seed < 2**32:
        raise sdk.LocalmError(400, f"{r.name('seed')} must be an integer from 0 to {2**32 - 1}, got {seed}")
    sampling = spec.Sampling(
        max_tokens=cap,
        temperature=r.number("temperature", defaults.temperature, 0, 2),
        top_p=r.number("top_p", defaults.top_p, 0, 1),
        top_k=int(r.get("top_k", (int,), "an integer", defaults.top_k)),
        min_p=r.number("min_p", defaults.min_p, 0, 1),
        seed=seed,
        presence_penalty=r.number("presence_penalty", 0.0, -2, 2),
        frequency_penalty=r.number("frequency_penalty", 0.0, -2, 2),
        repeat_penalty=r.number("repeat_penalty", defaults.repeat_penalty, 0, None),
    )
    stop = r.body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    elif stop is not None:
        r.error("must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise sdk.LocalmError(400, f"{r.name('stop')} holds {len(stops)} sequences; at most {MAX_STOPS} are accepted")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise sdk.LocalmError(400, f"a stop sequence ({r.name('stop')}) is {len(s)} characters; at most "
                                       f"{MAX_STOP_CHARS}")
    stops = tuple(s for s in stops if s)
    num_ctx = r.get("num_ctx", (int,), "an integer")
    if num_ctx is not None and not 1 <= num_ctx <= MAX_NUM_CTX:
        raise sdk.LocalmError(400, f"{r.name('num_ctx')} must be from 1 to {MAX_NUM_CTX}, got {num_ctx}")
    pin_model = r.get("pin_model", (bool,), "true or false")
    required = r.get("required_capabilities", (list,), "a list of capabilities") or []
    unknown = [c for c in required if c not in CAPABILITIES]
    if unknown:
        where = r.name("required_capabilities")
        raise sdk.LocalmError(400, f"{where}: {unknown[0]!r} is not one of {', '.join(CAPABILITIES)}", param=where)
    min_context = r.get("min_context", (int,), "an integer")
    if min_context is not None and not 1 <= min_context <= MAX_NUM_CTX:
        raise sdk.LocalmError(400, f"{r.name('min_context')} must be from 1 to {MAX_NUM_CTX}, got {min_context}")
    spec_source = r.get("spec_source", (str,), "a string")
    if spec_source is not None and spec_source not in SPEC_SOURCES:
        where = r.name("spec_source")
        raise sdk.LocalmError(400, f"{where} must be one of {', '.join(SPEC_SOURCES)}, got {spec_source[:40]!r}",
                              param=where)
    return Common(model=model, stream=stream, include_usage=include_usage, sampling=sampling, stops=stops,
                  cache_prompt=cache_prompt, num_ctx=num_ctx, background=background_task(r.body),
                  pin_model=pin_model, required=tuple(dict.fromkeys(required)), min_context=min_context,
                  spec_source=spec_source)


#: The draft sources spec_source names (off: none for this request).
SPEC_SOURCES = ("off", "ngram", "draft", "mtp")

#: What required_capabilities may list.
CAPABILITIES = ("vision", "audio_input", "tool_use", "reasoning")


#: Open WebUI's own background-task prompts (the DEFAULT_*_PROMPT_TEMPLATE of open_webui/config.py),
#: each known by the words its task opens with, as older and newer releases word them. Its RAG
#: template opens with "### Task:" too, but wraps a person's question: it is none of these.
OPEN_WEBUI_TASKS = {
    "title_generation": ("generate a concise, 3-5 word title", "generate a concise title summarizing the chat"),
    "tags_generation": ("generate 1-3 broad tags categorizing the main themes of the chat history",),
    "follow_up_generation": ("suggest 3-5 relevant follow-up questions or prompts that the user might naturally "
                             "ask next",),
    "query_generation": ("analyze the chat history to determine the necessity of generating search queries",),
    "emoji_generation": ("your task is to reflect the speaker's likely facial expression through a fitting emoji",),
    "autocomplete_generation": ("you are an autocompletion system.",),
    "image_prompt_generation": ("generate a detailed prompt for am image generation task",
                                "generate a detailed prompt for an image generation task"),
}
TASK_HEADING = "### task:"


def open_webui_task(text: str) -> str | None:
    """Which of Open WebUI's background tasks a prompt is (None: not one of them): its task
    (what follows a leading "### Task:", or the prompt itself) opens with that task's words,
    so a question that quotes a template further down stays a question."""
    flat = " ".join(text.split()).lower()
    if flat.startswith(TASK_HEADING):
        flat = flat[len(TASK_HEADING):].lstrip()
    for task, openings in OPEN_WEBUI_TASKS.items():
        if flat.startswith(openings):
            return task
    return None


def background_task(body: dict[str, Any]) -> bool:
    """A front end's background task rather than a person waiting on a reply: the request's
    ``metadata.task`` names one (Open WebUI's title_generation, tags_generation, ...), or its
    last user message is one of Open WebUI's task prompts (see OPEN_WEBUI_TASKS)."""
    meta = body.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("task"), str) and meta["task"]:
        return True
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in reversed(messages):
            if isinstance(message, dict) and message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, list):
                    content = next((p.get("text") for p in content if isinstance(p, dict)
                                    and isinstance(p.get("text"), str)), "")
                return isinstance(content, str) and open_webui_task(content) is not None
    return False


ORIGINS = ("tool", "client")


def read_messages(r: Reader) -> list[dict[str, Any]]:
    """Messages as the pipeline keeps them: role, content, and when sent tool_calls,
    tool_call_id, name (tool results), untrusted_spans (clamped) and origin."""
    messages = r.body.get("messages")
    if not isinstance(messages, list) or not messages:
        r.error("must be a non-empty list of messages", "messages")
        return []
    if len(messages) > MAX_MESSAGES:
        where = r.name("messages")
        raise sdk.LocalmError(400, f"{where} holds {len(messages)} items; at most {MAX_MESSAGES} are accepted",
                              code="limit_exceeded", field=where, limit=MAX_MESSAGES, param=where)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            r.error("must be an object with a role", "messages", i)
            continue
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant", "tool"):
            where = r.name("messages", i, "role")
            raise sdk.LocalmError(400, f"{where} {m['role']!r} is not one of system, developer, user, assistant, "
                                       "tool", param=where)
        content = m.get("content")
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif isinstance(part, dict) and part.get("type") in ("image_url", "input_audio"):
                    if role == "tool":
                        where = r.name("messages", i, "content", j)
                        raise sdk.LocalmError(400, f"{where}: a tool result holds text only (send the image in "
                                                   "a user message)", param=where)
                    parts.append(_media_part(r, part, i, j))
                else:
                    r.error("must be a text part", "messages", i, "content", j)
            # text alone is one string, as it always was; with media, the parts in order
            content = parts if any(p["type"] != "text" for p in parts) else "".join(p["text"] for p in parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            r.error("must be a string or a list of parts", "messages", i, "content")
            continue
        message: dict[str, Any] = {"role": role, "content": content}
        origin = m.get("origin")
        if origin is not None:
            if origin not in ORIGINS:
                r.error('must be "tool", "client" or null', "messages", i, "origin")
            else:
                message["origin"] = origin
        spans = m.get("untrusted_spans")
        if spans is not None and isinstance(content, list):  # spans are offsets into one string
            r.error("applies to a string content, not a list of parts", "messages", i, "untrusted_spans")
        elif spans is not None:
            if not isinstance(spans, list) or not all(
                    isinstance(s, list) and len(s) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                for x in s) for s in spans):
                r.error("must be a list of [start, end] integer pairs", "messages", i, "untrusted_spans")
            else:
                size = len(content)
                clamped = sorted((max(0, min(a, size)), max(0, min(b, size))) for a, b in spans)
                message["untrusted_spans"] = [[a, b] for a, b in clamped if b > a]
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _read_calls(r, i, m["tool_calls"])
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(m.get(key), str):
                    message[key] = m[key]
        out.append(message)
    return out


def _media_part(r: Reader, part: dict[str, Any], i: int, j: int) -> dict[str, Any]:
    """An image_url or input_audio part as the prompt keeps it: ``{"type": "image", "media": Media,
    "at": its place}`` (every bound checked before anything decodes it), or ``{"type": "audio",
    "data", "format", "at"}``, read once a model that hears takes it."""
    where = r.name("messages", i, "content", j)
    r.media.append(where)
    r.counted.add(where)
    if part["type"] == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        return {"type": "image", "media": sdk.media.image_from_url(url, where), "at": where}
    audio = part.get("input_audio")
    if not isinstance(audio, dict):
        raise sdk.LocalmError(400, f"{where}: an input_audio part needs an input_audio object with data and "
                                   "format", code="invalid_audio", param=where)
    # read when a model that hears takes it (sdk.media.audio_from_base64): until then a chat plugin
    # (the voice plugin's transcription) may turn it into text under its own rules
    return {"type": "audio", "data": audio.get("data"), "format": audio.get("format"), "at": where}


def media_of(messages: list[dict[str, Any]]) -> list[Any]:
    """The media parts of ``messages``, in order."""
    return [part for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if part.get("type") in ("image", "audio")]


def text_of(content: Any) -> str:
    """A message's text: its string, or its text parts joined (its media left out)."""
    if isinstance(content, list):
        return "".join(p["text"] for p in content if p.get("type") == "text")
    return content or ""


def _read_calls(r: Reader, i: int, calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        r.error("must be a list of tool calls", "messages", i, "tool_calls")
        return []
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            r.error("must be a function call with a name", "messages", i, "tool_calls", j)
            continue
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                pass  # the model is shown the text as it was sent
        out.append({"id": call.get("id") if isinstance(call.get("id"), str) else None,
                    "name": function["name"], "arguments": arguments})
    return out




@attrs.frozen
class Options:
    """What a generation asks for beyond sampling: probabilities, constraints, tools, reasoning."""

    logprobs: int | None = None  # None: no probabilities; k: each content token and its k most likely
    token_ids: bool = False  # return_tokens_as_token_ids
    fmt: Any = None  # constrained.Format
    tools: Any = None  # constrained.Tools
    grammar: tuple[str, str | None] | None = None  # an llguidance grammar from GBNF, and its lazy trigger
    thinking: bool | None = None  # enable_thinking as the template gets it (None: the model's default)
    add_special: bool = True  # completions: add the model's BOS

    def constraint(self) -> spec.Constraint | None:
        from . import constrained
        if self.grammar is not None:
            return spec.Constraint(grammar=self.grammar[0], trigger=self.grammar[1])
        tools = self.tools
        if tools is not None and tools.choice in ("required", "named"):
            grammar, trigger = constrained.tools_grammar(tools)
            return spec.Constraint(grammar=grammar, trigger=trigger)
        if tools is not None and tools.choice == "auto" and self.fmt is not None:
            grammar = constrained.format_or_calls_grammar(self.fmt, tools)
            return spec.Constraint(grammar=grammar)
        if self.fmt is not None:
            return spec.Constraint(grammar=self.fmt.grammar)
        if tools is not None and tools.choice == "auto":
            grammar, trigger = constrained.tools_grammar(tools)
            return spec.Constraint(grammar=grammar, trigger=trigger)
        return None


def read_options(r: Reader, route: str) -> Options:
    from . import constrained
    body = r.body
    if route == "chat":
        wanted = r.get("logprobs", (bool,), "true or false", False)
        top = r.get("top_logprobs", (int,), "an integer from 0 to 20")
        if top is not None and not 0 <= top <= 20:
            where = r.name("top_logprobs")
            raise sdk.LocalmError(400, f"{where} must be from 0 to 20, got {top}", param=where)
        if top and not wanted:
            where = r.name("top_logprobs")
            raise sdk.LocalmError(400, f"{where} needs {r.name('logprobs')}: true", param=where)
        logprobs = (top or 0) if wanted else None
    else:
        logprobs = r.get("logprobs", (int,), "an integer from 0 to 20")
        if logprobs is not None and not 0 <= logprobs <= 20:
            where = r.name("logprobs")
            raise sdk.LocalmError(400, f"{where} must be from 0 to 20, got {logprobs}", param=where)
    token_ids = r.get("return_tokens_as_token_ids", (bool,), "true or false", False)
    add_special = r.get("add_special_tokens", (bool,), "true or false", True) if route == "completions" else True
    fmt = constrained.read_response_format(body.get("response_format"), r.origins) if route == "chat" else None
    tools = constrained.read_tools(body, r.origins) if route == "chat" else None
    grammar = constrained.read_grammar(body, r.origins)
    if grammar is not None and (fmt is not None or (tools is not None and tools.choice != "none")):
        where = r.name("grammar")
        raise sdk.LocalmError(400, f"{where} cannot be combined with {r.name('response_format')} or "
                                   f"{r.name('tools')}", code="invalid_grammar", param=where)
    if fmt is not None and r.body.get("stop"):
        where = r.name("stop")
        raise sdk.LocalmError(400, f"{where} cannot be combined with {r.name('response_format')}: a stop sequence "
                                   "could cut the document and report it complete",
                              code="response_format_unsupported", param=where)
    thinking = None
    if route == "chat":
        kwargs = r.get("chat_template_kwargs", (dict,), "an object", {})
        enable = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None
        if enable is not None and not isinstance(enable, bool):
            r.error("must be true or false", "chat_template_kwargs", "enable_thinking")
            enable = None
        effort = r.get("reasoning_effort", (str,), "a string")
        if effort is not None and effort not in EFFORTS:
            r.error("must be one of " + ", ".join(EFFORTS), "reasoning_effort")
        thinking = enable if enable is not None else (False if effort == "none" else None)
        if thinking is None and (fmt is not None or (tools is not None and tools.choice in ("required", "named"))):
            thinking = False  # a format (or a forced call) is answered without thinking unless asked
    return Options(logprobs=logprobs, token_ids=token_ids, fmt=fmt, tools=tools, grammar=grammar,
                   thinking=thinking, add_special=add_special)
