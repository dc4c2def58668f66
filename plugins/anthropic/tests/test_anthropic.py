"""The Anthropic Messages surface (the anthropic plugin) on the real SmolLM2 model, with the
official anthropic SDK against a keyed server: x-api-key auth, messages non-streamed and
streamed, stop sequences, a tool round trip, structured output, count_tokens and
Anthropic's error shapes. The stream renderer and the request reader are also checked on
their own, for what the tiny model cannot show (thinking blocks, an error mid-stream)."""

from __future__ import annotations

import asyncio
import json
import types
from typing import Any, Iterator

import httpx
import jsonschema
import pytest

from project_fixtures import offline_cli
from localm import sdk
from localm.sdk.testing import LocalmServer, plugin_module

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "Write one sentence about the sea."}]
# greedy, and computed afresh: a reply that reuses the KV cache can differ slightly
GREEDY = {"temperature": 0, "cache_prompt": False}
WEATHER = {"name": "get_weather", "description": "The weather now in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}
FORCED = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalmServer, str]]:
    data_dir = tmp_path_factory.mktemp("anthropic") / "data"
    owner = offline_cli(data_dir, "key", "generate").strip()
    s = LocalmServer(data_dir, plugins=["chat", "llamacpp", "anthropic"]).start()
    yield s, owner
    s.stop()


@pytest.fixture(scope="module")
def client(server: tuple[LocalmServer, str]) -> Any:
    s, owner = server
    return anthropic.Anthropic(base_url=s.url, api_key=owner, timeout=120, max_retries=0)  # sends x-api-key


@pytest.fixture(scope="module")
def greedy(client: Any) -> Any:
    return client.messages.create(model=MODEL, messages=QUESTION, max_tokens=16, extra_body=GREEDY)


def raw_events(server: tuple[LocalmServer, str], body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each server-sent event of a streamed /v1/messages request."""
    s, owner = server
    out: list[tuple[str, dict[str, Any]]] = []
    name = None
    with httpx.stream("POST", s.url + "/v1/messages", json={**body, "stream": True}, timeout=120,
                      headers={"x-api-key": owner, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                out.append((name, data))
    return out


def post(server: tuple[LocalmServer, str], path: str, headers: dict[str, str] | None = None,
         **kwargs: Any) -> httpx.Response:
    s, owner = server
    return httpx.post(s.url + path, headers={"x-api-key": owner, **(headers or {})}, timeout=120, **kwargs)


def is_error(r: httpx.Response, status: int, kind: str) -> str:
    """The message of an Anthropic-shaped error of that status and type."""
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


# --- messages --------------------------------------------------------------------------

def test_a_message(greedy: Any) -> None:
    r = greedy
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert [b.type for b in r.content] == ["text"] and r.content[0].text.strip()
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert r.usage.input_tokens > 10 and 0 < r.usage.output_tokens <= 16


def test_the_stream_in_anthropic_order_matches_the_message(server: Any, greedy: Any) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 16, **GREEDY}
    events = raw_events(server, body)
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["model"] == MODEL
    assert start["usage"] == {"input_tokens": 0, "output_tokens": 0}
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert all(d["delta"]["type"] == "text_delta" for n, d in events if n == "content_block_delta")
    assert text == greedy.content[0].text
    ending = events[-2][1]
    assert ending["delta"] == {"stop_reason": greedy.stop_reason, "stop_sequence": None}
    assert ending["usage"] == {"input_tokens": greedy.usage.input_tokens, "output_tokens": greedy.usage.output_tokens}


def test_the_sdk_stream_helper_and_max_tokens(client: Any) -> None:
    with client.messages.stream(model=MODEL, messages=QUESTION, max_tokens=3, extra_body={"temperature": 0}) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 3
    assert final.content[0].text == "".join(pieces) and final.usage.input_tokens > 10


def test_system_as_a_string_or_as_text_blocks(client: Any) -> None:
    def count(**kwargs: Any) -> int:
        return client.messages.count_tokens(model=MODEL, messages=QUESTION, **kwargs).input_tokens

    plain = count()
    as_string = count(system="Answer like a pirate.")
    as_blocks = count(system=[{"type": "text", "text": "Answer like a pirate."}])
    assert as_string == as_blocks != plain  # (SmolLM2's template has a default system prompt of its own)
    r = client.messages.create(model=MODEL, messages=QUESTION, max_tokens=2, system=[
        {"type": "text", "text": "Answer like a pirate.", "cache_control": {"type": "ephemeral"}}],
        metadata={"user_id": "someone"}, extra_body={"temperature": 0})
    assert r.usage.input_tokens == as_blocks


def test_a_stop_sequence(client: Any, greedy: Any) -> None:
    text = greedy.content[0].text
    words = text.split()
    stop = " " + words[len(words) // 2]
    r = client.messages.create(model=MODEL, messages=QUESTION, max_tokens=16, stop_sequences=[stop],
                               extra_body=GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[: text.index(stop)]


def test_a_tool_round_trip(client: Any, server: Any) -> None:
    r = client.messages.create(model=MODEL, messages=ASK_WEATHER, max_tokens=40, tools=[WEATHER],
                               tool_choice=FORCED, extra_body=GREEDY)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    use = r.content[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])

    # streamed, the same call comes whole in one input_json_delta
    events = raw_events(server, {"model": MODEL, "messages": ASK_WEATHER, "max_tokens": 40, "tools": [WEATHER],
                                 "tool_choice": FORCED, **GREEDY})
    names = [n for n, _ in events]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    block = events[2][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    assert events[3][1]["delta"]["type"] == "input_json_delta"
    assert json.loads(events[3][1]["delta"]["partial_json"]) == use.input
    assert events[5][1]["delta"]["stop_reason"] == "tool_use"

    history = [*ASK_WEATHER, {"role": "assistant", "content": r.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "Sunny, 24 degrees."}]}]
    answer = client.messages.create(model=MODEL, messages=history, max_tokens=6, tools=[WEATHER],
                                    extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text.strip()
    failed = [*history[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                          "content": "Sunny, 24 degrees.", "is_error": True}]}]
    assert (client.messages.count_tokens(model=MODEL, messages=failed, tools=[WEATHER]).input_tokens
            > client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER]).input_tokens)


def test_count_tokens_counts_what_a_message_would_take(client: Any, greedy: Any) -> None:
    bare = client.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens
    assert bare == greedy.usage.input_tokens
    assert client.messages.count_tokens(model=MODEL, messages=QUESTION, tools=[WEATHER]).input_tokens > bare + 20


def test_output_config_format(client: Any) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    raw = client.messages.with_raw_response.create(
        model=MODEL, messages=ASK_WEATHER, max_tokens=48, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"})
    assert raw.headers["x-localm-constrained"] == "json_schema"
    r = raw.parse()
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), schema)


def test_thinking_on_a_model_that_does_not_think(client: Any) -> None:
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}):
        r = client.messages.create(model=MODEL, messages=QUESTION, max_tokens=2, thinking=thinking,
                                   extra_body={"temperature": 0})
        assert [b.type for b in r.content] == ["text"]


# --- keys ------------------------------------------------------------------------------

def test_x_api_key_is_the_key(server: Any) -> None:
    s, owner = server
    body = {"model": MODEL, "messages": QUESTION}
    wrong = anthropic.Anthropic(base_url=s.url, api_key="lm-wrong-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.count_tokens(**body)
    assert caught.value.body["error"]["type"] == "authentication_error"
    is_error(httpx.post(s.url + "/v1/messages/count_tokens", json=body), 401, "authentication_error")
    is_error(post(server, "/v1/messages", json={**body, "max_tokens": 1}, headers={"x-api-key": "lm-nope"}), 401,
             "authentication_error")
    # the bearer token wins over x-api-key, either way round
    both = post(server, "/v1/messages/count_tokens", json=body,
                headers={"x-api-key": "lm-nope", "Authorization": f"Bearer {owner}"})
    assert both.status_code == 200 and both.json()["input_tokens"] > 10
    is_error(post(server, "/v1/messages/count_tokens", json=body, headers={"Authorization": "Bearer lm-nope"}), 401,
             "authentication_error")
    bearer = anthropic.Anthropic(base_url=s.url, auth_token=owner, max_retries=0)
    assert bearer.messages.count_tokens(**body).input_tokens > 10


# --- errors ----------------------------------------------------------------------------

def test_an_unknown_model_is_not_found(client: Any, server: Any) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", messages=QUESTION, max_tokens=4)
    assert caught.value.body["error"]["type"] == "not_found_error"
    is_error(post(server, "/v1/messages/count_tokens", json={"model": "nope", "messages": QUESTION}), 404,
             "not_found_error")


@pytest.mark.parametrize(("body", "says"), [
    ({"messages": QUESTION}, "max_tokens"),
    ({"max_tokens": 4, "messages": "hi"}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ({"max_tokens": 4, "messages": QUESTION, "temperature": "hot"}, "temperature"),  # the chat service's 422
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages.0.content.0"),
    ({"max_tokens": 4, "messages": QUESTION, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "server tool"),
    ({"max_tokens": 4, "messages": QUESTION, "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]},
     "mcp_servers"),
    ({"max_tokens": 4, "messages": QUESTION, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": QUESTION, "thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGPk5ORkYGBgYmBgYGBgAAABbgAfXn6dLgAAAABJRU5ErkJggg=="}}]}]},
     "text only"),
])
def test_a_malformed_body_is_an_invalid_request(server: Any, body: dict[str, Any], says: str) -> None:
    message = is_error(post(server, "/v1/messages", json={"model": MODEL, **body}), 400, "invalid_request_error")
    assert says in message


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGPk5ORkYGBgYmBgYGBgAAABbgAfXn6dLgAAAABJRU5ErkJggg=="}}
BAD_SCHEMA = {"type": "object", "properties": 3}


@pytest.mark.parametrize(("body", "says", "not_says"), [
    # a system prompt is a chat message of its own: the image is still messages.2.content.1
    ({"system": "Be brief.", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]}]},
     "messages.2.content.1: this model takes text only", "messages[3]"),
    ({"messages": QUESTION, "stop_sequences": ["x"] * 17}, "stop_sequences holds 17 sequences", "stop "),
    ({"messages": QUESTION, "output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}},
     "output_config.format.schema", "response_format"),
    ({"messages": QUESTION, "tools": [{**WEATHER, "input_schema": BAD_SCHEMA}]},
     "tools.0.input_schema is not valid JSON Schema", "function"),
    ({"messages": QUESTION, "tools": [WEATHER, WEATHER]}, "tools.1.name: 'get_weather' is already tools.0",
     "function"),
])
def test_the_chat_services_refusals_name_anthropic_fields(server: Any, body: dict[str, Any], says: str,
                                                          not_says: str) -> None:
    message = is_error(post(server, "/v1/messages", json={"model": MODEL, "max_tokens": 4, **body}), 400,
                       "invalid_request_error")
    assert says in message and not_says not in message, message


def test_a_body_that_is_not_json(server: Any) -> None:
    is_error(post(server, "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}), 400,
             "invalid_request_error")


def test_the_sdk_sees_an_invalid_request(client: Any) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, messages=QUESTION, max_tokens=4,
                               tools=[{"type": "code_execution_20250825", "name": "code_execution"}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"


# --- the reader and the renderer on their own ------------------------------------------

def _load(name: str) -> Any:
    return plugin_module("anthropic", f"anthropic_messages.{name}")


def test_the_reader_joins_turns_and_translates_tools() -> None:
    asked = _load("translate").to_chat_request({
        "model": "localm", "max_tokens": 8, "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        "stop_sequences": ["\n\n"], "top_k": 5, "thinking": {"type": "adaptive"},
        "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "one"}, {"role": "user", "content": [{"type": "text", "text": "two"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True, "content": [
                    {"type": "text", "text": "timeout"},
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/x.png"}}]},
                {"type": "text", "text": "Try again?"}]}]})
    body, name = asked.body, asked.origins.name
    assert body["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "\n\n"},
                                     {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}],
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "(error) timeout"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/x.png"}},
                                     {"type": "text", "text": "Try again?"}]}]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]
    assert body["stop"] == ["\n\n"] and body["top_k"] == 5 and body["max_tokens"] == 8
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    # each chat message, part and call is named as the client sent it
    assert [name("messages", k) for k in range(5)] == ["system", "messages.0", "messages.2",
                                                        "messages.3.content.0", "messages.3"]
    assert name("messages", 0, "content", 1) == "system.1"
    assert name("messages", 1, "content", 2) == "messages.1.content.0"
    assert name("messages", 2, "tool_calls", 0, "function", "name") == "messages.2.content.2.name"
    assert name("messages", 4, "content", 0) == "messages.3.content.0.content.1"
    assert name("tools", 0, "function", "parameters") == "tools.0.input_schema"
    assert name("stop") == "stop_sequences" and name("response_format", "json_schema", "schema") == \
        "output_config.format.schema"


class _Text:
    def __init__(self, text: str) -> None:
        self.text = text


class _Items:
    """Stand-ins for the item classes the chat service hands out (``chat.Piece``...)."""

    class Piece(_Text):
        pass

    class Reasoning(_Text):
        pass

    class Status(_Text):
        code = "waiting"

    class Call:
        def __init__(self, call: dict[str, Any]) -> None:
            self.call = call

    @staticmethod
    def redact(text: str) -> str:
        return text


def _render(items: list[Any], fail: Exception | None = None, **outcome: Any) -> list[tuple[str, Any]]:
    """The events rendered for these items; a dict among them updates the outcome there."""
    out = types.SimpleNamespace(finish_reason="stop", stop_sequence=None, prompt_tokens=7, completion_tokens=5,
                                calls=[], error=None)

    async def produce() -> Any:
        for item in items:
            if isinstance(item, dict):
                vars(out).update(item)
            else:
                yield item
        if fail is not None:
            raise fail
        vars(out).update(outcome)

    gen = types.SimpleNamespace(outcome=out, model="m", items=produce, extra={})

    async def collect() -> list[bytes]:
        return [chunk async for chunk in _load("render").events(gen, _Items(), "msg_1")]

    found = []
    for chunk in asyncio.run(collect()):
        head, data = chunk.decode().split("\n", 1)
        found.append((head[len("event: "):], json.loads(data[len("data: "):])))
    return found


def test_the_stream_renders_thinking_text_and_calls() -> None:
    chat = _Items()
    call = {"id": "call_abc", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    events = _render([chat.Reasoning("Hmm."), chat.Reasoning(" Yes."), chat.Status("Waiting"), chat.Piece("Hi"),
                      chat.Call(call)], finish_reason="tool_calls", calls=[call])
    assert [(n, d.get("index"), (d.get("delta") or d.get("content_block") or {}).get("type")) for n, d in events] == [
        ("message_start", None, None), ("ping", None, None),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("ping", None, None),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None), ("message_delta", None, None), ("message_stop", None, None)]
    assert events[2][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert events[6][1]["delta"] == {"type": "signature_delta", "signature": ""}
    assert events[11][1]["content_block"] == {"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {}}
    assert events[12][1]["delta"]["partial_json"] == '{"a":1}'
    assert events[14][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                             "usage": {"input_tokens": 7, "output_tokens": 5}}


def test_a_stream_that_fails_ends_with_an_error_event() -> None:
    chat = _Items()
    events = _render([chat.Piece("Hi")], fail=sdk.LocalmError(500, "The reply broke its schema"))
    assert [n for n, _ in events][-2:] == ["content_block_delta", "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "The reply broke its schema"}}
    events = _render([chat.Piece("Hi"), {"finish_reason": "error", "error": "boom"},
                      chat.Piece("\n[inference error: boom]")])
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == "Hi"
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "boom"}})
