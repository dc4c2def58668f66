"""The plugin catalogue: ``localm plugin search`` and ``plugin info`` over builtin, installed and
catalog plugins plus the catalog's ``index.toml``; ``localm plugin install NAME`` through an
index entry that names a plugin folder, a pip package on a package index or a local wheel
(built here)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from cli_fixtures import installed, package_index, pip_env, uninstall, wheel
from conftest import TEST_STORE
from localm.sdk.testing import LocalmServer

FORECAST_TOML = '''id = "forecast"
version = "1.2.0"
description = "Test plugin shipped in a wheel: says what the sky does."
entry = "forecast"
'''
FORECAST_PY = '''from localm import sdk


@sdk.get("/forecast")
async def forecast() -> dict:
    return {"sky": "clear"}


@sdk.hookimpl
def register_routes(register):
    register(forecast)
'''


def store(tmp_path: Path, index: str) -> dict[str, str]:
    """A catalog folder with ``index`` as its index.toml, beside the test plugins; its env."""
    folder = tmp_path / "store"
    folder.mkdir(exist_ok=True)
    (folder / "index.toml").write_text(index)
    return {"LOCALM_PLUGIN_STORE": f"{folder}:{TEST_STORE}"}


def test_search_and_info(tmp_path: Path) -> None:
    env = store(tmp_path, '[[plugins]]\nname = "weather"\npip = "localm-weather-not-on-pypi"\n'
                          'description = "Forecasts in chat."\nkeywords = ["sky", "rain"]\n')
    s = LocalmServer(tmp_path / "data", env=env)
    found = s.cli("plugin", "search", "greeting")  # a keyword from plugin-store/index.toml
    assert found.returncode == 0 and found.stdout.startswith("hello ") and "available" in found.stdout
    assert s.cli("plugin", "search", "RAIN").stdout.split()[:3] == ["weather", "-", "available"]
    memory = s.cli("plugin", "search", "long-term", "memory").stdout  # every word, from the description
    assert memory.startswith("memory ") and len(memory.splitlines()) == 1
    assert s.cli("plugin", "search", "zebra", "crossing").stdout == "No plugin matches 'zebra crossing'.\n"
    rows = json.loads(s.cli("plugin", "search", "sky", "--json").stdout)
    assert [(r["name"], r["source"]) for r in rows] == [("weather", "pip: localm-weather-not-on-pypi")]

    info = s.cli("plugin", "info", "hello").stdout
    assert info.startswith("hello 0.1.0\n  An example plugin")
    assert "  requirements: humanize>=4" in info and "  source:       catalog" in info
    assert info.endswith("Install it with `localm plugin install hello`.\n")
    assert "  source:       builtin" in s.cli("plugin", "info", "rag").stdout
    assert json.loads(s.cli("plugin", "info", "weather", "--json").stdout)["keywords"] == ["sky", "rain"]
    unknown = s.cli("plugin", "info", "nosuch")
    assert unknown.returncode == 1
    assert unknown.stderr == "Error: Unknown plugin: nosuch (localm plugin search TEXT finds plugins)\n"


def test_a_broken_index_is_reported_and_the_rest_still_works(tmp_path: Path) -> None:
    env = store(tmp_path, '[[plugins]]\nname = "Bad Name"\npath = "x"\n\n[[plugins]]\nname = "both"\n'
                          'pip = "a"\npath = "b"\n')
    out = LocalmServer(tmp_path / "data", env=env).cli("plugin", "search", "hello")
    assert out.returncode == 0 and out.stdout.startswith("hello ")
    assert "plugins[0]: name must be a legal plugin id" in out.stderr
    assert "plugins[1] (both): give either pip (a requirement or a wheel) or path (a folder)" in out.stderr
    (tmp_path / "store" / "index.toml").write_text("[[plugins]\n")
    out = LocalmServer(tmp_path / "data", env=env).cli("plugin", "search", "hello")
    assert out.returncode == 0 and out.stderr.startswith("Warning: ") and "index.toml" in out.stderr


def test_install_a_folder_the_index_names(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere" / "stamp-plugin"
    elsewhere.parent.mkdir()
    subprocess.run(["cp", "-r", str(TEST_STORE / "stamp"), str(elsewhere)], check=True)
    env = store(tmp_path, '[[plugins]]\nname = "stamp"\npath = "../elsewhere/stamp-plugin"\n'
                          '[[plugins]]\nname = "liar"\npath = "../elsewhere/stamp-plugin"\n')
    env["LOCALM_PLUGIN_STORE"] = str(tmp_path / "store")  # stamp is no catalog folder now: only the index has it
    s = LocalmServer(tmp_path / "data", env=env)
    assert s.cli("plugin", "info", "stamp").stdout.splitlines()[0].startswith("stamp ")
    out = s.cli("plugin", "install", "stamp")
    assert out.returncode == 0 and out.stdout.startswith("Installed stamp.\n"), out.stderr
    assert (tmp_path / "data" / "plugins" / "stamp" / "plugin.toml").is_file()
    liar = s.cli("plugin", "install", "liar")
    assert liar.returncode == 1
    assert liar.stderr.startswith("Error: The catalog's entry for liar points at the plugin stamp")
    assert not (tmp_path / "data" / "plugins" / "liar").exists()


def test_install_a_pip_package_by_name_through_a_running_server(tmp_path: Path, server: Any) -> None:
    """The index names a package; pip fetches it from a package index (one on loopback here)."""
    built = wheel(tmp_path, "localm-forecast-test", {"localm_forecast_test/__init__.py": "",
                                                     "localm_forecast_test/plugin/plugin.toml": FORECAST_TOML,
                                                     "localm_forecast_test/plugin/forecast/__init__.py": FORECAST_PY})
    folder = tmp_path / "store"
    folder.mkdir()
    (folder / "index.toml").write_text('[[plugins]]\nname = "forecast"\ndescription = "What the sky does."\n'
                                       'pip = "localm-forecast-test>=0.1"\n')
    uninstall("localm-forecast-test")
    with package_index(tmp_path / "index", [built]) as url:
        s = server(env={"LOCALM_PLUGIN_STORE": str(folder), **pip_env(url), "PIP_CONFIG_FILE": os.devnull,
                        "PIP_FIND_LINKS": ""})
        try:
            assert s.cli("plugin", "search", "sky").stdout.startswith("forecast ")
            assert "  source:       pip: localm-forecast-test>=0.1" in s.cli("plugin", "info", "forecast").stdout
            out = s.cli("plugin", "install", "forecast")
            assert out.returncode == 0, out.stderr
            lines = out.stdout.splitlines()
            assert lines[0] == "Installing localm-forecast-test>=0.1 with pip"
            assert f"  Looking in indexes: {url}" in lines
            assert any(line.startswith("    Downloading localm_forecast_test-0.1.0-py3-none-any.whl (") for line in lines)
            assert "  Successfully installed localm-forecast-test-0.1.0" in lines
            assert lines[-2:] == ["Installed forecast.", "It is active."]
            assert s.owner().get("/forecast").json() == {"sky": "clear"}
            info = s.cli("plugin", "info", "forecast").stdout
            assert info.startswith("forecast 1.2.0\n") and "  state:        active" in info
        finally:
            uninstall("localm-forecast-test")


def test_a_package_without_the_plugin_is_removed_again(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    folder.mkdir()
    wheel(folder, "localm-empty-test", {"localm_empty_test/__init__.py": ""})
    (folder / "index.toml").write_text('[[plugins]]\nname = "empty"\npip = "./localm_empty_test-0.1.0-py3-none-any.whl"\n')
    s = LocalmServer(tmp_path / "data", env={"LOCALM_PLUGIN_STORE": str(folder)})
    try:
        out = s.cli("plugin", "install", "empty")
        assert out.returncode == 1
        assert out.stderr == ("Error: ./localm_empty_test-0.1.0-py3-none-any.whl installs no plugin named empty "
                              "(no plugin.toml with id = \"empty\" among its files)\n")
        assert not installed("localm-empty-test")  # what the command installed is gone again
        assert not (tmp_path / "data" / "plugins" / "empty").exists()
    finally:
        uninstall("localm-empty-test")
