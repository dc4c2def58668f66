"""Settings declared as attrs classes: their fields, schema and strict validation.

The kernel's own settings and every plugin's are attrs classes whose fields carry a
``localm`` metadata block (description, owner_only, choices, bounds). A plugin may also
add fields at run time (``host.add_settings``). Values arriving over HTTP are checked
strictly (``"1"`` is not an integer, ``1`` is not a boolean) with a cattrs converter.
"""

from __future__ import annotations

import typing
from typing import Any

import attrs
import cattrs

from .errors import LocalmError

_MISSING = object()


def setting(default: Any = _MISSING, *, factory: Any = None, description: str = "", label: str | None = None,
            owner_only: bool = False, choices: typing.Sequence[Any] | None = None,
            min: float | None = None, max: float | None = None, secret: bool = False) -> Any:
    """Declare one setting on an attrs class (``x: int = setting(3, description=...)``)."""
    meta = {"localm": {"description": description, "label": label, "owner_only": owner_only,
                       "choices": list(choices) if choices is not None else None,
                       "min": min, "max": max, "secret": secret}}
    if factory is not None:
        return attrs.field(factory=factory, metadata=meta)
    if default is _MISSING:
        raise TypeError("a setting needs a default")
    return attrs.field(default=default, metadata=meta)


@attrs.frozen
class FieldSpec:
    """One setting as the schema reports it."""

    key: str
    type: Any
    default: Any
    description: str = ""
    label: str | None = None
    owner_only: bool = False
    choices: tuple[Any, ...] | None = None
    min: float | None = None
    max: float | None = None
    secret: bool = False

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "type": type_name(self.type), "default": self.default,
                               "description": self.description, "label": self.label or self.key,
                               "owner_only": self.owner_only}
        if self.choices is not None:
            out["choices"] = list(self.choices)
        if self.min is not None:
            out["min"] = self.min
        if self.max is not None:
            out["max"] = self.max
        if self.secret:
            out["secret"] = True
        return out

    def check(self, value: Any) -> Any:
        """Return the value converted to the field's type, or raise a 400 naming the field."""
        try:
            out = strict.structure(value, self.type)
        except (cattrs.BaseValidationError, ValueError, TypeError) as exc:
            raise LocalmError(400, f"Invalid value for {self.key}: expected {type_name(self.type)}, "
                                   f"got {_describe(value)}") from exc
        if self.choices is not None and out not in self.choices:
            raise LocalmError(400, f"Invalid value for {self.key}: expected one of "
                                   f"{', '.join(map(repr, self.choices))}")
        if self.min is not None and out < self.min:
            raise LocalmError(400, f"Invalid value for {self.key}: must be at least {self.min}")
        if self.max is not None and out > self.max:
            raise LocalmError(400, f"Invalid value for {self.key}: must be at most {self.max}")
        return out


def fields_of(cls: type) -> list[FieldSpec]:
    """The FieldSpecs of an attrs settings class."""
    if not attrs.has(cls):
        raise TypeError(f"{cls!r} is not an attrs class")
    hints = typing.get_type_hints(cls)
    out = []
    for f in attrs.fields(cls):
        meta = f.metadata.get("localm", {})
        if isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
            default = f.default.factory()  # type: ignore[union-attr]
        elif f.default is attrs.NOTHING:
            raise TypeError(f"setting {cls.__name__}.{f.name} needs a default")
        else:
            default = f.default
        out.append(FieldSpec(key=f.name, type=hints.get(f.name, f.type), default=default,
                             description=meta.get("description", ""), label=meta.get("label"),
                             owner_only=meta.get("owner_only", False),
                             choices=tuple(meta["choices"]) if meta.get("choices") is not None else None,
                             min=meta.get("min"), max=meta.get("max"), secret=meta.get("secret", False)))
    return out


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is bool:
        return "boolean"
    if tp is int:
        return "integer"
    if tp is float:
        return "number"
    if tp is str:
        return "string"
    if origin in (list, tuple, typing.Sequence) or tp in (list, tuple):
        args = typing.get_args(tp)
        return f"array of {type_name(args[0])}" if args else "array"
    if origin is dict or tp is dict:
        return "object"
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        parts = [type_name(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in typing.get_args(tp) else "")
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def make_strict_converter() -> cattrs.Converter:
    """A cattrs converter that never coerces: ``"1"`` is not an integer, ``1`` not a boolean."""
    conv = cattrs.Converter(forbid_extra_keys=True)

    def _str(v: Any, _: Any) -> str:
        if not isinstance(v, str):
            raise ValueError("expected a string")
        return v

    def _bool(v: Any, _: Any) -> bool:
        if not isinstance(v, bool):
            raise ValueError("expected true or false")
        return v

    def _int(v: Any, _: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                return int(v)
            raise ValueError("expected an integer")
        return v

    def _float(v: Any, _: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError("expected a number")
        return float(v)

    conv.register_structure_hook(str, _str)
    conv.register_structure_hook(bool, _bool)
    conv.register_structure_hook(int, _int)
    conv.register_structure_hook(float, _float)

    def _list_hook(tp: Any) -> Any:
        (item,) = typing.get_args(tp) or (Any,)

        def structure(v: Any, _: Any) -> list[Any]:
            if not isinstance(v, list):
                raise ValueError("expected a list")
            return [v_ if item is Any else conv.structure(v_, item) for v_ in v]
        return structure

    conv.register_structure_hook_factory(lambda t: typing.get_origin(t) is list or t is list, _list_hook)

    def _dict_hook(tp: Any) -> Any:
        def structure(v: Any, _: Any) -> dict[str, Any]:
            if not isinstance(v, dict):
                raise ValueError("expected an object")
            return dict(v)
        return structure

    conv.register_structure_hook_factory(lambda t: typing.get_origin(t) is dict or t is dict, _dict_hook)
    return conv


strict = make_strict_converter()
