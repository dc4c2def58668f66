"""The request log: one line per request on a real server, in text and in JSON, as
docs/serving.md shows it."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conftest import offline_cli
from localm.sdk.testing import LocalmServer
from test_docs import DOCS, read_blocks

pytest.importorskip("llama_cpp")
MODEL = "smollm2-135m-instruct"
HELLO = [{"role": "user", "content": "Say hello."}]
LONG = [{"role": "user", "content": "Count from 1 to 1000, one number per line."}]
ACCESS = " INFO localm.access: "
WRONG = "lm-" + "0" * 40


def access_lines(s: LocalmServer) -> list[str]:
    return [line.partition(ACCESS)[2] for line in s.log_path.read_text(errors="replace").splitlines()
            if ACCESS in line]


def wait_for(s: LocalmServer, pattern: str, count: int = 1, timeout: float = 60) -> list[str]:
    """The request lines that match ``pattern``, once there are ``count`` of them (a line is
    written just after its response ends)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [line for line in access_lines(s) if re.search(pattern, line)]
        if len(found) >= count or time.monotonic() > deadline:
            assert len(found) >= count, f"{count} lines matching {pattern!r} expected:\n" + "\n".join(access_lines(s))
            return found
        time.sleep(0.05)


def documented(title: str) -> list[str]:
    (block,) = [b for b in read_blocks(DOCS / "serving.md") if b.title == title]
    return block.text.strip().split("\n")


def shape(line: str) -> tuple[Any, ...]:
    """What a text request line says, without its values: method, path, status, the names
    of its fields in order, and its flags."""
    method, path, status, duration, *rest = line.split(" ")
    assert re.fullmatch(r"\d+\.\dms", duration), line
    return method, path, status, tuple(w.partition("=")[0] if "=" in w else "flag:" + w for w in rest)


@pytest.fixture(scope="module")
def keyed(module_server: Any) -> tuple[LocalmServer, str, dict[str, Any]]:
    """A keyed server serving the default model: (server, owner key, a minted key's record)."""
    owner: list[str] = []

    def prepare(data_dir: Path) -> None:
        owner.append(offline_cli(data_dir, "key", "generate").strip())

    s = module_server(plugins=["chat", "llamacpp"], prepare=prepare)
    minted = s.client(owner[0]).post("/v1/keys", json={"name": "app", "scopes": []}).json()
    return s, owner[0], minted


@pytest.fixture(scope="module")
def traffic(keyed: Any) -> dict[str, Any]:
    """Requests of every kind, with the minted key (and the owner's once): what they got."""
    s, owner, minted = keyed
    key = minted["key"]
    client = openai.OpenAI(base_url=s.url + "/v1", api_key=key, timeout=300)
    out: dict[str, Any] = {"reply": client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4).usage}
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    out["chunks"], out["stream"] = len(chunks), chunks[-1].usage
    with s.client(key, timeout=300) as http:
        out["bad"] = http.post("/v1/chat/completions", content=b"{not json").status_code
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=100000)
        out["nothing"] = http.get("/v1/nothing", params={"api_key": key, "token": "t0k3n"}).status_code
        out["wrong"] = s.client(WRONG).get("/v1/models").status_code
        out["keys"] = s.client(owner).get("/v1/keys").status_code
        body = {"model": MODEL, "messages": LONG, "max_tokens": 2000, "temperature": 0}
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            out["left_stream"] = r.status_code
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            for _ in range(3):  # the role, then two tokens: the stream is generating; leave
                next(events)
    # a request whose client leaves before the server has read its body
    with socket.create_connection((s.host, s.port)) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\"".encode())
        time.sleep(0.5)
    return out


def test_every_request_gets_one_line(keyed: Any, traffic: dict[str, Any]) -> None:
    s, owner, minted = keyed
    key, key_id = minted["key"], minted["id"]
    who = rf"key_id={key_id} client=127\.0\.0\.1$"
    u = traffic["reply"]
    wait_for(s, rf"^POST /v1/chat/completions 200 [\d.]+ms model={MODEL} tokens_in={u.prompt_tokens} "
                rf"tokens_out={u.completion_tokens} {who}")
    u = traffic["stream"]
    assert traffic["chunks"] > 3
    wait_for(s, rf"^POST /v1/chat/completions 200 [\d.]+ms model={MODEL} tokens_in={u.prompt_tokens} "
                rf"tokens_out={u.completion_tokens} {who}")
    assert traffic["bad"] == 400
    wait_for(s, rf"^POST /v1/chat/completions 400 [\d.]+ms code=invalid_request_error {who}")
    wait_for(s, rf"^POST /v1/chat/completions 400 [\d.]+ms code=context_length_exceeded model={MODEL} {who}")
    # no route: no caller is identified, and the query string is never logged
    assert (traffic["nothing"], traffic["wrong"], traffic["keys"]) == (404, 401, 200)
    wait_for(s, r"^GET /v1/nothing 404 [\d.]+ms client=127\.0\.0\.1$")
    wait_for(s, r"^GET /v1/models 401 [\d.]+ms code=authentication_error client=127\.0\.0\.1$")
    wait_for(s, r"^GET /v1/keys 200 [\d.]+ms key_id=owner client=127\.0\.0\.1$")
    # the two replies read to their end are two lines, however many chunks one streamed
    wait_for(s, r" 499 ")  # the last request's line: every other one is written
    assert len([line for line in access_lines(s) if re.match(r"POST /v1/chat/completions 200 .*1$", line)]) == 2
    log = s.log_path.read_text(errors="replace")
    assert key not in log and owner not in log and WRONG not in log and "t0k3n" not in log
    assert not any("?" in line for line in access_lines(s))
    assert key_id in log


def test_a_client_that_leaves_gets_its_line(keyed: Any, traffic: dict[str, Any]) -> None:
    s, _, minted = keyed
    who = rf"key_id={minted['id']} client=127\.0\.0\.1 client_left$"
    assert traffic["left_stream"] == 200  # a stream keeps the status it sent
    wait_for(s, rf"^POST /v1/chat/completions 200 [\d.]+ms model={MODEL} tokens_in=\d+ tokens_out=\d+ {who}")
    wait_for(s, rf"^POST /v1/chat/completions 499 [\d.]+ms {who}")


def test_documented_text_lines_are_real_ones(keyed: Any, traffic: dict[str, Any]) -> None:
    s, _, _ = keyed
    wait_for(s, r" 499 ")
    real = {shape(line) for line in access_lines(s)}
    for line in documented("request-log.txt"):
        assert shape(line.partition(ACCESS)[2]) in real, f"docs/serving.md: {line}"


def test_json_log_format(localm_server: Any) -> None:
    s = localm_server(plugins=["chat", "llamacpp"], args=["--log-format", "json"])
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused-in-open-mode", timeout=300)
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
    assert httpx.post(s.url + "/v1/chat/completions", content=b"{not json").status_code == 400
    assert httpx.get(s.url + "/v1/nothing").status_code == 404
    s.stop()
    records = [json.loads(line) for line in s.log_path.read_text().splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert any(r["message"].startswith("localm serving on ") for r in records)
    access = [r for r in records if r["logger"] == "localm.access"]
    (chat,) = [a for a in access if a["path"] == "/v1/chat/completions" and a["status"] == 200]
    assert chat["method"] == "POST" and chat["model"] == MODEL and isinstance(chat["duration_ms"], float)
    assert (chat["tokens_in"], chat["tokens_out"]) == (r.usage.prompt_tokens, r.usage.completion_tokens)
    assert "key_id" not in chat  # open mode: no key
    (bad,) = [a for a in access if a["status"] == 400]
    assert bad["code"] == "invalid_request_error"
    assert [a["status"] for a in access if a["path"] == "/v1/nothing"] == [404]
    # docs/serving.md's example (a keyed caller's) has these fields, of these types, in this order
    (example,) = [json.loads(line) for line in documented("request-log.jsonl")]
    assert [(k, type(v)) for k, v in example.items() if k != "key_id"] == [(k, type(v)) for k, v in chat.items()]
