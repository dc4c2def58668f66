"""The hook bus: which active plugin implements which hook, in what order, and calling them.

pluggy keeps the registry (each active plugin's module, checked against the hookspecs);
the bus orders a hook's implementations (the manifest's ``hook_priority``, else its
``priority``, then the plugin id), calls them with the arguments each asks for, awaits
the ones that are coroutines, and attributes a failure to its plugin: the plugin's
recorded error, and a 500 that names it. A function marked as a hook that no hookspec
names (``chat_inlett``) fails the plugin's start (:meth:`HookBus.register`).

A plugin may declare hooks of its own (functions in its module marked ``@sdk.hookspec``,
named after the plugin): they join localm's hookspecs when the plugin registers, so the
plugins that require it implement them, checked as localm's own are, and the declaring
plugin calls them with ``host.run_hook`` (:meth:`HookBus.declare`).
"""

from __future__ import annotations

import difflib
import inspect
import logging
from typing import Any, Callable, Mapping

import types

import pluggy

from . import hookspecs
from .errors import LocalmError
from .plugin_files import Plugin, error_text

log = logging.getLogger("localm.plugins")


class HookImpl:
    """One active plugin's implementation of a hook, ready to call: ``await impl(**kwargs)``
    passes the arguments it asks for (``plugin`` and ``host`` included), awaits a coroutine,
    and turns any exception but a ``LocalmError`` into the plugin's recorded failure."""

    __slots__ = ("_bus", "plugin", "context", "priority", "hook", "function", "argnames")

    def __init__(self, bus: "HookBus", p: Plugin, hook: str, function: Callable[..., Any],
                 argnames: tuple[str, ...]) -> None:
        self._bus = bus
        self.plugin = p.name
        self.context = bus.context(p)
        if p.priority is not None:  # set at run time: every hook of the plugin
            self.priority = p.priority
        else:
            self.priority = p.manifest.hook_priority.get(hook, p.manifest.priority) if p.manifest else 0
        self.hook = hook
        self.function = function
        self.argnames = argnames

    async def __call__(self, **kwargs: Any) -> Any:
        kwargs.setdefault("plugin", self.context)
        kwargs.setdefault("host", self._bus.services)
        try:
            value = self.function(**{arg: kwargs.get(arg) for arg in self.argnames})
            if inspect.isawaitable(value):
                value = await value
        except LocalmError:
            raise
        except Exception as exc:
            raise self.failed(exc) from None
        return value

    def failed(self, exc: BaseException) -> LocalmError:
        """Record ``exc`` as this plugin's failure (for a hook that returned what it may not)
        and return the 500 refusal that names the plugin."""
        return self._bus.hook_failed(self.plugin, self.hook, exc)

    def __repr__(self) -> str:
        return f"<{self.hook} of {self.plugin}>"



class HookBus:
    """The hooks of the plugins in ``records`` (the plugin host's records by id): ``context``
    makes the ``plugin`` argument a hook gets, ``services`` is its ``host`` argument."""

    def __init__(self, records: Callable[[], Mapping[str, Plugin]], context: Callable[[Plugin], Any],
                 services: Any) -> None:
        self.records = records
        self.context = context
        self.services = services
        self.pm = pluggy.PluginManager("localm")
        self.pm.add_hookspecs(hookspecs)
        self._impl_cache: dict[str, tuple[int, list[HookImpl]]] = {}
        self._version = 0  # bumped whenever the set of active plugins or their order changes
        #: hooks plugins declared: hook name -> the id of the plugin that declared it
        self.declared: dict[str, str] = {}

    def changed(self) -> None:
        """The active set or a priority changed: every hook's order is read again."""
        self._version += 1

    def register(self, p: Plugin, module: Any) -> None:
        """Register ``p``'s module (first the hooks it declares), refusing one that marks a
        function no hook is called by."""
        self.declare(p, module)
        self.pm.register(module, name=p.name)
        try:
            self.check_names(p)
        except Exception:
            self.unregister(p.name)
            raise

    def declare(self, p: Plugin, module: Any) -> list[str]:
        """Add the hooks ``p``'s module declares (its functions marked ``@sdk.hookspec``) to
        the hookspecs; their names. Each must start with the plugin's id and an underscore
        (``rag_documents_added`` for the rag plugin), so two plugins never declare one name
        and none is mistaken for localm's own. A plugin started again (refresh, enable)
        declares its hooks anew: the latest arguments are the ones checked."""
        found = {name: function for name in dir(module)
                 if self.pm.parse_hookspec_opts(module, name) is not None
                 and callable(function := getattr(module, name))}
        prefix = p.name.replace("-", "_") + "_"
        for name in sorted(found):
            owner = self.declared.get(name)
            caller = getattr(self.pm.hook, name, None)
            if not name.startswith(prefix):
                raise LocalmError(500, f"the hook {name} it declares must be named after the plugin: "
                                       f"{prefix}{name}, say")
            if owner is None and caller is not None and caller.spec is not None:
                raise LocalmError(500, f"the hook {name} it declares is already a hook of localm")
            if owner not in (None, p.name):
                raise LocalmError(500, f"the hook {name} it declares is declared by the {owner} plugin")
        if not found:
            return []
        for name in found:
            caller = getattr(self.pm.hook, name, None)
            if caller is not None and self.declared.get(name) == p.name:
                caller.spec = None  # declared again by its plugin: the new arguments replace the old
        self.pm.add_hookspecs(types.SimpleNamespace(**found))
        for name in found:
            self.declared[name] = p.name
        return sorted(found)

    def unregister(self, name: str) -> None:
        if self.pm.has_plugin(name):
            self.pm.unregister(name=name)

    def has_plugin(self, name: str) -> bool:
        return self.pm.has_plugin(name)

    def impls(self, hook: str, p: Plugin) -> list[Any]:
        caller = getattr(self.pm.hook, hook)
        return [impl for impl in caller.get_hookimpls() if impl.plugin_name == p.name]

    async def call(self, hook: str, p: Plugin, **kwargs: Any) -> list[Any]:
        """Call one plugin's implementation of a hook; await it when it is a coroutine."""
        kwargs.setdefault("plugin", self.context(p))
        kwargs.setdefault("host", self.services)
        results = []
        for impl in self.impls(hook, p):
            value = impl.function(**{arg: kwargs[arg] for arg in impl.argnames if arg in kwargs})
            if inspect.isawaitable(value):
                value = await value
            results.append(value)
        return results

    def hook_impls(self, hook: str) -> list["HookImpl"]:
        """Active plugins' implementations of ``hook``, in their stable order: the manifest's
        ``priority`` (lower first), then the plugin id."""
        cached = self._impl_cache.get(hook)
        if cached is not None and cached[0] == self._version:
            return cached[1]
        out = []
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            p = self.records().get(impl.plugin_name)
            if p is None or not p.active:
                continue
            out.append(HookImpl(self, p, hook, impl.function, tuple(impl.argnames)))
        out.sort(key=lambda i: (i.priority, i.plugin))
        self._impl_cache[hook] = (self._version, out)
        return out

    def hook_failed(self, name: str, hook: str, exc: BaseException) -> LocalmError:
        """Record a hook's failure against its plugin (GET /api/plugins shows it) and return
        the refusal to answer: a 500 that names the plugin and nothing of its internals."""
        log.error("plugin %s: %s hook failed", name, hook, exc_info=exc)
        p = self.records().get(name)
        if p is not None:
            p.hook_error = f"{hook} hook failed: {error_text(exc)}"
        return LocalmError(500, f"The {name} plugin failed in its {hook} hook; the request was refused (the "
                                f"server log has the error, and GET /api/plugins shows it)",
                           code="plugin_failed", plugin=name)

    async def run_hook(self, hook: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call every active implementation of ``hook`` in order; (plugin, result) pairs.

        A ``LocalmError`` from a hook refuses the request; any other exception is recorded
        against its plugin and refuses it too (a 500 naming the plugin): a hook never fails open.
        """
        return [(impl.plugin, await impl(**kwargs)) for impl in self.hook_impls(hook)]

    def has_impls(self, hook: str) -> bool:
        return bool(getattr(self.pm.hook, hook).get_hookimpls())

    def call_sync(self, hook: str, p: Plugin, **kwargs: Any) -> list[Any]:
        kwargs.setdefault("plugin", self.context(p))
        kwargs.setdefault("host", self.services)
        return [impl.function(**{arg: kwargs[arg] for arg in impl.argnames if arg in kwargs})
                for impl in self.impls(hook, p)]

    def check_names(self, p: Plugin) -> None:
        """Refuse a plugin that marks with ``@sdk.hookimpl`` a function no hook is called by
        (``chat_inlett``): pluggy would keep it and never call it, so the plugin would run
        without the behaviour its author wrote. ``@sdk.hookimpl(optionalhook=True)`` marks
        one on purpose (a hook of another version of localm)."""
        known = sorted(name for name, caller in vars(self.pm.hook).items()
                       if isinstance(caller, pluggy.HookCaller) and caller.spec is not None)
        unknown = sorted(caller.name for caller in self.pm.get_hookcallers(self.pm.get_plugin(p.name)) or []
                         if caller.spec is None and any(impl.plugin_name == p.name and not impl.optionalhook
                                                        for impl in caller.get_hookimpls()))
        if not unknown:
            return
        parts = []
        for name in unknown:
            near = difflib.get_close_matches(name, known, n=1)
            parts.append(f"{name} (did you mean {near[0]}?)" if near else name)
        raise LocalmError(500, f"{', '.join(parts)} {'is no hook' if len(parts) == 1 else 'are no hooks'} of "
                               "localm or of an active plugin: see docs/plugins.md for the hooks and their "
                               "names (a hook another plugin declares needs that plugin under requires)")
