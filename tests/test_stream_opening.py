"""A streamed reply whose model is not loaded opens at once: a loading_model status comes
before the first token (OpenAI chunks, Ollama lines), and a refusal met once it is open
travels in band; a reply on a loaded model sends none. Real server, default model."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(module_server: Any) -> Any:
    return module_server(plugins=["chat", "llamacpp", "openai", "ollama"])


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
