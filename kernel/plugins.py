"""The plugin host: each plugin's life (activate, deactivate, settings, its service).

Three parts, one job each: :class:`~.plugin_files.PluginFiles` is the catalog of plugin
folders on disk (discovery, install, uninstall); :class:`~.hookbus.HookBus` orders and
calls the hooks of the active plugins and attributes their failures; :class:`PluginHost`,
here, decides which plugins run and takes each through its start (import, register the
hooks, settings, scopes, engines, model kinds, installers, its service, ``startup``) and
its stop. A plugin that fails to import, or raises in a hook, is reported with its error
and everything else keeps serving.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

from . import deps
from .config import Config
from .errors import LocalmError
from .hookbus import HookBus
from .manifest import Manifest, legal_id, parse_manifest
from .models import ModelFormat, ModelKinds, ModelSource
from .plugin_files import Plugin, PluginFiles, error_text, fingerprint, forget_modules, import_plugin
from .settings import FieldSpec, fields_of

log = logging.getLogger("localm.plugins")


class PluginContext:
    """What a hook receives as ``plugin``: this plugin's name, folders, settings and jobs."""

    def __init__(self, host: "PluginHost", plugin: Plugin) -> None:
        self._host = host
        self._plugin = plugin
        self.name = plugin.name
        self.log = logging.getLogger(f"localm.plugin.{plugin.name}")

    @property
    def manifest(self) -> Manifest | None:
        return self._plugin.manifest

    @property
    def folder(self) -> Path:
        return self._plugin.folder

    @property
    def data_dir(self) -> Path:
        """A folder this plugin owns for its data (created on first use)."""
        path = self._host.plugin_data_dir(self.name)
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def settings(self) -> dict[str, Any]:
        """This plugin's settings, resolved (stored value or declared default)."""
        return self._host.resolved_settings(self.name)

    @property
    def stored_settings(self) -> dict[str, Any]:
        """The settings set explicitly (in config.json), without the defaults."""
        return dict(self._host.config.plugin_block(self.name))

    def add_settings(self, settings: type | Iterable[FieldSpec], *,
                     validate: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        """Add settings at run time (the Open WebUI Valves seam). ``validate(values)``, when
        given, checks every change as a whole: it gets the values the plugin would have set
        (its stored values with the change applied; a reset key is absent) and returns the
        values to store, or raises ``LocalmError`` (or ``ValueError``, answered as a 400 with
        its message); it replaces any validator added before."""
        self._host.add_settings(self.name, settings, validate=validate)

    @property
    def service(self) -> Any:
        """The object this plugin's ``create_service`` hook made, while the plugin is active
        (a 503 ``service_unavailable`` otherwise): where its state lives, instead of module
        globals. Routes reach it with ``sdk.service_of(request)``, other plugins with
        ``host.service(<plugin id>)``."""
        found = self._plugin.service
        if found is None:
            raise LocalmError(503, f"The {self.name} plugin is not running", code="service_unavailable")
        return found

    def set_priority(self, priority: int | None) -> None:
        """Order this plugin's chat hooks by ``priority`` from now on (None: the manifest's)."""
        self._host.set_priority(self.name, priority)

    def save_settings(self, updates: dict[str, Any]) -> None:
        """Change this plugin's stored settings (each value checked against its declared field;
        None resets one to its default), as POST /v1/plugins/{name}/settings would."""
        self._host.save_settings(self.name, updates)

    def start_job(self, fn: Callable[..., Any], *, kind: str, title: str, owner: str = "owner") -> Any:
        return self._host.services.jobs.start(fn, kind=kind, title=title, owner=owner, plugin=self.name)



class PluginHost:
    """Which plugins run, and each one's start and stop. ``files`` is the catalog of plugin
    folders, ``hooks`` the hook bus; ``services`` is the host object hooks get as ``host``
    (None in the CLI, where no plugin runs)."""

    def __init__(self, *, data_dir: Path, config: Config, services: Any,
                 builtin_dirs: list[Path] | None = None, store_dirs: list[Path] | None = None,
                 only: Iterable[str] | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.config = config
        self.services = services
        self.files = PluginFiles(data_dir=self.data_dir, config=config, builtin_dirs=builtin_dirs,
                                 store_dirs=store_dirs)
        self.hooks = HookBus(lambda: self.files.plugins, self.context, services)
        self.only = set(only) if only is not None else None
        self._lock = asyncio.Lock()
        self._contexts: dict[str, PluginContext] = {}
        self._offline: set[str] = set()  # the plugins load_offline is loading now
        #: installers active plugins registered (register_installers), by plugin
        self._installers: dict[str, list[tuple[str, Callable[..., Any]]]] = {}
        self._offline_installers: list[tuple[str, str, Callable[..., Any]]] | None = None
        self.on_change: Callable[[], None] = lambda: None

    @property
    def plugins(self) -> dict[str, Plugin]:
        """Every plugin known, by id (the catalog's records, with their run state)."""
        return self.files.plugins

    def plugin_data_dir(self, name: str) -> Path:
        return self.files.plugin_data_dir(name)

    # --- which plugins run -------------------------------------------------------
    def enabled(self, plugin: Plugin) -> bool:
        if plugin.protected:
            return True
        override = self.config.enabled_overrides().get(plugin.name)
        if override is not None:
            return override
        return not (plugin.manifest and plugin.manifest.ships_disabled)

    def _wanted(self, plugin: Plugin) -> bool:
        plugin.excluded = self.only is not None and plugin.name not in self.only and not plugin.protected
        return (plugin.installed and plugin.manifest is not None and plugin.manifest_error is None
                and self.enabled(plugin) and not plugin.excluded)

    def _ordered(self) -> list[Plugin]:
        """Installed plugins, each after the plugins it requires (cycles are reported)."""
        out: list[Plugin] = []
        state: dict[str, int] = {}

        def visit(p: Plugin, chain: tuple[str, ...]) -> None:
            if state.get(p.name) == 2:
                return
            if state.get(p.name) == 1:
                p.error = "requires cycle: " + " -> ".join((*chain, p.name))
                return
            state[p.name] = 1
            for req in (p.manifest.requires if p.manifest else ()):
                dep = self.plugins.get(req)
                if dep is not None:
                    visit(dep, (*chain, p.name))
            state[p.name] = 2
            out.append(p)

        for p in sorted(self.plugins.values(), key=lambda p: p.name):
            visit(p, ())
        return out

    async def sync(self) -> None:
        """Make the active set match what is installed, enabled and satisfiable."""
        async with self._lock:
            changed = await self._sync()
        if changed:
            self.on_change()

    async def _sync(self) -> bool:
        changed = False
        ordered = self._ordered()
        # stop what should no longer run, then what needed it, until nothing changes
        stopping = True
        while stopping:
            stopping = False
            for p in reversed(ordered):
                if p.loaded and (not self._wanted(p) or self._requires_missing(p)):
                    await self._deactivate(p)
                    changed = stopping = True
        for p in ordered:
            if not self._wanted(p):
                p.missing_requires = []
                p.missing_deps = deps.missing(p.manifest.requirements) if p.manifest else []
                continue
            p.missing_requires = self._requires_missing(p)
            p.missing_deps = deps.missing(p.manifest.requirements)
            if p.loaded or p.missing_requires or p.missing_deps:
                continue
            if p.error and p.error.startswith("requires cycle"):
                continue
            await self._activate(p)
            changed = True
        return changed

    def _requires_missing(self, p: Plugin) -> list[str]:
        if p.manifest is None:
            return []
        return [r for r in p.manifest.requires if not (r in self.plugins and self.plugins[r].active)]

    # --- loading -----------------------------------------------------------------
    def context(self, p: Plugin) -> PluginContext:
        ctx = self._contexts.get(p.name)
        if ctx is None or ctx._plugin is not p:
            ctx = self._contexts[p.name] = PluginContext(self, p)
        return ctx

    async def _activate(self, p: Plugin) -> None:
        p.error = p.hook_error = None
        try:
            # off the event loop: a plugin whose import is slow (a heavy library, or a sleep)
            # holds up its own start, never the requests being served meanwhile
            module = await asyncio.to_thread(import_plugin, p)
        except (Exception, SystemExit) as exc:  # a broken plugin never takes the server down
            forget_modules(p.name)
            p.error = error_text(exc)
            log.error("plugin %s failed to import:\n%s", p.name, traceback.format_exc())
            return
        p.module = module
        try:
            self.hooks.register(p, module)
        except Exception as exc:
            forget_modules(p.name)
            p.error = error_text(exc)
            log.error("plugin %s failed to register: %s", p.name, p.error)
            return
        p.loaded = True
        p.loaded_fingerprint = fingerprint(p.folder)
        try:
            p.declared_fields = {}
            p.scope_descriptions = {}
            await self.hooks.call("register_settings", p, register=lambda cls: self._declare(p, cls))
            await self.hooks.call("register_scopes", p,
                            register=lambda name, description="": p.scope_descriptions.__setitem__(name, description))
            await self.hooks.call("register_engines", p, register=lambda name, factory, formats=(), fallback=():
                            self.services.register_engine(p.name, name, factory, formats=formats, fallback=fallback))
            await self.hooks.call("register_installers", p,
                            register=lambda name, read: self._add_installer(p, name, read))
            add_format, add_source = self.model_kinds_registrars(p, self.services.models.kinds)
            await self.hooks.call("register_model_formats", p, register=add_format)
            await self.hooks.call("register_model_providers", p, register=add_source)
            await self._start_service(p)
            await self.hooks.call("startup", p)
        except Exception as exc:
            p.error = error_text(exc)
            log.error("plugin %s failed to start:\n%s", p.name, traceback.format_exc())
            await self._deactivate(p, keep_error=True)
            return
        p.active = True
        self.hooks.changed()
        self._check_commands(p)
        log.info("plugin %s %s active", p.name, p.manifest.version if p.manifest else "")

    async def _start_service(self, p: Plugin) -> None:
        """Make the plugin's service (``create_service``), start it and offer it to other
        plugins under the plugin's id."""
        made = [m for m in await self.hooks.call("create_service", p) if m is not None]
        if not made:
            return
        service = made[0]
        start = getattr(service, "start", None)
        if callable(start):
            value = start()
            if inspect.isawaitable(value):
                await value
        p.service = service
        self.services.provide(p.name, service, plugin=p.name)

    async def _stop_service(self, p: Plugin) -> None:
        service, p.service = p.service, None
        stop = getattr(service, "stop", None)
        if service is None or not callable(stop):
            return
        try:
            value = stop()
            if inspect.isawaitable(value):
                await value
        except Exception:
            log.error("plugin %s: its service failed to stop cleanly:\n%s", p.name, traceback.format_exc())

    def _add_installer(self, p: Plugin, name: str, read: Callable[..., Any]) -> None:
        if name not in (p.manifest.installers if p.manifest else ()):
            raise LocalmError(500, f"register_installers registers {name!r}, which plugin.toml's installers does not "
                                   "list: add it there")
        self._installers.setdefault(p.name, []).append((name, read))

    @staticmethod
    def model_kinds_registrars(p: Plugin, kinds: ModelKinds) -> tuple[Callable[..., None], Callable[..., None]]:
        """The ``register`` callbacks of register_model_formats and register_model_providers
        for ``p``: each name must be listed in its plugin.toml (the CLI imports a plugin for
        ``localm pull`` by that list)."""
        listed_formats = set(p.manifest.model_formats if p.manifest else ())
        listed_sources = {s.lower() for s in (p.manifest.model_sources if p.manifest else ())}

        def add_format(fmt: ModelFormat) -> None:
            name = getattr(fmt, "name", None)
            if name not in listed_formats:
                raise LocalmError(500, f"register_model_formats registers the format {name!r}, which plugin.toml's "
                                       f"model_formats does not list: add it there")
            kinds.add_format(p.name, fmt)

        def add_source(scheme: str | ModelSource, pull: Callable[..., Any] | None = None, *,
                       forget: Callable[..., Any] | None = None, describe: Callable[..., Any] | None = None) -> None:
            src = scheme if isinstance(scheme, ModelSource) else ModelSource(
                scheme=str(scheme), pull=pull, forget=forget, describe=describe)  # type: ignore[arg-type]
            if not callable(src.pull):
                raise LocalmError(500, f"register_model_providers: the {src.scheme}: source needs a pull function")
            if src.scheme.lower() not in listed_sources:
                raise LocalmError(500, f"register_model_providers serves the source {src.scheme}:, which "
                                       f"plugin.toml's model_sources does not list: add it there")
            kinds.add_source(p.name, src)
        return add_format, add_source

    def load_offline(self, p: Plugin) -> Any:
        """For a process whose plugins are not running (the CLI): import ``p``, register its
        hooks and declare its settings, without starting it, so one of its registration hooks
        (commands, model kinds, installers) can be called with ``hooks.call_sync``. Its module.
        The plugins it requires are loaded first, so the hooks they declare are known."""
        if self.hooks.has_plugin(p.name) or p.name in self._offline:
            return p.module
        self._offline.add(p.name)  # a requires cycle loads each plugin once
        try:
            for name in (p.manifest.requires if p.manifest else ()):
                dep = self.plugins.get(name)
                if dep is not None and dep.installed and dep.manifest is not None:
                    try:
                        self.load_offline(dep)
                    except Exception as exc:  # the plugin itself fails below if it needed the hooks
                        log.warning("plugin %s: %s, which it requires, did not load: %s", p.name, name, exc)
        finally:
            self._offline.discard(p.name)
        if p.module is None:
            p.module = import_plugin(p)
        if not self.hooks.has_plugin(p.name):
            self.hooks.register(p, p.module)
            self.hooks.call_sync("register_settings", p, register=lambda cls: self._declare(p, cls), host=None)
        return p.module

    def load_model_kinds(self, kinds: ModelKinds) -> None:
        """For a process whose plugins are not running (the CLI, or a server registering its
        startup model before its plugins start): import each enabled plugin whose plugin.toml
        lists model formats or pull sources, and collect them into ``kinds``. A plugin that
        fails to import is logged and left out."""
        for p in self._ordered():
            m = p.manifest
            if m is None or not p.installed or not self.enabled(p) or not (m.model_formats or m.model_sources):
                continue
            try:
                self.load_offline(p)
                add_format, add_source = self.model_kinds_registrars(p, kinds)
                self.hooks.call_sync("register_model_formats", p, register=add_format, host=None)
                self.hooks.call_sync("register_model_providers", p, register=add_source, host=None)
            except Exception as exc:
                log.warning("plugin %s: its model formats and sources are not available: %s", p.name,
                            error_text(exc))

    def _check_commands(self, p: Plugin) -> None:
        """Say so when ``register_commands`` registers a command that plugin.toml's
        ``commands`` does not list: the CLI finds a plugin's commands by that list without
        importing the plugin, so ``localm NAME`` would only answer "No such command". The
        plugin stays active; its error says which names to add."""
        if p.manifest is None or not self.hooks.impls("register_commands", p):
            return
        names: list[str] = []
        try:
            self.hooks.call_sync("register_commands", p, host=None,
                           register=lambda *commands: names.extend(getattr(c, "name", "") or "" for c in commands))
        except Exception:  # noqa: BLE001 - the CLI reports a command that cannot register when it runs
            return
        unlisted = sorted({name for name in names if name and name not in p.manifest.commands})
        if unlisted:
            p.hook_error = (f"register_commands registers {', '.join(unlisted)}, which plugin.toml's commands does "
                            f"not list: `localm {unlisted[0]}` cannot find it until it is listed there")
            log.warning("plugin %s: %s", p.name, p.hook_error)

    def _declare(self, p: Plugin, cls: type) -> None:
        for spec in fields_of(cls):
            p.declared_fields[spec.key] = spec

    async def _deactivate(self, p: Plugin, *, keep_error: bool = False) -> None:
        if p.active:
            try:
                await self.hooks.call("shutdown", p)
            except Exception:
                log.error("plugin %s failed to shut down cleanly:\n%s", p.name, traceback.format_exc())
        await self._stop_service(p)  # also when its start failed after the service started
        p.active = False
        self.hooks.changed()
        if p.loaded:
            self.hooks.unregister(p.name)
        self.services.forget_provider(p.name)
        self._installers.pop(p.name, None)
        p.loaded = False
        p.module = None
        p.added_fields = {}
        p.settings_validator = None
        p.priority = None
        p.loaded_fingerprint = None
        # its modules stay in sys.modules until it is imported again (import_plugin reads its
        # files afresh then): a request still running its code may import one of them lazily
        if not keep_error:
            p.error = p.hook_error = None

    async def fail(self, name: str, error: str) -> None:
        """Mark an active plugin failed (e.g. its routes could not be mounted) and stop it."""
        p = self.plugins.get(name)
        if p is None:
            return
        await self._deactivate(p)
        p.error = error

    async def stop_all(self) -> None:
        async with self._lock:
            for p in reversed(self._ordered()):
                if p.loaded:
                    await self._deactivate(p)

    # --- settings ----------------------------------------------------------------
    def add_settings(self, name: str, settings: type | Iterable[FieldSpec], *,
                     validate: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        p = self.plugins[name]
        specs = fields_of(settings) if isinstance(settings, type) else list(settings)
        for spec in specs:
            p.added_fields[spec.key] = spec
        if validate is not None:
            p.settings_validator = validate

    def set_priority(self, name: str, priority: int | None) -> None:
        p = self.plugins[name]
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            raise TypeError("a priority is an integer (or None)")
        if p.priority != priority:
            p.priority = priority
            self.hooks.changed()  # the hooks' order is read again

    def check_settings(self, name: str, updates: dict[str, Any], *, caller: Any = None) -> dict[str, Any]:
        """The changes to store for ``updates`` to a plugin's settings (None or "" resets a
        value): each value checked against its field, then the whole block by the plugin's
        validator. Raises the 400 (or, for an owner-only field and a caller who is not the
        owner, the 403) that refuses the change; nothing is stored."""
        p = self.plugins[name]
        checked: dict[str, Any] = {}
        for key, value in updates.items():
            spec = p.fields.get(key)
            if spec is None:
                raise LocalmError(400, f"Unknown setting for {name}: {key}")
            if caller is not None and spec.owner_only and not caller.is_owner:
                raise LocalmError(403, f"{key} is owner-only: it needs an admin key")
            checked[key] = None if value is None or value == "" else spec.check(value)
        if p.settings_validator is None:
            return checked
        stored = self.config.plugin_block(name)
        block = dict(stored)
        for key, value in checked.items():
            if value is None:
                block.pop(key, None)
            else:
                block[key] = value
        try:
            kept = p.settings_validator(block)
        except LocalmError:
            raise
        except ValueError as exc:
            raise LocalmError(400, f"Invalid settings for {name}: {exc}") from exc
        if not isinstance(kept, dict):
            raise LocalmError(500, f"The {name} plugin's settings validator returned {type(kept).__name__}")
        return {**kept, **{key: None for key in stored if key not in kept}}

    def save_settings(self, name: str, updates: dict[str, Any]) -> None:
        """Validate and store a plugin's setting values (None or "" resets one); all or nothing."""
        self.config.set_plugin_values(name, self.check_settings(name, updates))

    def resolved_settings(self, name: str) -> dict[str, Any]:
        p = self.plugins.get(name)
        if p is None:
            return {}
        block = self.config.plugin_block(name)
        out = {}
        for key, spec in p.fields.items():
            value = spec.default
            if block.get(key) is not None:  # a null (left by a hand-edited file) means the default
                try:
                    value = spec.check(block[key])
                except LocalmError:
                    log.warning("plugin %s: stored setting %s is invalid; using its default", name, key)
            out[key] = value
        return out

    # --- reporting -----------------------------------------------------------------
    @property
    def errors(self) -> dict[str, str]:
        out = dict(self.files.folder_errors)
        for p in self.plugins.values():
            if p.manifest_error:
                out[p.name] = p.manifest_error
            elif p.error or p.hook_error:
                out[p.name] = p.error or p.hook_error
        return out

    def describe(self, p: Plugin) -> dict[str, Any]:
        m = p.manifest
        return {
            "name": p.name,
            "version": m.version if m else None,
            "description": m.description if m else "",
            "scope": m.scope if m else None,
            "scopes": list(m.scopes) if m else [],
            "builtin": p.builtin,
            "protected": p.protected,
            "tab": m.tab if m else None,
            "label": (m.label if m and m.label else p.name),
            "icon": m.icon if m else None,
            "group": m.group if m else None,
            "type": m.type if m else None,
            "author": m.author if m else None,
            "client_entry": m.client_entry if m else None,
            "assets_base": None,
            "requires": list(m.requires) if m else [],
            "requires_extras": list(m.requires_extras) if m else [],
            "requirements": list(m.requirements) if m else [],
            "missing_deps": p.missing_deps if m else [],
            "missing_requires": p.missing_requires,
            "tool_exports": list(m.tool_exports) if m else [],
            "commands": list(m.commands) if m else [],
            "extra": {"excluded_by_plugins_option": p.excluded} if p.excluded else {},
            "error": p.manifest_error or p.error or p.hook_error,
            "installed": p.installed,
            "enabled": p.installed and self.enabled(p),
            "active": p.active,
            "available": p.store_folder is not None or p.installed,
            "loaded": p.loaded,
        }

    def listing(self) -> list[dict[str, Any]]:
        for p in self.plugins.values():
            if p.manifest is not None and not p.loaded:
                p.missing_deps = deps.missing(p.manifest.requirements)
        return [self.describe(p) for p in sorted(self.plugins.values(), key=lambda p: p.name)]

    def known_scopes(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for p in self.plugins.values():
            if p.manifest is None:
                continue
            for s in p.manifest.scopes:
                out[s] = p.scope_descriptions.get(s) or f"Routes of the {p.name} plugin"
        return out

    # --- catalog operations (work with or without a running server) ----------------
    def installers(self) -> list[tuple[str, str, Callable[..., Any]]]:
        """(plugin, name, read) of every installer: active plugins' in a server; in the CLI,
        those of the enabled plugins whose plugin.toml lists one (imported for it)."""
        if self.services is None and self._offline_installers is None:
            self._offline_installers = []
            for p in self._ordered():
                m = p.manifest
                if m is None or not m.installers or not p.installed or not self.enabled(p):
                    continue
                try:
                    self.load_offline(p)
                    self.hooks.call_sync("register_installers", p, host=None,
                                   register=lambda name, read, p=p: self._offline_installers.append((p.name, name, read)))
                except Exception as exc:
                    log.warning("plugin %s: its installers are not available: %s", p.name, error_text(exc))
        if self.services is None:
            return list(self._offline_installers or [])
        return [(name, *item) for name, items in self._installers.items() for item in items]

    def read_installable(self, source: str | None = None, *, content: str | None = None,
                         fid: str | None = None) -> list[Any]:
        """What a plugin's installer makes of a file (or a source text) that is not a plugin
        folder: the plugins to write (see the ``register_installers`` hook)."""
        path = None
        if content is None:
            path = Path(source or "").expanduser()
            if not path.is_file():
                raise LocalmError(400, f"source is not a file: {path.name or source}")
        for _plugin, _name, read in self.installers():
            found = read(path=path, content=content, fid=fid)
            if found:
                return list(found)
        what = path.name if path is not None else "this content"
        raise LocalmError(400, f"No enabled plugin installs {what}: a plugin is a folder with a plugin.toml "
                               "(localm plugin list shows what the enabled plugins install)")

    def install_generated(self, found: list[Any], *, force: bool) -> list[str]:
        """Install what an installer read as plugins (all of them, or none) and enable them."""
        for item in found:
            if not isinstance(item.id, str) or not legal_id(item.id):
                raise LocalmError(400, f"Plugin rejected: {item.id!r} is not a plugin id")
            existing = self.plugins.get(item.id)
            if existing is not None and existing.builtin:
                raise LocalmError(400, f"Plugin rejected: {item.id} is the name of a builtin plugin; pass another id")
            if existing is not None and existing.installed and not force:
                raise LocalmError(400, f"Plugin {item.id} is already installed; pass force to replace it")
        self.files.installed_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.files.installed_dir, prefix=".generated-") as tmp:
            for item in found:
                item.write(Path(tmp) / item.id)
                parse_manifest(Path(tmp) / item.id / "plugin.toml")  # what was written must read back
            for item in found:
                self.files.copy_in(Path(tmp) / item.id, item.id)
                if item.settings:
                    self.config.set_plugin_values(item.id, dict(item.settings))
                self.config.set_plugin_enabled(item.id, True)
        self.files.discover()
        return [item.id for item in found]

    # --- catalog operations on a running server ------------------------------------------
    async def install(self, name: str) -> None:
        self.files.install_files(name)
        await self.sync()

    async def uninstall(self, name: str, *, delete_data: bool) -> None:
        p = self.files.check_uninstall(name)
        async with self._lock:
            for dep in reversed(self._ordered()):
                if dep.loaded and (dep is p or name in (dep.manifest.requires if dep.manifest else ())):
                    await self._deactivate(dep)
            self.files.remove_files(name, delete_data=delete_data)
            await self._sync()
        self.on_change()

    async def set_enabled(self, name: str, enabled: bool) -> dict[str, Any]:
        if enabled:
            p = self.files.get(name)
            if not p.installed:
                raise LocalmError(409, f"{name} is not installed; install it first")
        else:
            if not legal_id(name):
                raise LocalmError(404, f"Unknown plugin: {name}")
            p = self.plugins.get(name)  # type: ignore[assignment]
            if p is not None and p.protected:
                raise LocalmError(409, f"{name} is protected and cannot be disabled")
        previous = self.config.enabled_overrides().get(name)
        self.config.set_plugin_enabled(name, enabled)
        await self.sync()
        if enabled and p.error and not p.active:
            error = p.error
            # a refused enable changes no state
            if previous is None:
                self.config.forget_plugin(name, settings=False)
            else:
                self.config.set_plugin_enabled(name, previous)
            p.error = error
            raise LocalmError(400, f"Could not enable {name}: {error}")
        return self.describe(p) if p is not None else {}

    async def refresh(self, name: str | None = None) -> dict[str, Any]:
        if name is None:
            refreshed, failed = [], {}
            async with self._lock:
                self.files.discover()
                for p in reversed(self._ordered()):
                    if p.loaded and p.loaded_fingerprint != fingerprint(p.folder):
                        await self._deactivate(p)
                        refreshed.append(p.name)
                await self._sync()
                for n in refreshed:
                    if self.plugins.get(n) and self.plugins[n].error:
                        failed[n] = self.plugins[n].error
            self.on_change()
            return {"status": "partial" if failed else "ok", "refreshed": sorted(refreshed), "failed": failed}
        p = self.files.get(name)
        if not p.installed:
            raise LocalmError(404, f"{name} is not installed")
        if not p.builtin and p.store_folder is None:
            raise LocalmError(404, f"{name} did not ship with localm; reinstall it from its folder with force")
        async with self._lock:
            updated = False
            if not p.builtin and p.store_folder is not None and fingerprint(p.store_folder) != fingerprint(p.folder):
                if p.loaded:
                    await self._deactivate(p)
                self.files.copy_in(p.store_folder, name)
                updated = True
            self.files.discover()
            p = self.plugins[name]
            if p.loaded and p.loaded_fingerprint != fingerprint(p.folder):
                await self._deactivate(p)
                updated = True
            await self._sync()
        self.on_change()
        if p.error:
            raise LocalmError(500, f"Refreshing {name} failed: {p.error}")
        return {"status": "refreshed" if updated else "up-to-date", "name": name}
