"""Circuits: a multi-layer intervention (features on several layers' SAEs, each with an
authored strength) steered by one intensity dial λ, and the ``X-miLLM-Circuit-Rung`` header.

One λ scales every member through its own layer's SAE: the delta at a layer is
Σ clamp(λ·strength, ±200)·W_dec[feature] over that layer's members, re-derived from the
authored strengths on every request (absolute, never compounding). λ is clamped at both ends
into the declared intensity_range ∩ [0, intensity_max] (without a range, into
[circuit_intensity_min, intensity_max]); only an exact 0/"off" turns a circuit off. A circuit
in ``slice_fallback`` mode is served by its backing cluster profile with the cluster rule.

SAEs come from the steering plugin, through its service ``host.service("steering")``.
Routes: /api/circuits (scope ``steering``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from localm import sdk
from localm.sdk.storage import JsonFile

LIMIT = 200.0  # miLLM's steering range, per member at apply time
RUNG_HEADER = "X-miLLM-Circuit-Rung"
LADDER = {0: "associated", 1: "suggested (attribution-supported)", 2: "causally validated (edge)",
          3: "faithfulness-tested (circuit)"}
MODES = ("circuit", "slice_fallback")
CIRCUIT_FIELDS = ("circuit",)


@attrs.frozen
class Settings:
    circuit_intensity_min: float = sdk.setting(
        0.0, min=0.0, max=2.0, description="The intensity \"min\" resolves to, and the dial's floor, for a circuit "
                                           "that declares no intensity_range (CIRCUIT_INTENSITY_MIN)")


def rung_value(rung: int) -> str:
    """The header's RFC 8941 Item: a bare integer with a quoted-string ``language`` parameter."""
    return f'{int(rung)}; language="{LADDER[int(rung)]}"'


def clamp(value: float) -> float:
    return max(-LIMIT, min(LIMIT, float(value)))


def read_dial(c: "Circuits", value: Any) -> float | str | None:
    """steering_intensity (or the persistent dial): None, a number in 0–2 (0 is off), "off",
    "min" or "max", read by the steering plugin's own rules."""
    return c.steering().read_dial(value)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise sdk.LocalmError(400, f"{what} must be a finite number", code="invalid_parameter")
    return float(value)


def _index(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise sdk.LocalmError(400, f"{what} must be a non-negative integer", code="invalid_parameter")
    return value


def check_document(body: Any) -> dict[str, Any]:
    """A circuit document, validated and normalised (400 on anything malformed)."""
    if not isinstance(body, dict):
        raise sdk.LocalmError(400, "A circuit document must be a JSON object", code="invalid_parameter")
    name = body.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > 100 or "/" in name:
        raise sdk.LocalmError(400, "name must be a non-empty string of at most 100 characters, without '/'",
                              code="invalid_parameter")
    description = body.get("description")
    if description is not None and not isinstance(description, str):
        raise sdk.LocalmError(400, "description must be a string", code="invalid_parameter")
    rung = body.get("rung")
    if isinstance(rung, bool) or not isinstance(rung, int) or rung not in LADDER:
        raise sdk.LocalmError(400, "rung must be an integer from 0 to 3 (0 associated, 1 suggested, 2 causally "
                                   "validated (edge), 3 faithfulness-tested (circuit))", code="invalid_parameter")
    declared = body.get("intensity_range")
    if declared is not None:
        if not isinstance(declared, list) or len(declared) != 2:
            raise sdk.LocalmError(400, "intensity_range must be [low, high]", code="invalid_parameter")
        lo, hi = (_number(v, "intensity_range") for v in declared)
        if not 0.0 <= lo <= hi:
            raise sdk.LocalmError(400, "intensity_range must satisfy 0 ≤ low ≤ high", code="invalid_parameter")
        declared = [lo, hi]
    intensity = _number(body.get("intensity", 1.0), "intensity")
    if not 0.0 <= intensity <= 2.0:
        raise sdk.LocalmError(400, "intensity must be from 0 to 2", code="invalid_parameter")
    mode = body.get("mode", "circuit")
    if mode not in MODES:
        raise sdk.LocalmError(400, f"mode must be one of {', '.join(MODES)}", code="invalid_parameter")
    fallback = body.get("fallback_profile")
    if fallback is not None and not isinstance(fallback, str):
        raise sdk.LocalmError(400, "fallback_profile must be a profile's name", code="invalid_parameter")
    if mode == "slice_fallback" and not fallback:
        raise sdk.LocalmError(400, "a slice_fallback circuit names its backing cluster profile (fallback_profile)",
                              code="invalid_parameter")
    members = body.get("members")
    if not isinstance(members, list) or not members:
        raise sdk.LocalmError(400, "members must be a non-empty list", code="invalid_parameter")
    checked = []
    for n, m in enumerate(members):
        if not isinstance(m, dict):
            raise sdk.LocalmError(400, f"members[{n}] must be an object", code="invalid_parameter")
        entry = {"layer": _index(m.get("layer"), f"members[{n}].layer"),
                 "feature": _index(m.get("feature"), f"members[{n}].feature"),
                 "strength": _number(m.get("strength"), f"members[{n}].strength")}
        if m.get("sae_id") is not None:
            if not isinstance(m["sae_id"], str):
                raise sdk.LocalmError(400, f"members[{n}].sae_id must be a string", code="invalid_parameter")
            entry["sae_id"] = m["sae_id"]
        if isinstance(m.get("label"), str):
            entry["label"] = m["label"]
        checked.append(entry)
    doc = {"name": name, "rung": rung, "intensity": intensity, "mode": mode, "members": checked}
    if description:
        doc["description"] = description
    if declared is not None:
        doc["intensity_range"] = declared
    if fallback:
        doc["fallback_profile"] = fallback
    return doc


class Circuits:
    """The stored circuits, the active one and its dial, and the steering of one request."""

    def __init__(self, host: Any, plugin: Any) -> None:
        self.host = host
        self.plugin = plugin
        self.file = JsonFile(Path(plugin.data_dir) / "circuits.json", what="circuits.json",
                             default=lambda: {"version": 1, "circuits": {}, "active": None}, expect=dict)

    def steering(self) -> Any:
        return self.host.service("steering")

    # --- stored documents -------------------------------------------------------------------
    def data(self) -> dict[str, Any]:
        return self.file.cached()

    def circuit(self, name: str) -> dict[str, Any]:
        found = self.data()["circuits"].get(name)
        if found is None:
            raise sdk.LocalmError(404, f"No circuit named {name!r}", code="circuit_not_found")
        return found

    # --- the dial -----------------------------------------------------------------------------
    def bounds(self, doc: dict[str, Any]) -> tuple[float, float]:
        """(floor, cap): the declared range ∩ [0, intensity_max], else [circuit_intensity_min, intensity_max]."""
        top = float(self.steering().envelope())
        declared = doc.get("intensity_range")
        if declared:
            hi = min(float(declared[1]), top)
            return min(max(float(declared[0]), 0.0), hi), hi
        return min(float(self.plugin.settings.get("circuit_intensity_min", 0.0)), top), top

    def resolve(self, doc: dict[str, Any], dial: float | str | None) -> float:
        """λ for a circuit: both ends clamped; an exact 0 ("off") is honoured below the floor."""
        lo, hi = self.bounds(doc)
        if dial == 0.0:
            return 0.0
        if dial == "min":
            return lo
        if dial == "max":
            return hi
        lam = float(doc.get("intensity", 1.0)) if dial is None else float(dial)
        if lam == 0.0 and dial is None:
            return 0.0  # a persistent dial set to off
        return min(max(lam, lo), hi)

    # --- what a circuit adds ----------------------------------------------------------------
    def member_saes(self, doc: dict[str, Any]) -> dict[int, dict[str, Any]] | None:
        """layer → the attached SAE each member layer steers through; None when a member layer
        has no SAE attached (or not the one a member names)."""
        s = self.steering()
        attached = s.attached()
        out = {}
        for m in doc["members"]:
            sae_id = attached.get(m["layer"])
            if sae_id is None or (m.get("sae_id") is not None and m["sae_id"] != sae_id):
                return None
            out[m["layer"]] = s.sae(sae_id)
        return out

    def deltas(self, doc: dict[str, Any], lam: float, model_id: str | None) -> list[tuple[int, np.ndarray]] | None:
        saes = self.member_saes(doc)
        if saes is None:
            return None
        s = self.steering()
        sums: dict[int, np.ndarray] = {}
        for m in doc["members"]:
            sae = saes[m["layer"]]
            if m["feature"] >= sae["d_sae"]:
                raise sdk.LocalmError(400, f"Circuit {doc['name']!r} steers feature {m['feature']} at layer "
                                           f"{m['layer']}, past the width of SAE {sae['id']} ({sae['d_sae']})",
                                      code="invalid_feature_index")
            if model_id is not None:
                s.check_fits(sae, model_id)
            row = s.decoder(sae)[m["feature"]].astype(np.float64)
            sums.setdefault(m["layer"], np.zeros(sae["d_in"], dtype=np.float64))
            sums[m["layer"]] += clamp(lam * m["strength"]) * row
        return [(layer, delta.astype(np.float32)) for layer, delta in sorted(sums.items())]

    def fallback(self, doc: dict[str, Any], dial: float | str | None, model_id: str,
                 register: Any) -> None:
        """slice_fallback: the backing cluster profile steers, with the cluster rule (its floor
        is the steering plugin's cluster_intensity_min, 0.5 by default); no rung header."""
        s = self.steering()
        try:
            profile = s.profile(doc["fallback_profile"])
        except sdk.LocalmError:
            return  # the backing profile is gone: nothing to serve
        if dial == 0.0:
            return
        lo, hi = s.dial_bounds(profile)
        if dial == "min":
            lam = lo
        elif dial == "max":
            lam = hi
        else:
            lam = min(float(doc.get("intensity", 1.0)) if dial is None else dial, hi)
        if lam <= 0.0:
            return
        sae = s.profile_target(profile)
        if sae is None:
            return
        s.check_fits(sae, model_id)
        weights = s.decoder(sae)
        delta = np.zeros(sae["d_in"], dtype=np.float64)
        for f in profile["features"]:
            delta += clamp(lam * f["strength"]) * weights[f["index"]].astype(np.float64)
        register(sae["layer"], delta.astype(np.float32))

    def active_view(self) -> dict[str, Any]:
        """GET /api/circuits/active: the active circuit, its dial and whether it steers now."""
        data = self.data()
        name = data.get("active")
        doc = data["circuits"].get(name) if name else None
        if doc is None:
            return {"active": None, "steering": {"steering": False, "rung": None, "language": None}}
        try:
            doc = {**check_document(doc), **{k: doc[k] for k in ("created",) if k in doc}}
        except sdk.LocalmError as exc:
            return {"active": name, "circuit": doc, "error": str(exc),
                    "steering": {"steering": False, "rung": None, "language": None}}
        lo, hi = self.bounds(doc)
        lam = self.resolve(doc, None)
        steering = False
        layers: list[int] = []
        if doc["mode"] == "circuit" and lam > 0.0:
            try:
                saes = self.member_saes(doc)
            except sdk.LocalmError:
                saes = None
            steering = bool(saes)
            layers = sorted(saes) if saes else []
        return {"active": doc["name"], "circuit": doc, "intensity": lam, "bounds": [lo, hi],
                "steering": {"steering": steering, "rung": doc["rung"] if steering else None,
                             "language": LADDER[doc["rung"]] if steering else None,
                             "header": rung_value(doc["rung"]) if steering else None, "layers": layers,
                             "mode": doc["mode"]}}

    # --- one request ------------------------------------------------------------------------
    def interventions(self, request: dict[str, Any], model: Any, register: Any) -> None:
        named = request.get("circuit")
        for key in CIRCUIT_FIELDS:
            if key in request:
                register.use(key)
        if "steering_intensity" in request:
            register.use("steering_intensity")
        if named is not None and "messages" not in request:
            raise sdk.LocalmError(400, "circuit cannot be honoured on /v1/completions: per-request steering is "
                                       "served on chat completions", code="field_not_honoured", field="circuit")
        if named is not None:
            if not isinstance(named, str):
                raise sdk.LocalmError(400, "circuit must be a string (a circuit's name)", code="invalid_parameter")
            doc = self.circuit(named)
            try:
                doc = check_document(doc)
            except sdk.LocalmError as exc:
                raise sdk.LocalmError(409, f"Circuit {named!r} is stored in a form that cannot be read: {exc}",
                                      code="circuit_unreadable") from exc
        else:
            try:
                data = self.data()
            except sdk.LocalmError:
                return  # an unreadable circuits file: no circuit steers (GET /api/circuits reports it)
            name = data.get("active")
            doc = data["circuits"].get(name) if name else None
            if doc is None:
                return
            try:
                doc = check_document(doc)  # a hand-edited, unparseable definition does not steer
            except sdk.LocalmError:
                return
        if "messages" not in request:
            return  # text completions and scoring are not steered by an active circuit
        dial = read_dial(self, request.get("steering_intensity"))
        if doc["mode"] == "slice_fallback":
            self.fallback(doc, dial, model.id, register)
            return
        lam = self.resolve(doc, dial)
        if lam <= 0.0:
            return
        deltas = self.deltas(doc, lam, model.id)
        if not deltas:
            return  # no SAE attached on a member layer: unsteered, no header
        for layer, delta in deltas:
            register(layer, delta)
        register.header(RUNG_HEADER, rung_value(doc["rung"]))
        if dial is not None and not any(name in register.headers for name in INTENSITY_HEADERS):
            # the dial changed this circuit's steering: echo the λ it resolved to (unless the
            # steering plugin, whose base the request also dialled, already did)
            for name in INTENSITY_HEADERS:
                register.header(name, repr(round(float(lam), 6)))


#: The dial's echo, as the steering plugin writes it.
INTENSITY_HEADERS = ("X-miLLM-Steering-Intensity", "X-Localm-Steering-Intensity")


# --- the plugin ---------------------------------------------------------------------------

@sdk.hookimpl
def create_service(host: Any, plugin: Any) -> Circuits:
    """The plugin's state while it runs: routes reach it with ``sdk.service_of(request)``."""
    return Circuits(host, plugin)


@sdk.hookimpl
def register_settings(register: Any) -> None:
    register(Settings)


@sdk.hookimpl
def forward_interventions(request: Any, model: Any, register: Any, plugin: Any) -> None:
    if isinstance(request, dict):
        plugin.service.interventions(request, model, register)


@sdk.hookimpl
def register_routes(register: Any) -> None:
    from . import routes
    register(*routes.HANDLERS)
