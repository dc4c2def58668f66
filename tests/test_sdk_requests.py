"""The SDK's request helpers every surface shares: ``sdk.json_body`` (a request's JSON body)
and ``sdk.report_ignored`` / ``sdk.strict_mode`` (the ignored-fields report and
X-Localm-Strict). The surfaces' own answers are tested with their routes; these pin the
helpers' options."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from localm import sdk


class FakeRequest:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def body(self) -> bytes:
        return self.raw


def read(raw: bytes, **options: Any) -> Any:
    return asyncio.run(sdk.json_body(FakeRequest(raw), **options))  # type: ignore[arg-type]


def refusal(raw: bytes, **options: Any) -> Any:
    with pytest.raises(Exception) as caught:
        read(raw, **options)
    return caught.value


def test_a_body_is_one_json_object_by_default() -> None:
    assert read(b'{"a": 1}') == {"a": 1}
    for raw, message in ((b"", "A JSON body is required"), (b" \n", "A JSON body is required"),
                         (b"{nope", "The body is not valid JSON"), (b"[1]", "The body must be a JSON object")):
        err = refusal(raw)
        assert isinstance(err, sdk.LocalmError) and (err.status, err.detail, err.code) == (400, message, None)


def test_options_give_an_empty_body_a_value_and_take_any_json_value() -> None:
    assert read(b"", empty={}) == {} and read(b"  ", empty=None) is None
    assert read(b"[1, 2]", require_object=False) == [1, 2]
    assert refusal(b"", missing="missing request body").detail == "missing request body"
    assert refusal(b"3", not_object="The body must be a JSON object of settings").detail.endswith("of settings")


def test_max_bytes_refuses_a_larger_body_before_parsing_it() -> None:
    err = refusal(b"x" * (2 * 1024 * 1024 + 1), max_bytes=2 * 1024 * 1024)
    assert (err.status, err.code, err.detail) == (413, "request_too_large", "The request is over 2 MB")
    assert refusal(b"[" * 11, max_bytes=10).detail == "The request is over 10 bytes"
    assert read(b"{}", max_bytes=2) == {}


def test_a_large_body_is_parsed_too() -> None:
    big = {"text": "x" * (1024 * 1024)}
    assert read(json.dumps(big).encode()) == big


def test_refuse_builds_each_refusal() -> None:
    seen: list[tuple[str, str]] = []

    def refuse(reason: str, message: str) -> Exception:
        seen.append((reason, message))
        return sdk.LocalmError(422, message)

    for raw, options in ((b"", {}), (b"{", {}), (b"1", {}), (b"{}", {"max_bytes": 1})):
        assert refusal(raw, refuse=refuse, **options).status == 422
    assert seen == [("missing", "A JSON body is required"), ("invalid", "The body is not valid JSON"),
                    ("not_object", "The body must be a JSON object"), ("too_large", "The request is over 1 bytes")]


def test_the_report_names_unused_fields_in_both_headers(caplog: pytest.LogCaptureFixture) -> None:
    assert sdk.report_ignored([], {}, "/x") == {}
    with caplog.at_level(logging.WARNING, logger="localm"):
        headers = sdk.report_ignored(["user", "messages[0].naïve"], {}, "/x")
    assert headers == {"X-Localm-Ignored-Fields": '"user", "messages[0].na%c3%afve"',
                       "X-miLLM-Ignored-Fields": '"user", "messages[0].na%c3%afve"'}
    assert "request_fields_unused on /x: user" in caplog.text
    many = [f"field_{i:03}" for i in range(200)]
    value = sdk.report_ignored(many, {}, "/x")["X-Localm-Ignored-Fields"]
    assert len(value) <= 1024 and value.startswith('"field_000", ') and value.endswith(' more"')
    kept = value.count('"field_')
    assert value.endswith(f'"+{200 - kept} more"')


def test_strict_mode_refuses_unused_fields_and_a_malformed_header() -> None:
    for value in ("true", "1", " TRUE "):
        with pytest.raises(sdk.LocalmError) as caught:
            sdk.report_ignored(["user"], {"x-localm-strict": value}, "/x")
        assert (caught.value.status, caught.value.code, caught.value.extra) == (
            400, "unused_fields_refused", {"fields": ["user"]})
    assert sdk.report_ignored(["user"], {"x-millm-strict": "0"}, "/x")
    assert sdk.strict_mode({"x-millm-strict": "true"}) and not sdk.strict_mode({})
    assert not sdk.strict_mode({"x-localm-strict": "false", "x-millm-strict": "true"})  # the first one sent decides
    for unused in ([], ["user"]):  # refused whether or not a field was ignored
        with pytest.raises(sdk.LocalmError) as caught:
            sdk.report_ignored(unused, {"x-localm-strict": "yes"}, "/x")
        assert (caught.value.status, caught.value.code, caught.value.detail) == (
            400, "invalid_header", "x-localm-strict must be true, 1, false or 0, got 'yes'")
