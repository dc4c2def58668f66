"""Read a GGUF file's metadata (key/value header) without loading the model, and find the
projector (mmproj) a model file is paired with."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: Arrays longer than this (token lists, merges) are skipped, not kept.
_KEEP_ARRAY = 64


class GGUFError(Exception):
    pass


def _read(fh: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = fh.read(size)
    if len(data) != size:
        raise GGUFError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _string(fh: BinaryIO) -> str:
    n = _read(fh, "<Q")
    if n > 1 << 26:
        raise GGUFError("implausible string length in GGUF header")
    return fh.read(n).decode("utf-8", errors="replace")


def _value(fh: BinaryIO, kind: int) -> Any:
    if kind in _SCALARS:
        return _read(fh, _SCALARS[kind])
    if kind == _STRING:
        return _string(fh)
    if kind == _ARRAY:
        item_kind, count = _read(fh, "<I"), _read(fh, "<Q")
        if count <= _KEEP_ARRAY:
            return [_value(fh, item_kind) for _ in range(count)]
        if item_kind in _SCALARS:
            fh.seek(struct.calcsize(_SCALARS[item_kind]) * count, 1)
        else:
            for _ in range(count):
                _value(fh, item_kind)
        return {"array_of": count}
    raise GGUFError(f"unknown GGUF value type {kind}")


def metadata(path: Path) -> dict[str, Any]:
    """Every key/value of the GGUF header (long arrays summarised as {"array_of": n})."""
    return header(path)[0]


def header(path: Path, *, parameters: bool = False) -> tuple[dict[str, Any], int | None]:
    """The header's key/values and, when asked, the parameter count summed over the tensor
    shapes (read from the tensor index; no weight is read)."""
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise GGUFError(f"{Path(path).name} is not a GGUF file")
        version = _read(fh, "<I")
        if version < 2:
            raise GGUFError(f"GGUF version {version} is too old")
        tensors = _read(fh, "<Q")
        kv_count = _read(fh, "<Q")
        out: dict[str, Any] = {}
        for _ in range(kv_count):
            key = _string(fh)
            out[key] = _value(fh, _read(fh, "<I"))
        if not parameters:
            return out, None
        total = 0
        for _ in range(tensors):
            _string(fh)  # name
            count = 1
            for _ in range(_read(fh, "<I")):
                count *= _read(fh, "<Q")
            _read(fh, "<I")  # type
            _read(fh, "<Q")  # offset
            total += count
        return out, total


#: ``general.file_type`` values (llama.cpp's LLAMA_FTYPE) and their usual names.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
              18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S",
              25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M",
              32: "BF16"}


# --- projectors: the multimodal half of a vision (or audio) model --------------------------------

#: The GGUF value types' sizes, and the string and array types, for skipping values unread.
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
#: A projector ("mmproj") GGUF's architecture: llama.cpp's multimodal encoders.
PROJECTOR_ARCHITECTURE = "clip"


def _skip(fh: BinaryIO, kind: int) -> None:
    """Move past one value of type ``kind`` without reading it."""
    if kind in _SIZES:
        fh.seek(_SIZES[kind], 1)
    elif kind == _STRING:
        fh.seek(_read(fh, "<Q"), 1)
    elif kind == _ARRAY:
        item, count = _read(fh, "<I"), _read(fh, "<Q")
        if item in _SIZES:
            fh.seek(_SIZES[item] * count, 1)
        else:
            for _ in range(count):
                _skip(fh, item)
    else:
        raise GGUFError(f"unknown GGUF value type {kind}")


def architecture(path: str | Path) -> str | None:
    """A GGUF file's ``general.architecture`` (None when it is not a GGUF or does not say),
    read from its header up to that key: nothing else of the file is read."""
    try:
        with open(path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                return None
            _read(fh, "<I")  # version
            _read(fh, "<Q")  # tensors
            for _ in range(_read(fh, "<Q")):
                key_length = _read(fh, "<Q")
                if key_length > 1 << 16:
                    return None
                key = fh.read(key_length)
                kind = _read(fh, "<I")
                if key == b"general.architecture" and kind == _STRING:
                    return _string(fh)
                _skip(fh, kind)
    except (OSError, GGUFError, struct.error):
        return None
    return None


def tensor_names(path: str | Path) -> set[str]:
    """The tensor names of a GGUF file, read from its index (no weight is read); GGUFError when
    it is not a GGUF file or its header is cut short."""
    return set(tensor_shapes(path))


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, by name, in llama.cpp's ``ne`` order (the input width first), read
    from the file's index (no weight is read); GGUFError as ``tensor_names``."""
    shapes: dict[str, tuple[int, ...]] = {}
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise GGUFError(f"{Path(path).name} is not a GGUF file")
        _read(fh, "<I")  # version
        tensors, kv_count = _read(fh, "<Q"), _read(fh, "<Q")
        for _ in range(kv_count):
            _skip(fh, _STRING)  # the key
            _skip(fh, _read(fh, "<I"))
        for _ in range(tensors):
            name = _string(fh)
            shapes[name] = tuple(_read(fh, "<Q") for _ in range(_read(fh, "<I")))
            fh.seek(4 + 8, 1)  # type, offset
    return shapes


def find_projector(model_path: str | Path) -> Path | None:
    """The projector beside a model file, as llama.cpp's tools and model repositories name
    it, or None: ``<stem>.mmproj*.gguf`` or ``<stem>-mmproj*.gguf`` (this model's own) first,
    then ``mmproj*.gguf`` (one a folder: a repository's models share it), names compared
    without case, each checked to be a GGUF whose architecture is ``clip``. Among several
    of one kind the first by name wins (``mmproj-model-f16.gguf`` before ``-f32``), so the
    same folder always gives the same answer."""
    model = Path(model_path)
    stem = model.name[:-5] if model.name.lower().endswith(".gguf") else model.stem
    stem = stem.lower()
    try:
        names = sorted(entry.name for entry in os.scandir(model.parent) if entry.is_file())
    except OSError:
        return None
    own, shared = [], []
    for name in names:
        lower = name.lower()
        if not lower.endswith(".gguf") or name == model.name:
            continue
        if lower.startswith((f"{stem}.mmproj", f"{stem}-mmproj")):
            own.append(name)
        elif lower.startswith("mmproj"):
            shared.append(name)
    for name in own + shared:
        if architecture(model.parent / name) == "clip":
            return model.parent / name
    return None


def projector_capabilities(path: str | Path) -> dict[str, bool]:
    """What a projector adds to its model: ``vision`` (it has an image encoder) and
    ``audio_input`` (a sound encoder), from its header (an older projector, without the keys,
    sees)."""
    try:
        meta = metadata(Path(path))
    except (OSError, GGUFError, ValueError, struct.error):
        return {"vision": False, "audio_input": False}
    vision = meta.get("clip.has_vision_encoder")
    return {"vision": bool(vision) if vision is not None else not meta.get("clip.has_audio_encoder"),
            "audio_input": bool(meta.get("clip.has_audio_encoder"))}
