"""Diagnostics on the base server: GET /api/changelog, GET /api/issues, POST /api/bug-report
and POST /api/bug-report/send, the net_mode setting and the bug-report proxy settings.

The bug-report proxy is a real HTTP server on 127.0.0.1 that each test starts
(``proxy`` fixture): it answers issue listings and filings, or 429, or 500, or an answer too
large, or nothing at all (it hangs), and records every request that reached it.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import offline_cli
from localm.kernel import __version__, bugproxy, changelog, netpolicy

ROOT = Path(__file__).resolve().parents[1]
REPORT_ROUTES = ("/api/changelog", "/api/issues", "/api/bug-report", "/api/bug-report/send")
UPLOAD_TOKEN = "proxy-token-0123456789abcdef"


# --- the bug-report proxy ------------------------------------------------------------------

class Proxy:
    """A bug-report proxy on loopback: ``mode`` says how it answers; ``requests`` holds what
    reached it."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.issues: list[Any] = []
        self.requests: list[dict[str, Any]] = []
        self.release = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, value: Any, headers: dict[str, str] | None = None) -> None:
                data = value if isinstance(value, bytes) else json.dumps(value).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, v in (headers or {}).items():
                    self.send_header(key, v)
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, body: bytes) -> None:
                proxy.requests.append({"method": self.command, "path": self.path,
                                       "authorization": self.headers.get("Authorization"), "body": body})
                if proxy.mode == "hang":
                    proxy.release.wait(60)
                    return
                if proxy.mode == "429":
                    self._answer(429, {"error": "slow down"}, {"Retry-After": "120"})
                elif proxy.mode == "500":
                    self._answer(500, {"error": "broken"})
                elif proxy.mode == "deep":
                    self._answer(200, b"[" * 200_000)
                elif proxy.mode == "big":
                    self._answer(200, b"[" + b" " * (bugproxy.MAX_ANSWER_BYTES + 10) + b"]")
                elif self.command == "GET":
                    self._answer(200, proxy.issues)
                else:
                    self._answer(201, {"url": "https://tracker.example/issues/7"})

            def do_GET(self) -> None:
                self._handle(b"")

            def do_POST(self) -> None:
                self._handle(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    p = Proxy()
    yield p
    p.close()


@pytest.fixture
def quick_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy's time limit, one second (the in-process server's; a server process keeps its
    ten seconds, which the hanging proxy outlasts too)."""
    monkeypatch.setattr(bugproxy, "TIMEOUT", 1.0)


@pytest.fixture
def keyed(server: Any, tmp_path: Path) -> Any:
    """A server with an owner key, a config:write key and a config:read key."""
    data_dir = tmp_path / "data"
    owner = offline_cli(data_dir, "key", "generate").strip()
    writer = offline_cli(data_dir, "key", "create", "--name", "writer", "--scope", "config:write").strip()
    reader = offline_cli(data_dir, "key", "create", "--name", "reader", "--scope", "config:read").strip()
    other = offline_cli(data_dir, "key", "create", "--name", "models", "--scope", "models:read").strip()
    s = server(data_dir=data_dir, plugins=[])
    return s, {"owner": owner, "writer": writer, "reader": reader, "other": other}


def use_proxy(s: Any, proxy: Proxy, **more: Any) -> None:
    r = s.owner().patch("/v1/config", json={"bugreport_upload_url": proxy.url,
                                            "bugreport_upload_token": UPLOAD_TOKEN, **more})
    assert r.status_code == 200, r.text


def report(http: Any, **body: Any) -> dict[str, Any]:
    r = http.post("/api/bug-report", json=body or {"description": "The chat stops after one word"})
    assert r.status_code == 200, r.text
    return r.json()


def saved(s: Any) -> list[str]:
    folder = s.data_dir / "reports"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


# --- the changelog ---------------------------------------------------------------------------

def test_the_routes_are_on_a_headless_server_and_the_changelog_is_served(keyed: Any) -> None:
    s, keys = keyed
    paths = set(s.owner().get("/openapi/openapi.json").json()["paths"])
    assert set(REPORT_ROUTES) <= paths
    r = s.client(keys["reader"]).get("/api/changelog")
    assert r.status_code == 200
    body = r.json()
    assert body["available"] is True and body["version"] == __version__
    assert "[Unreleased]" not in body["markdown"] and f"## [{__version__}] - " in body["markdown"]
    assert body["markdown"].startswith("# Changelog")
    whole = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in whole and changelog.released(whole) == body["markdown"]
    # the build's version has its entry: the newest release in the file is this one
    assert changelog.newest_release(whole) == __version__
    # the kernel package holds it (a link in the source tree, a copy in a wheel)
    assert changelog.locate() == Path(__file__).resolve().parents[1] / "kernel" / "CHANGELOG.md"
    assert s.client(keys["other"]).get("/api/changelog").status_code == 403


def test_a_build_without_a_changelog_says_so(server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = server(data_dir=tmp_path / "data", plugins=[])
    if s.process:
        pytest.skip("the file's name is changed in this process only")
    monkeypatch.setattr(changelog, "NAME", "NO-SUCH-CHANGELOG.md")
    assert s.owner().get("/api/changelog").json() == {"available": False}


def test_unreleased_is_cut_wherever_it_is() -> None:
    text = "# Changelog\n\nintro\n\n## [Unreleased]\n\n- soon\n\n## [1.2.0] - 2026-01-01\n\n- done\n"
    assert changelog.released(text) == "# Changelog\n\nintro\n\n## [1.2.0] - 2026-01-01\n\n- done\n"
    assert changelog.newest_release(text) == "1.2.0"


# --- net_mode and the settings ----------------------------------------------------------------

@pytest.mark.parametrize("mode, requested, allowed", [
    ("on", True, True), ("on", False, True), ("ask", True, True), ("ask", False, False),
    ("off", True, False), ("off", False, False), ("OFF", True, False), (0, True, False)])
def test_net_policy(mode: Any, requested: bool, allowed: bool) -> None:
    decision = netpolicy.outbound({"net_mode": mode}, "the update channel", requested=requested)
    assert decision.allowed is allowed
    if not allowed:
        assert "net_mode" in decision.error and "the update channel" in decision.error


def test_the_proxy_settings_are_owner_only_and_net_mode_is_not(keyed: Any) -> None:
    s, keys = keyed
    assert s.owner().patch("/v1/config", json={"bugreport_upload_url": "http://127.0.0.1:9",
                                               "bugreport_upload_token": UPLOAD_TOKEN}).status_code == 200
    writer = s.client(keys["writer"])
    seen = writer.get("/v1/config").json()
    assert seen["net_mode"] == "on"
    for key in ("bugreport_upload_url", "bugreport_upload_token", "keep_diagnostics"):
        assert key not in seen
        before = (s.data_dir / "config.json").read_bytes()
        r = writer.patch("/v1/config", json={key: 5 if key == "keep_diagnostics" else "http://127.0.0.1:1"})
        assert r.status_code == 403 and key in r.json()["detail"]
        assert (s.data_dir / "config.json").read_bytes() == before
    assert UPLOAD_TOKEN not in writer.get("/v1/config/schema").text
    fields = {f["key"]: f for f in s.owner().get("/v1/config/schema").json()["fields"]}
    assert fields["bugreport_upload_token"]["secret"] is True and fields["bugreport_upload_token"]["owner_only"]
    assert fields["net_mode"]["choices"] == ["on", "ask", "off"] and not fields["net_mode"]["owner_only"]
    r = writer.patch("/v1/config", json={"net_mode": "sometimes"})
    assert r.status_code == 400 and "net_mode" in r.json()["detail"]
    assert writer.patch("/v1/config", json={"net_mode": "off"}).json()["net_mode"] == "off"


# --- GET /api/issues ------------------------------------------------------------------------------

def test_issues_without_a_proxy_are_not_available(keyed: Any) -> None:
    s, keys = keyed
    assert s.client(keys["reader"]).get("/api/issues").json() == {"available": False, "issues": []}
    assert s.client(keys["other"]).get("/api/issues").status_code == 403


def test_issues_come_through_the_proxy_bounded_and_reduced(keyed: Any, proxy: Proxy) -> None:
    s, keys = keyed
    use_proxy(s, proxy)
    proxy.issues = [{"number": i, "title": "t" * 2000, "state": "open", "url": f"https://tracker.example/{i}",
                     "labels": [{"name": "bug"}, "ui", 5], "body": "x" * 100, "user": {"login": "someone"}}
                    for i in range(150)]
    reader = s.client(keys["reader"])
    body = reader.get("/api/issues", params={"state": "open"}).json()
    assert body["available"] is True and body["state"] == "open" and "error" not in body
    assert len(body["issues"]) == bugproxy.MAX_ISSUES
    first = body["issues"][0]
    assert set(first) == {"number", "title", "state", "url", "created_at", "updated_at", "labels"}
    assert first["number"] == 0 and len(first["title"]) == bugproxy.MAX_FIELD_CHARS and first["labels"] == ["bug", "ui"]
    assert proxy.requests[-1]["path"] == "/issues?state=open"
    assert proxy.requests[-1]["authorization"] == f"Bearer {UPLOAD_TOKEN}"
    for given in ("closed", "all"):
        assert reader.get("/api/issues", params={"state": given}).json()["state"] == given
    for fallback in ("bogus", "", "../x"):
        assert reader.get("/api/issues", params={"state": fallback}).json()["state"] == "all"
        assert proxy.requests[-1]["path"] == "/issues?state=all"
    assert reader.get("/api/issues").json()["state"] == "all"
    # text JSON may carry but an answer cannot (a lone surrogate), and control characters
    proxy.issues = b'[{"number": 1, "title": "half \\ud800 a pair\\u0000\\n", "url": "\\udfff"}]'
    r = reader.get("/api/issues")
    assert r.status_code == 200 and r.json()["issues"][0]["title"] == "half   a pair  ", r.text


@pytest.mark.parametrize("mode, says", [("500", "answered 500"), ("big", "is over"), ("deep", "is not JSON"),
                                        ("hang", "did not answer within")])
def test_a_failing_proxy_is_reported_in_the_body(keyed: Any, proxy: Proxy, quick_timeout: None, mode: str,
                                                 says: str) -> None:
    s, keys = keyed
    use_proxy(s, proxy)
    proxy.mode = mode
    r = s.client(keys["reader"]).get("/api/issues")
    assert r.status_code == 200
    body = r.json()
    assert body["available"] is True and body["issues"] == [] and says in body["error"]
    assert proxy.url not in r.text and UPLOAD_TOKEN not in r.text


def test_an_unreachable_or_malformed_proxy_is_reported_in_the_body(keyed: Any, proxy: Proxy) -> None:
    s, keys = keyed
    port = proxy.httpd.server_address[1]
    proxy.close()  # nothing listens there now
    owner = s.owner()
    for url in (f"http://127.0.0.1:{port}", "ftp://127.0.0.1/x", "http://[::1", "not a url"):
        assert owner.patch("/v1/config", json={"bugreport_upload_url": url}).status_code == 200
        r = s.client(keys["reader"]).get("/api/issues")
        assert r.status_code == 200 and r.json()["error"], (url, r.text)
        assert url not in r.text


def test_net_mode_off_stops_the_calls_before_they_reach_the_proxy(keyed: Any, proxy: Proxy) -> None:
    s, keys = keyed
    use_proxy(s, proxy, net_mode="off")
    r = s.client(keys["reader"]).get("/api/issues")
    assert r.status_code == 200 and "net_mode" in r.json()["error"] and r.json()["issues"] == []
    made = report(s.client(keys["writer"]))
    assert made["maintainer"] is False
    sent = s.client(keys["writer"]).post("/api/bug-report/send",
                                         json={"filename": made["filename"], "sha256": made["report_sha256"]})
    assert sent.status_code == 200
    assert sent.json()["uploaded"] is False and sent.json()["upload_stage"] == "net_mode"
    assert "net_mode" in sent.json()["upload_message"]
    assert proxy.requests == []
    # ask: a request asking for the call is one the server may make
    s.owner().patch("/v1/config", json={"net_mode": "ask"})
    assert "error" not in s.client(keys["reader"]).get("/api/issues").json()
    assert len(proxy.requests) == 1


# --- POST /api/bug-report ------------------------------------------------------------------------

@pytest.mark.parametrize("body, status, says", [
    (None, 422, "A JSON body is required"),
    ([], 422, "must be a JSON object"),
    ("text", 422, "must be a JSON object"),
    ({}, 400, "needs description"),
    ({"what_i_expected": "a reply"}, 400, "what_i_expected alone is not enough"),
    ({"description": "   ", "what_happened": ""}, 400, "needs description"),
    ({"upload": True, "description": "x"}, 400, "upload is refused"),
    ({"upload": False, "description": "x"}, 400, "upload is refused"),
    ({"description": 5}, 422, "description: must be a string"),
    ({"description": "x", "include_log": "yes"}, 422, "include_log: must be true or false"),
    ({"description": "x", "client": "me"}, 422, "client: must be an object"),
    ({"description": "x", "title": "y"}, 422, "title: unknown field"),
    ({"description": "x", "message": "y"}, 422, "message: is another name for description"),
    ({"description": "x" * 20_001}, 422, "at most 20000 characters"),
    ({"description": "x" * 300_000}, 413, "The request is over"),
])
def test_bug_report_refusals_save_nothing(keyed: Any, body: Any, status: int, says: str) -> None:
    s, keys = keyed
    writer = s.client(keys["writer"])
    r = writer.post("/api/bug-report") if body is None else writer.post("/api/bug-report", json=body)
    assert r.status_code == status, r.text
    assert says in r.json()["detail"]
    assert saved(s) == []


def test_a_bug_report_needs_config_write(keyed: Any) -> None:
    s, keys = keyed
    for key in ("reader", "other"):
        r = s.client(keys[key]).post("/api/bug-report", json={"description": "x"})
        assert r.status_code == 403 and "config:write" in r.json()["detail"]
        r = s.client(keys[key]).post("/api/bug-report/send", json={"filename": "bug-20260101T000000.000000Z-abcdef.md",
                                                                    "sha256": "0" * 64})
        assert r.status_code == 403
    assert s.client().post("/api/bug-report", json={"description": "x"}).status_code == 401
    assert saved(s) == []


def test_a_report_is_saved_for_review_with_its_digest(keyed: Any) -> None:
    s, keys = keyed
    out = report(s.owner(), message="Replies stop\nafter one word", what_i_expected="A whole answer",
                 client={"name": "localm-gui", "version": 3, "user_agent": "u" * 1000, "screen": "1920x1080",
                         "cookies": "session=abc", "platform": {"nested": True}, "language": "en\n\x00GB"})
    assert out["saved"] is True and bugreport_name(out["filename"])
    path = s.data_dir / "reports" / out["filename"]
    assert out["path"] == str(path) and saved(s) == [out["filename"]]
    data = path.read_bytes()
    assert out["report_markdown"] == data.decode() and out["report_sha256"] == hashlib.sha256(data).hexdigest()
    assert path.stat().st_mode & 0o777 == 0o600
    text = out["report_markdown"]
    assert text.startswith("# Bug report: Replies stop\n") and "after one word" in text and "A whole answer" in text
    assert f"- localm: {__version__}" in text and "| chat |" in text and '"net_mode": "on"' in text
    assert "- name: localm-gui\n- version: 3\n" in text and "- screen: 1920x1080" in text
    assert "- language: en GB" in text and "u" * 201 not in text and "cookies" not in text and "nested" not in text
    assert "## Server log" not in text and out["maintainer"] is False


def test_text_unicode_cannot_hold_is_replaced_not_a_500(keyed: Any) -> None:
    s, keys = keyed
    r = s.client(keys["writer"]).post("/api/bug-report", content=b'{"description": "lone \\ud800 half", '
                                      b'"client": {"name": "\\udfff"}}')
    assert r.status_code == 200, r.text
    assert "## Description\n\nlone ? half\n" in r.json()["report_markdown"]


def test_the_log_is_included_when_asked_and_capped(keyed: Any) -> None:
    s, keys = keyed
    owner = s.owner()
    for i in range(30):
        owner.get(f"/v1/nothing-{i}")
    text = report(owner, what_happened="a 404", include_log=True)["report_markdown"]
    log = text.split("## Server log (last ", 1)[1]
    count = int(log.split(" ", 1)[0])
    assert 30 <= count <= 200 and "GET /v1/nothing-29 404" in log


def test_old_reports_are_removed_past_keep_diagnostics(keyed: Any) -> None:
    s, keys = keyed
    s.owner().patch("/v1/config", json={"keep_diagnostics": 2})
    names = [report(s.client(keys["writer"]), description=f"report {i}")["filename"] for i in range(4)]
    assert saved(s) == sorted(names)[-2:]


def test_a_report_that_cannot_be_written_is_a_500(keyed: Any) -> None:
    s, keys = keyed
    (s.data_dir / "reports").write_text("a file where the folder would be")
    r = s.client(keys["writer"]).post("/api/bug-report", json={"description": "x"})
    assert r.status_code == 500 and "could not be saved" in r.json()["detail"]
    assert "saved" not in r.json() and str(s.data_dir) not in r.text
    assert (s.data_dir / "reports").read_text() == "a file where the folder would be"


def test_a_key_that_is_not_the_owner_sees_scrubbed_paths(keyed: Any) -> None:
    s, keys = keyed
    out = report(s.client(keys["writer"]))
    assert out["path"] == f"<data>/reports/{out['filename']}"
    assert str(s.data_dir) not in json.dumps(out) and str(s.data_dir.resolve()) not in json.dumps(out)
    mine = report(s.client(keys["owner"]))
    assert mine["path"] == str(s.data_dir / "reports" / mine["filename"])


def test_secrets_never_reach_a_saved_report(keyed: Any, proxy: Proxy) -> None:
    s, keys = keyed
    hf_token = "hf_" + "A1b2C3d4E5f6G7h8I9j0K1l2"
    use_proxy(s, proxy, hf_token=hf_token, cors_origins=["http://owner-only.example"],
              allowed_hosts=["owner-only-host.example"])
    writer = s.client(keys["writer"])
    # the access log writes a request's path: put the scoped key and the token in one
    writer.get(f"/v1/nothing/{keys['writer']}/{hf_token}")
    s.owner().get(f"/v1/nothing/{UPLOAD_TOKEN}?token={keys['owner']}")
    body = {"description": f"my key is {keys['writer']} and Bearer {keys['owner']}",
            "what_happened": f"token={UPLOAD_TOKEN} hf={hf_token} attach {s.token}", "include_log": True}
    # the log holds every caller's requests: only the owner's report may carry it
    before = saved(s)
    refused = writer.post("/api/bug-report", json=body)
    assert refused.status_code == 403 and refused.json()["code"] == "owner_only" and saved(s) == before
    out = report(s.client(keys["owner"]), **body)
    text = (s.data_dir / "reports" / out["filename"]).read_text()
    assert "/v1/nothing/" in text  # the log lines are there, scrubbed
    for secret in (keys["writer"], keys["owner"], keys["reader"], hf_token, UPLOAD_TOKEN, s.token, proxy.url,
                   str(s.data_dir), "owner-only.example", "owner-only-host.example", "bugreport_upload",
                   "cors_origins", "hf_token"):
        assert secret not in text, secret
        assert secret not in out["report_markdown"]
    assert "<redacted>" in text


# --- POST /api/bug-report/send -------------------------------------------------------------------

def bugreport_name(name: str) -> bool:
    from localm.kernel.bugreport import NAME
    return NAME.fullmatch(name) is not None


def test_a_reviewed_report_is_filed_as_it_was_shown(keyed: Any, proxy: Proxy) -> None:
    s, keys = keyed
    use_proxy(s, proxy)
    writer = s.client(keys["writer"])
    out = report(writer, description="Streaming stops | at once", what_happened="Nothing after the first token")
    assert out["maintainer"] is True
    r = writer.post("/api/bug-report/send", json={"filename": out["filename"], "sha256": out["report_sha256"].upper()})
    assert r.status_code == 200
    assert r.json() == {"filename": out["filename"], "maintainer": True, "uploaded": True,
                        "issue_url": "https://tracker.example/issues/7"}
    (sent,) = proxy.requests
    assert sent["method"] == "POST" and sent["path"] == "/issues"
    assert sent["authorization"] == f"Bearer {UPLOAD_TOKEN}"
    filed = json.loads(sent["body"])
    assert filed["title"] == "Bug report: Streaming stops | at once"
    shown = out["report_markdown"]
    assert shown.startswith(filed["body"].rstrip("\n")) and "has not been sent anywhere" in shown
    assert "has not been sent anywhere" not in filed["body"] and "## Environment" in filed["body"]
    assert saved(s) == [out["filename"]]  # the file stays


@pytest.mark.parametrize("filename", [
    "../config.json", "bug-20260101T000000.000000Z-abcdef.md/../../config.json", "/etc/passwd",
    "reports/bug-20260101T000000.000000Z-abcdef.md", "bug-20260101T000000.000000Z-abcdef.md\n", "bug-x.md",
    "bug-20260101T000000.000000Z-ABCDEF.md", "bug-20260101T000000.000000Z-abcdef.md\x00.txt", "..%2Fconfig.json",
    "bug-20260101T000000.000000Z-abcdef.json", "bug-\u0662\u0660\u0662\u0666\u0660\u0661\u0660\u0661T000000.000000Z-abcdef.md",
    "", 5, None, ["bug-20260101T000000.000000Z-abcdef.md"]])
def test_send_takes_only_a_bare_report_name(keyed: Any, proxy: Proxy, filename: Any) -> None:
    s, keys = keyed
    use_proxy(s, proxy)
    r = s.client(keys["writer"]).post("/api/bug-report/send", json={"filename": filename, "sha256": "a" * 64})
    assert r.status_code == 400 and "bug-<stamp>.md" in r.json()["detail"]
    assert proxy.requests == []


def test_send_refusals(keyed: Any, proxy: Proxy) -> None:
    s, keys = keyed
    use_proxy(s, proxy)
    writer = s.client(keys["writer"])
    out = report(writer)
    name, digest = out["filename"], out["report_sha256"]
    for body in ({"filename": name}, {"filename": name, "sha256": ""}, {"filename": name, "sha256": "z" * 64},
                 {"filename": name, "sha256": 5}):
        r = writer.post("/api/bug-report/send", json=body)
        assert r.status_code == 400 and "sha256 is required" in r.json()["detail"]
    r = writer.post("/api/bug-report/send", json={"filename": name, "sha256": digest, "force": True})
    assert r.status_code == 400 and "force" in r.json()["detail"]
    r = writer.post("/api/bug-report/send", json={"filename": "bug-20260101T000000.000000Z-abcdef.md", "sha256": digest})
    assert r.status_code == 404
    # a link named like a report, to a file outside the folder, is not read
    (s.data_dir / "reports" / "bug-20260101T000000.000000Z-bbbbbb.md").symlink_to(s.data_dir / "config.json")
    config_digest = hashlib.sha256((s.data_dir / "config.json").read_bytes()).hexdigest()
    r = writer.post("/api/bug-report/send", json={"filename": "bug-20260101T000000.000000Z-bbbbbb.md", "sha256": config_digest})
    assert r.status_code == 404
    # an edited report no longer has the digest that was shown: nothing is sent
    path = s.data_dir / "reports" / name
    path.write_text(path.read_text() + "\nadded later\n")
    r = writer.post("/api/bug-report/send", json={"filename": name, "sha256": digest})
    assert r.status_code == 409 and r.json()["code"] == "report_changed"
    assert proxy.requests == []


def test_send_without_a_proxy_keeps_the_report(keyed: Any) -> None:
    s, keys = keyed
    out = report(s.client(keys["writer"]))
    r = s.client(keys["writer"]).post("/api/bug-report/send",
                                      json={"filename": out["filename"], "sha256": out["report_sha256"]})
    assert r.status_code == 200
    body = r.json()
    assert body["uploaded"] is False and body["upload_stage"] == "configure" and body["maintainer"] is False
    assert "bugreport_upload_url" in body["upload_message"] and saved(s) == [out["filename"]]


def test_a_rate_limited_upload_says_when_to_try_again(keyed: Any, proxy: Proxy) -> None:
    s, keys = keyed
    use_proxy(s, proxy)
    proxy.mode = "429"
    out = report(s.client(keys["writer"]))
    r = s.client(keys["writer"]).post("/api/bug-report/send",
                                      json={"filename": out["filename"], "sha256": out["report_sha256"]})
    assert r.status_code == 200
    body = r.json()
    assert body["uploaded"] is False and body["rate_limited"] is True and body["retry_after"] == 120
    assert body["upload_error"] == "HTTP 429" and body["upload_stage"] == "proxy" and body["upload_message"]
    assert saved(s) == [out["filename"]] and len(proxy.requests) == 1


@pytest.mark.parametrize("mode, stage", [("hang", "timeout"), ("500", "proxy"), ("deep", None)])
def test_a_failed_upload_is_a_200_and_the_report_stays(keyed: Any, proxy: Proxy, quick_timeout: None,
                                                       mode: str, stage: str) -> None:
    s, keys = keyed
    use_proxy(s, proxy)
    proxy.mode = mode
    out = report(s.client(keys["writer"]))
    r = s.client(keys["writer"]).post("/api/bug-report/send",
                                      json={"filename": out["filename"], "sha256": out["report_sha256"]})
    assert r.status_code == 200
    body = r.json()
    if stage is None:  # a 2xx whose answer is not JSON: filed, with no address
        assert body["uploaded"] is True and "issue_url" not in body
        return
    assert body["uploaded"] is False and body["upload_stage"] == stage and "rate_limited" not in body
    assert body["upload_message"] and body["upload_error"] and proxy.url not in r.text
    assert saved(s) == [out["filename"]]


def test_retry_after_reads_seconds_and_dates() -> None:
    assert bugproxy.retry_after("30") == 30
    assert bugproxy.retry_after("999999999") == bugproxy.MAX_RETRY_AFTER
    assert bugproxy.retry_after(None) == bugproxy.DEFAULT_RETRY_AFTER
    assert bugproxy.retry_after("soon") == bugproxy.DEFAULT_RETRY_AFTER
    assert bugproxy.retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0


def test_a_save_that_takes_too_long_is_a_504(keyed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    s, keys = keyed
    if s.process:
        pytest.skip("the time limit is changed in this process only")
    from localm.kernel.routes import diagnostics
    monkeypatch.setattr(diagnostics, "SAVE_TIMEOUT", 0)
    r = s.client(keys["writer"]).post("/api/bug-report", json={"description": "x"})
    assert r.status_code == 504 and r.json()["code"] == "save_timeout" and "saved" not in r.json()


def test_a_repeated_state_is_not_an_error(keyed: Any, proxy: Proxy) -> None:
    s, keys = keyed
    use_proxy(s, proxy)
    r = s.client(keys["reader"]).get("/api/issues?state=open&state=closed")
    assert r.status_code == 200 and r.json()["state"] == "closed", r.text  # the last one
    assert proxy.requests[-1]["path"] == "/issues?state=closed"
