"""The types a plugin setting may have (docs/plugins.md, "Setting types"): each is checked
strictly when a value is set, and a type no setting can have is refused when declared."""

from __future__ import annotations

import typing

import attrs
import pytest

from localm.kernel.errors import LocalmError
from localm.kernel.settings import fields_of
from localm.sdk import setting


@attrs.frozen
class Every:
    name: str = setting("x")
    count: int = setting(1)
    ratio: float = setting(0.5)
    on: bool = setting(True)
    mode: typing.Literal["fast", "exact"] = setting("fast")
    words: list[str] = setting(factory=list)
    limits: dict[str, int] = setting(factory=dict)
    extra: dict = setting(factory=dict)
    note: str | None = setting(None)


SPECS = {spec.key: spec for spec in fields_of(Every)}


@pytest.mark.parametrize("key, good, bad", [
    ("name", "y", 1),
    ("count", 3, "3"),
    ("count", 3.0, 3.5),
    ("ratio", 1, True),
    ("on", False, 1),
    ("mode", "exact", "slow"),
    ("words", ["a", "b"], "ab"),
    ("words", [], [1]),
    ("limits", {"a": 1}, {"a": "1"}),
    ("extra", {"a": [1, "x"]}, ["a"]),
    ("note", None, 0),
])
def test_each_type_takes_its_values_and_refuses_others(key: str, good: object, bad: object) -> None:
    spec = SPECS[key]
    assert spec.check(good) == good
    with pytest.raises(LocalmError) as caught:
        spec.check(bad)
    assert caught.value.status == 400 and caught.value.detail.startswith(f"Invalid value for {key}: expected ")


def test_the_schema_names_each_type() -> None:
    types = {key: spec.schema()["type"] for key, spec in SPECS.items()}
    assert types == {"name": "string", "count": "integer", "ratio": "number", "on": "boolean", "mode": "string",
                     "words": "array of string", "limits": "object of integer", "extra": "object",
                     "note": "string or null"}
    assert SPECS["mode"].schema()["choices"] == ["fast", "exact"]


@pytest.mark.parametrize("annotation", [tuple[str, ...], set[str], dict[int, str], bytes, "str | int"])
def test_a_type_no_setting_can_have_is_refused_when_declared(annotation: object) -> None:
    Bad = attrs.make_class("Bad", {"value": attrs.field(default=None, type=annotation)})
    with pytest.raises(TypeError, match="is not a setting type"):
        fields_of(Bad)


@pytest.mark.parametrize("key, bad, said", [
    ("mode", "slow", "expected one of 'fast', 'exact', got 'slow'"),
    ("words", ["a", 2], "expected array of string, got an array whose item 1 is an integer"),
    ("limits", {"a": 1, "b": "2"}, "expected object of integer, got an object whose 'b' is a string"),
    ("note", 3, "expected string or null, got an integer"),
])
def test_a_refusal_says_what_was_wrong(key: str, bad: object, said: str) -> None:
    with pytest.raises(LocalmError) as caught:
        SPECS[key].check(bad)
    assert caught.value.detail == f"Invalid value for {key}: {said}"
