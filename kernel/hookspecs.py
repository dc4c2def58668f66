"""Every hook a localm plugin can implement.

A plugin implements a hook by defining a function of the same name decorated with
``localm.sdk.hookimpl``, taking only the arguments it needs (pluggy passes them by
name). Hooks that hand out things take a ``register`` callback instead of returning
lists, so the host validates each item as it is registered and blames the right plugin.

Every hook also receives ``plugin`` (a :class:`localm.sdk.PluginContext` for the
plugin being called: its name, data directory, settings) and ``host`` (the
:class:`localm.sdk.Host` services) when it asks for them.

A hook that raises is reported against its plugin (``GET /api/plugins`` → ``errors``).
A lifecycle or registration hook that raises stops only its plugin; a per-request hook
(the chat hooks, ``forward_interventions``) that raises refuses that request.
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


@hookspec
def create_service(host: Any, plugin: Any) -> Any:
    """Make the plugin's service: the object that holds its state while it runs.

    Called at activation, before ``startup``. The kernel calls the object's ``start()``
    (when it has one; may be a coroutine function), keeps it as ``plugin.service`` (routes:
    ``sdk.service_of(request)``), offers it to other plugins as ``host.service(<plugin
    id>)``, and calls its ``stop()`` when the plugin stops, after ``shutdown``. Return None
    for no service.
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
def register_settings(register: Any, plugin: Any, host: Any) -> None:
    """Declare settings: ``register(attrs_class)``.

    Fields are declared with ``localm.sdk.setting``; they live under ``plugins.<name>``
    in config.json and are served by GET/POST /v1/plugins/settings. Called at activation.
    """


@hookspec
def register_scopes(register: Any, plugin: Any, host: Any) -> None:
    """Describe scopes: ``register(name, description)``.

    The names a plugin guards routes with must also be listed under ``scopes`` in its
    plugin.toml (so keys can be minted while the plugin is inactive); this hook adds the
    human description GET /v1/keys shows in its ``presets``.
    """


@hookspec
def register_commands(register: Any, plugin: Any, host: Any) -> None:
    """Add CLI commands: ``register(click_command, ...)``.

    Each command's name must be listed under ``commands`` in plugin.toml: the CLI imports
    the plugin only when one of its commands runs (or ``localm --help`` describes it).
    Called only by the CLI, where ``host`` is None; ``localm.sdk.connect()`` reaches the
    running server.
    """


@hookspec
def register_engines(register: Any, host: Any, plugin: Any) -> None:
    """Offer inference engines: ``register(name, factory, formats=(), fallback=())``.

    ``factory(model_entry, options)`` returns an object implementing
    :class:`localm.sdk.engines.Engine`. ``formats`` are the model file formats (registry
    entry types: ``"gguf"``, ``"hf"``, or one a plugin registers) the engine serves;
    ``fallback`` those it serves only when no active engine lists them in ``formats``. A
    model whose entry names an ``engine`` (a provided model) goes to that engine whatever
    its format. Called at activation.
    """


@hookspec
def register_model_formats(register: Any, host: Any, plugin: Any) -> None:
    """Teach the model registry a file format: ``register(sdk.ModelFormat(...))``.

    ``localm pull`` then finds models of that format in files, folders and pypi: packages,
    and registers them with the ``type`` the format names (what an engine's ``formats``
    declare). Each format's name must be listed under ``model_formats`` in plugin.toml: the
    CLI imports the plugin for ``localm pull`` only then. Called at activation (and by the
    CLI, where ``host`` is None).
    """


@hookspec
def register_model_providers(register: Any, host: Any, plugin: Any) -> None:
    """Serve a pull source scheme: ``register(scheme, pull, forget=None, describe=None)``
    (or ``register(sdk.ModelSource(...))``).

    ``localm pull SCHEME:...`` (and POST /api/pull, and every plugin's ``host.models.pull``)
    calls ``pull(source, registry=, name=, log=)``, which registers the models
    (``registry.add(sdk.ModelEntry(...))``) and returns their entries. ``forget(entry)`` is
    called once the last entry from a source leaves the registry; ``describe(entries)``
    (a coroutine function) adds fields to those entries in GET /v1/models, by model id. Each
    scheme must be listed under ``model_sources`` in plugin.toml. Called at activation (and
    by the CLI, where ``host`` is None).
    """


@hookspec
def register_installers(register: Any, host: Any, plugin: Any) -> None:
    """Install plugins from a file that is not a plugin folder: ``register(name, read)``.

    ``localm plugin install FILE`` (and POST /api/plugins/install-external with ``source``
    or ``content``) calls ``read(path=, content=, fid=)`` (a file, or a text, and the plugin
    id the caller asked for); it returns a list of plugins to install, each with ``id``,
    ``what`` (words for the CLI: "an Open WebUI filter"), ``settings`` (first values, a
    dict) and ``write(folder)``, which writes the plugin's folder; or an empty list when the
    file is not its kind. A 400 ``LocalmError`` refuses the install. All are installed, or
    none. Each name must be listed under ``installers`` in plugin.toml. Called at
    activation (and by the CLI, where ``host`` is None).
    """


# --- the chat pipeline ----------------------------------------------------------------
#
# The chat plugin calls these for every chat surface (OpenAI chat and text completions,
# Ollama, Anthropic Messages, OpenAI Responses). Implementations run in a stable order:
# the manifest's ``priority`` (lower first, default 0), then the plugin id; each one sees
# what the one before it returned. ``context`` is the request's chat context (see
# docs/plugins.md, "Chat hooks"): route, surface, caller, this plugin's ``plugin``, the
# ``host``, and what a hook may add (claimed fields, headers, response fields, status).
# A hook that raises ``LocalmError`` refuses the request with that status; any other
# exception refuses it with a 500 that names the plugin, and is recorded against the
# plugin in GET /api/plugins: a chat hook never fails open.

@hookspec
def chat_inlet(request: Any, context: Any, plugin: Any, host: Any) -> Any:
    """Called once per request, after its fields are read (a field of the wrong type is
    refused first) and before its model loads.

    ``request`` is the whole request as an OpenAI body (other surfaces translate theirs):
    ``messages`` on chat routes, ``prompt`` on text completions (``/v1/completions``,
    Ollama ``raw``), and every other field the client sent. May return a changed request
    (a dict) or None to keep it (changes made in place count too); ``model`` may be
    changed to another registered model. May be a coroutine function.
    """


@hookspec
def chat_stream(event: Any, context: Any, plugin: Any, host: Any) -> Any:
    """Called for each event of a streamed reply, before the surface renders it.

    ``event`` is a dict: ``{"type": "text", "text"}``, ``{"type": "reasoning", "text"}``,
    ``{"type": "tool_call", "call"}`` or ``{"type": "status", "code", "text"}``. Return
    None to keep it, a dict to replace it, or a list of events (empty: drop it). Runs per
    token: keep it cheap. May be a coroutine function.
    """


@hookspec
def chat_stream_end(context: Any, plugin: Any, host: Any) -> Any:
    """Called once when a streamed reply's last event has passed the chat_stream hooks,
    before chat_outlet (not when the generation failed or the client left): the place to
    send text a stream hook held back (a word cut at a chunk's end, a pattern not yet
    complete). Return None, an event, or a list of events (as chat_stream's); they pass
    through the chat_stream hooks of the plugins after this one, in order, and are sent
    before the outlet hooks see the whole message. May be a coroutine function.
    """


@hookspec
def chat_outlet(response: Any, context: Any, plugin: Any, host: Any) -> Any:
    """Called once a reply has been generated, streamed or not, with the whole assistant
    message (``role``, ``content``, and ``reasoning_content``/``tool_calls`` when present).

    May return a changed message, or None. For a streamed reply the text is already sent:
    what the hook appends to ``content`` (a footer) goes out as a last piece of text, and
    other edits reach only later hooks. Not called when the generation failed or the client
    left. May be a coroutine function.
    """


# --- forward-pass hooks (steering, circuits, SAE activations) --------------------

@hookspec
def forward_interventions(request: Any, model: Any, register: Any, plugin: Any, host: Any) -> None:
    """Called once per chat or text completion, after the chat_inlet hooks and before its
    model loads. Embeddings and scoring requests never call it: they are never steered.

    ``request`` is the OpenAI body as the inlet hooks left it (other surfaces translate
    theirs into one); ``model``
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
def activation_readers(request: Any, model: Any, register: Any, plugin: Any, host: Any) -> None:
    """Called once per generation: ``register(layer, reader, point)`` reads activations.

    ``point`` is ``"pre"`` or ``"post"`` (before or after interventions at that layer).
    """
