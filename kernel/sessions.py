"""Browser sessions: a key exchanged for an HttpOnly cookie plus a CSRF token.

``sessions.json`` maps the SHA-256 of each session id to the key it was made from;
the session always carries that key's *current* scopes, so revoking the key ends it.
Cookie-authenticated changes must send ``X-CSRF-Token``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from pathlib import Path
from typing import Any

import attrs

from .auth import KeyStore, Principal
from .errors import LocalmError
from .storage import JsonFile

COOKIE = "localm_session"
SESSION_TTL = 30 * 24 * 3600


def _h(sid: str) -> str:
    return hashlib.sha256(sid.encode()).hexdigest()


class SessionStore:
    def __init__(self, data_dir: Path, keys: KeyStore) -> None:
        self.file = JsonFile(data_dir / "sessions.json", what="The session store (sessions.json)",
                             default=dict, expect=dict, mode=0o600)
        self.keys = keys

    def create(self, principal: Principal) -> tuple[str, str]:
        sid = secrets.token_urlsafe(32)
        csrf = secrets.token_urlsafe(24)
        now = time.time()
        record = {"key_id": principal.key_id or "owner", "csrf": csrf, "created": now, "expires": now + SESSION_TTL}

        def add(current: dict[str, Any]) -> dict[str, Any]:
            live = {k: v for k, v in current.items() if isinstance(v, dict) and v.get("expires", 0) > now}
            live[_h(sid)] = record
            return live
        self.file.update(add)
        return sid, csrf

    def lookup(self, sid: str) -> tuple[Principal, str] | None:
        """(principal, csrf) for a live session cookie, or None."""
        try:
            data = self.file.cached()
        except LocalmError:
            return None
        rec = data.get(_h(sid))
        if not isinstance(rec, dict) or rec.get("expires", 0) <= time.time():
            return None
        principal = self.keys.principal_for_key_id(rec.get("key_id", ""))
        if principal is None:
            return None
        return attrs.evolve(principal, via_cookie=True, session_id=sid), rec.get("csrf", "")

    def drop(self, sid: str) -> None:
        def remove(current: dict[str, Any]) -> dict[str, Any]:
            current.pop(_h(sid), None)
            return current
        self.file.update(remove)

    def drop_all(self) -> None:
        self.file.update(lambda _: {})

    @staticmethod
    def csrf_ok(expected: str, sent: str | None) -> bool:
        return bool(expected) and sent is not None and hmac.compare_digest(expected.encode(), sent.encode())
