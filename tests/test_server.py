"""The server process: port choice, shutdown, restart, metrics, errors, OpenAPI."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import offline_cli


def test_busy_port_moves_to_the_next_free_one(server: Any) -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    busy = blocker.getsockname()[1]
    try:
        s = server(args=["--port", str(busy)])
        assert s.port != busy and busy < s.port <= busy + 50
        assert f"port {busy} is busy; serving on {s.port} instead" in s.log()
    finally:
        blocker.close()


def test_health_is_public_and_reports_no_engine(server: Any) -> None:
    s = server(plugins=[])  # the chat plugin is protected and runs; no engine plugin does
    r = s.client().get("/health")
    assert r.status_code == 503
    assert r.json()["status"] == "no_engine" and r.json()["loaded"] is False


@pytest.mark.server_process
def test_shutdown(server: Any) -> None:
    s = server()
    assert s.owner().post("/v1/server/shutdown").json() == {"stopping": True}
    assert s.proc is not None and s.proc.wait(timeout=20) == 0
    assert not (s.data_dir / "server.json").exists()


@pytest.mark.server_process
def test_restart_comes_back_on_the_same_port(server: Any) -> None:
    s = server()
    before = s.owner().get("/v1/config").json()
    assert s.owner().post("/v1/server/restart").json() == {"restarting": True}
    old_token = s.token
    s.wait_restarted(old_token)
    assert s.port == before["instance_port"] and s.token != old_token
    after = s.owner().get("/v1/config").json()
    assert after["instance_id"] != before["instance_id"] and after["instance_port"] == before["instance_port"]
    assert "localm restarted on" in s.log()


def test_metrics_404_until_enabled_then_admin_only(server: Any, tmp_path: Path) -> None:
    s = server()
    assert s.owner().get("/metrics").status_code == 404
    data_dir = tmp_path / "data"
    offline_cli(data_dir, "config", "set", "metrics_enabled", "true")
    owner_key = offline_cli(data_dir, "key", "generate").strip()
    reader = offline_cli(data_dir, "key", "create", "--scope", "config:read").strip()
    m = server(data_dir=data_dir)
    m.client(reader).get("/v1/config")
    m.client(reader).get("/api/jobs/job_abc")
    m.client(reader).get("/no/such/route")
    assert m.client(reader).get("/metrics").status_code == 403
    assert m.client().get("/metrics").status_code == 401
    r = m.client(owner_key).get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'localm_http_requests_total{method="GET",route="/v1/config",status="200"} 1' in text
    assert 'localm_http_requests_total{method="GET",route="/api/jobs/{job_id}",status="404"} 1' in text
    assert 'route="other",status="404"' in text
    assert "job_abc" not in text
    assert "localm_http_request_duration_seconds_bucket" in text and "localm_http_requests_in_flight" in text
    assert "localm_models_loaded 0" in text


def test_metrics_in_open_mode_need_the_attach_token(server: Any) -> None:
    s = server(env={"LOCALM_METRICS": "1"})
    assert s.client().get("/metrics").status_code == 403
    assert s.owner().get("/metrics").status_code == 200


def test_defect_is_an_opaque_500(server: Any) -> None:
    s = server()
    s.owner().post("/api/plugins/guard/install")
    r = s.owner().get("/guard/boom")
    assert r.status_code == 500 and r.json() == {"detail": "Internal server error"}
    assert "/srv/secret/path" in s.log()  # the cause goes to the server log


def test_body_that_fails_validation_is_422_with_errors(server: Any) -> None:
    s = server()
    s.owner().post("/api/plugins/guard/install")
    assert s.owner().post("/guard/typed", json={"count": 3, "label": "x"}).json() == {"count": 3}
    r = s.owner().post("/guard/typed", json={"count": "three"})
    assert r.status_code == 422
    body = r.json()
    assert isinstance(body["detail"], str) and "count" in body["detail"]
    assert isinstance(body["errors"], list) and body["errors"]


def test_inference_routes_take_any_origin_and_need_no_token_in_open_mode(server: Any) -> None:
    s = server()
    s.owner().post("/api/plugins/guard/install")
    r = s.client().get("/v1/guard/infer", headers={"Origin": "chrome-extension://abcdef"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "chrome-extension://abcdef"
    assert s.client().get("/guard/ping", headers={"Origin": "chrome-extension://abcdef"}).status_code == 403


def test_cors_origins_widens_the_allowlist(server: Any) -> None:
    s = server()
    app = "https://notes.example"
    assert s.owner().get("/v1/config", headers={"Origin": app}).status_code == 403
    s.owner().patch("/v1/config", json={"cors_origins": [app]})
    r = s.owner().get("/v1/config", headers={"Origin": app})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == app


def test_openapi_follows_the_active_plugins(server: Any) -> None:
    s = server()
    owner = s.owner()

    def paths() -> set[str]:
        return set(owner.get("/openapi/openapi.json").json()["paths"])

    assert "/v1/config" in paths() and "/guard/ping" not in paths()
    owner.post("/api/plugins/jobber/install")
    assert "/jobber/start" in paths()
    owner.post("/api/plugins/jobber/disable")
    assert "/jobber/start" not in paths()


def test_server_file_is_private(server: Any) -> None:
    s = server()
    info = s.data_dir / "server.json"
    assert info.stat().st_mode & 0o777 == 0o600
    assert json.loads(info.read_text())["token"] == s.token
    assert httpx.get(f"{s.url}/api/plugins", headers={"Authorization": "Bearer " + s.token}).status_code == 200
