"""GET/PATCH /v1/config, the schema and plugin settings, against a real server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import filelock
import pytest

from conftest import offline_cli


@pytest.fixture
def keyed(server: Any, tmp_path: Path) -> Any:
    data_dir = tmp_path / "data"
    owner = offline_cli(data_dir, "key", "generate").strip()
    writer = offline_cli(data_dir, "key", "create", "--scope", "config:write").strip()
    s = server(data_dir=data_dir)
    return s, owner, writer


def test_get_returns_defaults_and_read_only_extras(server: Any) -> None:
    s = server()
    cfg = s.owner().get("/v1/config").json()
    assert cfg["port"] == 8642 and cfg["cors_origins"] == [] and cfg["metrics_enabled"] is False
    assert cfg["instance_port"] == s.port and isinstance(cfg["instance_id"], str)


def test_patch_persists_atomically_and_returns_merged(server: Any) -> None:
    s = server()
    owner = s.owner()
    out = owner.patch("/v1/config", json={"suggest_plugins": False, "cors_origins": ["http://app.test"]}).json()
    assert out["suggest_plugins"] is False and out["cors_origins"] == ["http://app.test"]
    on_disk = json.loads((s.data_dir / "config.json").read_text())
    assert on_disk == {"suggest_plugins": False, "cors_origins": ["http://app.test"]}
    # a client may send back what it read: read-only extras are ignored
    assert owner.patch("/v1/config", json=out).status_code == 200
    # null resets a key to its default
    assert owner.patch("/v1/config", json={"suggest_plugins": None}).json()["suggest_plugins"] is True
    assert "suggest_plugins" not in json.loads((s.data_dir / "config.json").read_text())


@pytest.mark.parametrize("body, detail", [
    ({"no_such_key": 1}, "Unknown config key: no_such_key"),
    ({"port": "8080"}, "Invalid value for port: expected integer, got a string"),
    ({"port": 70000}, "Invalid value for port: must be at most 65535"),
    ({"suggest_plugins": 1}, "Invalid value for suggest_plugins: expected boolean, got an integer"),
    ({"log_level": "loud"}, "Invalid value for log_level: expected one of"),
    ({"require_auth": True}, "require_auth needs an API key first"),
])
def test_patch_refusals_change_nothing(server: Any, body: dict[str, Any], detail: str) -> None:
    s = server()
    owner = s.owner()
    owner.patch("/v1/config", json={"suggest_plugins": False})
    before = (s.data_dir / "config.json").read_bytes()
    r = owner.patch("/v1/config", json={"suggest_plugins": True, **body})
    assert r.status_code == 400 and r.json()["detail"].startswith(detail)
    assert (s.data_dir / "config.json").read_bytes() == before


def test_patch_body_must_be_an_object(server: Any) -> None:
    s = server()
    assert s.owner().patch("/v1/config", json=[1]).status_code == 400
    assert s.owner().patch("/v1/config", content=b"{nope").status_code == 400


def test_owner_only_keys_hidden_from_and_refused_for_a_non_owner(keyed: Any) -> None:
    s, owner, writer = keyed
    seen = s.client(writer).get("/v1/config").json()
    assert "cors_origins" not in seen and "metrics_enabled" not in seen and "suggest_plugins" in seen
    r = s.client(writer).patch("/v1/config", json={"cors_origins": ["http://x.test"]})
    assert r.status_code == 403 and r.json()["detail"] == "cors_origins is owner-only: it needs an admin key"
    schema = {f["key"] for f in s.client(writer).get("/v1/config/schema").json()["fields"]}
    assert "cors_origins" not in schema and "suggest_plugins" in schema
    assert s.client(writer).patch("/v1/config", json={"suggest_plugins": False}).status_code == 200
    assert s.client(owner).patch("/v1/config", json={"cors_origins": ["http://x.test"]}).status_code == 200
    assert "cors_origins" in {f["key"] for f in s.client(owner).get("/v1/config/schema").json()["fields"]}


def test_plugin_state_refused_to_a_non_owner_naming_the_route(keyed: Any) -> None:
    s, owner, writer = keyed
    r = s.client(writer).patch("/v1/config", json={"plugins_enabled": {"hello": False}})
    assert r.status_code == 403 and "POST /api/plugins/{name}/enable" in r.json()["detail"]
    r = s.client(writer).patch("/v1/config", json={"plugins": {}})
    assert r.status_code == 403 and "POST /v1/plugins/{name}/settings" in r.json()["detail"]
    assert "plugins_enabled" in s.client(writer).get("/v1/config").json()  # still readable


def test_require_auth_with_a_key(keyed: Any) -> None:
    s, owner, _ = keyed
    assert s.client(owner).patch("/v1/config", json={"require_auth": True}).json()["require_auth"] is True


def test_unreadable_config_is_409_and_never_overwritten(server: Any) -> None:
    s = server()
    garbage = b'{"port": 8642, oops'
    (s.data_dir / "config.json").write_bytes(garbage)
    owner = s.owner()
    r = owner.patch("/v1/config", json={"suggest_plugins": False})
    assert r.status_code == 409 and "config.json" in r.json()["detail"]
    assert owner.get("/v1/config").status_code == 409
    assert (s.data_dir / "config.json").read_bytes() == garbage
    # the server keeps serving everything else
    assert owner.get("/api/plugins").status_code == 200


def test_save_that_times_out_is_504_and_leaves_the_file(server: Any) -> None:
    s = server(env={"LOCALM_LOCK_TIMEOUT": "0.5"})
    owner = s.owner()
    owner.patch("/v1/config", json={"suggest_plugins": False})
    before = (s.data_dir / "config.json").read_bytes()
    with filelock.FileLock(str(s.data_dir / "config.json") + ".lock"):
        r = owner.patch("/v1/config", json={"suggest_plugins": True})
    assert r.status_code == 504 and r.json()["code"] == "save_timeout"
    assert (s.data_dir / "config.json").read_bytes() == before


# --- plugin settings ------------------------------------------------------------------

def test_plugin_settings_declared_and_added_at_run_time(server: Any) -> None:
    s = server()
    owner = s.owner()
    assert owner.post("/api/plugins/valves/install").status_code == 200
    listed = {p["plugin"]: p for p in owner.get("/v1/plugins/settings").json()["plugins"]}
    fields = {f["key"]: f for f in listed["valves"]["fields"]}
    assert fields["threshold"]["value"] == 0.5 and fields["webhook"]["owner_only"] is True
    r = owner.post("/v1/plugins/valves/settings", json={"threshold": 0.9})
    assert r.status_code == 200
    assert {f["key"]: f["value"] for f in r.json()["fields"]}["threshold"] == 0.9
    assert owner.get("/valves/values").json() == {"threshold": 0.9, "webhook": ""}
    assert json.loads((s.data_dir / "config.json").read_text())["plugins"]["valves"] == {"threshold": 0.9}
    # a blank value clears the override back to the default
    owner.post("/v1/plugins/valves/settings", json={"threshold": None})
    assert owner.get("/valves/values").json()["threshold"] == 0.5
    schema = {f["key"] for f in owner.get("/v1/config/schema").json()["fields"]}
    assert {"plugins.valves.threshold", "plugins.valves.webhook"} <= schema


@pytest.mark.parametrize("body, status, detail", [
    ({"threshold": 2.0}, 400, "Invalid value for threshold: must be at most 1.0"),
    ({"threshold": "high"}, 400, "Invalid value for threshold: expected number"),
    ({"nope": 1}, 400, "Unknown setting for valves: nope"),
])
def test_plugin_settings_refusals(server: Any, body: dict[str, Any], status: int, detail: str) -> None:
    s = server()
    owner = s.owner()
    owner.post("/api/plugins/valves/install")
    before = (s.data_dir / "config.json").read_bytes()
    r = owner.post("/v1/plugins/valves/settings", json=body)
    assert r.status_code == status and r.json()["detail"].startswith(detail)
    assert (s.data_dir / "config.json").read_bytes() == before


def test_plugin_settings_404_for_inactive_or_unknown(server: Any) -> None:
    s = server()
    owner = s.owner()
    assert owner.post("/v1/plugins/valves/settings", json={}).status_code == 404
    assert owner.post("/v1/plugins/Not-An-Id/settings", json={}).status_code == 404


def test_owner_only_plugin_setting_hidden_from_non_owner(server: Any, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    offline_cli(data_dir, "plugin", "install", "valves")
    offline_cli(data_dir, "key", "generate")
    writer = offline_cli(data_dir, "key", "create", "--scope", "config:write").strip()
    s = server(data_dir=data_dir)
    listed = {p["plugin"]: p for p in s.client(writer).get("/v1/plugins/settings").json()["plugins"]}
    fields = listed["valves"]["fields"]
    assert [f["key"] for f in fields] == ["threshold"]
    r = s.client(writer).post("/v1/plugins/valves/settings", json={"webhook": "http://x"})
    assert r.status_code == 403
