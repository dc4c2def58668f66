"""The localm CLI: on the data dir directly when no server runs, through the server when one does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import STORE_ENV
from localm.sdk.testing import LocalmServer


def cli(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return LocalmServer(data_dir, env=STORE_ENV).cli(*args)


def test_console_script() -> None:
    script = Path(sys.executable).parent / "localm"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("localm, version ")


def test_offline_plugin_commands(tmp_path: Path) -> None:
    d = tmp_path / "data"
    listing = cli(d, "plugin", "list").stdout
    assert "jobber" in listing and "available" in listing and "no server running" in listing
    assert cli(d, "plugin", "install", "jobber").stdout.startswith("Installed jobber.")
    assert (d / "plugins" / "jobber" / "plugin.toml").is_file()
    assert "enabled" in next(line for line in cli(d, "plugin", "list").stdout.splitlines() if "jobber" in line)
    cli(d, "plugin", "disable", "jobber")
    assert json.loads((d / "config.json").read_text())["plugins_enabled"]["jobber"] is False
    cli(d, "plugin", "enable", "jobber")
    out = cli(d, "plugin", "uninstall", "jobber")
    assert out.returncode == 0 and not (d / "plugins" / "jobber").exists()


def test_refusals_are_clean_errors(tmp_path: Path) -> None:
    d = tmp_path / "data"
    for args, message in [
        (("plugin", "install", "nosuch"), "Unknown plugin: nosuch"),
        (("plugin", "enable", "jobber"), "jobber is not installed"),
        (("plugin", "install", str(tmp_path)), "source has no plugin.toml"),
        (("config", "set", "port", "high"), "Invalid value for port"),
        (("config", "set", "nope", "1"), "Unknown config key: nope"),
        (("config", "set", "require_auth", "true"), "require_auth needs an API key first"),
        (("key", "create", "--scope", "Bad Scope"), "Unknown scope: Bad Scope"),
        (("key", "revoke", "key_nosuch"), "No key with id key_nosuch"),
    ]:
        out = cli(d, *args)
        assert out.returncode == 1, args
        assert out.stderr.startswith("Error: ") and message in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr


def test_offline_keys_and_config(tmp_path: Path) -> None:
    d = tmp_path / "data"
    owner = cli(d, "key", "generate").stdout.strip()
    assert owner.startswith("lm-")
    made = cli(d, "key", "create", "--name", "ci", "--scope", "config:read", "--expires-in", "60")
    assert made.returncode == 0 and made.stdout.strip().startswith("lm-")
    key_id = made.stderr.split()[1].rstrip(":")
    assert key_id in cli(d, "key", "list").stdout
    assert cli(d, "key", "revoke", key_id).returncode == 0
    assert cli(d, "key", "list").stdout.strip() == "No scoped keys."
    assert cli(d, "config", "set", "cors_origins", '["http://app.test"]').returncode == 0
    assert json.loads(cli(d, "config", "get", "cors_origins").stdout) == ["http://app.test"]
    assert cli(d, "key", "clear").returncode == 0
    assert not (d / "owner_key.json").exists()


def test_commands_go_through_a_running_server(server: Any) -> None:
    s = server()
    out = s.cli("plugin", "install", "jobber")
    assert out.returncode == 0 and "It is active." in out.stdout
    owner = s.owner()
    assert owner.post("/jobber/start", json={"steps": 1}).status_code == 200  # mounted at once
    assert s.cli("plugin", "disable", "jobber").returncode == 0
    assert owner.post("/jobber/start", json={"steps": 1}).status_code == 404
    assert s.cli("config", "set", "suggest_plugins", "false").returncode == 0
    assert owner.get("/v1/config").json()["suggest_plugins"] is False
    assert json.loads(s.cli("config", "get").stdout)["instance_port"] == s.port
    assert "Server" not in s.cli("plugin", "list").stdout and "jobber" in s.cli("plugin", "list").stdout
    refresh = s.cli("plugin", "refresh")
    assert refresh.returncode == 0 and json.loads(refresh.stdout)["status"] == "ok"


def test_keys_through_a_running_server(server: Any) -> None:
    s = server()
    owner = s.cli("key", "generate").stdout.strip()
    assert s.client(owner).get("/v1/config").status_code == 200  # the server enforces it at once
    assert s.client().get("/v1/config").status_code == 401
    # the CLI keeps working: the attach token acts as the owner from this machine
    made = s.cli("key", "create", "--scope", "config:read").stdout.strip()
    assert s.client(made).get("/v1/config").status_code == 200
    assert s.cli("key", "clear").returncode == 0
    assert s.client().get("/api/session").json()["required"] is True  # the scoped key still exists


def test_plugin_command_from_a_manifest(tmp_path: Path) -> None:
    d = tmp_path / "data"

    def cli(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
        # each command in a fresh interpreter: what pip removed is gone there, while this
        # worker may have imported humanize for an earlier test (an in-process server's hello)
        return LocalmServer(data_dir, env=STORE_ENV).cli(*args, process=True)

    cli(d, "plugin", "install", "hello")
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "humanize"], capture_output=True)
    # a plugin command that cannot load leaves --help working and says why when run
    assert "(unavailable)" in next(line for line in cli(d, "--help").stdout.splitlines() if "hello" in line)
    broken = cli(d, "hello", "ada")
    assert broken.returncode == 1 and "No module named 'humanize'" in broken.stderr
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "humanize>=4"], capture_output=True)
    assert "Print a greeting" in cli(d, "--help").stdout
    assert cli(d, "hello", "ada").stdout.strip() == "Hello, ada!"
    cli(d, "config", "set", "plugins", '{"hello": {"shout": true}}')
    assert cli(d, "hello", "ada").stdout.strip() == "HELLO, ADA!"
    cli(d, "plugin", "disable", "hello")
    assert cli(d, "hello", "ada").returncode == 2  # no such command while disabled


def test_install_deps_shows_pip_output_live(server: Any) -> None:
    """Installs the example plugin's requirement from the package index (network: PyPI)."""
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "humanize"], capture_output=True)
    s = server()
    s.cli("plugin", "install", "hello")
    out = s.cli("plugin", "install-deps", "hello")
    assert out.returncode == 0, out.stderr
    assert "Installing: humanize>=4" in out.stdout and "Successfully installed humanize" in out.stdout
    assert "It is active." in out.stdout
    assert s.owner().get("/hello/ada").json()["greeting"] == "Hello, ada!"


def test_install_deps_beside_a_server_bound_beyond_loopback(server: Any) -> None:
    """The server refuses to run pip; the CLI on its machine runs it and has the server refresh."""
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "humanize"], capture_output=True)
    s = server(host="0.0.0.0")
    s.cli("plugin", "install", "hello")
    out = s.cli("plugin", "install-deps", "hello")
    assert out.returncode == 0, out.stderr
    assert "installing here" in out.stdout and "It is active." in out.stdout
    assert s.owner().get("/hello/ada").json()["greeting"] == "Hello, ada!"


def test_a_plugin_command_calls_the_running_server_through_the_sdk(tmp_path: Path) -> None:
    d = tmp_path / "data"
    assert cli(d, "plugin", "install", "jobber").returncode == 0
    out = cli(d, "jobber-run", "2")  # no server yet: a clean error, not a traceback
    assert out.returncode == 1
    assert out.stderr == f"Error: No localm server is running on {d}: start one with `localm serve`\n"
    server = LocalmServer(d, env=STORE_ENV).start()
    try:
        out = server.cli("jobber-run", "2")
        assert out.returncode == 0, out.stderr
        assert out.stdout == "step 1\nstep 2\nresult: {'steps': 2}\n"
    finally:
        server.stop()


def test_installing_a_plugin_that_fails_to_start_exits_nonzero(tmp_path: Path) -> None:
    from conftest import TEST_STORE

    server = LocalmServer(tmp_path / "data", env=STORE_ENV).start()
    try:
        out = server.cli("plugin", "install", str(TEST_STORE / "failstart"))
        assert out.returncode == 1 and out.stdout == "Installed failstart.\n"
        assert out.stderr == "Error: failstart failed to start: RuntimeError: cannot reach its backend\n"
    finally:
        server.stop()
