"""Valves and UserValves: a Function's pydantic settings, as localm settings.

``Valves`` fields become the plugin's settings (GET/POST /v1/plugins/settings), described
from the model's JSON schema; every change is validated by the Function's own model, and
only the keys set explicitly are stored (Open WebUI's ``model_dump(exclude_unset=True)``).
A field whose ``json_schema_extra`` says ``{"input": {"type": "password"}}`` is owner-only
and never shown to another key. ``UserValves`` are kept per caller (each key, and the
owner) in the plugin's data folder.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from localm import sdk
from localm.sdk import storage

_JSON_TYPES = {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean",
               "array": "array", "object": "object", "null": "null"}


def message(exc: Exception) -> str:
    """pydantic's messages for a failed validation, one per field: ``field: what is wrong``."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())) or 'valves'}: {e.get('msg')}"
                             for e in errors())
        except Exception:  # noqa: BLE001 - fall back to the exception's own text
            pass
    return str(exc)


def jsonable(value: Any) -> Any:
    from pydantic_core import to_jsonable_python

    try:
        return to_jsonable_python(value)
    except Exception:  # noqa: BLE001 - a default no JSON can hold
        return repr(value)


def _type_name(prop: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in prop:
        prop = defs.get(prop["$ref"].rsplit("/", 1)[-1], {})
    if "type" in prop:
        kind = prop["type"]
        if isinstance(kind, list):
            return " or ".join(_JSON_TYPES.get(k, str(k)) for k in kind)
        return _JSON_TYPES.get(kind, str(kind))
    options = prop.get("anyOf") or prop.get("oneOf")
    if options:
        return " or ".join(dict.fromkeys(_type_name(o, defs) for o in options))
    if "enum" in prop:
        return "string"
    return "any"


def _choices(prop: dict[str, Any], defs: dict[str, Any], extra: Any) -> list[Any] | None:
    if "$ref" in prop:
        prop = defs.get(prop["$ref"].rsplit("/", 1)[-1], {})
    if isinstance(prop.get("enum"), list):
        return list(prop["enum"])
    for option in prop.get("anyOf") or ():
        found = _choices(option, defs, None)
        if found:
            return found
    given = extra.get("input", {}).get("options") if isinstance(extra, dict) and isinstance(
        extra.get("input"), dict) else None
    if isinstance(given, list) and given:  # a select input: strings, or {"value", "label"} objects
        return [o.get("value") if isinstance(o, dict) else o for o in given]
    return None


def is_password(field: Any) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and isinstance(extra.get("input"), dict) and extra["input"].get("type") == "password"


def fields_of(model: type) -> list[sdk.FieldSpec]:
    """localm settings for a pydantic model's fields (checked as a whole by ``validator``)."""
    from pydantic_core import PydanticUndefined

    schema = model.model_json_schema()
    props, defs = schema.get("properties", {}), schema.get("$defs", {})
    out = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        prop = props.get(key, {})
        default = field.get_default(call_default_factory=True)
        default = None if default is PydanticUndefined else jsonable(default)
        password = is_password(field)
        out.append(sdk.FieldSpec(
            key=key, type=_type_name(prop, defs), default=default,
            description=field.description or prop.get("description") or "", label=field.title or prop.get("title"),
            owner_only=password, secret=password, choices=_choices_tuple(prop, defs, field.json_schema_extra),
            min=prop.get("minimum", prop.get("exclusiveMinimum")), max=prop.get("maximum", prop.get("exclusiveMaximum")),
            checker=lambda value: value))
    return out


def _choices_tuple(prop: dict[str, Any], defs: dict[str, Any], extra: Any) -> tuple[Any, ...] | None:
    found = _choices(prop, defs, extra)
    return tuple(found) if found else None


def build(model: type, values: dict[str, Any]) -> Any:
    """The model from stored values (None values left out, as Open WebUI does)."""
    return model(**{k: v for k, v in values.items() if v is not None})


def validator(model: type, changed: Any = None) -> Any:
    """The plugin's settings validator: the Function's own model checks every change; the
    values set are stored as the model dumps them. ``changed(instance)`` runs after a change
    was accepted (the Valves priority, a Pipe's models)."""
    def validate(values: dict[str, Any]) -> dict[str, Any]:
        try:
            instance = build(model, values)
        except Exception as exc:  # pydantic's ValidationError, or a validator the Function wrote
            raise sdk.LocalmError(400, f"Invalid valves: {message(exc)}", code="invalid_valves") from None
        dumped = instance.model_dump(mode="json", by_alias=True)
        if changed is not None:
            changed(instance)
        return {k: dumped[k] for k in values if k in dumped}
    return validate


def schema(model: type, values: dict[str, Any], caller: Any) -> list[dict[str, Any]]:
    """The fields of ``model`` with their current values, as GET /v1/plugins/settings shows them."""
    out = []
    for spec in fields_of(model):
        if spec.owner_only and caller is not None and not caller.is_owner:
            continue
        out.append(spec.schema() | {"value": values.get(spec.key, spec.default)})
    return out


class UserValvesStore:
    """Each caller's UserValves values (the key id, or "owner"), in one JSON file."""

    def __init__(self, folder: Path) -> None:
        self.file = storage.JsonFile(folder / "user_valves.json", what="The user valves (user_valves.json)",
                                     default=dict, expect=dict)
        self._lock = threading.Lock()

    def get(self, who: str) -> dict[str, Any]:
        values = self.file.cached().get(who, {})
        return dict(values) if isinstance(values, dict) else {}

    def set(self, who: str, values: dict[str, Any]) -> None:
        def apply(current: dict[str, Any]) -> dict[str, Any]:
            if values:
                current[who] = values
            else:
                current.pop(who, None)
            return current
        with self._lock:
            self.file.update(apply)
