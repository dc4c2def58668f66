"""SAE steering (issue 6): SAEs registered from SAELens folders or Gemma Scope params.npz,
attached one per layer; per-feature strengths (clamped to ±200) whose sum
Σ strength·W_dec[i] is added at the SAE's layer; saved profiles (clusters when they declare
an intensity range); per-request ``profile`` and ``steering_intensity`` on chat completions;
``return_sae_activations`` on chat and text completions (the residual at an attached SAE's
layer, read before or after its steering and encoded with the SAE, answered under ``millm``).

Steering is computed for each request from the stored state through the
``forward_interventions`` hook: nothing on the model changes, so a per-request profile leaves
the state as it was, and an operator's change made while a request runs is what the next
request sees. Routes: /api/saes, /api/steering, /api/profiles (scope ``steering``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from localm import sdk

from . import store
from .store import JsonFile, clamp, read_index, read_strength

STEERING_FIELDS = ("profile", "steering_intensity")
ACTIVATIONS_FIELD = "return_sae_activations"
SAE_ACTIVATIONS_MAX_TOP_K = 64
SAE_ACTIVATIONS_MAX_ENTRIES = 65_536
DEFAULT_TOP_K = 8
ENCODE_ROWS = 256  # positions encoded at once
TEMPLATE_ALLOWANCE = 512  # tokens a chat template may add around the messages, for the worst case
POSITION_WORDS = ("last", "prompt", "completion", "all")
READ_POINTS = {"pre_steering": "pre", "post_steering": "post"}
NOTES = {
    "post_steering": "post_steering is what the model computed at this layer for this request, after this layer's "
                     "steering delta; it is not an unsteered counterfactual: steering at earlier layers and tokens "
                     "generated under steering shaped it too.",
    "pre_steering": "pre_steering is the residual before this layer's own steering delta; it is not an unsteered "
                    "counterfactual: steering at earlier layers and tokens generated under steering shaped it too.",
}
INTENSITY_HEADERS = ("X-miLLM-Steering-Intensity", "X-Localm-Steering-Intensity")


@attrs.frozen
class Settings:
    cluster_intensity_min: float = sdk.setting(
        0.5, min=0.0, max=2.0, description="The intensity \"min\" resolves to for a profile that declares no "
                                           "intensity_range (CLUSTER_INTENSITY_MIN)")
    intensity_max: float = sdk.setting(
        2.0, min=0.0, max=2.0, description="The highest steering intensity: the dial's cap for a profile that "
                                           "declares no intensity_range, and the envelope of declared ranges")


class Steering:
    """Everything the plugin keeps, and the steering of one request."""

    def __init__(self, host: Any, plugin: Any) -> None:
        self.host = host
        self.plugin = plugin
        folder = Path(plugin.data_dir)
        self.saes = JsonFile(folder / "saes.json", {"version": 1, "saes": {}})
        self.state = JsonFile(folder / "steering.json", {"version": 1, "enabled": True, "attached": {},
                                                          "features": [], "active_profile": None,
                                                          "locked_model": None})
        self.profiles = JsonFile(folder / "profiles.json", {"version": 1, "profiles": {}})
        self._decoders: dict[str, np.ndarray] = {}
        self._encoders: dict[str, dict[str, Any]] = {}
        self._shapes: dict[tuple[str, str, float], tuple[int | None, int | None]] = {}

    # --- settings ------------------------------------------------------------------------
    def envelope(self) -> float:
        return float(self.plugin.settings.get("intensity_max", 2.0))

    def floor(self) -> float:
        return float(self.plugin.settings.get("cluster_intensity_min", 0.5))

    # --- SAEs ------------------------------------------------------------------------------
    def sae(self, sae_id: str) -> dict[str, Any]:
        self.saes.check()
        found = self.saes.data["saes"].get(sae_id)
        if found is None:
            raise sdk.LocalmError(404, f"No SAE {sae_id!r} is registered", code="sae_not_found")
        return found

    def attached(self) -> dict[int, str]:
        """layer → SAE id."""
        return {int(layer): sae_id for layer, sae_id in self.state.data["attached"].items()}

    def sae_view(self, sae: dict[str, Any]) -> dict[str, Any]:
        return {**sae, "attached": self.attached().get(sae["layer"]) == sae["id"]}

    def decoder(self, sae: dict[str, Any]) -> np.ndarray:
        found = self._decoders.get(sae["id"])
        if found is None:
            try:
                found = store.load_decoder(sae)
            except Exception as exc:
                raise sdk.LocalmError(409, f"SAE {sae['id']}'s weights cannot be read from {sae['path']}: {exc}",
                                      code="sae_unreadable") from exc
            if found.shape != (sae["d_sae"], sae["d_in"]):
                raise sdk.LocalmError(409, f"SAE {sae['id']}'s W_dec changed on disk: {found.shape}",
                                      code="sae_unreadable")
            self._decoders[sae["id"]] = found
        return found

    def encoder(self, sae: dict[str, Any]) -> dict[str, Any]:
        """W_enc, b_enc, b_dec and a JumpReLU threshold (see ``store.load_encoder``)."""
        found = self._encoders.get(sae["id"])
        if found is None:
            try:
                found = store.load_encoder(sae)
            except sdk.LocalmError:
                raise
            except Exception as exc:
                raise sdk.LocalmError(409, f"SAE {sae['id']}'s encoder cannot be read from {sae['path']}: {exc}",
                                      code="sae_unreadable") from exc
            if found["W_enc"].shape != (sae["d_in"], sae["d_sae"]):
                raise sdk.LocalmError(409, f"SAE {sae['id']}'s W_enc changed on disk: {found['W_enc'].shape}",
                                      code="sae_unreadable")
            self._encoders[sae["id"]] = found
        return found

    def model_shape(self, model_id: str) -> tuple[int | None, int | None]:
        """(hidden size, decoder layers) of a model: from the loaded engine, else its files."""
        models = self.host.models
        resident = models.resident.get(model_id)
        if resident is not None:
            caps = resident.engine.capabilities
            return caps.hidden_size, caps.layers
        try:
            entry = models.registry.get(model_id)
        except sdk.LocalmError:
            return None, None
        path = Path(entry.path)
        try:
            key = (model_id, str(path), path.stat().st_mtime)
        except OSError:
            return None, None
        if key not in self._shapes:
            self._shapes[key] = _file_shape(path, entry.type)
        return self._shapes[key]

    def check_fits(self, sae: dict[str, Any], model_id: str) -> None:
        hidden, layers = self.model_shape(model_id)
        if hidden is not None and hidden != sae["d_in"]:
            raise sdk.LocalmError(400, f"SAE {sae['id']} has d_in {sae['d_in']} but model {model_id} has hidden size "
                                       f"{hidden}: it does not fit", code="sae_incompatible",
                                  d_in=sae["d_in"], hidden_size=hidden)
        if layers is not None and sae["layer"] >= layers:
            raise sdk.LocalmError(400, f"SAE {sae['id']} is at layer {sae['layer']} but model {model_id} has "
                                       f"{layers} layers (0 to {layers - 1})", code="sae_incompatible",
                                  layer=sae["layer"], layers=layers)

    # --- the live state ---------------------------------------------------------------------
    def pick_sae(self, sae_id: Any) -> dict[str, Any]:
        """The SAE a feature change names, or the one attached SAE when it names none."""
        if sae_id is not None:
            if not isinstance(sae_id, str):
                raise sdk.LocalmError(400, "sae_id must be a string", code="invalid_parameter")
            return self.sae(sae_id)
        attached = self.attached()
        if not attached:
            raise sdk.LocalmError(409, "No SAE is attached: attach one (POST /api/saes/{id}/attach) or name sae_id",
                                  code="no_sae_attached")
        if len(attached) > 1:
            names = ", ".join(f"{sid} (layer {layer})" for layer, sid in sorted(attached.items()))
            raise sdk.LocalmError(400, f"Several SAEs are attached ({names}): name sae_id",
                                  code="invalid_parameter")
        return self.sae(next(iter(attached.values())))

    def start(self) -> None:
        """As the plugin starts: the stored model lock is applied again."""
        self.apply_lock()

    def stop(self) -> None:
        """As the plugin stops: the lock is the steering plugin's, and goes with it."""
        self.host.models.lock(None)

    def apply_lock(self) -> None:
        """Re-apply the stored model lock (a model since removed from the registry unlocks)."""
        try:
            self.state.check()
            name = self.state.data.get("locked_model")
            self.host.models.lock(name)
        except sdk.LocalmError:
            self.host.models.lock(None)

    @staticmethod
    def read_dial(value: Any) -> float | str | None:
        """steering_intensity read as this plugin reads it (for the circuits plugin's dial)."""
        return read_dial(value)

    def state_view(self) -> dict[str, Any]:
        self.state.check()
        data = self.state.data
        attached = [{"layer": layer, "sae_id": sid, "d_sae": self.saes.data["saes"].get(sid, {}).get("d_sae"),
                     "d_in": self.saes.data["saes"].get(sid, {}).get("d_in")}
                    for layer, sid in sorted(self.attached().items())]
        features = [{**f, "layer": self.saes.data["saes"].get(f["sae_id"], {}).get("layer")} for f in data["features"]]
        active = data["active_profile"]
        return {"enabled": data["enabled"], "active_profile": active, "attached": attached, "features": features,
                "locked_model": data.get("locked_model"),
                "base": "profile" if active else "features",
                "live": bool(data["enabled"] and attached and not active and any(
                    f["sae_id"] in self.attached().values() for f in data["features"]))}

    def set_features(self, sae: dict[str, Any], items: list[dict[str, Any]], *, replace: bool) -> None:
        """Validate every item, then apply them all (or none)."""
        checked = []
        for n, item in enumerate(items):
            if not isinstance(item, dict):
                raise sdk.LocalmError(400, f"features[{n}] must be an object", code="invalid_parameter")
            index = read_index(item.get("index"), f"features[{n}].index")
            if index >= sae["d_sae"]:
                raise sdk.LocalmError(400, f"Feature {index} is past SAE {sae['id']}'s width ({sae['d_sae']})",
                                      code="invalid_feature_index")
            strength = read_strength(item.get("strength"), f"features[{n}].strength")
            label = item.get("label")
            if label is not None and not isinstance(label, str):
                raise sdk.LocalmError(400, f"features[{n}].label must be a string", code="invalid_parameter")
            checked.append((index, strength, label))
        kept = [f for f in self.state.data["features"]
                if f["sae_id"] != sae["id"] or (not replace and f["index"] not in {i for i, _, _ in checked})]
        for index, strength, label in checked:
            entry = {"sae_id": sae["id"], "index": index, "strength": strength}
            if label:
                entry["label"] = label
            kept = [f for f in kept if not (f["sae_id"] == sae["id"] and f["index"] == index)]
            kept.append(entry)
        self.state.data["features"] = sorted(kept, key=lambda f: (f["sae_id"], f["index"]))
        self.state.save()

    # --- profiles --------------------------------------------------------------------------
    def profile(self, name: Any) -> dict[str, Any]:
        self.profiles.check()
        found = self.profiles.data["profiles"].get(name) if isinstance(name, str) else None
        if found is None:
            raise sdk.LocalmError(404, f"No profile named {name!r}", code="profile_not_found")
        return found

    def profile_target(self, profile: dict[str, Any]) -> dict[str, Any] | None:
        """The attached SAE a profile steers; None when no SAE is attached; 400 when the
        profile does not fit what is attached."""
        attached = self.attached()
        if not attached:
            return None
        ref = profile.get("sae") or {}
        sae = None
        if ref.get("id") in attached.values():
            sae = self.sae(ref["id"])
        elif ref.get("layer") is not None:
            if ref["layer"] not in attached:
                raise sdk.LocalmError(400, f"Profile {profile['name']!r} steers layer {ref['layer']}, where no SAE is "
                                           f"attached (attached: layers {sorted(attached)})",
                                      code="profile_incompatible")
            sae = self.sae(attached[ref["layer"]])
        elif len(attached) == 1:
            sae = self.sae(next(iter(attached.values())))
        else:
            raise sdk.LocalmError(400, f"Profile {profile['name']!r} names no SAE or layer and several SAEs are "
                                       "attached", code="profile_incompatible")
        if ref.get("d_sae") is not None and ref["d_sae"] != sae["d_sae"]:
            raise sdk.LocalmError(400, f"Profile {profile['name']!r} was made for an SAE of width {ref['d_sae']}; "
                                       f"the SAE attached at layer {sae['layer']} ({sae['id']}) has {sae['d_sae']}",
                                  code="profile_incompatible")
        for f in profile["features"]:
            if f["index"] >= sae["d_sae"]:
                raise sdk.LocalmError(400, f"Profile {profile['name']!r} steers feature {f['index']}, past the width "
                                           f"of SAE {sae['id']} ({sae['d_sae']})", code="invalid_feature_index")
        return sae

    def dial_bounds(self, profile: dict[str, Any] | None) -> tuple[float, float]:
        """(what "min" resolves to, the cap): a declared range ∩ [0, intensity_max], else
        [cluster_intensity_min, intensity_max]."""
        top = self.envelope()
        declared = profile.get("intensity_range") if profile else None
        if declared:
            hi = min(float(declared[1]), top)
            lo = min(max(float(declared[0]), 0.0), hi)
            return lo, hi
        return min(self.floor(), top), top

    # --- one request ------------------------------------------------------------------------
    def activations(self, request: dict[str, Any], model: Any, register: Any) -> None:
        """``return_sae_activations``: check it all before anything loads, then read the residual
        at the SAE's layer and answer the encoded features under ``millm``."""
        if ACTIVATIONS_FIELD not in request:
            return
        register.use(ACTIVATIONS_FIELD)
        ask = request[ACTIVATIONS_FIELD]
        if ask is None:
            return
        if not isinstance(ask, dict):
            raise bad("must be an object")
        unknown = sorted(set(ask) - {"sae_id", "features", "top_k", "positions", "read_point"})
        if unknown:
            raise bad(f"has unknown keys: {', '.join(unknown)}")
        n = request.get("n")
        if n is not None and n != 1:
            raise bad("needs n 1 (there is one position axis per request)")
        prompt = request.get("prompt")
        if isinstance(prompt, list) and len(prompt) != 1:
            raise bad("needs one prompt (there is one position axis per request)")
        self.state.check()
        self.saes.check()
        attached = self.attached()
        sae_id = ask.get("sae_id")
        if sae_id is not None:
            if not isinstance(sae_id, str):
                raise bad("sae_id must be a string")
            if sae_id not in attached.values():
                names = ", ".join(f"{sid} (layer {layer})" for layer, sid in sorted(attached.items())) or "none"
                raise sdk.LocalmError(400, f"{ACTIVATIONS_FIELD}: SAE {sae_id!r} is not attached (attached: {names})",
                                      code="no_sae_attached", param=ACTIVATIONS_FIELD)
        elif not attached:
            raise sdk.LocalmError(400, f"{ACTIVATIONS_FIELD}: no SAE is attached", code="no_sae_attached",
                                  param=ACTIVATIONS_FIELD)
        elif len(attached) > 1:
            names = ", ".join(f"{sid} (layer {layer})" for layer, sid in sorted(attached.items()))
            raise bad(f"several SAEs are attached ({names}): name sae_id")
        else:
            sae_id = next(iter(attached.values()))
        sae = self.sae(sae_id)
        self.check_fits(sae, model.id)
        features = ask.get("features")
        if features is not None:
            if not isinstance(features, list) or not features or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in features):
                raise bad("features must be a non-empty list of non-negative integers")
            past = [i for i in features if i >= sae["d_sae"]]
            if past:
                raise sdk.LocalmError(400, f"{ACTIVATIONS_FIELD}: feature {past[0]} is past SAE {sae['id']}'s width "
                                           f"({sae['d_sae']})", code="invalid_feature_index", param=ACTIVATIONS_FIELD)
            features = sorted(set(features))
        top_k = ask.get("top_k")
        if top_k is None:
            top_k = min(len(features), SAE_ACTIVATIONS_MAX_TOP_K) if features else DEFAULT_TOP_K
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise bad("top_k must be a positive integer")
        if top_k > SAE_ACTIVATIONS_MAX_TOP_K:
            raise bad(f"top_k {top_k} is over {SAE_ACTIVATIONS_MAX_TOP_K} (SAE_ACTIVATIONS_MAX_TOP_K)")
        top_k = min(top_k, len(features) if features else sae["d_sae"])
        positions = ask.get("positions", "last")
        if isinstance(positions, dict):
            start, end = positions.get("start"), positions.get("end")
            if set(positions) != {"start", "end"} or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (start, end)) or end <= start:
                raise bad('positions {"start", "end"} needs integers with 0 <= start < end')
        elif positions not in POSITION_WORDS:
            raise bad('positions must be "last", "prompt", "completion", "all" or {"start": int, "end": int}')
        read_point = ask.get("read_point", "post_steering")
        if read_point not in READ_POINTS:
            raise bad("read_point must be \"pre_steering\" or \"post_steering\"")
        # the worst case, before anything is generated: the reply counts as max_tokens in full
        # (the rest of the context window without it); the prompt is not tokenised yet, so it
        # counts as its request's bytes (a token covers at least one) plus TEMPLATE_ALLOWANCE
        # for a chat template's own text, and never more than the window holds
        window = (model.capabilities or {}).get("context_window")
        cap = request.get("max_tokens") or request.get("max_completion_tokens")
        cap = cap if isinstance(cap, int) and not isinstance(cap, bool) else None
        if window is not None:
            cap = min(cap, window - 1) if cap is not None else window - 1
        prompt_bound = prompt_bytes(request) + TEMPLATE_ALLOWANCE
        if window is not None:
            prompt_bound = min(prompt_bound, window - 1)
        if positions == "last":
            worst: int | None = 1
        elif isinstance(positions, dict):
            worst = positions["end"] - positions["start"]
        elif positions == "completion":
            worst = cap
        elif positions == "prompt":
            worst = prompt_bound
        else:
            worst = None if cap is None else prompt_bound + cap
            if worst is not None and window is not None:
                worst = min(worst, window - 1)
        if worst is None or worst * top_k > SAE_ACTIVATIONS_MAX_ENTRIES:
            shown = "unbounded" if worst is None else f"{worst} positions × top_k {top_k} = {worst * top_k}"
            raise bad(f"the worst case ({shown}) is over {SAE_ACTIVATIONS_MAX_ENTRIES} entries "
                      "(SAE_ACTIVATIONS_MAX_ENTRIES): lower top_k, set max_tokens or read a {start, end} range")
        encoder = self.encoder(sae)
        chosen = np.asarray(features, dtype=np.int64) if features else None

        def done(rows: np.ndarray, prompt_ids: list[int], generated_ids: list[int]) -> dict[str, Any]:
            ids = list(prompt_ids) + list(generated_ids)
            count = int(rows.shape[0])
            if positions == "last":
                wanted = range(max(count - 1, 0), count)
            elif positions == "prompt":
                wanted = range(min(len(prompt_ids), count))
            elif positions == "completion":
                wanted = range(min(len(prompt_ids), count), count)
            elif positions == "all":
                wanted = range(count)
            else:
                wanted = range(min(positions["start"], count), min(positions["end"], count))
            out = []
            for first in range(wanted.start, wanted.stop, ENCODE_ROWS):  # a few rows at a time: d_sae can be wide
                last = min(first + ENCODE_ROWS, wanted.stop)
                acts = store.encode(encoder, rows[first:last], chosen)
                for n, values in enumerate(acts):
                    order = np.lexsort((np.arange(values.shape[0]), -values))[:top_k]  # largest; ties by index
                    position = first + n
                    out.append({"position": position, "token_id": int(ids[position]) if position < len(ids) else None,
                                "features": [{"index": int(chosen[j] if chosen is not None else j),
                                              "value": float(values[j])} for j in order]})
            return {"millm": {"sae_activations": {"sae_id": sae["id"], "layer": sae["layer"], "read_point": read_point,
                                                  "positions": out, "note": NOTES[read_point]}}}

        register.read(sae["layer"], READ_POINTS[read_point], done)

    def interventions(self, request: dict[str, Any], model: Any, register: Any) -> None:
        present = [k for k in STEERING_FIELDS if request.get(k) is not None]
        for key in STEERING_FIELDS:
            if key in request:
                register.use(key)
        if present and "messages" not in request:
            raise sdk.LocalmError(400, f"{present[0]} cannot be honoured on /v1/completions: per-request steering is "
                                       "served on chat completions", code="field_not_honoured", field=present[0])
        dial = read_dial(request.get("steering_intensity"))
        if self.state.error or self.saes.error:
            if present:
                (self.state if self.state.error else self.saes).check()
            return
        named = request.get("profile")
        if named is not None:
            if not isinstance(named, str):
                raise sdk.LocalmError(400, "profile must be a string (a profile's name)", code="invalid_parameter")
            profile = self.profile(named)
        elif not self.state.data["enabled"]:
            return
        else:
            active = self.state.data["active_profile"]
            profile = self.profiles.data["profiles"].get(active) if active else None
            if active and profile is None:
                return  # the active profile is gone: nothing to steer by
        attached = self.attached()
        if not attached:
            return  # no SAE: the request runs unsteered
        if profile is not None:
            base = [(f["index"], f["strength"]) for f in profile["features"]]
        else:
            on = set(attached.values())
            base = [(f["index"], f["strength"], f["sae_id"]) for f in self.state.data["features"] if f["sae_id"] in on]
        if not base:
            return
        if dial == 0.0:
            echo(register, 0.0)  # off: no steering, and the base is not validated
            return
        lo, hi = self.dial_bounds(profile)
        if dial is None:
            lam = float(profile.get("intensity", 1.0)) if profile is not None else 1.0
            lam = min(lam, hi)
        elif dial == "min":
            lam = lo
        elif dial == "max":
            lam = hi
        else:
            lam = min(dial, hi)
        if lam <= 0.0:  # a range or a stored dial that starts at 0: nothing to add
            if dial is not None:
                echo(register, 0.0)
            return
        if profile is not None:
            sae = self.profile_target(profile)
            if sae is None:
                return
            groups = {sae["id"]: base}
        else:
            groups = {}
            for index, strength, sae_id in base:
                groups.setdefault(sae_id, []).append((index, strength))
        deltas = []
        for sae_id, features in groups.items():
            sae = self.sae(sae_id)
            self.check_fits(sae, model.id)
            weights = self.decoder(sae)
            delta = np.zeros(sae["d_in"], dtype=np.float64)
            for index, strength in features:
                delta += clamp(lam * strength) * weights[index].astype(np.float64)
            deltas.append((sae["layer"], delta.astype(np.float32)))
        for layer, delta in deltas:
            register(layer, delta)
        if dial is not None:
            echo(register, lam)


def prompt_bytes(request: dict[str, Any]) -> int:
    """The UTF-8 bytes of what a prompt is made from (messages and tools, or the prompt)."""
    import json
    parts = [request.get(k) for k in ("messages", "tools", "prompt") if request.get(k) is not None]
    return len(json.dumps(parts, ensure_ascii=False).encode("utf-8"))


def bad(message: str) -> sdk.LocalmError:
    return sdk.LocalmError(400, f"{ACTIVATIONS_FIELD}: {message}", code="invalid_parameter", param=ACTIVATIONS_FIELD)


def echo(register: Any, lam: float) -> None:
    value = repr(round(float(lam), 6))
    for name in INTENSITY_HEADERS:
        register.header(name, value)


def read_dial(value: Any) -> float | str | None:
    """steering_intensity: None, a number in 0–2 (0 is off), "off", "min" or "max"."""
    if value is None:
        return None
    if isinstance(value, str):
        word = value.strip().lower()
        if word == "off":
            return 0.0
        if word in ("min", "max"):
            return word
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and 0.0 <= value <= 2.0:
        return float(value)
    raise sdk.LocalmError(400, f"steering_intensity must be a number from 0 to 2, \"off\", \"min\" or \"max\"; "
                               f"got {value!r}", code="invalid_parameter", param="steering_intensity")


def _file_shape(path: Path, kind: str) -> tuple[int | None, int | None]:
    """(hidden size, layers) read from a model's files without loading it."""
    try:
        if kind == "gguf":
            from localm.sdk import gguf
            meta = gguf.metadata(path)
            arch = meta.get("general.architecture", "")
            hidden, layers = meta.get(f"{arch}.embedding_length"), meta.get(f"{arch}.block_count")
        else:
            import json
            config = json.loads((path / "config.json").read_text())
            config = config.get("text_config") or config
            hidden, layers = config.get("hidden_size"), config.get("num_hidden_layers")
    except Exception:  # noqa: BLE001 (an unreadable model file: its shape is checked once loaded)
        return None, None
    return (hidden if isinstance(hidden, int) else None), (layers if isinstance(layers, int) else None)


# --- the plugin ---------------------------------------------------------------------------

@sdk.hookimpl
def create_service(host: Any, plugin: Any) -> Steering:
    """The plugin's state while it runs (``host.service("steering")`` for plugins that read
    SAEs: activations, circuits; ``sdk.service_of(request)`` in its routes)."""
    return Steering(host, plugin)


@sdk.hookimpl
def register_settings(register: Any) -> None:
    register(Settings)


@sdk.hookimpl
def register_scopes(register: Any) -> None:
    register("steering", "Register SAEs, steer features and manage steering profiles")


@sdk.hookimpl
def forward_interventions(request: Any, model: Any, register: Any, plugin: Any) -> None:
    if not isinstance(request, dict):
        return
    plugin.service.activations(request, model, register)
    plugin.service.interventions(request, model, register)


@sdk.hookimpl
def register_routes(register: Any) -> None:
    from . import routes
    register(*routes.HANDLERS)
