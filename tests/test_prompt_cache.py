"""The prompt cache survives a front end's side requests: Open WebUI's request sequence
(first message, its title, tags and follow-up tasks, second message) reads only the new
tokens of the second message, whether the conversation kept its slot (several slots) or was
restored from host memory (one slot); the cache persisted to the data dir warms a restarted
server, and a damaged or foreign cache file is skipped with a warning. Real server, real
SmolLM2 GGUF, the official openai and ollama clients."""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path
from typing import Any, Iterator

import httpx
import ollama
import openai
import pytest

from localm.sdk.testing import LocalmServer

pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
#: about 800 tokens of tool definitions, as a front end puts them in front of every chat
TOOLS = "You can call these tools:\n" + "\n".join(json.dumps({"type": "function", "function": {
    "name": f"tool_{i}", "description": f"Look up record {i} in the user's notes.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}) for i in range(20))
TASKS = ["### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history.\n"
         "### Chat History:\n<chat_history>\n{history}\n</chat_history>",
         "### Task:\nGenerate 1-3 broad tags categorizing the main themes of the chat history.\n"
         "### Chat History:\n<chat_history>\n{history}\n</chat_history>",
         "### Task:\nSuggest 3-5 relevant follow-up questions or prompts that the user might naturally ask next.\n"
         "### Chat History:\n<chat_history>\n{history}\n</chat_history>"]


def server_with(tmp_path_factory: pytest.TempPathFactory, name: str, **llamacpp: Any) -> LocalmServer:
    data = tmp_path_factory.mktemp(name) / "data"
    data.mkdir()
    (data / "config.json").write_text(json.dumps({"plugins": {"llamacpp": {"n_ctx": 2048, **llamacpp}}}))
    return LocalmServer(data, plugins=["chat", "llamacpp", "ollama"]).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalmServer]:
    s = server_with(tmp_path_factory, "prompt-cache")
    yield s
    s.stop()


def client_of(server: LocalmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused-in-open-mode", timeout=600)


def ask(client: openai.OpenAI, messages: list[dict], max_tokens: int = 12) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


def open_webui_turns(client: openai.OpenAI, system: str) -> tuple[Any, Any]:
    """The first message, Open WebUI's three background tasks (each a ``### Task:`` prompt
    quoting the chat; the first also names its task in ``metadata``, as a pipe or a client
    may), then the second message: the first and second replies."""
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Which tool finds my garden notes?"}]
    one = ask(client, first)
    history = f"USER: {first[1]['content']}\nASSISTANT: {one.choices[0].message.content}"
    for i, task in enumerate(TASKS):
        extra = {"metadata": {"task": "title_generation"}} if i == 0 else {}
        client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, extra_body=extra,
                                       messages=[{"role": "user", "content": task.format(history=history)}])
    second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                      {"role": "user", "content": "And my recipes?"}]
    return one, ask(client, second)


def cached(reply: Any) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


def test_a_follow_up_after_a_front_ends_tasks_reads_only_its_new_tokens(server: LocalmServer) -> None:
    # four slots: the tasks take the free slots, never the conversation's
    one, two = open_webui_turns(client_of(server), "Chat A. " + TOOLS)
    assert one.usage.prompt_tokens > 600 and cached(one) == 0
    assert cached(two) >= one.usage.prompt_tokens, (cached(two), one.usage.prompt_tokens)
    assert two.usage.prompt_tokens - cached(two) < 40  # the reply and the new question


@contextlib.contextmanager
def one_slot(server: LocalmServer) -> Iterator[httpx.Client]:
    """The model reloaded with one slot (the owner's client, for more settings), then with four
    slots and the default cache again."""
    owner = server.owner()
    assert owner.post("/v1/plugins/llamacpp/settings", json={"n_parallel": 1}).status_code == 200
    owner.post("/v1/models/unload", params={"model": MODEL})
    try:
        yield owner
    finally:
        owner.post("/v1/plugins/llamacpp/settings", json={"n_parallel": 4, "cache_ram_mb": -1})
        owner.post("/v1/models/unload", params={"model": MODEL})


def test_with_one_slot_the_conversation_comes_back_from_host_memory(server: LocalmServer) -> None:
    with one_slot(server) as owner:
        client = client_of(server)
        one, two = open_webui_turns(client, "Chat B. " + TOOLS)
        assert cached(two) >= one.usage.prompt_tokens, (cached(two), one.usage.prompt_tokens)
        # with the cache off, each task takes the only slot and the conversation is read again
        assert owner.post("/v1/plugins/llamacpp/settings", json={"cache_ram_mb": 0}).status_code == 200
        owner.post("/v1/models/unload", params={"model": MODEL})
        one, two = open_webui_turns(client, "Chat C. " + TOOLS)
        assert cached(two) < 100


def test_a_short_conversation_comes_back_from_host_memory_too(server: LocalmServer) -> None:
    # a few dozen tokens are worth keeping: copying them costs microseconds a token, reading
    # them again milliseconds a token on a CPU
    with one_slot(server):
        client = client_of(server)
        first = [{"role": "user", "content": "Write a short story about a keeper who finds a bottle."}]
        one = ask(client, first)
        other = ask(client, [{"role": "user", "content": "Name three colours of the rainbow."}])
        assert cached(other) < one.usage.prompt_tokens  # it took the only slot: the story left it
        two = ask(client, first + [{"role": "assistant", "content": one.choices[0].message.content},
                                   {"role": "user", "content": "Shorter, please."}])
        assert one.usage.prompt_tokens + one.usage.completion_tokens < 100
        assert cached(two) >= one.usage.prompt_tokens, (cached(two), one.usage.prompt_tokens)


def test_ollama_counts_only_the_prompt_tokens_it_evaluated(server: LocalmServer) -> None:
    client = ollama.Client(host=server.url, timeout=600)
    first = [{"role": "system", "content": "Chat D. " + TOOLS}, {"role": "user", "content": "Which tool?"}]
    one = client.chat(model=MODEL, messages=first, options={"num_predict": 8, "temperature": 0})
    assert one.prompt_eval_count > 600
    follow = first + [{"role": "assistant", "content": one.message.content}, {"role": "user", "content": "Why?"}]
    two = client.chat(model=MODEL, messages=follow, options={"num_predict": 8, "temperature": 0})
    assert 0 < two.prompt_eval_count < 60, two.prompt_eval_count  # as Ollama: the cached tokens are not counted


def test_cache_prompt_false_reads_everything(server: LocalmServer) -> None:
    client = client_of(server)
    messages = [{"role": "system", "content": "Chat E. " + TOOLS}, {"role": "user", "content": "Hello"}]
    ask(client, messages)
    fresh = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"cache_prompt": False})
    assert cached(fresh) == 0
    assert cached(ask(client, messages)) >= fresh.usage.prompt_tokens - 1


# --- persisted --------------------------------------------------------------------------

def cache_files(server: LocalmServer) -> list[Path]:
    return sorted((server.data_dir / "plugin-data" / "llamacpp" / "prompt-cache").rglob("*.kv"))


def test_a_restarted_server_reads_the_common_prefix_from_its_persisted_cache(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    s = server_with(tmp_path_factory, "persist", cache_persist=True)
    system = "Chat F. " + TOOLS
    try:
        one = ask(client_of(s), [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}])
        assert cached(one) == 0
    finally:
        s.stop()
    files = cache_files(s)
    assert len(files) == 1, files

    def new_chat(question: str) -> Any:
        s.start()
        try:
            return ask(client_of(s), [{"role": "system", "content": system}, {"role": "user", "content": question}])
        finally:
            s.stop()

    warm = new_chat("What can you do?")  # a new chat with the same tool definitions
    assert cached(warm) > 600, cached(warm)
    assert warm.usage.prompt_tokens - cached(warm) < 30

    # a damaged file: skipped with a warning, the server answers from scratch
    for f in cache_files(s):
        raw = bytearray(f.read_bytes())
        raw[-100:] = bytes(100)
        f.write_bytes(bytes(raw))
    before = len(s.log_path.read_text(errors="replace"))
    assert cached(new_chat("Tell me more.")) == 0
    assert "is damaged" in s.log_path.read_text(errors="replace")[before:]

    # a file written for another model (or another llama.cpp build): skipped with a warning
    for f in cache_files(s):
        f.unlink()
    assert cached(new_chat("Hello")) == 0 and len(cache_files(s)) == 1  # written again at stop
    for f in cache_files(s):
        raw = f.read_bytes()
        magic = raw[:9]
        length = struct.unpack("<I", raw[9:13])[0]
        header = json.loads(raw[13:13 + length])
        header["identity"]["sha256"] = "another-model"
        changed = json.dumps(header).encode()
        f.write_bytes(magic + struct.pack("<I", len(changed)) + changed + raw[13 + length:])
    before = len(s.log_path.read_text(errors="replace"))
    assert cached(new_chat("Hello again")) == 0
    assert "written for another model" in s.log_path.read_text(errors="replace")[before:]


def test_an_unreadable_cache_folder_never_stops_a_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    s = server_with(tmp_path_factory, "persist-junk", cache_persist=True)
    try:
        folder = s.data_dir / "plugin-data" / "llamacpp" / "prompt-cache" / MODEL
        folder.mkdir(parents=True)
        (folder / "junk.kv").write_bytes(b"LOCALMKV\x01" + struct.pack("<I", 2**31) + b"{")
        (folder / "short.kv").write_bytes(b"LOC")
        r = httpx.post(s.url + "/v1/chat/completions", timeout=600, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert "is damaged" in s.log()
    finally:
        s.stop()


# --- the pieces -------------------------------------------------------------------------

def test_a_short_request_never_takes_a_long_conversations_slot() -> None:
    from localm.plugins.llamacpp.llamacpp import _pick_slot
    idle = [False] * 4
    # slot 0 holds a 7,000-token conversation sharing the template's first tokens with a title task
    assert _pick_slot({0: 10, 1: 0, 2: 0, 3: 0}, idle, [9, 1, 2, 3], {0: 7000, 1: 0, 2: 0, 3: 0}) == 1
    # every slot holds something: the one that loses least
    assert _pick_slot({0: 10, 1: 3, 2: 3, 3: 3}, idle, [9, 1, 2, 3], {0: 7000, 1: 600, 2: 300, 3: 900}) == 2
    # a short loss still weighs less than keeping the busy slots in a row
    assert _pick_slot({1: 0, 3: 0}, [True, False, True, False], [0] * 4, {1: 100, 3: 0}) == 1
    # a large one does not
    assert _pick_slot({1: 0, 3: 0}, [True, False, True, False], [0] * 4, {1: 5000, 3: 0}) == 3
    # the conversation's own follow-up still takes its slot
    assert _pick_slot({0: 7000, 1: 0, 2: 0, 3: 0}, idle, [9, 1, 2, 3], {0: 7000, 1: 0, 2: 0, 3: 0}) == 0


def test_the_host_cache_keeps_the_longest_state_within_its_budget() -> None:
    from localm.plugins.llamacpp.llamacpp import PromptCache
    cache = PromptCache(100)
    assert cache.add((1, 2, 3), b"x" * 30)
    assert cache.add((1, 2, 3, 4, 5), b"y" * 40)  # extends the first: replaces it
    assert [e.tokens for e in cache.entries] == [(1, 2, 3, 4, 5)] and cache.size == 40
    assert cache.covers((1, 2, 3)) and not cache.covers((1, 2, 9))
    assert cache.add((7, 8), b"z" * 50)
    entry, n = cache.best((1, 2, 3, 4, 9))
    assert entry is not None and entry.tokens == (1, 2, 3, 4, 5) and n == 4
    cache.touch(entry)
    assert cache.add((9,), b"w" * 40)  # over budget: the least recently used (7, 8) goes
    assert [e.tokens for e in cache.entries] == [(1, 2, 3, 4, 5), (9,)]
    assert not cache.add((5,), b"v" * 101)  # larger than the whole budget


def test_the_host_cache_keeps_a_bounded_number_of_states() -> None:
    # every newcomer's prompt is compared with each state: their number is bounded as well as their bytes
    from localm.plugins.llamacpp.llamacpp import CACHE_ENTRIES, PromptCache, _shared_prefix
    cache = PromptCache(2**30)
    head = tuple(range(1000, 1300))  # a long system prompt every state shares
    for i in range(CACHE_ENTRIES + 5):
        assert cache.add(head + (i, i), b"s")
    assert len(cache.entries) == CACHE_ENTRIES and cache.entries[0].tokens == head + (5, 5)
    entry, n = cache.best(list(head) + [CACHE_ENTRIES + 4, 0])
    assert entry is not None and entry.tokens[-1] == CACHE_ENTRIES + 4 and n == len(head) + 1
    assert _shared_prefix(head + (1,), list(head) + [1]) == len(head) + 1  # a tuple against a list


def test_a_state_is_restored_when_it_saves_more_than_it_copies() -> None:
    from localm.plugins.llamacpp.llamacpp import _worth_restoring
    assert _worth_restoring(kept=48, shared=30, length=178)  # a short chat asked again: 18 tokens not read
    assert not _worth_restoring(kept=35, shared=30, length=178)  # 5 tokens: not worth a copy
    assert not _worth_restoring(kept=60, shared=30, length=6000)  # 30 tokens of a 6,000-token state
    assert _worth_restoring(kept=6000, shared=30, length=6100)  # the conversation itself
