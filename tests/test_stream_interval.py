"""A streamed reply's tokens travel together when the llama.cpp engine hands them over together
(the llamacpp plugin's stream_interval_ms): the first token comes alone and at once, later ones
in one message per interval, and what the client reads is the reply it would get unstreamed,
token for token: its text, its usage and, asked for, one log probability entry a token. Real
server, real SmolLM2 GGUF, the official openai and ollama clients."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import ollama
import openai
import pytest

from localm.sdk.testing import LocalmServer

pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
TOKENS = 40


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalmServer]:
    data = tmp_path_factory.mktemp("stream-interval") / "data"
    data.mkdir()
    # longer than the whole reply: everything after the first token comes with the Finished
    (data / "config.json").write_text(json.dumps({"plugins": {"llamacpp": {"n_ctx": 2048,
                                                                           "stream_interval_ms": 1000}}}))
    s = LocalmServer(data, plugins=["chat", "llamacpp", "ollama"]).start()
    yield s
    s.stop()


def client_of(server: LocalmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused-in-open-mode", timeout=600)


def streamed(client: openai.OpenAI, **extra: Any) -> tuple[list[Any], Any]:
    """The content chunks of a streamed chat, and its usage."""
    chunks, usage = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True}, **extra):
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            chunks.append(chunk.choices[0])
    return chunks, usage


def test_tokens_decoded_within_the_interval_come_in_one_chunk(server: LocalmServer) -> None:
    client = client_of(server)
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=TOKENS, temperature=0)
    chunks, usage = streamed(client)
    assert usage.completion_tokens == whole.usage.completion_tokens == TOKENS
    assert "".join(c.delta.content for c in chunks) == whole.choices[0].message.content
    assert len(chunks) == 2  # the first token at once, the other 39 with the end of the reply
    assert len(chunks[1].delta.content) > len(chunks[0].delta.content)


def test_a_joined_chunk_carries_each_of_its_tokens_log_probabilities(server: LocalmServer) -> None:
    chunks, usage = streamed(client_of(server), logprobs=True, top_logprobs=2)
    entries = [entry for c in chunks for entry in c.logprobs.content]
    assert len(entries) == usage.completion_tokens == TOKENS
    for c in chunks:  # a chunk's entries spell its text
        assert "".join(entry.token for entry in c.logprobs.content) == c.delta.content
        assert all(len(entry.top_logprobs) == 2 for entry in c.logprobs.content)


def test_ollama_and_raw_sse_clients_read_the_same_reply(server: LocalmServer) -> None:
    client, options = ollama.Client(host=server.url), {"temperature": 0, "num_predict": TOKENS}
    whole = client.chat(model=MODEL, messages=MESSAGES, options=options).message.content
    parts = [part.message.content for part in client.chat(model=MODEL, messages=MESSAGES, stream=True,
                                                          options=options)]
    assert "".join(parts) == whole
    assert len([p for p in parts if p]) == 2
    with httpx.stream("POST", server.url + "/v1/completions", timeout=600,
                      json={"model": MODEL, "prompt": "The lighthouse keeper", "max_tokens": TOKENS,
                            "temperature": 0, "stream": True}) as r:
        texts = [json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                 if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert len([t for t in texts if t]) == 2
