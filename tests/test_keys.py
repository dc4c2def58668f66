"""API keys, the owner key and browser sessions on a real server."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import offline_cli


def never_on_disk(data_dir: Path, secret: str) -> None:
    for path in data_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), f"{path} holds a plaintext key"


@pytest.fixture
def keyed(server: Any, tmp_path: Path) -> Any:
    data_dir = tmp_path / "data"
    owner = offline_cli(data_dir, "key", "generate").strip()
    return server(data_dir=data_dir), owner


def test_minted_key_shown_once_stored_hashed_and_scoped(keyed: Any) -> None:
    s, owner = keyed
    admin = s.client(owner)
    minted = admin.post("/v1/keys", json={"name": "reader", "scopes": ["config:read"], "expires_in": 3600}).json()
    assert minted["key"].startswith("lm-") and minted["scopes"] == ["config:read"] and minted["name"] == "reader"
    assert minted["expires"] > time.time()
    listed = admin.get("/v1/keys").json()
    assert listed["is_owner"] is True
    assert [k["id"] for k in listed["keys"]] == [minted["id"]]
    assert "key" not in listed["keys"][0] and minted["key"] not in json.dumps(listed)
    never_on_disk(s.data_dir, minted["key"])
    never_on_disk(s.data_dir, owner)
    reader = s.client(minted["key"])
    assert reader.get("/v1/config").status_code == 200
    assert reader.patch("/v1/config", json={}).status_code == 403
    assert admin.delete(f"/v1/keys/{minted['id']}").json() == {"status": "revoked", "id": minted["id"]}
    assert reader.get("/v1/config").status_code == 401
    assert admin.delete(f"/v1/keys/{minted['id']}").status_code == 404


def test_last_used_is_recorded(keyed: Any) -> None:
    s, owner = keyed
    minted = s.client(owner).post("/v1/keys", json={"name": "x", "scopes": ["config:read"]}).json()
    assert s.client(owner).get("/v1/keys").json()["keys"][0]["last_used"] is None
    s.client(minted["key"]).get("/v1/config")
    assert s.client(owner).get("/v1/keys").json()["keys"][0]["last_used"] > time.time() - 60


def test_expired_key_is_refused(keyed: Any) -> None:
    s, owner = keyed
    minted = s.client(owner).post("/v1/keys", json={"name": "brief", "scopes": [], "expires_in": 0.5}).json()
    assert s.client(minted["key"]).get("/api/jobs").status_code == 200
    time.sleep(0.8)
    r = s.client(minted["key"]).get("/api/jobs")
    assert r.status_code == 401 and r.json() == {"detail": "API key expired"}


@pytest.mark.parametrize("body, status, detail", [
    ({"name": "x", "scopes": "config:read"}, 400, "scopes must be a list"),
    ({"name": "x", "scopes": ["Not A Scope!"]}, 400, "Unknown scope: Not A Scope!"),
    ({"name": "x", "scopes": [], "expires_in": "soon"}, 400, "expires_in must be"),
    ({"name": "x", "scopes": [], "expires": "tomorrow"}, 400, "expires must be"),
    ({"name": "x", "scopes": [], "rag_roots": "/home"}, 400, "rag_roots must be"),
    ({"name": "x", "scopes": [], "fs_access": "root"}, 400, "fs_access must be"),
])
def test_mint_refusals_write_nothing(keyed: Any, body: dict[str, Any], status: int, detail: str) -> None:
    s, owner = keyed
    before = (s.data_dir / "keys.json").read_bytes() if (s.data_dir / "keys.json").exists() else None
    r = s.client(owner).post("/v1/keys", json=body)
    assert r.status_code == status and r.json()["detail"].startswith(detail)
    after = (s.data_dir / "keys.json").read_bytes() if (s.data_dir / "keys.json").exists() else None
    assert after == before


def test_plugin_scopes_and_plugin_names_are_mintable(keyed: Any) -> None:
    s, owner = keyed
    r = s.client(owner).post("/v1/keys", json={"name": "x", "scopes": ["jobber", "some_future_plugin"]})
    assert r.status_code == 200
    assert any("some_future_plugin" in w for w in r.json()["warnings"])


def test_only_the_owner_grants_privileged_scopes(keyed: Any) -> None:
    s, owner = keyed
    keymaster = s.client(owner).post("/v1/keys", json={"name": "km", "scopes": ["keys:admin"]}).json()["key"]
    km = s.client(keymaster)
    for body in ({"scopes": ["admin"]}, {"scopes": ["config:write"]}, {"scopes": ["keys:admin"]},
                 {"scopes": [], "fs_access": "host"}, {"scopes": [], "rag_roots": ["/srv"]}):
        r = km.post("/v1/keys", json={"name": "escalate", **body})
        assert r.status_code == 403, body
    ok = km.post("/v1/keys", json={"name": "reader", "scopes": ["config:read"]})
    assert ok.status_code == 200
    assert km.get("/v1/keys").json()["is_owner"] is False
    assert s.client(owner).post("/v1/keys", json={"name": "a", "scopes": ["admin"]}).status_code == 200


def test_unreadable_key_store_is_409_and_untouched(keyed: Any) -> None:
    s, owner = keyed
    garbage = b"[{]"
    (s.data_dir / "keys.json").write_bytes(garbage)
    admin = s.client(owner)  # the owner key still works: it lives in its own file
    assert admin.get("/v1/keys").status_code == 409
    assert admin.post("/v1/keys", json={"name": "x", "scopes": []}).status_code == 409
    assert admin.delete("/v1/keys/key_x").status_code == 409
    assert (s.data_dir / "keys.json").read_bytes() == garbage


def test_rotate_owner_key(keyed: Any) -> None:
    s, owner = keyed
    rolled = s.client(owner).post("/api/auth/key/rotate").json()
    assert rolled["rotated"] and rolled["active"] and rolled["warnings"] == []
    assert s.client(owner).get("/v1/config").status_code == 401
    new = rolled["key"]
    chosen = "my-own-chosen-owner-key-123"
    assert s.client(new).post("/api/auth/key/rotate", json={"key": chosen}).json()["key"] == chosen
    r = s.client(chosen).post("/api/auth/key/rotate", json={"key": "short"})
    assert r.status_code == 400 and r.json()["detail"].startswith("Key too short")
    r = s.client(chosen).post("/api/auth/key/rotate", json={"key": "has space in it 1234567"})
    assert r.status_code == 400
    assert s.client(chosen).post("/api/auth/key/rotate", content=b"[1]").status_code == 400
    assert s.client(chosen).get("/v1/config").status_code == 200  # the previous key stays
    never_on_disk(s.data_dir, chosen)


def test_rotate_reports_an_environment_override(server: Any) -> None:
    env_key = "environment-owner-key-0123456789"
    s = server(env={"LOCALM_API_KEY": env_key})
    r = s.client(env_key).post("/api/auth/key/rotate").json()
    assert r["active"] is False and "LOCALM_API_KEY" in r["warnings"][0]
    assert s.client(env_key).get("/v1/config").status_code == 200
    assert s.client(r["key"]).get("/v1/config").status_code == 401


def test_clear_returns_to_open_mode_and_signs_out_sessions(keyed: Any) -> None:
    s, owner = keyed
    login = s.client().post("/api/session", json={"key": owner})
    cookie = login.cookies["localm_session"]
    assert s.client(owner).post("/api/auth/key/clear").json() == {"cleared": True, "warnings": []}
    assert not (s.data_dir / "owner_key.json").exists()
    assert s.client().get("/api/session").json()["required"] is False
    assert s.client().get("/v1/config").status_code == 403  # open mode: the attach token's gate
    assert s.owner().get("/v1/config").status_code == 200
    assert json.loads((s.data_dir / "sessions.json").read_text()) == {}
    assert s.client(cookies={"localm_session": cookie}).get("/api/session").json()["authed"] is False


def test_owner_key_warning(server: Any, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir(parents=True)
    (data_dir / "owner_key.json").write_text("{}")
    s = server(data_dir=data_dir)
    warning = s.owner().get("/v1/keys").json()["owner_key_warning"]
    assert "owner_key.json" in warning and "keyless" in warning
    assert s.client().get("/api/session").json()["required"] is False


# --- sessions ----------------------------------------------------------------------

def test_session_cookie_and_csrf(keyed: Any) -> None:
    s, owner = keyed
    browser = s.client()
    login = browser.post("/api/session", json={"key": owner})
    assert login.status_code == 200
    body = login.json()
    assert body["authed"] is True and body["scopes"] == ["admin"] and body["csrf"]
    set_cookie = login.headers["set-cookie"]
    assert "HttpOnly" in set_cookie and "samesite=strict" in set_cookie.lower()
    state = browser.get("/api/session").json()
    assert state == {"authed": True, "scopes": ["admin"], "required": True, "csrf": body["csrf"],
                     "session_mode": "metadata"}
    assert browser.get("/v1/config").status_code == 200
    r = browser.patch("/v1/config", json={"suggest_plugins": False})
    assert r.status_code == 403 and "CSRF" in r.json()["detail"]
    r = browser.patch("/v1/config", json={"suggest_plugins": False}, headers={"X-CSRF-Token": "wrong"})
    assert r.status_code == 403
    r = browser.patch("/v1/config", json={"suggest_plugins": False}, headers={"X-CSRF-Token": body["csrf"]})
    assert r.status_code == 200
    assert browser.post("/api/session/logout").status_code == 403
    out = browser.post("/api/session/logout", headers={"X-CSRF-Token": body["csrf"]})
    assert out.json() == {"authed": False, "warnings": []}
    assert browser.get("/v1/config").status_code == 401
    never_on_disk(s.data_dir, login.cookies["localm_session"])


def test_session_follows_its_key(keyed: Any) -> None:
    s, owner = keyed
    minted = s.client(owner).post("/v1/keys", json={"name": "b", "scopes": ["config:read"]}).json()
    browser = s.client()
    login = browser.post("/api/session", headers={"Authorization": f"Bearer {minted['key']}"})
    assert login.json()["scopes"] == ["config:read"]
    assert browser.get("/v1/config").status_code == 200
    assert browser.get("/v1/keys").status_code == 403
    s.client(owner).delete(f"/v1/keys/{minted['id']}")
    assert browser.get("/v1/config").status_code == 401


def test_session_with_a_bad_key(keyed: Any) -> None:
    s, _ = keyed
    assert s.client().post("/api/session", json={"key": "lm-nope-nope-nope-nope"}).status_code == 401
    assert s.client().post("/api/session", json={}).status_code == 401
