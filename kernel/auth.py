"""API keys, scopes and the caller's identity.

Three kinds of credential:

- the **owner key** (``localm key generate``, ``POST /api/auth/key/rotate``, or the
  ``LOCALM_API_KEY`` environment variable): every scope;
- **scoped keys** (``localm key create``, ``POST /v1/keys``): the scopes they were minted with,
  optionally expiring;
- the per-process **attach token** that ``localm`` CLI commands read from the data dir
  (file mode 0600). It is accepted only from a loopback client and acts as the owner.

Keys are stored as SHA-256 hashes; a plaintext key is shown once, when it is made.
The server is in *open mode* until a key exists: inference routes need nothing and
management routes need the attach token. In open mode a caller is the owner (``open``)
only from this server's own pages, a local page or a ``cors_origins`` entry, or with no
``Origin`` at all (a program): a browser page of any other origin is ``web``, which gets
inference and nothing of the owner's (no scope, so no RAG collection, no memory, no
plugin data).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

import attrs

from . import limits
from .errors import LocalmError
from .manifest import legal_id
from .storage import JsonFile

#: Scopes the kernel ships, with what they grant.
KERNEL_SCOPES: dict[str, str] = {
    "admin": "Everything, including minting privileged keys (implies every other scope)",
    "config:read": "Read the config, its schema and plugin settings",
    "config:write": "Change the config and plugin settings; restart or stop the server",
    "plugins:read": "List plugins and their state",
    "plugins:admin": "Install, uninstall, enable, disable and refresh plugins; install their dependencies",
    "keys:admin": "List, mint and revoke scoped keys",
    "models:read": "List models and their details",
    "models:write": "Load, unload and rename models",
    "coder:full": "Full coder access (host filesystem reach)",
}

#: Scopes only the owner (or an admin key) may grant: each is host reach in some form.
PRIVILEGED_SCOPES = frozenset({"admin", "plugins:admin", "keys:admin", "config:write", "coder:full"})

KEY_PREFIX = "lm-"
_HEADER_SAFE = re.compile(r"^[\x21-\x7e]+$")
MIN_KEY_LENGTH = 16


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def check_key_value(value: str) -> None:
    """Refuse a caller-chosen key that is too short or cannot travel in a header."""
    if len(value) < MIN_KEY_LENGTH:
        raise LocalmError(400, f"Key too short: at least {MIN_KEY_LENGTH} characters")
    if not _HEADER_SAFE.match(value):
        raise LocalmError(400, "Key holds characters an Authorization header cannot carry "
                               "(use printable ASCII without spaces)")


def scope_satisfies(granted: frozenset[str], required: str) -> bool:
    """admin implies everything; ``x:write`` and ``x:admin`` imply ``x:read``."""
    if "admin" in granted or required in granted:
        return True
    if required.endswith(":read"):
        base = required[: -len(":read")]
        return f"{base}:write" in granted or f"{base}:admin" in granted
    return False


@attrs.frozen
class Principal:
    """Who is calling, and what they may do."""

    #: "owner" | "key" | "attach" | "open" (open mode: this machine's programs and pages) |
    #: "web" (open mode: a page of another origin; inference only) | "anonymous" (no credential)
    kind: str
    scopes: frozenset[str] = frozenset()
    key_id: str | None = None
    name: str | None = None
    via_cookie: bool = False
    session_id: str | None = None
    #: a scoped key's folders RAG indexing is confined to (empty: not confined)
    rag_roots: tuple[str, ...] = ()
    #: a scoped key's host filesystem reach: "none" or "host"
    fs_access: str = "none"

    @property
    def is_owner(self) -> bool:
        return self.kind in ("owner", "attach") or "admin" in self.scopes

    @property
    def authenticated(self) -> bool:
        return self.kind in ("owner", "key", "attach")

    def has(self, scope: str | None) -> bool:
        if self.kind in ("owner", "attach"):
            return True
        if self.kind == "web":  # a page of another origin holds no scope at all
            return False
        if scope is None:
            return self.kind != "anonymous"
        return scope_satisfies(self.scopes, scope)

    @property
    def owner_tag(self) -> str:
        """Who owns things this caller starts (jobs): the key id, or 'owner'."""
        return self.key_id or "owner"


ANONYMOUS = Principal(kind="anonymous")
OPEN = Principal(kind="open")
WEB = Principal(kind="web")


@attrs.frozen
class KeyRecord:
    id: str
    name: str
    scopes: tuple[str, ...]
    created: float
    expires: float | None
    fs_access: str
    rag_roots: tuple[str, ...]
    hash: str

    def public(self, last_used: float | None) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "scopes": list(self.scopes), "created": self.created,
                "expires": self.expires, "last_used": last_used, "fs_access": self.fs_access,
                "rag_roots": list(self.rag_roots)}

    def expired(self, now: float | None = None) -> bool:
        return self.expires is not None and (now or time.time()) >= self.expires


class KeyStore:
    """Scoped keys in ``keys.json`` (a JSON list, hashes only) and the owner key in ``owner_key.json``."""

    def __init__(self, data_dir: Path) -> None:
        self.keys_file = JsonFile(data_dir / "keys.json", what="The key store (keys.json)",
                                  default=list, expect=list, mode=0o600)
        self.owner_file = JsonFile(data_dir / "owner_key.json", what="The owner key file (owner_key.json)",
                                   default=dict, expect=dict, mode=0o600)
        self._last_used: dict[str, float] = {}
        self._unsaved: set[str] = set()

    # --- owner key ---------------------------------------------------------------
    @staticmethod
    def env_key() -> str | None:
        value = os.environ.get("LOCALM_API_KEY", "").strip()
        return value or None

    def owner_hash(self) -> str | None:
        try:
            data = self.owner_file.cached()
        except LocalmError:
            return None
        value = data.get("hash")
        return value if isinstance(value, str) and value else None

    def owner_key_warning(self) -> str | None:
        """A notice when the owner key file exists but holds no key (the server runs keyless)."""
        if self.owner_file.path.exists() and self.owner_hash() is None and not self.env_key():
            return f"The owner key file {self.owner_file.path} exists but holds no key, so the server runs keyless"
        return None

    def set_owner_key(self, plaintext: str) -> None:
        check_key_value(plaintext)
        self.owner_file.update(lambda _: {"hash": hash_key(plaintext), "created": time.time()})

    def clear_owner_key(self) -> None:
        path = self.owner_file.path
        with self.owner_file.locked():
            if path.exists():
                path.unlink()

    # --- scoped keys ------------------------------------------------------------
    def records(self) -> list[KeyRecord]:
        out = []
        for raw in self.keys_file.cached():
            try:
                out.append(KeyRecord(id=raw["id"], name=raw.get("name", ""), scopes=tuple(raw.get("scopes", [])),
                                     created=raw.get("created", 0.0), expires=raw.get("expires"),
                                     fs_access=raw.get("fs_access", "none"),
                                     rag_roots=tuple(raw.get("rag_roots", [])), hash=raw["hash"]))
            except (KeyError, TypeError):
                continue
        return out

    def listing(self) -> list[dict[str, Any]]:
        return [r.public(self._last_used.get(r.id, self._stored_last_used(r.id))) for r in self.records()]

    def _stored_last_used(self, key_id: str) -> float | None:
        for raw in self.keys_file.cached():
            if isinstance(raw, dict) and raw.get("id") == key_id:
                return raw.get("last_used")
        return None

    def create(self, *, name: str, scopes: list[str], expires: float | None, fs_access: str,
               rag_roots: list[str]) -> tuple[KeyRecord, str]:
        plaintext = new_key()
        record = KeyRecord(id="key_" + secrets.token_hex(6), name=name, scopes=tuple(scopes), created=time.time(),
                           expires=expires, fs_access=fs_access, rag_roots=tuple(rag_roots),
                           hash=hash_key(plaintext))

        def add(current: list[Any]) -> list[Any]:
            return [*current, attrs.asdict(record, recurse=False) | {"scopes": list(record.scopes),
                                                                       "rag_roots": list(record.rag_roots)}]
        self.keys_file.update(add)
        return record, plaintext

    def revoke(self, key_id: str) -> None:
        def drop(current: list[Any]) -> list[Any]:
            kept = [r for r in current if not (isinstance(r, dict) and r.get("id") == key_id)]
            if len(kept) == len(current):
                raise LocalmError(404, f"No key with id {key_id}")
            return kept
        self.keys_file.update(drop)
        self._last_used.pop(key_id, None)

    def flush_last_used(self) -> None:
        """Persist last-use times (kept in memory per request, written at most now and then)."""
        if not self._unsaved:
            return
        seen = {k: self._last_used[k] for k in self._unsaved if k in self._last_used}
        self._unsaved.clear()

        def merge(current: list[Any]) -> list[Any]:
            for r in current:
                if isinstance(r, dict) and r.get("id") in seen:
                    r["last_used"] = seen[r["id"]]
            return current
        try:
            self.keys_file.update(merge)
        except LocalmError:
            return

    # --- verification -------------------------------------------------------------
    def any_key(self) -> bool:
        """True once any credential exists: then every non-public route needs one."""
        if self.env_key() is not None or self.owner_hash() is not None:
            return True
        try:
            return bool(self.keys_file.cached())
        except LocalmError:
            return True  # an unreadable key store fails closed

    def verify(self, plaintext: str) -> Principal | None:
        env = self.env_key()
        if env is not None:
            if hmac.compare_digest(plaintext.encode(), env.encode()):
                return Principal(kind="owner", scopes=frozenset({"admin"}), name="owner")
        digest = hash_key(plaintext)
        owner = self.owner_hash()
        if owner and env is None and hmac.compare_digest(digest, owner):
            return Principal(kind="owner", scopes=frozenset({"admin"}), name="owner")
        try:
            records = self.records()
        except LocalmError:
            return None
        for r in records:
            if hmac.compare_digest(digest, r.hash):
                if r.expired():
                    raise LocalmError(401, "API key expired", headers={"WWW-Authenticate": "Bearer"})
                self._last_used[r.id] = time.time()
                self._unsaved.add(r.id)
                return Principal(kind="key", scopes=frozenset(r.scopes), key_id=r.id, name=r.name,
                                 rag_roots=r.rag_roots, fs_access=r.fs_access)
        return None

    def principal_for_key_id(self, key_id: str) -> Principal | None:
        """The current identity behind a session's key (None once revoked or expired)."""
        if key_id == "owner":
            if self.env_key() or self.owner_hash():
                return Principal(kind="owner", scopes=frozenset({"admin"}), name="owner")
            return None
        try:
            records = self.records()
        except LocalmError:
            return None
        for r in records:
            if r.id == key_id and not r.expired():
                return Principal(kind="key", scopes=frozenset(r.scopes), key_id=r.id, name=r.name,
                                 rag_roots=r.rag_roots, fs_access=r.fs_access)
        return None


def valid_scope_name(scope: str, known: set[str]) -> bool:
    """A shipped scope, a scope some plugin declares, or a plain plugin-name identifier."""
    return scope in known or legal_id(scope)


def parse_mint_request(body: dict[str, Any], caller: Principal, known_scopes: set[str]) -> dict[str, Any]:
    """Check a POST /v1/keys body (or `localm key create`); the keyword arguments for KeyStore.create."""
    name = body.get("name", "")
    scopes = body.get("scopes", [])
    fs_access = body.get("fs_access", "none")
    rag_roots = body.get("rag_roots", [])
    if not isinstance(name, str):
        raise LocalmError(400, "name must be a string")
    if not isinstance(scopes, list) or not all(isinstance(s, str) for s in scopes):
        raise LocalmError(400, "scopes must be a list of scope strings")
    if fs_access not in ("none", "host"):
        raise LocalmError(400, "fs_access must be none or host")
    if not isinstance(rag_roots, list) or not all(isinstance(r, str) for r in rag_roots):
        raise LocalmError(400, "rag_roots must be a list of folder paths")
    limits.check_length("name", name, limits.KEY_NAME_CHARS)
    limits.check_count("scopes", scopes, limits.KEY_SCOPES)
    for s in scopes:
        limits.check_length("scopes[]", s, limits.SCOPE_CHARS)
    limits.check_count("rag_roots", rag_roots, limits.KEY_RAG_ROOTS)
    for r in rag_roots:
        limits.check_length("rag_roots[]", r, limits.PATH_CHARS)
    for s in scopes:
        if not valid_scope_name(s, known_scopes):
            raise LocalmError(400, f"Unknown scope: {s} (a shipped scope, a plugin's scope or a plugin name)")
    expires = None
    if body.get("expires_in") is not None:
        value = body["expires_in"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LocalmError(400, "expires_in must be a positive number of seconds")
        expires = time.time() + float(value)
    elif body.get("expires") is not None:
        value = body["expires"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise LocalmError(400, "expires must be a number (epoch seconds)")
        expires = float(value)
    if not caller.is_owner:
        privileged = [s for s in scopes if s in PRIVILEGED_SCOPES]
        if privileged:
            raise LocalmError(403, f"Only the owner may grant {', '.join(privileged)}")
        if fs_access == "host":
            raise LocalmError(403, "Only the owner may grant fs_access=host")
        if rag_roots:
            raise LocalmError(403, "Only the owner may grant rag_roots")
    return {"name": name, "scopes": list(dict.fromkeys(scopes)), "expires": expires, "fs_access": fs_access,
            "rag_roots": rag_roots}
