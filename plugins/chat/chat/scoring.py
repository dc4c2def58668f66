"""Scoring mode: the probabilities of the next token, on /v1/completions and /v1/chat/completions.

A request is scored rather than generated from when it sends ``allowed_token_ids``, or
asks for probabilities (``logprobs: N`` on completions, ``logprobs: true`` on chat) with
``max_tokens: 1`` and no streaming. One forward pass runs per prompt and nothing is
generated:

- the candidates are ``allowed_token_ids`` (deduplicated, in order) or the whole vocabulary;
- ``z = logits / T`` (``T`` the temperature, none when 0 or absent) and each candidate's
  log probability is ``z - logsumexp(z over the candidates)``, in float64;
- the reply's text is the most probable candidate; ``finish_reason`` is ``"length"``.

Here the request is read and the candidates scored (``host.chat.score`` answers with
``localm.sdk.chat.Scores``); the openai plugin renders them in OpenAI's shapes.

What is reported:

- completions: ``logprobs`` is OpenAI's legacy object (``tokens``, ``token_logprobs``,
  ``top_logprobs``, ``text_offset``). ``top_logprobs`` holds the ``logprobs`` most likely
  tokens (at least the chosen one); with ``allowed_token_ids`` it holds every allowed
  token (they are normalised over that set only, so every listed token is returned).
  Keyed by text, two ids that decode to the same text share one entry (the more likely
  one's value). ``allowed_token_ids`` without ``logprobs``: ``logprobs`` is null.
- chat: ``logprobs.content`` holds one entry, the scored token, with
  ``min(top_logprobs, candidates)`` alternatives (none for 0 or absent).
- A token is keyed by its text (its bytes decoded, U+FFFD for a partial character), or
  ``token_id:<id>`` with ``return_tokens_as_token_ids``; ``bytes`` is always the token's
  own bytes. A log probability below -9999 reads -9999.0.

Refusals: a token id outside the vocabulary and a prompt that tokenises to nothing are 400
``invalid_scoring_request``, as are the scoring rule's (``max_tokens: 1``, ``n: 1``, no
streaming, a temperature of 0 or 0.001 to 2). NaN or +inf logits on a candidate, or -inf
on a reported token, are 500 ``non_finite_logits``. Steering and constraining fields are
400 ``field_not_honoured``. A chat model with no template is 400 ``no_chat_template``.

Chat scoring renders the messages as a chat generation would (the template with the
generation prompt, ``enable_thinking``, untrusted spans, tool turns) and tokenises them
without adding special tokens (the template writes the BOS), so it equals completion
scoring of the rendered prompt with ``add_special_tokens: false``. No chat hooks run: the
messages are scored as sent. Scoring is never steered (``X-Localm-Steering: none``).

The sampling fields other than temperature (top_p, top_k, min_p, the penalties, stop,
seed, cache_prompt) are accepted, validated as on generation, and change nothing; a seed
is echoed.
"""

from __future__ import annotations

import time
from typing import Any

from localm import sdk
from localm.sdk.chat import Candidate, Scores

from . import fields, pipeline
from .request import Reader, read_common, read_messages, read_options

MAX_ALTERNATIVES = 20
MIN_TEMPERATURE = 0.001
FLOOR = -9999.0  # a log probability too small to represent
RULE = "scoring mode needs max_tokens: 1 and n: 1 and no streaming"
INVALID = "invalid_scoring_request"

#: Fields a scoring request reads (the sampling ones besides temperature change nothing).
_COMMON = {"model", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens", "temperature",
           "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty", "repeat_penalty",
           "cache_prompt", "logprobs", "allowed_token_ids", "return_tokens_as_token_ids"}
USED = {
    "completions": _COMMON | {"prompt", "echo", "add_special_tokens"},
    "chat": _COMMON | {"messages", "top_logprobs", "chat_template_kwargs", "reasoning_effort"},
}

_UNCONSTRAINED = "scoring reads the model's own next-token distribution, unconstrained"
_UNSTEERED = "scoring is always unsteered"
#: Fields that would change a scoring request's answer: refused naming them (a "no change" value passes).
REFUSED = {
    "response_format": _UNCONSTRAINED, "tools": _UNCONSTRAINED, "tool_choice": _UNCONSTRAINED,
    "grammar": _UNCONSTRAINED, "grammar_lazy": _UNCONSTRAINED, "grammar_triggers": _UNCONSTRAINED,
    "profile": _UNSTEERED, "steering_intensity": _UNSTEERED, "steering": _UNSTEERED,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_one(value: Any) -> bool:
    return _is_int(value) and value == 1


def _holds_media(body: dict[str, Any]) -> bool:
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in ("image_url", "input_audio") for p in m["content"])
        for m in messages)


def wanted(body: Any) -> bool:
    """Is this request body a scoring request? (Any JSON value; only an object can be.)"""
    if not isinstance(body, dict):
        return False
    if body.get("allowed_token_ids") is not None:
        return True  # streamed or not: a streamed one is refused by the scoring rule
    if body.get("stream") is True:
        return False
    if _holds_media(body):  # a picture is read by generating: a reply of one token with its log probabilities
        return False
    if not (_is_one(body.get("max_tokens")) or _is_one(body.get("max_completion_tokens"))):
        return False
    logprobs = body.get("logprobs")
    return logprobs is True or (_is_int(logprobs) and logprobs >= 0)


# --- the numbers ---------------------------------------------------------------------------

def _non_finite(what: str, ids: list[int]) -> sdk.LocalmError:
    shown = ", ".join(str(i) for i in ids[:8]) + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")
    return sdk.LocalmError(500, f"The model produced {what} logits for token {shown}: the scores cannot be "
                                "computed (a fault in the model or its runtime)", code="non_finite_logits")


def distribution(logits: Any, allowed: list[int] | None, temperature: float,
                 report: int | None) -> list[tuple[int, float]]:
    """The ``report`` most likely candidates (all of them for None) as (token id, log probability),
    most likely first; ties in candidate order.

    ``allowed`` (distinct ids) restricts the candidates; ``temperature`` divides the logits
    (0 means none). Refuses an id outside the vocabulary (400), NaN or +inf on a candidate,
    and -inf on a reported token (500).
    """
    import numpy as np

    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    n_vocab = x.shape[0]
    if allowed is not None:
        outside = [i for i in allowed if not 0 <= i < n_vocab]
        if outside:
            raise sdk.LocalmError(400, f"allowed_token_ids holds {', '.join(map(str, outside[:8]))}, outside "
                                       f"the model's vocabulary of {n_vocab} tokens (0 to {n_vocab - 1})",
                                  code=INVALID, param="allowed_token_ids")
        candidates = np.asarray(allowed, dtype=np.int64)
    else:
        candidates = np.arange(n_vocab, dtype=np.int64)
    z = x[candidates]
    bad = np.isnan(z) | np.isposinf(z)
    if bad.any():
        raise _non_finite("NaN or +inf", candidates[bad].tolist())
    if temperature > 0:
        z = z / temperature
    count = len(candidates) if report is None else max(1, min(report, len(candidates)))
    if count < len(candidates):
        top = np.argpartition(-z, count - 1)[:count]
        order = top[np.lexsort((top, -z[top]))]  # by value, then candidate order
    else:
        order = np.lexsort((np.arange(len(z)), -z))
    chosen = z[order]
    if np.isneginf(chosen).any():
        raise _non_finite("-inf", candidates[order][np.isneginf(chosen)].tolist())
    m = z.max()
    lse = m + np.log(np.exp(z - m).sum())
    values = chosen - lse
    return [(int(i), float(v) if v >= FLOOR else FLOOR) for i, v in zip(candidates[order], values)]


# --- reading the request ----------------------------------------------------------------------

class _Ask:
    """What a scoring request asks for, read and validated before any model loads."""

    def __init__(self, route: str, body: Any) -> None:
        r = Reader(body)
        body = r.body
        self.route = route
        self.body = body
        if body.get("stream") is True:
            raise _rule("stream: true")
        n = body.get("n")
        if _is_int(n) and n != 1:
            raise _rule(f"n: {n}")
        for key in ("max_tokens", "max_completion_tokens"):
            if _is_int(body.get(key)) and body[key] != 1:
                raise _rule(f"{key}: {body[key]}")
        for key, why in REFUSED.items():  # before they are parsed: none of them applies here
            if key in body and not fields._no_change(key, body[key]):
                raise sdk.LocalmError(400, f"{key} cannot be honoured on a scoring request: {why}",
                                      code="field_not_honoured", field=key)
        if route == "completions" and body.get("echo") is True:
            raise sdk.LocalmError(400, "echo cannot be honoured on a scoring request: the prompt's tokens are "
                                       "not scored", code="field_not_honoured", field="echo")
        common = read_common(r)
        options = read_options(r, route)
        self.model = common.model
        self.seed = common.sampling.seed
        self.top = options.logprobs  # None: no probabilities asked; k: k alternatives
        self.as_ids = options.token_ids
        self.add_special = options.add_special
        self.thinking = options.thinking
        temperature = body.get("temperature")
        self.temperature = float(temperature) if _is_number(temperature) else 0.0
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise sdk.LocalmError(400, f"temperature {temperature} is below {MIN_TEMPERATURE}, which would "
                                       "overflow the logits: send 0 (no scaling) or 0.001 to 2",
                                  code=INVALID, param="temperature")
        self.allowed = self._allowed(r)
        if route == "completions":
            r.get("echo", (bool,), "true or false", False)
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                prompt = [prompt]
            if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) for p in prompt):
                r.errors.append({"key": "prompt", "message": "must be a string or a non-empty list of strings"})
                prompt = []
            self.prompts: list[str] = prompt
        else:
            self.messages = read_messages(r)
        r.done()
        if common.sampling.max_tokens is None:
            raise _rule("no max_tokens")

    @staticmethod
    def _allowed(r: Reader) -> list[int] | None:
        value = r.body.get("allowed_token_ids")
        if value is None:
            return None
        if not isinstance(value, list) or not all(_is_int(i) for i in value):
            r.errors.append({"key": "allowed_token_ids", "message": "must be a list of token ids (integers)"})
            return None
        if not value:
            raise sdk.LocalmError(400, "allowed_token_ids is empty: list at least one token id", code=INVALID,
                                  param="allowed_token_ids")
        return list(dict.fromkeys(value))  # a repeated id is one candidate


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rule(what: str) -> sdk.LocalmError:
    return sdk.LocalmError(400, f"{RULE} (got {what}): send max_tokens: 1 (or max_completion_tokens: 1), "
                                "leave n at 1 and stream off", code=INVALID)


# --- answering ---------------------------------------------------------------------------------

class _Tokens:
    """A scored token as reported: its key (its text, or token_id:<id>), text and bytes."""

    def __init__(self, engine: Any, as_ids: bool) -> None:
        self.engine = engine
        self.as_ids = as_ids

    def candidate(self, token: int, logprob: float) -> Candidate:
        raw = bytes(self.engine.token_bytes(token))
        text = raw.decode("utf-8", errors="replace")
        return Candidate(id=token, key=f"token_id:{token}" if self.as_ids else text, text=text, bytes=tuple(raw),
                         logprob=logprob)


class _AsWritten:
    """The engine, tokenising without adding special tokens: a rendered template writes its own."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self._engine.tokenize(text, add_special=False, parse_special=parse_special)


def _prompt_tokens(engine: Any, ask: _Ask) -> list[list[int]]:
    if ask.route == "completions":
        prompts = [engine.tokenize(p, add_special=ask.add_special) for p in ask.prompts]
    else:  # rendered as for generation (untrusted spans, tool turns, thinking), no special tokens added
        from .prompt import chat_tokens
        from .request import media_of
        if media_of(ask.messages):
            raise sdk.LocalmError(400, "allowed_token_ids scores text prompts: a request with an image or audio "
                                       "part is answered by generating (without allowed_token_ids)", code=INVALID,
                                  param="messages")
        prompts = [chat_tokens(_AsWritten(engine), ask.messages, thinking=ask.thinking)[0]]
    window = engine.capabilities.context_limit  # the window grows to score a longer prompt
    for i, ids in enumerate(prompts):
        if not ids:
            which = "The prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise sdk.LocalmError(400, f"{which} tokenises to nothing: there is no position to score",
                                  code=INVALID, param="prompt" if ask.route == "completions" else "messages")
        pipeline.check_fits(len(ids), window)
    return prompts


async def score(host: Any, request: Any, route: str, body: Any, received: float | None = None) -> Scores:
    """Answer a scoring request on ``route`` ("completions" or "chat"): the scores, which the
    OpenAI surface renders (its choices, logprobs objects and usage)."""
    from .service import fingerprint  # the service imports this module first

    received = time.perf_counter() if received is None else received
    ask = _Ask(route, body)
    headers = fields.check(route, ask.body, request.headers if request is not None else {}, used=USED[route])
    entry = host.models.resolve(ask.model)
    if entry.role in ("stt", "tts"):  # a speech model has no tokens to score
        host.chat.check_chat_model(entry)
    scored: list[tuple[list[int], list[tuple[int, float]]]] = []
    async with host.models.use(entry.id) as resident:
        engine = resident.engine
        if not callable(getattr(engine, "next_token_logits", None)):
            field = "allowed_token_ids" if ask.allowed is not None else "logprobs"
            raise sdk.LocalmError(400, f"The {engine.engine} engine does not score tokens", code="field_not_honoured",
                                  field=field)
        prompts = _prompt_tokens(engine, ask)
        if route == "completions":
            report = None if ask.allowed is not None and ask.top is not None else (ask.top or 1)
        else:
            report = max(ask.top or 0, 1)
        for ids in prompts:
            logits = await engine.next_token_logits(ids)
            scored.append((ids, distribution(logits, ask.allowed, ask.temperature, report)))
        tokens = _Tokens(engine, ask.as_ids)
        positions = tuple(tuple(tokens.candidate(token, logprob) for token, logprob in best) for _, best in scored)
        system_fingerprint = fingerprint(entry, engine)
        window = engine.capabilities.context_window
    headers.update({"X-Localm-Steering": "none", "X-miLLM-Steering": "none"})
    if ask.seed is not None:  # accepted and echoed; scoring draws nothing
        headers.update({name: f'{ask.seed};scope="request"' for name in ("X-Localm-Seed", "X-miLLM-Seed")})
    shown = ask.model if ask.model not in (None, "", "localm") else entry.id
    return Scores(entry=entry, model=shown, fingerprint=system_fingerprint, headers=headers, positions=positions,
                  prompts=tuple(ask.prompts) if route == "completions" else (), top=ask.top,
                  prompt_tokens=sum(len(ids) for ids, _ in scored), context_capacity=window,
                  ttft_ms=round((time.perf_counter() - received) * 1000, 1))
