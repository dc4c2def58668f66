"""The openwebui service: every installed Function, loaded and called from the chat hooks.

A Function's own plugin (written by ``localm plugin install FILE.py``) hands each hook to
this service: ``start``/``stop`` on activation, ``inlet``/``stream``/``outlet`` for a
Filter, and the models and ``run_pipe`` for a Pipe; Actions are called from a route.

Where Open WebUI is unsafe this does better without changing what a Function sees:

- one long-lived instance serves Open WebUI's every request, so state a Filter keeps on
  ``self`` between its inlet and its outlet leaks between concurrent requests. Here each
  request gets its own shallow copy of the instance: what the Function assigns on ``self``
  stays with that request (inlet → stream → outlet), while the objects ``__init__`` made
  (clients, caches, dicts it updates in place) are shared as before;
- sync handlers run in worker threads, not on the event loop;
- ``__event_emitter__`` and ``__event_call__`` are always callables.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import types
import uuid
from typing import Any, AsyncIterator

from localm import sdk

from . import calls, loader, pipes, valves

log = logging.getLogger("localm.plugin.openwebui")

#: Request fields Open WebUI clients send that the Functions read (claimed for them).
CLAIMED = ("metadata", "filter_ids", "chat_id", "session_id", "files", "features", "variables", "tool_ids",
           "background_tasks", "params")
STATUS_CODE = "function"


def who(caller: Any) -> str:
    """Whose UserValves a caller has: its key's id, "web" for a web page of another origin in
    open mode (never the owner's), or "owner"."""
    if getattr(caller, "kind", None) == "web":
        return "web"
    return getattr(caller, "key_id", None) or "owner"


def filter_ids(request: dict[str, Any]) -> list[str]:
    """The filters a request asks for (Open WebUI's ``metadata.filter_ids``, or ``filter_ids``)."""
    found: list[str] = []
    meta = request.get("metadata")
    for source in (request.get("filter_ids"), meta.get("filter_ids") if isinstance(meta, dict) else None):
        if isinstance(source, list):
            found.extend(str(x) for x in source)
    return found


class Events:
    """What a Function emits through ``__event_emitter__`` during one request.

    ``status`` events become the stream's status events (``status_code`` "function", the
    description as the text); ``message`` text is added to the reply and ``replace`` text
    replaces it (``pending``, applied where the hook that emitted it can); every event is
    also listed in the response's ``localm_events``.
    """

    def __init__(self, fid: str, context: Any, record: list[dict[str, Any]] | None = None) -> None:
        self.fid = fid
        self.context = context
        self.pending: list[tuple[str, str]] = []
        self.record: list[dict[str, Any]] = [] if record is None else record
        self._listed = context is None  # the record joins the response with the first event

    def _list(self) -> None:
        if not self._listed:
            found = self.context.fields.get("localm_events")
            if isinstance(found, list):
                found.extend(self.record)
                self.record = found
            else:
                self.context.field("localm_events", self.record)
            self._listed = True

    async def __call__(self, event: Any) -> None:
        self.emit(event)

    def emit(self, event: Any) -> None:
        if not isinstance(event, dict):
            return
        kind = event.get("type")
        data = event.get("data") if isinstance(event.get("data"), dict) else None
        if kind is None and "description" in event:  # a status sent without its type, as some Functions do
            kind, data = "status", event
        data = data or {}
        self._list()
        self.record.append({"function": self.fid, "type": kind, "data": valves.jsonable(data)})
        if kind == "status":
            text = data.get("description")
            if text and not data.get("hidden") and self.context is not None:
                self.context.status(STATUS_CODE, str(text))
        elif kind in ("message", "chat:message:delta"):
            self.pending.append(("append", str(data.get("content") or "")))
        elif kind in ("replace", "chat:message"):
            self.pending.append(("replace", str(data.get("content") or "")))
        elif kind == "chat:completion" and isinstance(data.get("content"), str):
            self.pending.append(("completion", data["content"]))

    def apply(self, content: str) -> str:
        """``content`` with the pending message and replace events applied (and cleared)."""
        for what, text in self.pending:
            content = content + text if what == "append" else text
        self.pending = []
        return content


async def event_call(event: Any) -> None:
    """``__event_call__`` asks a browser for input; a headless server has none to ask: None."""
    return None


class Loaded:
    """One running Function: its module, class and instance, and its settings."""

    def __init__(self, plugin: Any, meta: dict[str, Any], module: Any, cls: type, kind: str, instance: Any) -> None:
        self.plugin = plugin
        self.fid = plugin.name
        self.meta = meta
        self.module = module
        self.cls = cls
        self.kind = kind
        self.instance = instance
        self.valves_cls = _model(getattr(cls, "Valves", None))
        self.user_valves_cls = _model(getattr(cls, "UserValves", None))
        self.user_valves = valves.UserValvesStore(plugin.data_dir)
        self.title = (meta.get("frontmatter") or {}).get("title") or self.fid
        self.models: list[dict[str, Any]] = []

    # --- the instance a request uses -------------------------------------------------------
    def stored(self) -> dict[str, Any]:
        return self.plugin.stored_settings

    def current_valves(self, stored: dict[str, Any] | None = None) -> Any:
        """The Valves from the stored values; a stored value the model refuses is left out."""
        values = self.stored() if stored is None else stored
        try:
            return valves.build(self.valves_cls, values)
        except Exception as exc:  # noqa: BLE001 - values stored by an older version of the Function
            log.warning("%s: stored valves refused (%s); using the defaults for them", self.fid, valves.message(exc))
            kept = {}
            for key, value in values.items():
                try:
                    valves.build(self.valves_cls, {**kept, key: value})
                    kept[key] = value
                except Exception:  # noqa: BLE001
                    continue
            return valves.build(self.valves_cls, kept)

    def fresh(self) -> Any:
        """This request's instance: a shallow copy, its valves rebuilt from the stored values."""
        try:
            inst = copy.copy(self.instance)
        except Exception:  # noqa: BLE001 - an instance that cannot be copied is used as it is
            inst = self.instance
        if self.valves_cls is not None and (hasattr(inst, "valves") or self.kind == "pipe"):
            inst.valves = self.current_valves()
        return inst

    @property
    def toggle(self) -> bool:
        return bool(getattr(self.instance, "toggle", None))

    @property
    def file_handler(self) -> bool:
        return bool(getattr(self.instance, "file_handler", False) or getattr(self.module, "file_handler", False))

    # --- the reserved arguments ------------------------------------------------------------
    def user(self, caller: Any) -> dict[str, Any]:
        now = int(time.time())
        ident = who(caller)
        owner = caller is None or getattr(caller, "is_owner", True) or getattr(caller, "kind", "") == "open"
        name = "Owner" if ident == "owner" else (getattr(caller, "name", None) or ident)
        user: dict[str, Any] = {
            "id": ident, "email": f"{ident}@localhost", "username": name, "name": name,
            "role": "admin" if owner else "user", "profile_image_url": "", "bio": None, "gender": None,
            "date_of_birth": None, "timezone": None, "info": {}, "settings": {}, "oauth": None,
            "last_active_at": now, "updated_at": now, "created_at": now}
        if self.user_valves_cls is not None:
            user["valves"] = self.user_valves_for(ident)
        return user

    def user_valves_for(self, ident: str) -> Any:
        values = self.user_valves.get(ident)
        try:
            return valves.build(self.user_valves_cls, values)
        except Exception as exc:  # noqa: BLE001
            log.warning("%s: stored user valves of %s refused (%s)", self.fid, ident, valves.message(exc))
            return self.user_valves_cls()

    def extras(self, context: Any, request: dict[str, Any], emitter: Events, model: str | None) -> dict[str, Any]:
        caller = getattr(context, "caller", None)
        meta = request.get("metadata") if isinstance(request.get("metadata"), dict) else {}
        model_id = model or (request.get("model") if isinstance(request.get("model"), str) else "") or ""
        model_info = model_dict(model_id, pipe=self.kind == "pipe" and model_id.split(".", 1)[0] == self.fid)
        user = self.user(caller)
        chat_id = meta.get("chat_id") or request.get("chat_id") or ""
        message_id = (meta.get("message_id") or (request["id"] if isinstance(request.get("id"), str) else None)
                      or str(uuid.uuid4()))
        files = request.get("files") if isinstance(request.get("files"), list) else meta.get("files") or []
        metadata = {**meta, "user_id": user["id"], "chat_id": chat_id, "message_id": message_id,
                    "session_id": meta.get("session_id"), "filter_ids": filter_ids(request),
                    "tool_ids": meta.get("tool_ids") or [], "files": files, "features": meta.get("features") or {},
                    "variables": meta.get("variables") or {}, "model": model_info,
                    "params": meta.get("params") or {}, "direct": False, "interface": "localm"}
        return {"__user__": user, "__event_emitter__": emitter, "__event_call__": event_call,
                "__metadata__": metadata, "__model__": model_info, "__id__": self.fid, "__request__": None,
                "__chat_id__": chat_id or None, "__message_id__": message_id, "__session_id__": metadata["session_id"],
                "__task__": meta.get("task"), "__task_body__": meta.get("task_body"), "__files__": files,
                "__tools__": {}, "__oauth_token__": None, "__features__": metadata["features"], "__body__": request}


def plain_text(messages: list[Any]) -> None:
    """Content made only of text parts as one string, as Open WebUI hands a Function a
    text-only message (an Anthropic client sends every message as parts)."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and content and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            message["content"] = "".join(p["text"] for p in content)


def _model(cls: Any) -> type | None:
    return cls if isinstance(cls, type) and hasattr(cls, "model_fields") else None


def model_dict(model_id: str, *, pipe: bool = False) -> dict[str, Any]:
    """``__model__``: the model as Open WebUI describes one."""
    out: dict[str, Any] = {
        "id": model_id, "name": model_id, "object": "model", "created": int(time.time()), "owned_by": "localm",
        "info": {"id": model_id, "base_model_id": None, "name": model_id, "params": {},
                 "meta": {"description": None, "tags": [], "filterIds": [], "actionIds": []}},
        "actions": [], "filter_ids": []}
    if pipe:
        out["pipe"] = {"type": "pipe"}
    return out


class Functions:
    """The service the openwebui plugin provides as ``host.service("openwebui")``."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.loaded: dict[str, Loaded] = {}

    def get(self, fid: str) -> Loaded:
        fn = self.loaded.get(fid)
        if fn is None:
            raise sdk.LocalmError(404, f"No active Open WebUI Function named {fid}", code="function_not_found")
        return fn

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self, plugin: Any) -> None:
        """Load a Function's plugin folder (function.py, function.json); raising fails the plugin,
        and GET /api/plugins shows why."""
        folder = plugin.folder
        meta = json.loads((folder / "function.json").read_text(encoding="utf-8"))
        source = (folder / "function.py").read_text(encoding="utf-8")
        loader.install_shim()

        def load() -> tuple[Any, type, str, Any]:
            module, cls, kind = loader.load(source, plugin.name, folder / "function.py")
            return module, cls, kind, cls()
        module, cls, kind, instance = await asyncio.to_thread(load)
        fn = Loaded(plugin, meta, module, cls, kind, instance)
        if fn.valves_cls is not None:
            plugin.add_settings(valves.fields_of(fn.valves_cls),
                                validate=valves.validator(fn.valves_cls, lambda v: self._valves_changed(fn, v)))
            self._apply_priority(fn, fn.current_valves())
        self.loaded[plugin.name] = fn
        if kind == "pipe":
            await self.refresh_models(fn)

    async def stop(self, plugin: Any) -> None:
        fn = self.loaded.pop(plugin.name, None)
        if fn is not None:
            self.host.models.provide(plugin.name, [])
            loader.unload(plugin.name)

    def _apply_priority(self, fn: Loaded, current: Any) -> None:
        if fn.kind != "filter":
            return
        priority = getattr(current, "priority", 0)
        fn.plugin.set_priority(priority if isinstance(priority, int) and not isinstance(priority, bool) else 0)

    def _valves_changed(self, fn: Loaded, current: Any) -> None:
        self._apply_priority(fn, current)
        if fn.kind == "pipe":  # its models may depend on its valves (a key, an upstream)
            asyncio.get_running_loop().create_task(self.refresh_models(fn, current))

    # --- filters -----------------------------------------------------------------------------
    def _runs(self, fn: Loaded, request: dict[str, Any]) -> bool:
        if not isinstance(request.get("messages"), list):
            return False  # a text completion: Open WebUI runs Filters on chats only
        meta = request.get("metadata")
        if isinstance(meta, dict) and meta.get("task"):
            return False  # Open WebUI's background tasks skip Function filters
        return not fn.toggle or fn.fid in filter_ids(request)

    async def inlet(self, plugin: Any, request: dict[str, Any], context: Any) -> dict[str, Any] | None:
        fn = self.loaded.get(plugin.name)
        context.use(*CLAIMED)
        if fn is None or not self._runs(fn, request):
            context.state["skip"] = True
            return None
        inst = fn.fresh()
        events = Events(fn.fid, context)
        context.state.update(instance=inst, events=events)
        body = request
        plain_text(body["messages"])
        added = "metadata" not in body
        extras = fn.extras(context, body, events, context.model)
        if added:
            body["metadata"] = extras["__metadata__"]
        for name in ("inlet", "request"):
            handler = getattr(inst, name, None)
            if handler is None or name not in fn.meta.get("methods", (name,)):
                continue
            try:
                result = await calls.call(handler, "body", body, extras)
            except Exception as exc:  # the Function refused the request, as Open WebUI answers: a 400
                raise sdk.LocalmError(400, calls.refusal_text(exc), code="function_refused",
                                      function=fn.fid) from None
            if result is not None:
                if not isinstance(result, dict):
                    raise TypeError(f"{name} returned {type(result).__name__}; it returns the body (a dict)")
                body = result
        if added and isinstance(body.get("metadata"), dict):
            body.pop("metadata", None)
        if fn.file_handler:
            body.pop("files", None)
        context.state["extras"] = extras
        return body

    async def stream(self, plugin: Any, event: dict[str, Any], context: Any) -> Any:
        state = context.state
        fn = self.loaded.get(plugin.name)
        if fn is None or state.get("skip") or event.get("type") not in ("text", "reasoning", "tool_call"):
            return None
        inst = state.get("instance")
        if inst is None:  # no inlet hook ran (the Function has none)
            if not self._runs(fn, context.request):
                state["skip"] = True
                return None
            inst = state["instance"] = fn.fresh()
        events = state.get("events") or state.setdefault("events", Events(fn.fid, context))
        extras = state.get("extras") or state.setdefault("extras", fn.extras(context, context.request, events,
                                                                             context.model))
        delta: dict[str, Any] = {}
        if event["type"] == "text":
            delta["content"] = event["text"]
        elif event["type"] == "reasoning":
            delta["reasoning_content"] = event["text"]
        else:
            delta["tool_calls"] = [event["call"]]
        chunk = {"id": state.setdefault("chunk_id", f"chatcmpl-{uuid.uuid4().hex[:24]}"),
                 "object": "chat.completion.chunk", "created": int(time.time()), "model": context.model,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        try:
            result = await calls.call(inst.stream, "event", chunk, extras)
        except Exception as exc:
            raise sdk.LocalmError(400, calls.refusal_text(exc), code="function_refused", function=fn.fid) from None
        out: list[dict[str, Any]] = []
        if result:
            got = result if isinstance(result, dict) else chunk
            choices = got.get("choices") if isinstance(got.get("choices"), list) else []
            new = choices[0].get("delta", {}) if choices and isinstance(choices[0], dict) else {}
            new = new if isinstance(new, dict) else {}
            if isinstance(new.get("reasoning_content"), str) and new["reasoning_content"]:
                out.append({"type": "reasoning", "text": new["reasoning_content"]})
            if isinstance(new.get("content"), str) and new["content"]:
                out.append({"type": "text", "text": new["content"]})
            if event["type"] == "tool_call" and new.get("tool_calls"):
                out.append(event)
        for what, text in events.pending:  # text a stream hook emitted goes out where it was emitted
            if what == "append" and text:
                out.append({"type": "text", "text": text})
        events.pending = [p for p in events.pending if p[0] != "append"]
        return out

    async def outlet(self, plugin: Any, response: dict[str, Any], context: Any) -> dict[str, Any] | None:
        state = context.state
        fn = self.loaded.get(plugin.name)
        if fn is None or state.get("skip"):
            return None
        outcome = getattr(context, "outcome", None)
        if outcome is not None and outcome["finish_reason"] in ("error", "abandoned"):
            return None  # Open WebUI calls a Filter's outlet for a completed reply only
        events: Events | None = state.get("events")
        original = response.get("content") or ""
        content = events.apply(original) if events is not None else original
        if "outlet" in fn.meta.get("methods", ("outlet",)) and hasattr(fn.instance, "outlet"):
            if not self._runs(fn, context.request):
                return None
            inst = state.get("instance") or fn.fresh()
            events = events or Events(fn.fid, context)
            extras = state.get("extras") or fn.extras(context, context.request, events, context.model)
            request = context.request
            history = list(request.get("messages") or []) if isinstance(request.get("messages"), list) else \
                [{"role": "user", "content": request.get("prompt") or ""}]
            message_id = extras["__message_id__"]
            reply = {"id": message_id, "role": "assistant", "content": content, "timestamp": int(time.time())}
            if response.get("reasoning_content"):
                reply["reasoning_content"] = response["reasoning_content"]
            shown = copy.deepcopy(history)
            plain_text(shown)
            body = {"model": context.model, "messages": [*shown, reply],
                    "chat_id": extras["__chat_id__"] or "", "session_id": extras["__session_id__"],
                    "id": message_id, "filter_ids": filter_ids(request)}
            try:
                result = await calls.call(inst.outlet, "body", body, extras)
            except Exception as exc:
                raise sdk.LocalmError(400, calls.refusal_text(exc), code="function_refused", function=fn.fid) \
                    from None
            result = result if isinstance(result, dict) else body
            messages = result.get("messages")
            if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
                last = messages[-1].get("content")
                content = last if isinstance(last, str) else content
            content = events.apply(content)
        if content != original:
            return {**response, "content": content}
        return None

    # --- pipes -------------------------------------------------------------------------------
    async def refresh_models(self, fn: Loaded, current_valves: Any = None) -> None:
        """Ask a Pipe for its models and provide them to the registry."""
        inst = fn.fresh()
        if current_valves is not None:
            inst.valves = current_valves
        listed = getattr(inst, "pipes", None)
        models: list[dict[str, Any]]
        if listed is None:
            models = [{"id": fn.fid, "name": fn.title}]
        else:
            try:
                if callable(listed):
                    listed = await listed() if pipes.is_async_callable(listed) else await asyncio.to_thread(listed)
                models = []
                prefix = getattr(inst, "name", "") or ""
                for item in listed or []:
                    if isinstance(item, dict) and item.get("id") is not None:
                        models.append({"id": f"{fn.fid}.{item['id']}",
                                       "name": f"{prefix}{item.get('name') or item['id']}"})
            except Exception as exc:  # noqa: BLE001 - Open WebUI lists no models for a failing pipes()
                log.warning("%s: pipes() failed: %s", fn.fid, calls.refusal_text(exc))
                models = []
        fn.models = models
        self.host.models.provide(fn.plugin.name, [
            {"id": m["id"], "engine": "openwebui", "type": "pipe", "source": f"openwebui:{fn.fid}",
             "capabilities": {"pipe": True, "name": m["name"], "function": fn.fid}} for m in models])

    async def run_pipe(self, plugin: str, model: str, chat: Any) -> AsyncIterator[str]:
        """The reply text of one request to a Pipe model, piece by piece."""
        fn = self.get(plugin)
        inst = fn.fresh()
        context = chat.context
        body = copy.deepcopy(chat.body)
        if isinstance(body.get("messages"), list):
            plain_text(body["messages"])
        events = Events(fn.fid, context)
        extras = fn.extras(context, body, events, model)
        body.pop("metadata", None)
        result = await calls.call(inst.pipe, "body", body, extras)
        said = ""

        def emitted() -> list[str]:
            nonlocal said
            out = []
            for what, text in events.pending:
                if what == "append":
                    out.append(text)
                elif what == "completion" and text.startswith(said):  # the whole message so far
                    out.append(text[len(said):])
            events.pending = []
            return [t for t in out if t]

        async for text in pipes.texts(result):
            for extra in emitted():
                said += extra
                yield extra
            said += text
            yield text
        for extra in emitted():
            said += extra
            yield extra

    # --- actions -----------------------------------------------------------------------------
    async def action(self, action_id: str, body: dict[str, Any], caller: Any) -> dict[str, Any]:
        fid, _, sub = action_id.partition(".")
        fn = self.get(fid)
        if fn.kind != "action":
            raise sdk.LocalmError(404, f"{fid} is an Open WebUI {fn.kind}, not an action", code="not_an_action")
        inst = fn.fresh()
        events = Events(fn.fid, None)
        extras = fn.extras(types.SimpleNamespace(caller=caller), body, events,
                           body.get("model") if isinstance(body.get("model"), str) else None)
        extras["__id__"] = sub or fid
        try:
            result = await calls.call(inst.action, "body", body, extras)
        except Exception as exc:
            raise sdk.LocalmError(400, calls.refusal_text(exc), code="function_refused", function=fid) from None
        if hasattr(result, "__aiter__") or (hasattr(result, "__iter__") and not isinstance(result, (str, bytes, dict,
                                                                                                  list))):
            result = "".join([t async for t in pipes.texts(result)])
        return {"function": fid, "action": sub or fid, "result": valves.jsonable(result), "events": events.record}

    # --- listing -----------------------------------------------------------------------------
    def describe(self, fn: Loaded) -> dict[str, Any]:
        actions = getattr(fn.instance, "actions", None) if fn.kind == "action" else None
        return {"id": fn.fid, "type": fn.kind, "title": fn.title, "models": [m["id"] for m in fn.models],
                "actions": [a.get("id") for a in actions if isinstance(a, dict)] if isinstance(actions, list) else [],
                "toggle": fn.toggle, "has_valves": fn.valves_cls is not None,
                "has_user_valves": fn.user_valves_cls is not None,
                "version": (fn.meta.get("frontmatter") or {}).get("version")}
