"""Reading an OpenAI request body: every field used, refused with its reason, or typed wrong (422)."""

from __future__ import annotations

from typing import Any

import attrs

from localm import sdk
from localm.sdk import engines as spec

MAX_STOPS = 16
MAX_STOP_CHARS = 1024


class Invalid(sdk.LocalmError):
    """A field of the wrong type: 422 with one sentence per field and the structured list."""

    def __init__(self, errors: list[dict[str, str]]) -> None:
        detail = " ".join(f"{e['key']}: {e['message']}." for e in errors)
        super().__init__(422, detail, errors=errors)


@attrs.frozen
class Common:
    model: str | None
    stream: bool
    include_usage: bool
    sampling: spec.Sampling
    stops: tuple[str, ...]
    cache_prompt: bool


class Reader:
    """Collects type errors across fields, so one 422 names them all."""

    def __init__(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise Invalid([{"key": "body", "message": "must be a JSON object"}])
        self.body = body
        self.errors: list[dict[str, str]] = []

    def get(self, key: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
        value = self.body.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) and bool not in kinds:
            self.errors.append({"key": key, "message": f"must be {what}"})
            return default
        if not isinstance(value, kinds):
            self.errors.append({"key": key, "message": f"must be {what}"})
            return default
        return value

    def number(self, key: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
        value = self.get(key, (int, float), "a number", default)
        if value is not default and ((lo is not None and value < lo) or (hi is not None and value > hi)):
            raise sdk.LocalmError(400, f"{key} must be between {lo} and {hi}, got {value}")
        return float(value)

    def done(self) -> None:
        if self.errors:
            raise Invalid(self.errors)


def read_common(r: Reader) -> Common:
    model = r.get("model", (str,), "a string")
    stream = r.get("stream", (bool,), "true or false", False)
    cache_prompt = r.get("cache_prompt", (bool,), "true or false", True)
    options = r.get("stream_options", (dict,), "an object", {}) or {}
    include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
    n = r.get("n", (int,), "an integer", 1)
    if n != 1:
        raise sdk.LocalmError(400, "n must be 1: localm returns one choice per request")
    max_tokens = r.get("max_tokens", (int,), "an integer")
    max_completion = r.get("max_completion_tokens", (int,), "an integer")
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise sdk.LocalmError(400, "max_tokens and max_completion_tokens differ: send one of them")
    cap = max_tokens if max_tokens is not None else max_completion
    if cap is not None and cap < 1:
        raise sdk.LocalmError(400, "max_tokens must be at least 1")
    defaults = spec.Sampling()
    seed = r.get("seed", (int,), "an integer")
    if seed is not None and not 0 <= seed < 2**32:
        raise sdk.LocalmError(400, f"seed must be an integer from 0 to {2**32 - 1}, got {seed}")
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
        r.errors.append({"key": "stop", "message": "must be a string or a list of strings"})
    if len(stops) > MAX_STOPS:
        raise sdk.LocalmError(400, f"stop holds {len(stops)} sequences; at most {MAX_STOPS} are accepted")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise sdk.LocalmError(400, f"a stop sequence is {len(s)} characters; at most {MAX_STOP_CHARS}")
    stops = tuple(s for s in stops if s)
    return Common(model=model, stream=stream, include_usage=include_usage, sampling=sampling, stops=stops,
                  cache_prompt=cache_prompt)


def read_messages(r: Reader) -> list[dict[str, Any]]:
    messages = r.body.get("messages")
    if not isinstance(messages, list) or not messages:
        r.errors.append({"key": "messages", "message": "must be a non-empty list of messages"})
        return []
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            r.errors.append({"key": f"messages[{i}]", "message": "must be an object with a role"})
            continue
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise sdk.LocalmError(400, f"messages[{i}].role {m['role']!r} is not one of system, developer, "
                                       "user, assistant, tool")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif isinstance(part, dict) and part.get("type") in ("image_url", "input_audio"):
                    raise sdk.LocalmError(400, f"messages[{i}].content[{j}]: this model takes text only")
                else:
                    r.errors.append({"key": f"messages[{i}].content[{j}]", "message": "must be a text part"})
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            r.errors.append({"key": f"messages[{i}].content", "message": "must be a string or a list of parts"})
            continue
        out.append({"role": role, "content": content})
    return out
