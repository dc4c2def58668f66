"""``localm serve``: bind the port (moving to the next free one when busy), run uvicorn
(on uvloop and httptools where they are installed), and restart in place when asked to."""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import uvicorn

from . import logs
from .runtime import Kernel
from .tls import setup_for as setup_tls

log = logging.getLogger("localm")

PORT_TRIES = 50
#: The event loops and HTTP parsers uvicorn can run on; "auto" takes the first one installed.
LOOPS = ("uvloop", "asyncio")
PARSERS = ("httptools", "h11")


def pick(kind: str, wanted: str) -> str:
    """The event loop (``kind`` "loop") or HTTP parser ("http") to serve with: ``wanted``, or
    for "auto" the fastest one installed. A named one that is not installed is refused."""
    choices = LOOPS if kind == "loop" else PARSERS
    if wanted == "auto":
        return next(name for name in choices if name in ("asyncio", "h11") or importlib.util.find_spec(name))
    if wanted not in choices:
        raise ValueError(f"--{kind} must be auto, {' or '.join(choices)}")
    if wanted not in ("asyncio", "h11") and importlib.util.find_spec(wanted) is None:
        fallback = choices[-1]
        raise ValueError(f"--{kind} {wanted}: {wanted} is not installed (pip install {wanted}), "
                         f"or use --{kind} {fallback}")
    return wanted


def bind_socket(host: str, port: int, *, bump: bool, wait: float = 0.0) -> socket.socket:
    """A listening socket on ``host:port``, or the next free port when ``bump``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    deadline = time.monotonic() + wait
    candidate = port
    while True:
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only then,
        # and without it a keep-alive response body waits ~40 ms for the client's delayed ACK
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, candidate))
            sock.listen(2048)
            sock.set_inheritable(True)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE:
                raise
            if bump and port != 0 and candidate < port + PORT_TRIES:
                candidate += 1
                continue
            if time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            raise


#: How often (seconds) a Python thread that wants the GIL gets it from one that holds it.
SWITCH_INTERVAL = 0.0005


def serving_line(kernel: Kernel, host: str, port: int, loop: str, http: str, *, restarted: bool = False) -> str:
    """The line a server announces once it answers: its address, data dir, plugins, loop and parser."""
    url = kernel.url(host, port)
    active = [p.name for p in kernel.plugins.plugins.values() if p.active]
    return (f"localm {'restarted' if restarted else 'serving'} on {url} "
            f"(data: {kernel.data_dir}; plugins: {', '.join(sorted(active)) or 'none'}; {loop}, {http})")


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(0)


def serve(*, data_dir: Path, host: str, port: int, only: list[str] | None, model: str | None,
          log_level: str = "info", loop: str = "auto", http: str = "auto") -> None:
    loop, http = pick("loop", loop), pick("http", http)
    tls = setup_tls(data_dir, host)  # before binding: a refusal leaves nothing listening
    restart_port = os.environ.pop("LOCALM_RESTART_PORT", None)
    if restart_port:
        sock = bind_socket(host, int(restart_port), bump=False, wait=10.0)
    else:
        sock = bind_socket(host, port, bump=True)
    actual = sock.getsockname()[1]
    if port not in (0, actual) and not restart_port:
        logs.announce(f"localm: port {port} is busy; serving on {actual} instead")
    kernel = Kernel(data_dir, bind_host=host, port=actual, only=only, model=model, tls=tls)
    config = uvicorn.Config(kernel.asgi, lifespan="on", log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5, log_config=None, server_header=False, loop=loop, http=http,
                            **(tls.uvicorn_options() if tls is not None else {}))
    server = uvicorn.Server(config)
    restart = [False]

    def exit_handler(again: bool) -> None:
        restart[0] = again
        server.should_exit = True

    kernel.exit_handler = exit_handler

    def announce() -> None:
        kernel.write_server_file(host, actual)
        logs.announce(serving_line(kernel, host, actual, loop, http, restarted=bool(restart_port)))

    kernel.on_ready = announce
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again: end with status 0
    # then, since a stop asked for (a service manager's, a test's) is no failure
    signal.signal(signal.SIGTERM, _stopped)
    # an engine thread back from a native decode waits for the GIL while the event loop runs
    # Python; at CPython's default 5 ms switch interval that wait stalls a whole decode step
    # (llama.cpp's threads idle meanwhile): parallel streams decoded ~15% slower
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        kernel.forget_server_file()
    if restart[0]:
        os.environ["LOCALM_RESTART_PORT"] = str(actual)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
