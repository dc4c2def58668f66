"""One typed error for every refusal, and the renderers that turn it into a response.

Raise :class:`LocalmError` from anywhere (a route, a hook, a store); the route
family's renderer shapes the body. The default shape is ``{"detail": ...}``; a 500
never carries internals, its cause goes to the server log.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("localm")


class LocalmError(Exception):
    """A refusal with an HTTP status, a message for the caller and an optional stable code."""

    def __init__(self, status: int, detail: str, *, code: str | None = None,
                 headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.code = code
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"detail": self.detail}
        if self.code:
            out["code"] = self.code
        out.update(self.extra)
        return out


class Unreadable(LocalmError):
    """A stored file exists but cannot be read; it is reported and never overwritten."""

    def __init__(self, what: str) -> None:
        super().__init__(409, f"{what} exists but cannot be read; fix or remove it (it was not changed)",
                         code="unreadable_file")


class SaveTimeout(LocalmError):
    """Another writer held the file's lock for too long; nothing was written."""

    def __init__(self, what: str) -> None:
        super().__init__(504, f"Timed out waiting to save {what}; nothing was changed", code="save_timeout")
