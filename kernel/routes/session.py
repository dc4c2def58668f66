"""Browser sessions: exchange a key for a cookie, read the session, sign out."""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
from litestar import Request, Response
from litestar.datastructures import Cookie

from ..app import _cookie
from ..errors import LocalmError
from ..sessionlog import HEADER, effective_mode
from ..sessions import COOKIE, SESSION_TTL
from ..routing import delete, get, post
from .common import json_body, kernel_of, principal_of


def _session_cookie(value: str, *, max_age: int, secure: bool = False) -> Cookie:
    """The session cookie; ``secure`` (a request that came over HTTPS) keeps a browser from
    ever sending it over plain HTTP, to this host on any port."""
    return Cookie(key=COOKIE, value=value, path="/", httponly=True, samesite="strict", max_age=max_age,
                  secure=secure)


def _https(request: Request) -> bool:
    return request.scope.get("scheme") == "https"


@get("/api/session", access="session", summary="Whether this caller is signed in, and whether a key is required")
async def read_session(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    caller = principal_of(request)
    csrf = ""
    sid = _cookie(request.scope, COOKIE)
    if sid:
        found = k.sessions.lookup(sid)
        if found is not None:
            csrf = found[1]
    scopes = sorted(caller.scopes) if caller.authenticated else []
    return {"authed": caller.authenticated, "scopes": scopes, "required": k.auth_required(), "csrf": csrf,
            "session_mode": session_mode(k, caller, request.headers.get(HEADER))}


def session_mode(k: Any, caller: Any, asked: str | None) -> str:
    """The mode a chat from ``caller`` is recorded under, with the request's
    X-Localm-Session-Mode (``asked``), which the owner (or anyone, while no key exists) may use
    to lower it."""
    return effective_mode(k.config.get("session_mode"), asked, may_lower=caller.is_owner or not k.auth_required())


@attrs.define
class SignIn:
    """The key to sign in with (or send it as a bearer token instead)."""

    key: str | None = None


@post("/api/session", access="session", summary="Exchange a key for a session cookie and a CSRF token",
      body=SignIn, body_required=False,
      errors={400: "Open mode: no key is configured, so there is nothing to sign in to",
              401: "No key sent, or a key that does not verify"})
async def sign_in(request: Request) -> Response:
    k = kernel_of(request)
    if not k.auth_required():
        raise LocalmError(400, "No API key is configured: there is nothing to sign in to")
    body = await json_body(request, empty=None, require_object=False)
    key = body.get("key") if isinstance(body, dict) else None
    if key is None:
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            key = auth[7:].strip()
    if not isinstance(key, str) or not key:
        raise LocalmError(401, "Send a key as {\"key\": ...} or as a bearer token")
    principal = k.keys.verify(key)
    if principal is None:
        raise LocalmError(401, "Invalid API key")
    sid, csrf = k.sessions.create(principal)
    response = Response({"authed": True, "scopes": sorted(principal.scopes), "csrf": csrf})
    response.set_cookie(_session_cookie(sid, max_age=SESSION_TTL, secure=_https(request)))
    return response


@post("/api/session/logout", access="session", summary="Sign this browser out")
async def sign_out(request: Request) -> Response:
    k = kernel_of(request)
    warnings: list[str] = []
    sid = _cookie(request.scope, COOKIE)
    if sid:
        found = k.sessions.lookup(sid)
        if found is not None:
            if not k.sessions.csrf_ok(found[1], request.headers.get("x-csrf-token")):
                raise LocalmError(403, "Missing or invalid CSRF token (send X-CSRF-Token)")
            try:
                k.sessions.drop(sid)
            except (OSError, LocalmError):
                warnings.append("this session's server-side record (it could not be removed)")
    response = Response({"authed": False, "warnings": warnings})
    response.set_cookie(_session_cookie("", max_age=0, secure=_https(request)))
    return response


@get("/whoami", access="public", summary="Who this caller is to the server: its key, scopes and whether a key is needed")
async def whoami(request: Request) -> dict[str, Any]:
    """Public, so a client can tell a wrong key from a missing scope: it never refuses, and an
    unknown or absent credential is ``anonymous`` (or, in open mode, ``open``/``web``)."""
    k = kernel_of(request)
    caller = principal_of(request)
    authed = caller.authenticated
    return {"kind": caller.kind, "authed": authed, "owner": caller.is_owner and caller.kind != "open",
            "key_id": caller.key_id if authed else None, "name": caller.name if authed else None,
            "scopes": sorted(caller.scopes) if authed else [], "via_cookie": caller.via_cookie,
            "fs_access": caller.fs_access if caller.kind == "key" else None,
            "rag_roots": list(caller.rag_roots) if caller.kind == "key" else None,
            "required": k.auth_required()}


def _log_owner(request: Request) -> str | None:
    """Whose turns this caller reads and clears: everyone's for the owner (None), else its own."""
    caller = principal_of(request)
    return None if caller.is_owner or caller.kind == "open" else caller.owner_tag


@get("/api/session/log", scope=None, summary="Chat turns in the session log, newest first (the owner's: all; a key's: its own)",
     errors={400: "limit or before that is not a positive integer",
             409: "The session log cannot be read (session_log_unreadable)"})
async def read_log(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    query = request.query_params
    numbers = {}
    for name, default in (("limit", 100), ("before", None)):
        raw = query.get(name)
        if raw is None:
            numbers[name] = default
            continue
        if not raw.isdigit() or int(raw) < 1:
            raise LocalmError(400, f"{name} must be a positive integer", code="invalid_parameter")
        numbers[name] = int(raw)
    turns = await asyncio.to_thread(k.session_log.turns, owner=_log_owner(request), limit=numbers["limit"],
                                    before=numbers["before"])
    return {"mode": k.config.get("session_mode"), "turns": turns}


@delete("/api/session/log", scope=None, summary="Clear the session log (the owner's: every turn; a key's: its own)",
        errors={409: "The session log cannot be written (session_log_unreadable)"})
async def clear_log(request: Request) -> dict[str, Any]:
    k = kernel_of(request)
    gone = await asyncio.to_thread(k.session_log.clear, owner=_log_owner(request))
    return {"cleared": gone}


ROUTES = [read_session, sign_in, sign_out, whoami, read_log, clear_log]
