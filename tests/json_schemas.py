"""A corpus of JSON schemas for structured output, each small enough that a 135M model can
finish a document within its MAX_TOKENS (strings bounded by maxLength, arrays by maxItems).

SCHEMAS: (name, schema), every one inside localm's enforced subset (strict: true compiles it),
each finished by SmolLM2-135M-Instruct (greedy, a plain prompt) well within its MAX_TOKENS.
RECURSIVE: recursive schemas, enforced too, that a small model may not finish (see there).
MAX_TOKENS: a max_tokens that leaves room to finish each document.
EXAMPLES: for each name, (a valid document, an invalid one), written in the layout the grammar
enforces (", " between items, ": " after keys): the grammar accepts the first, and both the
grammar and the schema reject the second.
"""

from __future__ import annotations

from typing import Any

_point = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                           "y": {"type": "integer", "minimum": -100, "maximum": 100}},
          "required": ["x", "y"], "additionalProperties": False}


def _obj(properties: dict[str, Any], required: list[str] | None = None, **more: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False, **more}


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("sentiment_enum", _obj({"label": {"enum": ["positive", "negative", "neutral"]}})),
    ("judge_const", _obj({"version": {"const": "v1"}, "humor": {"type": "boolean"}})),
    ("person_nested", _obj({
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": _obj({"city": {"type": "string", "maxLength": 20},
                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    })),
    ("tags_array", _obj({"tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 12},
                                  "minItems": 1, "maxItems": 3}})),
    ("code_length", _obj({"code": {"type": "string", "minLength": 2, "maxLength": 4}})),
    ("date_pattern", {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}),
    ("score_integer", _obj({"score": {"type": "integer", "minimum": 1, "maximum": 10}})),
    ("temperature_number", _obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("percent_exclusive", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}),
    ("value_any_of", _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                               {"type": "string", "maxLength": 10}]}})),
    ("segment_defs", {"$defs": {"point": _point}, **_obj({"start": {"$ref": "#/$defs/point"},
                                                          "end": {"$ref": "#/$defs/point"}})}),
    ("color_definitions", {"definitions": {"color": {"enum": ["red", "green", "blue"]}},
                           **_obj({"fg": {"$ref": "#/definitions/color"}, "bg": {"$ref": "#/definitions/color"}})}),
    # depth bounded by the schema: sections hold items, items hold nothing
    ("menu_bounded_depth", {"$defs": {
        "item": _obj({"label": {"type": "string", "minLength": 1, "maxLength": 12}}),
        "section": _obj({"title": {"type": "string", "minLength": 1, "maxLength": 12},
                         "items": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/item"}}})},
        **_obj({"sections": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"$ref": "#/$defs/section"}}})}),
    ("counts_additional_schema", {"type": "object", "properties": {"total": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99}},
                                  "required": ["total"],
                                  "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}}),
    ("note_type_list", _obj({"note": {"type": ["string", "null"], "maxLength": 20}})),
    ("email_nullable", _obj({"email": {"anyOf": [{"type": "string", "maxLength": 30,
                                                  "pattern": "^[a-z0-9.]+@[a-z0-9.]+$"},
                                                 {"type": "null"}]}})),
    ("flags_boolean", _obj({"is_spam": {"type": "boolean"}, "is_urgent": {"type": "boolean"}})),
    ("required_subset", _obj({"title": {"type": "string", "maxLength": 16},
                              "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                              "done": {"type": "boolean"}}, required=["title"])),
    ("order_items", _obj({"items": {"type": "array", "maxItems": 3, "items": _obj({
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "qty": {"type": "integer", "minimum": 1, "maximum": 99}})}})),
    ("pair_prefix_items", {"type": "array", "prefixItems": [{"type": "string", "maxLength": 10},
                                                            {"type": "integer", "minimum": 0, "maximum": 100}],
                           "items": False, "minItems": 2}),
    ("color_enum_top", {"enum": ["red", "green", "blue"]}),
    ("yes_no_boolean", {"type": "boolean"}),
    ("mixed_enum", _obj({"answer": {"enum": ["yes", "no", None, 1]}})),
    ("empty_object", {"type": "object", "properties": {}, "additionalProperties": False}),
    ("probabilities_pair", {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1},
                            "minItems": 2, "maxItems": 2}),
    ("deep_nested", _obj({"a": _obj({"b": _obj({"c": {"type": "integer", "minimum": 0, "maximum": 9}})})})),
    ("annotated", {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "Review",
                   "description": "A short review", "$comment": "annotations are ignored",
                   **_obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5, "description": "1 to 5",
                                     "default": 3, "examples": [4]},
                           "summary": {"type": "string", "maxLength": 24, "title": "Summary"}})}),
    ("hex_color_pattern", _obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
]

#: Recursive schemas: llguidance compiles and enforces them, but their depth is bounded by
#: max_tokens only, and SmolLM2-135M nests greedily until it runs out (measured: 0 of 3 prompts
#: ended a required-null linked list within 256 tokens), so they are not in SCHEMAS: expect
#: finish_reason "length" as often as "stop" from a small model.
RECURSIVE: list[tuple[str, dict[str, Any]]] = [
    ("linked_list_recursive", {"$defs": {"node": _obj({
        "value": {"type": "integer", "minimum": 0, "maximum": 9},
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}})}, "$ref": "#/$defs/node"}),
    ("tree_recursive", {"$defs": {"node": _obj({
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}})}, "$ref": "#/$defs/node"}),
]

MAX_TOKENS: dict[str, int] = {name: 64 for name, _ in SCHEMAS + RECURSIVE}
MAX_TOKENS.update({
    "person_nested": 96, "tags_array": 96, "segment_defs": 96, "menu_bounded_depth": 160,
    "linked_list_recursive": 256, "tree_recursive": 256,
    "counts_additional_schema": 128, "order_items": 160, "deep_nested": 96, "annotated": 96,
    "email_nullable": 96, "required_subset": 96,
})

EXAMPLES: dict[str, tuple[str, str]] = {
    "sentiment_enum": ('{"label": "neutral"}', '{"label": "happy"}'),
    "judge_const": ('{"version": "v1", "humor": true}', '{"version": "v2", "humor": true}'),
    "person_nested": ('{"name": "Ada", "age": 36, "address": {"city": "London", "zip": "12345"}}',
                      '{"name": "Ada", "age": 36, "address": {"city": "London", "zip": "1234a"}}'),
    "tags_array": ('{"tags": ["a", "b"]}', '{"tags": []}'),
    "code_length": ('{"code": "abc"}', '{"code": "abcde"}'),
    "date_pattern": ('"2024-01-31"', '"31/01/2024"'),
    "score_integer": ('{"score": 10}', '{"score": 11}'),
    "temperature_number": ('{"celsius": -12.5}', '{"celsius": 60.5}'),
    "percent_exclusive": ("99", "100"),
    "value_any_of": ('{"value": "ten"}', '{"value": true}'),
    "segment_defs": ('{"start": {"x": 0, "y": -3}, "end": {"x": 5, "y": 100}}',
                     '{"start": {"x": 0, "y": -3}, "end": {"x": 5, "y": 101}}'),
    "color_definitions": ('{"fg": "red", "bg": "blue"}', '{"fg": "red", "bg": "black"}'),
    "menu_bounded_depth": ('{"sections": [{"title": "Drinks", "items": [{"label": "Tea"}]}]}',
                           '{"sections": [{"title": "Drinks", "items": [{"label": "Tea", "items": []}]}]}'),
    "linked_list_recursive": ('{"value": 1, "next": {"value": 2, "next": null}}',
                              '{"value": 1, "next": {"value": 12, "next": null}}'),
    "tree_recursive": ('{"name": "a", "children": [{"name": "b", "children": []}]}',
                       '{"name": "a", "children": [{"name": "b"}]}'),
    "counts_additional_schema": ('{"total": 3, "apples": 2, "pears": 1}', '{"total": 3, "apples": 12}'),
    "note_type_list": ('{"note": null}', '{"note": 5}'),
    "email_nullable": ('{"email": "a.b@example.org"}', '{"email": "not an email"}'),
    "flags_boolean": ('{"is_spam": false, "is_urgent": true}', '{"is_spam": false}'),
    "required_subset": ('{"title": "Buy milk"}', '{"priority": 2}'),
    "order_items": ('{"items": [{"name": "tea", "qty": 2}]}', '{"items": [{"name": "tea", "qty": 0}]}'),
    "pair_prefix_items": ('["apples", 3]', '["apples", 3, 4]'),
    "color_enum_top": ('"green"', '"purple"'),
    "yes_no_boolean": ("false", '"false"'),
    "mixed_enum": ('{"answer": null}', '{"answer": 2}'),
    "empty_object": ("{}", '{"a": 1}'),
    "probabilities_pair": ("[0.25, 0.75]", "[0.25, 1.5]"),
    "deep_nested": ('{"a": {"b": {"c": 7}}}', '{"a": {"b": {"c": "7"}}}'),
    "annotated": ('{"stars": 4, "summary": "Good tea"}', '{"stars": 6, "summary": "Good tea"}'),
    "hex_color_pattern": ('{"hex": "#a0b1c2"}', '{"hex": "#A0B1C2"}'),
}
