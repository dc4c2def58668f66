"""Plugin management: list, install, uninstall, enable, disable, refresh, install-deps."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, AsyncIterator

import attrs
from litestar import Request

from .. import deps, limits
from ..errors import LocalmError
from ..jobs import JobContext
from ..manifest import legal_id
from ..routing import get, post
from .common import json_body, kernel_of, principal_of, sse


def _name(name: str) -> str:
    if not legal_id(name):
        raise LocalmError(404, f"Unknown plugin: {name}")
    return name


@get("/api/plugins", scope="plugins:read", summary="Every plugin the host knows, with its state")
async def list_plugins(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    return {"plugins": k.plugins.listing(), "errors": k.plugins.errors,
            "suggest_plugins": bool(k.config.get("suggest_plugins")),
            "auto_install_plugin_deps": bool(k.config.get("auto_install_plugin_deps"))}


@post("/api/plugins/{name:str}/install", scope="plugins:admin", summary="Install a plugin from the catalog")
async def install(request: Request, name: str) -> dict[str, Any]:
    k = kernel_of(request)
    await k.plugins.install(_name(name))
    p = k.plugins.plugins[name]
    if k.config.get("auto_install_plugin_deps") and p.missing_deps and k.loopback_bind():
        start_deps_install(k, name, principal_of(request).owner_tag)
    return {"status": "installed", "name": name}


@post("/api/plugins/{name:str}/uninstall", scope="plugins:admin", summary="Uninstall an installed plugin")
async def uninstall(request: Request, name: str, delete_data: bool = False) -> dict[str, Any]:
    await kernel_of(request).plugins.uninstall(_name(name), delete_data=delete_data)
    return {"status": "uninstalled", "name": name}


@post("/api/plugins/{name:str}/enable", scope="plugins:admin", summary="Enable and start a plugin")
async def enable(request: Request, name: str) -> dict[str, Any]:
    await kernel_of(request).plugins.set_enabled(_name(name), True)
    return {"status": "enabled", "name": name}


@post("/api/plugins/{name:str}/disable", scope="plugins:admin", summary="Disable and stop a plugin")
async def disable(request: Request, name: str) -> dict[str, Any]:
    await kernel_of(request).plugins.set_enabled(_name(name), False)
    return {"status": "disabled", "name": name}


@post("/api/plugins/refresh", scope="plugins:admin", summary="Re-read every plugin from disk")
async def refresh_all(request: Request) -> dict[str, Any]:
    return await kernel_of(request).plugins.refresh(None)


@post("/api/plugins/{name:str}/refresh", scope="plugins:admin", summary="Re-read one shipped plugin from disk")
async def refresh_one(request: Request, name: str) -> dict[str, Any]:
    return await kernel_of(request).plugins.refresh(_name(name))


@attrs.define
class ExternalPlugin:
    """A plugin folder, an Open WebUI Function file (.py) or export (.json) as source; or a Function's
    source (or an export's JSON, without id) as content. Exactly one of source and content."""

    closed = True

    source: str | None = None
    content: str | None = None
    id: str | None = None
    force: bool = False


@post("/api/plugins/install-external", scope="plugins:admin",
      summary="Install a third-party plugin from a local folder, or Open WebUI Functions", body=ExternalPlugin,
      errors={400: "An unknown field, a field of the wrong type, both or neither of source and content, or a "
                   "source that is not a plugin", 409: "Already installed (force replaces it)"})
async def install_external(request: Request) -> dict[str, Any]:
    """``{"source": PATH}``: a plugin folder, an Open WebUI Function file (``.py``) or an Open
    WebUI export (``.json``); or ``{"content": SOURCE, "id": ID}``: a Function's source (or an
    export's JSON, without ``id``). ``force`` replaces what is installed."""
    k = kernel_of(request)
    body = await json_body(request)
    unknown = sorted(set(body) - {"source", "content", "id", "force"})
    if unknown:
        raise LocalmError(400, f"Unknown field(s): {', '.join(unknown)} (source, content, id and force are read)")
    source, content, fid = body.get("source"), body.get("content"), body.get("id")
    force = body.get("force", False)
    if not isinstance(force, bool) or (fid is not None and not isinstance(fid, str)):
        raise LocalmError(400, "force must be a boolean and id a string")
    if (source is None) == (content is None):
        raise LocalmError(400, "source must be given (a plugin folder, a .py Open WebUI Function or a .json "
                               "export), or content (a Function's source), not both")
    if source is not None:
        source = _local_path(source)
    if content is not None or (isinstance(source, str) and Path(source).expanduser().is_file()):
        found = k.plugins.read_installable(source, content=content, fid=fid)
        names = k.plugins.install_generated(found, force=force)
        await k.plugins.sync()
        first = k.plugins.plugins[names[0]]
        return {"status": "installed", "name": names[0], "names": names,
                "version": first.manifest.version if first.manifest else None,
                "types": {n: k.plugins.plugins[n].manifest.type for n in names},
                "what": {item.id: getattr(item, "what", "") for item in found}}
    if fid is not None:
        raise LocalmError(400, "id applies to an Open WebUI Function; a plugin folder names itself")
    manifest = k.plugins.files.install_external_files(source, force=force)
    await k.plugins.sync()
    return {"status": "installed", "name": manifest.id, "version": manifest.version}


def _local_path(source: Any) -> str:
    """``source`` as a path on this host (``~`` expanded); a 400 for anything that cannot be one."""
    if not isinstance(source, str):
        raise LocalmError(400, "source must be a path (string)")
    limits.check_length("source", source, limits.PATH_CHARS)
    try:
        path = Path(source).expanduser()
        path.exists()  # a NUL byte, or a name too long for the filesystem, refuses here
    except (RuntimeError, ValueError, OSError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise LocalmError(400, f"source is not a usable path: {reason}", field="source") from exc
    return str(path)


# --- install-deps ------------------------------------------------------------------------

def _refuse_remote(k: Any) -> None:
    if not k.loopback_bind():
        raise LocalmError(403, "Installing plugin dependencies is refused on a server bound beyond loopback: "
                               "run `localm plugin install-deps` on the server's machine")


def start_deps_install(k: Any, name: str, owner: str) -> Any:
    p = k.plugins.files.get(name)
    existing = k.deps_jobs.get(name)
    if existing is not None and not existing.done:
        return existing
    requirements = list(p.manifest.requirements) if p.manifest else []
    wanted = deps.missing(requirements)

    async def run(ctx: JobContext) -> dict[str, Any]:
        if not wanted:
            ctx.log("All requirements are already installed.")
            return {"ok": True, "installed": [], "failed": []}
        ctx.log("Installing: " + " ".join(wanted))
        error = None
        file = "a file"
        try:
            async for line in deps.pip_install(wanted, p.manifest.pip_env if p.manifest else None, progress=True):
                got = deps.pip_progress(line)
                if got is None:
                    file = deps.pip_download_name(line) or file
                    ctx.log(line)
                else:  # a download's bytes: a progress event a client draws as a bar
                    done, total = got
                    ctx.progress(done / total if total else None, f"Downloading {file}", unit="bytes",
                                 file=file, done=done, total=total or None)
        except RuntimeError as exc:
            error = str(exc)
        importlib.invalidate_caches()
        still = deps.missing(wanted)
        await k.plugins.sync()
        result = {"ok": error is None and not still, "installed": [r for r in wanted if r not in still],
                  "failed": still}
        if error or still:
            raise DepsFailed(error or "some requirements are still missing", result)
        return result

    job = k.jobs.start(run, kind="install-deps", title=f"Install dependencies of {name}", owner=owner, plugin=name)
    job.deps_missing = wanted
    k.deps_jobs[name] = job
    return job


class DepsFailed(RuntimeError):
    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


def _deps_state(job: Any) -> str:
    return {"done": "done", "failed": "error", "cancelled": "error"}.get(job.status, "running")


@post("/api/plugins/{name:str}/install-deps", scope="plugins:admin",
      summary="Install a plugin's pip requirements on this host (loopback servers only)")
async def install_deps(request: Request, name: str) -> dict[str, Any]:
    k = kernel_of(request)
    _refuse_remote(k)
    job = start_deps_install(k, _name(name), principal_of(request).owner_tag)
    lines = [e["line"] for e in job.events if e["type"] == "log"]
    return {"status": _deps_state(job), "name": name, "missing": job.deps_missing, "lines": lines,
            "job_id": job.id}


@get("/api/plugins/{name:str}/install-deps/events", scope="plugins:admin",
     summary="The install's log, replayed then followed, as server-sent events")
async def install_deps_events(request: Request, name: str) -> Any:
    k = kernel_of(request)
    _refuse_remote(k)
    job = k.deps_jobs.get(_name(name))
    if job is None:
        raise LocalmError(404, f"No dependency install was started for {name}")

    async def events() -> AsyncIterator[dict[str, Any]]:
        async for event in job.follow():
            if event["type"] == "log":
                yield {"type": "log", "line": event["line"]}
            elif event["type"] == "end":
                result = job.result or {}
                yield {"type": "end", "ok": event["status"] == "done", "installed": result.get("installed", []),
                       "failed": result.get("failed", job.deps_missing if event["status"] != "done" else []),
                       "error": event.get("error")}
    return sse(events(), ids=False)


ROUTES = [list_plugins, install, uninstall, enable, disable, refresh_all, refresh_one, install_external,
          install_deps, install_deps_events]
