"""Open WebUI Functions as plugins: the files, not the running of them.

A Function is one Python file holding ``class Pipe``, ``class Filter`` or ``class Action``
(Open WebUI's order of precedence), with a frontmatter docstring (``title:``,
``version:``, ``requirements:`` ...). Installing one writes a plugin folder:

    <id>/plugin.toml     generated from the frontmatter; requires the openwebui plugin
    <id>/function.py     the Function's source, unchanged
    <id>/function.json   its id, type and frontmatter, for the runtime
    <id>/entry.py        generated hooks that hand every call to the openwebui plugin

An Open WebUI export (a JSON list of functions, each with ``id`` and ``content``) installs
as one such folder per function. The openwebui plugin registers this module's ``read`` as
its installer (``register_installers``), and runs the Functions it installed (see
docs/open-webui.md); this module only reads and writes files, so the CLI can install a
Function with no server.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import attrs
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from localm.sdk import LocalmError

#: A legal plugin id (plugin.toml's ``id``).
PLUGIN_ID = re.compile(r"^[a-z][a-z0-9_]{0,39}$")

#: The plugin that runs installed Functions.
RUNTIME = "openwebui"
#: Open WebUI's frontmatter line (utils/plugin.py): ``key: value``.
_FRONTMATTER = re.compile(r"^\s*([a-z_]+):\s*(.*)\s*$", re.IGNORECASE)
#: The class names Open WebUI looks for, in its order.
KINDS = (("Pipe", "pipe"), ("Filter", "filter"), ("Action", "action"))
#: The methods of each kind that localm calls.
METHODS = {"filter": ("inlet", "request", "stream", "outlet"), "pipe": ("pipe", "pipes"),
           "action": ("action", "actions")}
MAX_SOURCE_BYTES = 1_000_000


@attrs.frozen
class Function:
    """One Function to install: its id, source, what it is, and stored Valves (from an export)."""

    id: str
    source: str
    kind: str
    methods: tuple[str, ...]
    frontmatter: dict[str, str]
    valves: dict[str, Any] | None = None

    @property
    def title(self) -> str:
        return self.frontmatter.get("title") or self.id

    # --- what the plugin host's installer protocol reads --------------------------------
    @property
    def what(self) -> str:
        return f"an Open WebUI {self.kind}"

    @property
    def settings(self) -> dict[str, Any]:
        """The Valves an export stored: the installed plugin's first settings."""
        return {k: v for k, v in (self.valves or {}).items() if v is not None}

    def write(self, folder: Path) -> None:
        write_folder(self, folder)


def frontmatter(source: str) -> dict[str, str]:
    """The frontmatter as Open WebUI reads it: the file's first line is exactly three double
    quotes, and each ``key: value`` line up to the closing quotes is one entry."""
    lines = source.splitlines()
    if not lines or lines[0].strip() != '"""':
        return {}
    out: dict[str, str] = {}
    for line in lines[1:]:
        if '"""' in line:
            break
        match = _FRONTMATTER.match(line)
        if match:
            out[match.group(1).strip().lower()] = match.group(2).strip()
    return out


def function_id(name: str) -> str:
    """A plugin id from a file name or an Open WebUI id: lowercase letters, digits and _."""
    out = re.sub(r"[^a-z0-9_]+", "_", name.strip().lower()).strip("_")
    if out and not out[0].isalpha():
        out = "f_" + out
    return out[:40].rstrip("_")


def inspect_source(source: str, name: str = "function.py") -> tuple[str, tuple[str, ...]]:
    """(kind, the methods localm calls that the class defines); a 400 for a file that does not
    parse or holds no Function class."""
    try:
        tree = ast.parse(source, filename=name)
    except SyntaxError as exc:
        where = f"line {exc.lineno}" + (f", column {exc.offset}" if exc.offset else "")
        raise LocalmError(400, f"{name} is not valid Python ({where}): {exc.msg}", code="function_syntax_error") \
            from None
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for class_name, kind in KINDS:
        node = classes.get(class_name)
        if node is None:
            continue
        names = set()
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(item.name)
            elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
        if node.bases:  # methods may come from a base class: give it every hook of its kind
            names.update(METHODS[kind])
        if "__init__" in names:  # pipes/actions are often set on self in __init__
            names.update(n for n in ("pipes", "actions") if n in METHODS[kind])
        return kind, tuple(m for m in METHODS[kind] if m in names)
    raise LocalmError(400, f"{name} holds no Open WebUI Function: no class Pipe, Filter or Action at its top level",
                      code="not_a_function")


def read_function(source: str, *, fid: str, name: str = "function.py", valves: Any = None) -> Function:
    if len(source.encode("utf-8")) > MAX_SOURCE_BYTES:
        raise LocalmError(413, f"{name} is over {MAX_SOURCE_BYTES} bytes")
    if not PLUGIN_ID.match(fid):
        raise LocalmError(400, f"{fid!r} is not a plugin id: a lowercase letter, then lowercase letters, digits "
                               "and _ (at most 40 characters); pass one with --id")
    if valves is not None and not isinstance(valves, dict):
        raise LocalmError(400, f"the valves of {fid} are not an object")
    kind, methods = inspect_source(source, name)
    return Function(id=fid, source=source, kind=kind, methods=methods, frontmatter=frontmatter(source),
                    valves=valves)


def read_file(path: Path, fid: str | None = None) -> list[Function]:
    """The Functions a ``.py`` file or an Open WebUI export (``.json``) holds."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise LocalmError(400, f"{path.name} cannot be read: {exc.strerror or exc}") from exc
    if len(raw) > 50 * MAX_SOURCE_BYTES:
        raise LocalmError(413, f"{path.name} is too large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise LocalmError(400, f"{path.name} is not UTF-8 text") from None
    if path.suffix.lower() == ".json":
        if fid is not None:
            raise LocalmError(400, "an export names its functions' ids itself: --id applies to one .py file")
        return read_export(text, path.name)
    return [read_function(text, fid=fid or function_id(path.stem), name=path.name)]


def read_export(text: str, name: str = "export.json") -> list[Function]:
    """The functions of an Open WebUI export: a JSON list (or ``{"functions": [...]}``) of
    objects with ``id`` and ``content`` (and, optionally, ``valves``)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise LocalmError(400, f"{name} is not JSON: {exc}") from None
    if isinstance(data, dict):
        data = data.get("functions", [data])
    if not isinstance(data, list) or not data:
        raise LocalmError(400, f"{name} holds no functions: an Open WebUI export is a list of functions")
    out: list[Function] = []
    for n, item in enumerate(data):
        if not isinstance(item, dict) or not isinstance(item.get("content"), str):
            raise LocalmError(400, f"{name}: function {n} has no content (its source)")
        raw_id = item.get("id") if isinstance(item.get("id"), str) else ""
        fid = function_id(raw_id or item.get("name") or f"function_{n}")
        out.append(read_function(item["content"], fid=fid, name=f"{name}: {raw_id or fid}",
                                 valves=item.get("valves")))
    ids = [f.id for f in out]
    if len(set(ids)) != len(ids):
        raise LocalmError(400, f"{name} holds two functions with one id")
    return out


def _version(text: str | None) -> str:
    try:
        return str(Version(text or ""))
    except InvalidVersion:
        match = re.match(r"\d+(\.\d+)*", (text or "").strip().lstrip("vV"))
        return match.group(0) if match else "0.0.0"


def _requirements(fn: Function) -> list[str]:
    text = fn.frontmatter.get("requirements", "")
    out = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            Requirement(item)
        except InvalidRequirement:
            raise LocalmError(400, f"{fn.id}: requirements: {item!r} is not a pip requirement") from None
        out.append(item)
    return out


def _toml(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # a JSON string or list of strings is valid TOML


ENTRY = '''"""Generated by localm from function.py, an Open WebUI {kind}: each hook hands the call to
the openwebui plugin, which runs the Function. Reinstall the Function to regenerate it."""

from localm import sdk


def _functions(host):
    return host.service("openwebui")


@sdk.hookimpl
async def startup(host, plugin):
    await _functions(host).start(plugin)


@sdk.hookimpl
async def shutdown(host, plugin):
    if host.has_service("openwebui"):
        await _functions(host).stop(plugin)
'''

HOOKS = {
    "chat_inlet": '''

@sdk.hookimpl
async def chat_inlet(request, context, plugin, host):
    return await _functions(host).inlet(plugin, request, context)
''',
    "chat_stream": '''

@sdk.hookimpl
async def chat_stream(event, context, plugin, host):
    return await _functions(host).stream(plugin, event, context)
''',
    "chat_outlet": '''

@sdk.hookimpl
async def chat_outlet(response, context, plugin, host):
    return await _functions(host).outlet(plugin, response, context)
''',
}


def hooks_for(fn: Function) -> list[str]:
    """The chat hooks a Function's plugin implements."""
    if fn.kind != "filter":
        return []
    out = []
    if {"inlet", "request"} & set(fn.methods):
        out.append("chat_inlet")
    if "stream" in fn.methods:
        out.append("chat_stream")
    out.append("chat_outlet")  # the outlet, and the message events its other hooks emitted
    return out


def write_folder(fn: Function, folder: Path) -> None:
    """Write ``fn`` as a plugin folder at ``folder`` (which must not exist yet)."""
    folder.mkdir(parents=True)
    fm = fn.frontmatter
    description = fm.get("description") or f"Open WebUI {fn.kind}: {fn.title}"
    lines = [f"id = {_toml(fn.id)}", f"version = {_toml(_version(fm.get('version')))}",
             f"description = {_toml(description)}", 'entry = "entry"', f'requires = ["chat", "{RUNTIME}"]',
             f"requirements = {_toml(_requirements(fn))}", f"type = {_toml(fn.kind)}", f"label = {_toml(fn.title)}",
             'group = "Open WebUI Functions"']
    if fm.get("author"):
        lines.append(f"author = {_toml(fm['author'])}")
    (folder / "plugin.toml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "function.py").write_text(fn.source, encoding="utf-8")
    meta = {"id": fn.id, "type": fn.kind, "methods": list(fn.methods), "frontmatter": fm}
    (folder / "function.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    entry = ENTRY.format(kind=fn.kind) + "".join(HOOKS[h] for h in hooks_for(fn))
    (folder / "entry.py").write_text(entry, encoding="utf-8")


def read(path: Path | None = None, content: str | None = None, fid: str | None = None) -> list[Function]:
    """The installer (``register_installers``): the Functions a ``.py`` file, an export
    (``.json``) or a source text holds."""
    if content is not None:
        if not isinstance(content, str) or not content.strip():
            raise LocalmError(400, "content must be a Function's Python source")
        if content.lstrip().startswith(("[", "{")):
            if fid is not None:
                raise LocalmError(400, "an export names its functions' ids itself: id applies to one source")
            return read_export(content)
        if fid is None:
            raise LocalmError(400, "id is required with content: the plugin id to install the Function as")
        return [read_function(content, fid=fid)]
    assert path is not None
    return read_file(path, fid)
