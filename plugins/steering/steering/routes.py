"""The management routes: /api/saes, /api/steering, /api/profiles (scope ``steering``)."""

from __future__ import annotations

import math
import re
import secrets
import time
from pathlib import Path
from typing import Any

from localm import sdk

from . import Steering
from . import store
from .store import read_index, read_strength

NAME_MAX = 100
SAE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def steering(request: sdk.Request) -> Steering:
    """The plugin's running state (its create_service object)."""
    return sdk.service_of(request)


async def _body(request: sdk.Request) -> dict[str, Any]:
    return await sdk.json_body(request, empty={})


# --- SAEs ---------------------------------------------------------------------------------

@sdk.get("/api/saes", summary="List registered SAEs")
async def list_saes(request: sdk.Request) -> dict[str, Any]:
    s = steering(request)
    s.saes.check()
    return {"saes": [s.sae_view(sae) for sae in s.saes.data["saes"].values()]}


@sdk.post("/api/saes", status_code=201, summary="Register an SAE from a SAELens folder or a Gemma Scope params.npz")
async def register_sae(request: sdk.Request) -> dict[str, Any]:
    s = steering(request)
    body = await _body(request)
    s.saes.check()
    info = store.inspect_sae(body.get("path"), body.get("layer"))
    sae_id = body.get("id")
    if sae_id is None:
        sae_id = "sae_" + secrets.token_hex(4)
    elif not isinstance(sae_id, str) or not SAE_ID.match(sae_id):
        raise sdk.LocalmError(400, "id must be 1–64 letters, digits, '.', '_' or '-'", code="invalid_parameter")
    if sae_id in s.saes.data["saes"]:
        raise sdk.LocalmError(409, f"An SAE {sae_id!r} is already registered", code="sae_exists")
    name = body.get("name")
    if name is not None and not isinstance(name, str):
        raise sdk.LocalmError(400, "name must be a string", code="invalid_parameter")
    sae = {"id": sae_id, "name": name or _folder_name(info["path"]), **info, "created": time.time()}
    s.saes.data["saes"][sae_id] = sae
    s.saes.save()
    return s.sae_view(sae)


def _folder_name(path: str) -> str:
    p = Path(path)
    return p.parent.name if p.name == "params.npz" else p.name


@sdk.get("/api/saes/{sae_id:str}", summary="One registered SAE")
async def get_sae(request: sdk.Request, sae_id: str) -> dict[str, Any]:
    s = steering(request)
    return s.sae_view(s.sae(sae_id))


@sdk.delete("/api/saes/{sae_id:str}", summary="Unregister an SAE (detach it first)")
async def delete_sae(request: sdk.Request, sae_id: str) -> dict[str, Any]:
    s = steering(request)
    sae = s.sae(sae_id)
    s.state.check()
    if s.attached().get(sae["layer"]) == sae_id:
        raise sdk.LocalmError(409, f"SAE {sae_id} is attached at layer {sae['layer']}: detach it first",
                              code="sae_attached")
    del s.saes.data["saes"][sae_id]
    s.saes.save()
    if any(f["sae_id"] == sae_id for f in s.state.data["features"]):
        s.state.data["features"] = [f for f in s.state.data["features"] if f["sae_id"] != sae_id]
        s.state.save()
    s._decoders.pop(sae_id, None)
    s._encoders.pop(sae_id, None)
    return {"deleted": sae_id}


@sdk.post("/api/saes/{sae_id:str}/attach", summary="Attach an SAE at its layer")
async def attach_sae(request: sdk.Request, sae_id: str) -> dict[str, Any]:
    s = steering(request)
    body = await _body(request)
    sae = s.sae(sae_id)
    s.state.check()
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise sdk.LocalmError(400, "model must be a string", code="invalid_parameter")
    try:
        entry = s.host.models.resolve(model)
    except sdk.LocalmError:
        if model is not None:
            raise
        entry = None
    if entry is not None:
        s.check_fits(sae, entry.id)
    taken = s.attached().get(sae["layer"])
    if taken is not None and taken != sae_id:
        raise sdk.LocalmError(409, f"SAE {taken} is attached at layer {sae['layer']}: detach it first "
                                   "(one SAE per layer)", code="sae_layer_taken")
    s.decoder(sae)  # read the weights now, so a broken file is refused at attach
    s.state.data["attached"][str(sae["layer"])] = sae_id
    s.state.save()
    return s.state_view()


@sdk.post("/api/saes/{sae_id:str}/detach", summary="Detach an SAE")
async def detach_sae(request: sdk.Request, sae_id: str) -> dict[str, Any]:
    s = steering(request)
    sae = s.sae(sae_id)
    s.state.check()
    if s.attached().get(sae["layer"]) != sae_id:
        raise sdk.LocalmError(409, f"SAE {sae_id} is not attached", code="sae_not_attached")
    del s.state.data["attached"][str(sae["layer"])]
    s.state.save()
    return s.state_view()


# --- the live steering state -----------------------------------------------------------------

@sdk.get("/api/steering", summary="The steering state")
async def get_steering(request: sdk.Request) -> dict[str, Any]:
    return steering(request).state_view()


def _set_enabled(s: Steering, on: bool) -> dict[str, Any]:
    s.state.check()
    s.state.data["enabled"] = on
    s.state.save()
    return s.state_view()


@sdk.post("/api/steering/enable", summary="Turn steering on")
async def enable_steering(request: sdk.Request) -> dict[str, Any]:
    return _set_enabled(steering(request), True)


@sdk.post("/api/steering/disable", summary="Turn steering off (per-request profiles still steer)")
async def disable_steering(request: sdk.Request) -> dict[str, Any]:
    return _set_enabled(steering(request), False)


@sdk.post("/api/steering/lock", summary="Lock a model: GET /v1/models then lists only it")
async def lock_model(request: sdk.Request) -> dict[str, Any]:
    body = await _body(request)
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise sdk.LocalmError(400, "model must name a registered model", code="invalid_parameter")
    s = steering(request)
    s.state.check()
    models = sdk.host_of(request).models
    locked = models.resolve(name).id  # 404 for an unknown model, before anything is stored
    s.state.data["locked_model"] = locked
    s.state.save()
    models.lock(locked)
    return s.state_view()


@sdk.delete("/api/steering/lock", summary="Unlock: GET /v1/models lists every model again")
async def unlock_model(request: sdk.Request) -> dict[str, Any]:
    s = steering(request)
    s.state.check()
    s.state.data["locked_model"] = None
    s.state.save()
    sdk.host_of(request).models.lock(None)
    return s.state_view()


@sdk.post("/api/steering/features", summary="Set one feature's strength")
async def set_feature(request: sdk.Request) -> dict[str, Any]:
    s = steering(request)
    body = await _body(request)
    s.state.check()
    sae = s.pick_sae(body.get("sae_id"))
    item = {k: body.get(k) for k in ("index", "strength", "label")}
    s.set_features(sae, [item], replace=False)
    return s.state_view()


@sdk.post("/api/steering/features/batch", summary="Set several features' strengths at once")
async def set_features(request: sdk.Request) -> dict[str, Any]:
    s = steering(request)
    body = await _body(request)
    s.state.check()
    sae = s.pick_sae(body.get("sae_id"))
    items = body.get("features")
    if not isinstance(items, list):
        raise sdk.LocalmError(400, "features must be a list of {index, strength, label?}", code="invalid_parameter")
    replace = body.get("replace", False)
    if not isinstance(replace, bool):
        raise sdk.LocalmError(400, "replace must be true or false", code="invalid_parameter")
    s.set_features(sae, items, replace=replace)
    return s.state_view()


@sdk.delete("/api/steering/features/{index:int}", summary="Remove one feature")
async def delete_feature(request: sdk.Request, index: int, sae_id: str | None = None) -> dict[str, Any]:
    s = steering(request)
    s.state.check()
    sae = s.pick_sae(sae_id)
    before = s.state.data["features"]
    after = [f for f in before if not (f["sae_id"] == sae["id"] and f["index"] == index)]
    if len(after) == len(before):
        raise sdk.LocalmError(404, f"Feature {index} of SAE {sae['id']} is not set", code="feature_not_set")
    s.state.data["features"] = after
    s.state.save()
    return s.state_view()


@sdk.post("/api/steering/clear", summary="Remove every feature (of one SAE with sae_id)")
async def clear_features(request: sdk.Request) -> dict[str, Any]:
    s = steering(request)
    body = await _body(request)
    s.state.check()
    sae_id = body.get("sae_id")
    if sae_id is not None:
        s.sae(sae_id)
    s.state.data["features"] = [f for f in s.state.data["features"] if sae_id is not None and f["sae_id"] != sae_id]
    s.state.save()
    return s.state_view()


# --- profiles ------------------------------------------------------------------------------

def _name(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > NAME_MAX or "/" in value \
            or any(ord(c) < 0x20 for c in value):
        raise sdk.LocalmError(400, f"name must be 1–{NAME_MAX} printable characters, without '/'",
                              code="invalid_parameter")
    return value.strip()


def _range(value: Any) -> list[float] | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = [value.get("min"), value.get("max")]
    if not (isinstance(value, list) and len(value) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
            and 0 <= value[0] <= value[1]):
        raise sdk.LocalmError(400, "intensity_range must be [lo, hi] with 0 ≤ lo ≤ hi", code="invalid_parameter")
    return [float(value[0]), float(value[1])]


def _features(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise sdk.LocalmError(400, "features must be a list of {index, strength, label?}", code="invalid_parameter")
    out: dict[int, dict[str, Any]] = {}
    for n, item in enumerate(value):
        if not isinstance(item, dict):
            raise sdk.LocalmError(400, f"features[{n}] must be an object", code="invalid_parameter")
        entry = {"index": read_index(item.get("index"), f"features[{n}].index"),
                 "strength": read_strength(item.get("strength"), f"features[{n}].strength")}
        label = item.get("label")
        if label is not None:
            if not isinstance(label, str):
                raise sdk.LocalmError(400, f"features[{n}].label must be a string", code="invalid_parameter")
            entry["label"] = label
        out[entry["index"]] = entry
    return [out[i] for i in sorted(out)]


def _sae_ref(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise sdk.LocalmError(400, "sae must be {id, layer, d_sae}", code="invalid_parameter")
    ref = {"id": value.get("id"), "layer": value.get("layer"), "d_sae": value.get("d_sae")}
    if ref["id"] is not None and not isinstance(ref["id"], str):
        raise sdk.LocalmError(400, "sae.id must be a string", code="invalid_parameter")
    for key in ("layer", "d_sae"):
        v = ref[key]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise sdk.LocalmError(400, f"sae.{key} must be a non-negative integer", code="invalid_parameter")
    return ref


def _intensity(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= 2:
        raise sdk.LocalmError(400, "intensity must be a number from 0 to 2", code="invalid_parameter")
    return float(value)


def _profile_from(s: Steering, body: dict[str, Any], *, name: str) -> dict[str, Any]:
    """A profile from a document: the create body or an exported profile."""
    sae = _sae_ref(body.get("sae"))
    if sae is None and any(body.get(k) is not None for k in ("sae_id", "layer", "d_sae")):
        sae = _sae_ref({"id": body.get("sae_id"), "layer": body.get("layer"), "d_sae": body.get("d_sae")})
    if body.get("features") is not None:
        features = _features(body["features"])
        if sae is not None and sae["id"] in s.saes.data["saes"]:
            known = s.saes.data["saes"][sae["id"]]
            sae = {"id": sae["id"], "layer": sae["layer"] if sae["layer"] is not None else known["layer"],
                   "d_sae": sae["d_sae"] if sae["d_sae"] is not None else known["d_sae"]}
    else:  # save the live values of one SAE
        s.state.check()
        wanted = sae["id"] if sae else None
        ids = sorted({f["sae_id"] for f in s.state.data["features"]})
        if wanted is None:
            if len(ids) != 1:
                raise sdk.LocalmError(400, "Give features, or sae_id to save the live values of one SAE "
                                           f"(features are set on {len(ids)} SAEs)", code="invalid_parameter")
            wanted = ids[0]
        known = s.sae(wanted)
        features = [{k: v for k, v in f.items() if k != "sae_id"} for f in s.state.data["features"]
                    if f["sae_id"] == wanted]
        sae = {"id": wanted, "layer": known["layer"], "d_sae": known["d_sae"]}
    if sae is not None and sae.get("d_sae") is not None:
        for f in features:
            if f["index"] >= sae["d_sae"]:
                raise sdk.LocalmError(400, f"Feature {f['index']} is past the SAE's width ({sae['d_sae']})",
                                      code="invalid_feature_index")
    description = body.get("description") or ""
    if not isinstance(description, str):
        raise sdk.LocalmError(400, "description must be a string", code="invalid_parameter")
    declared = _range(body.get("intensity_range"))
    cluster = body.get("cluster", declared is not None)
    if not isinstance(cluster, bool):
        raise sdk.LocalmError(400, "cluster must be true or false", code="invalid_parameter")
    now = time.time()
    profile = {"name": name, "description": description, "sae": sae, "features": features,
               "intensity_range": declared, "cluster": cluster or declared is not None,
               "intensity": _intensity(body.get("intensity", 1.0)), "created": now, "updated": now}
    return profile


def _save_profile(s: Steering, profile: dict[str, Any], *, replace: bool) -> dict[str, Any]:
    s.profiles.check()
    existing = s.profiles.data["profiles"].get(profile["name"])
    if existing is not None and not replace:
        raise sdk.LocalmError(409, f"A profile named {profile['name']!r} exists", code="profile_exists")
    if existing is not None:
        profile["created"] = existing.get("created", profile["created"])
    s.profiles.data["profiles"][profile["name"]] = profile
    s.profiles.save()
    return profile


def export_doc(profile: dict[str, Any]) -> dict[str, Any]:
    doc = {"format": "millm.profile", "version": 1, "name": profile["name"], "description": profile["description"],
           "sae": profile["sae"], "features": profile["features"]}
    if profile.get("intensity_range") is not None:
        doc["intensity_range"] = profile["intensity_range"]
    if profile.get("cluster"):
        doc["cluster"] = True
    if profile.get("intensity", 1.0) != 1.0:
        doc["intensity"] = profile["intensity"]
    return doc


@sdk.get("/api/profiles", summary="List steering profiles")
async def list_profiles(request: sdk.Request) -> dict[str, Any]:
    s = steering(request)
    s.profiles.check()
    s.state.check()
    return {"profiles": list(s.profiles.data["profiles"].values()), "active": s.state.data["active_profile"]}


@sdk.post("/api/profiles", status_code=201, summary="Save a profile (from features, or the live values)")
async def create_profile(request: sdk.Request) -> dict[str, Any]:
    body = await _body(request)
    profile = _profile_from(steering(request), body, name=_name(body.get("name")))
    return _save_profile(steering(request), profile, replace=False)


@sdk.post("/api/profiles/import", status_code=201, summary="Import an exported profile document")
async def import_profile(request: sdk.Request, overwrite: bool = False) -> dict[str, Any]:
    body = await _body(request)
    if isinstance(body.get("profile"), dict):
        body = body["profile"]
    profile = _profile_from(steering(request), {**body, "features": body.get("features", [])}, name=_name(body.get("name")))
    return _save_profile(steering(request), profile, replace=overwrite)


@sdk.post("/api/profiles/deactivate", summary="Steer by the live feature values again")
async def deactivate_profile(request: sdk.Request) -> dict[str, Any]:
    s = steering(request)
    s.state.check()
    s.state.data["active_profile"] = None
    s.state.save()
    return s.state_view()


@sdk.get("/api/profiles/{name:str}", summary="One profile")
async def get_profile(request: sdk.Request, name: str) -> dict[str, Any]:
    return steering(request).profile(name)


@sdk.get("/api/profiles/{name:str}/export", summary="A profile as a portable JSON document")
async def export_profile(request: sdk.Request, name: str) -> dict[str, Any]:
    return export_doc(steering(request).profile(name))


@sdk.patch("/api/profiles/{name:str}", summary="Change a profile")
async def update_profile(request: sdk.Request, name: str) -> dict[str, Any]:
    s = steering(request)
    profile = dict(s.profile(name))
    body = await _body(request)
    unknown = set(body) - {"description", "features", "intensity_range", "intensity", "cluster", "sae"}
    if unknown:
        raise sdk.LocalmError(400, f"Unknown fields: {', '.join(sorted(unknown))}", code="invalid_parameter")
    if "description" in body:
        if not isinstance(body["description"], str):
            raise sdk.LocalmError(400, "description must be a string", code="invalid_parameter")
        profile["description"] = body["description"]
    if "sae" in body:
        profile["sae"] = _sae_ref(body["sae"])
    if "features" in body:
        profile["features"] = _features(body["features"])
    if "intensity_range" in body:
        profile["intensity_range"] = _range(body["intensity_range"])
        if profile["intensity_range"] is not None:
            profile["cluster"] = True
    if "cluster" in body:
        if not isinstance(body["cluster"], bool):
            raise sdk.LocalmError(400, "cluster must be true or false", code="invalid_parameter")
        profile["cluster"] = body["cluster"] or profile.get("intensity_range") is not None
    if "intensity" in body:
        value = _intensity(body["intensity"])
        _, cap = s.dial_bounds(profile)
        if value > cap:
            raise sdk.LocalmError(400, f"intensity {value} is above this profile's maximum ({cap})",
                                  code="invalid_parameter")
        profile["intensity"] = value
    ref = profile.get("sae") or {}
    if ref.get("d_sae") is not None and any(f["index"] >= ref["d_sae"] for f in profile["features"]):
        raise sdk.LocalmError(400, f"A feature is past the SAE's width ({ref['d_sae']})", code="invalid_feature_index")
    profile["updated"] = time.time()
    return _save_profile(steering(request), profile, replace=True)


@sdk.delete("/api/profiles/{name:str}", summary="Delete a profile")
async def delete_profile(request: sdk.Request, name: str) -> dict[str, Any]:
    s = steering(request)
    s.profile(name)
    s.state.check()
    del s.profiles.data["profiles"][name]
    s.profiles.save()
    if s.state.data["active_profile"] == name:
        s.state.data["active_profile"] = None
        s.state.save()
    return {"deleted": name}


@sdk.post("/api/profiles/{name:str}/activate", summary="Steer every request by this profile")
async def activate_profile(request: sdk.Request, name: str) -> dict[str, Any]:
    s = steering(request)
    profile = s.profile(name)
    s.state.check()
    s.profile_target(profile)  # refuse a profile that does not fit the attached SAEs
    s.state.data["active_profile"] = name
    s.state.data["enabled"] = True
    s.state.save()
    return s.state_view()


HANDLERS = [list_saes, register_sae, get_sae, delete_sae, attach_sae, detach_sae,
            get_steering, enable_steering, disable_steering, lock_model, unlock_model, set_feature, set_features, delete_feature,
            clear_features, list_profiles, create_profile, import_profile, deactivate_profile, get_profile,
            export_profile, update_profile, delete_profile, activate_profile]
