"""Who a caller is and what they may read: GET /whoami, keys in x-api-key, the first key in
open mode, credentials kept apart from config.json, secret and owner-only plugin settings,
and `localm key set` / `localm key recover`; each on a real server."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import offline_cli


@pytest.fixture
def keyed(server: Any, tmp_path: Path) -> Any:
    data_dir = tmp_path / "data"
    owner = offline_cli(data_dir, "key", "generate").strip()
    return server(data_dir=data_dir), owner


def mint(s: Any, owner: str, *scopes: str) -> str:
    return s.client(owner).post("/v1/keys", json={"name": "-".join(scopes) or "any", "scopes": list(scopes)}).json()["key"]


# --- GET /whoami -------------------------------------------------------------------------

def test_whoami_is_public_and_tells_each_caller_who_they_are(keyed: Any) -> None:
    s, owner = keyed
    reader = mint(s, owner, "config:read")
    with httpx.Client(base_url=s.url) as nobody:
        me = nobody.get("/whoami")
    assert me.status_code == 200
    assert me.json() == {"kind": "anonymous", "authed": False, "owner": False, "key_id": None, "name": None,
                         "scopes": [], "via_cookie": False, "fs_access": None, "rag_roots": None, "required": True}
    wrong = s.client("lm-not-a-key-of-this-server").get("/whoami")
    assert wrong.status_code == 200 and wrong.json()["kind"] == "anonymous"  # never a 401
    scoped = s.client(reader).get("/whoami").json()
    assert scoped["kind"] == "key" and scoped["authed"] is True and scoped["owner"] is False
    assert scoped["scopes"] == ["config:read"] and scoped["name"] == "config:read" and scoped["key_id"].startswith("key_")
    assert scoped["fs_access"] == "none" and scoped["rag_roots"] == []
    me = s.client(owner).get("/whoami").json()
    assert me["kind"] == "owner" and me["owner"] is True and me["scopes"] == ["admin"]


def test_whoami_in_open_mode(server: Any, tmp_path: Path) -> None:
    s = server(data_dir=tmp_path / "data")
    with httpx.Client(base_url=s.url) as local:
        me = local.get("/whoami").json()
        page = local.get("/whoami", headers={"Origin": "http://evil.example"})
    assert me["kind"] == "open" and me["required"] is False and me["owner"] is False
    assert page.json()["kind"] == "web"  # a page of another origin: inference only
    assert "access-control-allow-origin" not in page.headers  # and it cannot read the answer


# --- x-api-key -----------------------------------------------------------------------------

def test_x_api_key_works_on_every_api_route_and_the_bearer_wins(keyed: Any) -> None:
    s, owner = keyed
    reader = mint(s, owner, "config:read")
    with httpx.Client(base_url=s.url) as c:
        assert c.get("/v1/config", headers={"x-api-key": reader}).status_code == 200
        assert c.get("/v1/plugins/settings", headers={"x-api-key": reader}).status_code == 200
        assert c.get("/v1/config", headers={"x-api-key": "lm-wrong"}).status_code == 401
        # the bearer token wins, either way round
        assert c.get("/v1/config", headers={"x-api-key": reader, "Authorization": "Bearer lm-wrong"}).status_code == 401
        assert c.get("/v1/config", headers={"x-api-key": "lm-wrong",
                                            "Authorization": f"Bearer {reader}"}).status_code == 200
        # a key in x-api-key holds no more than its scopes
        assert c.patch("/v1/config", headers={"x-api-key": reader}, json={"log_level": "debug"}).status_code == 403
        # signing in takes only the bearer form (or a body)
        assert c.post("/api/session", headers={"x-api-key": reader}).status_code == 401
        assert c.post("/api/session", headers={"Authorization": f"Bearer {reader}"}).status_code == 200


# --- the first key in open mode ----------------------------------------------------------------

def test_the_first_key_in_open_mode_comes_with_an_owner_key_and_a_session(server: Any, tmp_path: Path) -> None:
    s = server(data_dir=tmp_path / "data")
    with s.owner() as local:
        minted = local.post("/v1/keys", json={"name": "webui", "scopes": ["chat"]})
    assert minted.status_code == 200
    body = minted.json()
    owner_key = body["owner_key"]
    assert owner_key.startswith("lm-") and owner_key != body["key"]
    assert any("first key" in w for w in body["warnings"])
    cookie = minted.cookies.get("localm_session")
    assert cookie
    with httpx.Client(base_url=s.url) as nobody:
        assert nobody.get("/v1/config").status_code == 401  # keys are on now
    assert s.client(owner_key).get("/v1/keys").json()["is_owner"] is True
    with httpx.Client(base_url=s.url, cookies={"localm_session": cookie}) as browser:
        assert browser.get("/v1/config").status_code == 200  # the browser that minted it is signed in
        assert browser.get("/whoami").json()["owner"] is True
    # the second key comes alone
    second = s.client(owner_key).post("/v1/keys", json={"name": "other", "scopes": ["chat"]})
    assert "owner_key" not in second.json() and "localm_session" not in second.cookies


def test_the_first_key_from_the_cli_prints_the_owner_key_on_stderr(server: Any, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    s = server(data_dir=data_dir)
    done = s.cli("key", "create", "--name", "ci", "--scope", "chat")
    assert done.returncode == 0, done.stdout + done.stderr
    scoped = done.stdout.strip()
    owner_key = next(line.split(": ", 1)[1] for line in done.stderr.splitlines() if line.startswith("Owner key: "))
    assert s.client(owner_key).get("/whoami").json()["kind"] == "owner"
    assert s.client(scoped).get("/whoami").json()["scopes"] == ["chat"]
    again = s.cli("key", "create", "--name", "ci2", "--scope", "chat")
    assert "Owner key" not in again.stderr


def test_the_first_key_offline_also_seeds_an_owner_key(tmp_path: Path) -> None:
    from localm.kernel.auth import KeyStore
    data_dir = tmp_path / "data"
    offline_cli(data_dir, "key", "create", "--name", "a", "--scope", "chat")
    assert KeyStore(data_dir).owner_hash() is not None


def test_an_environment_owner_key_means_no_seeding(server: Any, tmp_path: Path) -> None:
    s = server(data_dir=tmp_path / "data", env={"LOCALM_API_KEY": "lm-from-the-environment-0123456789"})
    minted = s.client("lm-from-the-environment-0123456789").post("/v1/keys", json={"name": "x", "scopes": ["chat"]})
    assert minted.status_code == 200 and "owner_key" not in minted.json()
    assert not (s.data_dir / "owner_key.json").exists()


# --- credentials.json ----------------------------------------------------------------------------

def test_hf_token_lives_in_an_owner_only_credentials_file(keyed: Any) -> None:
    s, owner = keyed
    admin = s.client(owner)
    assert admin.patch("/v1/config", json={"hf_token": "hf_secret_value_123", "log_level": "debug"}).status_code == 200
    credentials = s.data_dir / "credentials.json"
    assert json.loads(credentials.read_text()) == {"hf_token": "hf_secret_value_123"}
    assert stat.S_IMODE(os.stat(credentials).st_mode) == 0o600
    assert "hf_secret" not in (s.data_dir / "config.json").read_text()
    assert admin.get("/v1/config").json()["hf_token"] == "hf_secret_value_123"
    writer = mint(s, owner, "config:read", "config:write")
    seen = s.client(writer).get("/v1/config").json()
    assert "hf_token" not in seen and "hf_secret" not in json.dumps(seen)
    before = credentials.read_bytes()
    assert s.client(writer).patch("/v1/config", json={"hf_token": "hf_mine"}).status_code == 403
    assert credentials.read_bytes() == before
    from localm.kernel import hub
    assert hub.token(s.data_dir) == "hf_secret_value_123"
    # cleared: back to the default (and the environment's HF_TOKEN)
    assert admin.patch("/v1/config", json={"hf_token": None}).json()["hf_token"] == ""
    assert json.loads(credentials.read_text()) == {}


def test_a_change_with_an_unreadable_credentials_file_writes_nothing(keyed: Any) -> None:
    s, owner = keyed
    credentials = s.data_dir / "credentials.json"
    credentials.write_text("{not json")
    config_before = (s.data_dir / "config.json").read_bytes() if (s.data_dir / "config.json").exists() else None
    r = s.client(owner).patch("/v1/config", json={"hf_token": "hf_x", "log_level": "debug"})
    assert r.status_code == 409 and "credentials.json" in r.json()["detail"]
    assert credentials.read_text() == "{not json"
    after = (s.data_dir / "config.json").read_bytes() if (s.data_dir / "config.json").exists() else None
    assert after == config_before  # config.json untouched too


def test_a_token_an_older_config_json_held_is_read_and_moved(keyed: Any) -> None:
    s, owner = keyed
    config = s.data_dir / "config.json"
    config.write_text(json.dumps({"hf_token": "hf_older"}))
    admin = s.client(owner)
    assert admin.get("/v1/config").json()["hf_token"] == "hf_older"
    assert admin.patch("/v1/config", json={"hf_token": "hf_newer"}).status_code == 200
    assert "hf_token" not in json.loads(config.read_text())
    assert json.loads((s.data_dir / "credentials.json").read_text()) == {"hf_token": "hf_newer"}


# --- owner-only and secret plugin settings --------------------------------------------------------

def test_owner_only_plugin_settings_are_not_in_the_config_a_reader_sees(server: Any, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    owner = offline_cli(data_dir, "key", "generate").strip()
    s = server(data_dir=data_dir, plugins=["chat", "llamacpp"])
    admin = s.client(owner)
    assert admin.post("/v1/plugins/llamacpp/settings",
                      json={"spec_draft_model": "/home/you/models/draft.gguf", "n_threads": 2}).status_code == 200
    assert admin.get("/v1/config").json()["plugins"]["llamacpp"]["spec_draft_model"] == "/home/you/models/draft.gguf"
    reader = mint(s, owner, "config:read")
    seen = s.client(reader).get("/v1/config").json()
    assert seen["plugins"]["llamacpp"] == {"n_threads": 2}
    assert "draft.gguf" not in json.dumps(seen)
    # a block of a plugin this server has not loaded: its settings cannot be told apart, so none shows
    config = json.loads((data_dir / "config.json").read_text())
    config["plugins"]["absent"] = {"api_token": "tok_123"}
    (data_dir / "config.json").write_text(json.dumps(config))
    assert "tok_123" not in s.client(reader).get("/v1/config").text
    assert "tok_123" in admin.get("/v1/config").text


def test_a_secret_setting_is_owner_only() -> None:
    import attrs

    from localm.kernel.settings import fields_of, setting

    @attrs.frozen
    class Settings:
        api_token: str = setting("", secret=True, description="A token")
        label: str = setting("", description="A label")

    fields = {f.key: f for f in fields_of(Settings)}
    assert fields["api_token"].owner_only is True and fields["api_token"].schema()["secret"] is True
    assert fields["label"].owner_only is False


# --- localm key set / recover ----------------------------------------------------------------------

def test_key_set_and_recover(keyed: Any) -> None:
    s, owner = keyed
    chosen = "lm-chosen-owner-key-0123456789abcdef"
    done = s.cli("key", "set", input=chosen + "\n")
    assert done.returncode == 0, done.stdout + done.stderr
    assert chosen not in done.stdout + done.stderr
    assert s.client(chosen).get("/whoami").json()["kind"] == "owner"
    assert s.client(owner).get("/v1/config").status_code == 401  # the old one is gone
    short = s.cli("key", "set", "short")
    assert short.returncode != 0
    assert s.client(chosen).get("/whoami").json()["kind"] == "owner"  # refused: nothing changed
    signed = httpx.post(s.url + "/api/session", json={"key": chosen})
    cookie = signed.cookies["localm_session"]
    reader = mint(s, chosen, "config:read")
    recovered = s.cli("key", "recover")
    assert recovered.returncode == 0, recovered.stdout + recovered.stderr
    fresh = recovered.stdout.strip()
    assert fresh.startswith("lm-") and fresh != chosen
    assert s.client(fresh).get("/whoami").json()["kind"] == "owner"
    assert s.client(chosen).get("/v1/config").status_code == 401
    with httpx.Client(base_url=s.url, cookies={"localm_session": cookie}) as browser:
        assert browser.get("/v1/config").status_code == 401  # every session signed out
    assert s.client(reader).get("/v1/config").status_code == 200  # scoped keys are as they were
