"""The engine hook spec: what an inference engine provides to localm.

An engine plugin registers a factory (``register_engines`` hook); the model manager
calls ``factory(model, options)`` in a worker thread to load a model and gets back an
:class:`Engine`. Surfaces (the chat plugin's OpenAI routes, the Ollama and Anthropic
plugins) never schedule work themselves: they hand the engine a prompt and sampling
settings and read its event stream. The engine owns the queue, so it can later decode
several requests in one batch without any surface changing.

The event stream of :meth:`Engine.generate`:

- :class:`Queued` (zero or more times): the request waits behind others; ``ahead`` is
  how many run or wait before it.
- :class:`Started`: the engine took the request; the prompt is being processed.
- :class:`Token` (for each generated token): its id and the text it completes; with
  ``logprobs`` requested, its log probability and the most likely alternatives.
- :class:`Status` (any number, optional): what the engine is doing, for status events.
- :class:`Finished` (last): why it stopped, and token counts and timings.

Closing the async iterator early (a client that went away, a stop sequence found by
the caller) stops the generation within a token or two and frees the engine.

A request may carry a :class:`Constraint`: an llguidance grammar that masks the
logits before each draw, from the first token or, lazily, from a trigger text on.
Log probabilities are always those of the model's raw logits, before penalties,
temperature, top-k/p, min-p and the grammar mask. The shared machinery (token masks,
log-softmax entries) is in :mod:`localm.sdk.constrain`, and the queues an engine may run
its requests through (:class:`~localm.sdk.scheduling.Serial`, :class:`~localm.sdk.scheduling.Batched`)
in :mod:`localm.sdk.scheduling`: both are the engines' own, not the kernel's.

A request may also carry forward-pass :class:`Intervention` s (steering) and
:class:`ActivationRead` s (SAE activations, monitoring): see those classes. They belong to
that one request: an engine applies them only to its own forward passes (hooks installed
for the request and removed when it ends), never as state left on the model, so another
request, :meth:`Engine.embed` and :meth:`Engine.next_token_logits` (which take no
interventions) always see the unmodified model. That is how embeddings and scoring stay
unsteered, even while a steered generation runs on the same engine. Only an engine whose
capabilities say ``interventions=True`` accepts them; any other ends such a request with
``Finished(reason="error")``.

An engine whose capabilities say ``messages`` answers whole chat requests: its
``generate`` reads ``request.chat`` (the OpenAI body after the inlet hooks, and the chat
context) instead of a token prompt, and its Token events carry text with ``id`` -1. Its
Finished event's token counts are what it knows of them (0 when nothing counted them).

A request may place images and sounds in its prompt (``GenerateRequest.media``, a
:class:`MediaSpan` each) for an engine whose model sees or hears (:class:`MediaEngine`):
the chat service renders the template with ``engine.media_marker`` where a message holds
one, tokenizes the text around the markers, and asks ``engine.media_tokens`` how many
positions each takes, so the window arithmetic counts them like tokens.

Where a model's weights went is the engine's to say: a loaded model may carry a
:class:`Placement` (``placement``), and an engine that can read its accelerator's memory a
``vram()`` method (free and total bytes of the devices it uses, or None). Both are
optional, and say only what the backend reports: an engine that cannot tell leaves them out.

Each model role has a protocol of its own, so an engine implements only what its models
do: :class:`ChatEngine` (``Engine``, the name engines were first written against) for chat
models, :class:`EmbeddingEngine`, :class:`RerankEngine` (a cross-encoder: its engine says
``capabilities.rerank`` and scores (query, document) pairs, see :class:`Ranked`),
:class:`SpeechToTextEngine` and :class:`TextToSpeechEngine`. Surfaces check a model's role
before they use its engine, so a speech engine never meets a chat request.
"""

from __future__ import annotations

import importlib
from typing import Any, AsyncIterator, Callable, Literal, Protocol, Sequence, runtime_checkable

import attrs


@attrs.frozen
class Capabilities:
    """What a loaded model can do."""

    context_window: int
    chat_template: bool = False
    vision: bool = False
    audio: bool = False
    tool_use: bool = False
    reasoning: bool = False
    embeddings: bool = False
    logprobs: bool = False
    grammar: bool = False
    #: Accepts GenerateRequest.interventions and .reads (see Intervention, ActivationRead).
    interventions: bool = False
    #: The width of the residual stream (the size of an Intervention's delta), and the number
    #: of decoder layers (an Intervention's ``layer`` is 0 .. layers-1); None when not known.
    hidden_size: int | None = None
    layers: int | None = None
    #: Reusing the prompt cache computes the same numbers as starting afresh (so a seed
    #: repeats a reply whatever ran before it).
    cache_exact: bool = True
    #: What the weights compute in, and the quantization they came from ("unrecorded" when not known).
    dtype: str | None = None
    quantization: str | None = None
    #: A reranker (a cross-encoder with a classifier head): the engine serves ``rerank``.
    rerank: bool = False
    #: The engine answers whole chat requests (``GenerateRequest.chat``: the messages and the
    #: rest of the body) rather than token prompts: a model served by a plugin's own code (an
    #: Open WebUI Pipe) or by a server that applies its own template. It has no tokenizer the
    #: chat service uses: no prompt is rendered, counted or checked against a window.
    messages: bool = False
    #: The window can grow: ``context_window`` is the window the model is open at now, and the
    #: engine opens a larger one (up to this many tokens) for a request that needs it
    #: (``GenerateRequest.window``). None: the window is fixed at ``context_window``.
    context_max: int | None = None
    #: The draft sources the engine speculates with (``GenerateRequest.speculation``): "ngram",
    #: "draft", "mtp". Empty: it decodes one token a step, whatever a request asks.
    speculation: tuple[str, ...] = ()

    @property
    def context_limit(self) -> int:
        """The most tokens a prompt and its reply may take: the ceiling the window grows to."""
        return self.context_max or self.context_window


@attrs.frozen
class Sampling:
    """How to pick each token. Engines apply every field or refuse the request."""

    max_tokens: int | None = None
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0


@attrs.frozen
class Constraint:
    """Output constrained token by token by an llguidance grammar.

    ``grammar`` is an llguidance grammar string (``llguidance.LLMatcher.grammar_from_lark``,
    ``grammar_from_json_schema``, ``grammar_from_regex``). The grammar's end is the
    engine's end-of-generation tokens (EOS, end of turn): once a grammar is complete the
    generation ends with ``Finished(reason="stop")``.

    ``trigger`` makes it lazy: nothing is constrained until this text appears in the
    generated text; the grammar then constrains what follows the trigger, and once it
    completes the generation is free again until the trigger appears anew. A lazy
    constraint never ends the generation by itself.
    """

    grammar: str
    trigger: str | None = None


@attrs.frozen(eq=False)  # a delta may be an array: two interventions are equal only when they are one
class Intervention:
    """An additive change to the residual stream, for one request.

    ``delta`` (a 1-D torch tensor, numpy array or list of floats, ``Capabilities.hidden_size``
    long) is added to the hidden states at the OUTPUT of decoder layer ``layer`` (0-based):
    what layer ``layer`` passes on to layer ``layer + 1`` (after the last layer: to the final
    norm). That is SAELens' ``blocks.{layer}.hook_resid_post``. It is added at every position
    the engine computes for this request, prompt and generated tokens alike. Several
    interventions on one layer add up. The engine casts the delta to the model's dtype.
    """

    layer: int
    delta: Any


@attrs.frozen
class ActivationRead:
    """Record the residual stream at the output of decoder layer ``layer`` for one request.

    ``point`` "pre" is the layer's output before this request's interventions at that layer
    (where monitoring reads); "post" is after them (what the next layer receives). Neither
    is a counterfactual: interventions at earlier layers, and tokens generated under
    steering, shape both. The result is ``Finished.activations[(layer, point)]``.
    """

    layer: int
    point: Literal["pre", "post"] = "post"


def steering_of(request: "GenerateRequest", layers: int | None,
                hidden: int | None) -> tuple[dict[int, Any], dict[int, set[str]]]:
    """A request's interventions and reads, checked as every engine checks them: the deltas
    summed per layer (layer → float32 numpy vector of ``hidden`` values) and the points read
    per layer. A bad layer, width, value or point is a ValueError whose message the engine
    ends the request with. numpy is imported when called (an engine plugin brings it; the
    kernel itself does not depend on it)."""
    np = importlib.import_module("numpy")

    def layer_of(layer: Any, what: str) -> int:
        if not isinstance(layer, int) or isinstance(layer, bool) or layers is None or not 0 <= layer < layers:
            raise ValueError(f"{what}'s layer must be 0..{(layers or 0) - 1}, not {layer!r}")
        return layer

    sums: dict[int, Any] = {}
    for item in request.interventions:
        layer = layer_of(getattr(item, "layer", None), "An intervention")
        delta = item.delta
        if hasattr(delta, "detach"):  # a torch tensor
            delta = delta.detach().to("cpu").float().numpy()
        try:
            vector = np.asarray(delta, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"An intervention's delta is not a vector of numbers: {exc}") from None
        if vector.ndim != 1 or vector.shape[0] != hidden:
            raise ValueError(f"An intervention's delta has shape {tuple(vector.shape)}; "
                             f"this model's hidden size is {hidden}")
        if not np.isfinite(vector).all():
            raise ValueError("An intervention's delta holds a value that is not finite")
        sums[layer] = sums[layer] + vector if layer in sums else vector.copy()
    reads: dict[int, set[str]] = {}
    for read in request.reads:
        layer = layer_of(getattr(read, "layer", None), "An activation read")
        point = getattr(read, "point", None)
        if point not in ("pre", "post"):
            raise ValueError(f"An activation read's point must be 'pre' or 'post', not {point!r}")
        reads.setdefault(layer, set()).add(point)
    return sums, reads


@attrs.frozen
class ChatInput:
    """A whole chat request, for an engine whose capabilities say ``messages``.

    ``body`` is the request as an OpenAI chat-completions body, as the chat_inlet hooks left
    it (``model`` is the id of the model that answers, ``stream`` what the client asked for);
    ``context`` is the request's chat context (the caller, the route, ``field()`` and
    ``status()``; see docs/plugins.md, "Chat hooks").
    """

    body: dict[str, Any]
    context: Any = None


@attrs.frozen
class Media:
    """An image or a sound a chat message carries, as the client sent it (``data``: the encoded
    file, PNG/JPEG/WebP/GIF/BMP for an image, WAV/MP3/FLAC for audio; its size and pixel
    dimensions were checked before anything decoded it). ``digest`` (sha256 hex of ``data``)
    names it: two requests holding the same picture share its encoding and prompt cache."""

    kind: Literal["image", "audio"]
    data: bytes = attrs.field(repr=lambda data: f"<{len(data)} bytes>")
    digest: str = ""


@attrs.frozen
class MediaSpan:
    """Where a :class:`Media` sits in a token prompt: before ``prompt[at]`` (``at`` may equal
    the prompt's length), taking ``tokens`` positions (what :meth:`ChatEngine.media_tokens`
    said). The prompt's own ids hold only the text around it."""

    at: int
    media: Media
    tokens: int


@attrs.frozen
class GenerateRequest:
    prompt: tuple[int, ...]
    sampling: Sampling = Sampling()
    cache_prompt: bool = True
    constraint: Constraint | None = None
    #: None: no probabilities; k >= 0: every Token carries its logprob and the k most likely
    #: alternatives (the OpenAI routes allow 0..20).
    logprobs: int | None = None
    #: Steering for this request only (see Intervention); needs Capabilities.interventions.
    interventions: tuple[Intervention, ...] = ()
    #: Residual-stream reads for this request (see ActivationRead). When any is asked, the
    #: engine computes the whole prompt afresh (no prompt-cache reuse), so every position is
    #: present in Finished.activations.
    reads: tuple[ActivationRead, ...] = ()
    #: For an engine whose capabilities say ``messages``: the chat request itself (``prompt``
    #: is then empty). None for every other engine.
    chat: ChatInput | None = None
    #: The window this request needs (its prompt and room for its reply). An engine whose window
    #: can grow (``Capabilities.context_max``) opens at least this many tokens before it decodes
    #: (up to ``context_max``); an engine with a fixed window ignores it.
    window: int | None = None
    #: A window the client asked for (Ollama's ``options.num_ctx``): a growable engine serves
    #: with this window from this request on (never smaller than ``window``), as Ollama reloads
    #: a model at the num_ctx a request names.
    num_ctx: int | None = None
    #: A background request (a front end's title or tags task): it waits behind interactive
    #: requests that arrive while it is queued (see :class:`Serial`).
    background: bool = False
    #: Images and sounds placed in the prompt, in order of ``at`` (needs
    #: ``Capabilities.vision`` / ``Capabilities.audio``). The positions a request uses are
    #: ``len(prompt) + sum(span.tokens)``.
    media: tuple[MediaSpan, ...] = ()
    #: The draft source this request asks for ("off", "ngram", "draft", "mtp"; the spec's
    #: ``spec_source``); None: the engine's own setting. An engine reports what it did in
    #: ``Finished.speculation``.
    speculation: str | None = None


@attrs.frozen
class Queued:
    ahead: int


@attrs.frozen
class Started:
    prompt_tokens: int


@attrs.frozen
class Token:
    id: int
    text: str  # the text this token completes ("" while a character is still partial)
    #: log-softmax of the raw logits at this token (None unless the request asked for logprobs);
    #: a value too small to represent, or a step whose logits were not finite, reads -9999.0
    logprob: float | None = None
    #: the k most likely (token id, logprob) of the same raw distribution, most likely first
    #: (empty when the step's logits were not finite)
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen
class Status:
    """What the engine is doing, for a streamed reply's status events (``code`` a stable id,
    ``text`` in English); an engine may send any number, anywhere before Finished."""

    code: str
    text: str


FinishReason = Literal["stop", "length", "cancelled", "error"]


@attrs.frozen
class Finished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    prompt_seconds: float = 0.0
    generate_seconds: float = 0.0
    error: str | None = None
    #: With GenerateRequest.reads: ``{(layer, point): float32 numpy array (positions, hidden)}``,
    #: one row per position the engine computed, in order: every prompt token, then each
    #: generated token that was fed back. The last sampled token is never fed back (a token
    #: that ended the generation, an end-of-generation token, or the one that reached
    #: max_tokens), so it has no row. None without reads, or after an error.
    activations: dict[tuple[int, str], Any] | None = None
    #: How many of the prompt's tokens a cache held, so the engine did not compute them (a
    #: follow-up turn's conversation so far; OpenAI's ``usage.prompt_tokens_details.cached_tokens``).
    cached_tokens: int = 0
    #: With a draft source on: the spec's ``usage.speculation`` ({"source", "state", "drafted",
    #: "accepted", "paused_steps", "reason"}); None when the reply did not speculate.
    speculation: dict[str, Any] | None = None


Event = Queued | Started | Token | Status | Finished


class Stop(BaseException):
    """Thrown into an engine's event stream (``await events.athrow(Stop())``) by a consumer
    that needs no more tokens (a stop sequence matched) but wants the generation's Finished,
    with its counts (``Finished.speculation``). :class:`~localm.sdk.engines.Batched` ends the
    generation as cancelled and goes on yielding until that Finished; a stream that does not
    know it ends with it raised, as it would on ``aclose``. A BaseException, so an engine's
    ``except Exception`` does not catch it."""


@attrs.frozen
class Ranked:
    """One document's relevance to a query, from :meth:`Engine.rerank`.

    ``score`` is on the model's own scale (higher is more relevant): a single-output head's
    logit, or with several outputs the first. ``label_scores`` holds every output of a head
    with more than one (None for one). ``truncated`` says the document was cut to fit the
    model's window; ``tokens`` is the length of the pair the model read.
    """

    score: float
    label_scores: tuple[float, ...] | None = None
    truncated: bool = False
    tokens: int = 0


@attrs.frozen
class Placement:
    """Where a loaded model runs, as its backend reports it.

    ``device`` is ``"cpu"`` or the accelerator (``"gpu"``, ``"cuda:0"``, ``"mps"``). An engine
    that places a model layer by layer (llama.cpp) says how many of its layers landed on the
    accelerator (``gpu_layers_offloaded`` of ``gpu_layers_total``); ``vram_bytes`` is the
    accelerator memory the load took, measured, when the backend can read it. A model that
    runs on the CPU carries none of those."""

    device: str = "cpu"
    gpu_layers_offloaded: int | None = None
    gpu_layers_total: int | None = None
    vram_bytes: int | None = None
    #: the accelerators it uses, by the backend's names
    devices: tuple[str, ...] = ()
    #: why it is where it is, when that is worth saying (an offload that did not fit)
    note: str | None = None

    @property
    def degraded(self) -> bool | None:
        """Fewer than all of its layers on the accelerator; None when nothing is placed by layer."""
        if self.gpu_layers_total is None or self.gpu_layers_offloaded is None:
            return None
        return self.gpu_layers_offloaded < self.gpu_layers_total

    def public(self) -> dict[str, Any]:
        """The fields the load response, GET /v1/models/{id} and /api/models/loaded carry."""
        out: dict[str, Any] = {"device": self.device}
        if self.devices:
            out["devices"] = list(self.devices)
        if self.gpu_layers_total is not None and self.gpu_layers_offloaded is not None:
            out.update(gpu_layers_offloaded=self.gpu_layers_offloaded, gpu_layers_total=self.gpu_layers_total,
                       degraded=self.degraded)
        if self.vram_bytes is not None:
            out["vram_bytes"] = self.vram_bytes
        if self.note:
            out["placement_note"] = self.note
        return out


def placement_of(engine: Any) -> Placement | None:
    """A loaded model's placement, when its engine says one."""
    found = getattr(engine, "placement", None)
    return found if isinstance(found, Placement) else None


def vram_of(engine: Any) -> tuple[int, int] | None:
    """(free, total) bytes of the accelerator memory ``engine`` reads, or None when it cannot."""
    reading = getattr(engine, "vram", None)
    if not callable(reading):
        return None
    try:
        found = reading()
    except Exception:  # a reading is a report, never a failure
        return None
    if (isinstance(found, tuple) and len(found) == 2 and all(isinstance(v, int) and v >= 0 for v in found)
            and found[1] > 0):
        return found
    return None


@runtime_checkable
class LoadedModel(Protocol):
    """What every loaded model provides, whatever its role."""

    engine: str  # the engine's name ("llamacpp", "transformers", "piper")
    capabilities: Capabilities

    @property
    def busy(self) -> int:
        """Requests running or waiting on this engine."""

    def close(self) -> None:
        """Free the model's memory; no call follows."""


@runtime_checkable
class ChatEngine(LoadedModel, Protocol):
    """A model that generates (role ``chat``; an embedding model loaded by a token engine
    provides these too). Methods that compute run off the event loop."""

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds the model's BOS when it uses one."""

    def detokenize(self, ids: Sequence[int]) -> str: ...

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    template_kwargs: dict | None = None) -> str:
        """The model's chat template applied to OpenAI-style messages (role, content)."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Generate; requests to one engine run in arrival order. See the module docstring."""

    async def embed(self, texts: list[str]) -> list[list[float]]:
        """One vector per text (pooled as the model was trained, normalised). Never steered: it
        takes no interventions, and no generation's interventions reach it."""

    async def next_token_logprobs(self, prompt: Sequence[int]) -> list[float]:
        """Log-softmax of the model's raw logits for the token after ``prompt``."""

    async def next_token_logits(self, prompt: Sequence[int]) -> Any:
        """The model's raw logits (a float32 ``numpy.ndarray`` of the vocabulary's width) for the
        token after ``prompt``: one forward pass, in turn with generations. It may drop the
        engine's prompt cache; later generations are unaffected. Never steered: it takes no
        interventions, and no generation's interventions reach it."""

    def token_bytes(self, token: int) -> bytes:
        """The token's own UTF-8 bytes as the tokenizer spells it (a special token as its text);
        a token that holds part of a character gives those bytes only."""

    def check_constraint(self, constraint: Constraint) -> None:
        """Raise ``LocalmError(400, ..., code="invalid_grammar")`` when the grammar does not
        compile for this model's tokenizer; synchronous, so a surface can call it before it
        opens a stream (the first call builds the tokenizer's llguidance form: a fraction of a
        second). ``generate`` refuses such a grammar in-band (``Finished(reason="error")``)."""


@runtime_checkable
class MediaEngine(ChatEngine, Protocol):
    """A chat engine whose model sees images (``capabilities.vision``) or hears sound
    (``capabilities.audio``): it places :class:`Media` in a prompt (``GenerateRequest.media``).

    Optionally, ``media_device`` (``"gpu"`` or ``"cpu"``) says where it encodes media: a
    streamed reply's status while it does is ``encoding_image_gpu`` / ``encoding_image_cpu``
    (``encoding_audio_*`` for sound); without it, ``encoding_image`` (and for sound
    ``encoding_audio_cpu``)."""

    #: The text a chat template gets where a message holds an image or a sound; the prompt is
    #: tokenized around it and each marker becomes a :class:`MediaSpan`.
    media_marker: str

    async def media_tokens(self, media: Media) -> int:
        """How many prompt positions ``media`` takes. The engine encodes it here (once per
        digest, kept for the ``generate`` that follows) and raises ``EngineError`` with
        ``code="invalid_media"`` when it cannot decode it."""


#: The name engines were written against before roles had protocols of their own.
Engine = ChatEngine


@runtime_checkable
class EmbeddingEngine(LoadedModel, Protocol):
    """A model that embeds (role ``embedding``)."""

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]: ...

    async def embed(self, texts: list[str]) -> list[list[float]]:
        """One vector per text, pooled and normalised; never steered."""


@runtime_checkable
class RerankEngine(LoadedModel, Protocol):
    """A cross-encoder (role ``reranker``; ``capabilities.rerank``)."""

    async def rerank(self, query: str, documents: list[str]) -> list[Ranked]:
        """One :class:`Ranked` per document, in the documents' order. Each (query, document)
        pair is scored in a forward pass of its own, so a score never depends on the other
        documents; a document too long for the window is cut (``truncated``), and a query that
        leaves no room for a document is refused with ``LocalmError(400, ...,
        code="query_too_long")``. It runs in turn with the engine's other work and is never
        steered."""


@runtime_checkable
class SpeechToTextEngine(LoadedModel, Protocol):
    """A model that transcribes (role ``stt``): ``transcribe(data, options)``, whose options
    and result belong to the plugin that serves the transcription route."""

    async def transcribe(self, data: bytes, options: Any) -> Any: ...


@runtime_checkable
class TextToSpeechEngine(LoadedModel, Protocol):
    """A model that speaks (role ``tts``): ``speak(speech, emit)``, whose request and sample
    callback belong to the plugin that serves the speech route."""

    async def speak(self, speech: Any, emit: Callable[..., None]) -> int: ...


class EngineError(Exception):
    """A model that cannot be loaded or run; the message never names absolute paths.

    ``code`` names a failure a caller may tell apart (``"no_classifier_head"``: a model
    registered as a reranker whose files hold no classifier head); the model manager
    reports it as the error's code, ``model_load_failed`` otherwise."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code
