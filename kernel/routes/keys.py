"""API keys: list, mint, revoke; the owner key's rotate and clear."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import attrs
from litestar import Request, Response
from litestar.datastructures import Cookie
from msgspec import Meta

from .. import limits
from ..auth import KERNEL_SCOPES, PRIVILEGED_SCOPES, new_key, parse_mint_request
from ..errors import LocalmError
from ..routing import delete, get, post
from ..sessions import COOKIE, SESSION_TTL
from .common import json_body, kernel_of, principal_of


@attrs.define
class KeyMint:
    """A scoped key to mint. Only the owner may grant a privileged scope, fs_access host or rag_roots (403)."""

    name: Annotated[str, Meta(max_length=limits.KEY_NAME_CHARS, description="A label for the key")] = ""
    scopes: Annotated[list[Annotated[str, Meta(max_length=limits.SCOPE_CHARS)]],
                      Meta(max_length=limits.KEY_SCOPES,
                           description="Shipped scopes, plugin scopes or plugin names")] = attrs.Factory(list)
    fs_access: Literal["none", "host"] = "none"
    rag_roots: Annotated[list[Annotated[str, Meta(max_length=limits.PATH_CHARS)]],
                         Meta(max_length=limits.KEY_RAG_ROOTS,
                              description="Folders RAG indexing is confined to")] = attrs.Factory(list)
    expires_in: Annotated[float, Meta(gt=0, description="Seconds from now")] | None = None
    expires: Annotated[float, Meta(description="Epoch seconds (when expires_in is not given)")] | None = None


@attrs.define
class OwnerKey:
    """The owner key to set; left out, empty or blank: a fresh random key."""

    key: Annotated[str, Meta(description="At least 16 characters an Authorization header can carry")] | None = None


def _key_file_label(k: Any, owner: bool) -> str:
    return str(k.keys.owner_file.path) if owner else "<data>/owner_key.json"


@get("/v1/keys", scope="keys:admin", summary="Every scoped key's metadata (never a plaintext key)")
async def list_keys(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    caller = principal_of(request)
    warning = k.keys.owner_key_warning()
    if warning and not caller.is_owner:
        warning = warning.replace(str(k.keys.owner_file.path), _key_file_label(k, False))
    scopes = {**KERNEL_SCOPES, **k.plugins.known_scopes()}
    return {"keys": k.keys.listing(), "is_owner": caller.is_owner,
            "presets": [{"scope": s, "description": d, "privileged": s in PRIVILEGED_SCOPES}
                        for s, d in sorted(scopes.items())],
            "owner_key_warning": warning}


@post("/v1/keys", scope="keys:admin", summary="Mint a scoped key; the plaintext is shown once", body=KeyMint,
      errors={400: "A field of the wrong type, an unknown scope, or a name or list over its limit "
                   "(code limit_exceeded)", 403: "A privileged grant by a caller who is not the owner",
              409: "The key store exists but cannot be read"})
async def create_key(request: Request) -> Response:
    k = kernel_of(request)
    caller = principal_of(request)
    body = await json_body(request)
    known = {**KERNEL_SCOPES, **k.plugins.known_scopes()}
    wanted = parse_mint_request(body, caller, set(known))
    scopes = wanted["scopes"]
    k.keys.keys_file.read()  # 409 before anything is minted when the store is unreadable
    first = not k.keys.any_key()  # open mode: this key turns keys on for every caller
    owner_key = None
    if first:  # the local user keeps full access: an owner key, and this browser signed in as it
        owner_key = new_key()
        k.keys.set_owner_key(owner_key)
    record, plaintext = k.keys.create(**wanted)
    out: dict[str, Any] = {"id": record.id, "name": record.name, "scopes": list(record.scopes),
                           "expires": record.expires, "fs_access": record.fs_access,
                           "rag_roots": list(record.rag_roots), "key": plaintext}
    cookie = None
    if owner_key is not None:
        out["owner_key"] = owner_key
        owner = k.keys.verify(owner_key)
        if owner is not None:
            sid, csrf = k.sessions.create(owner)
            out["csrf"] = csrf
            cookie = Cookie(key=COOKIE, value=sid, path="/", httponly=True, samesite="strict", max_age=SESSION_TTL)
    warnings = []
    for s in scopes:
        base = s.split(":")[0]
        p = next((q for q in k.plugins.plugins.values() if q.manifest and s in q.manifest.scopes),
                 k.plugins.plugins.get(base))  # the plugin that declares it (images declares image)
        if s not in KERNEL_SCOPES and (p is None or not p.installed):
            warnings.append(f"{s}: no installed plugin serves this scope yet")
        elif s not in KERNEL_SCOPES and p is not None and not p.active:
            warnings.append(f"{s}: the {p.name} plugin is not active")
    if owner_key is not None:
        warnings.append("This was the first key, so an owner key was made too (owner_key, shown once): with "
                        "keys on, every caller needs one")
    if warnings:
        out["warnings"] = warnings
    response = Response(out)
    if cookie is not None:
        response.set_cookie(cookie)
    return response


@delete("/v1/keys/{key_id:str}", scope="keys:admin", summary="Revoke a scoped key",
        errors={404: "No key has this id"})
async def revoke_key(request: Request, key_id: str) -> dict[str, Any]:
    kernel_of(request).keys.revoke(key_id)
    return {"status": "revoked", "id": key_id}


@post("/api/auth/key/rotate", scope="admin", summary="Roll the owner key, or set it to a chosen value",
      body=OwnerKey, body_required=False,
      errors={400: "A body that is not an object, or a key the store refuses (too short, or characters an "
                   "Authorization header cannot carry)"})
async def rotate_owner_key(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    body = await json_body(request, empty={})
    value = body.get("key")
    if value is not None and not isinstance(value, str):
        raise LocalmError(400, "key must be a string")
    key = value.strip() if value and value.strip() else new_key()
    k.keys.set_owner_key(key)
    warnings = []
    active = k.keys.verify(key) is not None and k.keys.env_key() is None
    if k.keys.env_key() is not None:
        warnings.append("LOCALM_API_KEY is set in the server's environment and overrides the stored owner key")
    elif not active:
        warnings.append("The stored key could not be read back")
    return {"rotated": True, "active": active, "key": key, "warnings": warnings}


@post("/api/auth/key/clear", scope="config:write", summary="Delete the owner key and sign out every session")
async def clear_owner_key(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    warnings = []
    try:
        k.keys.clear_owner_key()
    except (OSError, LocalmError):
        warnings.append("the owner key (it could not be removed)")
    try:
        k.sessions.drop_all()
    except (OSError, LocalmError):
        warnings.append("browser sessions (some devices may still be signed in)")
    return {"cleared": not warnings, "warnings": warnings}


ROUTES = [list_keys, create_key, revoke_key, rotate_owner_key, clear_owner_key]
