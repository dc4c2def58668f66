"""Every hook a localm plugin can implement.

A plugin implements a hook by defining a function of the same name decorated with
``localm.sdk.hookimpl``, taking only the arguments it needs (pluggy passes them by
name). Hooks that hand out things take a ``register`` callback instead of returning
lists, so the host validates each item as it is registered and blames the right plugin.

Every hook also receives ``plugin`` (a :class:`localm.sdk.PluginContext` for the
plugin being called: its name, data directory, settings) and ``host`` (the
:class:`localm.sdk.Host` services) when it asks for them.

A hook that raises is reported against its plugin (``GET /api/plugins`` → ``errors``)
and the server keeps serving everything else.
"""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("localm")
hookimpl = pluggy.HookimplMarker("localm")


# --- lifecycle -------------------------------------------------------------------

@hookspec
def startup(host: Any, plugin: Any) -> Any:
    """Called once when the plugin becomes active (server start, or enable at run time).

    May be a coroutine function. Raising marks the plugin failed; its routes are not mounted.
    """


@hookspec
def shutdown(host: Any, plugin: Any) -> Any:
    """Called when the plugin stops being active (server stop, disable, uninstall, refresh).

    May be a coroutine function. Errors are logged; the plugin is unloaded regardless.
    """


# --- what a plugin contributes ----------------------------------------------------

@hookspec
def register_routes(register: Any, host: Any, plugin: Any) -> None:
    """Register HTTP route handlers: ``register(handler_or_router, ...)``.

    Use the decorators from ``localm.sdk`` (``get``, ``post``, ...), which carry the
    route's scope guard. Called each time the app is rebuilt (enable, disable, refresh),
    so handlers must be safe to register more than once. Routes whose path and method
    another plugin already registered are refused and reported.
    """


@hookspec
def register_settings(register: Any, plugin: Any) -> None:
    """Declare settings: ``register(attrs_class)``.

    Fields are declared with ``localm.sdk.setting``; they live under ``plugins.<name>``
    in config.json and are served by GET/POST /v1/plugins/settings. Called at activation.
    """


@hookspec
def register_scopes(register: Any, plugin: Any) -> None:
    """Describe scopes: ``register(name, description)``.

    The names a plugin guards routes with must also be listed under ``scopes`` in its
    plugin.toml (so keys can be minted while the plugin is inactive); this hook adds the
    human description GET /v1/keys shows in its ``presets``.
    """


@hookspec
def register_commands(register: Any, plugin: Any) -> None:
    """Add CLI commands: ``register(click_command)``.

    Each command's name must be listed under ``commands`` in plugin.toml: the CLI imports
    the plugin only when one of its commands runs (or ``localm --help`` describes it).
    Called only by the CLI.
    """


@hookspec
def register_engines(register: Any, host: Any, plugin: Any) -> None:
    """Offer inference engines: ``register(name, factory)``.

    ``factory(model_entry, options)`` returns an object implementing
    :class:`localm.kernel.engines.Engine`. Called at activation; the model manager picks
    an engine by the model's type.
    """


@hookspec
def register_model_providers(register: Any, host: Any, plugin: Any) -> None:
    """Offer model sources for ``localm pull``: ``register(scheme, provider)``.

    ``provider`` resolves a source string (``pypi:NAME``, ``hf:REPO``, a path) to files
    on disk; called at activation.
    """


# --- the chat pipeline (implemented by later issues; declared now) -----------------

@hookspec
def chat_inlet(request: Any, context: Any) -> Any:
    """Called in plugin order before a chat request is templated.

    May return a changed request (dict) or None to leave it as it is; may raise a
    ``localm.sdk.LocalmError`` to refuse the request. Memory recall, RAG context and
    Open WebUI-style filters live here.
    """


@hookspec
def chat_stream(event: Any, context: Any) -> Any:
    """Called for each event of a streamed generation (token, status, tool call).

    May return a changed event, or None to keep it. Must be fast: it runs per token.
    """


@hookspec
def chat_outlet(response: Any, context: Any) -> Any:
    """Called once with the finished assistant message, before it is rendered.

    May return a changed response, or None. Memory capture and audit logging live here.
    """


# --- forward-pass hooks (steering, circuits, SAE activations) --------------------

@hookspec
def forward_interventions(request: Any, model: Any, register: Any) -> None:
    """Called once per chat or text completion, after its fields are read and before its
    model loads. Embeddings and scoring requests never call it: they are never steered.

    ``request`` is the OpenAI body (other surfaces translate theirs into one); ``model``
    says what will answer: ``model.id``, ``model.type`` ("gguf" or "hf"), ``model.engine``
    (the engine plugin's name) and ``model.capabilities`` (the registry's). ``register``
    collects, for this request only:

    - ``register(layer, delta)``: an :class:`localm.sdk.engines.Intervention`, a delta added
      to the residual stream at the output of decoder layer ``layer``;
    - ``register.use(field)``: a request field this plugin reads (so it is neither refused
      as not honoured nor reported as ignored);
    - ``register.header(name, value)``: a response header;
    - ``register.read(layer, point, done)``: read the residual at ``layer``'s output, before
      (``"pre"``) or after (``"post"``) this request's interventions there; when the
      generation ends, ``done(rows, prompt_ids, generated_ids)`` (called in a worker thread,
      so its work does not hold other requests) gets the rows (a float32
      array, positions × hidden: the prompt, then each generated token fed back) and returns
      a dict of fields added to the response (a streamed reply sends them in one last chunk
      with empty ``choices``).

    A plugin refuses a request it cannot serve by raising ``LocalmError`` (for example a
    steering field sent to an engine that cannot intervene: 400 ``field_not_honoured``). An
    intervention that reaches an engine without ``Capabilities.interventions`` is refused
    with that 400 once the model is loaded.
    """


@hookspec
def activation_readers(request: Any, model: Any, register: Any) -> None:
    """Called once per generation: ``register(layer, reader, point)`` reads activations.

    ``point`` is ``"pre"`` or ``"post"`` (before or after interventions at that layer).
    """
