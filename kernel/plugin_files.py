"""The plugin catalog: plugin folders on disk, read and written.

Plugins come from three places: the builtin ``plugins/`` folder shipped with localm,
the installed set in ``<data dir>/plugins/``, and the ``plugin-store/`` catalog that
``localm plugin install NAME`` copies from (plus any folders in ``LOCALM_PLUGIN_STORE``).
:class:`PluginFiles` finds them (a :class:`Plugin` record each), copies a plugin into
the installed set and removes it; it never imports or runs one. A plugin's code is
imported (:func:`import_plugin`) under ``localm_plugins.<id>`` from its folder, so
plugins never collide with each other or with installed packages, and relative imports
work inside a plugin.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import attrs

from .config import Config
from .errors import LocalmError
from .manifest import Manifest, ManifestError, legal_id, parse_manifest
from .settings import FieldSpec

PACKAGE_ROOT = "localm_plugins"


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        if os.path.isdir(loc):
            return Path(loc)
    return None


def builtin_root() -> Path | None:
    return _package_dir("localm.plugins")


def store_roots(environ: Mapping[str, str] = os.environ) -> list[Path]:
    """The plugin catalogs: the bundled store, then each folder of LOCALM_PLUGIN_STORE."""
    roots = [p for p in [_package_dir("localm.plugin_store")] if p is not None]
    for extra in environ.get("LOCALM_PLUGIN_STORE", "").split(os.pathsep):
        if extra.strip():
            roots.append(Path(extra).expanduser())
    return roots


def fingerprint(folder: Path) -> str:
    """A digest of a plugin folder's files (names, sizes, contents), ignoring caches."""
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        h.update(str(path.relative_to(folder)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def error_text(exc: BaseException) -> str:
    text = f"{exc.__class__.__name__}: {exc}".strip()
    return text.rstrip(":")


@attrs.define(eq=False)
class Plugin:
    """One plugin the host knows about, wherever it lives, and its run state."""

    name: str
    folder: Path
    manifest: Manifest | None
    builtin: bool = False
    installed: bool = False
    store_folder: Path | None = None
    manifest_error: str | None = None
    module: Any = None
    loaded: bool = False
    active: bool = False
    error: str | None = None
    missing_deps: list[str] = attrs.Factory(list)
    missing_requires: list[str] = attrs.Factory(list)
    declared_fields: dict[str, FieldSpec] = attrs.Factory(dict)
    added_fields: dict[str, FieldSpec] = attrs.Factory(dict)
    scope_descriptions: dict[str, str] = attrs.Factory(dict)
    loaded_fingerprint: str | None = None
    excluded: bool = False
    #: the last failure of one of its per-request hooks (chat_inlet, ...) while it stayed active
    hook_error: str | None = None
    #: set at run time (PluginContext.set_priority): replaces the manifest's priority
    priority: int | None = None
    #: checks a whole block of setting values (PluginContext.add_settings(..., validate=))
    settings_validator: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    #: what its create_service hook made, while it is active (PluginContext.service)
    service: Any = None

    @property
    def protected(self) -> bool:
        return bool(self.manifest and self.manifest.protected)

    @property
    def fields(self) -> dict[str, FieldSpec]:
        return {**self.declared_fields, **self.added_fields}


def import_plugin(p: Plugin) -> Any:
    """Import ``p``'s entry module afresh from its folder (any earlier import forgotten)."""
    assert p.manifest is not None
    if PACKAGE_ROOT not in sys.modules:
        root = types.ModuleType(PACKAGE_ROOT)
        root.__path__ = []  # type: ignore[attr-defined]
        sys.modules[PACKAGE_ROOT] = root
    pkg_name = f"{PACKAGE_ROOT}.{p.name}"
    forget_modules(p.name)
    importlib.invalidate_caches()
    init = p.folder / "__init__.py"
    if init.is_file():
        spec = importlib.util.spec_from_file_location(pkg_name, init, submodule_search_locations=[str(p.folder)])
        assert spec is not None and spec.loader is not None
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[pkg_name] = pkg
        spec.loader.exec_module(pkg)
    else:
        pkg = types.ModuleType(pkg_name)
        pkg.__path__ = [str(p.folder)]  # type: ignore[attr-defined]
        pkg.__package__ = pkg_name
        sys.modules[pkg_name] = pkg
    return importlib.import_module(f"{pkg_name}.{p.manifest.entry}")


def forget_modules(name: str) -> None:
    """Drop plugin ``name``'s modules from ``sys.modules``: the next import reads its files again."""
    prefix = f"{PACKAGE_ROOT}.{name}"
    for mod in [m for m in sys.modules if m == prefix or m.startswith(prefix + ".")]:
        del sys.modules[mod]


class PluginFiles:
    """The plugins on disk: builtin, installed and in the catalogs, by id (``plugins``), and
    the folder errors of those that could not be read (``folder_errors``)."""

    def __init__(self, *, data_dir: Path, config: Config, builtin_dirs: list[Path] | None = None,
                 store_dirs: list[Path] | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.config = config
        root = builtin_root()
        self.builtin_dirs = builtin_dirs if builtin_dirs is not None else ([root] if root else [])
        self.store_dirs = store_dirs if store_dirs is not None else store_roots()
        self.plugins: dict[str, Plugin] = {}
        self.folder_errors: dict[str, str] = {}

    @property
    def installed_dir(self) -> Path:
        return self.data_dir / "plugins"

    def plugin_data_dir(self, name: str) -> Path:
        return self.data_dir / "plugin-data" / name

    def _scan(self, root: Path) -> Iterable[tuple[str, Path, Manifest | None, str | None]]:
        if not root.is_dir():
            return
        for folder in sorted(root.iterdir()):
            if not folder.is_dir() or folder.name.startswith((".", "_")):
                continue
            if not (folder / "plugin.toml").is_file():
                continue
            try:
                manifest = parse_manifest(folder / "plugin.toml")
            except ManifestError as exc:
                yield folder.name, folder, None, str(exc)
                continue
            if manifest.id != folder.name:
                yield folder.name, folder, None, (f"{folder / 'plugin.toml'}: field 'id': {manifest.id!r} does not "
                                                  f"match its folder name {folder.name!r}")
                continue
            yield manifest.id, folder, manifest, None

    def discover(self) -> None:
        """Re-read every plugin folder; keeps the run state of plugins already known."""
        found: dict[str, Plugin] = {}
        self.folder_errors = {}

        def take(name: str, folder: Path, manifest: Manifest | None, error: str | None, **flags: Any) -> Plugin | None:
            if not legal_id(name):
                self.folder_errors[name] = error or f"{folder}: folder name is not a legal plugin id"
                return None
            old = self.plugins.get(name)
            if old is not None and old.folder == folder and old.loaded:
                plugin = old
                plugin.manifest = manifest or old.manifest
                plugin.manifest_error = error
            else:
                plugin = Plugin(name=name, folder=folder, manifest=manifest, manifest_error=error)
            plugin.builtin = flags.get("builtin", False)
            plugin.installed = flags.get("installed", False)
            plugin.store_folder = None
            found[name] = plugin
            return plugin

        for root in self.builtin_dirs:
            for name, folder, manifest, error in self._scan(root):
                if name not in found:
                    take(name, folder, manifest, error, builtin=True, installed=True)
        for name, folder, manifest, error in self._scan(self.installed_dir):
            if name in found:
                self.folder_errors[name] = f"{folder}: shadowed by the builtin plugin of the same name"
                continue
            take(name, folder, manifest, error, installed=True)
        for root in self.store_dirs:
            for name, folder, manifest, error in self._scan(root):
                if name in found:
                    if found[name].store_folder is None and error is None:
                        found[name].store_folder = folder
                    continue
                plugin = take(name, folder, manifest, error)
                if plugin is not None and error is None:
                    plugin.store_folder = folder
        # plugins that vanished from disk while loaded stay known until deactivated
        for name, old in self.plugins.items():
            if name not in found and old.loaded:
                old.installed = False
                found[name] = old
        self.plugins = found

    # --- state -------------------------------------------------------------------

    def get(self, name: str) -> Plugin:
        if not legal_id(name) or name not in self.plugins:
            raise LocalmError(404, f"Unknown plugin: {name}")
        return self.plugins[name]

    def install_files(self, name: str) -> Plugin:
        """Copy a catalog plugin into the installed set and enable it."""
        p = self.get(name)
        if p.installed:
            self.config.set_plugin_enabled(name, True)
            return p
        if p.store_folder is None or p.manifest is None:
            raise LocalmError(400, f"Plugin {name} cannot be installed: {p.manifest_error or 'not in the catalog'}")
        self.copy_in(p.store_folder, name)
        self.config.set_plugin_enabled(name, True)
        self.discover()
        return self.plugins[name]

    def copy_in(self, source: Path, name: str) -> None:
        self.installed_dir.mkdir(parents=True, exist_ok=True)
        target = self.installed_dir / name
        staging = self.installed_dir / f".{name}.installing"
        old = self.installed_dir / f".{name}.replaced"
        for leftover in (staging, old):
            shutil.rmtree(leftover, ignore_errors=True)
        try:
            shutil.copytree(source, staging, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".git"))
            if target.exists():
                os.replace(target, old)
            os.replace(staging, target)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if old.exists() and not target.exists():
                os.replace(old, target)
            raise LocalmError(400, f"Could not install {name}: {exc.strerror or exc}") from exc
        shutil.rmtree(old, ignore_errors=True)

    def check_uninstall(self, name: str) -> Plugin:
        p = self.get(name)
        if p.protected:
            raise LocalmError(409, f"{name} is protected and cannot be uninstalled")
        if p.builtin:
            raise LocalmError(400, f"{name} ships with localm and cannot be uninstalled; disable it instead")
        if not p.installed:
            raise LocalmError(400, f"{name} is not installed")
        return p

    def remove_files(self, name: str, *, delete_data: bool) -> None:
        """Remove an installed plugin's folder (it must already be inactive)."""
        target = self.installed_dir / name
        trash = self.installed_dir / f".{name}.removing"
        shutil.rmtree(trash, ignore_errors=True)
        try:
            if target.exists():
                os.replace(target, trash)
        except OSError as exc:
            raise LocalmError(400, f"Could not uninstall {name}: {exc.strerror or exc}") from exc
        self.config.forget_plugin(name, settings=delete_data)
        leftovers = []
        shutil.rmtree(trash, ignore_errors=True)
        if trash.exists():
            leftovers.append(str(trash))
        if delete_data:
            shutil.rmtree(self.plugin_data_dir(name), ignore_errors=True)
            if self.plugin_data_dir(name).exists():
                leftovers.append(str(self.plugin_data_dir(name)))
        self.discover()
        if leftovers:
            raise LocalmError(500, f"{name} was disabled and unloaded, but some of its files could not be removed")

    def check_external(self, source: str, *, force: bool) -> Manifest:
        if not source:
            raise LocalmError(400, "source is required: a local folder holding a plugin.toml")
        folder = Path(source).expanduser()
        if not folder.is_dir():
            raise LocalmError(400, f"source is not a folder: {folder.name or source}")
        if not (folder / "plugin.toml").is_file():
            raise LocalmError(400, f"source has no plugin.toml: {folder.name}")
        try:
            manifest = parse_manifest(folder / "plugin.toml")
        except ManifestError as exc:
            raise LocalmError(400, f"Plugin rejected: {exc}") from exc
        existing = self.plugins.get(manifest.id)
        if existing is not None and existing.builtin:
            raise LocalmError(400, f"Plugin rejected: {manifest.id} is the name of a builtin plugin")
        if existing is not None and existing.installed and not force:
            raise LocalmError(400, f"Plugin {manifest.id} is already installed; pass force to replace it")
        return manifest

    def install_external_files(self, source: str, *, force: bool) -> Manifest:
        manifest = self.check_external(source, force=force)
        self.copy_in(Path(source).expanduser(), manifest.id)
        self.config.set_plugin_enabled(manifest.id, True)
        self.discover()
        return manifest
