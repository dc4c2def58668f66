"""Test helpers for localm and its plugins: a real server on a free loopback port.

Loaded as a pytest plugin (entry point ``localm``), it provides the ``localm_server``
fixture: call it to start ``localm serve`` in a subprocess with chosen plugins and a
temporary data dir; every server it started is stopped after the test::

    def test_hello(localm_server):
        server = localm_server(plugins=["hello"])
        assert server.client().get("/hello/ada").json() == {"greeting": "Hello, ada"}
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

START_TIMEOUT = float(os.environ.get("LOCALM_TEST_START_TIMEOUT", "60"))


#: Commands ``LocalmServer.cli`` always runs as a process: they serve, or read a terminal.
PROCESS_COMMANDS = ("serve", "run")


class LocalmServer:
    """A ``localm serve`` subprocess with its own data dir."""

    def __init__(self, data_dir: Path, *, plugins: list[str] | None = None, env: dict[str, str] | None = None,
                 model: str | None = None, host: str = "127.0.0.1", args: list[str] | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.plugins = plugins
        self.env = dict(env or {})
        self.model = model
        self.host = host
        self.args = list(args or [])
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.port = 0
        self.token = ""
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

    def start(self) -> "LocalmServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
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
                    httpx.get(f"{info['url']}/health", timeout=2)
                except httpx.HTTPError:
                    pass
                else:
                    self.url, self.port, self.token = info["url"], info["port"], info["token"]
                    return
            time.sleep(0.05)
        raise RuntimeError(f"localm serve did not become ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-8000:]
        except OSError:
            return ""

    def stop(self) -> None:
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


@pytest.fixture
def localm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LocalmServer]]:
    """Start real servers: ``localm_server(plugins=[...], env={...}, data_dir=...)``."""
    started: list[LocalmServer] = []

    def start(*, data_dir: Path | None = None, **kwargs: Any) -> LocalmServer:
        d = data_dir or tmp_path_factory.mktemp("localm") / "data"
        server = LocalmServer(d, **kwargs).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def plugin_module(plugin: str, module: str = "") -> Any:
    """A builtin plugin's package, or one of its modules, imported for a test by the name the
    plugin host gives it (``localm_plugins.<id>``): ``plugin_module("remote", "remote_engine.source")``.
    Nothing is activated; a module already imported (by an earlier call, or an in-process
    server) is returned as it is."""
    import importlib
    import importlib.util
    import types

    from localm.kernel.plugins import PACKAGE_ROOT, builtin_root

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
