"""The OpenAPI document's request bodies and refusals, from what each route declares.

Routes read their JSON bodies themselves, so that every refusal keeps its own status and
message. A route declares its body's model with ``body=`` (an attrs class, a dataclass or
a msgspec Struct; ``Annotated[..., msgspec.Meta(...)]`` documents bounds, and a class
attribute ``closed = True`` says that a field the route does not read is refused; or a JSON
schema as a dict, for a body assembled at run time) and its refusals
with ``errors={status: "when"}`` (``None``: a status the route never answers, such as a
413 its error family renders as a 400), and the bounds of its path parameters that it checks itself
with ``params={name: {"pattern": ..., "maxLength": ...}}``; this module writes both into /openapi/openapi.json the
first time it is served, so the document is a truthful contract for client generators
and schema-driven fuzzers.
"""

from __future__ import annotations

import copy
import re

import threading
from typing import TYPE_CHECKING, Any

import msgspec
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.routes import HTTPRoute

if TYPE_CHECKING:
    from litestar import Litestar, Request

REF = "#/components/schemas/{name}"

#: The default error shape (the OpenAI, Ollama and Anthropic route families render their own).
ERROR = {"type": "object", "title": "Error",
         "properties": {"detail": {"type": "string", "description": "What was refused and why"},
                        "code": {"type": "string", "description": "A stable code, where the refusal has one"}},
         "required": ["detail"]}
#: The default shape of a body or parameter that failed validation: one entry per field.
INVALID = {"type": "object", "title": "Invalid",
           "properties": {"detail": {"type": "string"},
                          "errors": {"type": "array", "items": {"type": "object",
                                                                "properties": {"key": {"type": "string"},
                                                                               "message": {"type": "string"}}}}},
           "required": ["detail"]}
#: What every route may answer, whatever it declares.
COMMON = {413: "The body is larger than max_body_bytes (or the route's own limit)"}
LIMITS = {400: "A JSON body nested deeper than max_json_depth"}
RATE = "More inference requests this minute than expensive_requests_per_minute allows (rate_limited, Retry-After)"


def _error(description: str, ref: str = "Error") -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": REF.format(name=ref)}}}}


def describe(app: "Litestar", schema: dict[str, Any]) -> None:
    """Add the declared bodies and refusals of ``app``'s routes to ``schema`` (in place)."""
    paths = schema.setdefault("paths", {})
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.setdefault("Error", ERROR)
    components.setdefault("Invalid", INVALID)
    found: list[tuple[dict[str, Any], dict[str, Any], bool]] = []
    models: list[Any] = []
    added: dict[str, dict[str, Any]] = {}  # the subpaths handlers answer as routes of their own
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        item = paths.get(route.path_format or "/")
        if item is None:
            continue
        for handler in route.route_handlers:
            for method in handler.http_methods:
                operation = item.get(method.lower())
                if operation is None:
                    continue
                responses = operation.setdefault("responses", {})
                # Litestar calls a parameter that fails validation a 400; localm answers 422
                litestar_400 = responses.get("400", {})
                if "Bad request syntax" in str(litestar_400.get("description", "")):
                    del responses["400"]
                    responses["422"] = _error("A parameter or body field failed validation", "Invalid")
                for parameter in operation.get("parameters", []):
                    extra = (handler.opt.get("params") or {}).get(parameter.get("name"))
                    if extra:
                        parameter["schema"] = {**parameter.get("schema", {}), **extra}
                body = handler.opt.get("body")
                errors = dict(handler.opt.get("errors") or {})
                if handler.opt.get("expensive", handler.opt.get("access") == "inference"):
                    errors.setdefault(429, RATE)
                if body is not None:
                    if not isinstance(body, dict):  # a dict is a JSON schema already
                        models.append(body)
                    found.append((operation, handler.opt, method in ("POST", "PUT", "PATCH")))
                    errors = {**LIMITS, **COMMON, **errors}
                for status, why in sorted(errors.items()):
                    if why is None:  # never answered here (a route family that renders it as another status)
                        responses.pop(str(status), None)
                    else:
                        responses.setdefault(str(status), _error(why))
                for sub, summary in (handler.opt.get("subpaths") or {}).items():
                    copied = copy.deepcopy(operation)
                    copied["summary"] = summary
                    copied["operationId"] = f"{operation.get('operationId', '')}{sub}".replace("/", "_")
                    copied["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                            for n in re.findall(r"\{([^}:]+)", sub)]
                    added.setdefault(sub, {})[method.lower()] = copied
    for sub, operations in added.items():
        paths.setdefault(sub, {}).update(operations)
    unique = list(dict.fromkeys(models))
    refs, defined = msgspec.json.schema_components(unique, ref_template=REF) if unique else ((), {})
    by_model = dict(zip(unique, refs))
    for model, ref in by_model.items():
        if getattr(model, "closed", False):  # the route refuses a field it does not read
            defined[ref["$ref"].rsplit("/", 1)[1]]["additionalProperties"] = False
    for name, definition in defined.items():
        components.setdefault(name, definition)
    for operation, opt, _ in found:
        body = opt["body"]
        operation["requestBody"] = {"required": bool(opt.get("body_required", True)), "content": {
            "application/json": {"schema": body if isinstance(body, dict) else by_model[body]}}}


class DescribedJson(JsonRenderPlugin):
    """/openapi/openapi.json, with the declared bodies and refusals written in once."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lock = threading.Lock()
        self._described: set[int] = set()

    def render(self, request: "Request", openapi_schema: dict[str, Any]) -> bytes:
        with self._lock:
            if id(openapi_schema) not in self._described:
                describe(request.app, openapi_schema)
                self._described.add(id(openapi_schema))
        return super().render(request, openapi_schema)
