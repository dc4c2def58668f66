"""The chat hooks as the chat service runs them: the context each one receives, and the
three chains (chat_inlet, chat_stream, chat_outlet) in which every implementation sees
what the one before it returned.

Implementations come from ``host.hooks(name)`` in the kernel's stable order (manifest
``priority``, then plugin id); calling one fails closed (a raised exception refuses the
request with a 500 naming the plugin, recorded in GET /api/plugins). A hook that returns
something it may not is that plugin's failure too.
"""

from __future__ import annotations

import copy
import types
from typing import Any

from localm import sdk

from . import pipeline

#: What ``context["key"]`` reads (the context was a dict holding ``route`` before it was an object).
_KEYS = frozenset({"route", "surface", "streamed", "caller", "owner_tag", "plugin", "host", "request", "model",
                   "state", "fields"})
_EVENT_TYPES = {"text": ("text",), "reasoning": ("text",), "tool_call": ("call",), "status": ("code", "text")}


def surface_of(route: str) -> str:
    """The surface a route belongs to: openai, ollama, anthropic, responses (or the route's first word)."""
    head = route.split(".", 1)[0]
    return {"chat": "openai", "completions": "openai", "count_tokens": "anthropic"}.get(head, head)


class RequestState:
    """One request's state, from the inlet hooks to the last byte of the reply: what every
    plugin's view of the context reads and adds to, and what the generation answers with.
    Nothing else holds a copy: the response's headers are ``headers`` and its added fields
    ``fields``, whoever set them (the chat service, a hook, a forward_interventions reader)."""

    def __init__(self, host: Any, route: str, streamed: bool, caller: Any) -> None:
        self.host = host
        self.route = route
        self.surface = surface_of(route)
        self.streamed = streamed
        self.caller = caller
        #: the request as the inlet hooks left it, and where it holds image or audio parts
        self.request: dict[str, Any] = {}
        self.media: list[str] = []
        #: the model that answers (None until it is resolved)
        self.model: str | None = None
        #: request fields plugins said they read (context.use)
        self.claims: set[str] = set()
        #: the response's headers, and the fields added to its body (or its last chunk)
        self.headers: dict[str, str] = {}
        self.fields: dict[str, Any] = {}
        #: the capability routing that chose the model (routing.Route; None: the model asked for)
        self.routing: Any = None
        #: status events waiting to be sent; whether a streamed reply's headers were sent
        self.statuses: list[pipeline.Status] = []
        self.opened = False
        #: how the reply ended, for the outlet hooks (None until it has)
        self.outcome: dict[str, Any] | None = None
        #: what the session log keeps of this turn (none, metadata, full)
        self.session_mode = "none"
        #: a stream opened before its model loaded: the Outcome its surface reads, for the
        #: generation prepared later to fill
        self.outcome_to_fill: Any = None
        #: a streamed request being prepared whose stream may open before preparing ends
        #: (service.Live): told of every status, so an open stream sends it at once
        self.live: Any = None

    def header(self, name: str, value: str) -> None:
        """A response header; once a streamed reply is open its headers are sent, so a later one
        goes into the last chunk's ``localm_headers`` field."""
        if self.opened:
            self.fields.setdefault("localm_headers", {})[name] = value
        else:
            self.headers[name] = value

    def answer_with(self, headers: dict[str, str]) -> None:
        """Headers the chat service sets (the seed echo, the ignored-fields report, ...): a hook's
        header of the same name, set earlier, wins."""
        self.headers = {**headers, **self.headers}


class ChatContext:
    """What a chat hook receives as ``context``.

    Read: ``route`` ("chat.completions", "completions", "ollama.chat", "ollama.generate",
    "anthropic", "anthropic.count_tokens", "responses"), ``surface`` ("openai", "ollama",
    "anthropic", "responses"), ``streamed``, ``caller`` (the ``sdk.Principal``), ``owner_tag``,
    ``plugin`` (this plugin's context), ``host``, ``request`` (the request as the inlet hooks
    left it), ``model`` (the id of the model that answers; None during the inlet) and
    ``state`` (a dict this plugin keeps for this request, from its inlet to its outlet).

    Do: ``use(*fields)`` claims request fields, ``header(name, value)`` adds a response header,
    ``field(name, value)`` adds a field to the response body (a last chunk when streamed),
    ``status(code, text)`` sends a status event on a streamed reply.
    """

    __slots__ = ("_req", "plugin", "state")

    def __init__(self, req: RequestState, plugin: Any = None) -> None:
        self._req = req
        self.plugin = plugin
        self.state: dict[str, Any] = {}

    route = property(lambda self: self._req.route)
    surface = property(lambda self: self._req.surface)
    streamed = property(lambda self: self._req.streamed)
    caller = property(lambda self: self._req.caller)
    host = property(lambda self: self._req.host)
    request = property(lambda self: self._req.request)
    model = property(lambda self: self._req.model)

    @property
    def outcome(self) -> Any:
        """How the reply ended, once it has (in ``chat_outlet``; None before): a read-only
        mapping with ``finish_reason`` ("stop", "length", "tool_calls", "error" or "abandoned":
        the client left before the end), ``error`` (the error's text, or None) and
        ``completion_tokens``. The outlet hooks run after a failed or abandoned reply too; what
        they return then reaches nobody."""
        return types.MappingProxyType(self._req.outcome) if self._req.outcome is not None else None

    @property
    def owner_tag(self) -> str:
        caller = self._req.caller
        return caller.owner_tag if caller is not None else "owner"

    def use(self, *fields: str) -> None:
        """Claim request fields this plugin reads: they are neither reported in
        X-Localm-Ignored-Fields nor refused by X-Localm-Strict. A name covers what is nested
        under it (``"options"`` covers ``options.num_ctx`` on the Ollama routes)."""
        for name in fields:
            if not isinstance(name, str) or not name:
                raise TypeError("context.use takes field names (non-empty strings)")
        self._req.claims.update(fields)

    def header(self, name: str, value: str) -> None:
        """Add a response header. Once a streamed reply is open its headers are sent, so a
        header added later (from chat_stream or chat_outlet) arrives in the stream's last
        fields as ``localm_headers``."""
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError("context.header takes a name and a value, both strings")
        self._req.header(name, value)

    @property
    def fields(self) -> Any:
        """The fields added to the response so far, by every plugin (read-only; add with ``field``)."""
        return types.MappingProxyType(self._req.fields)

    def field(self, name: str, value: Any) -> None:
        """Add a field to the response: in the body of a whole reply, in one last chunk (the
        final line, the message_delta event, the completed response) of a streamed one. It
        must be JSON-serialisable; a name the surface already uses is left to the surface."""
        if not isinstance(name, str) or not name:
            raise TypeError("context.field takes a name (a non-empty string) and a value")
        self._req.fields[name] = value

    def status(self, code: str, text: str) -> None:
        """Send a status event (``status_code`` and ``status`` on the OpenAI routes) in a
        streamed reply. From chat_inlet it is sent as the stream opens, which is at once when
        preparing the request takes more than a fraction of a second (a slow inlet hook's
        statuses arrive while it runs)."""
        if not isinstance(code, str) or not isinstance(text, str):
            raise TypeError("context.status takes a code and a text, both strings")
        self._req.statuses.append(pipeline.Status(code, text))
        if self._req.live is not None:  # a stream open while the request is prepared sends it now
            self._req.live.changed.set()

    # the context was a dict with "route" once: context["route"] and context.get("route") still read
    def __getitem__(self, key: str) -> Any:
        if key not in _KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in _KEYS else default

    def __contains__(self, key: object) -> bool:
        return key in _KEYS

    def __repr__(self) -> str:
        return f"<ChatContext {self.route} for {getattr(self.plugin, 'name', None)}>"


class Unreadable(Exception):
    """A request an inlet hook returned that the chat readers cannot read (the reason)."""


def _refused(impl: Any, message: str) -> sdk.LocalmError:
    """A hook that returned what it may not: that plugin's failure, recorded and answered as one."""
    return impl.failed(TypeError(message))


def _describe(value: Any) -> str:
    return "None" if value is None else type(value).__name__


class Chain:
    """One request's chat hooks: each implementation with its plugin's view of the context."""

    def __init__(self, host: Any, *, route: str, streamed: bool, caller: Any) -> None:
        self.state = RequestState(host, route, streamed, caller)
        self.context = ChatContext(self.state)
        views: dict[str, ChatContext] = {}

        def bind(hook: str) -> list[tuple[Any, ChatContext]]:
            out = []
            for impl in host.hooks(hook):
                view = views.get(impl.plugin)
                if view is None:
                    view = views[impl.plugin] = ChatContext(self.state, impl.context)
                out.append((impl, view))
            return out

        self.inlets = bind("chat_inlet")
        self.streams = bind("chat_stream")
        self.stream_ends = bind("chat_stream_end")
        self.outlets = bind("chat_outlet")

    @property
    def claims(self) -> set[str]:
        return self.state.claims

    # --- inlet ------------------------------------------------------------------------
    async def inlet(self, request: dict[str, Any], check: Any = None) -> tuple[dict[str, Any], list[str], Any]:
        """Run the inlet hooks on ``request`` (a copy the hooks may change). After each hook
        that changed it, ``check(request, plugin)`` reads it again; a request it cannot read
        (it raises Unreadable) is that hook's failure. Returns the request the hooks leave,
        the plugins that changed it, in order, and what the last ``check`` returned."""
        changed_by: list[str] = []
        checked = None
        for impl, context in self.inlets:
            before = copy.deepcopy(request)
            self.state.request = request
            out = await impl(request=request, context=context)
            if out is not None:
                if not isinstance(out, dict):
                    raise _refused(impl, f"chat_inlet returned {_describe(out)}; it returns a dict or None")
                request = out
            if request != before:
                changed_by.append(impl.plugin)
                if check is not None:
                    try:
                        checked = check(request, impl.plugin)
                    except Unreadable as exc:
                        raise impl.failed(ValueError(f"chat_inlet returned a request that cannot be read: {exc}")) \
                            from None
        self.state.request = request
        return request, changed_by, checked

    # --- stream -----------------------------------------------------------------------
    async def stream(self, item: Any) -> list[Any]:
        """One streamed item through the stream hooks: the items to send instead (maybe none)."""
        events = [to_event(item)]
        for impl, context in self.streams:
            out: list[dict[str, Any]] = []
            for event in events:
                result = await impl(event=event, context=context)
                if result is None:
                    out.append(event)
                elif isinstance(result, dict):
                    out.append(_checked(impl, result))
                elif isinstance(result, list):
                    out.extend(_checked(impl, e) for e in result)
                else:
                    raise _refused(impl, f"chat_stream returned {_describe(result)}; it returns a dict, a list of "
                                         "dicts or None")
            events = out
            if not events:
                return []
        return [to_item(e) for e in events]

    async def stream_end(self) -> list[Any]:
        """A streamed reply ended: each chat_stream_end hook may send what it held back. What
        one returns passes through the chat_stream hooks of the plugins after it, in order;
        the items to send last."""
        out: list[Any] = []
        for impl, context in self.stream_ends:
            result = await impl(context=context)
            if result is None:
                continue
            if isinstance(result, dict):
                result = [result]
            if not isinstance(result, list):
                raise _refused(impl, f"chat_stream_end returned {_describe(result)}; it returns a list of events, "
                                     "one event or None")
            events = [_checked(impl, e, "chat_stream_end") for e in result]
            mine = (impl.priority, impl.plugin)
            for later, view in self.streams:
                if not events:
                    break
                if (later.priority, later.plugin) <= mine:
                    continue
                passed: list[dict[str, Any]] = []
                for event in events:
                    got = await later(event=event, context=view)
                    if got is None:
                        passed.append(event)
                    elif isinstance(got, dict):
                        passed.append(_checked(later, got))
                    elif isinstance(got, list):
                        passed.extend(_checked(later, e) for e in got)
                    else:
                        raise _refused(later, f"chat_stream returned {_describe(got)}; it returns a dict, a list "
                                              "of dicts or None")
                events = passed
            out.extend(to_item(e) for e in events)
        return out

    # --- outlet -----------------------------------------------------------------------
    async def outlet(self, message: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Run the outlet hooks on a finished reply's message; returns the message they leave
        and whether it differs from the one generated."""
        if not self.outlets:
            return message, False
        original = copy.deepcopy(message)
        for impl, context in self.outlets:
            out = await impl(response=message, context=context)
            if out is not None:
                if not isinstance(out, dict):
                    raise _refused(impl, f"chat_outlet returned {_describe(out)}; it returns a dict or None")
                message = out
            problem = _message_problem(message)
            if problem:
                raise _refused(impl, f"chat_outlet left a message whose {problem}")
        return message, message != original

    def statuses(self) -> list[pipeline.Status]:
        """Status events the hooks asked for since the last call."""
        out, self.state.statuses = self.state.statuses, []
        return out


def to_event(item: Any) -> dict[str, Any]:
    if isinstance(item, pipeline.Piece):
        return {"type": "text", "text": item.text}
    if isinstance(item, pipeline.Reasoning):
        return {"type": "reasoning", "text": item.text}
    if isinstance(item, pipeline.Call):
        return {"type": "tool_call", "call": copy.deepcopy(item.call)}
    return {"type": "status", "code": item.code, "text": item.text}


def to_item(event: dict[str, Any]) -> Any:
    kind = event["type"]
    if kind == "text":
        return pipeline.Piece(event["text"])
    if kind == "reasoning":
        return pipeline.Reasoning(event["text"])
    if kind == "tool_call":
        return pipeline.Call(event["call"])
    return pipeline.Status(event["code"], event["text"])


def _checked(impl: Any, event: Any, hook: str = "chat_stream") -> dict[str, Any]:
    if not isinstance(event, dict) or event.get("type") not in _EVENT_TYPES:
        raise _refused(impl, f"{hook} returned an event that is not one of "
                             f"{', '.join(_EVENT_TYPES)}: {_describe(event)}")
    for key in _EVENT_TYPES[event["type"]]:
        wanted = dict if key == "call" else str
        if not isinstance(event.get(key), wanted):
            raise _refused(impl, f"{hook} returned a {event['type']} event whose {key} is not a "
                                 f"{wanted.__name__}")
    return event


def _message_problem(message: dict[str, Any]) -> str | None:
    if not isinstance(message.get("content", ""), (str, type(None))):
        return "content is not a string"
    if not isinstance(message.get("reasoning_content", ""), (str, type(None))):
        return "reasoning_content is not a string"
    calls = message.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
        return "tool_calls is not a list of calls"
    return None
