"""Limits on what a client sends, and inputs that once broke the server: each is a clear 4xx,
the model keeps serving after it, and the server still shuts down cleanly."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import offline_cli

pytest.importorskip("llama_cpp")
MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "Say hi."}]
COLLECTION = "limits"


@pytest.fixture(scope="module")
def keyed(module_server: Any) -> Any:
    owner: list[str] = []

    def prepare(data_dir: Path) -> None:
        owner.append(offline_cli(data_dir, "key", "generate").strip())
        config = data_dir / "config.json"
        settings = json.loads(config.read_text()) if config.exists() else {}
        # the window a user capped (see CEILING): a full window is a quarter of the trained one
        settings.setdefault("plugins", {})["llamacpp"] = {"n_ctx": 1024, "n_ctx_max": CEILING}
        config.write_text(json.dumps(settings))

    # a process: the last test stops it with SIGTERM and reads its exit status
    s = module_server(prepare=prepare, plugins=["chat", "llamacpp", "ollama", "anthropic", "responses", "rag"],
                      process=True)
    http = s.client(owner[0], timeout=120)
    assert http.post("/api/rag/collections", json={"name": COLLECTION}).status_code == 200
    return s, http


def nested(depth: int) -> bytes:
    return b'{"model": "x", "input": ' + b"[" * depth + b"]" * depth + b"}"


#: (method, path, body bytes or JSON, expected status, expected code): each once broke or was
#: silently accepted; test_clean_shutdown_after_every_failing_input sends them all again.
FAILING: list[tuple[str, str, Any, int, str | None]] = [
    ("POST", "/v1/embeddings", {"model": MODEL, "input": ""}, 400, "empty_input"),
    ("POST", "/v1/embeddings", {"model": MODEL, "input": [""]}, 400, "empty_input"),
    ("POST", "/v1/embeddings", {"model": MODEL, "input": ["the sea", ""]}, 400, "empty_input"),
    ("POST", "/v1/embeddings", {"model": MODEL, "input": []}, 400, "empty_input"),
    ("POST", "/api/embed", {"model": MODEL, "input": [""]}, 400, None),  # Ollama's shape has no code
    ("POST", "/v1/embeddings", nested(100_000), 400, "limit_exceeded"),
    ("POST", "/v1/chat/completions", nested(100_000), 400, "limit_exceeded"),
    ("POST", "/api/chat", nested(5_000), 400, None),
    ("POST", "/v1/messages", nested(5_000), 400, None),  # Anthropic's shape has no code
    ("POST", "/v1/keys", nested(100_000), 400, "limit_exceeded"),
    ("PATCH", "/v1/config", b"[" * 1000 + b"]" * 1000, 400, "limit_exceeded"),
    ("POST", "/v1/chat/completions", b'{"messages": "' + b"x" * 11_000_000 + b'"}', 413, "body_too_large"),
    ("POST", "/v1/models/load", {"model": "nope"}, 404, None),
    ("POST", "/v1/models/load", {"modle": MODEL}, 400, "unknown_field"),
    ("POST", "/v1/keys", {"name": "n" * 100_000, "scopes": []}, 400, "limit_exceeded"),
    ("POST", "/v1/keys", {"name": "many", "scopes": ["config:read"] * 1000}, 400, "limit_exceeded"),
    ("POST", "/v1/keys", {"name": "long", "scopes": ["s" * 100_000]}, 400, "limit_exceeded"),
    ("POST", "/v1/keys", {"name": "roots", "scopes": [], "rag_roots": ["/tmp"] * 1000}, 400, "limit_exceeded"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": QUESTION * 10_001}, 400, "limit_exceeded"),
    ("POST", "/api/chat", {"model": MODEL, "messages": QUESTION * 10_001, "stream": False}, 400, None),
    ("POST", "/v1/messages", {"model": MODEL, "max_tokens": 3, "messages": QUESTION * 10_001}, 400, None),
    ("POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": QUESTION * 10_001}, 400, None),
    ("POST", "/v1/responses", {"model": MODEL, "input": QUESTION * 10_001}, 400, "limit_exceeded"),
    # a reply cap past the window the prompt leaves ended the reply at the window, as if asked
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 9000}, 400,
     "context_length_exceeded"),
    ("POST", "/api/chat", {"model": MODEL, "messages": QUESTION, "options": {"num_predict": 9000}}, 400, None),
    # found by tests/test_fuzz.py: a NUL in a path was a 500 (ValueError from realpath)
    ("POST", f"/api/rag/collections/{COLLECTION}/remove-doc", {"path": "a\x00b"}, 404, "doc_not_found"),
    ("POST", f"/api/rag/collections/{COLLECTION}/add", {"paths": ["/tmp/a\x00b"]}, 400, "invalid_path"),
]


def send(http: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return http.request(method, path, content=body, headers={"Content-Type": "application/json"})
    return http.request(method, path, json=body)


def code_of(r: httpx.Response) -> str | None:
    body = r.json()
    if "code" in body:
        return body["code"]
    if isinstance(body.get("error"), dict):  # anthropic: {"type": "error", "error": {...}}
        return body["error"].get("code")
    return None


def still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": ["the sea", "a cat"]})
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == 2 and len(r.json()["data"][0]["embedding"]) > 100
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("body", [{"input": ""}, {"input": [""]}, {"input": ["a", ""]}, {"input": []}],
                         ids=["empty", "list-of-empty", "one-empty", "no-input"])
def test_empty_embedding_input_is_a_400_and_the_model_keeps_serving(keyed: Any, body: dict[str, Any]) -> None:
    _, http = keyed
    r = http.post("/v1/embeddings", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "empty_input" and r.json()["error"]["param"] == "input"
    assert "non-empty string" in r.json()["error"]["message"]
    still_serving(http)


def test_ollama_empty_input_is_a_400_and_an_empty_list_embeds_nothing(keyed: Any) -> None:
    _, http = keyed
    r = http.post("/api/embed", json={"model": MODEL, "input": ["the sea", ""]})
    assert r.status_code == 400 and "non-empty string" in r.json()["error"]
    assert http.post("/api/embed", json={"model": MODEL, "input": []}).json()["embeddings"] == []
    assert http.post("/api/embed", json={"model": MODEL, "input": ""}).json()["embeddings"] == []
    still_serving(http)


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/chat/completions", "/api/chat", "/v1/messages",
                                  "/v1/keys", "/v1/models/load"])
def test_deeply_nested_json_is_a_400_on_every_route_family(keyed: Any, path: str) -> None:
    _, http = keyed
    r = send(http, "POST", path, nested(100_000))
    assert r.status_code == 400, r.text
    assert "nested more than 100 levels" in r.text
    still_serving(http)


def test_nesting_within_the_limit_is_read_as_before(keyed: Any) -> None:
    _, http = keyed
    deep = {"model": MODEL, "input": "x", "user": json.loads("[" * 90 + "]" * 90)}
    r = http.post("/v1/embeddings", json=deep)
    assert r.status_code != 400 or "nested" not in r.text  # past the depth check: the route reads it
    # brackets inside strings do not count
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": "[" * 1000})
    assert r.status_code == 200, r.text


def test_body_over_the_size_limit_is_a_413_in_the_route_family_shape(keyed: Any) -> None:
    _, http = keyed
    big = b'{"model": "x", "messages": "' + b"x" * 11_000_000 + b'"}'
    r = send(http, "POST", "/v1/chat/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert "at most 10000000 bytes" in r.json()["error"]["message"]
    r = send(http, "POST", "/v1/messages", big)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = send(http, "PATCH", "/v1/config", big)
    assert r.status_code == 413 and r.json()["code"] == "body_too_large"
    still_serving(http)


def test_the_limits_are_settings(keyed: Any) -> None:
    s, http = keyed
    schema = {f["key"]: f for f in http.get("/v1/config/schema").json()["fields"]}
    assert schema["max_body_bytes"]["default"] == 10_000_000
    assert schema["max_json_depth"]["default"] == 100
    assert http.patch("/v1/config", json={"max_json_depth": 20}).status_code == 200
    try:
        r = send(http, "POST", "/v1/embeddings", nested(25))
        assert r.status_code == 400 and "nested more than 20 levels" in r.text
    finally:
        assert http.patch("/v1/config", json={"max_json_depth": None}).status_code == 200
    assert send(http, "POST", "/v1/embeddings", nested(25)).status_code == 422  # read, then refused as before


def test_expensive_requests_per_minute_is_a_429_per_key(keyed: Any) -> None:
    s, http = keyed
    minted = http.post("/v1/keys", json={"name": "rate", "scopes": ["models:read"]}).json()
    key = s.client(minted["key"], timeout=120)
    second = http.post("/v1/keys", json={"name": "rate2", "scopes": ["models:read"]}).json()
    other = s.client(second["key"], timeout=120)
    empty = {"model": MODEL, "input": []}  # refused before any engine runs: counted all the same
    assert http.patch("/v1/config", json={"expensive_requests_per_minute": 2}).status_code == 200
    try:
        assert [key.post("/v1/embeddings", json=empty).status_code for _ in range(2)] == [400, 400]
        r = key.post("/v1/embeddings", json=empty)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limited" and r.json()["error"]["type"] == "rate_limit_error"
        assert 1 <= int(r.headers["Retry-After"]) <= 60
        assert "may start 2 a minute" in r.json()["error"]["message"]
        r = key.post("/api/chat", json={"model": MODEL, "messages": QUESTION, "stream": False})
        assert r.status_code == 429 and "Too many expensive requests" in r.json()["error"], r.text  # Ollama's shape
        assert key.get("/v1/models").status_code == 200  # a route that runs no model is not counted
        assert other.post("/v1/embeddings", json=empty).status_code == 400  # each key has its own budget
        assert http.post("/v1/embeddings", json=empty).status_code == 400  # and the owner too
    finally:
        assert http.patch("/v1/config", json={"expensive_requests_per_minute": None}).status_code == 200
    assert key.post("/v1/embeddings", json=empty).status_code == 400  # 0: no limit
    for k in (minted, second):
        http.delete(f"/v1/keys/{k['id']}")


def test_the_openapi_document_describes_the_plugins_bodies_and_bounds(keyed: Any) -> None:
    _, http = keyed
    doc = http.get("/openapi/openapi.json").json()
    paths, components = doc["paths"], doc["components"]["schemas"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank", "/api/chat",
                 "/api/generate", "/api/embed", "/api/show", "/v1/messages", "/v1/messages/count_tokens",
                 "/api/rag/collections/{name}/query"):
        assert "requestBody" in paths[path]["post"], path
    chat = components["ChatCompletionRequest"]
    assert "messages" in chat["required"]
    assert chat["properties"]["messages"]["maxItems"] == 10_000
    assert chat["properties"]["top_logprobs"]["anyOf"][0]["maximum"] == 20
    assert "429" in paths["/v1/chat/completions"]["post"]["responses"]
    assert "413" not in paths["/api/chat"]["post"]["responses"]  # Ollama answers it as a 400
    name = paths["/api/rag/collections/{name}"]["get"]["parameters"][0]
    assert name["schema"]["pattern"] == "^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"


def test_load_reads_the_model_from_the_body_too(keyed: Any) -> None:
    _, http = keyed
    r = http.post("/v1/models/load", json={"model": "nope"})
    assert r.status_code == 404 and "nope" in r.text
    r = http.post("/v1/models/load", json={"model": MODEL})
    assert r.status_code == 200 and r.json()["model"] == MODEL
    r = http.post("/v1/models/load", params={"model": MODEL}, json={"model": "nope"})
    assert r.status_code == 400 and "differs" in r.json()["detail"]
    r = http.post("/v1/models/load", json={"modle": MODEL})
    assert r.status_code == 400 and r.json()["code"] == "unknown_field" and "modle" in r.json()["detail"]
    r = http.post("/v1/models/load", json={"model": 3})
    assert r.status_code == 400 and r.json()["detail"] == "model must be a string"
    r = http.post("/v1/models/unload", json={"model": "nope"})
    assert r.status_code == 404
    r = http.post("/v1/models/rename", json={"model": "nope", "new_name": "other"})
    assert r.status_code == 404
    r = http.post("/v1/models/rename", json={"model": MODEL})
    assert r.status_code == 422 and "new_name is required" in r.json()["detail"]
    still_serving(http)


@pytest.mark.parametrize("body, field", [
    ({"name": "n" * 201}, "name"),
    ({"name": "many", "scopes": ["config:read"] * 65}, "scopes"),
    ({"name": "long", "scopes": ["a" * 101]}, "scopes[]"),
    ({"name": "roots", "rag_roots": ["/tmp"] * 65}, "rag_roots"),
    ({"name": "root", "rag_roots": ["/" + "d" * 5000]}, "rag_roots[]"),
])
def test_key_mint_limits(keyed: Any, body: dict[str, Any], field: str) -> None:
    s, http = keyed
    before = http.get("/v1/keys").json()["keys"]
    r = http.post("/v1/keys", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "limit_exceeded" and r.json()["field"] == field
    assert "at most" in r.json()["detail"]
    assert http.get("/v1/keys").json()["keys"] == before  # nothing stored
    ok = http.post("/v1/keys", json={"name": "n" * 200, "scopes": ["config:read"] * 64})
    assert ok.status_code == 200 and ok.json()["scopes"] == ["config:read"]
    http.delete(f"/v1/keys/{ok.json()['id']}")


def test_messages_past_the_limit_are_refused_and_at_the_limit_read(keyed: Any) -> None:
    _, http = keyed
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION * 10_001, "max_tokens": 1})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "limit_exceeded" and error["param"] == "messages"
    assert error["message"] == "messages holds 10001 items; at most 10000 are accepted"
    # 10,000 are read: the refusal is then for a field read after them (a conversation that long
    # would be compacted, a summary generated at a time: minutes on this machine)
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION * 10_000, "max_tokens": 1,
                                                "logprobs": True, "top_logprobs": 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    still_serving(http)


def test_a_nul_in_a_rag_path_is_a_4xx(keyed: Any) -> None:
    _, http = keyed
    r = http.post(f"/api/rag/collections/{COLLECTION}/remove-doc", json={"path": "/tmp/x\x00y"})
    assert r.status_code == 404 and r.json()["code"] == "doc_not_found", r.text
    r = http.post(f"/api/rag/collections/{COLLECTION}/add", json={"paths": ["/tmp/x\x00y"]})
    assert r.status_code == 400 and r.json() == {"detail": "A path cannot hold a NUL character",
                                                 "code": "invalid_path"}, r.text


# --- max_tokens against the context window ------------------------------------------------
#: The window grows on demand up to the 2,048 tokens this server's llama.cpp caps it at
#: (n_ctx_max, below the 8,192 SmolLM2 was trained for; test_context grows it that far): the
#: ceiling a prompt and its reply must fit in together.
CEILING = 2048


def owner_key(http: httpx.Client) -> str:
    return http.headers["Authorization"].split(" ", 1)[1]


def test_max_tokens_that_does_not_fit_beside_the_prompt_is_a_400_and_one_that_fits_is_served(keyed: Any) -> None:
    openai = pytest.importorskip("openai")
    s, http = keyed
    client = openai.OpenAI(base_url=s.url + "/v1", api_key=owner_key(http), timeout=300, max_retries=0)
    long = [{"role": "user", "content": "sea " * 1900}]
    first = client.chat.completions.create(model=MODEL, messages=long, max_tokens=1, temperature=0)
    prompt = first.usage.prompt_tokens
    room = CEILING - prompt
    assert 0 < room < 400, prompt
    for stream in (False, True):  # a stream is refused before it starts: the SDK raises on create
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=long, max_tokens=room + 1, temperature=0,
                                           stream=stream)
        error = err.value.body
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
        assert error["message"] == (f"The prompt is {prompt} tokens and max_tokens is {room + 1}: {CEILING + 1} "
                                    f"tokens, more than the model's context window of {CEILING} tokens; set "
                                    f"max_tokens to at most {room} or shorten the prompt")
    # the same prompt with the whole room left is served, and the reply may fill it
    r = client.chat.completions.create(model=MODEL, messages=long, max_completion_tokens=room, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= room
    assert r.usage.model_extra["context_capacity"] == CEILING
    still_serving(http)


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_cap_past_the_window_is_refused_on_every_surface(keyed: Any, stream: bool) -> None:
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    ollama = pytest.importorskip("ollama")
    s, http = keyed
    key = owner_key(http)
    oai = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=CEILING, stream=stream)
    assert err.value.body["code"] == "context_length_exceeded"
    assert f"max_tokens is {CEILING}" in err.value.body["message"] and f"of {CEILING} tokens" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt="The sea", max_tokens=CEILING, stream=stream)
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="Say hi.", max_output_tokens=10_000, stream=stream)
    assert "max_output_tokens is 10000" in err.value.body["message"]

    claude = anthropic.Anthropic(base_url=s.url, api_key=key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, messages=QUESTION, max_tokens=CEILING, stream=stream)
    assert err.value.body["error"]["type"] == "invalid_request_error"
    message = err.value.body["error"]["message"]
    assert f"max_tokens is {CEILING}" in message and f"context window of {CEILING} tokens" in message

    olla = ollama.Client(host=s.url, headers={"Authorization": f"Bearer {key}"})
    capped = {"num_predict": 9000}
    with pytest.raises(ollama.ResponseError) as err:
        for _ in olla.chat(model=MODEL, messages=QUESTION, options=capped, stream=True) if stream else \
                [olla.chat(model=MODEL, messages=QUESTION, options=capped)]:
            pass
    assert err.value.status_code == 400  # Ollama answers its 4xx as 400
    assert "options.num_predict is 9000" in err.value.error and f"of {CEILING} tokens" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        for _ in olla.generate(model=MODEL, prompt="The sea", options=capped, stream=True) if stream else \
                [olla.generate(model=MODEL, prompt="The sea", options=capped)]:
            pass
    assert err.value.status_code == 400 and "options.num_predict" in err.value.error
    still_serving(http)


def test_clean_shutdown_after_every_failing_input(keyed: Any) -> None:
    """Runs last: the server took each input that once failed, keeps serving, and exits 0 on SIGTERM."""
    s, http = keyed
    for method, path, body, status, code in FAILING:
        r = send(http, method, path, body)
        assert r.status_code == status, (path, r.text[:300])
        if code is not None:
            assert code_of(r) == code, (path, r.text[:300])
    still_serving(http)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=60) == 0, s.log()
    assert "Traceback" not in s.log(), s.log()
