"""Loading a Function's source as Open WebUI does (its utils/plugin.py): the source runs in a
fresh module named ``function_<id>``, registered in ``sys.modules`` (pydantic resolves the
Valves' annotations through it), with ``__file__`` set; the Function is its first class
named Pipe, Filter or Action, built with no arguments.

Imports of ``open_webui`` modules are served from the helpers localm provides (the ``shim``
folder); any other ``open_webui`` module is an ImportError naming it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import re
import sys
import types
from pathlib import Path
from typing import Any

SHIM = Path(__file__).parent / "shim"
#: The open_webui modules localm provides.
PROVIDED = ("open_webui", "open_webui.constants", "open_webui.env", "open_webui.utils", "open_webui.utils.misc")
KINDS = (("Pipe", "pipe"), ("Filter", "filter"), ("Action", "action"))
# Open WebUI rewrites the imports of Functions written for its older layout (utils/plugin.py)
_OLD_IMPORTS = [(re.compile(rf"^(\s*)from {old}(\.|\s)", re.M), rf"\1from open_webui.{old}\2")
                for old in ("utils", "apps", "main", "config")]


class ShimFinder(importlib.abc.MetaPathFinder):
    """Serves ``open_webui.*`` imports from localm's helpers, whatever else is installed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "open_webui" and not fullname.startswith("open_webui."):
            return None
        if fullname not in PROVIDED:
            raise ImportError(f"No module named {fullname!r}: localm runs Open WebUI Functions, not Open WebUI, "
                              f"and of its modules provides only {', '.join(PROVIDED[1:])} "
                              "(see docs/open-webui.md)", name=fullname)
        parts = fullname.split(".")
        base = SHIM.joinpath(*parts)
        if base.is_dir():
            return importlib.util.spec_from_file_location(fullname, base / "__init__.py",
                                                               submodule_search_locations=[str(base)])
        return importlib.util.spec_from_file_location(fullname, base.with_suffix(".py"))


_FINDER = ShimFinder()


def install_shim() -> None:
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    for name in [m for m in sys.modules if m == "open_webui" or m.startswith("open_webui.")]:
        module = sys.modules[name]
        if not str(getattr(module, "__file__", "") or "").startswith(str(SHIM)):
            del sys.modules[name]  # another package's open_webui: the Functions get localm's


def remove_shim() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def module_name(fid: str) -> str:
    return f"function_{fid}"


def load(source: str, fid: str, path: Path) -> tuple[types.ModuleType, type, str]:
    """Run ``source`` as the Function ``fid``: (its module, its class, its kind). Whatever the
    source raises propagates (the caller reports it); the module is then forgotten."""
    for pattern, replacement in _OLD_IMPORTS:
        source = pattern.sub(replacement, source)
    name = module_name(fid)
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - running the Function is the point
        for class_name, kind in KINDS:
            cls = getattr(module, class_name, None)
            if isinstance(cls, type):
                return module, cls, kind
        raise RuntimeError("no Function class found in the module (Pipe, Filter or Action)")
    except BaseException:
        sys.modules.pop(name, None)
        raise


def unload(fid: str) -> None:
    sys.modules.pop(module_name(fid), None)
