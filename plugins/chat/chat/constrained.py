"""Structured output and tools: OpenAI request fields to llguidance grammars, and back.

Pure functions, no engine: :func:`read_response_format`, :func:`read_tools` and
:func:`read_grammar` read and check the request (every refusal a 400 sent before a model
loads); :func:`tools_grammar` and :func:`format_or_calls_grammar` build the grammars the
engines apply; :func:`tools_prompt` tells the model about the functions; :func:`parse_calls`
reads the calls back out of a reply; :func:`validate_output` checks a finished document.

Generated JSON is compact and laid out one way only (``{"a": 1, "b": [1, 2]}``: ", " between
items, ": " after keys, no other whitespace), so a small model cannot wander into whitespace.

The enforced JSON Schema subset
-------------------------------
type (the seven types, or a list of them), properties, required, additionalProperties
(boolean or schema), items (a schema), prefixItems, minItems, maxItems, enum, const,
minimum, maximum, exclusiveMinimum, exclusiveMaximum (integers and numbers), minLength,
maxLength, pattern, anyOf, and $ref to a schema in the same document ("#" or "#/...": $defs,
definitions, or any other subschema), with its $defs / definitions. Ignored annotations:
title, description, default, examples, $comment, $schema, readOnly, writeOnly, deprecated,
$anchor, and $id at the root.

Verified against llguidance 1.9.1, token by token, over SmolLM2's vocabulary: for each
keyword an instance that satisfies it is accepted and one that breaks it is rejected
(tests/test_constrained.py keeps these checks). The grammar is never looser than the
schema, and in places stricter: properties come in the order of ``properties``, integers
have no fraction or exponent (1.0 and 1e2 are refused), bounded numbers have no exponent,
a length-bounded string refuses \\uXXXX escapes. A pattern matches anywhere in the string,
as in JSON Schema, but in Rust regex syntax (look-around, back-references: a 400).

What llguidance does NOT enforce (it refuses the schema): not, if/then/else,
dependentSchemas, dependentRequired, propertyNames, contains, unevaluatedProperties,
unevaluatedItems, uniqueItems, unknown formats; oneOf unless its branches are disjoint; and it
silently ignores contentEncoding and OpenAPI's nullable. It does enforce multipleOf, allOf,
patternProperties, min/maxProperties (in part) and some formats (date, email, ...
checked), but these are outside localm's documented subset and are treated as
unsupported here, so the subset stays one short, predictable list.

Outside the subset: a keyword that only narrows values (multipleOf, format, uniqueItems,
minProperties, ..., and unknown keywords) is refused under strict: true and dropped
otherwise (:attr:`Format.dropped`, debug log). A keyword that gives the schema its shape
(allOf, oneOf, not, if/then/else, dependentSchemas, patternProperties, propertyNames,
contains, unevaluated*, additionalItems, dependencies, $dynamicRef, $recursiveRef, a
nested $id, a $ref that is remote or points nowhere) is never dropped: a 400 in either
mode. Limits: the schema's compact JSON at most 64 KiB, subschemas nested at most 32 deep,
at most 256 properties in one object.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import urllib.parse
from typing import Any

import attrs
from localm import sdk
from localm.sdk.chat import MAX_GRAMMAR_BYTES, MAX_TOOLS, Origins

#: The OpenAI routes' names: every place as OpenAI spells it.
OPENAI = Origins()

log = logging.getLogger("localm.plugin.chat")

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"

#: llguidance's JSON options: one compact layout.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                                "coerce_one_of": False, "lenient": False}

MAX_SCHEMA_BYTES = 64 * 1024
MAX_DEPTH = 32
MAX_PROPERTIES = 256
# MAX_TOOLS and MAX_GRAMMAR_BYTES are the SDK's (localm.sdk.chat), so the OpenAI schema states them too
#: a tool list whose grammar is larger than this takes any JSON object as arguments
MAX_TOOLS_GRAMMAR_BYTES = 1024 * 1024
ANY_OBJECT: dict[str, Any] = {"type": "object"}

SUPPORTED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
    "pattern", "anyOf", "$ref", "$defs", "definitions",
})
IGNORED = frozenset({"title", "description", "default", "examples", "$comment", "$schema", "readOnly", "writeOnly",
                     "deprecated", "$anchor"})
SHAPE = frozenset({
    "allOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "dependencies", "patternProperties",
    "propertyNames", "contains", "unevaluatedItems", "unevaluatedProperties", "additionalItems", "$dynamicRef",
    "$recursiveRef", "$id",
})
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties")
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
#: a block: from the last TOOL_OPEN before a TOOL_CLOSE to it
_BLOCK = re.compile(re.escape(TOOL_OPEN) + r"((?:(?!" + re.escape(TOOL_OPEN) + r").)*?)" + re.escape(TOOL_CLOSE),
                    re.DOTALL)


# ---------------------------------------------------------------------------- schemas

class _Refused(Exception):
    """A schema that cannot be enforced (or is malformed: code invalid_schema), with the
    keywords to blame when there are."""

    def __init__(self, detail: str, entries: list[dict[str, str]] | None = None,
                 code: str = "response_format_unsupported") -> None:
        super().__init__(detail)
        self.detail = detail
        self.entries = entries
        self.code = code


def _pointer(parts: tuple[str, ...]) -> str:
    """RFC 6901: "" for the root."""
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def _where(pointer: str) -> str:
    return pointer if pointer else "the root"


def _listing(found: list[tuple[str, str]], why: dict[tuple[str, str], str] | None = None) -> str:
    return ", ".join(f"{k} at {_where(p)}" + (f" ({why[(k, p)]})" if why and (k, p) in why else "")
                     for k, p in found)


def _json_depth(value: Any, limit: int) -> bool:
    """Whether ``value``'s containers nest deeper than ``limit`` (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            items = v.values()
        elif isinstance(v, list):
            items = v
        else:
            continue
        if d > limit:
            return True
        stack.extend((x, d + 1) for x in items)
    return False


@attrs.define
class _Walk:
    shape: list[tuple[str, str]] = attrs.Factory(list)  # (keyword, pointer): never dropped
    unenforced: list[tuple[str, str]] = attrs.Factory(list)  # droppable
    refs: list[tuple[str, tuple[str, ...]]] = attrs.Factory(list)  # ($ref value, where)
    seen: set[tuple[str, ...]] = attrs.Factory(set)  # every schema position walked


def _walk(node: Any, at: tuple[str, ...], depth: int, w: _Walk) -> Any:
    """A copy of ``node`` (a subschema) holding only the enforced subset, the findings in ``w``."""
    w.seen.add(at)
    if isinstance(node, bool):
        return node
    if depth > MAX_DEPTH:
        raise _Refused(f"The schema nests subschemas more than {MAX_DEPTH} deep (at {_where(_pointer(at))})")
    out: dict[str, Any] = {}
    for key, value in node.items():
        here = at + (key,)
        if key in _SCHEMA_MAPS:
            if key == "properties" and len(value) > MAX_PROPERTIES:
                raise _Refused(f"An object has {len(value)} properties, more than {MAX_PROPERTIES} "
                               f"(at {_where(_pointer(at))})")
            out[key] = {name: _walk(sub, here + (name,), depth + 1, w) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS:
            out[key] = [_walk(sub, here + (str(i),), depth + 1, w) for i, sub in enumerate(value)]
        elif key in _SCHEMA_ONE:
            out[key] = _walk(value, here, depth + 1, w)
        elif key == "$ref":
            w.refs.append((value, at))
            out[key] = value
        elif key in SUPPORTED:
            out[key] = value
        elif key in IGNORED or (key == "$id" and not at):
            continue
        elif key in SHAPE:
            w.shape.append((key, _pointer(at)))
        else:
            w.unenforced.append((key, _pointer(at)))
    return out


def _ref_target(ref: str) -> tuple[str, ...] | None:
    """The schema position a local $ref names ("#", "#/a/b"), or None for any other reference."""
    if not ref.startswith("#"):
        return None
    fragment = urllib.parse.unquote(ref[1:])
    if fragment == "":
        return ()
    if not fragment.startswith("/"):
        return None  # "#anchor"
    return tuple(p.replace("~1", "/").replace("~0", "~") for p in fragment[1:].split("/"))


def _clean(schema: Any, *, strict: bool) -> tuple[dict[str, Any], tuple[tuple[str, str], ...]]:
    """The enforced copy of ``schema`` and what was dropped; raises :class:`_Refused`."""
    import jsonschema

    if not isinstance(schema, dict):
        raise _Refused("The schema must be a JSON object", code="invalid_schema")
    if _json_depth(schema, 4 * MAX_DEPTH):  # before anything recursive looks at it
        raise _Refused(f"The schema nests more than {4 * MAX_DEPTH} levels of JSON "
                       f"(subschemas may nest {MAX_DEPTH} deep)")
    try:
        size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
    except (ValueError, RecursionError) as exc:
        raise _Refused(f"The schema cannot be read: {exc}") from exc
    if size > MAX_SCHEMA_BYTES:
        raise _Refused(f"The schema is {size} bytes, more than {MAX_SCHEMA_BYTES}")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = _pointer(tuple(str(p) for p in exc.absolute_path))
        raise _Refused(f"The schema is not valid JSON Schema (draft 2020-12): {_short(exc.message)} "
                       f"at {_where(where)}", code="invalid_schema") from exc
    w = _Walk()
    cleaned = _walk(schema, (), 0, w)
    why: dict[tuple[str, str], str] = {}
    for ref, at in w.refs:
        target = _ref_target(ref)
        if target is not None and target in w.seen:
            continue
        found = ("$ref", _pointer(at))
        w.shape.append(found)
        why[found] = (f"{_short(ref, 80)} is outside this schema" if target is None
                      else f"{_short(ref, 80)} names no subschema of this schema")
    refused = w.shape + (w.unenforced if strict else [])
    if refused:
        entries = [{"keyword": k, "pointer": p} for k, p in refused]
        if w.shape:
            lead = ("The schema uses keywords that give it its shape and cannot be compiled "
                    "(never left out, whatever strict says)")
            if strict and w.unenforced:
                lead += " and keywords that cannot be enforced (strict: true)"
        else:
            lead = "The schema uses keywords that cannot be enforced (strict: true; strict: false leaves them out)"
        raise _Refused(f"{lead}: {_listing(refused, why)}", entries)
    return cleaned, tuple(w.unenforced)


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _compile_error(schema: dict[str, Any]) -> tuple[str, str]:
    """(grammar, llguidance's error or "") for a cleaned schema."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    return grammar, LLMatcher.validate_grammar(grammar)


# ---------------------------------------------------------------------------- response_format

@attrs.frozen
class Format:
    """A response_format to enforce."""

    grammar: str  # llguidance grammar
    label: str  # X-Localm-Constrained: json_object or json_schema;name="..."
    schema: dict[str, Any] | None  # the schema enforced (after strict: false drops); None for json_object
    dropped: tuple[tuple[str, str], ...] = ()  # (keyword, JSON pointer) left out under strict: false


def _bad_format(origins: Origins, detail: str, *path: str | int) -> sdk.LocalmError:
    """A malformed response_format: ``detail`` follows the client's name for ``path`` under it."""
    return sdk.LocalmError(400, origins.name("response_format", *path) + detail, code="invalid_response_format",
                           param=origins.name("response_format"))


def _sf_string(text: str) -> str:
    """An RFC 8941 sf-string (the text is printable ASCII)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def read_response_format(value: Any, origins: Origins = OPENAI) -> Format | None:
    """The response_format field, read and compiled; None for no constraint.

    None for an absent/null value or {"type": "text"}. json_object: any JSON object.
    json_schema: ``json_schema.schema`` (any JSON object without it), ``name`` (optional,
    printable ASCII, at most 64 characters), ``strict`` (default false). A malformed value is
    a 400 ``invalid_response_format``; a schema that cannot be enforced a 400
    ``response_format_unsupported`` with ``unsupported: [{"keyword", "pointer"}]`` when
    keywords are the cause (see the module docstring for the rules). Places are named as
    ``origins`` says the client calls them.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad_format(origins, " must be an object such as {\"type\": \"json_object\"}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        grammar, error = _compile_error(ANY_OBJECT)
        assert not error, error
        return Format(grammar=grammar, label="json_object", schema=None)
    if kind != "json_schema":
        raise _bad_format(origins, f" must be text, json_object or json_schema, got {kind!r}", "type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad_format(origins, " must be an object with name and schema", "json_schema")
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and 1 <= len(name) <= 64
                                 and all(" " <= c <= "~" for c in name)):
        raise _bad_format(origins, " must be 1 to 64 printable ASCII characters", "json_schema", "name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad_format(origins, " must be true or false", "json_schema", "strict")
    schema = spec.get("schema")
    if schema is None:
        schema = dict(ANY_OBJECT)
    label = "json_schema" if name is None else f"json_schema;name={_sf_string(name)}"
    where = origins.name("response_format", "json_schema", "schema")
    try:
        cleaned, dropped = _clean(schema, strict=bool(strict))
    except _Refused as exc:
        if exc.code == "invalid_schema":
            raise _bad_format(origins, f": {exc.detail}", "json_schema", "schema") from None
        extra = {"unsupported": exc.entries} if exc.entries is not None else {}
        raise sdk.LocalmError(400, f"{where}: {exc.detail}", code="response_format_unsupported",
                              param=origins.name("response_format"), **extra) from None
    grammar, error = _compile_error(cleaned)
    if error:
        raise sdk.LocalmError(400, f"{where} cannot be compiled: {_short(error, 600)}",
                              code="response_format_unsupported", param=origins.name("response_format"))
    if dropped:
        log.debug("response_format %s: left out (strict: false): %s", name or "", _listing(list(dropped)))
    return Format(grammar=grammar, label=label, schema=cleaned, dropped=dropped)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def validate_output(text: str, fmt: Format) -> None:
    """Check a document the model ended itself; a 500 ``constrained_output_invalid`` if it
    does not parse (an object for json_object) or does not validate against ``fmt.schema``
    (Draft 2020-12, formats not checked), naming the first problem and where it is."""
    import jsonschema

    try:
        doc = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise sdk.LocalmError(500, f"The constrained output is not JSON: {_short(str(exc))}",
                              code="constrained_output_invalid") from None
    if fmt.schema is None:
        if not isinstance(doc, dict):
            raise sdk.LocalmError(500, f"The constrained output is JSON but not an object ({type(doc).__name__})",
                                  code="constrained_output_invalid")
        return
    validator = jsonschema.Draft202012Validator(fmt.schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        where = _pointer(tuple(str(p) for p in error.absolute_path))
        raise sdk.LocalmError(500, f"The constrained output does not match the schema: {_short(error.message)} "
                                   f"at {_where(where)}", code="constrained_output_invalid")


# ---------------------------------------------------------------------------- tools

@attrs.frozen
class Tool:
    """One offered function."""

    name: str
    description: str
    parameters: dict[str, Any]  # the schema as sent (for the system prompt)
    arguments_grammar_schema: dict[str, Any] | None  # enforced for arguments; None: any JSON object


@attrs.frozen
class Tools:
    """The request's tools and how they may be called."""

    tools: tuple[Tool, ...]
    choice: str  # auto | none | required | named
    named: str | None  # the function when choice == "named"
    parallel: bool  # parallel_tool_calls

    def offered(self) -> tuple[Tool, ...]:
        """The functions a call may name: only the named one under a named choice."""
        if self.choice == "named":
            return tuple(t for t in self.tools if t.name == self.named)
        return self.tools


def _bad_tools(detail: str, param: str) -> sdk.LocalmError:
    return sdk.LocalmError(400, detail, code="invalid_tools", param=param)


def _bad_tool(origins: Origins, detail: str, *path: str | int) -> sdk.LocalmError:
    """A malformed tool: ``detail`` follows the client's name for ``path``, the place at fault."""
    where = origins.name(*path)
    return _bad_tools(where + detail, where)


def _arguments_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any] | None:
    """The arguments' enforced schema under the tool rules (unenforceable keywords left out),
    forced to an object; None when it cannot be compiled (any JSON object then). Logged."""
    try:
        cleaned, dropped = _clean(parameters, strict=False)
    except _Refused as exc:
        log.debug("tool %s: its parameters cannot be compiled (any JSON object instead): %s", name, exc.detail)
        return None
    if dropped:
        log.debug("tool %s: left out of its parameters: %s", name, _listing(list(dropped)))
    kind = cleaned.get("type")
    if kind is None or (isinstance(kind, list) and "object" in kind):
        cleaned["type"] = "object"
    _, error = _compile_error(cleaned)
    if error:
        log.debug("tool %s: its parameters cannot be compiled (any JSON object instead): %s", name, error)
        return None
    return cleaned


def read_tools(body: dict[str, Any], origins: Origins = OPENAI) -> Tools | None:
    """tools, tool_choice and parallel_tool_calls; None when no tools are sent.

    Without tools, tool_choice may only be absent, "none" or "auto". Each malformed case is a
    400 ``invalid_tools`` naming its place as the client calls it (``tools[2].function.name``
    on the OpenAI routes), in the detail and in ``param``. A function's
    ``strict`` is accepted; its parameters follow the tool rules either way (unenforceable
    keywords left out, a schema that cannot compile takes any JSON object).
    """
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad_tool(origins, " must be true or false", "parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise _bad_tool(origins, f" needs {origins.name('tools')}", "tool_choice")
        return None
    if not isinstance(raw, list):
        raise _bad_tool(origins, " must be a list of function tools", "tools")
    if len(raw) > MAX_TOOLS:
        raise _bad_tool(origins, f" holds {len(raw)} tools, more than {MAX_TOOLS}", "tools")
    tools: list[Tool] = []
    where_named: dict[str, int] = {}
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise _bad_tool(origins, " must be an object", "tools", i)
        if item.get("type") != "function":
            raise _bad_tool(origins, f" must be \"function\" (only function tools are served), "
                                     f"got {item.get('type')!r}", "tools", i, "type")
        fn = item.get("function")
        if not isinstance(fn, dict):
            raise _bad_tool(origins, " must be an object", "tools", i, "function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad_tool(origins, f" must be 1 to 64 letters, digits, _ or -, got {name!r}",
                            "tools", i, "function", "name")
        if name in where_named:
            raise _bad_tool(origins, f": {name!r} is already {origins.name('tools', where_named[name])}",
                            "tools", i, "function", "name")
        where_named[name] = i
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad_tool(origins, " must be a string", "tools", i, "function", "description")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad_tool(origins, " must be true or false", "tools", i, "function", "strict")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise _bad_tool(origins, " must be a JSON schema object", "tools", i, "function", "parameters")
        _check_parameters(parameters, origins.name("tools", i, "function", "parameters"))
        tools.append(Tool(name=name, description=description or "", parameters=parameters,
                          arguments_grammar_schema=_arguments_schema(name, parameters)))
    named = None
    if choice is None or choice == "auto":
        kind = "auto"
    elif choice in ("none", "required"):
        kind = choice
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad_tool(origins, _CHOICES, "tool_choice")
        named = fn["name"]
        if named not in where_named:
            raise _bad_tools(f"{origins.name('tool_choice', 'function', 'name')}: {named!r} is not one of the "
                             f"tools", origins.name("tool_choice"))
        kind = "named"
    else:
        raise _bad_tool(origins, _CHOICES, "tool_choice")
    return Tools(tools=tuple(tools), choice=kind, named=named, parallel=True if parallel is None else parallel)


#: What tool_choice may be.
_CHOICES = ' must be "auto", "none", "required" or {"type": "function", "function": {"name": "..."}}'


def _check_parameters(parameters: dict[str, Any], at: str) -> None:
    """A 400 for parameters (the client's ``at``) that are no JSON schema, or one that cannot
    describe an object."""
    import jsonschema

    if _json_depth(parameters, 4 * MAX_DEPTH):
        raise _bad_tools(f"{at} nests deeper than {4 * MAX_DEPTH} levels", at)
    try:
        jsonschema.Draft202012Validator.check_schema(parameters)
    except jsonschema.SchemaError as exc:
        where = _pointer(tuple(str(p) for p in exc.absolute_path))
        raise _bad_tools(f"{at} is not valid JSON Schema (draft 2020-12): {_short(exc.message)} "
                         f"at {_where(where)}", at) from None
    except RecursionError:
        raise _bad_tools(f"{at} nests too deep", at) from None
    kind = parameters.get("type")
    if kind is not None and kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise _bad_tools(f"{at} must describe an object (type \"object\"), got type {kind!r}", at)


# ---------------------------------------------------------------------------- tool prompt

def _example(schema: Any, root: Any, depth: int = 0) -> Any:
    """A short value following ``schema``, for the prompt's example call."""
    if not isinstance(schema, dict) or depth > 4:
        return {} if depth == 0 else "..."
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target: Any = root
        for part in _ref_target(ref) or ():
            target = target.get(part) if isinstance(target, dict) else None
        if isinstance(target, dict) and target is not schema:
            return _example(target, root, depth + 1)
    if isinstance(schema.get("anyOf"), list) and schema["anyOf"]:
        return _example(schema["anyOf"][0], root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "string"
    if kind == "object":
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        names = [n for n in schema.get("required", []) if n in props] or list(props)[:2]
        return {n: _example(props[n], root, depth + 1) for n in names}
    if kind == "array":
        return [_example(schema["items"], root, depth + 1)] if isinstance(schema.get("items"), dict) else []
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        value = low + (1 if "minimum" not in schema else 0) if isinstance(low, (int, float)) else 1
        return int(value) if kind == "integer" and value == int(value) else value
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return "..."


def tools_prompt(tools: Tools) -> str:
    """The system-prompt text that describes the functions and how to call them ("" for
    tool_choice none, whose functions are not shown)."""
    if tools.choice == "none":
        return ""
    lines = ["You can call functions. Each is described by one line of JSON:"]
    for t in tools.tools:
        entry: dict[str, Any] = {"name": t.name}
        if t.description:
            entry["description"] = t.description
        entry["parameters"] = t.parameters
        lines.append(json.dumps(entry, ensure_ascii=False))
    first = next(iter(tools.offered()))
    example = {"name": first.name, "arguments": _example(first.parameters, first.parameters)}
    lines += ["", "To call a function, write a block like this one, with the function's name and your arguments:",
              TOOL_OPEN, json.dumps(example, ensure_ascii=False), TOOL_CLOSE]
    if tools.parallel:
        lines.append("Write one such block for each call, one call per block. After your calls, stop: "
                     "the results will come back to you.")
    else:
        lines.append("Make at most one call. After it, stop: the result will come back to you.")
    if tools.choice == "required":
        lines.append("You must call a function now.")
    elif tools.choice == "named":
        lines.append(f"You must call the function {tools.named} now.")
    else:
        lines.append("Call a function only when it helps; otherwise answer in plain text.")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- tool grammars

def _retarget(schema: Any, prefix: str) -> Any:
    """``schema`` (cleaned) with every local $ref moved under ``prefix`` (a JSON pointer),
    for embedding it in a larger document."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS:
            out[key] = {n: _retarget(v, prefix) for n, v in value.items()}
        elif key in _SCHEMA_LISTS:
            out[key] = [_retarget(v, prefix) for v in value]
        elif key in _SCHEMA_ONE:
            out[key] = _retarget(value, prefix)
        elif key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + prefix + value[1:]
        else:
            out[key] = value
    return out


def _call_json(name: str, arguments: dict[str, Any] | None) -> str:
    """One call object, {"name": ..., "arguments": ...}, as an inline %json schema."""
    args = _retarget(arguments if arguments is not None else ANY_OBJECT, "/properties/arguments")
    return json.dumps({
        "x-guidance": JSON_OPTIONS, "type": "object",
        "properties": {"name": {"const": name}, "arguments": args},
        "required": ["name", "arguments"], "additionalProperties": False,
    }, ensure_ascii=False)


def _lark(tools: Tools, start: str, any_object: bool, doc: dict[str, Any] | None = None) -> str:
    offered = tools.offered()
    rules = [f"start: {start}",
             f'call: "{_lark_str(TOOL_OPEN)}\\n" fn "\\n{_lark_str(TOOL_CLOSE)}"',
             "fn: " + " | ".join(f"f{i}" for i in range(len(offered)))]
    rules += [f"f{i}: %json {_call_json(t.name, None if any_object else t.arguments_grammar_schema)}"
              for i, t in enumerate(offered)]
    if doc is not None:
        rules.append(f"doc: %json {json.dumps({**doc, 'x-guidance': JSON_OPTIONS}, ensure_ascii=False)}")
    return "\n".join(rules) + "\n"


def _lark_str(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _tools_grammar(tools: Tools, start: str, doc: dict[str, Any] | None = None) -> str:
    """The grammar over the offered functions, each with its own arguments; when llguidance
    refuses that (or it is too large), every function takes any JSON object (logged)."""
    from llguidance import LLMatcher

    lark = _lark(tools, start, any_object=False, doc=doc)
    error = "" if len(lark.encode()) <= MAX_TOOLS_GRAMMAR_BYTES else f"{len(lark.encode())} bytes"
    grammar = LLMatcher.grammar_from_lark(lark)
    error = error or LLMatcher.validate_grammar(grammar)
    if not error:
        return grammar
    log.debug("The tool list is too large for one grammar (%s): every function takes any JSON object", error)
    grammar = LLMatcher.grammar_from_lark(_lark(tools, start, any_object=True, doc=doc))
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise sdk.LocalmError(400, f"The tools cannot be compiled to a grammar: {_short(error, 600)}",
                              code="invalid_tools", param="tools")
    return grammar


def tools_grammar(tools: Tools) -> tuple[str, str | None]:
    """(llguidance grammar, lazy trigger or None) for a reply under ``tools``.

    required / named: not lazy; the whole reply is calls separated by "\\n" (exactly one when
    parallel_tool_calls is false), each ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
    with the arguments of the function it names (only the named one under a named choice).
    auto: lazy, trigger ``<tool_call>``; the grammar covers what follows the trigger:
    "\\n", one call object, "\\n</tool_call>" (the engine frees the reply again after it).
    tool_choice none has no grammar: a ValueError.
    """
    if tools.choice == "none":
        raise ValueError("tool_choice none has no grammar")
    if tools.choice == "auto":
        return _tools_grammar(tools, f'"\\n" fn "\\n{_lark_str(TOOL_CLOSE)}"'), TOOL_OPEN
    return _tools_grammar(tools, 'call ("\\n" call)*' if tools.parallel else "call"), None


def format_or_calls_grammar(fmt: Format, tools: Tools) -> str:
    """A grammar (not lazy) for tool_choice auto with a response_format: the whole reply is
    either the formatted JSON or calls as under tools_grammar's required."""
    doc = fmt.schema if fmt.schema is not None else ANY_OBJECT
    calls = 'call ("\\n" call)*' if tools.parallel else "call"
    return _tools_grammar(tools, f"doc | {calls}", doc=doc)


# ---------------------------------------------------------------------------- reading calls

def _call(body: str, names: set[str]) -> dict[str, Any] | None:
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return {"id": "call_" + secrets.token_hex(12), "type": "function",
            "function": {"name": obj["name"],
                         "arguments": json.dumps(args, separators=(",", ":"), ensure_ascii=False)}}


def parse_calls(text: str, tools: Tools) -> tuple[str, list[dict[str, Any]]]:
    """Split a finished reply into (visible text, calls).

    Each ``<tool_call>...</tool_call>`` block holding {"name": <an offered function>,
    "arguments": {...}} becomes an OpenAI call with a fresh id and compact arguments; any
    other block stays in the text as written. Without parallel calls only the first call is
    kept (later ones are removed). Whitespace around a removed block is tidied. Under
    tool_choice none nothing is read.
    """
    if tools.choice == "none" or TOOL_OPEN not in text:
        return text, []
    names = {t.name for t in tools.offered()}
    calls: list[dict[str, Any]] = []
    pieces: list[str] = []
    at = 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1), names)
        if call is None:
            continue
        if tools.parallel or not calls:
            calls.append(call)
        else:
            log.debug("parallel_tool_calls is false: a further call to %s is dropped", call["function"]["name"])
        pieces.append(text[at:m.start()])
        at = m.end()
    if not pieces:
        return text, []
    pieces.append(text[at:])
    out = pieces[0].rstrip()
    last = len(pieces) - 1
    for i in range(1, len(pieces)):
        piece = pieces[i].strip() if i < last else pieces[i].lstrip()
        if piece:
            out = f"{out}\n{piece}" if out else piece
    return out, calls


# ---------------------------------------------------------------------------- GBNF

def _bad_grammar(detail: str, param: str) -> sdk.LocalmError:
    return sdk.LocalmError(400, detail, code="invalid_grammar", param=param)


def _trigger(item: Any, at: str, param: str) -> str:
    """One grammar_triggers entry's word: a string, {"type": "word" (or llama.cpp's 1),
    "value": ...}, or llama.cpp's older {"word": ...}."""
    if isinstance(item, str):
        word = item
    elif isinstance(item, dict):
        kind = item.get("type", "word")
        if kind != "word" and not (type(kind) is int and kind == 1):
            raise _bad_grammar(f"{at}: only word triggers are supported (type \"word\"), got type {kind!r}", param)
        if item.get("at_start"):
            raise _bad_grammar(f"{at}: at_start is not supported", param)
        word = item.get("value", item.get("word"))
    else:
        raise _bad_grammar(f"{at} must be a string or {{\"type\": \"word\", \"value\": \"...\"}}", param)
    if not isinstance(word, str) or not word:
        raise _bad_grammar(f"{at}: the trigger word must be a non-empty string", param)
    return word


def read_grammar(body: dict[str, Any], origins: Origins = OPENAI) -> tuple[str, str | None] | None:
    """grammar (GBNF, as llama.cpp takes it; a Lark grammar for llguidance is accepted too),
    grammar_lazy (default false) and grammar_triggers: (llguidance grammar, trigger or None),
    or None without a grammar (an empty one included).

    A lazy grammar needs exactly one trigger: the engine waits for one word, so several are a
    400. Triggers are words: a string, {"type": "word", "value": ...} ({"type": 1, ...} as
    llama.cpp numbers it, and its older {"word": ...}); token and pattern triggers are a 400.
    The grammar then describes the text that FOLLOWS the trigger (the trigger is not part of
    it, unlike in llama.cpp, whose lazy grammar matches from the trigger on). Triggers
    without grammar_lazy: true are a 400. A grammar that does not convert or compile is a 400
    ``invalid_grammar`` with the converter's message. Combinations with response_format or
    tools are the caller's to refuse. Fields are named as ``origins`` says the client calls them.
    """
    from llguidance import LLMatcher, gbnf_to_lark

    text = body.get("grammar")
    lazy = body.get("grammar_lazy")
    triggers = body.get("grammar_triggers")
    named, lazy_named, triggers_named = (origins.name(key) for key in ("grammar", "grammar_lazy", "grammar_triggers"))
    if lazy is not None and not isinstance(lazy, bool):
        raise _bad_grammar(f"{lazy_named} must be true or false", lazy_named)
    if triggers is not None and not isinstance(triggers, list):
        raise _bad_grammar(f"{triggers_named} must be a list", triggers_named)
    if text is not None and not isinstance(text, str):
        raise _bad_grammar(f"{named} must be a string (GBNF)", named)
    if not text:
        if lazy or triggers:
            raise _bad_grammar(f"{lazy_named} and {triggers_named} need a grammar",
                               lazy_named if lazy else triggers_named)
        return None
    words = [_trigger(t, origins.name("grammar_triggers", i), triggers_named) for i, t in enumerate(triggers or [])]
    if lazy:
        if not words:
            raise _bad_grammar(f"{lazy_named}: true needs one trigger in {triggers_named}", triggers_named)
        if len(words) > 1:
            raise _bad_grammar(f"{triggers_named} holds {len(words)} triggers; a lazy grammar takes exactly one",
                               triggers_named)
    elif words:
        raise _bad_grammar(f"{triggers_named} needs {lazy_named}: true", triggers_named)
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise _bad_grammar(f"{named} is larger than {MAX_GRAMMAR_BYTES} bytes", named)
    try:
        if "::=" in text or not gbnf_to_lark.is_lark_syntax(text):
            lark = gbnf_to_lark.gbnf_to_lark(text)
        else:
            lark = text
    except Exception as exc:  # the converter raises plain Exceptions too
        raise _bad_grammar(f"The grammar is not valid GBNF: {_short(str(exc), 600)}", named) from None
    grammar = LLMatcher.grammar_from_lark(lark)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise _bad_grammar(f"The grammar does not compile: {_short(error, 600)}", named)
    return grammar, (words[0] if lazy else None)
