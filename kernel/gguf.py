"""Read a GGUF file's metadata (key/value header) without loading the model."""

from __future__ import annotations

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
