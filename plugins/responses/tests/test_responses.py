"""POST /v1/responses (the OpenAI Responses API) with the official openai SDK on a keyed
server running SmolLM2 through llama.cpp; the store and the event renderer in process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import jsonschema
import pytest

from project_fixtures import offline_cli
from localm.sdk.chat import Call, Piece, Reasoning
from localm.sdk.testing import LocalmServer, plugin_module

openai = pytest.importorskip("openai")
MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather now in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
FORCED = {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
          "parallel_tool_calls": False}
ASK = "What is the weather in Paris?"
LONG = "Write a long story about the sea."


def _package() -> Any:
    """The plugin's package, imported as the plugin host names it (it needs only the sdk at import)."""
    return plugin_module("responses", "responses")


# --- a keyed server, two keys ---------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalmServer]:
    pytest.importorskip("llama_cpp")
    data_dir = tmp_path_factory.mktemp("responses") / "data"
    owner = offline_cli(data_dir, "key", "generate").strip()
    s = LocalmServer(data_dir, plugins=["chat", "llamacpp", "responses"]).start()
    s.owner_key = owner  # type: ignore[attr-defined]
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LocalmServer) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.owner_key)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def other(server: LocalmServer) -> Any:
    with server.client(server.owner_key) as admin:  # type: ignore[attr-defined]
        minted = admin.post("/v1/keys", json={"name": "other", "scopes": []}).json()
    return openai.OpenAI(base_url=server.url + "/v1", api_key=minted["key"])


def create(client: Any, **kwargs: Any) -> Any:
    return client.responses.create(model=MODEL, temperature=0, **kwargs)


def test_a_reply_and_its_usage(client: Any) -> None:
    r = create(client, input=LONG, max_output_tokens=6, metadata={"run": "test"})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.status == "incomplete" and r.output_text.strip() and r.output_text == message.content[0].text
    u = r.usage
    assert u.output_tokens == 6 and u.input_tokens > 10 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens == 0 and u.output_tokens_details.reasoning_tokens == 0
    assert r.max_output_tokens == 6 and r.store is True and r.error is None and r.tools == []
    assert r.metadata == {"run": "test"} and r.text.format.type == "text" and r.tool_choice == "auto"


def _stream(client: Any, **kwargs: Any) -> list[Any]:
    events = list(create(client, stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    return events


def test_a_streamed_reply_stops_at_the_cap(client: Any) -> None:
    events = _stream(client, input=LONG, max_output_tokens=5)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and deltas
    done = events[-4]
    assert done.text == "".join(deltas) and events[-2].item.content[0].text == done.text
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == done.text and final.usage.output_tokens == 5


def test_a_forced_function_call_streamed_and_its_result(client: Any) -> None:
    events = _stream(client, input=ASK, max_output_tokens=48, **FORCED)
    kinds = [e.type for e in events]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"]
    added, delta, done, item_done, completed = events[2:]
    assert added.item.type == "function_call" and added.item.status == "in_progress" and added.item.arguments == ""
    assert delta.delta == done.arguments == item_done.item.arguments
    r = completed.response
    assert r.status == "completed" and r.parallel_tool_calls is False and r.output_text == ""
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id == added.item.id and call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # the result, as a continuation and as the whole conversation sent again: the same prompt
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    follow = create(client, previous_response_id=r.id, input=[result], tools=[WEATHER], max_output_tokens=1)
    assert follow.status in ("completed", "incomplete") and follow.previous_response_id == r.id
    whole = create(client, input=[{"role": "user", "content": ASK}, *r.output, result],  # output items as input
                   tools=[WEATHER], max_output_tokens=1, store=False)
    assert whole.usage.input_tokens == follow.usage.input_tokens > r.usage.input_tokens


def test_a_continuation_sees_the_conversation_but_not_the_instructions(client: Any) -> None:
    first = create(client, input="My name is Ada.", instructions="Answer in five words.", max_output_tokens=8)
    assert first.instructions == "Answer in five words."
    second = create(client, input="What is my name?", previous_response_id=first.id, max_output_tokens=1)
    assert second.previous_response_id == first.id and second.instructions is None
    alone = create(client, input="What is my name?", max_output_tokens=1, store=False)
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens
    spelled = create(client, input=[{"role": "user", "content": "My name is Ada."},
                                    {"role": "assistant", "content": [{"type": "output_text",
                                                                       "text": first.output_text}]},
                                    {"role": "user", "content": "What is my name?"}],
                     max_output_tokens=1, store=False)
    assert second.usage.input_tokens == spelled.usage.input_tokens  # no instructions in it


def test_store_false_and_another_keys_response_are_not_found(client: Any, other: Any) -> None:
    kept = create(client, input="Hi", max_output_tokens=1)
    unkept = create(client, input="Hi", max_output_tokens=1, store=False)
    assert kept.store is True and unkept.store is False
    for who, rid in ((client, unkept.id), (other, kept.id), (client, "resp_nosuch")):
        with pytest.raises(openai.NotFoundError) as caught:
            create(who, input="Again", previous_response_id=rid, max_output_tokens=1)
        error = caught.value.body
        assert error["type"] == "not_found_error" and error["param"] == "previous_response_id"
    mine = create(other, input="Hi", max_output_tokens=1)
    assert create(other, input="Again", previous_response_id=mine.id, max_output_tokens=1).status != "failed"
    with pytest.raises(openai.NotFoundError):
        create(client, input="Again", previous_response_id=mine.id, max_output_tokens=1)


def test_json_schema_output_validates(client: Any) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    r = create(client, input=ASK, max_output_tokens=48,
               text={"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_logprobs_come_with_the_include(client: Any) -> None:
    r = create(client, input=LONG, max_output_tokens=3, include=["message.output_text.logprobs"], top_logprobs=2)
    entries = r.output[0].content[0].logprobs
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 for e in entries)
    assert "".join(e.token for e in entries) == r.output_text
    assert create(client, input=LONG, max_output_tokens=1, top_logprobs=2).output[0].content[0].logprobs == []
    events = _stream(client, input=LONG, max_output_tokens=3, include=["message.output_text.logprobs"],
                     top_logprobs=1)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [x.token for d in deltas for x in d.logprobs] == [x.token for x in done.logprobs] and len(done.logprobs) == 3
    assert all(len(x.top_logprobs) == 1 for x in done.logprobs)


@pytest.mark.parametrize("fields, param", [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER, {**WEATHER, "name": "a name"}]}, "tools[1].name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                             {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input[0].content[1]"),
    ({"input": [{"role": "user", "content": "Look"},
                {"type": "function_call", "call_id": "call_1", "name": "look", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1",
                 "output": [{"type": "input_text", "text": "A photo:"},
                            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input[2].output[1]"),
    ({"include": ["output.everything"]}, "include"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"temperature": "warm"}, "temperature"),
    ({"top_k": "many"}, "top_k"),
    ({"text": {"format": {"type": "json_schema", "name": "bad name!\n", "schema": {}}}}, "text.format"),
])
def test_refusals_are_400s_naming_the_field(client: Any, fields: dict[str, Any], param: str) -> None:
    body = {"input": "Hi", "max_output_tokens": 1, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, extra_body=body)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_a_missing_key_is_an_authentication_error(server: LocalmServer) -> None:
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "input": "Hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


# --- in process: the store ------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _store(**kwargs: Any) -> tuple[Any, Clock]:
    clock = Clock()
    return _package().store.Store(clock=clock, **kwargs), clock


def _conversation(size: int) -> list[dict[str, Any]]:
    """A conversation whose JSON is ``size`` bytes."""
    base = _package().store.Store.measure([{"role": "user", "content": ""}])
    return [{"role": "user", "content": "x" * (size - base)}]


def test_the_store_evicts_the_oldest_of_the_key_holding_the_most() -> None:
    store, _ = _store(max_responses=4, max_bytes=10_000)
    for rid, owner in (("a1", "A"), ("b1", "B"), ("a2", "A"), ("b2", "B")):
        assert store.put(rid, owner, _conversation(100))
    assert store.put("a3", "A", _conversation(100))  # A, now holding 3, drops its oldest
    assert [r for r in ("a1", "b1", "a2", "b2", "a3") if r in store] == ["b1", "a2", "b2", "a3"]
    assert store.put("a4", "A", _conversation(100))
    assert [r for r in ("b1", "a2", "b2", "a3", "a4") if r in store] == ["b1", "b2", "a3", "a4"]
    assert store.put("b3", "B", _conversation(100))  # a tie at 3 each: B's own count decides
    assert [r for r in ("b1", "b2", "a3", "a4", "b3") if r in store] == ["b2", "a3", "a4", "b3"]
    assert len(store) == 4 and store.size == 400


def test_the_store_evicts_by_bytes_and_refuses_what_cannot_fit() -> None:
    store, _ = _store(max_responses=100, max_bytes=1000)
    assert store.put("big", "A", _conversation(600))
    assert store.put("b1", "B", _conversation(100)) and store.put("b2", "B", _conversation(100))
    assert store.put("b3", "B", _conversation(300))  # 1100 bytes: A holds the most, its response goes
    assert "big" not in store and store.size == 500 and store.held("B") == (3, 500)
    assert store.put("b4", "B", _conversation(600))  # 1100 again: B's oldest goes, B holding the most
    assert "b1" not in store and store.size == 1000
    assert not store.put("huge", "A", _conversation(1001)) and "huge" not in store and store.size == 1000


def test_the_store_expires_after_an_hour_and_shows_each_key_its_own() -> None:
    store, clock = _store()
    store.put("r1", "key:one", _conversation(50))
    assert store.get("r1", "key:one").messages == _conversation(50)
    assert store.get("r1", "key:two") is None and store.get("r1", "owner") is None and store.get("nosuch", "x") is None
    clock.now += 3599
    store.put("r2", "key:two", _conversation(50))
    assert store.get("r1", "key:one") is not None and store.purge() == 0
    clock.now += 1
    assert store.get("r1", "key:one") is None and len(store) == 2  # expired: never returned
    assert store.purge() == 1 and len(store) == 1 and store.get("r2", "key:two") is not None
    clock.now += 3600
    assert store.purge() == 1 and len(store) == 0 and store.size == 0


def test_callers_are_told_apart() -> None:
    identity = _package().identity

    @attrs.frozen
    class P:
        kind: str
        key_id: str | None = None

    assert identity(P("key", "k1")) == "key:k1" != identity(P("key", "k2"))
    assert identity(P("owner")) == identity(P("attach")) == "owner"
    assert identity(P("open")) == "open"


# --- in process: the renderer, with a reasoning model's items ------------------------------

class FakeChat:
    Piece, Reasoning, Call = Piece, Reasoning, Call

    @staticmethod
    def redact(text: str) -> str:
        return text


@attrs.define
class Outcome:
    finish_reason: str = "stop"
    error: str | None = None
    prompt_tokens: int = 20
    completion_tokens: int = 9
    calls: list[dict[str, Any]] = attrs.Factory(list)


@attrs.define
class FakeGen:
    items_: list[Any]
    outcome: Outcome
    extra: dict[str, Any] = attrs.Factory(dict)

    async def items(self) -> Any:
        for item in self.items_:
            if isinstance(item, Call):
                self.outcome.calls.append(item.call)
            yield item

    async def reply(self) -> Any:
        content, reasoning = [], []
        async for item in self.items():
            if isinstance(item, Piece):
                content.append(item.text)
            elif isinstance(item, Reasoning):
                reasoning.append(item.text)
        return type("Reply", (), {"text": "".join(content), "reasoning": reasoning, "logprobs": [],
                                  "calls": list(self.outcome.calls), "rewritten": False})()


THOUGHT = [Reasoning("The user "), Reasoning("greets.")]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}


def _render(items: list[Any], *, stream: bool, finish: str = "stop", **body: Any) -> Any:
    package = _package()
    parsed = package.request.parse({"input": "Hi", "stream": stream, **body})
    reply = package.render.Reply(parsed=parsed, model="m", response_id="resp_1", created_at=1)
    gen = FakeGen(items, Outcome(finish_reason=finish))
    kept: list[Any] = []

    def keep(assistant: Any, status: str) -> bool:
        kept.append((assistant, status))
        return True

    async def run() -> Any:
        if not stream:
            return await package.render.whole(FakeChat(), gen, reply, keep)
        return [chunk async for chunk in package.render.events(FakeChat(), gen, reply, keep)]

    return asyncio.run(run()), kept


def _parse_sse(chunks: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for chunk in chunks:
        event, data = chunk.decode().rstrip("\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert event == "event: " + payload["type"]
        out.append(payload)
    return out


def test_reasoning_comes_back_as_a_reasoning_item() -> None:
    from openai.types.responses import Response

    obj, kept = _render([*THOUGHT, Piece("Hello!")], stream=False)
    r = Response.model_validate(obj)  # strict: every required field is there
    reasoning, _ = r.output
    assert reasoning.type == "reasoning" and reasoning.summary == [] and reasoning.id.startswith("rs_")
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "The user greets.")]
    assert r.output_text == "Hello!" and r.status == "completed"
    assert kept == [({"role": "assistant", "content": "Hello!"}, "completed")]  # thinking is not carried


def test_a_function_call_item_whole() -> None:
    from openai.types.responses import Response

    obj, kept = _render([Call(CALL)], stream=False, finish="tool_calls", **FORCED)
    r = Response.model_validate(obj)
    [call] = r.output  # no message beside the call
    assert (call.type, call.call_id, call.name, call.arguments, call.status) == (
        "function_call", "call_1", "get_weather", '{"city":"Paris"}', "completed")
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather" and r.output_text == ""
    assert kept == [({"role": "assistant", "content": "", "tool_calls": [CALL]}, "completed")]


def test_every_streamed_event_is_one_the_sdk_knows() -> None:
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    chunks, kept = _render([*THOUGHT, Piece("Hel"), Piece("lo"), Call(CALL)], stream=True,
                           tools=[WEATHER])
    events = _parse_sse(chunks)
    for e in events:
        adapter.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     "response.reasoning_text.delta", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert [item["output_index"] for item in events if item["type"] == "response.output_item.done"] == [0, 1, 2]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "The user greets."}]
    assert final["output"][2]["call_id"] == "call_1" and final["output"][2]["arguments"] == '{"city":"Paris"}'
    assert kept == [({"role": "assistant", "content": "Hello", "tool_calls": [CALL]}, "completed")]


def test_a_failed_generation_ends_with_response_failed() -> None:
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    items = [Piece("Hel"), Piece("\n[inference error: boom]")]

    class Failing(FakeGen):
        async def items(self) -> Any:
            yield items[0]
            self.outcome.finish_reason, self.outcome.error = "error", "boom"
            yield items[1]

    package = _package()
    parsed = package.request.parse({"input": "Hi", "stream": True})
    reply = package.render.Reply(parsed=parsed, model="m", response_id="resp_1", created_at=1)

    async def run() -> list[bytes]:
        return [c async for c in package.render.events(FakeChat(), Failing([], Outcome()), reply,
                                                       lambda a, s: s != "failed")]

    events = _parse_sse(asyncio.run(run()))
    for e in events:
        TypeAdapter(ResponseStreamEvent).validate_python(e)
    last = events[-1]
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"] == {"code": "server_error", "message": "boom"}
    assert last["response"]["store"] is False and last["response"]["output"][0]["content"][0]["text"] == "Hel"
