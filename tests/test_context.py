"""The context window as a front end such as Open WebUI meets it: a window that grows from
n_ctx to the model's trained context, Ollama's num_ctx, compaction past the ceiling on every
surface, the clear refusal of what cannot fit, background tasks capped and queued after
interactive requests, keep_alive, and the config resets. A real server runs SmolLM2 (trained
for 8,192 tokens) on llama.cpp, opened at the default n_ctx of 4,096, with default settings.
Compaction is tested on a second server whose window a user capped (llama.cpp's n_ctx 1,024
and n_ctx_max 2,048): past that ceiling compaction works as past the trained context, on a
quarter of the tokens. Its long conversation arrives whole in one request and needs two passes
of summarising, so the chat plugin's compaction_max_tokens is raised past its default of
about one pass. The clients are the official openai, ollama and anthropic SDKs (and httpx
for the headers of streams)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from localm.sdk.engines import Turns
from localm.sdk.testing import LocalmServer

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
TRAINED = 8192
PLUGINS = ["chat", "llamacpp", "ollama", "anthropic"]


#: The ceiling of the compacting server's window (llama.cpp's n_ctx_max).
CEILING = 2048


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalmServer]:
    data = tmp_path_factory.mktemp("context") / "data"
    data.mkdir()
    s = LocalmServer(data, plugins=PLUGINS).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def compacting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalmServer]:
    data = tmp_path_factory.mktemp("compacting") / "data"
    data.mkdir()
    (data / "config.json").write_text(json.dumps({"plugins": {
        "chat": {"compaction_max_tokens": 32768}, "llamacpp": {"n_ctx": 1024, "n_ctx_max": CEILING}}}))
    s = LocalmServer(data, plugins=PLUGINS).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server: LocalmServer) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=300)


@pytest.fixture(scope="module")
def olla(server: LocalmServer) -> Any:
    return ollama.Client(host=server.url, timeout=300)


@pytest.fixture(scope="module")
def coai(compacting: LocalmServer) -> Any:
    return openai.OpenAI(base_url=compacting.url + "/v1", api_key="none", timeout=300)


def open_webui_tools(count: int = 36) -> list[dict[str, Any]]:
    """Tool definitions of the size Open WebUI sends with every chat (36 of them, about 26 KB),
    their keys in the order the ollama client writes them, so both clients' prompts are the same
    text and the second request reads the first one's cache."""
    tools = []
    for n in range(count):
        properties = {name: {"type": "string", "description": f"The {name} the tool works on, as the user gave it."}
                      for name in ("query", "target")}
        tools.append({"type": "function", "function": {
            "name": f"builtin_tool_{n}",
            "description": ("Searches, fetches, reads or writes what the user asks about: notes, knowledge bases, "
                            "web pages, chats, memories and files. Call it only when the user's request needs "
                            "it, with the query filled in; it returns text for the assistant to answer from."),
            "parameters": {"type": "object", "required": ["query"], "properties": properties}}})
    return tools


def ps(server: LocalmServer) -> dict[str, Any]:
    models = httpx.get(server.url + "/api/ps").json()["models"]
    return {m["name"]: m for m in models}


def conversation(turns: int, words: int = 220) -> list[dict[str, Any]]:
    """A long chat: ``turns`` exchanges, each message about ``words`` words, then a question."""
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for n in range(turns):
        out.append({"role": "user", "content": f"Part {n} of my travel diary. " + " ".join(
            f"On day {n} we walked past house number {n * 100 + k} and saw boats." for k in range(words // 12))})
        out.append({"role": "assistant", "content": f"Thank you for part {n}. " + " ".join(
            f"Noted: day {n}, house {n * 100 + k}." for k in range(words // 6))})
    out.append({"role": "user", "content": "In one sentence: what did we see on the walks?"})
    return out


# --- the window grows -----------------------------------------------------------------

def test_open_webuis_tools_are_answered_on_default_settings(server: LocalmServer, oai: Any, olla: Any) -> None:
    tools = open_webui_tools()
    assert len(json.dumps(tools)) > 20_000
    r = olla.chat(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=tools,
                  options={"num_predict": 8})
    assert r.done and r.prompt_eval_count > 4096, r.prompt_eval_count
    window = ps(server)[MODEL]["context_length"]
    assert 4096 < window <= TRAINED and window > r.prompt_eval_count
    raw = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=tools, max_tokens=8)
    assert raw.status_code == 200
    done = raw.parse()
    assert done.usage.prompt_tokens > 4096 and done.choices[0].finish_reason in ("stop", "length", "tool_calls")
    config = server.owner().get("/v1/config").json()
    assert config["effective_ctx_max"] == TRAINED and config["effective_ctx_model"] == MODEL


def test_the_grown_window_is_reported_in_usage(oai: Any) -> None:
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    capacity = r.usage.model_extra.get("context_capacity")
    assert capacity is not None and 4096 < capacity <= TRAINED


def test_num_ctx_sets_the_window_as_on_ollama(server: LocalmServer, olla: Any) -> None:
    r = olla.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                  options={"num_ctx": 8192, "num_predict": 4})
    assert r.done
    assert ps(server)[MODEL]["context_length"] == 8192
    shown = olla.show(MODEL)
    assert "num_ctx" in (shown.parameters or "") and "8192" in shown.parameters
    olla.generate(model=MODEL, prompt="Hi", options={"num_ctx": 2048, "num_predict": 4})
    assert ps(server)[MODEL]["context_length"] == 2048
    # past the trained context the window stops at the model's own
    olla.generate(model=MODEL, prompt="Hi", options={"num_ctx": 100_000, "num_predict": 4})
    assert ps(server)[MODEL]["context_length"] == TRAINED
    # the field is read, not reported as ignored
    r = httpx.post(server.url + "/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False,
                                                        "options": {"num_ctx": 4096, "num_predict": 2}})
    assert r.status_code == 200 and "num_ctx" not in r.headers.get("x-localm-ignored-fields", "")
    bad = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "num_ctx": 0,
                                                                "messages": [{"role": "user", "content": "Hi"}]})
    assert bad.status_code == 400 and "num_ctx" in bad.text


# --- compaction --------------------------------------------------------------------

LONG = conversation(6)


def test_the_long_conversation_is_past_the_ceiling(compacting: LocalmServer) -> None:
    words = sum(len(m["content"].split()) for m in LONG)
    assert words > CEILING  # about 3,000 tokens: more than the 2,048 the window may grow to
    r = httpx.post(compacting.url + "/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False,
                                                            "options": {"num_ctx": 100_000, "num_predict": 2}})
    assert r.status_code == 200 and ps(compacting)[MODEL]["context_length"] == CEILING


def test_compacted_on_the_openai_route(coai: Any) -> None:
    raw = coai.chat.completions.with_raw_response.create(model=MODEL, messages=LONG, max_tokens=24)
    assert raw.status_code == 200 and raw.headers["x-localm-context-compacted"] == "1"
    r = raw.parse()
    assert r.choices[0].message.content and r.usage.prompt_tokens < CEILING
    with coai.chat.completions.with_streaming_response.create(model=MODEL, messages=LONG, max_tokens=24,
                                                              stream=True) as stream:
        assert stream.headers["x-localm-context-compacted"] == "1"
        text = "".join(line for line in stream.iter_lines())
    assert "compacting" in text and '"finish_reason":"error"' not in text.replace(" ", "")


def test_compacted_on_the_ollama_route(compacting: LocalmServer) -> None:
    body = {"model": MODEL, "messages": LONG, "options": {"num_predict": 24}}
    r = httpx.post(compacting.url + "/api/chat", json={**body, "stream": False}, timeout=300)
    assert r.status_code == 200 and r.headers["x-localm-context-compacted"] == "1", r.text
    assert r.json()["message"]["content"]
    with httpx.stream("POST", compacting.url + "/api/chat", json=body, timeout=300) as s:
        assert s.status_code == 200 and s.headers["x-localm-context-compacted"] == "1"
        lines = [json.loads(line) for line in s.iter_lines() if line]
    assert lines[-1]["done"] is True and lines[-1]["done_reason"] in ("stop", "length")
    olla = ollama.Client(host=compacting.url, timeout=300)
    assert olla.chat(model=MODEL, messages=LONG, options={"num_predict": 8}).done


def test_compacted_on_the_anthropic_route(compacting: LocalmServer) -> None:
    client = anthropic.Anthropic(base_url=compacting.url, api_key="none", timeout=300)
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=24, system=LONG[0]["content"],
                                                   messages=LONG[1:])
    assert raw.status_code == 200 and raw.headers["x-localm-context-compacted"] == "1"
    assert raw.parse().content[0].text
    body = {"model": MODEL, "max_tokens": 24, "system": LONG[0]["content"], "messages": LONG[1:], "stream": True}
    with httpx.stream("POST", compacting.url + "/v1/messages", json=body, timeout=300) as s:
        assert s.status_code == 200 and s.headers["x-localm-context-compacted"] == "1"
        text = "".join(s.iter_lines())
    assert "message_stop" in text


def test_what_cannot_fit_even_after_compaction_is_refused(compacting: LocalmServer, coai: Any) -> None:
    giant = " ".join(f"word{n}" for n in range(CEILING))  # one message longer than the window may grow
    messages = [*LONG[:3], {"role": "user", "content": giant}]
    with pytest.raises(openai.APIStatusError) as err:
        coai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert err.value.status_code == 413
    assert "even after compaction" in str(err.value) and str(CEILING) in str(err.value)
    r = httpx.post(compacting.url + "/api/chat", json={"model": MODEL, "messages": messages}, timeout=300)
    assert r.status_code == 400 and "even after compaction" in r.json()["error"]  # Ollama's status for it


def test_a_max_tokens_that_fits_after_compaction_is_compacted_not_refused(coai: Any) -> None:
    # 750 is more than a quarter of the window: the prompt is compacted to leave all of it
    raw = coai.chat.completions.with_raw_response.create(model=MODEL, messages=LONG, max_tokens=750,
                                                         temperature=0, stop=["."])
    assert raw.status_code == 200 and raw.headers["x-localm-context-compacted"] == "1"
    r = raw.parse()
    assert r.usage.prompt_tokens + 750 <= CEILING and r.choices[0].finish_reason in ("stop", "length")


def test_a_max_tokens_no_compaction_can_make_room_for_is_a_400(compacting: LocalmServer, coai: Any) -> None:
    # the system prompt, the latest message and a summary leave less than 1,900 tokens
    with pytest.raises(openai.BadRequestError) as err:
        coai.chat.completions.create(model=MODEL, messages=LONG, max_tokens=1900)
    message = err.value.body["message"]
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "max_tokens"
    assert message.startswith("Even after compaction the prompt takes ") and f"window of {CEILING} tokens" in message
    assert "max_tokens is 1900" in message
    # a cap the window cannot hold at all is refused before anything is summarised
    r = httpx.post(compacting.url + "/api/chat", timeout=300, json={
        "model": MODEL, "messages": LONG, "stream": False, "options": {"num_predict": CEILING}})
    assert r.status_code == 400 and f"options.num_predict is {CEILING}" in r.json()["error"], r.text
    assert "x-localm-context-compacted" not in r.headers


# --- Ollama's replies ------------------------------------------------------------------

def test_unload_and_load_replies_parse_with_the_ollama_client(server: LocalmServer, olla: Any) -> None:
    r = olla.generate(model=MODEL, keep_alive=0)
    assert r.done and r.done_reason == "unload"
    assert MODEL not in ps(server)
    raw = httpx.post(server.url + "/api/generate", json={"model": MODEL})
    assert raw.headers["content-type"].startswith("application/json") and raw.json()["done_reason"] == "load"
    r = olla.chat(model=MODEL, messages=[], keep_alive=0)
    assert r.done and r.done_reason == "unload"


def test_keep_alive_sets_when_the_model_is_unloaded(server: LocalmServer, olla: Any) -> None:
    olla.generate(model=MODEL, prompt="Hi", options={"num_predict": 2}, keep_alive="2s")
    expires = dt.datetime.fromisoformat(ps(server)[MODEL]["expires_at"].replace("Z", "+00:00"))
    left = (expires - dt.datetime.now(dt.UTC)).total_seconds()
    assert 0 < left <= 2.5, left
    deadline = time.monotonic() + 15
    while MODEL in ps(server) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert MODEL not in ps(server)
    olla.generate(model=MODEL, prompt="Hi", options={"num_predict": 2}, keep_alive=-1)
    assert ps(server)[MODEL]["expires_at"] > "2200"  # Ollama's forever


# --- background tasks ------------------------------------------------------------------

HISTORY = ("### Chat History:\n<chat_history>\nUSER: Write a very long story about the sea.\n"
           "ASSISTANT: The sea was calm that morning.\n</chat_history>")
#: Open WebUI's task prompts as it sends them: each template's task section (its opening words,
#: older and newer wordings of the title), then the chat history it fills in.
OPEN_WEBUI_TASKS = {
    "title (older)": "### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history.\n"
                     "### Guidelines:\n- Keep it clear and simple.\n### Output:\nJSON format: { \"title\": \"...\" }\n"
                     + HISTORY,
    "title": "### Task:\nGenerate a concise title summarizing the chat history.\n### Guidelines:\n"
             "- Keep it short: 2-4 words is best.\n" + HISTORY,
    "tags": "### Task:\nGenerate 1-3 broad tags categorizing the main themes of the chat history, along with 1-3 "
            "more specific subtopic tags.\n\n### Guidelines:\n- Start with high-level domains\n" + HISTORY,
    "follow-ups": "### Task:\nSuggest 3-5 relevant follow-up questions or prompts that the user might naturally ask "
                  "next in this conversation as a **user**, based on the chat history.\n### Guidelines:\n" + HISTORY,
    "queries": "### Task:\nAnalyze the chat history to determine the necessity of generating search queries, in "
               "the given language.\n\n### Guidelines:\n- Respond with a JSON object.\n" + HISTORY,
    "image prompt": "### Task:\nGenerate a detailed prompt for am image generation task based on the given language "
                    "and context.\n\n### Guidelines:\n- Be descriptive.\n" + HISTORY,
    "autocomplete": "### Task:\nYou are an autocompletion system. Continue the text in `<text>` based on the "
                    "**completion type** in `<type>` and the given language.\n\n### **Instructions**:\n"
                    "1. Analyze `<text>`.\n---\n### Context:\n<chat_history>\n</chat_history>\n"
                    "<type>General</type>\n<text>The sun was setting over the</text>\n#### Output:\n",
    "emoji": "Your task is to reflect the speaker's likely facial expression through a fitting emoji. Interpret "
             "emotions from the message.\n\nMessage: ```I won the race!```",
}
#: A question about a file in the chat, wrapped in Open WebUI's RAG template (its task section
#: and headings, the retrieved context, then the question): a person waits on this one.
RAG_QUESTION = ("### Task:\nRespond to the user query using the provided context, incorporating inline citations in "
                "the format [id] **only when the <source> tag includes an explicit id attribute** (e.g., "
                "<source id=\"1\">).\n\n### Guidelines:\n- If you don't know the answer, clearly state that.\n"
                "\n### Output:\nProvide a clear and direct response to the user's query.\n\n<context>\n"
                "<source id=\"1\" name=\"sea.txt\">The sea covers most of the Earth. Sailors crossed it for "
                "centuries.</source>\n</context>\n\nWrite a very long story about the sea, in many chapters.")


def test_open_webuis_task_prompts_are_background_and_its_rag_template_is_not() -> None:
    from localm.plugins.chat.chat.request import background_task

    def body(content: str) -> dict[str, Any]:
        return {"messages": [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": content}]}

    for name, prompt in OPEN_WEBUI_TASKS.items():
        assert background_task(body(prompt)), name
    assert not background_task(body(RAG_QUESTION))
    assert not background_task(body("### Task:\nExplain what this heading means."))  # a heading is not a task
    # a question that quotes a task prompt further down is still a question
    assert not background_task(body("Why does my front end send this?\n\n" + OPEN_WEBUI_TASKS["title"]))
    assert background_task({"metadata": {"task": "title_generation"}, "messages": [{"role": "user", "content": "x"}]})


def test_a_background_task_is_capped(oai: Any, server: LocalmServer) -> None:
    r = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": OPEN_WEBUI_TASKS["title (older)"]}],
        extra_body={"repeat_penalty": 1.0, "temperature": 0})
    assert r.headers["x-localm-capped"] == "task_max_tokens=256"
    assert r.parse().usage.completion_tokens <= 256
    # the cap is a setting of the chat plugin
    owner = server.owner()
    assert owner.post("/v1/plugins/chat/settings", json={"task_max_tokens": 5}).status_code == 200
    try:
        r = oai.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
            extra_body={"metadata": {"task": "title_generation"}})
        assert r.headers["x-localm-capped"] == "task_max_tokens=5"
        assert r.parse().usage.completion_tokens <= 5
        for name, prompt in OPEN_WEBUI_TASKS.items():  # each of Open WebUI's tasks, as its Ollama connection sends it
            got = httpx.post(server.url + "/api/chat", timeout=120, json={
                "model": MODEL, "stream": name == "title", "messages": [{"role": "user", "content": prompt}]})
            assert got.headers.get("x-localm-capped") == "task_max_tokens=5", name
            last = json.loads(got.text.strip().splitlines()[-1])
            assert last["eval_count"] <= 5, name
        # a cap the client sets is its own: nothing is named
        r = oai.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=3, messages=[{"role": "user", "content": OPEN_WEBUI_TASKS["tags"]}])
        assert "x-localm-capped" not in r.headers and r.parse().usage.completion_tokens <= 3
    finally:
        owner.post("/v1/plugins/chat/settings", json={"task_max_tokens": None})


def test_a_question_in_open_webuis_rag_template_gets_a_whole_reply(server: LocalmServer) -> None:
    """The question is not a background task: the task cap (256) does not cut it. With a
    default_max_tokens above it, the reply runs past 256 tokens and the header names that cap."""
    owner = server.owner()
    assert owner.post("/v1/plugins/chat/settings", json={"default_max_tokens": 300}).status_code == 200
    try:
        got = httpx.post(server.url + "/api/chat", timeout=300, json={
            "model": MODEL, "stream": False, "options": {"temperature": 0, "repeat_penalty": 1.0},
            "messages": [{"role": "user", "content": RAG_QUESTION}]})
        assert got.status_code == 200, got.text
        assert got.headers["x-localm-capped"] == "default_max_tokens=300"
        reply = got.json()
        assert reply["done_reason"] == "length" and reply["eval_count"] == 300, reply
    finally:
        owner.post("/v1/plugins/chat/settings", json={"default_max_tokens": None})
    # the client's own cap: nothing is named
    got = httpx.post(server.url + "/api/chat", timeout=300, json={
        "model": MODEL, "stream": False, "options": {"num_predict": 2},
        "messages": [{"role": "user", "content": RAG_QUESTION}]})
    assert got.status_code == 200 and "x-localm-capped" not in got.headers


def test_interactive_requests_go_before_waiting_background_ones() -> None:
    async def scenario() -> list[str]:
        turns = Turns()
        order: list[str] = []

        async def one(name: str, background: bool, hold: float) -> None:
            async with turns(background):
                order.append(name)
                await asyncio.sleep(hold)

        first = asyncio.create_task(one("running", False, 0.05))
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(one("title", True, 0)), asyncio.create_task(one("tags", True, 0))]
        await asyncio.sleep(0)
        user = asyncio.create_task(one("user", False, 0))
        await asyncio.sleep(0)
        gone = asyncio.create_task(one("left", False, 0))
        await asyncio.sleep(0)
        gone.cancel()  # a client that leaves while it waits gives up its place
        await asyncio.gather(first, user, *waiting, return_exceptions=True)
        return order

    assert asyncio.run(scenario()) == ["running", "user", "title", "tags"]


# --- config -------------------------------------------------------------------------------

def test_config_set_plugins_null_resets_and_no_null_is_stored(server: LocalmServer) -> None:
    r = server.cli("config", "set", "plugins", '{"llamacpp": {"n_batch": 256, "n_threads": null}}')
    assert r.returncode == 0, r.stderr
    stored = json.loads((server.data_dir / "config.json").read_text())
    assert stored["plugins"] == {"llamacpp": {"n_batch": 256}}
    r = server.cli("config", "set", "plugins", "null")
    assert r.returncode == 0, r.stderr
    assert "plugins" not in json.loads((server.data_dir / "config.json").read_text())
    assert server.owner().get("/v1/config").json()["plugins"] == {}


# --- an engine of a plugin's own ------------------------------------------------------------

WINDOW_PLUGIN = {
    "plugin.toml": 'id = "window"\nversion = "0.1.0"\ndescription = "window-echo"\nentry = "window"\n'
                   'requires = ["chat"]\n',
    "window.py": '''\
from localm import sdk
from localm.sdk import engines


class WindowEngine:
    engine = "window"
    capabilities = engines.Capabilities(context_window=0, messages=True)
    busy = 0

    async def generate(self, request):
        yield engines.Token(id=-1, text=f"num_ctx={request.num_ctx} background={request.background}")
        yield engines.Finished(reason="stop", prompt_tokens=0, completion_tokens=1)

    def close(self):
        pass


@sdk.hookimpl
def register_engines(register):
    register("window", lambda entry, options: WindowEngine())


@sdk.hookimpl
def startup(host, plugin):
    host.models.provide(plugin.name, [{"id": "window-echo", "engine": "window"}])
''',
}


def test_a_plugins_messages_engine_gets_num_ctx_and_background(tmp_path: Any) -> None:
    """An engine that takes whole chat requests still learns the window the client asked for
    and whether the request is a front end's background task (a remote engine queues by it)."""
    source = tmp_path / "window-plugin"
    source.mkdir()
    for name, text in WINDOW_PLUGIN.items():
        (source / name).write_text(text)
    s = LocalmServer(tmp_path / "data", plugins=["chat", "ollama", "window"])
    assert s.cli("plugin", "install", str(source)).returncode == 0
    s.start()
    try:
        client = s.owner()
        r = client.post("/api/chat", json={"model": "window-echo", "stream": False, "options": {"num_ctx": 2048},
                                           "messages": [{"role": "user", "content": OPEN_WEBUI_TASKS["title"]}]})
        assert r.json()["message"]["content"] == "num_ctx=2048 background=True", r.text
        r = client.post("/v1/chat/completions", json={"model": "window-echo", "metadata": {"task": "tags_generation"},
                                                      "messages": [{"role": "user", "content": "hi"}]})
        assert r.json()["choices"][0]["message"]["content"] == "num_ctx=None background=True", r.text
        r = client.post("/v1/chat/completions", json={"model": "window-echo",
                                                      "messages": [{"role": "user", "content": "hi"}]})
        assert r.json()["choices"][0]["message"]["content"] == "num_ctx=None background=False", r.text
    finally:
        s.stop()
