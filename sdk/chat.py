"""The chat service's types: what a surface or a plugin gets from ``host.chat``.

The chat plugin provides the service; a chat surface (OpenAI, Ollama, Anthropic,
Responses) or any plugin that asks a model something calls it through ``host.chat``, typed
as :class:`ChatService`. A generation's streamed items are :class:`Status`,
:class:`Piece`, :class:`Reasoning` and :class:`Call`; its end is an :class:`Outcome`.
These records live here, in the SDK, so a plugin can name them without importing the chat
plugin; ``host.chat.Piece`` and the other class attributes still name the same classes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import attrs


@attrs.frozen
class Status:
    """What the model is doing (``waiting``, ``loading``, ``compacting``...), for a status
    event; a chat hook's ``context.status(code, text)`` sends one too."""
    code: str
    text: str


@attrs.frozen
class Piece:
    """Visible reply text, with the log probabilities of the tokens that spell it (when asked)."""
    text: str
    logprobs: tuple[dict[str, Any], ...] = ()


@attrs.frozen
class Reasoning:
    """Text of the model's <think> block."""
    text: str


@attrs.frozen
class Call:
    """One tool call, read whole from the reply (OpenAI's shape: id, type, function)."""
    call: dict[str, Any]


#: What ``Generation.items()`` yields.
Item = Status | Piece | Reasoning | Call


@attrs.define
class Outcome:
    """How a generation ended: its finish reason and token counts, once it has."""
    finish_reason: str = "stop"
    stop_sequence: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: prompt tokens a cache held (the engine did not compute them)
    cached_tokens: int = 0
    ttft_ms: float | None = None
    tokens_per_sec: float | None = None
    context_capacity: int = 0
    error: str | None = None
    #: the engine ended the reply itself (end of turn or a completed grammar), not a cap or a stop sequence
    ended_by_model: bool = False
    calls: list[dict[str, Any]] = attrs.Factory(list)
    #: the generated token ids, and the engine's activation reads when the plan asked for any
    token_ids: list[int] = attrs.Factory(list)
    activations: dict[tuple[int, str], Any] | None = None


class Reply(Protocol):
    """A whole reply (a request not streamed), as the chat_outlet hooks left it."""
    content: list[str]
    reasoning: list[str]
    logprobs: list[dict[str, Any]]
    calls: list[dict[str, Any]]
    rewritten: bool

    @property
    def text(self) -> str: ...


class Generation(Protocol):
    """A request checked, its model loaded and its prompt read; nothing generated yet.

    Stream it with ``items()``, or take it whole with ``reply()``; either runs the chat
    hooks (stream, stream end, outlet) and ends with ``outcome`` filled in. ``headers``
    are the response headers every surface sends; ``extra`` the fields plugins added to
    the response; ``model`` the name to show; ``entry`` the registry entry that answers."""
    entry: Any
    model: str
    headers: dict[str, str]
    extra: dict[str, Any]
    outcome: Outcome

    def items(self) -> AsyncIterator[Item]: ...

    async def reply(self) -> Reply: ...

    async def prime(self) -> None: ...


class ChatService(Protocol):
    """The chat service (``host.chat``): every chat surface's one way to a model."""

    Status: type[Status]
    Piece: type[Piece]
    Reasoning: type[Reasoning]
    Call: type[Call]

    async def chat(self, body: dict[str, Any], *, route: str = "chat.completions", request: Any = None,
                   report: bool | None = None, ignored: list[str] | None = None, extra: dict[str, Any] | None = None,
                   request_headers: Any = None, received: float | None = None,
                   compact: bool = True) -> Generation:
        """Prepare a chat generation from an OpenAI chat-completions ``body``."""

    async def complete(self, body: dict[str, Any], *, route: str = "completions", request: Any = None,
                       report: bool | None = None, ignored: list[str] | None = None,
                       extra: dict[str, Any] | None = None, request_headers: Any = None,
                       received: float | None = None) -> Generation:
        """Prepare a text completion from an OpenAI completions ``body``."""

    async def embed(self, model: str | None, texts: list[str]) -> tuple[Any, list[list[float]], int]:
        """(the registry entry, one normalised vector per text, the tokens they took)."""

    async def rerank(self, model: str | None, query: str, documents: list[str], *,
                     top_n: int | None = None) -> tuple[Any, list[dict[str, Any]], int]:
        """(the registry entry, the results best first, the tokens the model read)."""

    async def count_tokens(self, body: dict[str, Any], *, route: str = "anthropic.count_tokens",
                           request: Any = None, extra: dict[str, Any] | None = None) -> int:
        """The prompt tokens a chat ``body`` would take."""

    def check_chat_model(self, entry: Any) -> None:
        """A 400 ``not_a_chat_model`` for a model that does not chat."""

    def check_embedding_model(self, entry: Any) -> None:
        """A 422 ``not_an_embedding_model`` for a model that embeds nothing."""

    def usage(self, outcome: Outcome, *, timings: bool = True, capacity: bool = True) -> dict[str, Any]:
        """OpenAI's ``usage`` object for an outcome."""

    def redact(self, text: str) -> str:
        """An error text with absolute paths cut to file names."""


__all__ = ["Call", "ChatService", "Generation", "Item", "Outcome", "Piece", "Reasoning", "Reply", "Status"]
