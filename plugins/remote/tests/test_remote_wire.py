"""The remote plugin's own HTTP/1.1 client (plugins/remote/remote_engine/wire.py), against real
asyncio servers on loopback that answer the way upstreams do: chunked event streams, bodies
with a length, bodies that end at the close, connections kept or dropped, silence."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest

from localm.sdk.testing import plugin_module

wire = plugin_module("remote", "remote_engine.wire")

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Upstream:
    """An asyncio server on a free loopback port that counts its connections and requests."""

    def __init__(self, answer: Callable[[int, bytes, asyncio.StreamWriter], Awaitable[bool]],
                 tls: Any = None) -> None:
        self.answer = answer
        self.tls = tls  # (request number, request body, writer) -> keep the connection?
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body)
        self.closed_by_peer = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed_by_peer.set()
                    return
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                try:
                    keep = await self.answer(len(self.requests), body, writer)
                except ConnectionError:
                    self.closed_by_peer.set()
                    return
                if not keep:
                    return
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0, ssl=self.tls)
        port = self.server.sockets[0].getsockname()[1]
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{port}/v1"

    async def __aexit__(self, *exc: Any) -> None:
        self.server.close()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def _event(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"


async def _stream(_: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
    """A chunked event stream of three events (one split across two chunks), then [DONE]."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    whole = _event("a") + _event("b") + _event("c")
    writer.write(_chunk(whole[:10]) + _chunk(whole[10:]))
    writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()
    return True


@pytest.fixture(autouse=True, params=["asyncio", "uvloop"])
def loop(request: pytest.FixtureRequest) -> Any:
    """Each test on asyncio's own loop and on uvloop (what `localm serve` runs on)."""
    if request.param == "asyncio":
        yield
        return
    uvloop = pytest.importorskip("uvloop")
    before = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(before)


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_stream_is_read_line_by_line_and_its_connection_kept() -> None:
    async def main() -> None:
        upstream = Upstream(_stream)
        async with upstream as base:
            client = wire.Upstream(base, headers={"Authorization": "Bearer k"})
            for _ in range(3):
                answer = await client.post("/completions", b'{"prompt": "x"}')
                assert answer.status == 200 and answer.header(b"content-type") == "text/event-stream"
                lines = [line async for line in answer.lines()]
                answer.release()
                assert [line for line in lines if line] == [
                    "data: " + json.dumps({"choices": [{"index": 0, "text": t}]}) for t in "abc"] + ["data: [DONE]"]
            assert upstream.connections == 1  # read to its end: the connection served all three
            head, body = upstream.requests[0]
            assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
            assert b"\r\nAuthorization: Bearer k\r\n" in head and b"\r\nContent-Length: 15\r\n" in head
            assert body == b'{"prompt": "x"}'
            client.close()
    run(main())


def test_a_body_with_a_length_and_one_that_ends_at_the_close() -> None:
    async def answer(n: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
        if n == 1:
            writer.write(b'HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 22\r\n\r\n'
                         b'{"error": "too long"}\n')
            await writer.drain()
            return True
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
                     + _event("z") + b"data: [DONE]\n\n")
        await writer.drain()
        return False  # the close ends the body

    async def main() -> None:
        upstream = Upstream(answer)
        async with upstream as base:
            client = wire.Upstream(base)
            refused = await client.post("/completions", b"{}")
            assert refused.status == 400 and await refused.read() == b'{"error": "too long"}\n'
            refused.release()
            streamed = await client.post("/completions", b"{}")
            assert [line async for line in streamed.lines() if line][-1] == "data: [DONE]"
            assert streamed.done
            streamed.release()
            assert upstream.connections == 1
    run(main())


def test_a_connection_the_upstream_closed_while_idle_is_replaced() -> None:
    async def answer(n: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
        await _stream(n, body, writer)
        return False  # says nothing of it, then closes the connection after each answer

    async def main() -> None:
        upstream = Upstream(answer)
        async with upstream as base:
            client = wire.Upstream(base)
            for _ in range(3):
                answer_ = await client.post("/completions", b"{}")
                assert [line async for line in answer_.lines() if line][-1] == "data: [DONE]"
                answer_.release()
                await asyncio.sleep(0.05)  # the close reaches the client while the connection is idle
            assert upstream.connections == 3 and len(upstream.requests) == 3
    run(main())


def test_a_reader_that_stops_early_closes_the_connection() -> None:
    async def endless(n: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while True:
            writer.write(_chunk(_event("x")))
            await writer.drain()
            await asyncio.sleep(0.01)

    async def main() -> None:
        upstream = Upstream(endless)
        async with upstream as base:
            client = wire.Upstream(base)
            answer = await client.post("/completions", b"{}")
            seen = 0
            async for line in answer.lines():
                seen += bool(line)
                if seen == 3:
                    break
            answer.release()
            await asyncio.wait_for(upstream.closed_by_peer.wait(), 5)  # the upstream sees the disconnect
            assert not client._idle
    run(main())


def test_failures_are_told_apart() -> None:
    async def killed(n: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunk(_event("x")))
        await writer.drain()
        writer.transport.abort()  # gone mid-answer
        return False

    async def silent(n: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(60)
        return False

    async def garbage(n: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        return False

    async def main() -> None:
        async with Upstream(killed) as base:
            answer = await wire.Upstream(base).post("/completions", b"{}")
            with pytest.raises(wire.Broken, match="closed before the answer ended"):
                async for _ in answer.lines():
                    pass
        async with Upstream(silent) as base:
            with pytest.raises(wire.TimedOut):
                await wire.Upstream(base, timeout=0.3).post("/completions", b"{}")
        async with Upstream(garbage) as base:
            with pytest.raises(wire.Broken, match="not an HTTP answer"):
                await wire.Upstream(base).post("/completions", b"{}")
        async with Upstream(silent) as base:
            port = int(base.split(":")[2].split("/")[0])
        with pytest.raises(wire.ConnectFailed, match="(?i)refused"):  # the server is gone: nothing listens
            await wire.Upstream(f"http://127.0.0.1:{port}/v1").post("/completions", b"{}")
    run(main())


def test_a_slow_reader_holds_back_the_upstream() -> None:
    async def flood(n: int, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        piece = _chunk(b"data: " + b"x" * 65536 + b"\n\n")
        for _ in range(160):  # 10 MiB
            writer.write(piece)
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    async def main() -> None:
        async with Upstream(flood) as base:
            answer = await wire.Upstream(base).post("/completions", b"{}")
            most = 0
            lines = 0
            async for line in answer.lines():
                lines += bool(line)
                most = max(most, answer._held)
                await asyncio.sleep(0.002)
            assert lines == 160
            assert most <= wire.HIGH_WATER + (1 << 18)  # paused past the mark, not 10 MiB held
            answer.release()
    run(main())


def test_proxied_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy",
                 "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert not wire.proxied("http://10.0.0.5:8000/v1")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.lan:3128")
    assert wire.proxied("http://10.0.0.5:8000/v1")
    assert not wire.proxied("https://10.0.0.5:8000/v1")
    monkeypatch.setenv("NO_PROXY", "10.0.0.5")
    assert not wire.proxied("http://10.0.0.5:8000/v1")


def test_https_with_the_certificates_the_environment_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)

    async def main() -> None:
        async with Upstream(_stream, tls=tls) as base:
            assert base.startswith("https://")
            with pytest.raises(wire.ConnectFailed, match="(?i)certificate"):  # not trusted yet
                await wire.Upstream(base).post("/completions", b"{}")
            monkeypatch.setenv("SSL_CERT_FILE", str(cert))
            answer = await wire.Upstream(base).post("/completions", b"{}")
            assert [line async for line in answer.lines() if line][-1] == "data: [DONE]"
            answer.release()
    run(main())
