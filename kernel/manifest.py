"""``plugin.toml``: the manifest that names a plugin and says what it needs.

Parsed into :class:`Manifest` with cattrs. A malformed manifest raises
:class:`ManifestError` naming the file and the field, never a traceback.

```toml
id = "hello"                 # legal id: lowercase letter, then lowercase letters, digits, _
version = "0.1.0"
description = "Says hello."
entry = "hello"              # module (or package) inside the plugin folder
scopes = ["hello"]           # scopes this plugin introduces
requires = []                # plugins that must be active first
requirements = ["humanize>=4"]   # pip requirements (installed by `localm plugin install-deps`)
pip_env = {}                 # environment for building them (e.g. CMAKE_ARGS); set: pip skips its cache
protected = false            # true: cannot be disabled or uninstalled
ships_disabled = false       # true: installed but off until enabled
priority = 0                 # order among plugins implementing the same chat hook: lower runs first
hook_priority = {}           # per hook, in place of priority: {chat_stream = 100} runs its stream hook late
commands = ["hello"]         # CLI command names it adds (`localm hello ...`)
model_formats = []           # model file formats it teaches the registry (register_model_formats)
engine_formats = []          # model file formats its engines serve: the hint when no engine runs a model
model_sources = []           # pull source schemes it serves, e.g. "openai+http" (register_model_providers)
installers = []              # what it installs as plugins from a file that is not one (register_installers)
label = "Hello"
group = "Examples"
icon = "hand-wave"
type = "example"             # what kind of plugin (an Open WebUI Function: filter, pipe, action)
author = "Ada"
```
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import attrs
import cattrs
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from .settings import make_strict_converter

PLUGIN_ID = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
MODULE_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
SCOPE = re.compile(r"^[a-z][a-z0-9_]*(:[a-z][a-z0-9_]*)?$")


class ManifestError(Exception):
    """A plugin.toml that cannot be used; the message names the file and the field."""


class _FieldError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def legal_id(name: str) -> bool:
    return bool(PLUGIN_ID.match(name or ""))


def _check_id(inst: Any, att: attrs.Attribute, value: str) -> None:
    if not legal_id(value):
        raise _FieldError(att.name, "must start with a lowercase letter and hold only lowercase letters, digits and _ "
                         "(at most 40 characters)")


def _check_version(inst: Any, att: attrs.Attribute, value: str) -> None:
    try:
        Version(value)
    except InvalidVersion as exc:
        raise _FieldError(att.name, f"{value!r} is not a version (PEP 440, e.g. 0.1.0)") from exc


def _check_entry(inst: Any, att: attrs.Attribute, value: str) -> None:
    if not MODULE_PATH.match(value):
        raise _FieldError(att.name, f"{value!r} is not a module path inside the plugin folder")


def _check_ids(inst: Any, att: attrs.Attribute, value: tuple[str, ...]) -> None:
    for v in value:
        if not legal_id(v):
            raise _FieldError(att.name, f"{v!r} is not a legal plugin id")


def _check_scopes(inst: Any, att: attrs.Attribute, value: tuple[str, ...]) -> None:
    for v in value:
        if not SCOPE.match(v):
            raise _FieldError(att.name, f"{v!r} is not a scope name (e.g. 'rag' or 'rag:write')")


def _check_priority(inst: Any, att: attrs.Attribute, value: int) -> None:
    if not -1000 <= value <= 1000:
        raise _FieldError(att.name, f"{value} is out of range (an integer from -1000 to 1000)")


#: The hooks whose implementations run in order (the only ones a priority orders).
ORDERED_HOOKS = ("chat_inlet", "chat_stream", "chat_stream_end", "chat_outlet", "forward_interventions",
                 "activation_readers")


def _check_hook_priority(inst: Any, att: attrs.Attribute, value: dict[str, int]) -> None:
    for hook, priority in value.items():
        if hook not in ORDERED_HOOKS:
            raise _FieldError(att.name, f"{hook!r} is not a hook run in order ({', '.join(ORDERED_HOOKS)})")
        if not -1000 <= priority <= 1000:
            raise _FieldError(att.name, f"{hook}: {priority} is out of range (an integer from -1000 to 1000)")


def _check_requirements(inst: Any, att: attrs.Attribute, value: tuple[str, ...]) -> None:
    for v in value:
        try:
            Requirement(v)
        except InvalidRequirement as exc:
            raise _FieldError(att.name, f"{v!r} is not a pip requirement: {str(exc).splitlines()[0]}") from exc


@attrs.frozen
class Manifest:
    id: str = attrs.field(validator=_check_id)
    version: str = attrs.field(validator=_check_version)
    entry: str = attrs.field(validator=_check_entry)
    description: str = ""
    scopes: tuple[str, ...] = attrs.field(default=(), validator=_check_scopes)
    requires: tuple[str, ...] = attrs.field(default=(), validator=_check_ids)
    requirements: tuple[str, ...] = attrs.field(default=(), validator=_check_requirements)
    requires_extras: tuple[str, ...] = ()
    pip_env: dict[str, str] = attrs.field(factory=dict)
    protected: bool = False
    ships_disabled: bool = False
    priority: int = attrs.field(default=0, validator=_check_priority)
    #: per hook, in place of ``priority`` (an inlet that must run first and a stream hook
    #: that must run last, in one plugin)
    hook_priority: dict[str, int] = attrs.field(factory=dict, validator=_check_hook_priority)
    commands: tuple[str, ...] = ()
    #: the model file formats (entry types) and pull source schemes it registers: the CLI
    #: imports the plugin for ``localm pull`` / ``localm rm`` only when it lists one
    model_formats: tuple[str, ...] = ()
    model_sources: tuple[str, ...] = ()
    #: the model file formats its engines serve (register_engines' formats and fallback):
    #: when no active engine runs a model, the refusal names the plugins to enable
    engine_formats: tuple[str, ...] = ()
    #: the installers it registers (a file that is not a plugin folder, written as plugins):
    #: the CLI imports the plugin for ``localm plugin install FILE`` only when it lists one
    installers: tuple[str, ...] = ()
    label: str | None = None
    group: str | None = None
    icon: str | None = None
    tab: str | None = None
    #: What kind of plugin it is, where that says more than its hooks (an Open WebUI Function:
    #: "filter", "pipe" or "action"); reported by GET /api/plugins.
    type: str | None = None
    author: str | None = None
    client_entry: str | None = None
    tool_exports: tuple[str, ...] = ()

    @property
    def scope(self) -> str | None:
        """The plugin's primary scope: the default guard on its routes."""
        return self.scopes[0] if self.scopes else None


def _converter() -> cattrs.Converter:
    conv = make_strict_converter()

    def _strs(v: Any, _: Any) -> tuple[str, ...]:
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ValueError("expected a list of strings")
        return tuple(v)

    conv.register_structure_hook_func(lambda t: t == tuple[str, ...], _strs)

    def _env(v: Any, _: Any) -> dict[str, str]:
        if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
            raise ValueError("expected a table of strings")
        return dict(v)

    conv.register_structure_hook_func(lambda t: t == dict[str, str], _env)

    def _ints(v: Any, _: Any) -> dict[str, int]:
        if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, int) and not isinstance(x, bool)
                                              for k, x in v.items()):
            raise ValueError("expected a table of integers")
        return dict(v)

    conv.register_structure_hook_func(lambda t: t == dict[str, int], _ints)
    return conv


_conv = _converter()


def _first_error(exc: BaseException) -> tuple[str, str]:
    """(field, message) of the first leaf error in a cattrs error tree."""
    if isinstance(exc, cattrs.ClassValidationError):
        for sub in exc.exceptions:
            for note in getattr(sub, "__notes__", []):
                name = getattr(note, "name", None)
                if name:
                    return name, str(sub)
            return _first_error(sub)
    if isinstance(exc, ExceptionGroup):
        return _first_error(exc.exceptions[0])
    if isinstance(exc, _FieldError):
        return exc.field, exc.message
    return "", str(exc)




def parse_manifest(path: Path) -> Manifest:
    """Parse ``plugin.toml`` at ``path``; raise ManifestError naming the file and field."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ManifestError(f"{path}: no plugin.toml") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: cannot be read ({exc.__class__.__name__})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: not valid TOML: {exc}") from exc
    for required in ("id", "version", "entry"):
        if required not in data:
            raise ManifestError(f"{path}: field '{required}' is required")
    try:
        return _conv.structure(data, Manifest)
    except cattrs.ForbiddenExtraKeysError as exc:
        raise ManifestError(f"{path}: unknown field(s) {', '.join(sorted(map(repr, exc.extra_fields)))}") from exc
    except cattrs.ClassValidationError as exc:
        extra = [e for e in exc.exceptions if isinstance(e, cattrs.ForbiddenExtraKeysError)]
        if extra:
            names = ", ".join(sorted(map(repr, extra[0].extra_fields)))
            raise ManifestError(f"{path}: unknown field(s) {names}") from exc
        field, msg = _first_error(exc)
        raise ManifestError(f"{path}: field '{field}': {msg}" if field else f"{path}: {msg}") from exc
    except (cattrs.BaseValidationError, ValueError, TypeError) as exc:
        field, msg = _first_error(exc)
        where = f"field '{field}'" if field else "manifest"
        raise ManifestError(f"{path}: {where}: {msg}") from exc
