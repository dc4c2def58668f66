"""The release history this build ships (``CHANGELOG.md``), for ``GET /api/changelog``.

The file is read from the kernel package (``localm/kernel/CHANGELOG.md``: a copy in a
wheel, a link to the repository's own file in a source checkout), or from the root of the
source tree the kernel runs from. No network call is ever made.
"""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path
from typing import Any

from . import __version__

NAME = "CHANGELOG.md"
#: A larger file is not served (it is not the changelog this build shipped).
MAX_BYTES = 1024 * 1024
_SECTION = re.compile(r"^## \[([^\]]+)\]", re.M)


def locate() -> Path | None:
    """Where this build's CHANGELOG.md is, or None when it shipped without one."""
    candidates: list[Path] = []
    try:
        candidates.append(Path(str(importlib.resources.files("localm.kernel") / NAME)))
    except (ModuleNotFoundError, TypeError):
        pass
    candidates.append(Path(__file__).resolve().parent.parent / NAME)  # the source tree's root
    for path in candidates:
        try:
            if path.is_file():
                return path
        except OSError:
            continue
    return None


def released(markdown: str) -> str:
    """``markdown`` without its ``## [Unreleased]`` section."""
    out: list[str] = []
    skipping = False
    for line in markdown.splitlines(keepends=True):
        if line.startswith("## "):
            skipping = line.lower().startswith("## [unreleased]")
        if not skipping:
            out.append(line)
    return "".join(out)


def read() -> dict[str, Any]:
    """GET /api/changelog's answer: ``{"available": true, "version", "markdown"}``, or
    ``{"available": false}`` when the file is absent, unreadable or too large."""
    path = locate()
    if path is None:
        return {"available": False}
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            return {"available": False}
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return {"available": False}
    return {"available": True, "version": __version__, "markdown": released(text)}


def newest_release(markdown: str) -> str | None:
    """The version of the first released section (``## [0.1.0] - date``), if any."""
    for m in _SECTION.finditer(markdown):
        if m.group(1).lower() != "unreleased":
            return m.group(1)
    return None
