"""Test helpers for localm and its plugins: a real server on a free loopback port.

Loaded as a pytest plugin (entry point ``localm``), it provides the ``localm_server``
fixture: call it to start a server with chosen plugins and a temporary data dir; every
server it started is stopped after the test::

    def test_hello(localm_server):
        server = localm_server(plugins=["hello"])
        assert server.client().get("/hello/ada").json() == {"greeting": "Hello, ada"}

A server runs in the test's own process by default: the kernel and uvicorn on a thread,
listening on a real loopback port, so clients still talk HTTP to it, and a plugin's heavy
imports (torch, llama.cpp) are paid once per test run instead of once per server. It runs
as a real ``localm serve`` subprocess when the test is about the process (a test marked
``@pytest.mark.server_process``, or ``process=True``), when it is given serve arguments
or an environment this process does not have, or when ``LOCALM_TEST_SERVER_PROCESS=1``.

``localm_module_server`` is the same for a whole test module (one server shared by its
tests), and three helpers need no fixture: ``offline_cli`` runs a CLI command against a
data dir with no server, ``sse_events`` reads a streamed response's events, ``wait_job``
waits for a server job to end. ``plugin_module`` imports a builtin plugin's module by the
name the plugin host gives it, without starting the plugin.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

START_TIMEOUT = float(os.environ.get("LOCALM_TEST_START_TIMEOUT", "60"))


#: Commands ``LocalmServer.cli`` always runs as a process: they serve, or read a terminal.
PROCESS_COMMANDS = ("serve", "run")


#: The environment variable a server's ``env`` may set and still run in this process: the
#: plugin catalog, which the kernel takes as an argument.
IN_PROCESS_ENV = ("LOCALM_PLUGIN_STORE",)


class LocalmServer:
    """A localm server with its own data dir: in this process, or a ``localm serve``
    subprocess (``process=True``; see the module's docstring for when it is one anyway)."""

    def __init__(self, data_dir: Path, *, plugins: list[str] | None = None, env: dict[str, str] | None = None,
                 model: str | None = None, host: str = "127.0.0.1", args: list[str] | None = None,
                 process: bool | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.plugins = plugins
        self.env = dict(env or {})
        self.model = model
        self.host = host
        self.args = list(args or [])
        self.process = self._needs_process() if process is None else process
        self.proc: subprocess.Popen[bytes] | None = None
        self._thread: _InProcess | None = None
        self.url = ""
        self.port = 0
        self.token = ""
        #: What a client verifies this server's HTTPS with (the data dir's CA), or True for HTTP.
        self.verify: Any = True
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}-server.log"

    # --- lifecycle -----------------------------------------------------------------
    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "localm.kernel", "--data-dir", str(self.data_dir), "serve",
               "--host", self.host, "--port", "0", *self.args]
        if self.plugins is not None:
            cmd += ["--plugins", ",".join(self.plugins)]
        if self.model:
            cmd.append(self.model)
        return cmd

    def _needs_process(self) -> bool:
        if os.environ.get("LOCALM_TEST_SERVER_PROCESS") == "1" or self.args:
            return True
        return any(os.environ.get(k) != v for k, v in self.env.items() if k not in IN_PROCESS_ENV)

    def start(self) -> "LocalmServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.process:
            self._thread = _InProcess(self)
            self._thread.start()
            return self
        env = {**os.environ, **self.env}
        if "LOCALM_API_KEY" not in self.env:  # a developer's own key must not leak into a test server
            env.pop("LOCALM_API_KEY", None)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_ready(self.proc.pid)
        return self

    def wait_ready(self, pid: int, timeout: float = START_TIMEOUT) -> None:
        """Wait for the server (process ``pid``) to write server.json and answer on its port."""
        deadline = time.monotonic() + timeout
        info_path = self.data_dir / "server.json"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"localm serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                info = json.loads(info_path.read_text())
            except (OSError, ValueError):
                info = None
            if info and info.get("pid") == pid:
                try:
                    httpx.get(f"{info['url']}/health", timeout=2, verify=_verify(info))
                except httpx.HTTPError:
                    pass
                else:
                    self._found(info)
                    return
            time.sleep(0.05)
        raise RuntimeError(f"localm serve did not become ready in {timeout}s:\n{self.log()}")

    def wait_restarted(self, old_token: str, timeout: float = 60) -> None:
        """After ``POST /v1/server/restart``: wait for the restarted server (a server.json with
        another attach token than ``old_token``) to answer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if json.loads((self.data_dir / "server.json").read_text())["token"] != old_token:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        self.wait_ready(self.pid, timeout=max(1.0, deadline - time.monotonic()))

    def _found(self, info: dict[str, Any]) -> None:
        """Take the address, scheme, trust and attach token from the server's server.json."""
        self.url, self.port, self.token, self.verify = info["url"], info["port"], info["token"], _verify(info)

    @property
    def pid(self) -> int:
        """The process the server runs in: its subprocess, or this one."""
        return self.proc.pid if self.proc is not None else os.getpid()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-8000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
            return
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    # --- talking to it -------------------------------------------------------------
    def client(self, key: str | None = None, *, attach: bool = False, **kwargs: Any) -> httpx.Client:
        """An HTTP client for this server: with ``key`` as bearer, or the attach token."""
        headers = dict(kwargs.pop("headers", {}))
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        elif attach:
            headers["Authorization"] = f"Bearer {self.token}"
        kwargs.setdefault("verify", self.verify)
        return httpx.Client(base_url=self.url, headers=headers, timeout=kwargs.pop("timeout", 60), **kwargs)

    def owner(self) -> httpx.Client:
        """A client holding this process's attach token (the owner, from loopback)."""
        return self.client(attach=True)

    def cli(self, *args: str, input: str | None = None, env: dict[str, str] | None = None,
            timeout: float = 300, process: bool | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``localm --data-dir <this server's> ARGS`` and capture its output.

        The command runs in this process (Click's test runner: no interpreter to start, so a
        test's many CLI calls take milliseconds each) unless ``process`` is true, the command
        is ``serve`` or ``run`` (which read the terminal and the pipe on stdin), or
        ``LOCALM_TEST_CLI_PROCESS=1`` is set; then it is a real ``python -m
        localm.kernel`` subprocess (``timeout`` applies only there). Either way the result is
        a ``CompletedProcess`` with ``returncode``, ``stdout`` and ``stderr``; an exception
        the command did not handle is a returncode of 1 with its traceback in ``stderr``, as
        the interpreter would print it."""
        args = tuple(os.fspath(a) for a in args)  # a path argument, as subprocess takes it
        if process is None:
            process = os.environ.get("LOCALM_TEST_CLI_PROCESS") == "1" or (bool(args) and args[0] in PROCESS_COMMANDS)
        cmd = [sys.executable, "-m", "localm.kernel", "--data-dir", str(self.data_dir), *args]
        extra = {**self.env, **(env or {})}
        if process:
            return subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, **extra})
        return _cli_in_process(cmd, input, extra)


def _store_roots(env: dict[str, str]) -> list[Path]:
    """The plugin catalogs a ``localm serve`` started with ``env`` would read."""
    from localm.kernel.plugin_files import store_roots

    return store_roots({**os.environ, **env})


class _InProcess:
    """A server on a thread of this process: a kernel served by uvicorn on a loopback socket,
    writing server.json as ``localm serve`` does and its log lines to the server's log file.
    A restart asked over HTTP builds a fresh kernel on the same port."""

    def __init__(self, server: LocalmServer) -> None:
        self.server = server
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.running: Any = None
        self.stopping = False
        from localm.kernel.logs import TEXT_FORMAT

        self.handler = logging.FileHandler(server.log_path, encoding="utf-8")
        self.handler.setFormatter(logging.Formatter(TEXT_FORMAT))  # as localm serve writes its log

    def start(self) -> tuple[str, int, str]:
        from localm.kernel.server import SWITCH_INTERVAL, bind_socket

        sys.setswitchinterval(SWITCH_INTERVAL)  # as localm serve runs
        s = self.server
        self.sock = bind_socket(s.host, 0, bump=False)
        self.port = self.sock.getsockname()[1]
        for name in ("localm", "uvicorn"):
            logger = logging.getLogger(name)
            logger.addHandler(self.handler)
            if logger.level == logging.NOTSET or logger.level > logging.INFO:
                logger.setLevel(logging.INFO)
        self.thread = threading.Thread(target=self._run, name=f"localm-test-server-{self.port}", daemon=True)
        self.thread.start()
        return self.wait()

    def wait(self, timeout: float = START_TIMEOUT) -> tuple[str, int, str]:
        if not self.ready.wait(timeout) or self.failed is not None:
            raise RuntimeError(f"the in-process server did not start: {self.failed!r}\n{self.server.log()}")
        self.ready.clear()
        return self.server.url, self.port, self.server.token

    def _run(self) -> None:
        import uvicorn

        from localm.kernel.runtime import Kernel
        from localm.kernel.server import pick, serving_line
        from localm.kernel.tls import setup_for

        s = self.server
        stores = _store_roots(s.env)
        loop, http = pick("loop", "auto"), pick("http", "auto")
        restarted = False
        try:
            while True:
                tls = setup_for(s.data_dir, s.host)  # as localm serve does: HTTPS when tls_enabled is on
                kernel = Kernel(s.data_dir, bind_host=s.host, port=self.port, only=s.plugins, model=s.model,
                                store_dirs=stores, tls=tls)
                config = uvicorn.Config(kernel.asgi, lifespan="on", log_level="warning", access_log=False,
                                        timeout_graceful_shutdown=5, log_config=None, server_header=False,
                                        loop=loop, http=http, **(tls.uvicorn_options() if tls else {}))
                self.running = uvicorn.Server(config)  # on a thread that is not main: no signal handlers
                restart = [False]

                def exit_handler(again: bool, running: Any = self.running) -> None:
                    restart[0] = again
                    running.should_exit = True

                def announce(kernel: Any = kernel, restarted: bool = restarted) -> None:
                    kernel.write_server_file(s.host, self.port)
                    line = serving_line(kernel, s.host, self.port, loop, http, restarted=restarted)
                    with open(s.log_path, "a", encoding="utf-8") as log:  # as localm serve prints it
                        log.write(line + "\n")
                    s._found(json.loads((s.data_dir / "server.json").read_text()))
                    self.ready.set()

                kernel.exit_handler = exit_handler
                kernel.on_ready = announce
                try:
                    self.running.run(sockets=[self.sock])
                finally:
                    kernel.forget_server_file()
                if not restart[0] or self.stopping:
                    return
                restarted = True
        except BaseException as exc:  # reported by wait(); the thread ends
            self.failed = exc
            self.ready.set()

    def stop(self) -> None:
        self.stopping = True
        if self.running is not None:
            self.running.should_exit = True
        self.thread.join(60)
        self.sock.close()
        for name in ("localm", "uvicorn"):
            logging.getLogger(name).removeHandler(self.handler)
        self.handler.close()


def _verify(info: dict[str, Any]) -> Any:
    """What a client of the server ``server.json`` (``info``) describes verifies HTTPS with."""
    from localm.kernel.client import verify_for

    return verify_for(info)


def _cli_in_process(cmd: list[str], input: str | None, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``localm ARGS`` (``cmd`` after ``-m localm.kernel``) through Click's test runner, with
    ``env`` set for the call as the subprocess would see it."""
    import traceback

    from click.testing import CliRunner

    from localm.kernel.cli import main

    runner = CliRunner(env=env)
    result = runner.invoke(main, cmd[3:], input=input, prog_name="localm", catch_exceptions=True)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(cmd, result.exit_code, result.stdout, stderr)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "server_process: the test's servers run as localm serve subprocesses "
                                       "(it signals, kills, restarts or waits on the process)")
    # a server runs in the test's process: Litestar's notice that a route's parameters are read
    # from the handler's signature (the SDK's documented style, with litestar<3) is not the test's
    config.addinivalue_line("filterwarnings", "ignore::litestar.exceptions.LitestarDeprecationWarning")


def wants_process(request: pytest.FixtureRequest) -> bool | None:
    """True when the requesting test (or its module) is marked ``server_process``; else None
    (the server decides)."""
    node = request.node
    return True if node.get_closest_marker("server_process") is not None else None


def _servers(tmp_path_factory: pytest.TempPathFactory,
             request: pytest.FixtureRequest) -> Iterator[Callable[..., LocalmServer]]:
    """What both server fixtures yield: ``start(prepare=None, data_dir=None, **kwargs)``, and
    every server it started stopped when the fixture ends."""
    started: list[LocalmServer] = []

    def start(*, prepare: Callable[[Path], Any] | None = None, data_dir: Path | None = None,
              **kwargs: Any) -> LocalmServer:
        d = data_dir or tmp_path_factory.mktemp("localm") / "data"
        if prepare is not None:
            d.mkdir(parents=True, exist_ok=True)
            prepare(d)
        kwargs.setdefault("process", wants_process(request))
        server = LocalmServer(d, **kwargs).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def localm_server(tmp_path_factory: pytest.TempPathFactory,
                  request: pytest.FixtureRequest) -> Iterator[Callable[..., LocalmServer]]:
    """Start real servers: ``localm_server(plugins=[...], env={...}, data_dir=..., process=...)``."""
    yield from _servers(tmp_path_factory, request)


@pytest.fixture(scope="module")
def localm_module_server(tmp_path_factory: pytest.TempPathFactory,
                         request: pytest.FixtureRequest) -> Iterator[Callable[..., LocalmServer]]:
    """Start real servers shared by a test module's tests (stopped after its last test):
    ``localm_module_server(prepare=None, **kwargs)`` takes ``localm_server``'s arguments, and
    ``prepare(data_dir)`` is called on the fresh data dir before the server starts (keys,
    config, plugins installed offline)."""
    yield from _servers(tmp_path_factory, request)


def offline_cli(data_dir: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``localm --data-dir DATA_DIR ARGS`` with no server running (as ``LocalmServer.cli``
    runs it: in this process unless the command needs one) and return its stdout; an exit
    status other than 0 fails the test with the command's output."""
    result = LocalmServer(data_dir, env=env).cli(*args)
    if result.returncode != 0:
        raise AssertionError(f"localm {' '.join(map(str, args))} exited with {result.returncode}:\n"
                             f"{result.stderr}{result.stdout}")
    return result.stdout


def sse_events(server: LocalmServer, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """POST ``body`` to ``path`` on ``server`` and yield each server-sent event's JSON, until
    ``data: [DONE]`` or the end of the stream. It sends no credential (an open server); for a
    keyed one, stream with ``server.client(key)``."""
    with httpx.Client(base_url=server.url, timeout=120, verify=server.verify) as http, \
            http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return
            if line.startswith("data: "):
                yield json.loads(line[6:])


def wait_job(client: httpx.Client, job_id: str, timeout: float = 300) -> dict[str, Any]:
    """A server job's record (``GET /api/jobs/{job_id}``) once it has ended: done, failed or
    cancelled; the test fails when it has not ended in ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/api/jobs/{job_id}").json()
        if job["status"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not end in {timeout}s")


def plugin_module(plugin: str, module: str = "") -> Any:
    """A builtin plugin's package, or one of its modules, imported for a test by the name the
    plugin host gives it (``localm_plugins.<id>``): ``plugin_module("remote", "remote_engine.source")``.
    Nothing is activated; a module already imported (by an earlier call, or an in-process
    server) is returned as it is."""
    import importlib
    import importlib.util
    import types

    from localm.kernel.plugin_files import PACKAGE_ROOT, builtin_root

    root = builtin_root()
    folder = root / plugin if root is not None else None
    if folder is None or not (folder / "plugin.toml").is_file():
        raise LookupError(f"No builtin plugin {plugin}")
    if PACKAGE_ROOT not in sys.modules:
        package = types.ModuleType(PACKAGE_ROOT)
        package.__path__ = []  # type: ignore[attr-defined]
        sys.modules[PACKAGE_ROOT] = package
    name = f"{PACKAGE_ROOT}.{plugin}"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]  # type: ignore[attr-defined]
        package.__package__ = name
        sys.modules[name] = package
    return importlib.import_module(f"{name}.{module}" if module else name)
