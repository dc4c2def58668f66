"""Open WebUI Functions, run unmodified.

``localm plugin install my_filter.py`` turns a Function file into a plugin of its own
(see ``install.py``, this plugin's installer); this plugin runs them: it provides the ``openwebui``
service their hooks call, the engine that answers their Pipes' models, and the routes for
Actions and UserValves:

- ``GET /api/functions``: the running Functions (type, models, actions, valves);
- ``POST /api/functions/{id}/action``: run an Action (``id`` or ``id.sub_id``) on a message body;
- ``GET``/``POST /api/functions/{id}/valves/user``: the caller's own UserValves.

docs/open-webui.md describes it for users.
"""

from __future__ import annotations

from typing import Any

from localm import sdk

from . import valves
from .pipes import PipeEngine
from .runtime import Functions, who

_STATE: dict[str, Functions] = {}


def current() -> Functions:
    found = _STATE.get("functions")
    if found is None:
        raise sdk.LocalmError(503, "The openwebui plugin is not running", code="service_unavailable")
    return found


@sdk.hookimpl
def startup(host: Any, plugin: Any) -> None:
    functions = Functions(host)
    _STATE["functions"] = functions
    host.provide("openwebui", functions, plugin=plugin.name)


@sdk.hookimpl
def shutdown() -> None:
    from . import loader

    _STATE.pop("functions", None)
    loader.remove_shim()


@sdk.hookimpl
def register_engines(register: Any) -> None:
    def load(entry: Any, options: dict[str, Any]) -> PipeEngine:
        return PipeEngine(current(), entry.provider, entry.id)

    register("openwebui", load)


@sdk.hookimpl
def register_installers(register: Any) -> None:
    from . import install
    register("function", install.read)


async def _body(request: sdk.Request) -> dict[str, Any]:
    return await sdk.json_body(request, empty={})


@sdk.get("/api/functions", scope=None, access="inference", web=False,
         summary="The Open WebUI Functions that run here")
async def list_functions() -> dict[str, Any]:
    functions = current()
    return {"functions": [functions.describe(fn) for _, fn in sorted(functions.loaded.items())]}


@sdk.post("/api/functions/{action_id:str}/action", scope=None, access="inference", web=False,
          summary="Run an Open WebUI Action on a message")
async def run_action(request: sdk.Request, action_id: str) -> dict[str, Any]:
    body = await _body(request)
    return await current().action(action_id, body, sdk.caller(request))


def _user_valves(fid: str) -> Any:
    fn = current().get(fid)
    if fn.user_valves_cls is None:
        raise sdk.LocalmError(404, f"{fid} has no UserValves", code="no_user_valves")
    return fn


@sdk.get("/api/functions/{fid:str}/valves/user", scope=None, access="inference", web=False,
         summary="The caller's UserValves of a Function")
async def read_user_valves(request: sdk.Request, fid: str) -> dict[str, Any]:
    fn = _user_valves(fid)
    caller = sdk.caller(request)
    values = fn.user_valves.get(who(caller))
    return {"function": fid, "values": values, "fields": valves.schema(fn.user_valves_cls, values, None)}


@sdk.post("/api/functions/{fid:str}/valves/user", scope=None, access="inference", web=False,
          summary="Set the caller's UserValves of a Function (null or \"\" resets one)")
async def write_user_valves(request: sdk.Request, fid: str) -> dict[str, Any]:
    fn = _user_valves(fid)
    caller = sdk.caller(request)
    updates = await _body(request)
    model = fn.user_valves_cls
    unknown = sorted(set(updates) - {f.alias or name for name, f in model.model_fields.items()})
    if unknown:
        raise sdk.LocalmError(400, f"Unknown user valve(s) of {fid}: {', '.join(unknown)}")
    values = fn.user_valves.get(who(caller))
    for key, value in updates.items():
        if value is None or value == "":
            values.pop(key, None)
        else:
            values[key] = value
    stored = valves.validator(model)(values)
    fn.user_valves.set(who(caller), stored)
    return {"function": fid, "values": stored, "fields": valves.schema(model, stored, None)}


@sdk.hookimpl
def register_routes(register: Any) -> None:
    register(list_functions, run_action, read_user_valves, write_user_valves)
