"""The gallery: each generated PNG in the plugin's data folder with a JSON sidecar (the
prompt, the workflow, the seed, the size, when, and who made it)."""

from __future__ import annotations

import re
import secrets
import struct
import time
from pathlib import Path
from typing import Any

from localm import sdk
from localm.sdk.storage import atomic_write_bytes, atomic_write_json, read_json

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,120}\.png$")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's header, or None when ``data`` is not a PNG."""
    if len(data) < 24 or not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", data[16:24])


def visible(meta: dict[str, Any], caller: Any) -> bool:
    return bool(caller.is_owner or meta.get("owner") == caller.owner_tag)


class Gallery:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, png: bytes, meta: dict[str, Any]) -> dict[str, Any]:
        """Keep ``png`` with its sidecar; returns the sidecar (with the image's ``name``)."""
        name = time.strftime("img-%Y%m%d-%H%M%S-", time.localtime()) + secrets.token_hex(4) + ".png"
        size = png_size(png)
        record = {"name": name, **meta, "width": size[0] if size else None, "height": size[1] if size else None,
                  "bytes": len(png), "created": time.time()}
        atomic_write_bytes(self.folder / name, png)
        atomic_write_json(self.folder / f"{name[:-4]}.json", record)
        return record

    def _meta(self, name: str) -> dict[str, Any] | None:
        if not NAME.match(name) or not (self.folder / name).is_file():
            return None
        meta = read_json(self.folder / f"{name[:-4]}.json", None, what=f"The gallery sidecar of {name}", expect=dict)
        return meta if meta is not None else {"name": name}

    def find(self, name: str, caller: Any) -> tuple[Path, dict[str, Any]]:
        """The image and its sidecar; 404 when there is none, or the caller did not make it."""
        meta = self._meta(name)
        if meta is None or not visible(meta, caller):
            raise sdk.LocalmError(404, f"No image {name} in the gallery", code="image_not_found")
        return self.folder / name, meta

    def listing(self, caller: Any) -> list[dict[str, Any]]:
        out = []
        for path in self.folder.glob("*.png"):
            try:
                meta = self._meta(path.name)
            except sdk.LocalmError:  # an unreadable sidecar: only the owner sees the image
                meta = {"name": path.name, "error": "its sidecar cannot be read"}
            if meta is None or not visible(meta, caller):
                continue
            item = dict(meta)
            if not caller.is_owner:
                item.pop("owner", None)
            out.append(item)
        return sorted(out, key=lambda m: (m.get("created") or 0, m["name"]), reverse=True)

    def delete(self, name: str, caller: Any) -> None:
        path, _ = self.find(name, caller)
        path.unlink(missing_ok=True)
        (self.folder / f"{name[:-4]}.json").unlink(missing_ok=True)
