"""How CLI commands reach a running server: its address and attach token from
``<data dir>/server.json``, checked live before use.

``server.json`` (mode 0600) holds ``pid``, ``host``, ``port``, ``url``, ``token`` (the
server's attach token: the owner's credential from loopback), ``version``, ``started``
(epoch seconds) and, when it serves HTTPS, ``tls``: ``{"trust": PATH, "own": BOOL}``, the
file a client trusts (localm's CA, or the owner's own certificate; see :func:`verify_for`).
A plugin's command gets a client with ``localm.sdk.connect()``, or with
``localm.sdk.cli.ensure_server()``, which starts ``localm serve`` in the background when
none runs; either one's ``verify`` is what an HTTP client of its own must verify with.
"""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import click
import httpx

from .datadir import default_data_dir, server_file
from .errors import LocalmError

#: Seconds a background ``localm serve`` (:func:`ensure_server`) may take to answer.
START_TIMEOUT = 120.0


class ServerError(LocalmError):
    """The server refused a call: its status and ``detail``."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(status, detail)


def verify_for(info: dict[str, Any]) -> ssl.SSLContext | bool:
    """What a client of the server ``server.json`` describes (``info``) verifies its HTTPS
    with: an SSL context trusting that server's CA (or its owner's certificate), or True (the
    system's trust, for a plain HTTP server). A ``tls`` entry it cannot use raises ValueError."""
    tls = info.get("tls")
    if tls is None:
        return True
    if not isinstance(tls, dict) or not isinstance(tls.get("trust"), str):
        raise ValueError("server.json: tls must be an object with trust")
    from .tls import client_context
    try:
        return client_context(tls["trust"], own=tls.get("own") is True)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"server.json: cannot trust {tls['trust']}: {exc}") from None


class ServerClient:
    def __init__(self, url: str, token: str, *, verify: ssl.SSLContext | bool = True) -> None:
        self.url = url
        self.verify = verify
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=None,
                                 verify=verify)

    @classmethod
    def find(cls, data_dir: Path) -> "ServerClient | None":
        """The server running on this data dir, or None when there is none."""
        try:
            info = json.loads(server_file(data_dir).read_text())
            pid, url, token = int(info["pid"]), str(info["url"]), str(info["token"])
            verify = verify_for(info)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        try:
            httpx.get(f"{url}/health", timeout=3.0, verify=verify)
        except httpx.HTTPError:
            return None
        return cls(url, token, verify=verify)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """``method path`` with httpx's keyword arguments (``json=``, ``params=``...): the answer's
        JSON, or ServerError with the server's status and detail."""
        response = self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ServerError(response.status_code, str(detail))
        return response.json()

    def events(self, path: str) -> Iterator[dict[str, Any]]:
        """Follow a server-sent event stream, yielding each event's JSON."""
        with self.http.stream("GET", path) as response:
            if response.status_code >= 400:
                response.read()
                raise ServerError(response.status_code, response.json().get("detail", response.text))
            for line in response.iter_lines():
                if line.startswith("data: "):
                    yield json.loads(line[6:])


def _folder(data_dir: str | Path | None) -> Path:
    if data_dir is None:
        ctx = click.get_current_context(silent=True)
        data_dir = getattr(ctx.find_root().obj, "data_dir", None) if ctx is not None else None
    return Path(data_dir) if data_dir is not None else default_data_dir()


def command_data_dir(data_dir: str | Path | None = None) -> Path:
    """``data_dir`` when given, else the data directory the ``localm`` command was given
    (``--data-dir``, else ``LOCALM_HOME``, else ``~/.localm``)."""
    return _folder(data_dir)


def connect(data_dir: str | Path | None = None) -> ServerClient:
    """The server running on ``data_dir``, for a command to call. By default the data directory
    the ``localm`` command was given (``--data-dir``, else ``LOCALM_HOME``, else ``~/.localm``).
    Raises a 503 ``server_not_running`` LocalmError when no server runs there."""
    folder = _folder(data_dir)
    client = ServerClient.find(folder)
    if client is None:
        raise LocalmError(503, f"No localm server is running on {folder}: start one with `localm serve`",
                          code="server_not_running")
    return client


@contextlib.contextmanager
def server(data_dir: str | Path | None = None, *, timeout: float = 120.0) -> Iterator[ServerClient]:
    """A client of the server running on ``data_dir``; when none runs, of one started in this
    process for the ``with`` block (every enabled plugin, on a free loopback port, announced to
    no one) and stopped after it. A command works the same with or without ``localm serve``."""
    folder = _folder(data_dir)
    found = ServerClient.find(folder)
    if found is not None:
        yield found
        return
    import uvicorn

    from .runtime import Kernel
    from .server import bind_socket

    sock = bind_socket("127.0.0.1", 0, bump=False)
    port = sock.getsockname()[1]
    kernel = Kernel(folder, port=port)
    ready = threading.Event()
    kernel.on_ready = ready.set
    config = uvicorn.Config(kernel.asgi, lifespan="on", log_level="warning", access_log=False, log_config=None,
                            server_header=False)
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, kwargs={"sockets": [sock]}, name="localm-local-server", daemon=True)
    thread.start()
    try:
        while not ready.wait(0.1):
            if not thread.is_alive():
                raise LocalmError(500, f"A local server could not start on {folder}", code="server_failed")
            timeout -= 0.1
            if timeout <= 0:
                raise LocalmError(504, f"A local server on {folder} did not start in time", code="server_failed")
        yield ServerClient(f"http://127.0.0.1:{port}", kernel.attach_token)
    finally:
        running.should_exit = True
        thread.join(60)
        sock.close()


def ensure_server(data_dir: str | Path | None = None, *,
                  timeout: float | None = None) -> tuple[ServerClient, str | None]:
    """The server running on ``data_dir`` (by default the ``localm`` command's, as for
    :func:`connect`), or one started now as a background ``localm serve`` that outlives the
    command, with a line that says so for the caller to print (None when one was running).
    Its output goes to ``<data dir>/serve.log``; a ``server_failed`` LocalmError when it exits
    or does not answer within ``timeout`` seconds (default :data:`START_TIMEOUT`)."""
    data_dir = _folder(data_dir)
    timeout = START_TIMEOUT if timeout is None else timeout
    found = ServerClient.find(data_dir)
    if found is not None:
        return found, None
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "serve.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "localm.kernel", "--data-dir", str(data_dir), "serve"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise LocalmError(500, f"localm serve could not start (exit status {proc.returncode}): "
                                   + " / ".join(tail), code="server_failed")
        try:
            pid = json.loads(server_file(data_dir).read_text()).get("pid")
        except (OSError, ValueError):
            pid = None
        if pid == proc.pid:
            found = ServerClient.find(data_dir)
            if found is not None:
                return found, (f"Started `localm serve` in the background on {found.url} (pid {proc.pid}; "
                               f"log: {log_path}; stop it with `kill {proc.pid}`).")
        time.sleep(0.1)
    raise LocalmError(504, f"localm serve did not answer within {timeout:.0f} s; see {log_path}",
                      code="server_failed")
