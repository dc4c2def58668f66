"""The session log: what each session mode keeps of a chat turn, X-Localm-Session-Mode (who may
lower it), reading and clearing the log (the owner's: all; a key's: its own), and turns a client
saw end surviving SIGKILL. Real servers, the default model, the official openai client."""

from __future__ import annotations

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

from conftest import offline_cli

openai = pytest.importorskip("openai")
pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
PLUGINS = ["chat", "llamacpp", "openai"]


@pytest.fixture(scope="module")
def keyed(module_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    data_dir = tmp_path_factory.mktemp("session-log") / "data"
    owner = offline_cli(data_dir, "key", "generate").strip()
    s = module_server(data_dir=data_dir, plugins=PLUGINS)
    mint = s.client(owner).post
    alice = mint("/v1/keys", json={"name": "alice", "scopes": ["config:read"]}).json()["key"]
    bob = mint("/v1/keys", json={"name": "bob", "scopes": []}).json()["key"]
    writer = mint("/v1/keys", json={"name": "writer", "scopes": ["config:write"]}).json()["key"]
    return s, {"owner": owner, "alice": alice, "bob": bob, "writer": writer}


def client(s: Any, key: str, **headers: str) -> Any:
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, timeout=120, max_retries=0, default_headers=headers)


def set_mode(s: Any, owner: str, mode: str) -> None:
    assert s.client(owner).patch("/v1/config", json={"session_mode": mode}).status_code == 200


def log(s: Any, key: str, **params: Any) -> list[dict[str, Any]]:
    r = s.client(key).get("/api/session/log", params=params)
    assert r.status_code == 200, r.text
    return r.json()["turns"]


def test_metadata_mode_keeps_no_text(keyed: Any) -> None:
    s, keys = keyed
    set_mode(s, keys["owner"], "metadata")
    s.client(keys["owner"]).delete("/api/session/log")
    raw = client(s, keys["alice"]).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "My secret is 4321. Say hi."}], max_tokens=4)
    assert raw.headers["x-localm-session-mode"] == "metadata"
    reply = raw.parse()
    [turn] = log(s, keys["alice"])
    assert turn["mode"] == "metadata" and turn["route"] == "chat.completions" and turn["model"] == MODEL
    assert turn["finish_reason"] == reply.choices[0].finish_reason
    assert turn["prompt_tokens"] == reply.usage.prompt_tokens and turn["completion_tokens"] == reply.usage.completion_tokens
    assert turn["user"] is None and turn["reply"] is None
    assert b"4321" not in (s.data_dir / "session-log.sqlite").read_bytes()


def test_full_mode_keeps_the_users_own_words_and_the_reply(keyed: Any) -> None:
    s, keys = keyed
    set_mode(s, keys["owner"], "full")
    try:
        s.client(keys["owner"]).delete("/api/session/log")
        messages = [{"role": "user", "content": "Earlier words."}, {"role": "assistant", "content": "Yes."},
                    {"role": "user", "content": "Name a colour."},
                    {"role": "user", "content": "Summarise the chat above.", "origin": "client"}]
        chunks = list(client(s, keys["bob"]).chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                                    stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        [turn] = log(s, keys["bob"])
        assert turn["mode"] == "full" and turn["user"] == "Name a colour." and turn["reply"] == text
        assert turn["owner"].startswith("key_")
        # a text completion keeps its prompt
        client(s, keys["bob"]).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3)
        assert log(s, keys["bob"])[0]["user"] == "Once upon a time" and log(s, keys["bob"])[0]["route"] == "completions"
    finally:
        set_mode(s, keys["owner"], "metadata")


def test_who_may_lower_the_mode(keyed: Any) -> None:
    s, keys = keyed
    set_mode(s, keys["owner"], "full")
    try:
        s.client(keys["owner"]).delete("/api/session/log")
        ask = {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
        # the owner may ask for less: nothing is kept
        r = s.client(keys["owner"]).post("/v1/chat/completions", json=ask, headers={"X-Localm-Session-Mode": "none"})
        assert r.status_code == 200 and r.headers["x-localm-session-mode"] == "none"
        assert log(s, keys["owner"]) == []
        assert s.client(keys["owner"]).get("/api/session", headers={"X-Localm-Session-Mode": "metadata"}).json()[
            "session_mode"] == "metadata"
        # a scoped key may not: the turn is kept in full, and the answer says so
        r = s.client(keys["bob"]).post("/v1/chat/completions", json=ask, headers={"X-Localm-Session-Mode": "none"})
        assert r.status_code == 200 and r.headers["x-localm-session-mode"] == "full"
        assert log(s, keys["bob"])[0]["user"] == "Hi."
        assert s.client(keys["bob"]).get("/api/session", headers={"X-Localm-Session-Mode": "none"}).json()[
            "session_mode"] == "full"
        # more than the setting is never granted; a value that is no mode is a 400 before anything runs
        set_mode(s, keys["owner"], "metadata")
        r = s.client(keys["owner"]).post("/v1/chat/completions", json=ask, headers={"X-Localm-Session-Mode": "full"})
        assert r.headers["x-localm-session-mode"] == "metadata"
        before = len(log(s, keys["owner"]))
        bad = s.client(keys["owner"]).post("/v1/chat/completions", json=ask, headers={"X-Localm-Session-Mode": "all"})
        assert bad.status_code == 400 and bad.json()["code"] == "invalid_session_mode"
        assert len(log(s, keys["owner"])) == before
    finally:
        set_mode(s, keys["owner"], "metadata")


def test_reading_and_clearing_the_log(keyed: Any) -> None:
    s, keys = keyed
    set_mode(s, keys["owner"], "metadata")
    s.client(keys["owner"]).delete("/api/session/log")
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
    for who in ("alice", "alice", "bob"):
        assert s.client(keys[who]).post("/v1/chat/completions", json=ask).status_code == 200
    assert len(log(s, keys["alice"])) == 2 and len(log(s, keys["bob"])) == 1
    everyone = log(s, keys["owner"])
    assert len(everyone) == 3 and everyone[0]["id"] > everyone[1]["id"]  # newest first
    assert len(log(s, keys["owner"], limit=1)) == 1
    assert [t["id"] for t in log(s, keys["owner"], before=everyone[0]["id"])] == [t["id"] for t in everyone[1:]]
    assert s.client(keys["owner"]).get("/api/session/log", params={"limit": "-3"}).status_code == 400
    assert s.client(keys["bob"]).delete("/api/session/log").json() == {"cleared": 1}
    assert len(log(s, keys["owner"])) == 2  # bob cleared his own only
    with httpx.Client(base_url=s.url) as nobody:
        assert nobody.get("/api/session/log").status_code == 401
    # the mode is the owner's to change
    assert s.client(keys["writer"]).patch("/v1/config", json={"session_mode": "none"}).status_code == 403
    seen = s.client(keys["alice"]).get("/v1/config").json()
    assert "session_mode" not in seen and seen["effective_mode"] == "metadata" and seen["effective_chat_mode"] == "metadata"


def test_an_abandoned_stream_is_kept(keyed: Any) -> None:
    s, keys = keyed
    set_mode(s, keys["owner"], "metadata")
    s.client(keys["owner"]).delete("/api/session/log")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a hundred."}], "max_tokens": 300,
            "stream": True}
    with s.client(keys["alice"], timeout=120) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if '"content"' in line and '"content":""' not in line:
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not log(s, keys["alice"]):
        time.sleep(0.1)
    assert log(s, keys["alice"])[0]["finish_reason"] == "abandoned"


def test_mode_none_writes_no_file(server: Any, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "config.json").write_text(json.dumps({"session_mode": "none"}))
    s = server(data_dir=data_dir, plugins=PLUGINS)
    r = httpx.post(s.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 2}, timeout=120)
    assert r.status_code == 200 and r.headers["x-localm-session-mode"] == "none"
    assert not (data_dir / "session-log.sqlite").exists()
    assert s.owner().get("/api/session/log").json() == {"mode": "none", "turns": []}


@pytest.mark.server_process
def test_turns_a_client_saw_end_survive_sigkill(localm_server: Any, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "config.json").write_text(json.dumps({"session_mode": "full"}))
    s = localm_server(data_dir=data_dir, plugins=PLUGINS, process=True)
    ended: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Story number {i}, please."}],
                "max_tokens": 16 + 8 * i, "temperature": 0}
        try:
            r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120)
        except httpx.HTTPError:
            return  # killed before it ended: not acknowledged
        if r.status_code == 200:
            with lock:
                ended.append(f"Story number {i}, please.")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with lock:
            if len(ended) >= 3:
                break
        time.sleep(0.01)
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(timeout=30)
    for t in threads:
        t.join(60)
    assert len(ended) >= 3
    db = sqlite3.connect(data_dir / "session-log.sqlite")
    kept = {row[0] for row in db.execute("SELECT user FROM turns")}
    db.close()
    assert set(ended) <= kept, (ended, kept)
