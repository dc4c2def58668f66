"""The services a plugin reaches through the host, never by importing the kernel.

Hooks receive this object as ``host``. Plugins share work through named services:
one plugin ``provide``s a service (the chat pipeline, the embedder), another asks for it
with ``service`` and names the provider under ``requires`` in its plugin.toml.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from .errors import LocalmError
from .settings import FieldSpec

if TYPE_CHECKING:
    from .runtime import Kernel


class Host:
    def __init__(self, kernel: "Kernel") -> None:
        self._kernel = kernel
        self._services: dict[str, tuple[str, Any]] = {}
        self._renderers: dict[str, str] = {}

    @property
    def data_dir(self) -> Path:
        return self._kernel.data_dir

    @property
    def version(self) -> str:
        from . import __version__
        return __version__

    @property
    def started_at(self) -> float:
        """When this server process started (epoch seconds)."""
        return self._kernel.started_at

    @property
    def session_log(self) -> Any:
        """The session log (kernel/sessionlog.py): ``record(...)``, ``turns(owner=...)``,
        ``user_lines(owner=..., since=...)``, ``clear(owner=...)``; and ``session_mode(caller,
        asked)`` below says which mode a chat is recorded under."""
        return self._kernel.session_log

    def session_mode(self, caller: Any, asked: str | None = None) -> str:
        """The mode a chat from ``caller`` is recorded under: the session_mode setting, or less
        when ``asked`` (the request's X-Localm-Session-Mode) says so and the caller may lower it
        (the owner, or anyone while no key exists). An ``asked`` that is no mode is a 400."""
        from .sessionlog import effective_mode
        k = self._kernel
        may_lower = caller is None or caller.is_owner or not k.auth_required()
        return effective_mode(k.config.get("session_mode"), asked, may_lower=may_lower)

    @property
    def models(self) -> Any:
        """The model manager: ``resolve``, ``use`` (hold a loaded model for a request), ``load``, ``unload_one``."""
        return self._kernel.models

    @property
    def instances(self) -> Any:
        """The instance registry on this machine and the vouches between instances
        (kernel/instances.py): ``instance_id``, ``others()``, ``read(id)``, ``vouch_headers(...)``,
        ``check_proof(...)``."""
        return self._kernel.instances

    @property
    def jobs(self) -> Any:
        return self._kernel.jobs

    @property
    def metrics(self) -> Any:
        """The metrics collector, or None when metrics_enabled is off."""
        return self._kernel.metrics

    @property
    def startup_model(self) -> str | None:
        """The MODEL argument ``localm serve`` was started with, if any."""
        return self._kernel.startup_model

    @property
    def auth_required(self) -> bool:
        """Whether callers need a key: an API key exists (or require_auth is on). False in
        open mode, where only the attach token reaches management routes."""
        return self._kernel.auth_required()

    def setting(self, key: str) -> Any:
        """A kernel setting's current value (e.g. ``cors_origins``)."""
        return self._kernel.config.get(key)

    def settings(self, plugin: str) -> dict[str, Any]:
        """A plugin's resolved settings."""
        return self._kernel.plugins.resolved_settings(plugin)

    def add_settings(self, plugin: str, settings: type | Iterable[FieldSpec], *,
                     validate: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        """Add settings to a plugin at run time (served by GET/POST /v1/plugins/settings);
        see ``PluginContext.add_settings`` for ``validate``."""
        self._kernel.plugins.add_settings(plugin, settings, validate=validate)

    def start_job(self, fn: Callable[..., Any], *, kind: str, title: str, owner: str = "owner",
                  plugin: str | None = None) -> Any:
        return self._kernel.jobs.start(fn, kind=kind, title=title, owner=owner, plugin=plugin)

    # --- services between plugins ---------------------------------------------------
    def provide(self, name: str, service: Any, *, plugin: str) -> None:
        """Offer ``service`` under ``name``; it is withdrawn when ``plugin`` stops."""
        owner = self._services.get(name)
        if owner is not None and owner[0] != plugin:
            raise LocalmError(500, f"Service {name} is already provided by {owner[0]}")
        self._services[name] = (plugin, service)

    def service(self, name: str) -> Any:
        """A service another plugin provides; 503 when no active plugin provides it."""
        found = self._services.get(name)
        if found is None:
            raise LocalmError(503, f"Service {name} is not available: the plugin that provides it is not active",
                              code="service_unavailable")
        return found[1]

    @property
    def chat(self) -> Any:
        """The chat service (``localm.sdk.chat.ChatService``): every chat surface's way to a
        model; a 503 while no active plugin provides it."""
        return self.service("chat")

    def has_service(self, name: str) -> bool:
        return name in self._services

    def register_error_renderer(self, family: str, renderer: Callable[..., Any], *, plugin: str) -> None:
        """Shape errors of routes whose ``error_family`` is ``family`` (OpenAI, Ollama, Anthropic)."""
        self._kernel.error_renderers[family] = renderer
        self._renderers[family] = plugin

    async def run_hook(self, name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call every active plugin's implementation of a per-request hook, in order (the
        manifest's ``priority``, lower first, then the plugin id); (plugin, result) pairs.

        A LocalmError from a hook refuses the request; any other exception is recorded
        against its plugin (GET /api/plugins) and refuses the request with a 500 naming it.
        """
        return await self._kernel.plugins.hooks.run_hook(name, **kwargs)

    def hooks(self, name: str) -> list[Any]:
        """The active implementations of a hook, in the order ``run_hook`` calls them: each
        has ``plugin`` (its id), ``context`` (its PluginContext) and is called as
        ``await impl(**kwargs)``, failing closed as ``run_hook`` does. For a caller that
        chains results from one implementation to the next (the chat service)."""
        return self._kernel.plugins.hooks.hook_impls(name)

    def register_engine(self, plugin: str, name: str, factory: Any, *, formats: Any = (), fallback: Any = ()) -> None:
        owner = self._kernel.engines.get(name)
        if owner is not None and owner[0] != plugin:
            raise LocalmError(500, f"Engine {name} is already registered by {owner[0]}")
        for value in (formats, fallback):
            if isinstance(value, str) or not all(isinstance(f, str) for f in value):
                raise LocalmError(500, f"Engine {name}: formats and fallback are lists of model formats, e.g. "
                                       "formats=['gguf']")
        self._kernel.engines[name] = (plugin, factory)
        self._kernel.engine_formats[name] = (tuple(formats), tuple(fallback))

    def engines(self) -> dict[str, Any]:
        """Engine factories active plugins registered, by engine name."""
        return {name: factory for name, (_, factory) in self._kernel.engines.items()}

    def forget_provider(self, plugin: str) -> None:
        for name in [n for n, (p, _) in self._services.items() if p == plugin]:
            del self._services[name]
        for family in [f for f, p in self._renderers.items() if p == plugin]:
            self._kernel.error_renderers.pop(family, None)
            del self._renderers[family]
        for name in [n for n, (p, _) in self._kernel.engines.items() if p == plugin]:
            del self._kernel.engines[name]
            self._kernel.engine_formats.pop(name, None)
        models = getattr(self._kernel, "models", None)
        if models is not None:
            models.kinds.forget(plugin)
            try:
                models.provide(plugin, [])
                models.engine_gone(plugin)
            except RuntimeError:  # no running loop (the CLI's offline host): nothing is resident
                models.registry.provide(plugin, [])
