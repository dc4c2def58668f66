"""The management routes: /api/circuits (scope ``steering``)."""

from __future__ import annotations

import time
from typing import Any

from localm import sdk

from . import Circuits, check_document, read_dial


async def _body(request: sdk.Request) -> dict[str, Any]:
    return await sdk.json_body(request, empty={})


def current(request: sdk.Request) -> Circuits:
    return sdk.service_of(request)


@sdk.get("/api/circuits", summary="List imported circuits")
async def list_circuits(request: sdk.Request) -> dict[str, Any]:
    data = current(request).data()
    return {"circuits": list(data["circuits"].values()), "active": data.get("active")}


@sdk.post("/api/circuits", status_code=201, summary="Import a circuit document")
async def import_circuit(request: sdk.Request) -> dict[str, Any]:
    c = current(request)
    doc = check_document(await _body(request))
    doc["created"] = time.time()
    overwrite = request.query_params.get("overwrite", "").lower() in ("1", "true", "yes")

    def add(data: dict[str, Any]) -> None:
        if doc["name"] in data["circuits"] and not overwrite:
            raise sdk.LocalmError(409, f"A circuit named {doc['name']!r} exists (import with ?overwrite=true to "
                                       "replace it)", code="circuit_exists")
        data["circuits"][doc["name"]] = doc

    c.file.update(add)
    return doc


@sdk.get("/api/circuits/active", summary="The active circuit, its dial, and whether it is steering now")
async def active_circuit(request: sdk.Request) -> dict[str, Any]:
    return current(request).active_view()


@sdk.post("/api/circuits/deactivate", summary="Stop steering by the active circuit")
async def deactivate_circuit(request: sdk.Request) -> dict[str, Any]:
    c = current(request)
    c.file.update(lambda data: data.__setitem__("active", None))
    return c.active_view()


@sdk.put("/api/circuits/active/intensity", summary="Set the active circuit's persistent intensity dial")
async def set_intensity(request: sdk.Request) -> dict[str, Any]:
    c = current(request)
    body = await _body(request)
    if "intensity" not in body:
        raise sdk.LocalmError(400, "Send {\"intensity\": λ} (0 to 2, \"off\", \"min\" or \"max\")",
                              code="invalid_parameter")
    try:
        dial = read_dial(c, body["intensity"])
    except sdk.LocalmError as exc:
        raise sdk.LocalmError(400, f"intensity must be a number from 0 to 2, \"off\", \"min\" or \"max\"; got "
                                   f"{body['intensity']!r}", code="invalid_parameter") from exc

    def dial_it(data: dict[str, Any]) -> None:
        name = data.get("active")
        doc = data["circuits"].get(name) if name else None
        if doc is None:
            raise sdk.LocalmError(409, "No circuit is active: activate one (POST /api/circuits/{name}/activate)",
                                  code="no_active_circuit")
        doc["intensity"] = c.resolve({**doc, "intensity": 1.0}, dial) if dial is not None else doc["intensity"]

    c.file.update(dial_it)
    return c.active_view()


@sdk.get("/api/circuits/{name:str}", summary="One circuit")
async def get_circuit(request: sdk.Request, name: str) -> dict[str, Any]:
    return current(request).circuit(name)


@sdk.delete("/api/circuits/{name:str}", summary="Delete a circuit (deactivate it first)")
async def delete_circuit(request: sdk.Request, name: str) -> dict[str, Any]:
    c = current(request)

    def remove(data: dict[str, Any]) -> None:
        if name not in data["circuits"]:
            raise sdk.LocalmError(404, f"No circuit named {name!r}", code="circuit_not_found")
        if data.get("active") == name:
            raise sdk.LocalmError(409, f"Circuit {name!r} is active: deactivate it first "
                                       "(POST /api/circuits/deactivate)", code="circuit_active")
        del data["circuits"][name]

    c.file.update(remove)
    return {"deleted": name}


@sdk.post("/api/circuits/{name:str}/activate", summary="Steer every chat completion by this circuit")
async def activate_circuit(request: sdk.Request, name: str) -> dict[str, Any]:
    c = current(request)
    doc = c.circuit(name)
    if doc["mode"] == "slice_fallback":
        c.steering().profile(doc["fallback_profile"])  # 404 when the backing cluster profile is missing

    def activate(data: dict[str, Any]) -> None:
        if name not in data["circuits"]:
            raise sdk.LocalmError(404, f"No circuit named {name!r}", code="circuit_not_found")
        data["active"] = name

    c.file.update(activate)
    return c.active_view()


HANDLERS = [list_circuits, import_circuit, active_circuit, deactivate_circuit, set_intensity, get_circuit,
            delete_circuit, activate_circuit]
