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
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise GGUFError(f"{Path(path).name} is not a GGUF file")
        version = _read(fh, "<I")
        if version < 2:
            raise GGUFError(f"GGUF version {version} is too old")
        _read(fh, "<Q")  # tensor count
        kv_count = _read(fh, "<Q")
        out: dict[str, Any] = {}
        for _ in range(kv_count):
            key = _string(fh)
            out[key] = _value(fh, _read(fh, "<I"))
        return out
