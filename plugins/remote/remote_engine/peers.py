"""Using a model another localm instance on this machine has loaded (peer routes).

- ``GET /v1/models/{model}/peer-offer``: asks every live instance in the machine's instance
  registry (``host.instances``) for its status, with a vouch and a nonce; an instance whose
  proof does not verify is skipped. A loaded model matches by its file: the same path, the same
  sha256, or the same file name and size (an instance that reports only a name matches by name).
- ``POST /v1/models/{model}/peer-route``: checks the offer again, then the key against that
  instance (its ``GET /api/session``, with ``X-Localm-Session-Mode``: a refused key is a 403
  and nothing is stored), and the session-mode agreement, then stores the route in memory:
  the model manager's ``forward`` answers the model with a :class:`PeerEngine`.
- :class:`PeerEngine` is the remote engine pointed at that instance (its own name for the
  model, the key accepted), so every surface forwards, streamed or not, and a client that
  leaves closes the stream there. Every forwarded request carries X-Localm-Session-Mode. An
  instance that had no key, or was given its owner key, honours that header, so nothing more
  is asked; with any other key the session mode is checked again before each request: a
  disagreement is a 409 naming the instance and its mode (nothing sent, the route stays); no
  answer or a refused key drops the route, and that request is a 502 naming the instance.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from typing import Any

import httpx

from localm import sdk

from . import RemoteEngine, wire

MODES = ("none", "metadata", "full")
HEADER = "X-Localm-Session-Mode"
#: Seconds a whole offer lookup, or a route's checks, may take (then 504).
LOOKUP_TIMEOUT = 5.0
#: Seconds one instance may take to answer one check.
CHECK_TIMEOUT = 3.0


def _rank(mode: Any) -> int:
    return MODES.index(mode) if mode in MODES else 0


def identity(entry: Any) -> dict[str, Any]:
    """A registry entry's file identity: resolved path, sha256, file name, size."""
    out: dict[str, Any] = {"path": None, "sha256": getattr(entry, "sha256", None) or None, "file": None,
                           "size_bytes": getattr(entry, "size_bytes", 0) or None}
    path = str(getattr(entry, "path", "") or "")
    if path and "://" not in path:  # weights on this machine (not an upstream's URL)
        try:
            resolved = Path(path).resolve()
            if not resolved.exists():
                return out
            out["path"], out["file"] = str(resolved), resolved.name
            if not out["size_bytes"] and resolved.is_file():
                out["size_bytes"] = os.path.getsize(resolved)
        except OSError:
            pass
    return out


def matches(mine: dict[str, Any], theirs: dict[str, Any], my_name: str) -> bool:
    """Whether a model another instance reports is this entry's file (see the module's docstring)."""
    if not any(theirs.get(k) for k in ("path", "sha256", "file")):  # it reports a name only
        return theirs.get("model") == my_name
    if mine.get("path") and theirs.get("path") == mine["path"]:
        return True
    if mine.get("sha256") and theirs.get("sha256") == mine["sha256"]:
        return True
    return bool(mine.get("file") and mine.get("size_bytes") and theirs.get("file") == mine["file"]
                and theirs.get("size_bytes") == mine["size_bytes"])


async def ask_status(host: Any, peer: Any) -> dict[str, Any] | None:
    """A live instance's verified status, or None (no answer, a refusal, a proof that fails)."""
    nonce = secrets.token_hex(16)
    path = f"/v1/instances/status?nonce={nonce}"
    headers = host.instances.vouch_headers(peer.instance_id, "GET", path)
    try:
        async with httpx.AsyncClient(timeout=CHECK_TIMEOUT, verify=False) as client:  # noqa: S501 - loopback, proof-checked
            answer = await client.get(peer.base + path, headers=headers)
        data = answer.json() if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("instance_id") != peer.instance_id:
        return None
    if not host.instances.check_proof(peer, nonce, data.get("proof")):
        return None
    return data


async def find_offer(host: Any, entry: Any) -> tuple[Any, dict[str, Any], dict[str, Any]] | None:
    """(peer, its status, its loaded model) for the first live instance with ``entry``'s file loaded."""
    mine = identity(entry)
    peers = await host.instances.others()
    statuses = await asyncio.gather(*(ask_status(host, p) for p in peers))
    for peer, status in zip(peers, statuses):
        if status is None:
            continue
        for model in status.get("models") or []:
            if isinstance(model, dict) and model.get("role", "chat") == "chat" and matches(mine, model, entry.id):
                return peer, status, model
    return None


def _entry(host: Any, model: str) -> Any:
    try:
        return host.models.resolve(model)
    except sdk.LocalmError as exc:
        if exc.status == 404:
            raise sdk.LocalmError(400, f"No model {model} to route: it is not registered here",
                                  code="model_not_found") from None
        raise


async def peer_offer(host: Any, model: str) -> dict[str, Any]:
    """GET /v1/models/{model}/peer-offer."""
    entry = _entry(host, model)
    try:
        found = await asyncio.wait_for(find_offer(host, entry), LOOKUP_TIMEOUT)
    except asyncio.TimeoutError:
        raise sdk.LocalmError(504, "Looking for another instance with this model took too long",
                              code="peer_timeout") from None
    if found is None:
        return {"available": False, "peer": None}
    peer, status, theirs = found
    return {"available": True, "peer": {**peer.public(), "model": theirs["model"],
                                        "requires_key": bool(status.get("requires_key"))}}


class RouteBody(sdk.Struct, forbid_unknown_fields=True):
    """The offer to accept: the instance, and its API key (empty when it has none)."""

    instance_id: str
    api_key: str = ""


def _route_body(raw: Any) -> RouteBody:
    if not isinstance(raw, dict):
        raise sdk.LocalmError(400, "The body must be a JSON object")
    unknown = sorted(set(raw) - {"instance_id", "api_key"})
    if unknown:
        raise sdk.LocalmError(400, f"Unknown field {unknown[0]!r}: this route reads instance_id and api_key",
                              code="unknown_field", field=unknown[0])
    if "instance_id" not in raw:
        raise sdk.LocalmError(422, "instance_id is required", field="instance_id")
    for name in ("instance_id", "api_key"):
        if name in raw and not isinstance(raw[name], str):
            raise sdk.LocalmError(422, f"{name} must be a string", field=name)
    return RouteBody(instance_id=raw["instance_id"], api_key=raw.get("api_key") or "")


async def check_session(base: str, key: str, mode: str, *, client: Any = None) -> dict[str, Any]:
    """What the instance at ``base`` says of ``key`` and of the mode it records at, asked to
    record no more than ``mode`` (GET /api/session). Raises httpx errors."""
    headers = {HEADER: mode, **({"Authorization": f"Bearer {key}"} if key else {})}
    if client is None:
        async with httpx.AsyncClient(timeout=CHECK_TIMEOUT, verify=False) as fresh:  # noqa: S501 - loopback
            answer = await fresh.get(base + "/api/session", headers=headers)
    else:
        answer = await client.get(base + "/api/session", headers=headers, timeout=CHECK_TIMEOUT)
    answer.raise_for_status()
    data = answer.json()
    if not isinstance(data, dict):
        raise httpx.HTTPError("no session object")
    return data


async def is_owner(base: str, key: str) -> bool:
    """Whether ``key`` is the owner key of the instance at ``base`` (GET /whoami); False when
    it cannot tell."""
    if not key:
        return False
    try:
        async with httpx.AsyncClient(timeout=CHECK_TIMEOUT, verify=False) as client:  # noqa: S501 - loopback
            answer = await client.get(base + "/whoami", headers={"Authorization": f"Bearer {key}"})
        return answer.status_code == 200 and answer.json().get("owner") is True
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def key_refused(session: dict[str, Any]) -> bool:
    return bool(session.get("required")) and not session.get("authed")


def disagrees(mine: str, session: dict[str, Any]) -> bool:
    """Whether the instance records more than ``mine`` allows (full here: anything goes)."""
    return mine != "full" and _rank(session.get("session_mode", "full")) > _rank(mine)


async def peer_route(host: Any, model: str, body: Any) -> dict[str, Any]:
    """POST /v1/models/{model}/peer-route (``body``: the parsed JSON object)."""
    data = _route_body(body)
    if not data.instance_id.strip():
        raise sdk.LocalmError(400, "instance_id must not be empty", field="instance_id")
    entry = _entry(host, model)
    try:
        return await asyncio.wait_for(_accept(host, entry, data), LOOKUP_TIMEOUT * 2)
    except asyncio.TimeoutError:
        raise sdk.LocalmError(504, f"Checking instance {data.instance_id} took too long",
                              code="peer_timeout") from None


async def _accept(host: Any, entry: Any, data: RouteBody) -> dict[str, Any]:
    wanted = data.instance_id.strip()
    peer = next((p for p in await host.instances.others() if p.instance_id == wanted), None)
    if peer is None:
        raise sdk.LocalmError(409, f"Instance {wanted} is not a live localm instance on this machine's loopback",
                              code="peer_not_live")
    status = await ask_status(host, peer)
    if status is None:
        raise sdk.LocalmError(409, f"Instance {wanted} did not prove its identity", code="peer_not_live")
    mine = identity(entry)
    theirs = next((m for m in status.get("models") or [] if isinstance(m, dict) and matches(mine, m, entry.id)), None)
    if theirs is None:
        raise sdk.LocalmError(409, f"Instance {wanted} no longer has {entry.id} loaded", code="peer_model_gone")
    mode = host.setting("session_mode") or "none"
    try:
        session = await check_session(peer.base, data.api_key, mode)
    except (httpx.HTTPError, ValueError):
        raise sdk.LocalmError(403, f"Instance {wanted} did not answer the key check", code="peer_key_refused") from None
    if key_refused(session):
        raise sdk.LocalmError(403, f"Instance {wanted} refused the key", code="peer_key_refused")
    if disagrees(mode, session):
        raise sdk.LocalmError(409, f"Instance {wanted} records chats in {session.get('session_mode')} mode, more than "
                                   f"this instance's {mode} allows", code="session_mode_disagrees")
    info = {"model": entry.id, "peer": {**peer.public(), "model": entry.id, "peer_model": theirs["model"]}}
    settings = host.settings("remote")
    honoured = not session.get("required") or await is_owner(peer.base, data.api_key)
    engine = PeerEngine(host, entry, peer, theirs, data.api_key, settings, honoured=honoured)
    host.models.forward(entry.id, engine, info, plugin="remote")
    return {"status": "routed", **info}


async def peer_unroute(host: Any, model: str) -> dict[str, Any]:
    """DELETE /v1/models/{model}/peer-route."""
    entry = _entry(host, model)
    return {"status": "unrouted", "model": entry.id, "was_routed": host.models.unforward(entry.id)}


class _PeerEntry:
    """What the remote engine reads of an entry, for a peer's model."""

    def __init__(self, entry: Any, peer: Any, theirs: dict[str, Any]) -> None:
        self.id = entry.id
        self.path = peer.base + "/v1"
        self.capabilities = {"upstream": peer.base + "/v1", "upstream_model": theirs["model"],
                             "upstream_kind": "localm", "context_window": theirs.get("context_window") or 0}


class PeerEngine(RemoteEngine):
    """The remote engine, pointed at another localm instance (see the module's docstring)."""

    engine = "peer"

    def __init__(self, host: Any, entry: Any, peer: Any, theirs: dict[str, Any], key: str,
                 settings: dict[str, Any], *, honoured: bool = False) -> None:
        self._host = host
        self.peer = peer
        #: the peer lowers its mode to the X-Localm-Session-Mode every forwarded request carries:
        #: it had no key, or the key is its owner's (a key it stops taking ends the route)
        self.honoured = honoured
        self._mode = host.setting("session_mode") or "none"
        super().__init__(_PeerEntry(entry, peer, theirs), settings, key or None)
        self._set_mode(self._mode)

    def _set_mode(self, mode: str) -> None:
        """Every forwarded request carries X-Localm-Session-Mode: this instance's mode."""
        self._mode = mode
        headers = {**({"Authorization": f"Bearer {self._key}"} if self._key else {}), HEADER: mode}
        self._client.headers.update(headers)
        if self._wire is not None:
            self._wire.close()
            self._wire = wire.Upstream(self.base, headers=headers,
                                       connect_timeout=float(self._settings.get("connect_timeout_s", 5.0)),
                                       timeout=float(self._settings.get("timeout_s", 300.0)))

    def _drop(self, why: str) -> sdk.LocalmError:
        self._host.models.unforward(self.id)
        return sdk.LocalmError(502, f"{self.id}: instance {self.peer.instance_id} ({self.peer.base}) {why}; its "
                                    "route is dropped and the next request loads the model here",
                               code="peer_unreachable")

    async def agree(self) -> None:
        """The session-mode check before a forwarded request (see the module's docstring)."""
        mode = self._host.setting("session_mode") or "none"
        if mode != self._mode:
            self._set_mode(mode)
        if mode == "full":  # nothing to agree on; a peer gone or a key refused shows on the request itself
            return
        if self.honoured:  # the request's own header holds the peer to this mode (the spec's owner/no-key rule)
            return
        try:
            session = await check_session(self.base[:-3], self._key or "", mode, client=self._client)
        except (httpx.HTTPError, ValueError) as exc:
            raise self._drop(f"did not answer ({type(exc).__name__})") from None
        if key_refused(session):
            raise self._drop("refused the key it was given")
        if disagrees(mode, session):
            raise sdk.LocalmError(409, f"{self.id}: instance {self.peer.instance_id} records chats in "
                                       f"{session.get('session_mode')} mode, more than this instance's {mode} "
                                       "allows; nothing was sent", code="session_mode_disagrees")

    async def generate(self, request: Any) -> Any:
        await self.agree()
        try:
            async for event in super().generate(request):
                yield event
        except sdk.LocalmError as exc:
            if exc.code == "upstream_unreachable" or exc.status in (401, 403):
                raise self._drop("stopped answering" if exc.status == 502 else "refused the key it was given") from None
            raise


class PeerService:
    """The ``peers`` service: what the /v1/models/{model}/peer-offer and /peer-route routes do
    (they live with GET /v1/models/{id}, whose path they extend, in the openai plugin)."""

    def __init__(self, host: Any) -> None:
        self._host = host

    async def offer(self, model: str) -> dict[str, Any]:
        return await peer_offer(self._host, model)

    async def route(self, model: str, body: Any) -> dict[str, Any]:
        return await peer_route(self._host, model, body)

    async def unroute(self, model: str) -> dict[str, Any]:
        return await peer_unroute(self._host, model)


@sdk.hookimpl
def startup(host, plugin):
    host.provide("peers", PeerService(host), plugin=plugin.name)
