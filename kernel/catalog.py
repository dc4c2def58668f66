"""The plugin catalogue: what ``localm plugin search``, ``plugin info`` and ``plugin install``
know about.

It is every plugin the host discovers (builtin, installed, and the folders of the catalog:
``plugin-store/`` and each folder named in ``LOCALM_PLUGIN_STORE``) plus the entries of
each catalog folder's ``index.toml``. An index lists plugins that live elsewhere, each
installable by name::

    [[plugins]]
    name = "weather"                 # the plugin's id (its plugin.toml says the same)
    description = "Forecasts in chat."
    keywords = ["weather", "tools"]
    pip = "localm-weather>=1.0"      # a package that ships the plugin folder (or a local
                                     # wheel or project: "./dist/localm_weather-1.0-py3-none-any.whl")
    # path = "../weather-plugin"     # or: a plugin folder on disk, relative to this file

An entry for a plugin that is also a catalog folder adds its keywords to the search.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path
from typing import Any

import attrs
from packaging.requirements import InvalidRequirement, Requirement

from .errors import LocalmError
from .manifest import ManifestError, legal_id, parse_manifest

INDEX = "index.toml"


@attrs.frozen
class IndexEntry:
    name: str
    index: Path
    description: str = ""
    keywords: tuple[str, ...] = ()
    homepage: str | None = None
    pip: str | None = None
    path: Path | None = None

    @property
    def source(self) -> str:
        return f"pip: {self.pip}" if self.pip else f"path: {self.path}"

    def pip_target(self) -> str:
        """What pip installs: the requirement, or a local path resolved against the index's folder."""
        assert self.pip is not None
        if self.pip.startswith(("./", "../", "/", "~")):
            return str((self.index.parent / Path(self.pip).expanduser()).resolve())
        return self.pip

    def distribution(self) -> str | None:
        """The distribution the pip entry installs, when its text says (a requirement, a wheel)."""
        assert self.pip is not None
        target = self.pip_target()
        if target.endswith(".whl"):
            return Path(target).name.split("-")[0]
        if target.startswith("/"):
            return None
        try:
            return Requirement(target).name
        except InvalidRequirement:
            return None


def read_index(root: Path) -> tuple[list[IndexEntry], list[str]]:
    """The entries of ``root/index.toml`` (none when there is no such file) and what was wrong
    with the ones left out."""
    file = root / INDEX
    if not file.is_file():
        return [], []
    try:
        data = tomllib.loads(file.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        return [], [f"{file}: {exc}"]
    raw = data.get("plugins", [])
    if not isinstance(raw, list):
        return [], [f"{file}: plugins must be an array of tables ([[plugins]])"]
    entries, errors = [], []
    for i, item in enumerate(raw):
        where = f"{file}: plugins[{i}]"
        if not isinstance(item, dict):
            errors.append(f"{where}: must be a table")
            continue
        name = item.get("name")
        if not isinstance(name, str) or not legal_id(name):
            errors.append(f"{where}: name must be a legal plugin id")
            continue
        pip, path = item.get("pip"), item.get("path")
        if (pip is None) == (path is None) or not isinstance(pip or path, str):
            errors.append(f"{where} ({name}): give either pip (a requirement or a wheel) or path (a folder)")
            continue
        keywords = item.get("keywords", [])
        if not isinstance(keywords, list) or not all(isinstance(k, str) for k in keywords):
            errors.append(f"{where} ({name}): keywords must be a list of strings")
            continue
        description, homepage = item.get("description", ""), item.get("homepage")
        if not isinstance(description, str) or not isinstance(homepage, (str, type(None))):
            errors.append(f"{where} ({name}): description and homepage must be strings")
            continue
        entries.append(IndexEntry(name=name, index=file, description=description, keywords=tuple(keywords),
                                  homepage=homepage, pip=pip,
                                  path=(root / Path(path).expanduser()).resolve() if path else None))
    return entries, errors


def index(roots: list[Path]) -> tuple[dict[str, IndexEntry], list[str]]:
    """Every index entry of the catalog folders ``roots``, by name (the first folder wins)."""
    out: dict[str, IndexEntry] = {}
    problems: list[str] = []
    for root in roots:
        entries, errors = read_index(root)
        problems.extend(errors)
        for entry in entries:
            out.setdefault(entry.name, entry)
    return out, problems


# --- the rows search and info show ----------------------------------------------------------

def rows(listing: list[dict[str, Any]], entries: dict[str, IndexEntry]) -> list[dict[str, Any]]:
    """One row per plugin: the host's description of it (``GET /api/plugins``'s shape) with
    ``state``, ``source`` and ``keywords``; index entries the host does not know are added."""
    out: list[dict[str, Any]] = []
    seen = set()
    for p in listing:
        entry = entries.get(p["name"])
        state = ("active" if p["active"] else "enabled" if p["enabled"] else
                 "installed" if p["installed"] else "available")
        source = "builtin" if p["builtin"] else "installed" if p["installed"] else "catalog"
        out.append({**p, "state": state, "source": source,
                    "keywords": list(entry.keywords) if entry else [],
                    "homepage": entry.homepage if entry else None})
        seen.add(p["name"])
    for name, entry in sorted(entries.items()):
        if name in seen:
            continue
        row: dict[str, Any] = {"name": name, "version": None, "description": entry.description, "state": "available",
                               "source": entry.source, "keywords": list(entry.keywords), "homepage": entry.homepage,
                               "installed": False, "enabled": False, "active": False, "available": True,
                               "builtin": False, "requires": [], "requirements": [], "missing_deps": [],
                               "scopes": [], "commands": [], "label": name, "group": None, "error": None}
        if entry.path is not None:  # a folder on disk: its manifest says more
            try:
                m = parse_manifest(entry.path / "plugin.toml")
            except (ManifestError, OSError) as exc:
                row["error"] = str(exc)
            else:
                row.update(version=m.version, description=entry.description or m.description,
                           requires=list(m.requires), requirements=list(m.requirements), scopes=list(m.scopes),
                           commands=list(m.commands), label=m.label or name, group=m.group)
        out.append(row)
    return out


def search(all_rows: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The rows whose name, label, group, description or keywords hold every word of ``text``
    (any case); plugins whose name matches come first."""
    words = [w for w in re.split(r"\s+", text.lower()) if w]
    if not words:
        raise LocalmError(400, "Search for something: localm plugin search TEXT")

    def haystack(row: dict[str, Any]) -> str:
        return " ".join(str(row.get(k) or "") for k in ("name", "label", "group", "description")).lower() + " " + \
            " ".join(row.get("keywords") or []).lower()

    found = [row for row in all_rows if all(w in haystack(row) for w in words)]
    return sorted(found, key=lambda row: (not any(w in row["name"] for w in words), row["name"]))


# --- installing an index entry ----------------------------------------------------------------

def plugin_folder(entry: IndexEntry, dist_name: str | None = None) -> Path:
    """The plugin folder a pip entry's installed distribution ships (the one whose plugin.toml
    names ``entry.name``)."""
    names = [dist_name or entry.distribution()]
    candidates = [md.distribution(n) for n in names if n and _installed(n)]
    if not candidates:  # a local project whose name its path does not say: look through them all
        candidates = list(md.distributions())
    for dist in candidates:
        for f in dist.files or []:
            if f.name != "plugin.toml":
                continue
            path = Path(str(dist.locate_file(f)))
            try:
                if parse_manifest(path).id == entry.name:
                    return path.parent
            except (ManifestError, OSError):
                continue
    raise LocalmError(400, f"{entry.pip} installs no plugin named {entry.name} (no plugin.toml with "
                           f"id = \"{entry.name}\" among its files)")


def _installed(name: str) -> bool:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


def installed_distribution(entry: IndexEntry) -> bool:
    """Whether the distribution a pip entry names is installed already."""
    name = entry.distribution()
    return bool(name) and _installed(name)  # type: ignore[arg-type]
