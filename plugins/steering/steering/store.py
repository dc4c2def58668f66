"""The steering plugin's data: SAEs registered from files, the live steering state and the
saved profiles, each a JSON file in the plugin's data directory, written atomically (a
temporary file beside the target, flushed, then renamed over it). A file that exists but
cannot be read is reported with 409 and never overwritten."""

from __future__ import annotations

import json
import math
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
from localm import sdk
from localm.sdk import storage

MAX_STRENGTH = 200.0
RESID_POST = re.compile(r"^blocks\.(\d+)\.hook_resid_post$")
RESID_PRE = re.compile(r"^blocks\.(\d+)\.hook_resid_pre$")


def write_json(path: Path, value: Any) -> None:
    """Replace ``path`` with ``value`` as JSON; on any failure the old file stays."""
    storage.atomic_write_json(path, value)


class JsonFile:
    """One JSON object on disk, read once; ``error`` is set when it exists but cannot be read."""

    def __init__(self, path: Path, default: dict[str, Any]) -> None:
        self.path = path
        self.error: str | None = None
        self.data = default
        if path.exists():
            try:
                data = json.loads(path.read_text())
                if not isinstance(data, dict):
                    raise ValueError("not a JSON object")  # noqa: TRY004 (reported as unreadable)
                self.data = {**default, **data}
            except (OSError, ValueError) as exc:
                self.error = f"{path.name} exists but cannot be read ({exc}); fix or remove it (it was not changed)"

    def check(self) -> None:
        if self.error is not None:
            raise sdk.LocalmError(409, self.error, code="unreadable_file")

    def save(self) -> None:
        self.check()
        write_json(self.path, self.data)


def clamp(strength: float) -> float:
    return max(-MAX_STRENGTH, min(MAX_STRENGTH, strength))


def read_strength(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise sdk.LocalmError(400, f"{where} must be a finite number", code="invalid_parameter")
    return clamp(float(value))


def read_index(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise sdk.LocalmError(400, f"{where} must be a non-negative integer", code="invalid_feature_index")
    return value


# --- SAE files ---------------------------------------------------------------------------

def _npz_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The arrays' shapes in an .npz, read from their headers (no weights read)."""
    shapes = {}
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            if not name.endswith(".npy"):
                continue
            with z.open(name) as fh:
                version = np.lib.format.read_magic(fh)
                reader = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                          else np.lib.format.read_array_header_2_0)
                shape, _, _ = reader(fh)
            shapes[name[:-4]] = tuple(shape)
    return shapes


def _layer_of_hook(hook_name: Any) -> int | None:
    if not isinstance(hook_name, str):
        return None
    m = RESID_POST.match(hook_name)
    if m:
        return int(m.group(1))
    m = RESID_PRE.match(hook_name)
    if m and int(m.group(1)) >= 1:
        return int(m.group(1)) - 1  # the input of block L is the output of block L-1
    raise sdk.LocalmError(400, f"SAE hook {hook_name!r} is not on the residual stream "
                               "(blocks.L.hook_resid_post or hook_resid_pre): it cannot be steered here",
                          code="sae_unsupported")


def inspect_sae(path_text: Any, layer: Any) -> dict[str, Any]:
    """Read an SAE's description from a SAELens folder or a Gemma Scope params.npz."""
    if not isinstance(path_text, str) or not path_text:
        raise sdk.LocalmError(400, "path must name a SAELens folder or a Gemma Scope params.npz",
                              code="invalid_parameter")
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
        raise sdk.LocalmError(400, "layer must be a non-negative integer", code="invalid_parameter")
    path = Path(path_text).expanduser()
    if path.is_dir() and (path / "params.npz").is_file() and not (path / "cfg.json").is_file():
        path = path / "params.npz"
    if path.is_file() and path.suffix == ".npz":
        try:
            shapes = _npz_shapes(path)
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise sdk.LocalmError(400, f"{path.name} is not a readable .npz: {exc}", code="sae_unreadable") from exc
        missing = [k for k in ("W_enc", "b_enc", "W_dec", "b_dec") if k not in shapes]
        if missing:
            raise sdk.LocalmError(400, f"{path.name} lacks {', '.join(missing)}", code="sae_unreadable")
        if layer is None:
            raise sdk.LocalmError(400, "A Gemma Scope params.npz does not record its layer: give layer",
                                  code="invalid_parameter")
        d_sae, d_in = _matrix(shapes["W_dec"], "W_dec", path.name)
        _expect(shapes["W_enc"], (d_in, d_sae), "W_enc", path.name)
        return {"format": "gemma_scope", "path": str(path.resolve()), "layer": layer, "d_in": d_in, "d_sae": d_sae,
                "hook_name": f"blocks.{layer}.hook_resid_post", "dtype": "float32",
                "jumprelu": "threshold" in shapes}
    cfg_path, weights = path / "cfg.json", path / "sae_weights.safetensors"
    if not (path.is_dir() and cfg_path.is_file() and weights.is_file()):
        raise sdk.LocalmError(400, f"{path_text} is neither a SAELens folder (cfg.json and sae_weights.safetensors) "
                                   "nor a Gemma Scope params.npz", code="sae_unreadable")
    try:
        cfg = json.loads(cfg_path.read_text())
        from safetensors import safe_open
        with safe_open(str(weights), framework="numpy") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception as exc:  # a broken file of any kind: refused, naming it
        raise sdk.LocalmError(400, f"{path.name} cannot be read: {exc}", code="sae_unreadable") from exc
    missing = [k for k in ("W_enc", "b_enc", "W_dec", "b_dec") if k not in shapes]
    if missing:
        raise sdk.LocalmError(400, f"sae_weights.safetensors lacks {', '.join(missing)}", code="sae_unreadable")
    d_sae, d_in = _matrix(shapes["W_dec"], "W_dec", "sae_weights.safetensors")
    _expect(shapes["W_enc"], (d_in, d_sae), "W_enc", "sae_weights.safetensors")
    for key, value in (("d_in", d_in), ("d_sae", d_sae)):
        if cfg.get(key) is not None and cfg.get(key) != value:
            raise sdk.LocalmError(400, f"cfg.json says {key} {cfg.get(key)} but W_dec has {value}",
                                  code="sae_unreadable")
    found = _layer_of_hook(cfg.get("hook_name"))
    if found is None and isinstance(cfg.get("hook_layer"), int):
        found = cfg["hook_layer"]
    if found is None and layer is None:
        raise sdk.LocalmError(400, "cfg.json names no layer (hook_name or hook_layer): give layer",
                              code="invalid_parameter")
    if found is not None and layer is not None and found != layer:
        raise sdk.LocalmError(400, f"layer {layer} was given but cfg.json's hook is at layer {found}",
                              code="invalid_parameter")
    layer = found if found is not None else layer
    return {"format": "saelens", "path": str(path.resolve()), "layer": layer, "d_in": d_in, "d_sae": d_sae,
            "hook_name": cfg.get("hook_name") or f"blocks.{layer}.hook_resid_post",
            "dtype": str(cfg.get("dtype") or "float32"), "model_name": cfg.get("model_name")}


def _matrix(shape: tuple[int, ...], name: str, file: str) -> tuple[int, int]:
    if len(shape) != 2:
        raise sdk.LocalmError(400, f"{name} in {file} has shape {shape}, not a matrix", code="sae_unreadable")
    return int(shape[0]), int(shape[1])


def _expect(shape: tuple[int, ...], wanted: tuple[int, int], name: str, file: str) -> None:
    if tuple(shape) != wanted:
        raise sdk.LocalmError(400, f"{name} in {file} has shape {tuple(shape)}, expected {wanted}",
                              code="sae_unreadable")


def load_decoder(sae: dict[str, Any]) -> np.ndarray:
    """W_dec (d_sae × d_in) as float32."""
    path = Path(sae["path"])
    if sae["format"] == "gemma_scope":
        with np.load(path) as z:
            return np.ascontiguousarray(z["W_dec"], dtype=np.float32)
    from safetensors import safe_open
    try:
        with safe_open(str(path / "sae_weights.safetensors"), framework="numpy") as f:
            return np.ascontiguousarray(f.get_tensor("W_dec"), dtype=np.float32)
    except (TypeError, ValueError):  # bfloat16 and other dtypes numpy cannot hold: through torch
        with safe_open(str(path / "sae_weights.safetensors"), framework="pt") as f:
            return f.get_tensor("W_dec").float().numpy()


def load_encoder(sae: dict[str, Any]) -> dict[str, Any]:
    """What encoding a residual needs: W_enc (d_in × d_sae), b_enc, b_dec, ``threshold`` (a
    JumpReLU SAE's, else None) as float32, and ``centre`` (subtract b_dec before W_enc).

    A SAELens SAE must be "standard" (ReLU((x - b_dec) @ W_enc + b_enc)) or "jumprelu";
    a Gemma Scope params.npz is JumpReLU on x @ W_enc + b_enc (ReLU without a threshold).
    Other architectures (top-k, gated) and normalised inputs are refused with 400."""
    path = Path(sae["path"])
    if sae["format"] == "gemma_scope":
        with np.load(path) as z:
            arrays = {k: np.ascontiguousarray(z[k], dtype=np.float32) for k in ("W_enc", "b_enc", "b_dec")}
            threshold = np.ascontiguousarray(z["threshold"], dtype=np.float32) if "threshold" in z.files else None
        return {**arrays, "threshold": threshold, "centre": False}
    cfg = json.loads((path / "cfg.json").read_text())
    arch = cfg.get("architecture") or "standard"
    if arch not in ("standard", "jumprelu"):
        raise sdk.LocalmError(400, f"SAE {sae['id']} has architecture {arch!r}: only standard (ReLU) and jumprelu "
                                   "SAEs are encoded here", code="sae_unsupported")
    if arch == "standard" and (cfg.get("activation_fn_str") or "relu") != "relu":
        raise sdk.LocalmError(400, f"SAE {sae['id']} uses activation {cfg.get('activation_fn_str')!r}: only relu "
                                   "is encoded here", code="sae_unsupported")
    if (cfg.get("normalize_activations") or "none") != "none":
        raise sdk.LocalmError(400, f"SAE {sae['id']} normalises its inputs ({cfg.get('normalize_activations')}): "
                                   "it cannot be encoded here", code="sae_unsupported")
    from safetensors import safe_open
    names = ["W_enc", "b_enc", "b_dec"] + (["threshold"] if arch == "jumprelu" else [])
    file = str(path / "sae_weights.safetensors")
    try:
        with safe_open(file, framework="numpy") as f:
            arrays = {k: np.ascontiguousarray(f.get_tensor(k), dtype=np.float32) for k in names}
    except (TypeError, ValueError):  # bfloat16 and other dtypes numpy cannot hold: through torch
        with safe_open(file, framework="pt") as f:
            arrays = {k: f.get_tensor(k).float().numpy() for k in names}
    return {"W_enc": arrays["W_enc"], "b_enc": arrays["b_enc"], "b_dec": arrays["b_dec"],
            "threshold": arrays.get("threshold"), "centre": bool(cfg.get("apply_b_dec_to_input", True))}


def encode(encoder: dict[str, Any], rows: np.ndarray, features: np.ndarray | None = None) -> np.ndarray:
    """The SAE's feature activations (positions × d_sae, float32) of residual ``rows``; only
    the columns of ``features`` when given."""
    w_enc, b_enc, threshold = encoder["W_enc"], encoder["b_enc"], encoder["threshold"]
    if features is not None:
        w_enc, b_enc = w_enc[:, features], b_enc[features]
        threshold = None if threshold is None else threshold[features]
    x = np.asarray(rows, dtype=np.float32)
    if encoder["centre"]:
        x = x - encoder["b_dec"]
    pre = x @ w_enc + b_enc
    acts = np.maximum(pre, 0.0)
    if threshold is not None:
        acts = acts * (pre > threshold)
    return acts.astype(np.float32, copy=False)
