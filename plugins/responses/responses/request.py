"""Reading a Responses API request: its fields checked and turned into an OpenAI
chat-completions body for the chat service, plus what the response object echoes.

Every field is used, accepted with no effect (listed in ``ACCEPTED``), refused with a 400
naming it, or, when unknown, named in the debug log. A field of the wrong type is a 400
here (the Responses API has no 422).
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
from localm import sdk
from localm.sdk.chat import Origins

log = logging.getLogger("localm.plugin.responses")

#: localm's own chat fields, passed to the chat service as they are.
PASSED = ("top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "grammar",
          "grammar_lazy", "grammar_triggers", "required_capabilities", "pin_model", "min_context",
          "chat_template_kwargs", "cache_prompt", "spec_source")
#: Fields accepted with no effect (metadata is echoed, the rest too where the response has a place).
ACCEPTED = ("metadata", "user", "prompt_cache_key", "safety_identifier", "service_tier", "max_tool_calls",
            "stream_options", "prompt_cache_retention")
#: Fields read here.
READ = ("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "max_output_tokens",
        "temperature", "top_p", "reasoning", "previous_response_id", "store", "stream", "include", "truncation",
        "top_logprobs", "background", "conversation", "prompt")
#: include values accepted with no effect.
INCLUDE_NO_EFFECT = ("reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
                     "web_search_call.action.sources", "message.input_image.image_url",
                     "computer_call_output.output.image_url", "code_interpreter_call.outputs")
LOGPROBS = "message.output_text.logprobs"
ROLES = ("user", "assistant", "system", "developer")
#: The most input items a request may hold (the chat plugin's bound on messages).
MAX_ITEMS = 10_000


def bad(detail: str, param: str | None, code: str | None = None) -> sdk.LocalmError:
    return sdk.LocalmError(400, detail, code=code, param=param)


@attrs.define
class Parsed:
    """A request read: the chat body (without the conversation of a previous response) and
    what the response object reports back."""

    body: dict[str, Any]  # the chat body; "messages" holds this request's input only
    instructions: str | None
    input_messages: list[dict[str, Any]]  # this request's input, as chat messages (kept in the store)
    #: where the input messages' places came from: (3, "content", 1) → "input[2].content[1]"
    places: dict[tuple[Any, ...], str]
    previous_response_id: str | None
    store: bool
    stream: bool
    logprobs: bool
    echo: dict[str, Any]  # the request fields the response object carries
    #: the client's fields this surface does not know: the chat plugins see them in the request
    unread: dict[str, Any] = attrs.Factory(dict)


def _get(body: dict[str, Any], key: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise bad(f"{key} must be {what}", key)
    return value


def parse(body: Any) -> Parsed:
    if not isinstance(body, dict):
        raise bad("The body must be a JSON object", None)
    unknown = sorted(k for k in body if k not in READ and k not in PASSED and k not in ACCEPTED)
    if unknown:
        log.debug("POST /v1/responses: fields with no effect: %s", ", ".join(unknown))

    if body.get("background"):
        raise bad("background is not served: a response is generated while the request waits", "background")
    for key in ("conversation", "prompt"):
        if body.get(key) is not None:
            raise bad(f"{key} is not served: send the input (and previous_response_id) instead", key)

    chat: dict[str, Any] = {}
    model = _get(body, "model", (str,), "a string")
    if model is not None:
        chat["model"] = model
    stream = _get(body, "stream", (bool,), "true or false", False)
    store = _get(body, "store", (bool,), "true or false", True)
    instructions = _get(body, "instructions", (str,), "a string")
    previous = _get(body, "previous_response_id", (str,), "a string")
    if previous == "":
        raise bad("previous_response_id must not be empty", "previous_response_id")

    cap = _get(body, "max_output_tokens", (int,), "an integer")
    if cap is not None:
        if cap < 1:
            raise bad(f"max_output_tokens must be at least 1, got {cap}", "max_output_tokens")
        chat["max_tokens"] = cap
    for key in ("temperature", "top_p"):
        value = _get(body, key, (int, float), "a number")
        if value is not None:
            chat[key] = value
    for key in PASSED:
        if key in body:
            chat[key] = body[key]

    # tools
    tools = _get(body, "tools", (list,), "a list of tools", [])
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad(f"tools[{i}] must be an object", f"tools[{i}]")
        kind = tool.get("type")
        if kind != "function":
            raise bad(f"tools[{i}].type {kind!r} is not served: only function tools are (built-in tools such as "
                      "web search, file search or code interpreter run on OpenAI's servers)", f"tools[{i}].type")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        chat_tools.append({"type": "function", "function": fn})
    if chat_tools:
        chat["tools"] = chat_tools
    choice = body.get("tool_choice")
    if choice is not None:
        if isinstance(choice, str):
            if choice not in ("auto", "none", "required"):
                raise bad(f'tool_choice must be "auto", "none", "required" or {{"type": "function", "name": ...}}, '
                          f"got {choice!r}", "tool_choice")
            chat["tool_choice"] = choice
        elif isinstance(choice, dict) and choice.get("type") == "function":
            if not isinstance(choice.get("name"), str):
                raise bad("tool_choice.name must be a string", "tool_choice")
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            kind = choice.get("type") if isinstance(choice, dict) else None
            raise bad('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}'
                      + (f"; {kind!r} is not served" if kind else ""), "tool_choice")
    parallel = _get(body, "parallel_tool_calls", (bool,), "true or false")
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel

    # text.format, text.verbosity
    text = _get(body, "text", (dict,), "an object", {})
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise bad(f"text.verbosity {verbosity!r} is not served: only medium", "text.verbosity")
    fmt = text.get("format")
    echo_format: dict[str, Any] = {"type": "text"}
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise bad("text.format must be an object such as {\"type\": \"json_object\"}", "text.format")
        kind = fmt.get("type")
        if kind == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif kind == "json_schema":
            spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            chat["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif kind != "text":
            raise bad(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text.format")
        echo_format = fmt

    # reasoning
    reasoning = _get(body, "reasoning", (dict,), "an object", {})
    effort = reasoning.get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise bad("reasoning.effort must be a string", "reasoning.effort")
        chat["reasoning_effort"] = effort
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if summary is not None and summary not in ("auto", "concise", "detailed"):
        raise bad(f"reasoning.summary must be auto, concise or detailed, got {summary!r}", "reasoning.summary")

    # include, top_logprobs
    include = _get(body, "include", (list,), "a list of strings", [])
    logprobs = False
    for i, value in enumerate(include):
        if value == LOGPROBS:
            logprobs = True
        elif value not in INCLUDE_NO_EFFECT:
            raise bad(f"include[{i}] {value!r} is not one of " + ", ".join((LOGPROBS, *INCLUDE_NO_EFFECT)),
                      "include")
    top = _get(body, "top_logprobs", (int,), "an integer from 0 to 20")
    if top is not None and not 0 <= top <= 20:
        raise bad(f"top_logprobs must be from 0 to 20, got {top}", "top_logprobs")
    if logprobs:
        chat["logprobs"] = True
        chat["top_logprobs"] = top or 0

    truncation = _get(body, "truncation", (str,), "auto or disabled", "disabled")
    if truncation not in ("auto", "disabled"):
        raise bad(f"truncation must be auto or disabled, got {truncation!r}", "truncation")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise bad("metadata must be an object of strings", "metadata")

    raw = body.get("input")
    if raw is None:
        raw = []
    messages, places = read_input(raw)
    if not messages and previous is None:
        raise bad("input must not be empty", "input")

    echo = {
        "instructions": instructions,
        "max_output_tokens": cap,
        "max_tool_calls": body.get("max_tool_calls"),
        "metadata": metadata or {},
        "parallel_tool_calls": True if parallel is None else parallel,
        "previous_response_id": previous,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": {"effort": effort, "summary": summary},
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": body.get("service_tier") or "default",
        "temperature": body.get("temperature", 1.0),
        "text": {"format": echo_format, "verbosity": "medium"},
        "tool_choice": choice if choice is not None else "auto",
        "tools": tools,
        "top_logprobs": top or 0,
        "top_p": body.get("top_p", 1.0),
        "truncation": truncation,
        "user": body.get("user"),
    }
    chat["messages"] = messages
    chat["stream"] = stream
    return Parsed(body=chat, instructions=instructions, input_messages=messages, places=places,
                  previous_response_id=previous, store=store, stream=stream, logprobs=logprobs, echo=echo,
                  unread={key: body[key] for key in unknown})


# --- input items -> chat messages -------------------------------------------------------

def _part(part: Any, at: str) -> dict[str, Any]:
    """One content part as an OpenAI chat part."""
    if not isinstance(part, dict):
        raise bad(f"{at} must be an object", at)
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        if not isinstance(part.get("text"), str):
            raise bad(f"{at}.text must be a string", at)
        return {"type": "text", "text": part["text"]}
    if kind == "refusal":
        if not isinstance(part.get("refusal"), str):
            raise bad(f"{at}.refusal must be a string", at)
        return {"type": "text", "text": part["refusal"]}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise bad(f"{at}: an input_image needs an image_url (a URL or a data: URL); file ids are not served", at)
        image: dict[str, Any] = {"url": url}
        if isinstance(part.get("detail"), str):
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, dict):
            raise bad(f"{at}.input_audio must be an object with data and format", at)
        return {"type": "input_audio", "input_audio": audio}
    if kind == "input_file":
        raise bad(f"{at}: input_file parts are not served", at)
    raise bad(f"{at}.type {kind!r} is not a content part here (input_text, output_text, input_image, input_audio)",
              at)


def _content(content: Any, at: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{at} must be a string or a list of content parts", at)
    return [_part(p, f"{at}[{j}]") for j, p in enumerate(content)]


def read_input(raw: Any) -> tuple[list[dict[str, Any]], dict[tuple[Any, ...], str]]:
    """input (a string or a list of items) as chat messages, and the input item each message,
    tool call and part came from, by its place among the messages (``(3, "tool_calls", 0)``)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}], {(0,): "input"}
    if not isinstance(raw, list):
        raise bad("input must be a string or a list of items", "input")
    if len(raw) > MAX_ITEMS:
        raise bad(f"input holds {len(raw)} items; at most {MAX_ITEMS} are accepted", "input", "limit_exceeded")
    messages: list[dict[str, Any]] = []
    places: dict[tuple[Any, ...], str] = {}
    names: dict[str, str] = {}  # call_id -> function name
    images: list[tuple[dict[str, Any], str]] = []  # images of tool outputs, waiting for the results to end

    def flush_images() -> None:
        if images:
            places[(len(messages),)] = images[0][1]
            places.update({(len(messages), "content", j): at for j, (_, at) in enumerate(images)})
            messages.append({"role": "user", "content": [part for part, _ in images]})
            images.clear()

    for i, item in enumerate(raw):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{at} must be an object", at)
        kind = item.get("type", "message" if "role" in item else None)
        if kind != "function_call_output":
            flush_images()
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(f"{at}.role must be one of {', '.join(ROLES)}, got {role!r}", at)
            places[(len(messages),)] = at
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _content(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise bad(f"{at}: a function_call needs a name and a call_id", at)
            if not isinstance(arguments, (str, dict)):
                raise bad(f"{at}.arguments must be a JSON string", at)
            names[call_id] = name
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                places[(len(messages),)] = at
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            calls = last.setdefault("tool_calls", [])
            where = (len(messages) - 1, "tool_calls", len(calls))
            places[where] = places[(*where, "function")] = at  # a call's name and arguments are the item's
            calls.append(call)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise bad(f"{at}: a function_call_output needs a call_id", at)
            if isinstance(output, list):
                texts = []
                for j, part in enumerate(output):
                    converted = _part(part, f"{at}.output[{j}]")
                    if converted["type"] == "text":
                        texts.append(converted["text"])
                    elif converted["type"] == "image_url":
                        images.append((converted, f"{at}.output[{j}]"))
                    else:
                        raise bad(f"{at}.output[{j}]: a tool output holds input_text and input_image parts", at)
                output = "".join(texts)
            elif not isinstance(output, str):
                raise bad(f"{at}.output must be a string or a list of parts", at)
            message = {"role": "tool", "tool_call_id": call_id, "content": output}
            if call_id in names:
                message["name"] = names[call_id]
            places[(len(messages),)] = at
            messages.append(message)
        elif kind == "reasoning":
            continue  # earlier thinking is not shown to the model again
        elif kind == "item_reference":
            raise bad(f"{at}: item_reference is not served (items are not stored one by one; "
                      "use previous_response_id)", at)
        else:
            raise bad(f"{at}.type {kind!r} is not served here (message, function_call, function_call_output, "
                      "reasoning)", at)
    flush_images()
    return messages, places


#: The chat body's places the Responses API names otherwise.
RENAMED = {("response_format",): "text.format", ("response_format", "json_schema"): "text.format",
           ("max_tokens",): "max_output_tokens", ("max_completion_tokens",): "max_output_tokens",
           ("reasoning_effort",): "reasoning.effort", ("tool_choice", "function"): "tool_choice",
           ("messages",): "input", ("logprobs",): "include"}


def origins(parsed: Parsed, instructions: int, earlier: int) -> Origins:
    """Where each place of the chat body came from: the system message of ``instructions``,
    the ``earlier`` messages of previous_response_id, then this request's input items; a
    function tool's fields sit on the tool itself (tools[0].name)."""
    names: dict[tuple[Any, ...], str] = dict(RENAMED)
    names.update({("messages", k): "instructions" for k in range(instructions)})
    names.update({("messages", instructions + k): "previous_response_id" for k in range(earlier)})
    before = instructions + earlier
    names.update({("messages", before + k, *rest): at for (k, *rest), at in parsed.places.items()})
    names.update({("tools", i, "function"): f"tools[{i}]" for i in range(len(parsed.body.get("tools", [])))})
    return Origins(names)
