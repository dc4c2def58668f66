"""Plugin lifecycle on a real server: install, enable, disable, uninstall, refresh,
install-external, install-deps; broken plugins are reported and everything else serves."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import TEST_STORE, offline_cli


def state(client: Any, name: str) -> dict[str, Any]:
    listing = client.get("/api/plugins").json()
    return next(p for p in listing["plugins"] if p["name"] == name)


def test_install_enable_disable_uninstall_round_trip(server: Any) -> None:
    s = server()
    owner = s.owner()
    assert state(owner, "guard")["installed"] is False and state(owner, "guard")["available"] is True
    assert owner.get("/guard/ping").status_code == 404

    assert owner.post("/api/plugins/parent/install").json() == {"status": "installed", "name": "parent"}
    assert owner.post("/api/plugins/child/install").json() == {"status": "installed", "name": "child"}
    p = state(owner, "child")
    assert p["installed"] and p["enabled"] and p["active"] and p["loaded"] and p["missing_requires"] == []
    assert owner.post("/child/bump").json() == {"value": 1}
    assert owner.post("/child/bump").json() == {"value": 2}

    # disabling a required plugin stops its dependents: their routes 404 at once
    assert owner.post("/api/plugins/parent/disable").json() == {"status": "disabled", "name": "parent"}
    assert owner.post("/child/bump").status_code == 404
    child = state(owner, "child")
    assert child["enabled"] and not child["active"] and child["missing_requires"] == ["parent"]
    assert json.loads((s.data_dir / "config.json").read_text())["plugins_enabled"]["parent"] is False

    # enabling it again brings both back, without a restart
    assert owner.post("/api/plugins/parent/enable").json() == {"status": "enabled", "name": "parent"}
    assert owner.post("/child/bump").json() == {"value": 1}  # a fresh start of the parent plugin

    assert owner.post("/api/plugins/child/uninstall").json() == {"status": "uninstalled", "name": "child"}
    assert not (s.data_dir / "plugins" / "child").exists()
    assert owner.post("/child/bump").status_code == 404
    assert state(owner, "child")["installed"] is False


def test_enable_and_disable_persist_across_a_restart(server: Any, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    s = server(data_dir=data_dir)
    owner = s.owner()
    owner.post("/api/plugins/guard/install")
    owner.post("/api/plugins/valves/install")
    owner.post("/api/plugins/valves/disable")
    s.stop()
    s2 = server(data_dir=data_dir)
    assert state(s2.owner(), "valves")["active"] is False
    assert state(s2.owner(), "guard")["active"] is True
    assert s2.owner().get("/valves/values").status_code == 404


def test_plugin_that_fails_to_import_is_reported_and_the_rest_serves(server: Any) -> None:
    s = server()
    owner = s.owner()
    owner.post("/api/plugins/guard/install")
    r = owner.post("/api/plugins/broken/install")
    assert r.status_code == 200  # installed; it failed to start, which GET /api/plugins reports
    listing = owner.get("/api/plugins").json()
    assert "ModuleNotFoundError" in listing["errors"]["broken"]
    assert "localm_missing_dependency_for_tests" in listing["errors"]["broken"]
    broken = state(owner, "broken")
    assert broken["installed"] and not broken["loaded"] and not broken["active"]
    assert "Traceback" not in broken["error"]
    assert owner.get("/guard/ping").json() == {"pong": "guard"}
    # enabling it again is refused with its error, and changes nothing
    before = (s.data_dir / "config.json").read_bytes()
    r = owner.post("/api/plugins/broken/enable")
    assert r.status_code == 400 and "ModuleNotFoundError" in r.json()["detail"]
    assert (s.data_dir / "config.json").read_bytes() == before
    assert owner.post("/api/plugins/broken/uninstall").status_code == 200
    assert "broken" not in owner.get("/api/plugins").json()["errors"]


def test_plugin_that_raises_in_startup_is_reported(server: Any) -> None:
    s = server()
    owner = s.owner()
    owner.post("/api/plugins/failstart/install")
    p = state(owner, "failstart")
    assert p["error"] == "RuntimeError: cannot reach its backend" and not p["active"] and not p["loaded"]
    assert owner.get("/failstart/ping").status_code == 404
    assert owner.get("/api/plugins").status_code == 200


def test_plugin_whose_routes_clash_is_reported(server: Any) -> None:
    s = server()
    owner = s.owner()
    owner.post("/api/plugins/clash/install")
    p = state(owner, "clash")
    assert not p["active"] and "already served by the kernel" in p["error"]
    assert s.client().get("/health").json()["status"] != "not the kernel's"


def test_malformed_manifest_is_reported_with_file_and_field(server: Any) -> None:
    s = server()
    errors = s.owner().get("/api/plugins").json()["errors"]
    assert errors["badmanifest"].endswith("badmanifest/plugin.toml: field 'version': expected a string")
    r = s.owner().post("/api/plugins/badmanifest/install")
    assert r.status_code == 400 and "field 'version'" in r.json()["detail"]


def test_protected_plugin_cannot_be_disabled_or_uninstalled(server: Any) -> None:
    s = server()
    owner = s.owner()
    owner.post("/api/plugins/guard/install")
    r = owner.post("/api/plugins/guard/disable")
    assert r.status_code == 409
    assert owner.post("/api/plugins/guard/uninstall").status_code == 409
    assert owner.get("/guard/ping").status_code == 200


def test_status_codes_of_the_management_routes(server: Any) -> None:
    s = server()
    owner = s.owner()
    assert owner.post("/api/plugins/nosuch/install").status_code == 404
    assert owner.post("/api/plugins/nosuch/enable").status_code == 404
    assert owner.post("/api/plugins/valves/enable").status_code == 409  # not installed
    assert owner.post("/api/plugins/nosuch/disable").json() == {"status": "disabled", "name": "nosuch"}
    assert owner.post("/api/plugins/Bad-Name/disable").status_code == 404
    assert owner.post("/api/plugins/valves/uninstall").status_code == 400  # not installed
    assert owner.post("/api/plugins/nosuch/refresh").status_code == 404


def test_plugins_option_limits_what_runs(server: Any, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    offline_cli(data_dir, "plugin", "install", "valves")
    offline_cli(data_dir, "plugin", "install", "jobber")
    offline_cli(data_dir, "plugin", "install", "guard")
    s = server(data_dir=data_dir, plugins=["jobber"])
    owner = s.owner()
    assert state(owner, "jobber")["active"]
    valves = state(owner, "valves")
    assert valves["enabled"] and not valves["active"] and valves["extra"] == {"excluded_by_plugins_option": True}
    assert state(owner, "guard")["active"]  # protected plugins always run


def test_install_external_then_refresh_picks_up_changes(server: Any, tmp_path: Path) -> None:
    s = server()
    owner = s.owner()
    src = tmp_path / "my-plugin"
    shutil.copytree(TEST_STORE / "guard", src)
    (src / "plugin.toml").write_text((src / "plugin.toml").read_text()
                                     .replace('id = "guard"', 'id = "mine"').replace("protected = true", ""))
    (src / "guard.py").write_text((src / "guard.py").read_text().replace("/guard/", "/mine/"))
    r = owner.post("/api/plugins/install-external", json={"source": str(src)})
    assert r.json() == {"status": "installed", "name": "mine", "version": "1.0.0"}
    assert owner.get("/mine/ping").json() == {"pong": "guard"}
    # installing again needs force
    again = owner.post("/api/plugins/install-external", json={"source": str(src)})
    assert again.status_code == 400 and "force" in again.json()["detail"]
    # edit the installed copy: a refresh reloads it without a restart
    installed = s.data_dir / "plugins" / "mine" / "guard.py"
    installed.write_text(installed.read_text().replace('{"pong": "guard"}', '{"pong": "edited"}'))
    out = owner.post("/api/plugins/refresh").json()
    assert out == {"status": "ok", "refreshed": ["mine"], "failed": {}}
    assert owner.get("/mine/ping").json() == {"pong": "edited"}
    # an external plugin has no shipped copy to refresh from
    assert owner.post("/api/plugins/mine/refresh").status_code == 404


@pytest.mark.parametrize("body, detail", [
    ({}, "source must be"),
    ({"source": "/nonexistent/folder"}, "source is not a folder"),
    ({"source": str(TEST_STORE)}, "source has no plugin.toml"),
    ({"source": str(TEST_STORE / "badmanifest")}, "Plugin rejected:"),
])
def test_install_external_refusals(server: Any, body: dict[str, Any], detail: str) -> None:
    s = server()
    r = s.owner().post("/api/plugins/install-external", json=body)
    assert r.status_code == 400 and r.json()["detail"].startswith(detail)
    assert not (s.data_dir / "plugins").exists() or not any((s.data_dir / "plugins").iterdir())


def test_refresh_one_catalog_plugin_from_the_store(server: Any, tmp_path: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(TEST_STORE / "guard", store / "guard")
    s = server(env={"LOCALM_PLUGIN_STORE": str(store)})
    owner = s.owner()
    owner.post("/api/plugins/guard/install")
    assert owner.post("/api/plugins/guard/refresh").json() == {"status": "up-to-date", "name": "guard"}
    module = store / "guard" / "guard.py"
    module.write_text(module.read_text().replace('{"pong": "guard"}', '{"pong": "v2"}'))
    assert owner.post("/api/plugins/guard/refresh").json() == {"status": "refreshed", "name": "guard"}
    assert owner.get("/guard/ping").json() == {"pong": "v2"}


def test_uninstall_with_delete_data(server: Any) -> None:
    s = server()
    owner = s.owner()
    owner.post("/api/plugins/valves/install")
    owner.post("/v1/plugins/valves/settings", json={"threshold": 0.7})
    (s.data_dir / "plugin-data" / "valves").mkdir(parents=True)
    assert owner.post("/api/plugins/valves/uninstall", params={"delete_data": "true"}).status_code == 200
    assert not (s.data_dir / "plugin-data" / "valves").exists()
    assert "valves" not in json.loads((s.data_dir / "config.json").read_text()).get("plugins", {})


def test_services_between_plugins(server: Any) -> None:
    s = server()
    owner = s.owner()
    owner.post("/api/plugins/child/install")  # its requirement is not installed
    child = state(owner, "child")
    assert child["missing_requires"] == ["parent"] and not child["active"]
    owner.post("/api/plugins/parent/install")
    assert state(owner, "child")["active"]
    assert owner.post("/child/bump").json() == {"value": 1}


def _uninstall_humanize() -> None:
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "humanize"], capture_output=True)


def test_install_deps_streams_pip_and_activates_the_plugin(server: Any) -> None:
    """Installs the example plugin's requirement from the package index (network: PyPI)."""
    _uninstall_humanize()
    s = server()
    owner = s.owner()
    owner.post("/api/plugins/hello/install")
    hello = state(owner, "hello")
    assert hello["missing_deps"] == ["humanize>=4"] and not hello["active"]
    assert owner.get("/api/plugins/hello/install-deps/events").status_code == 404  # none started yet
    started = owner.post("/api/plugins/hello/install-deps").json()
    assert started["status"] == "running" and started["missing"] == ["humanize>=4"]
    events = []
    with owner.stream("GET", "/api/plugins/hello/install-deps/events") as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if events[-1]["type"] == "end":
                    break
    logs = [e["line"] for e in events if e["type"] == "log"]
    assert any("humanize" in line for line in logs)
    assert events[-1] == {"type": "end", "ok": True, "installed": ["humanize>=4"], "failed": [], "error": None}
    assert state(owner, "hello")["active"]
    assert owner.get("/hello/ada").json()["greeting"] == "Hello, ada!"
    # replay: a second follower gets the whole log again
    with owner.stream("GET", "/api/plugins/hello/install-deps/events") as r:
        replay = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e for e in replay if e["type"] == "log"] == [e for e in events if e["type"] == "log"]


def test_install_deps_refused_beyond_loopback(server: Any) -> None:
    s = server(host="0.0.0.0")
    r = s.owner().post("/api/plugins/hello/install-deps")
    assert r.status_code == 403
    assert s.owner().get("/api/plugins/hello/install-deps/events").status_code == 403


def test_builtin_plugins_are_installed_and_cannot_be_uninstalled(tmp_path: Path) -> None:
    """Discovery from the builtin folder, the data dir and the catalog, on the host itself."""
    from localm.kernel.config import Config
    from localm.kernel.errors import LocalmError
    from localm.kernel.plugins import PluginHost

    builtin = tmp_path / "builtin"
    shutil.copytree(TEST_STORE / "guard", builtin / "guard")
    shutil.copytree(TEST_STORE / "jobber", builtin / "jobber")
    data_dir = tmp_path / "data"
    shutil.copytree(TEST_STORE / "jobber", data_dir / "plugins" / "jobber")  # shadowed by the builtin one
    host = PluginHost(data_dir=data_dir, config=Config(data_dir), services=None,
                      builtin_dirs=[builtin], store_dirs=[TEST_STORE])
    host.files.discover()
    listing = {p["name"]: p for p in host.listing()}
    assert listing["jobber"]["builtin"] and listing["jobber"]["installed"] and listing["jobber"]["enabled"]
    assert listing["valves"]["available"] and not listing["valves"]["installed"]
    assert "shadowed by the builtin plugin" in host.errors["jobber"]
    with pytest.raises(LocalmError) as err:
        host.files.check_uninstall("jobber")
    assert err.value.status == 400
    with pytest.raises(LocalmError) as err:
        host.files.check_uninstall("guard")
    assert err.value.status == 409


def _copy_of_guard(tmp_path: Path, name: str) -> Path:
    src = tmp_path / name
    shutil.copytree(TEST_STORE / "guard", src)
    (src / "plugin.toml").write_text((src / "plugin.toml").read_text()
                                     .replace('id = "guard"', f'id = "{name}"').replace("protected = true", "")
                                     .replace('scopes = ["guard"]', f'scopes = ["{name}"]'))
    (src / "guard.py").write_text((src / "guard.py").read_text().replace("/guard/", f"/{name}/"))
    return src


def test_a_misspelt_hook_fails_the_plugin_with_the_name_it_meant(server: Any, tmp_path: Path) -> None:
    s = server()
    owner = s.owner()
    src = _copy_of_guard(tmp_path, "typo")
    with (src / "guard.py").open("a") as fh:
        fh.write("\n\n@sdk.hookimpl\ndef chat_inlett(request):\n    return None\n"
                 "\n\n@sdk.hookimpl(optionalhook=True)\ndef a_hook_of_a_later_localm():\n    return None\n")
    assert owner.post("/api/plugins/install-external", json={"source": str(src)}).status_code == 200
    p = state(owner, "typo")
    assert not p["active"] and "chat_inlett (did you mean chat_inlet?) is no hook of localm" in p["error"], p
    assert owner.get("/typo/ping").status_code == 404
    assert owner.get("/api/plugins").status_code == 200  # the rest serves


def _plugin(folder: Path, manifest: str, module: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "plugin.toml").write_text(manifest)
    name = next(line.split('"')[1] for line in manifest.splitlines() if line.startswith("entry"))
    (folder / f"{name}.py").write_text(module)
    return folder


BELL = '''from localm import sdk


@sdk.hookspec
def bell_rang(sound):
    """Called each time the bell rings; return what you heard."""


@sdk.post("/bell/ring")
async def ring(request: sdk.Request) -> dict:
    heard = await sdk.host_of(request).run_hook("bell_rang", sound="ding")
    return {"heard": [[name, value] for name, value in heard]}


@sdk.hookimpl
def register_routes(register):
    register(ring)
'''

EAR = '''import click

from localm import sdk


@sdk.hookimpl
def bell_rang(sound):
    return sound.upper()


@click.command("ear", help="Say what the ear hears.")
def ear():
    click.echo("listening")


@sdk.hookimpl
def register_commands(register):
    register(ear)
'''


def test_a_plugin_declares_hooks_that_the_plugins_requiring_it_implement(server: Any, tmp_path: Path) -> None:
    s = server()
    owner = s.owner()
    bell = _plugin(tmp_path / "bell", 'id = "bell"\nversion = "1"\nentry = "bell"\nscopes = ["bell"]\n', BELL)
    ear = _plugin(tmp_path / "ear", 'id = "ear"\nversion = "1"\nentry = "ear"\nrequires = ["bell"]\n'
                                    'commands = ["ear"]\n', EAR)
    for folder in (bell, ear):
        assert owner.post("/api/plugins/install-external", json={"source": str(folder)}).status_code == 200
    assert state(owner, "ear")["active"], state(owner, "ear")
    assert owner.post("/bell/ring").json() == {"heard": [["ear", "DING"]]}
    # started again, the bell declares its hook anew; the ear still hears it
    owner.post("/api/plugins/bell/disable")
    assert not state(owner, "ear")["active"]
    owner.post("/api/plugins/bell/enable")
    assert state(owner, "ear")["active"] and owner.post("/bell/ring").json() == {"heard": [["ear", "DING"]]}
    # the CLI loads a plugin's commands after the plugins it requires: their hooks are known there
    assert s.cli("ear", process=True).stdout.strip() == "listening"

    # a misspelt declared hook, one with an argument the declaration lacks, and declarations
    # that are not named after their plugin each stop only their own plugin
    wrong = {
        "deaf": ("@sdk.hookimpl\ndef bell_rangg(sound):\n    return sound\n",
                 "bell_rangg (did you mean bell_rang?) is no hook of localm or of an active plugin"),
        "loud": ("@sdk.hookimpl\ndef bell_rang(sound, volume):\n    return sound\n", "volume"),
        "thief": ("@sdk.hookspec\ndef chat_inlet(request):\n    pass\n",
                  "the hook chat_inlet it declares must be named after the plugin: thief_chat_inlet"),
        "copycat": ("@sdk.hookspec\ndef bell_rang(sound):\n    pass\n",
                    "the hook bell_rang it declares must be named after the plugin"),
    }
    for name, (code, error) in wrong.items():
        folder = _plugin(tmp_path / name, f'id = "{name}"\nversion = "1"\nentry = "{name}"\nrequires = ["bell"]\n',
                         "from localm import sdk\n\n\n" + code)
        assert owner.post("/api/plugins/install-external", json={"source": str(folder)}).status_code == 200
        p = state(owner, name)
        assert not p["active"] and error in p["error"], p
    assert owner.post("/bell/ring").json() == {"heard": [["ear", "DING"]]}


def test_a_route_whose_scope_no_manifest_lists_fails_its_plugin(server: Any, tmp_path: Path) -> None:
    s = server()
    owner = s.owner()
    src = _copy_of_guard(tmp_path, "unlisted")
    (src / "guard.py").write_text((src / "guard.py").read_text()
                                  .replace('@sdk.get("/unlisted/ping")', '@sdk.get("/unlisted/ping", scope="unlisted:read")'))
    assert owner.post("/api/plugins/install-external", json={"source": str(src)}).status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and state(owner, "unlisted")["active"]:
        time.sleep(0.1)  # its routes are refused when the app is rebuilt, just after the install
    p = state(owner, "unlisted")
    assert not p["active"] and "scope 'unlisted:read', which no plugin.toml lists" in p["error"], p
    assert owner.get("/unlisted/ping").status_code == 404


def test_a_command_the_manifest_does_not_list_is_named_in_the_plugins_error(server: Any, tmp_path: Path) -> None:
    s = server()
    owner = s.owner()
    src = tmp_path / "quiet"
    shutil.copytree(TEST_STORE / "jobber", src)
    (src / "plugin.toml").write_text((src / "plugin.toml").read_text().replace('id = "jobber"', 'id = "quiet"')
                                     .replace('scopes = ["jobber"]', 'scopes = ["quiet"]')
                                     .replace('commands = ["jobber-run"]', "commands = []"))
    (src / "jobber.py").write_text((src / "jobber.py").read_text().replace("/jobber/", "/quiet/")
                                   .replace('scope="jobber', 'scope="quiet'))
    assert owner.post("/api/plugins/install-external", json={"source": str(src)}).status_code == 200
    p = state(owner, "quiet")
    assert p["active"], p  # it runs; only its command cannot be found
    assert "registers jobber-run, which plugin.toml's commands does not list" in p["error"], p


COUNTER_PY = '''from localm import sdk


class Counter:
    def __init__(self, plugin):
        self.file = plugin.data_dir / "count.txt"
        self.count = 0

    def start(self):
        if self.file.exists():
            self.count = int(self.file.read_text())

    def stop(self):
        self.file.write_text(str(self.count))


@sdk.hookimpl
def create_service(plugin):
    return Counter(plugin)


@sdk.hookimpl
def register_routes(register):
    register(next_number, read_other)


@sdk.get("/api/counter/next")
async def next_number(request: sdk.Request) -> dict:
    counter = sdk.service_of(request)
    counter.count += 1
    return {"count": counter.count}


@sdk.get("/api/counter/hooked")
async def read_other(request: sdk.Request) -> dict:
    host = sdk.host_of(request)
    return {"same": host.service("counter") is sdk.plugin_of(request).service}
'''


def test_a_plugins_service_starts_serves_its_routes_and_stops(server: Any, tmp_path: Path) -> None:
    """docs/plugins.md, "Where a plugin keeps its state": create_service's object is started,
    reached from routes and other plugins, and stopped (its state kept) when the plugin stops."""
    s = server()
    owner = s.owner()
    src = tmp_path / "counter"
    src.mkdir()
    (src / "plugin.toml").write_text('id = "counter"\nversion = "0.1.0"\nentry = "counter"\n')
    (src / "counter.py").write_text(COUNTER_PY)
    assert owner.post("/api/plugins/install-external", json={"source": str(src)}).status_code == 200
    assert [owner.get("/api/counter/next").json()["count"] for _ in range(3)] == [1, 2, 3]
    assert owner.get("/api/counter/hooked").json() == {"same": True}
    assert owner.post("/api/plugins/counter/disable").status_code == 200
    assert (s.data_dir / "plugin-data" / "counter" / "count.txt").read_text() == "3"  # stop() ran
    assert owner.post("/api/plugins/counter/enable").status_code == 200
    assert owner.get("/api/counter/next").json()["count"] == 4  # start() read it back
