"""The chat service: one generation path for every surface.

The chat plugin provides it to other plugins as ``host.service("chat")``. A surface (the
OpenAI routes here; the Ollama, Anthropic and Responses plugins) parses its own request
into an OpenAI chat-completions body, hands it to :meth:`ChatService.chat` (or a prompt to
:meth:`ChatService.complete`), and renders what the returned :class:`Generation` yields:

- :class:`pipeline.Status` while waiting or starting, :class:`pipeline.Piece` for visible
  text (with its tokens' log probabilities when asked), :class:`pipeline.Reasoning` for the
  model's ``<think>`` text, :class:`pipeline.Call` for each whole tool call;
- at the end, ``generation.outcome`` holds the finish reason, the stop sequence, the calls
  and the token counts (``pipeline.usage(outcome)`` renders OpenAI's usage block).

Every refusal before generation (a malformed field, an unknown model, a prompt that does
not fit) is a :class:`sdk.LocalmError` raised by ``chat``/``complete``, with the status the
OpenAI routes would answer; a surface renders it in its own error shape. Fields are read
by the same readers as the OpenAI routes, so a field means the same on every surface.
The chat inlet hooks run inside ``chat`` for every surface; ``outlet`` runs the outlet
hooks on a finished reply.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import attrs
from localm import sdk
from localm.sdk import engines as spec

from . import constrained, fields, pipeline
from .prompt import chat_tokens
from .request import Common, Options, Reader, read_common, read_messages, read_options


def fingerprint(entry: Any, engine: Any) -> str:
    """localm:<model>@<revision>:<dtype>/<quantization>:<engine>; an unknown part reads unrecorded."""
    caps = engine.capabilities
    revision = entry.sha256[:8] if entry.sha256 else None
    dtype = caps.dtype or entry.capabilities.get("dtype")
    quantization = caps.quantization or entry.capabilities.get("quantization")
    parts = [p or "unrecorded" for p in (revision, dtype, quantization)]
    return f"localm:{entry.id}@{parts[0]}:{parts[1]}/{parts[2]}:{engine.engine}"


@attrs.define
class Reply:
    """A whole reply, for a non-streaming request."""
    content: list[str] = attrs.Factory(list)
    reasoning: list[str] = attrs.Factory(list)
    logprobs: list[dict[str, Any]] = attrs.Factory(list)

    @property
    def text(self) -> str:
        return "".join(self.content)


@attrs.define
class Generation:
    """A request checked, its model loaded and its prompt tokenised; nothing generated yet."""

    host: Any
    entry: Any  # the registry entry of the model that answers
    prompt: list[int]
    fingerprint: str  # system_fingerprint
    plan: pipeline.Plan
    common: Common
    options: Options
    headers: dict[str, str]  # response headers every surface sends (seed echo, constraint, ignored fields)
    model: str  # the model name to show: the one asked for, or the model that answers
    received: float  # time.perf_counter() when the request arrived
    messages: list[dict[str, Any]] | None = None  # the messages after the inlet hooks (chat only)
    outcome: pipeline.Outcome = attrs.Factory(pipeline.Outcome)
    reads: list[tuple[Any, Any]] = attrs.Factory(list)  # (ActivationRead, done) from forward_interventions
    #: fields the forward_interventions readers add to the response, filled when the generation ends
    extra: dict[str, Any] = attrs.Factory(dict)

    async def items(self) -> AsyncIterator[pipeline.Status | pipeline.Piece | pipeline.Reasoning | pipeline.Call]:
        """Generate. A constrained document the model ended itself is validated at the end:
        a failure raises 500 constrained_output_invalid after the last item."""
        content: list[str] = []
        async with self.host.models.use(self.entry.id) as resident:
            async for item in pipeline.run(resident.engine, self.prompt, self.common, self.received, self.outcome,
                                           self.host.metrics, self.plan):
                if isinstance(item, pipeline.Piece):
                    content.append(item.text)
                yield item
        fmt = self.options.fmt
        if fmt is not None and self.outcome.ended_by_model and not self.outcome.calls:
            constrained.validate_output("".join(content), fmt)
        activations = self.outcome.activations or {}
        for read, done in self.reads:
            rows = activations.get((read.layer, read.point))
            if rows is not None:  # a reader's work (an SAE encoding) runs off the event loop
                self.extra.update(await asyncio.to_thread(done, rows, list(self.prompt),
                                                          list(self.outcome.token_ids)) or {})

    async def reply(self) -> Reply:
        """The whole reply (for a non-streaming request)."""
        reply = Reply()
        async for item in self.items():
            if isinstance(item, pipeline.Piece):
                reply.content.append(item.text)
                reply.logprobs.extend(item.logprobs)
            elif isinstance(item, pipeline.Reasoning):
                reply.reasoning.append(item.text)
        return reply


@attrs.frozen
class ModelView:
    """What the forward_interventions hook is told about the model that will answer."""
    id: str
    type: str
    engine: str
    capabilities: dict[str, Any]


class Interventions:
    """The ``register`` of the forward_interventions hook: deltas, fields read, headers."""

    def __init__(self) -> None:
        self.items: list[spec.Intervention] = []
        self.fields: set[str] = set()
        self.headers: dict[str, str] = {}
        self.reads: list[tuple[spec.ActivationRead, Any]] = []

    def __call__(self, layer: int, delta: Any) -> None:
        self.items.append(spec.Intervention(layer=layer, delta=delta))

    def use(self, field: str) -> None:
        self.fields.add(field)

    def header(self, name: str, value: str) -> None:
        self.headers[name] = value

    def read(self, layer: int, point: str, done: Any) -> None:
        """Read the residual at ``layer``'s output (``point`` "pre" or "post" this request's
        interventions); after the generation ``done(activations, prompt_ids, generated_ids)``
        gets the rows (a float32 array, positions × hidden) and returns a dict of fields to
        add to the response (for example ``{"millm": {...}}``)."""
        self.reads.append((spec.ActivationRead(layer=layer, point=point), done))


class ChatService:
    """What other surfaces call; see the module docstring.

    A surface may not import the chat plugin's modules, so the item classes it tells apart
    (``isinstance(item, chat.Piece)``) and the usage renderer are attributes here.
    """

    Status = pipeline.Status
    Piece = pipeline.Piece
    Reasoning = pipeline.Reasoning
    Call = pipeline.Call
    TOOL_OPEN, TOOL_CLOSE = constrained.TOOL_OPEN, constrained.TOOL_CLOSE

    def __init__(self, host: Any) -> None:
        self.host = host

    @staticmethod
    def usage(outcome: pipeline.Outcome, *, timings: bool = True, capacity: bool = True) -> dict[str, Any]:
        """OpenAI's usage block for a finished generation."""
        return pipeline.usage(outcome, timings=timings, capacity=capacity)

    @staticmethod
    def redact(text: str) -> str:
        """An error text with absolute paths cut to file names, as every surface sends it."""
        return pipeline.redact(text)

    async def chat(self, body: dict[str, Any], *, route: str = "chat.completions", request_headers: Any = None,
                   received: float | None = None) -> Generation:
        """Prepare a chat generation from an OpenAI chat-completions ``body``.

        ``request_headers`` (the OpenAI routes pass theirs) turns on the ignored-fields
        report and strict mode; surfaces that translate their own requests leave it out.
        ``route`` names the surface to the inlet hooks (``context["route"]``).
        """
        received = time.perf_counter() if received is None else received
        r = Reader(body)
        common = read_common(r)
        messages = read_messages(r)
        options = read_options(r, "chat")
        r.done()
        steering = await self._interventions(body, common)
        headers = self._fields("chat", body, request_headers, steering)
        hooked = {"messages": messages, "model": common.model}
        for _, changed in await self.host.run_hook("chat_inlet", request=hooked, context={"route": route}):
            if isinstance(changed, dict):
                hooked = changed
        messages = hooked["messages"]

        def render(engine: Any) -> tuple[list[int], bool]:
            return chat_tokens(engine, messages, tools=options.tools, thinking=options.thinking)

        generation = await self._prepare(common, options, render, headers, received, steering)
        generation.messages = messages
        return generation

    async def complete(self, body: dict[str, Any], *, request_headers: Any = None,
                       received: float | None = None) -> Generation:
        """Prepare a text completion from an OpenAI completions ``body`` (``prompt`` one string):
        the prompt goes to the model as written, with no chat template."""
        received = time.perf_counter() if received is None else received
        r = Reader(body)
        common = read_common(r)
        prompt_text = body.get("prompt")
        if isinstance(prompt_text, list) and len(prompt_text) == 1 and isinstance(prompt_text[0], str):
            prompt_text = prompt_text[0]
        if isinstance(prompt_text, list):
            raise sdk.LocalmError(400, "prompt must be one string (a list of one string is accepted)")
        if not isinstance(prompt_text, str):
            r.errors.append({"key": "prompt", "message": "must be a string"})
        r.get("echo", (bool,), "true or false", False)
        options = read_options(r, "completions")
        r.done()
        steering = await self._interventions(body, common)
        headers = self._fields("completions", body, request_headers, steering)

        def render(engine: Any) -> tuple[list[int], bool]:
            return engine.tokenize(prompt_text, add_special=options.add_special), False

        return await self._prepare(common, options, render, headers, received, steering)

    async def outlet(self, message: dict[str, Any], *, route: str = "chat.completions") -> tuple[dict[str, Any], bool]:
        """Run the outlet hooks on a finished reply's message; returns it and whether a hook changed it."""
        before = dict(message)
        for _, changed in await self.host.run_hook("chat_outlet", response=message, context={"route": route}):
            if isinstance(changed, dict):
                message = changed
        return message, message != before

    async def embed(self, model: str | None, texts: list[str]) -> tuple[Any, list[list[float]], int]:
        """The registry entry, one normalised vector per text, and the tokens they took."""
        entry = self.host.models.resolve(model)
        async with self.host.models.use(entry.id) as resident:
            vectors = await resident.engine.embed(texts)
            tokens = sum(len(resident.engine.tokenize(t)) for t in texts)
        return entry, vectors, tokens

    async def count_tokens(self, body: dict[str, Any]) -> int:
        """The prompt tokens a chat ``body`` would take (its messages, tools and template), loading
        the model that would answer it."""
        generation = await self.chat(body, route="count_tokens")
        return len(generation.prompt)

    async def _interventions(self, body: dict[str, Any], common: Common) -> Interventions:
        """Ask the forward_interventions hook for this request's steering (before any load)."""
        collected = Interventions()
        try:
            entry = self.host.models.resolve(common.model)
        except sdk.LocalmError:
            return collected  # an unknown model: refused as such once the fields are checked
        try:
            engine = self.host.models.engine_name(entry)
        except sdk.LocalmError:
            engine = ""  # no engine for this model: _prepare refuses it
        view = ModelView(id=entry.id, type=entry.type, engine=engine, capabilities=dict(entry.capabilities))
        await self.host.run_hook("forward_interventions", request=body, model=view, register=collected)
        return collected

    @staticmethod
    def _fields(route: str, body: dict[str, Any], request_headers: Any, steering: Interventions) -> dict[str, str]:
        if request_headers is None:
            return {}
        return fields.check(route, body, request_headers, used=fields.USED[route] | steering.fields)

    async def _prepare(self, common: Common, options: Options, render: Any, headers: dict[str, str],
                       received: float, steering: Interventions | None = None) -> Generation:
        host = self.host
        steering = steering or Interventions()
        entry = host.models.resolve(common.model)
        async with host.models.use(entry.id) as resident:
            engine = resident.engine
            caps = engine.capabilities
            constraint = options.constraint()
            if constraint is not None:
                if not caps.grammar:
                    raise sdk.LocalmError(400, f"The {engine.engine} engine cannot constrain output",
                                          code="response_format_unsupported")
                engine.check_constraint(constraint)
            if options.logprobs is not None and not caps.logprobs:
                raise sdk.LocalmError(400, f"The {engine.engine} engine does not report log probabilities",
                                      code="field_not_honoured", field="logprobs")
            if (steering.items or steering.reads) and not caps.interventions:
                raise sdk.LocalmError(400, f"The {engine.engine} engine cannot steer a generation",
                                      code="field_not_honoured", field=min(steering.fields) if steering.fields
                                      else "steering")
            prompt, opened = render(engine)
            pipeline.check_fits(len(prompt), caps.context_window)
        plan = pipeline.Plan(constraint=constraint, logprobs=options.logprobs, tools=options.tools,
                             reasoning=caps.reasoning and options.thinking is not False, thinking_open=opened,
                             interventions=tuple(steering.items), reads=tuple(r for r, _ in steering.reads))
        headers.update(steering.headers)
        seed = common.sampling.seed
        if seed is not None:
            # the promise: the same seed and body repeat the reply, unless a reused prompt cache
            # can change the numbers on this engine
            scope = "request" if caps.cache_exact or not common.cache_prompt else "best-effort"
            headers.update({name: f'{seed};scope="{scope}"' for name in ("X-Localm-Seed", "X-miLLM-Seed")})
        if options.fmt is not None or options.grammar is not None:
            label = options.fmt.label if options.fmt is not None else "grammar"
            headers.update({"X-Localm-Constrained": label, "X-miLLM-Constrained": label})
        shown = common.model if common.model not in (None, "", "localm") else entry.id
        return Generation(host=host, entry=entry, prompt=prompt, fingerprint=fingerprint(entry, engine), plan=plan,
                          common=common, options=options, headers=headers, model=shown, received=received,
                          reads=list(steering.reads))
