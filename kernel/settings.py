"""Settings declared as attrs classes: their fields, schema and strict validation.

The kernel's own settings and every plugin's are attrs classes whose fields carry a
``localm`` metadata block (description, owner_only, choices, bounds). A plugin may also
add fields at run time (``host.add_settings``). Values arriving over HTTP are checked
strictly (``"1"`` is not an integer, ``1`` is not a boolean) with a cattrs converter.
"""

from __future__ import annotations

import types
import typing
from typing import Any

import attrs
import cattrs

from .errors import LocalmError

_MISSING = object()


def setting(default: Any = _MISSING, *, factory: Any = None, description: str = "", label: str | None = None,
            owner_only: bool = False, choices: typing.Sequence[Any] | None = None,
            min: float | None = None, max: float | None = None, secret: bool = False) -> Any:
    """Declare one setting on an attrs class (``x: int = setting(3, description=...)``).
    ``owner_only``: hidden from, and refused for, a caller who is not the owner; ``secret``
    (a token, a password) is owner-only too."""
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
    #: Converts or refuses a value (raising ValueError with the reason) in place of the
    #: type's strict check: for fields whose type is described by another library (an Open
    #: WebUI Function's pydantic Valves); ``type`` is then the name the schema shows.
    checker: Any = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.secret and not self.owner_only:  # a secret is shown to, and set by, the owner alone
            object.__setattr__(self, "owner_only", True)

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "type": type_name(self.type), "default": self.default,
                               "description": self.description, "label": self.label or self.key,
                               "owner_only": self.owner_only}
        choices = self.choices
        if typing.get_origin(self.type) is typing.Literal:  # a Literal is its values' type, with choices
            values = typing.get_args(self.type)
            out["type"] = type_name(type(values[0])) if len({type(v) for v in values}) == 1 else "string or number"
            choices = values if choices is None else choices
        if choices is not None:
            out["choices"] = list(choices)
        if self.min is not None:
            out["min"] = self.min
        if self.max is not None:
            out["max"] = self.max
        if self.secret:
            out["secret"] = True
        return out

    def check(self, value: Any) -> Any:
        """Return the value converted to the field's type, or raise a 400 naming the field."""
        if self.checker is not None:
            try:
                return self.checker(value)
            except (TypeError, ValueError) as exc:
                raise LocalmError(400, f"Invalid value for {self.key}: {exc}") from exc
        try:
            out = strict.structure(value, self.type)
        except Exception as exc:  # cattrs' own errors, and the strict hooks' ValueError
            raise LocalmError(400, f"Invalid value for {self.key}: expected {type_name(self.type)}, "
                                   f"got {_describe(value, self.type)}") from exc
        if self.choices is not None and out not in self.choices:
            raise LocalmError(400, f"Invalid value for {self.key}: expected one of "
                                   f"{', '.join(map(repr, self.choices))}")
        if self.min is not None and out < self.min:
            raise LocalmError(400, f"Invalid value for {self.key}: must be at least {self.min}")
        if self.max is not None and out > self.max:
            raise LocalmError(400, f"Invalid value for {self.key}: must be at most {self.max}")
        return out


_SCALARS = (str, int, float, bool)


def supported(tp: Any) -> bool:
    """The types a setting may have: str, int, float, bool, a Literal of strings or numbers,
    list (of any of those), dict (a JSON object; dict[str, T] checks its values), and any
    of these ``| None``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _SCALARS or tp in (list, dict):
        return True
    if origin is typing.Literal:
        return all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in args)
    if origin is list:
        return len(args) == 1 and (args[0] is Any or args[0] in _SCALARS or supported(args[0]))
    if origin is dict:
        return len(args) == 2 and args[0] is str and (args[1] is Any or supported(args[1]))
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return len(rest) == 1 and type(None) in args and supported(rest[0])
    return False


def fields_of(cls: type) -> list[FieldSpec]:
    """The FieldSpecs of an attrs settings class (a field of a type no setting can have is a
    TypeError naming it)."""
    if not attrs.has(cls):
        raise TypeError(f"{cls!r} is not an attrs class")
    hints = typing.get_type_hints(cls)
    out = []
    for f in attrs.fields(cls):
        tp = hints.get(f.name, f.type)
        if not supported(tp):
            spelled = tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
            raise TypeError(f"setting {cls.__name__}.{f.name}: {spelled} is not a setting type (use str, int, "
                            "float, bool, a Literal, list[...], dict[str, ...], or one of them | None)")
        meta = f.metadata.get("localm", {})
        if isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
            default = f.default.factory()  # type: ignore[union-attr]
        elif f.default is attrs.NOTHING:
            raise TypeError(f"setting {cls.__name__}.{f.name} needs a default")
        else:
            default = f.default
        out.append(FieldSpec(key=f.name, type=tp, default=default,
                             description=meta.get("description", ""), label=meta.get("label"),
                             owner_only=meta.get("owner_only", False),
                             choices=tuple(meta["choices"]) if meta.get("choices") is not None else None,
                             min=meta.get("min"), max=meta.get("max"), secret=meta.get("secret", False)))
    return out


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
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
    if origin is dict and len(typing.get_args(tp)) == 2 and typing.get_args(tp)[1] is not Any:
        return f"object of {type_name(typing.get_args(tp)[1])}"
    if origin is dict or tp is dict:
        return "object"
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        parts = [type_name(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in typing.get_args(tp) else "")
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any, tp: Any = None) -> str:
    """What a refused value is, in the words of the JSON it came as: the value itself where
    it was of the right kind but not allowed, the first wrong item of an array or object."""
    if value is None:
        return "null"
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)
    if typing.get_origin(tp) is typing.Literal and isinstance(value, (str, int, float)):
        return repr(value)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    origin = typing.get_origin(tp) or tp
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _describe(value, args[0])
    if origin is list and isinstance(value, list) and args:
        for i, item in enumerate(value):
            try:
                strict.structure(item, args[0])
            except Exception:
                return f"an array whose item {i} is {_describe(item, args[0])}"
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        for key, item in value.items():
            try:
                strict.structure(item, args[1])
            except Exception:
                return f"an object whose {key!r} is {_describe(item, args[1])}"
    return kind


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
        args = typing.get_args(tp)
        value_type = args[1] if len(args) == 2 else Any

        def structure(v: Any, _: Any) -> dict[str, Any]:
            if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
                raise ValueError("expected an object")
            if value_type is Any:
                return dict(v)
            return {k: conv.structure(x, value_type) for k, x in v.items()}
        return structure

    conv.register_structure_hook_factory(lambda t: typing.get_origin(t) is dict or t is dict, _dict_hook)
    return conv


strict = make_strict_converter()
