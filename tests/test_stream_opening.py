"""A streamed reply whose model is not loaded opens at once: a loading_model status comes
before the first token (OpenAI chunks, Ollama lines), and a refusal met once it is open
travels in band; a reply on a loaded model sends none. A request whose inlet hooks take
longer than a fraction of a second (tests/plugins/slowinlet) opens its stream while they run:
chat_hooks and the hook's own statuses arrive live, and a refusal from then on travels in
band with localm_error. Real server, default model."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from conftest import TEST_STORE

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(module_server: Any) -> Any:
    s = module_server(plugins=["chat", "llamacpp", "openai", "ollama", "slowinlet"])
    done = s.cli("plugin", "install", str(TEST_STORE / "slowinlet"))
    assert done.returncode == 0 and done.stdout.endswith("It is active.\n"), done.stderr + done.stdout
    return s


def unload(server: Any) -> None:
    with server.owner() as owner:
        r = owner.post("/v1/models/unload", params={"model": MODEL})
        assert r.status_code == 200, r.text
        assert MODEL not in [m["id"] for m in owner.get("/api/models/loaded").json()["models"]]


def test_openai_stream_shows_loading_model_before_the_first_token(server: Any) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="open", timeout=120, max_retries=0)
    unload(server)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    codes = [(d.model_extra or {}).get("status_code") for d in deltas]
    first_text = next(i for i, d in enumerate(deltas) if d.content)
    assert "loading_model" in codes[:first_text], codes
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert "".join(d.content or "" for d in deltas).strip()
    # loaded now: nothing to wait for
    again = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, stream=True))
    assert "loading_model" not in [(c.choices[0].delta.model_extra or {}).get("status_code")
                                   for c in again if c.choices]


def test_a_refusal_after_the_stream_opened_travels_in_band(server: Any) -> None:
    unload(server)
    long = [{"role": "user", "content": "word " * 20000}]  # past the window, and nothing to compact
    with httpx.Client(base_url=server.url, timeout=120) as c:
        with c.stream("POST", "/v1/chat/completions", json={"model": MODEL, "messages": long, "max_tokens": 4,
                                                            "stream": True}) as r:
            assert r.status_code == 200  # open before the model loaded
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    codes = [e["choices"][0]["delta"].get("status_code") for e in events if e.get("choices")]
    assert "loading_model" in codes
    errors = [e["choices"][0]["localm_error"] for e in events if e.get("choices") and "localm_error" in e["choices"][0]]
    assert errors and errors[0]["status"] == 413, events[-3:]
    assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1] == "error"


def test_an_unknown_model_is_still_an_http_status(server: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": "no-such-model", "messages": HI, "stream": True})
    assert r.status_code == 404


def test_ollama_stream_shows_loading_model_first(server: Any) -> None:
    unload(server)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        with c.stream("POST", "/api/chat", json={"model": MODEL, "messages": HI, "stream": True,
                                                 "options": {"num_predict": 4}}) as r:
            assert r.status_code == 200
            lines = [json.loads(line) for line in r.iter_lines() if line.strip()]
    assert lines[0]["status"] == "loading_model" and lines[0]["message"] == {"role": "assistant", "content": ""}
    assert lines[0]["done"] is False
    assert lines[-1]["done"] is True and lines[-1]["load_duration"] > 0
    assert "".join(line["message"]["content"] for line in lines if not line["done"]).strip()
    # the ollama client reads such a stream as it reads any other
    unload(server)
    parts = list(ollama.Client(host=server.url, timeout=120).chat(model=MODEL, messages=HI, stream=True,
                                                                  options={"num_predict": 4}))
    assert parts[-1].done and "".join(p.message.content or "" for p in parts).strip()


def timed_events(server: Any, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[tuple[float, Any]]]:
    """A streamed request's response and its events (SSE data objects or NDJSON lines), each
    with the seconds from sending the request to its arrival."""
    events: list[tuple[float, Any]] = []
    with httpx.Client(base_url=server.url, timeout=120) as c:
        sent = time.monotonic()
        with c.stream("POST", path, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append((time.monotonic() - sent, json.loads(line[6:])))
                elif line.startswith("{"):
                    events.append((time.monotonic() - sent, json.loads(line)))
    return r, events


def loaded(server: Any) -> None:
    with server.owner() as owner:
        assert owner.post("/v1/models/load", params={"model": MODEL}).status_code == 200


def test_a_slow_inlet_hook_opens_the_stream_and_its_statuses_arrive_while_it_runs(server: Any) -> None:
    loaded(server)
    r, events = timed_events(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 4,
                                                              "stream": True, "slow": 2.0})
    assert r.status_code == 200
    statuses = [(at, e["choices"][0]["delta"]["status_code"]) for at, e in events
                if e.get("choices") and "status_code" in e["choices"][0]["delta"]]
    codes = [code for _, code in statuses]
    assert codes[:2] == ["chat_hooks", "slowinlet"], statuses
    assert "processing" in codes, statuses
    # live: sent while the hook still waited, not with processing once it had ended
    processing_at = next(at for at, code in statuses if code == "processing")
    assert all(processing_at - at >= 1.0 for at, code in statuses[:2]), statuses
    # the hook's header was set after the stream opened: it comes in localm_headers, in a chunk
    # with an empty delta before the reply
    [late] = [i for i, (_, e) in enumerate(events) if (e.get("localm_headers") or {}).get("X-Slowinlet") == "done"]
    assert events[late][1]["choices"][0]["delta"] == {}
    assert late < min(i for i, (_, e) in enumerate(events) if e.get("choices") and e["choices"][0]["delta"].get("content"))
    assert "x-slowinlet" not in r.headers and r.headers["x-localm-session-mode"]
    assert [e["choices"][0]["finish_reason"] for _, e in events if e.get("choices")][-1] in ("stop", "length")


def test_a_constrained_request_says_checking_grammar_while_its_stream_is_open(server: Any) -> None:
    loaded(server)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r, events = timed_events(server, "/v1/chat/completions", {
        "model": MODEL, "messages": HI, "max_tokens": 8, "stream": True, "slow": 0.7,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    assert r.status_code == 200
    codes = [e["choices"][0]["delta"].get("status_code") for _, e in events if e.get("choices")]
    codes = [c for c in codes if c]
    assert codes.index("processing") < codes.index("checking_grammar"), codes


def test_a_refusal_after_a_slow_inlet_hook_travels_in_band_on_the_error_and_final_chunks(server: Any) -> None:
    loaded(server)
    r, events = timed_events(server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 4,
                                                              "stream": True, "slow": 1.2, "refuse": 403})
    assert r.status_code == 200
    chunks = [e for _, e in events if e.get("choices")]
    errors = [c["choices"][0]["localm_error"] for c in chunks if "localm_error" in c["choices"][0]]
    assert len(errors) == 2 and errors[0] == errors[1], chunks
    assert errors[0]["status"] == 403 and errors[0]["code"] == "slow_refusal"
    assert chunks[-1]["choices"][0]["finish_reason"] == "error" and "localm_error" in chunks[-1]["choices"][0]
    assert "slow_refusal" not in json.dumps([c["choices"][0]["delta"] for c in chunks[:-2]])
    # text completions too
    r, events = timed_events(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4,
                                                         "stream": True, "slow": 1.2, "refuse": 409})
    assert r.status_code == 200
    last = [e for _, e in events if e.get("choices")][-1]["choices"][0]
    assert last["finish_reason"] == "error" and last["localm_error"]["status"] == 409


def test_a_quick_refusal_and_an_unstreamed_one_are_still_http_statuses(server: Any) -> None:
    loaded(server)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        quick = c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "stream": True,
                                                     "slow": 0.01, "refuse": 403})
        assert quick.status_code == 403 and "slowinlet" in quick.text
        whole = c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "slow": 1.2, "refuse": 409})
        assert whole.status_code == 409


def test_ollama_lines_carry_the_live_statuses_of_a_slow_inlet_hook(server: Any) -> None:
    loaded(server)
    r, lines = timed_events(server, "/api/chat", {"model": MODEL, "messages": HI, "stream": True, "slow": 1.5,
                                                  "options": {"num_predict": 4}})
    assert r.status_code == 200
    statuses = [(at, line["status"]) for at, line in lines if line.get("status")]
    assert [code for _, code in statuses][:2] == ["chat_hooks", "slowinlet"], statuses
    processing_at = next(at for at, code in statuses if code == "processing")
    assert processing_at - statuses[1][0] >= 0.7, statuses  # sent while the hook still waited
    assert lines[-1][1]["done"] is True
    assert "".join(line["message"]["content"] for _, line in lines if not line["done"]).strip()
