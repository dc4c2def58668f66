"""The spec_source request field and usage.speculation on every surface that reports usage:
the field is checked (a value not among off, ngram, draft, mtp is a 400 naming it), and a
reply says what drafting did. A source the engine cannot draft with is reported
``unavailable`` with its reason (mtp: the model has no Multi-Token Prediction heads); with
no source on, OpenAI's usage.speculation is null and the other surfaces leave it out.
Real server, real SmolLM2 GGUF, the official openai and anthropic SDKs."""

from __future__ import annotations

from typing import Iterator

import anthropic
import openai
import pytest

from localm.sdk.testing import LocalmServer

pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(module_server) -> Iterator[LocalmServer]:
    yield module_server(plugins=["chat", "llamacpp", "openai", "anthropic", "responses"])


@pytest.fixture(scope="module")
def client(server: LocalmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)


def test_no_source_on_is_a_null_speculation(client: openai.OpenAI, server: LocalmServer) -> None:
    for extra in ({}, {"spec_source": "off"}):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
        assert reply.usage.model_extra["speculation"] is None
    message = anthropic.Anthropic(base_url=server.url, api_key="unused").messages.create(
        model=MODEL, max_tokens=4, messages=ASK)
    assert "speculation" not in (message.usage.model_extra or {})


def test_a_source_the_model_cannot_draft_with_is_reported_unavailable(client: openai.OpenAI,
                                                                      server: LocalmServer) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body={"spec_source": "mtp"})
    spec = reply.usage.model_extra["speculation"]
    assert spec["source"] == "mtp" and spec["state"] == "unavailable" and spec["reason"].startswith("no-mtp-heads")
    assert (spec["drafted"], spec["accepted"], spec["paused_steps"]) == (0, 0, 0)
    streamed = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"spec_source": "mtp"})
    last = [chunk for chunk in streamed][-1]
    assert last.usage.model_extra["speculation"] == spec
    text = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body={"spec_source": "mtp"})
    assert text.usage.model_extra["speculation"] == spec
    message = anthropic.Anthropic(base_url=server.url, api_key="unused").messages.create(
        model=MODEL, max_tokens=4, messages=ASK, extra_body={"spec_source": "mtp"})
    assert message.usage.model_extra["speculation"] == spec
    response = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=16,
                                       extra_body={"spec_source": "mtp"})
    assert response.usage.model_extra["speculation"] == spec


def test_an_unknown_source_is_refused_by_name(client: openai.OpenAI, server: LocalmServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body={"spec_source": "eagle"})
    assert "spec_source must be one of off, ngram, draft, mtp" in str(caught.value)
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic.Anthropic(base_url=server.url, api_key="unused").messages.create(
            model=MODEL, max_tokens=4, messages=ASK, extra_body={"spec_source": "eagle"})
    assert "spec_source" in str(refused.value)
    with pytest.raises(openai.BadRequestError) as again:
        client.responses.create(model=MODEL, input="Hi", extra_body={"spec_source": "eagle"})
    assert "spec_source" in str(again.value)
