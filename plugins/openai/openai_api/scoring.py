"""Scoring mode's answers in OpenAI's shapes, on /v1/completions and /v1/chat/completions.

The chat service reads a scoring request and scores the next token (``host.chat.score``; the
mode is described in the chat plugin's scoring.py); this renders its
``localm.sdk.chat.Scores``:

- completions: one choice per prompt; ``logprobs`` is OpenAI's legacy object (``tokens``,
  ``token_logprobs``, ``top_logprobs``, ``text_offset``), null when no probabilities were
  asked. ``top_logprobs`` is keyed by token: two ids that decode to the same text share one
  entry (the more likely one's value).
- chat: one choice; ``logprobs.content`` holds the scored token with ``top_logprobs``
  alternatives.

``finish_reason`` is always ``"length"``: one token, never generated.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from localm import sdk
from localm.sdk.chat import Candidate, Scores


async def serve(request: sdk.Request, route: str, body: Any) -> sdk.Response:
    """Answer a scoring request on ``route`` ("completions" or "chat")."""
    scores = await sdk.host_of(request).chat.score(body, kind=route, request=request)
    if route == "completions":
        choices = [_completion_choice(i, prompt, best, scores)
                   for i, (prompt, best) in enumerate(zip(scores.prompts, scores.positions))]
    else:
        choices = [_chat_choice(scores.positions[0], scores)]
    completion_tokens = len(scores.positions)
    usage: dict[str, Any] = {"prompt_tokens": scores.prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": scores.prompt_tokens + completion_tokens}
    if route == "chat":
        usage.update(ttft_ms=scores.ttft_ms, tokens_per_sec=None, context_capacity=scores.context_capacity)
    return sdk.Response({"id": ("cmpl-" if route == "completions" else "chatcmpl-") + secrets.token_hex(12),
                         "object": "text_completion" if route == "completions" else "chat.completion",
                         "created": int(time.time()), "model": scores.model,
                         "system_fingerprint": scores.fingerprint, "choices": choices, "usage": usage},
                        headers=scores.headers)


def _entry(candidate: Candidate) -> dict[str, Any]:
    return {"token": candidate.key, "logprob": candidate.logprob, "bytes": list(candidate.bytes)}


def _completion_choice(index: int, prompt: str, best: tuple[Candidate, ...], scores: Scores) -> dict[str, Any]:
    chosen = best[0]
    logprobs = None
    if scores.top is not None:
        top: dict[str, float] = {}
        for other in best:
            top.setdefault(other.key, other.logprob)  # the same text twice: the more likely one's entry
        logprobs = {"tokens": [chosen.key], "token_logprobs": [chosen.logprob], "top_logprobs": [top],
                    "text_offset": [len(prompt)]}
    return {"index": index, "text": chosen.text, "logprobs": logprobs, "finish_reason": "length",
            "stop_sequence": None}


def _chat_choice(best: tuple[Candidate, ...], scores: Scores) -> dict[str, Any]:
    chosen = best[0]
    logprobs = None
    if scores.top is not None:
        entry = _entry(chosen)
        entry["top_logprobs"] = [_entry(c) for c in best[:scores.top]]
        logprobs = {"content": [entry], "refusal": None}
    return {"index": 0, "message": {"role": "assistant", "content": chosen.text}, "logprobs": logprobs,
            "finish_reason": "length", "stop_sequence": None}
