"""Every request field is honoured, reported or refused, never dropped silently.

- A field the route does not use is named in ``X-Localm-Ignored-Fields`` and logged once
  per request without its value; ``X-Localm-Strict: true`` (or 1) refuses such a request
  with 400 ``unused_fields_refused``. The report and the header are the SDK's
  (``sdk.report_ignored``), the same on every surface.
- A field that would change the output but cannot be honoured here is refused with 400
  ``field_not_honoured`` before any model loads, unless it carries a "no change" value.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from localm import sdk
from localm.sdk.chat import Origins

log = logging.getLogger("localm.plugin.chat")

#: Fields the request path reads, per route.
USED = {
    "chat": {"model", "messages", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "seed",
             "stop", "presence_penalty", "frequency_penalty", "repeat_penalty", "max_tokens",
             "max_completion_tokens", "n", "cache_prompt", "logprobs", "top_logprobs", "return_tokens_as_token_ids",
             "response_format", "tools", "tool_choice", "parallel_tool_calls", "grammar", "grammar_lazy",
             "grammar_triggers", "chat_template_kwargs", "reasoning_effort", "num_ctx", "pin_model",
             "required_capabilities", "min_context", "spec_source"},
    "completions": {"model", "prompt", "echo", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p",
                    "seed", "stop", "presence_penalty", "frequency_penalty", "repeat_penalty", "max_tokens",
                    "max_completion_tokens", "n", "cache_prompt", "logprobs", "return_tokens_as_token_ids",
                    "add_special_tokens", "grammar", "grammar_lazy", "grammar_triggers", "num_ctx", "pin_model",
                    "required_capabilities", "min_context", "spec_source"},
    "embeddings": {"model", "input", "encoding_format"},
    "rerank": {"model", "query", "documents", "top_n", "return_documents"},
}
#: A document's fields /v1/rerank reads (a document may be a string or {"text": ...}).
DOCUMENT_USED = {"text"}
MESSAGE_USED = {"role", "content", "untrusted_spans", "origin"}
#: Message fields read for one role only.
ROLE_USED = {"assistant": {"tool_calls"}, "tool": {"tool_call_id", "name"}}
PART_USED = {"type", "text", "image_url", "input_audio"}
#: A body's places as OpenAI names them (a request with no origins).
OPENAI = Origins()


def _no_change(key: str, value: Any) -> bool:
    """The values that ask for nothing a route would have to honour."""
    if value is None:
        return True
    return {
        "logprobs": value is False,
        "top_logprobs": value == 0,
        "response_format": isinstance(value, dict) and value.get("type") == "text",
        "tools": value == [],
        "tool_choice": value == "none",
        "parallel_tool_calls": isinstance(value, bool),
        "logit_bias": value == {},
        "function_call": value == "none",
        "functions": value == [],
        "modalities": value == ["text"],
        "n": value == 1,
        "best_of": value == 1,
        "suffix": value == "",
    }.get(key, False)


#: Output-changing fields no route here honours yet, with what to send instead.
NOT_HONOURED = {
    "top_logprobs": "use logprobs (an integer) on text completions",
    "response_format": "structured output is served on chat completions (use grammar here)",
    "tools": "tool calling is served on chat completions",
    "tool_choice": "tool calling is served on chat completions",
    "parallel_tool_calls": "tool calling is served on chat completions",
    "logit_bias": "token ids differ between models",
    "best_of": "one completion is generated and returned: leave best_of at 1",
    "suffix": "no model here fills in the middle: send the prompt alone",
    "functions": "the deprecated function-calling fields are not served: send tools",
    "function_call": "the deprecated function-calling fields are not served: send tools and tool_choice",
    "audio": "audio output is not served",
    "modalities": "only text output is served",
    "web_search_options": "web search is not served",
    "chat_template_kwargs": "text completions apply no chat template",
    "reasoning_effort": "text completions apply no chat template",
    "allowed_token_ids": "allowed_token_ids is for scoring: it needs max_tokens 1, n 1 and no streaming",
    "logprobs": "embeddings have no token probabilities",
    "grammar": "embeddings generate nothing",
    "grammar_lazy": "embeddings generate nothing",
    "grammar_triggers": "embeddings generate nothing",
    "dimensions": "embeddings keep the model's own size",
    "profile": "steering is served by the steering plugin",
    "steering_intensity": "steering is served by the steering plugin",
    "steering": "steering is served by the steering plugin",
    "return_sae_activations": "SAE activations are served by the steering plugin",
}
#: Where a route needs its own reason for refusing one of NOT_HONOURED.
NOT_HONOURED_ON = {
    "rerank": {"logprobs": "reranking returns one score per document, no token probabilities",
               "grammar": "reranking generates nothing", "grammar_lazy": "reranking generates nothing",
               "grammar_triggers": "reranking generates nothing", "dimensions": "reranking returns no vectors"},
}


def check(route: str, body: dict[str, Any], headers: Any, used: set[str] | None = None) -> dict[str, str]:
    """Refuse what cannot be honoured; return the ignored-fields headers to send (maybe none).

    ``used`` replaces the route's own set of used fields (scoring requests read other fields).
    """
    used = USED[route] if used is None else used
    refuse_not_honoured(route, body, used)
    return sdk.report_ignored(list(_unused(route, body, used, OPENAI)), headers, ROUTE_NAMES[route], log=log)


def refuse_not_honoured(route: str, body: dict[str, Any], used: set[str], origins: Origins = OPENAI) -> None:
    """400 field_not_honoured for an output-changing field nothing here serves (named as
    ``origins`` says the client calls it)."""
    for key, value in body.items():
        if key in NOT_HONOURED and key not in used and not _no_change(key, value):
            reason = NOT_HONOURED_ON.get(route, {}).get(key, NOT_HONOURED[key])
            where = origins.name(key)
            raise sdk.LocalmError(400, f"{where} cannot be honoured on {ROUTE_NAMES[route]}: {reason}",
                                  code="field_not_honoured", field=where)


def unused(route: str, body: dict[str, Any], used: set[str], origins: Origins = OPENAI) -> list[str]:
    """Where ``body`` holds fields the route does not use (``messages[2].name``, ...), as the
    client names them."""
    return list(_unused(route, body, used, origins))


def claimed(location: str, claims: set[str]) -> bool:
    """Whether a claim covers ``location``: the field itself or one that holds it."""
    return any(location == c or location.startswith((c + ".", c + "[")) for c in claims)


ROUTE_NAMES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings",
               "rerank": "/v1/rerank"}


def _unused(route: str, body: dict[str, Any], used: set[str], origins: Origins) -> Iterable[str]:
    name = origins.name
    for key, value in body.items():
        if key in used:
            continue
        if key in NOT_HONOURED and _no_change(key, value):
            continue  # a "no change" value is honoured by doing nothing
        yield name(key)
    if route == "rerank" and isinstance(body.get("documents"), list):
        for i, document in enumerate(body["documents"]):
            if isinstance(document, dict):
                yield from (name("documents", i, key) for key in document if key not in DOCUMENT_USED)
    kwargs = body.get("chat_template_kwargs")
    if route == "chat" and isinstance(kwargs, dict):
        yield from (name("chat_template_kwargs", key) for key in kwargs if key != "enable_thinking")
    if route == "chat" and isinstance(body.get("messages"), list):
        for i, m in enumerate(body["messages"]):
            if not isinstance(m, dict):
                continue
            role_used = ROLE_USED.get(m.get("role"), set())
            for key in m:
                if key not in MESSAGE_USED and key not in role_used and not (key == "tool_calls" and not m[key]):
                    yield name("messages", i, key)
            if isinstance(m.get("content"), list):
                for j, part in enumerate(m["content"]):
                    if isinstance(part, dict):
                        for key in part:
                            if key not in PART_USED:
                                yield name("messages", i, "content", j, key)
