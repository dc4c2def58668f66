"""Every kernel route × every kind of caller, against real servers on loopback.

Callers: no key, a wrong key, a key without the route's scope, a key with exactly the
route's scope, the owner key, a cross-origin browser; and in open mode, with and
without the attach token. A route's answer either comes from the guard (a refusal
with the spec's status and message) or from the route itself (anything else).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from conftest import offline_cli, refused_by_guard


@attrs.frozen
class R:
    method: str
    path: str
    scope: str | None  # None: any valid key
    access: str = "managed"
    body: Any = None
    destructive: bool = False  # the right caller would stop the server or drop the owner key
    own_status: int | None = None  # what a public route answers any caller in key mode

    @property
    def id(self) -> str:
        return f"{self.method} {self.path}"


ROUTES = [
    R("GET", "/health", None, access="public", own_status=503),
    R("GET", "/localm-ca.crt", None, access="public", own_status=404),  # HTTPS never set up: no CA
    R("GET", "/v1/config", "config:read"),
    R("PATCH", "/v1/config", "config:write", body={}),
    R("GET", "/v1/config/schema", "config:read"),
    R("GET", "/v1/plugins/settings", "config:read"),
    R("POST", "/v1/plugins/nosuch/settings", "config:write", body={}),
    R("GET", "/api/plugins", "plugins:read"),
    R("POST", "/api/plugins/nosuch/install", "plugins:admin"),
    R("POST", "/api/plugins/nosuch/uninstall", "plugins:admin"),
    R("POST", "/api/plugins/nosuch/enable", "plugins:admin"),
    R("POST", "/api/plugins/nosuch/disable", "plugins:admin"),
    R("POST", "/api/plugins/refresh", "plugins:admin"),
    R("POST", "/api/plugins/nosuch/refresh", "plugins:admin"),
    R("POST", "/api/plugins/install-external", "plugins:admin", body={"source": ""}),
    R("POST", "/api/plugins/nosuch/install-deps", "plugins:admin"),
    R("GET", "/api/plugins/nosuch/install-deps/events", "plugins:admin"),
    R("GET", "/v1/keys", "keys:admin"),
    R("POST", "/v1/keys", "keys:admin", body={"name": "x", "scopes": "not-a-list"}),
    R("DELETE", "/v1/keys/key_nosuch", "keys:admin"),
    R("POST", "/api/auth/key/rotate", "admin", body={"key": 12345}),
    R("POST", "/api/auth/key/clear", "config:write", destructive=True),
    R("GET", "/api/session", None, access="session", own_status=200),
    R("POST", "/api/session", None, access="session", body={"key": "lm-not-a-real-key-at-all"}, own_status=401),
    R("POST", "/api/session/logout", None, access="session", own_status=200),
    R("GET", "/api/jobs", None),
    R("GET", "/api/jobs/job_nosuch", None),
    R("GET", "/api/jobs/job_nosuch/events", None),
    R("POST", "/api/jobs/job_nosuch/cancel", None),
    R("POST", "/v1/server/shutdown", "config:write", destructive=True),
    R("POST", "/v1/server/restart", "config:write", destructive=True),
    R("GET", "/api/changelog", "config:read"),
    R("GET", "/api/issues", "config:read"),
    R("POST", "/api/bug-report", "config:write", body={"upload": True, "description": "refused: saves nothing"}),
    R("POST", "/api/bug-report/send", "config:write", body={"filename": "../config.json", "sha256": "0" * 64}),
    R("GET", "/metrics", "admin"),
    R("GET", "/api/update/check", "config:read"),
    R("POST", "/api/update/apply", "config:write"),
    R("GET", "/api/update/rollback", "config:read"),
    R("POST", "/api/update/rollback", "admin"),
    R("GET", "/v1/models", "models:read", access="open_read", own_status=200),
    R("GET", "/v1/models/nope", "models:read", access="open_read", own_status=404),
    R("GET", "/api/models/loaded", "models:read", access="open_read", own_status=200),
    R("GET", "/api/models", "models:read", access="open_read", own_status=200),
    # another instance's routes: no bearer key, an instance vouch, which no caller here has
    R("GET", "/v1/instances/status?nonce=n1", None, access="public", own_status=403),
    R("POST", "/v1/instances/vouch", None, access="public", own_status=403),
    R("POST", "/v1/instances/cooperate-unload", None, access="public", own_status=403),
    R("POST", "/v1/models/load?model=nope", "models:write"),
    R("POST", "/v1/models/unload?model=nope", "models:write"),
    R("POST", "/v1/models/rename?model=nope&new_name=x", "models:write"),
    R("POST", "/v1/chat/completions", None, access="inference", own_status=404,
      body={"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
    R("POST", "/v1/completions", None, access="inference", own_status=404, body={"model": "nope", "prompt": "hi"}),
    R("POST", "/v1/embeddings", None, access="inference", own_status=404, body={"model": "nope", "input": "hi"}),
    R("POST", "/v1/rerank", None, access="inference", own_status=404,
      body={"model": "nope", "query": "hi", "documents": ["a"]}),
]
SCOPES = sorted({r.scope for r in ROUTES if r.scope})
UNRELATED = "guard"  # a scope no kernel route asks for
EVIL = "http://evil.example"


def call(client: Any, route: R, **headers: str) -> Any:
    kwargs: dict[str, Any] = {"headers": headers}
    if route.body is not None:
        kwargs["json"] = route.body
    return client.request(route.method, route.path, **kwargs)


@pytest.fixture(scope="module")
def keyed(module_server: Any) -> Any:
    keys: dict[str, str] = {}

    def prepare(data_dir: Path) -> None:
        keys["owner"] = offline_cli(data_dir, "key", "generate").strip()
        for scope in [*SCOPES, UNRELATED]:
            keys[scope] = offline_cli(data_dir, "key", "create", "--name", scope, "--scope", scope).strip()
        keys["any"] = offline_cli(data_dir, "key", "create", "--name", "no scopes").strip()

    server = module_server(prepare=prepare, env={"LOCALM_METRICS": "1"}, plugins=[])
    return server, keys


@pytest.fixture(scope="module")
def open_server(module_server: Any) -> Any:
    return module_server(env={"LOCALM_METRICS": "1"}, plugins=[])


def answered_by_route(response: Any) -> bool:
    return not refused_by_guard(response) and response.status_code != 401


# --- key mode ----------------------------------------------------------------------

@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.id)
def test_no_key(keyed: Any, route: R) -> None:
    server, _ = keyed
    r = call(server.client(), route)
    if route.access in ("public", "session"):
        assert r.status_code == route.own_status, r.text
    else:
        assert r.status_code == 401 and r.json()["detail"] == "Missing API key"
        assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.id)
def test_wrong_key(keyed: Any, route: R) -> None:
    server, _ = keyed
    r = call(server.client("lm-this-key-was-never-minted-000000"), route)
    if route.access in ("public", "session"):
        assert r.status_code == route.own_status, r.text
    else:
        assert r.status_code == 401 and r.json()["detail"] == "Invalid API key"


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.id)
def test_key_without_the_scope(keyed: Any, route: R) -> None:
    server, keys = keyed
    r = call(server.client(keys[UNRELATED]), route)
    if route.access in ("public", "session"):
        assert r.status_code == route.own_status, r.text
    elif route.scope is None:
        assert answered_by_route(r), r.text
    else:
        assert r.status_code == 403
        assert r.json()["detail"] == f"Key lacks required scope: {route.scope}"


@pytest.mark.parametrize("route", [r for r in ROUTES if not r.destructive], ids=lambda r: r.id)
@pytest.mark.parametrize("who", ["scope", "owner"])
def test_right_key(keyed: Any, route: R, who: str) -> None:
    server, keys = keyed
    key = keys["owner"] if who == "owner" else keys[route.scope or "any"]
    r = call(server.client(key), route)
    if route.access in ("public", "session"):
        assert r.status_code == route.own_status, r.text
    else:
        assert answered_by_route(r), r.text
    assert r.status_code < 500 or route.path == "/health", r.text


@pytest.mark.parametrize("route", [r for r in ROUTES if r.access not in ("public", "inference")], ids=lambda r: r.id)
def test_cross_origin_refused(keyed: Any, route: R) -> None:
    server, keys = keyed
    r = call(server.client(keys["owner"]), route, Origin=EVIL)
    assert r.status_code == 403
    assert r.json()["detail"].startswith(f"Cross-origin request refused: {EVIL}")
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("route", [r for r in ROUTES if r.access == "inference"], ids=lambda r: r.id)
def test_inference_routes_accept_any_origin(keyed: Any, route: R) -> None:
    server, keys = keyed
    r = call(server.client(keys["any"]), route, Origin=EVIL)
    assert r.status_code == route.own_status and r.headers["access-control-allow-origin"] == EVIL


def test_cross_origin_preflight_refused(keyed: Any) -> None:
    server, _ = keyed
    r = server.client().options("/v1/config", headers={"Origin": EVIL, "Access-Control-Request-Method": "PATCH"})
    assert r.status_code == 403


def test_localhost_origin_gets_cors_headers(keyed: Any) -> None:
    server, keys = keyed
    origin = "http://localhost:5173"
    pre = server.client().options("/v1/config", headers={"Origin": origin, "Access-Control-Request-Method": "GET",
                                                         "Access-Control-Request-Headers": "authorization"})
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == origin
    assert "authorization" in pre.headers["access-control-allow-headers"]
    r = server.client(keys["config:read"]).get("/v1/config", headers={"Origin": origin})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin


def test_public_health_answers_any_origin_without_cors_headers(keyed: Any) -> None:
    server, _ = keyed
    r = server.client().get("/health", headers={"Origin": EVIL})
    assert not refused_by_guard(r)
    assert "access-control-allow-origin" not in r.headers


def test_write_scope_implies_read(keyed: Any) -> None:
    server, keys = keyed
    assert server.client(keys["config:write"]).get("/v1/config").status_code == 200
    assert server.client(keys["plugins:admin"]).get("/api/plugins").status_code == 200
    assert server.client(keys["config:read"]).patch("/v1/config", json={}).status_code == 403


def test_admin_scope_implies_every_scope(keyed: Any) -> None:
    server, keys = keyed
    admin = server.client(keys["admin"])
    for route in ROUTES:
        if not route.destructive and route.access == "managed":
            assert answered_by_route(call(admin, route)), route.id


def test_attach_token_acts_as_owner_from_loopback(keyed: Any) -> None:
    server, _ = keyed
    assert server.owner().get("/v1/keys").json()["is_owner"] is True


# --- open mode ------------------------------------------------------------------------

@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.id)
def test_open_mode_without_attach_token(open_server: Any, route: R) -> None:
    r = call(open_server.client(), route)
    exempt = route.access in ("public", "inference", "open_read") or (route.access == "session"
                                                                     and route.method == "GET")
    if exempt:
        assert r.status_code == (route.own_status or 200), r.text
    else:
        assert r.status_code == 403
        assert r.json() == {"detail": "Open-mode management requires the localm GUI shell on this machine, "
                                      "or an API key"}


@pytest.mark.parametrize("route", [r for r in ROUTES if not r.destructive], ids=lambda r: r.id)
def test_open_mode_with_attach_token(open_server: Any, route: R) -> None:
    r = call(open_server.owner(), route)
    assert answered_by_route(r), r.text
    assert r.status_code < 500 or route.path == "/health", r.text


@pytest.mark.parametrize("route", [r for r in ROUTES if r.access not in ("public", "inference")], ids=lambda r: r.id)
def test_open_mode_cross_origin_refused_even_with_the_token(open_server: Any, route: R) -> None:
    r = call(open_server.owner(), route, Origin=EVIL)
    assert r.status_code == 403
    assert r.json()["detail"].startswith("Cross-origin request refused")


def test_open_mode_wrong_bearer_is_still_gated(open_server: Any) -> None:
    r = open_server.client("lm-some-guess-0000000000000000").get("/v1/config")
    assert r.status_code == 403 and r.json()["detail"].startswith("Open-mode management requires")


def test_open_mode_session_post_with_token_is_400(open_server: Any) -> None:
    r = open_server.owner().post("/api/session", json={"key": "lm-whatever-0000000000000"})
    assert r.status_code == 400
    assert open_server.client().post("/api/session", json={"key": "x"}).status_code == 403
