"""The chat service's types: what a surface or a plugin gets from ``host.chat``.

The chat plugin provides the service; a chat surface (OpenAI, Ollama, Anthropic,
Responses) or any plugin that asks a model something calls it through ``host.chat``, typed
as :class:`ChatService`. A generation's streamed items are :class:`Status`,
:class:`Piece`, :class:`Reasoning` and :class:`Call`; its end is an :class:`Outcome`.
These records live here, in the SDK, so a plugin can name them without importing the chat
plugin; ``host.chat.Piece`` and the other class attributes still name the same classes.

A surface hands the service a :class:`ChatRequest`: the OpenAI chat body it translated its
client's request into, and :class:`Origins`, the map back to the client's own field names,
so a refusal names the field the client sent (``input[2]``, ``system``, ``output_config.format``).

The bounds the chat service reads a request within (``MAX_MESSAGES``, ``MAX_STOPS``...) are
here too, so a surface's request schema states the same numbers. A scoring request (the
probabilities of the next token, on the OpenAI routes) is answered by ``host.chat.score``
with :class:`Scores`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import attrs

from .engines import Sampling

#: The most stop sequences a request may send, and the longest one (400 past either).
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
#: The most messages one request may hold (past it: 400 limit_exceeded, before any is read).
MAX_MESSAGES = 10_000
#: The largest window a request may ask for with num_ctx (the engine opens at most its model's own).
MAX_NUM_CTX = 1 << 24
#: The most tools one request may declare (400 invalid_tools past it).
MAX_TOOLS = 64
#: The longest grammar (GBNF or Lark) a request may send, in bytes.
MAX_GRAMMAR_BYTES = 1024 * 1024
#: What reasoning_effort may be ("none" turns thinking off).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")

#: A place in the OpenAI chat body: keys and list indices, ``("messages", 3, "content", 1)``.
Path = tuple[str | int, ...]


def _spelled(path: Path, dotted: bool) -> str:
    """A path as OpenAI writes it (``messages[3].content[1]``), or with dots (``messages.3.content.1``)."""
    out = ""
    for step in path:
        if isinstance(step, int):
            out += f".{step}" if dotted else f"[{step}]"
        else:
            out += f".{step}" if out else step
    return out


@attrs.frozen
class Origins:
    """Where each place of a translated chat body came from in the client's request, so the
    chat service names the client's field when it refuses one.

    ``names`` maps a path of the chat body to the client's name for it. A path is named by
    its longest mapped prefix, with the rest appended (``("messages", 3)`` → ``"input[2]"``
    names ``("messages", 3, "content")`` ``"input[2].content"``); mapping a longer prefix
    renames a suffix (``("tools", 0, "function")`` → ``"tools[0]"`` names the function's
    ``name`` ``"tools[0].name"``). An unmapped path keeps its OpenAI name. ``dotted`` writes
    the appended indices as the client does (``.1`` for Anthropic, ``[1]`` otherwise)."""

    names: dict[Path, str] = attrs.field(factory=dict)
    dotted: bool = False

    def name(self, *path: str | int) -> str:
        """The client's name for the chat body's ``path``."""
        for cut in range(len(path), 0, -1):
            found = self.names.get(path[:cut])
            if found is not None:
                rest = _spelled(path[cut:], self.dotted)
                return found + ("" if not rest else rest if rest[0] == "." else "." + rest)
        return _spelled(path, self.dotted)


@attrs.frozen
class ChatRequest:
    """A chat request as a surface hands it to ``host.chat.chat``: the OpenAI chat ``body`` (the
    dict the chat hooks see), ``origins`` (the client's names for its places) and ``extra``
    (the client's fields the surface did not read, shown to the inlet hooks).

    The typed fields are the chat service's reading of the request once its inlet hooks ran
    (``Generation.request``); a surface leaves them unset."""

    body: dict[str, Any]
    origins: Origins = attrs.field(factory=Origins)
    extra: dict[str, Any] = attrs.field(factory=dict)
    #: the registry entry for ``body["model"]`` when the surface already resolved it (Ollama's
    #: names); None: the chat service resolves the model. Either way it is resolved once per
    #: request (again only when an inlet hook names another model). In ``Generation.request``:
    #: the entry of the model that answers.
    entry: Any = None
    model: str | None = None
    stream: bool = False
    messages: list[dict[str, Any]] | None = None
    sampling: Sampling | None = None
    stops: tuple[str, ...] = ()
    #: the chat plugin's read tools and response format (its constrained.Tools and Format)
    tools: Any = None
    format: Any = None
    #: None: no log probabilities; k: each token's k most likely alternatives
    logprobs: int | None = None
    #: enable_thinking as the template gets it (None: the model's default)
    thinking: bool | None = None
    #: stream_options.include_usage: a streamed reply ends with a usage chunk of its own
    include_usage: bool = False
    #: return_tokens_as_token_ids: a token is reported as ``token_id:<id>``, not its text
    token_ids: bool = False


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
    #: with a draft source on (``spec_source``), the spec's ``usage.speculation``: {"source",
    #: "state", "drafted", "accepted", "paused_steps", "reason"}; None when none was on
    speculation: dict[str, Any] | None = None


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
    the response; ``model`` the name to show; ``entry`` the registry entry that answers;
    ``request`` the request as read."""
    entry: Any
    model: str
    #: the system fingerprint: localm:<model>@<revision>:<dtype>/<quantization>:<engine>
    fingerprint: str
    headers: dict[str, str]
    extra: dict[str, Any]
    outcome: Outcome
    #: the request as the chat service read it (its typed fields filled in)
    request: ChatRequest

    def items(self) -> AsyncIterator[Item]: ...

    async def reply(self) -> Reply: ...

    async def prime(self) -> None: ...


@attrs.frozen
class Candidate:
    """A token scored for the next position: its ``id``, its ``key`` as reported (its text, or
    ``token_id:<id>`` when the request sent return_tokens_as_token_ids), its ``text`` (its bytes
    decoded, U+FFFD for a partial character), its own ``bytes`` and its ``logprob`` (at least
    -9999.0)."""
    id: int
    key: str
    text: str
    bytes: tuple[int, ...]
    logprob: float


@attrs.frozen
class Scores:
    """A scoring request's answer (``host.chat.score``): one forward pass per prompt, nothing
    generated. ``positions`` holds, per prompt, the candidates most likely first (the first is
    the reply's token); ``prompts`` the completions prompts as sent (empty for a chat);
    ``top`` the alternatives asked for (None: no probabilities asked); ``headers`` the
    response headers (the ignored-fields report, the steering and seed echoes)."""
    entry: Any
    #: the model name to show: the one asked for, or the model that answered
    model: str
    fingerprint: str
    headers: dict[str, str]
    positions: tuple[tuple[Candidate, ...], ...]
    prompts: tuple[str, ...]
    top: int | None
    prompt_tokens: int
    context_capacity: int
    #: milliseconds from the request's arrival to the scores
    ttft_ms: float


class ChatService(Protocol):
    """The chat service (``host.chat``): every chat surface's one way to a model."""

    Status: type[Status]
    Piece: type[Piece]
    Reasoning: type[Reasoning]
    Call: type[Call]

    async def chat(self, body: ChatRequest | dict[str, Any], *, route: str = "chat.completions", request: Any = None,
                   report: bool | None = None, ignored: list[str] | None = None, extra: dict[str, Any] | None = None,
                   request_headers: Any = None, received: float | None = None,
                   compact: bool = True) -> Generation:
        """Prepare a chat generation from a :class:`ChatRequest` (or a bare OpenAI chat body)."""

    async def complete(self, body: ChatRequest | dict[str, Any], *, route: str = "completions", request: Any = None,
                       report: bool | None = None, ignored: list[str] | None = None,
                       extra: dict[str, Any] | None = None, request_headers: Any = None,
                       received: float | None = None) -> Generation:
        """Prepare a text completion from an OpenAI completions ``body`` (or a ChatRequest holding one)."""

    async def embed(self, model: str | None, texts: list[str]) -> tuple[Any, list[list[float]], int]:
        """(the registry entry, one normalised vector per text, the tokens they took)."""

    async def rerank(self, model: str | None, query: str, documents: list[str], *,
                     top_n: int | None = None) -> tuple[Any, list[dict[str, Any]], int]:
        """(the registry entry, the results best first, the tokens the model read)."""

    async def count_tokens(self, body: ChatRequest | dict[str, Any], *, route: str = "anthropic.count_tokens",
                           request: Any = None, extra: dict[str, Any] | None = None,
                           headers: dict[str, str] | None = None) -> int:
        """The prompt tokens a chat ``body`` would take (routed as a reply would be); ``headers``,
        when given, receives the response headers a reply would carry (X-Localm-Model-Routing)."""

    def wants_scoring(self, body: Any) -> bool:
        """Whether an OpenAI completions or chat-completions body (any JSON value) asks for scoring
        mode: allowed_token_ids, or log probabilities with max_tokens 1 and no streaming."""

    async def score(self, body: dict[str, Any], *, kind: str, request: Any = None,
                    received: float | None = None) -> Scores:
        """Answer a scoring request: ``kind`` is "completions" or "chat" (which OpenAI body it is).
        Refusals are the scoring mode's (400 invalid_scoring_request, field_not_honoured...)."""

    def check_fields(self, kind: str, body: dict[str, Any], headers: Any) -> dict[str, str]:
        """For an OpenAI body of ``kind`` ("chat", "completions", "embeddings" or "rerank"): a 400
        field_not_honoured for an output-changing field the route cannot honour, then the
        ignored-fields report's response headers (maybe none; strict mode refuses instead)."""

    def check_chat_model(self, entry: Any) -> None:
        """A 400 ``not_a_chat_model`` for a model that does not chat."""

    def check_embedding_model(self, entry: Any) -> None:
        """A 422 ``not_an_embedding_model`` for a model that embeds nothing."""

    def usage(self, outcome: Outcome, *, timings: bool = True, capacity: bool = True) -> dict[str, Any]:
        """OpenAI's ``usage`` object for an outcome."""

    def redact(self, text: str) -> str:
        """An error text with absolute paths cut to file names."""


__all__ = ["Call", "Candidate", "ChatRequest", "ChatService", "EFFORTS", "Generation", "Item", "MAX_GRAMMAR_BYTES",
           "MAX_MESSAGES", "MAX_NUM_CTX", "MAX_STOPS", "MAX_STOP_CHARS", "MAX_TOOLS", "Origins", "Outcome", "Path",
           "Piece", "Reasoning", "Reply", "Scores", "Status"]
