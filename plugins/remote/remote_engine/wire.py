"""A lean HTTP/1.1 client for the upstream's streamed replies: the path every generation takes.

A short streamed request cost localm's process 2.3 ms of CPU with httpx on this path (its
connection pool, anyio checkpoints, cookie jar and per-request log line) and 1.0 ms with this
client, and when many requests arrive at once they queue behind each other's client work on
the one event loop, so that cost is paid several times over before the last of them
reaches the upstream. This client does what a streamed chat needs and nothing more:

- one ``asyncio.Protocol`` a connection, the response read by httptools' C parser (a kernel
  dependency: uvicorn's parser);
- the request line, headers and body in one write;
- keep-alive connections pooled per upstream, a connection taken from the pool checked for
  having been closed, and a request that finds its reused connection closed before any byte of
  the answer sent again once on a fresh one (what browsers do);
- backpressure: reading pauses while more than :data:`HIGH_WATER` bytes wait for the reader;
- a reader that stops early (its client went away) closes the connection, so the upstream
  sees the disconnect and stops generating;
- failures as three exceptions the engine maps to statuses: :class:`ConnectFailed` (502),
  :class:`TimedOut` (504), :class:`Broken` (the connection failed mid-answer).

Everything else the remote engine asks (models, tokenize, embeddings) goes through httpx, and
so does every request to an upstream reached through a proxy (``HTTP_PROXY`` and friends, as
httpx reads them): :func:`proxied` says when.
"""

from __future__ import annotations

import asyncio
import errno
import ssl
import urllib.parse
import urllib.request
from collections import deque
from typing import AsyncIterator

import httptools

#: Bytes of an answer held for a slow reader before the connection stops reading.
HIGH_WATER = 1 << 20
#: Idle keep-alive connections kept per upstream.
MAX_IDLE = 64


class UpstreamError(Exception):
    """The upstream could not be asked, or failed while answering."""


class ConnectFailed(UpstreamError):
    """No connection: refused, unknown host, or not accepted within the connect timeout."""


class TimedOut(UpstreamError):
    """The upstream stayed silent longer than the read timeout."""


class Broken(UpstreamError):
    """The connection closed or sent something that is not HTTP before the answer ended."""


def proxied(url: str) -> bool:
    """Whether requests to ``url`` go through a proxy the environment names (httpx's rule:
    ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` unless ``NO_PROXY`` covers the host)."""
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies()
    if not (proxies.get(parts.scheme) or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass(parts.hostname or "")


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(TimedOut())


class Answer(asyncio.Protocol):
    """One connection to the upstream and the answer being read on it."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head = False
        self.done = False
        self.keep = False
        self.got = False  # any byte of the answer
        self._till_close = False
        self.failure: UpstreamError | None = None
        self._chunks: deque[bytes] = deque()
        self._held = 0
        self._paused = False
        self._waiter: asyncio.Future | None = None

    # --- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.failure = Broken(f"not an HTTP answer ({exc})")
            self.transport.close()  # type: ignore[union-attr]
            self._wake()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.done:
            if self.head and self._till_close:  # an answer with no length and no chunks ends at the close
                self.done = True
            elif self.failure is None:
                self.failure = Broken("the connection closed before the answer ended")
        self.upstream._forget(self)
        self._wake()

    # --- httptools callbacks -----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep = self.parser.should_keep_alive()
        self._till_close = not any(k in (b"content-length", b"transfer-encoding") for k, _ in self.headers)
        self.head = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._held += len(body)
        if self._held > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.done = True
        self._wake()

    # --- the reader --------------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        """Until the parser has more (or the connection failed), at most the read timeout."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(self.upstream.timeout, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    async def _head(self) -> None:
        while not self.head:
            if self.failure is not None:
                raise self.failure
            await self._wait()

    def header(self, name: bytes) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value.decode("latin-1")
        return None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The answer's body as it arrives; raises :class:`Broken` or :class:`TimedOut` when it
        fails before its end."""
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                self._held -= len(chunk)
                if self._paused and self._held <= HIGH_WATER // 4 and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                yield chunk
            if self.done:
                return
            if self.failure is not None:
                raise self.failure
            await self._wait()

    async def read(self) -> bytes:
        """The whole body (an error's)."""
        return b"".join([chunk async for chunk in self.chunks()])

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines (an event stream's), without their line ends."""
        rest = b""
        async for chunk in self.chunks():
            if rest:
                chunk, rest = rest + chunk, b""
            *whole, rest = chunk.split(b"\n")
            for line in whole:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if rest:
            yield rest.rstrip(b"\r").decode("utf-8", errors="replace")

    def release(self) -> None:
        """Done with the answer: a connection whose answer was read to its end and may be kept
        goes back to the pool; any other is closed (the upstream sees the disconnect)."""
        self.upstream._release(self)


class Upstream:
    """Keep-alive connections to one upstream origin (``scheme://host:port``), and the requests
    sent on them."""

    def __init__(self, base: str, *, headers: dict[str, str] | None = None, connect_timeout: float = 5.0,
                 timeout: float = 300.0) -> None:
        parts = urllib.parse.urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.ssl: ssl.SSLContext | None = _ssl_context() if parts.scheme == "https" else None
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        default = self.port == (443 if parts.scheme == "https" else 80)
        fields = {"Host": host if default else f"{host}:{self.port}", "User-Agent": "localm",
                  "Accept": "*/*", "Content-Type": "application/json", **(headers or {})}
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fields.items()).encode("latin-1")
        self._idle: list[Answer] = []
        self._open: set[Answer] = set()

    async def _connect(self) -> Answer:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, answer = await loop.create_connection(
                    lambda: Answer(self), self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.ssl is not None else None)
        except TimeoutError:
            raise ConnectFailed(f"no connection within {self.connect_timeout:g} s") from None
        except OSError as exc:
            refused = isinstance(exc, ConnectionRefusedError) or exc.errno == errno.ECONNREFUSED
            raise ConnectFailed("connection refused" if refused else exc.strerror or str(exc)) from None
        self._open.add(answer)
        return answer

    async def post(self, path: str, body: bytes) -> Answer:
        """Send ``POST prefix+path`` with a JSON ``body``; returns once the answer's status and
        headers are in (read its body with :meth:`Answer.lines` / :meth:`Answer.read`, then
        :meth:`Answer.release`)."""
        request = b"".join((b"POST ", (self.prefix + path).encode("latin-1"), b" HTTP/1.1\r\n", self._head,
                            b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body))
        while True:
            answer, reused = None, False
            while self._idle:
                candidate = self._idle.pop()
                if not candidate.lost and candidate.transport is not None and not candidate.transport.is_closing():
                    answer, reused = candidate, True
                    break
            if answer is None:
                answer = await self._connect()
            answer._reset()
            answer.transport.write(request)  # type: ignore[union-attr]
            try:
                await answer._head()
            except Broken:
                if reused and not answer.got:  # closed by the upstream while idle: once more, fresh
                    continue
                raise
            except BaseException:
                answer.transport.close()  # type: ignore[union-attr]
                raise
            return answer

    def _release(self, answer: Answer) -> None:
        if answer.done and answer.keep and not answer.lost and answer.failure is None \
                and answer.transport is not None and not answer.transport.is_closing() \
                and len(self._idle) < MAX_IDLE:
            self._idle.append(answer)
        elif answer.transport is not None:
            answer.transport.close()

    def _forget(self, answer: Answer) -> None:
        self._open.discard(answer)
        if answer in self._idle:
            self._idle.remove(answer)

    def close(self) -> None:
        """Close every connection (the engine is unloading)."""
        for answer in list(self._open):
            if answer.transport is not None:
                answer.transport.close()
        self._idle.clear()


def _ssl_context() -> ssl.SSLContext:
    """The certificates httpx would trust: ``SSL_CERT_FILE``/``SSL_CERT_DIR`` when set, else
    certifi's bundle where it is installed, else the system's."""
    import os
    if os.environ.get("SSL_CERT_FILE") or os.environ.get("SSL_CERT_DIR"):
        return ssl.create_default_context(cafile=os.environ.get("SSL_CERT_FILE"),
                                          capath=os.environ.get("SSL_CERT_DIR"))
    try:
        import certifi
        return ssl.create_default_context(cafile=certifi.where())
    except ImportError:
        return ssl.create_default_context()
