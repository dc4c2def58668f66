"""A model's defaults (its registry entry's ``defaults``: what an Ollama Modelfile's SYSTEM,
PARAMETER and MESSAGE lines set) applied to a request, on every surface alike.

What the request says wins: an option it sets is kept, a system message it sends replaces the
model's system prompt. What it leaves out comes from the model: ``options`` (Ollama's names:
num_predict is the reply cap, max_tokens; temperature, top_p, top_k, min_p, seed, stop,
repeat_penalty, presence_penalty, frequency_penalty, num_ctx), ``system`` (put first when the
conversation has no system message) and ``messages`` (put before the conversation, after its
system messages). A text completion (a raw prompt) takes the options only. The other
parameters a Modelfile may hold (mirostat, num_keep, ...) are kept and shown, not applied;
``template`` is shown, and the model's own chat template renders the prompt.
"""

from __future__ import annotations

from typing import Any

#: Ollama option names and the request fields they fill.
OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
           "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "num_ctx": "num_ctx", "num_predict": "max_tokens",
           "stop": "stop"}


def _given(body: dict[str, Any], key: str) -> bool:
    if key == "max_tokens":
        return body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
    return body.get(key) is not None


def apply(body: dict[str, Any], entry: Any, kind: str) -> dict[str, Any]:
    """``body`` with ``entry``'s defaults filled in where it says nothing (a new dict), or
    ``body`` itself when the model has none to add."""
    defaults = getattr(entry, "defaults", None)
    if not isinstance(defaults, dict) or not defaults:
        return body
    out = dict(body)
    options = defaults.get("options") if isinstance(defaults.get("options"), dict) else {}
    for name, key in OPTIONS.items():
        value = options.get(name)
        if value is None or isinstance(value, bool) or _given(out, key):
            continue
        if name in ("num_predict", "num_ctx") and (not isinstance(value, int) or value <= 0):
            continue  # -1 (no limit) and -2 (fill the context): the reply is not capped
        if name == "seed" and (not isinstance(value, int) or value < 0):
            continue  # a negative seed is Ollama's "random"
        if name == "stop" and (not isinstance(value, list) or not value or out.get("response_format")):
            continue  # a stop sequence could cut a structured reply: a format wins
        out[key] = list(value) if isinstance(value, list) else value
    messages = out.get("messages")
    if kind == "chat" and isinstance(messages, list) and messages:
        lead = 0
        while lead < len(messages) and isinstance(messages[lead], dict) \
                and messages[lead].get("role") in ("system", "developer"):
            lead += 1
        before = [dict(m) for m in defaults.get("messages") or []
                  if isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)]
        system = defaults.get("system")
        if lead == 0 and isinstance(system, str) and system:
            before.insert(0, {"role": "system", "content": system})
        if before:
            out["messages"] = [*messages[:lead], *before, *messages[lead:]] if lead else [*before, *messages]
    return out if out != body else body
