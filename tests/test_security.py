"""Attacks on a running server, each reproduced and now refused or bounded: the kernel's and the
chat pipeline's part of the trust boundary.

- A web page of another origin, in open mode, gets inference only: no RAG collection, no
  memory recalled or learnt, no cookie taken for its user's, and no credentials in CORS.
- A Host this server does not answer to (DNS rebinding) reaches nothing.
- A whole (non-streamed) reply stops being generated when its client goes away, on every
  surface.
- A small request cannot hold the model for minutes summarising: compaction's work is
  bounded before it starts.
- A plugin whose import blocks does not freeze the server; temporary files a killed
  process left in the data dir are removed at the next start.

The rag plugin's paths and documents, audio and memory have their own files
(test_security_rag.py, test_security_audio.py, test_security_memory.py).
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import TEST_STORE, add

from localm.sdk.testing import LocalmServer

pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
EVIL = "http://evil.example"
LOCAL_PAGE = "http://localhost:5173"
SECRET = "4417-ALPHA"
PLUGINS = ["chat", "llamacpp", "rag", "memory", "ollama", "anthropic", "responses"]


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("private")
    (folder / "vault.txt").write_text(f"The vault code is {SECRET}. Only the owner may read this note.\n")
    return folder


@pytest.fixture(scope="module")
def srv(module_server: Any, private: Path) -> LocalmServer:
    """An open-mode server holding a private collection and a remembered fact."""
    pytest.importorskip("chromadb")

    def prepare(data: Path) -> None:
        (data / "config.json").write_text(json.dumps({"plugins": {"rag": {"allowed_roots": [str(private)]}}}))
    server = module_server(plugins=PLUGINS, prepare=prepare)
    owner = server.owner()
    assert owner.post("/api/rag/collections", json={"name": "private"}).status_code == 200
    assert add(owner, "private", private / "vault.txt", embed=False)["added"]
    assert owner.put("/api/memory", json={"text": f"The user's vault code is {SECRET}."}).status_code == 200
    return server


def chat(server: LocalmServer, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=300,
                      json={"model": MODEL, "max_tokens": 2, **body})


VAULT_QUESTION = [{"role": "user", "content": "What is the vault code?"}]
RAG = {"messages": VAULT_QUESTION, "rag": {"collections": ["private"]}}


# --- a web page of another origin, in open mode -------------------------------------------------

def test_the_owners_program_reads_the_collection(srv: LocalmServer) -> None:
    r = chat(srv, RAG)  # no Origin: a program on this machine, the owner in open mode
    assert r.status_code == 200, r.text
    assert SECRET in json.dumps(r.json().get("sources"))


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, **RAG}),
    ("/api/chat", {"model": MODEL, "stream": False, "options": {"num_predict": 2}, **RAG}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 2, **RAG}),
    ("/v1/responses", {"model": MODEL, "max_output_tokens": 16, "input": "What is the vault code?",
                       "rag": {"collections": ["private"]}}),
])
def test_a_web_page_cannot_read_a_collection(srv: LocalmServer, path: str, body: dict[str, Any]) -> None:
    r = httpx.post(srv.url + path, json=body, headers={"Origin": EVIL}, timeout=300)
    assert r.status_code == 403, r.text
    assert SECRET not in r.text
    assert r.headers["access-control-allow-origin"] == EVIL  # the page may read the refusal
    assert "access-control-allow-credentials" not in r.headers


def test_a_web_page_gets_inference_but_no_memory_and_teaches_none(srv: LocalmServer) -> None:
    owner = srv.owner()
    owner_turn = chat(srv, {"messages": VAULT_QUESTION})
    assert json.loads(owner_turn.headers["x-localm-memory"])["count"] == 1  # the owner's program recalls it
    r = chat(srv, {"messages": [{"role": "user", "content": "Remember that my name is Mallory. What is the vault "
                                                            "code?"}]}, Origin=EVIL)
    assert r.status_code == 200, r.text  # inference is open to any page, as on Ollama and LM Studio
    assert "x-localm-memory" not in r.headers  # memory was not asked
    assert r.headers["access-control-allow-origin"] == EVIL
    assert "access-control-allow-credentials" not in r.headers
    # the owner's next line is learnt; the page's, sent before it, never was
    assert chat(srv, {"messages": [{"role": "user", "content": "Remember that my name is Ada."}]}).status_code == 200
    db = srv.data_dir / "plugin-data" / "memory" / "memory.db"

    def turns() -> list[str]:
        with sqlite3.connect(db) as conn:
            return [row[0] for row in conn.execute("SELECT text FROM turns")]
    assert wait_for(lambda: any("Ada" in t for t in turns()), 30), turns()
    assert not any("Mallory" in t for t in turns())
    assert SECRET in json.dumps(owner.get("/api/memory").json())  # what the owner saved is untouched


def test_a_local_page_and_a_listed_origin_are_the_owners(srv: LocalmServer) -> None:
    r = chat(srv, RAG, Origin=LOCAL_PAGE)
    assert r.status_code == 200 and SECRET in json.dumps(r.json().get("sources"))
    assert r.headers["access-control-allow-origin"] == LOCAL_PAGE
    assert r.headers["access-control-allow-credentials"] == "true"
    listed = "https://notes.example"
    owner = srv.owner()
    assert owner.patch("/v1/config", json={"cors_origins": [listed]}).status_code == 200
    try:
        r = chat(srv, RAG, Origin=listed)
        assert r.status_code == 200 and SECRET in json.dumps(r.json().get("sources"))
        assert r.headers["access-control-allow-credentials"] == "true"
    finally:
        owner.patch("/v1/config", json={"cors_origins": None})


def test_a_web_pages_preflight_gets_no_credentials(srv: LocalmServer) -> None:
    r = httpx.options(srv.url + "/v1/chat/completions", headers={
        "Origin": EVIL, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == EVIL
    assert "access-control-allow-credentials" not in r.headers


def test_a_web_page_cannot_use_the_owners_session_cookie(localm_server: Any) -> None:
    key = "lm-owner-key-for-the-cookie-test"
    server = localm_server(plugins=["chat", "llamacpp"], env={"LOCALM_API_KEY": key})
    login = httpx.post(server.url + "/api/session", json={"key": key})
    assert login.status_code == 200, login.text
    cookies, csrf = dict(login.cookies), {"X-CSRF-Token": login.json()["csrf"]}
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    mine = httpx.post(server.url + "/v1/chat/completions", json=body, cookies=cookies, headers=csrf, timeout=300)
    assert mine.status_code == 200, mine.text
    theirs = httpx.post(server.url + "/v1/chat/completions", json=body, cookies=cookies, timeout=300,
                        headers={**csrf, "Origin": EVIL})
    assert theirs.status_code == 401 and theirs.json()["detail"] == "Missing API key"


# --- Host ----------------------------------------------------------------------------------------

def test_a_rebound_host_reaches_nothing(srv: LocalmServer) -> None:
    port = srv.url.rsplit(":", 1)[1]
    rebound = f"evil.example:{port}"
    for path in ("/health", "/v1/models"):
        r = httpx.get(srv.url + path, headers={"Host": rebound})
        assert r.status_code == 403 and r.json()["code"] == "host_not_allowed", r.text
    # the page's own origin matches the Host it sent: still not this server's page
    r = chat(srv, RAG, Host=rebound, Origin=f"http://{rebound}")
    assert r.status_code == 403 and SECRET not in r.text
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"app.localhost:{port}"):
        assert httpx.get(srv.url + "/health", headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_names_more(srv: LocalmServer) -> None:
    owner = srv.owner()
    assert httpx.get(srv.url + "/health", headers={"Host": "ai.home.lan"}).status_code == 403
    assert owner.patch("/v1/config", json={"allowed_hosts": ["AI.home.lan"]}).status_code == 200
    try:
        assert httpx.get(srv.url + "/health", headers={"Host": "ai.home.lan:8642"}).status_code == 200
    finally:
        owner.patch("/v1/config", json={"allowed_hosts": None})
    assert httpx.get(srv.url + "/health", headers={"Host": "ai.home.lan"}).status_code == 403


# --- work nobody waits for -----------------------------------------------------------------------

COUNT = "Write the numbers from 1 to 3000, separated by commas."
WHOLE_REPLIES = {
    "openai": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 3000, "temperature": 0,
                                        "messages": [{"role": "user", "content": COUNT}]}),
    "completions": ("/v1/completions", {"model": MODEL, "max_tokens": 3000, "temperature": 0,
                                        "prompt": "1, 2, 3, 4, 5,"}),
    "ollama-chat": ("/api/chat", {"model": MODEL, "stream": False, "options": {"num_predict": 3000,
                                                                               "temperature": 0},
                                  "messages": [{"role": "user", "content": COUNT}]}),
    "ollama-generate": ("/api/generate", {"model": MODEL, "stream": False, "prompt": COUNT,
                                          "options": {"num_predict": 3000, "temperature": 0}}),
    "anthropic": ("/v1/messages", {"model": MODEL, "max_tokens": 3000, "temperature": 0,
                                   "messages": [{"role": "user", "content": COUNT}]}),
    "responses": ("/v1/responses", {"model": MODEL, "max_output_tokens": 3000, "temperature": 0, "input": COUNT}),
}


def busy(server: LocalmServer) -> int:
    return int(httpx.get(f"{server.url}/v1/models/{MODEL}").json().get("busy") or 0)


def wait_for(check: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("surface", list(WHOLE_REPLIES))
def test_a_whole_reply_stops_when_its_client_leaves(srv: LocalmServer, surface: str) -> None:
    path, body = WHOLE_REPLIES[surface]
    chat(srv, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})  # loaded
    assert wait_for(lambda: busy(srv) == 0, 60)
    payload = json.dumps(body).encode()
    host, port = srv.url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)))
    conn.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    try:
        assert wait_for(lambda: busy(srv) >= 1, 120), "the generation never started"
    finally:
        conn.close()  # the client gives up before the reply is whole
    # 3,000 tokens would keep the model busy for minutes; the work stops with its client
    assert wait_for(lambda: busy(srv) == 0, 30), f"{surface}: still generating after its client left"


# --- compaction's cost -----------------------------------------------------------------------------

def test_ten_thousand_empty_messages_are_refused_before_any_summary(srv: LocalmServer) -> None:
    # 180 KB, inside the 10,000-message limit: it once kept the model summarising for 24 minutes
    r = chat(srv, {"messages": [{"role": "tool"}] * 10_000, "max_tokens": 4})
    assert r.status_code == 413, r.text
    detail = r.json()["detail"]
    assert detail.startswith("Compacting this conversation means summarising ") and "compaction_max_tokens" in detail
    assert r.json()["code"] == "context_length_exceeded"
    assert "x-localm-context-compacted" not in r.headers


def test_compaction_stays_within_its_setting(srv: LocalmServer) -> None:
    owner = srv.owner()
    assert owner.post("/v1/plugins/chat/settings", json={"compaction_max_tokens": 1000}).status_code == 200
    try:
        # 2,000 empty tool messages: about 12,000 tokens to summarise, more than one pass of the model
        r = chat(srv, {"messages": [{"role": "tool"}] * 2000, "max_tokens": 4})
        assert r.status_code == 413 and "one request may have summarised" in r.json()["detail"], r.text
        # a conversation of more messages than the window and the budget hold is refused unread
        assert owner.post("/v1/plugins/chat/settings", json={"compaction_max_tokens": 0}).status_code == 200
        many = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] * 4500
        r = chat(srv, {"messages": [*many, {"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 413 and r.json()["detail"].startswith("The conversation holds 9001 messages"), r.text
    finally:
        owner.post("/v1/plugins/chat/settings", json={"compaction_max_tokens": None})


# --- the server itself --------------------------------------------------------------------------------

def test_a_plugin_whose_import_blocks_does_not_freeze_the_server(localm_server: Any, tmp_path: Path) -> None:
    signals = tmp_path / "signals"
    signals.mkdir()
    server = localm_server(plugins=["chat", "llamacpp", "slowimport"], env={"LOCALM_PLUGIN_STORE": str(TEST_STORE),
                                                  "SLOWIMPORT_DIR": str(signals)})
    done: list[httpx.Response] = []
    install = threading.Thread(target=lambda: done.append(
        server.owner().post("/api/plugins/slowimport/install", timeout=120)))
    install.start()
    try:
        assert wait_for(lambda: (signals / "importing").exists(), 60), "the plugin's import never began"
        health = httpx.get(server.url + "/health", timeout=30)  # answered while the import still blocks
        assert health.status_code == 200 and not done
    finally:
        (signals / "release").touch()
        install.join(120)
    assert done and done[0].status_code == 200, done
    assert httpx.get(server.url + "/api/slowimport/ping").json() == {"imported": True}


def test_a_killed_writers_temporary_files_are_removed_at_start(localm_server: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "plugin-data" / "memory").mkdir(parents=True)
    dead = data / ".config.json.999999999.abcd1234.tmp"  # no process has that id
    dead.write_text("{")
    deep = data / "plugin-data" / "memory" / ".facts.json.999999999.zz_y0123.tmp"
    deep.write_text("{")
    alive = data / f".keys.json.{os.getppid()}.abcd1234.tmp"  # a live process still writing
    alive.write_text("[")
    user = data / "notes.tmp"  # not a temporary file of ours
    user.write_text("mine")
    localm_server(data_dir=data, plugins=["chat"])
    assert not dead.exists() and not deep.exists()
    assert alive.exists() and user.exists()


def test_a_write_killed_midway_leaves_nothing_after_the_next_start(localm_server: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "config.json").write_text('{"log_level": "info"}\n')
    # a process killed while its write reaches the disk (SIGKILL from inside fsync)
    child = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from localm.kernel import storage\n"
        "storage.os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)\n"
        "storage.atomic_write_json(Path(sys.argv[1]), {'log_level': 'debug'})\n"), str(data / "config.json")])
    assert child.returncode == -9
    left = [p.name for p in data.iterdir() if p.name.endswith(".tmp")]
    assert left and left[0].startswith(".config.json."), left
    assert json.loads((data / "config.json").read_text()) == {"log_level": "info"}  # the old file stands
    localm_server(data_dir=data, plugins=["chat"])
    assert not [p for p in data.iterdir() if p.name.endswith(".tmp")]
