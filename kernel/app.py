"""The HTTP app: an outer ASGI callable that swaps in a freshly built Litestar app
whenever the set of active plugins changes, plus the guard every route passes.

Enabling a plugin mounts its routes without a restart (a new Litestar app is built and
swapped in; requests already running finish on the old one). A disabled plugin's
routes are simply absent, so they answer 404.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import time
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

from litestar import Litestar, Request, Response, Router
from litestar.exceptions import HTTPException, ValidationException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import ScalarRenderPlugin
from litestar.routes import HTTPRoute

from . import __version__, limits, logs
from .auth import ANONYMOUS, OPEN, WEB, Principal
from .errors import LocalmError
from .limits import LimitedRequest, too_large
from .openapi import DescribedJson
from .sessions import COOKIE

if TYPE_CHECKING:
    from .runtime import Kernel

log = logging.getLogger("localm")

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_MODE_REFUSAL = "Open-mode management requires the localm GUI shell on this machine, or an API key"
ATTACH = Principal(kind="attach", scopes=frozenset({"admin"}), name="attach token")


def principal_of(request: Request) -> Principal:
    """The caller of this request, as the guard identified them."""
    return request.scope.get("localm_principal", ANONYMOUS)  # type: ignore[return-value]


@functools.lru_cache(maxsize=256)
def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def localhost_origin(origin: str) -> bool:
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and is_loopback(parts.hostname)


#: Names that always reach this machine from itself, whatever the bind address.
LOCAL_NAMES = frozenset({"localhost", "host.docker.internal"})


def host_name(host: str) -> str:
    """The name in a Host header, lower case, without its port, trailing dot or an IPv6
    literal's brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    return (host.rsplit(":", 1)[0] if host.count(":") == 1 else host).rstrip(".")


@functools.lru_cache(maxsize=256)
def local_host(name: str) -> bool:
    """An address (no page's own name can be rebound to one) or a name that is always this
    machine (localhost, *.localhost, host.docker.internal)."""
    if name in LOCAL_NAMES or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _cookie(scope: dict[str, Any], name: str) -> str | None:
    raw = _header(scope, b"cookie")
    if not raw:
        return None
    for part in raw.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


class Guard:
    """Authentication, scopes, open mode's gate, CORS and CSRF for one route call."""

    def __init__(self, kernel: "Kernel", policy: dict[tuple[str, str], dict[str, Any]]) -> None:
        self.kernel = kernel
        self.policy = policy
        self.rates: limits.RateLimiter = getattr(kernel, "rates", None) or limits.RateLimiter()
        kernel.rates = self.rates  # one count across app rebuilds (a plugin enabled or disabled)

    def __call__(self, app: Any) -> Any:
        async def guard(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] in ("http", "websocket") and self.check(scope):
                await self._preflight(scope, send)
                return
            opt = scope["route_handler"].opt
            if scope["type"] == "http" and opt.get("cancel_on_disconnect", opt.get("access") == "inference"):
                await until_disconnect(app, scope, receive, send)
                return
            await app(scope, receive, send)
        return guard

    def check(self, scope: dict[str, Any]) -> bool:
        """Identify and authorise the caller; True when this is a CORS preflight to answer."""
        opt = scope["route_handler"].opt
        method = scope.get("method", "GET")  # a websocket handshake is a GET
        requested = _header(scope, b"access-control-request-method")
        preflight = method == "OPTIONS" and requested is not None
        if preflight:
            opt = self.policy.get((scope.get("path_template", ""), requested.upper()), opt)
        access = opt.get("access", "managed")
        self.check_host(scope)
        origin = _header(scope, b"origin")
        cross = origin is not None and not self._same_origin(scope, origin)
        trusted = not cross
        if cross:
            assert origin is not None
            trusted = localhost_origin(origin) or origin in self.kernel.cors_origins()
            if (access == "inference" and opt.get("web", True)) or trusted:
                scope["localm_cors"] = origin
                scope["localm_cors_credentials"] = trusted
            elif not (access == "public" and method in ("GET", "HEAD")):
                raise LocalmError(403, f"Cross-origin request refused: {origin} is not an allowed origin "
                                       "(the owner can add it to cors_origins)")
        if preflight:
            return True
        principal = self.identify(scope, opt, method, trusted=trusted)
        scope["localm_principal"] = principal
        if opt.get("expensive", access == "inference"):
            per_minute = int(self.kernel.config.get("expensive_requests_per_minute") or 0)
            if per_minute:
                client = scope.get("client")
                self.rates.check(limits.caller_id(principal, client[0] if client else None), per_minute)
        return False

    def check_host(self, scope: dict[str, Any]) -> None:
        """Refuse a Host this server does not answer to: a page whose own name resolves to this
        machine (DNS rebinding) reaches nothing, and cannot pass for one of this server's pages."""
        host = _header(scope, b"host")
        if host is None:
            return
        name = host_name(host)
        if local_host(name):
            return
        allowed = self.kernel.allowed_hosts()
        if name in allowed or "*" in allowed:
            return
        raise LocalmError(403, f"Host not allowed: {name} is not a name this server answers to "
                               "(the owner can add it to allowed_hosts)", code="host_not_allowed")

    @staticmethod
    def _same_origin(scope: dict[str, Any], origin: str) -> bool:
        """The page is one of this server's own (its Host was checked before this is asked)."""
        host = _header(scope, b"host")
        return host is not None and origin in (f"http://{host}", f"https://{host}")

    def identify(self, scope: dict[str, Any], opt: dict[str, Any], method: str, *, trusted: bool) -> Principal:
        """Who is calling. ``trusted``: no Origin, this server's own page, a local page or a
        cors_origins entry. Any other page's cookie is not taken for its user's, and in open
        mode such a page is ``web`` (inference only)."""
        k = self.kernel
        access = opt.get("access", "managed")
        required = opt.get("scope")
        auth = _header(scope, b"authorization")
        bearer = None
        if auth:
            kind, _, value = auth.partition(" ")
            if kind.lower() == "bearer":
                bearer = value.strip()
        if bearer is None and access != "session":  # Anthropic clients send their key so; the bearer wins
            bearer = _header(scope, b"x-api-key")
        client = scope.get("client")
        attach = bool(bearer) and is_loopback(client[0] if client else None) and k.check_attach_token(bearer)
        keyed = k.auth_required()

        if access == "public" or (access == "session" and keyed):
            return self._soft_identify(bearer, attach and trusted, scope, keyed, trusted)
        if keyed:
            if bearer:
                if attach:
                    principal = ATTACH
                else:
                    found = k.keys.verify(bearer)
                    if found is None:
                        raise LocalmError(401, "Invalid API key", headers={"WWW-Authenticate": "Bearer"})
                    principal = found
            else:
                sid = _cookie(scope, COOKIE) if trusted else None
                session = k.sessions.lookup(sid) if sid else None
                if session is None:
                    detail = "Session expired or signed out; sign in again" if sid else "Missing API key"
                    raise LocalmError(401, detail, headers={"WWW-Authenticate": "Bearer"})
                principal, csrf = session
                if method not in SAFE_METHODS and not k.sessions.csrf_ok(csrf, _header(scope, b"x-csrf-token")):
                    raise LocalmError(403, "Missing or invalid CSRF token (send X-CSRF-Token from POST /api/session)")
            if not principal.has(required):
                raise LocalmError(403, f"Key lacks required scope: {required or 'a valid key'}")
            return principal
        # open mode: no key exists
        if attach and trusted:
            return ATTACH
        if access in ("inference", "open_read"):
            return OPEN if trusted else WEB
        path = scope["path"]
        gated = (method not in SAFE_METHODS or path.startswith(("/api/", "/v1/")) or opt.get("gate")
                 or access == "session")
        if access == "session" and method in SAFE_METHODS:
            gated = False
        if gated:
            raise LocalmError(403, OPEN_MODE_REFUSAL)
        return OPEN

    def _soft_identify(self, bearer: str | None, attach: bool, scope: dict[str, Any], keyed: bool,
                       trusted: bool) -> Principal:
        """Who is calling a public route, if they say; never refuses."""
        if attach:
            return ATTACH
        if bearer:
            try:
                found = self.kernel.keys.verify(bearer)
            except LocalmError:
                found = None
            if found is not None:
                return found
        sid = _cookie(scope, COOKIE) if trusted else None
        if sid:
            session = self.kernel.sessions.lookup(sid)
            if session is not None:
                return session[0]
        return ANONYMOUS if keyed else OPEN if trusted else WEB

    async def _preflight(self, scope: dict[str, Any], send: Any) -> None:
        requested_headers = _header(scope, b"access-control-request-headers") or ""
        # the allowed origin itself is added by KernelASGI, as on every answer
        headers = [
            (b"access-control-allow-methods", b"GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS"),
            (b"access-control-allow-headers", requested_headers.encode("latin-1") or b"*"),
            (b"access-control-max-age", b"600"),
            (b"content-length", b"0"),
        ]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})


async def until_disconnect(app: Any, scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Run ``app`` for one request, and cancel it when the client goes away before the answer
    has been sent: the work a client no longer waits for (a whole reply being generated, an
    embedding, a transcription) stops at its next await, as a stream's does.

    Once the body has been read, one watcher waits for the disconnect; the app's own later
    ``receive()`` calls (a stream listening for the client leaving) hear it from the watcher."""
    left = asyncio.Event()
    read = asyncio.Event()
    sent = False

    async def app_receive() -> dict[str, Any]:
        if read.is_set():
            await left.wait()
            return {"type": "http.disconnect"}
        message = await receive()
        if message["type"] == "http.disconnect":
            left.set()
            read.set()
        elif not message.get("more_body", False):
            read.set()
        return message

    async def app_send(message: dict[str, Any]) -> None:
        nonlocal sent
        await send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            sent = True

    task = asyncio.ensure_future(app(scope, app_receive, app_send))

    async def watch() -> None:
        await read.wait()
        while not left.is_set():
            message = await receive()
            if message["type"] == "http.disconnect":
                left.set()
        if not sent and not task.done():
            task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        await task
    except asyncio.CancelledError:
        if not left.is_set():
            raise  # the server is cancelling this request, not the client
        log.debug("%s %s: the client went away; its request was cancelled", scope.get("method"), scope.get("path"))
    finally:
        watcher.cancel()


# --- errors ----------------------------------------------------------------------

ErrorRenderer = Callable[[int, str, "str | None", dict[str, Any]], Response]


def default_error(status: int, detail: str, code: str | None, extra: dict[str, Any]) -> Response:
    body: dict[str, Any] = {"detail": detail}
    if code:
        body["code"] = code
    body.update(extra)
    return Response(body, status_code=status)


def make_exception_handler(kernel: "Kernel") -> Callable[[Request, Exception], Response]:
    def handle(request: Request, exc: Exception) -> Response:
        headers: dict[str, str] = {}
        extra: dict[str, Any] = {}
        code = None
        if isinstance(exc, RequestEntityTooLarge):
            exc = too_large(_body_limit(request))
        if isinstance(exc, LocalmError):
            status, detail, code, headers, extra = exc.status, exc.detail, exc.code, exc.headers, exc.extra
        elif isinstance(exc, ValidationException):
            errors = [e for e in (exc.extra or []) if isinstance(e, dict)] if isinstance(exc.extra, list) else []
            sentences = [f"{e.get('key') or 'body'}: {e.get('message')}" for e in errors]
            status, detail = 422, (". ".join(sentences) or str(exc.detail) or "Invalid request body")
            extra = {"errors": errors}
        elif isinstance(exc, HTTPException):
            status, detail = exc.status_code, str(exc.detail)
            headers = dict(exc.headers or {})
        else:
            log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
            status, detail = 500, "Internal server error"
        family = None
        try:
            family = request.route_handler.opt.get("error_family")
        except Exception:
            family = None
        renderer = kernel.error_renderers.get(family or "", default_error)
        try:
            response = renderer(status, detail, code, extra)
        except Exception:
            log.exception("error renderer %s failed", family)
            response = default_error(status, detail, code, extra)
        for key, value in headers.items():
            response.headers[key] = value
        logs.annotate(request, code=code or _error_type(response))
        return response
    return handle


def _error_type(response: Response) -> str | None:
    """The kind of error an OpenAI or Anthropic error body names (``error.type``, such as
    invalid_request_error) when the error has no code of its own."""
    error = response.content.get("error") if isinstance(response.content, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) else None


def _body_limit(request: Request) -> int | None:
    try:
        return request.route_handler.resolve_request_max_body_size()
    except Exception:
        return None


# --- building ----------------------------------------------------------------------

def route_pairs(value: Any) -> list[tuple[str, str]]:
    """The (path, method) pairs a handler or router would mount."""
    if isinstance(value, HTTPRouteHandler):
        return [(path, method) for path in value.paths for method in value.http_methods]
    if isinstance(value, Router):
        return [(path, method) for path, methods in value.route_handler_method_map.items() for method in methods]
    paths = getattr(value, "paths", None)
    return [(p, "*") for p in paths] if paths else []


def build_litestar(kernel: "Kernel", kernel_routes: list[Any], plugin_routers: list[Router]) -> Litestar:
    policy: dict[tuple[str, str], dict[str, Any]] = {}
    app = Litestar(
        route_handlers=[Router("/", route_handlers=kernel_routes), *plugin_routers],
        middleware=[Guard(kernel, policy)],
        exception_handlers={Exception: make_exception_handler(kernel)},
        request_class=LimitedRequest,
        request_max_body_size=int(kernel.config.get("max_body_bytes")),
        openapi_config=OpenAPIConfig(title="localm", version=__version__, path="/openapi",
                                     render_plugins=[ScalarRenderPlugin(), DescribedJson()]),
        logging_config=None,
        debug=False,
    )
    for r in app.routes:
        if isinstance(r, HTTPRoute):
            for handler in r.route_handlers:
                for method in handler.http_methods:
                    policy[(r.path, method)] = handler.opt
    app.state.kernel = kernel
    return app


class KernelASGI:
    """The ASGI app uvicorn serves: lifespan, metrics, the request log, CORS headers, then the current
    Litestar app."""

    def __init__(self, kernel: "Kernel") -> None:
        self.kernel = kernel
        self.app: Litestar | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        app = self.app
        if scope["type"] != "http":
            if app is not None:
                await app(scope, receive, send)
            return
        line, token = logs.begin(scope)

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                line.status = 499 if line.left else message["status"]  # an answer nobody hears
                origin = scope.get("localm_cors")
                if origin:
                    cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
                    if scope.get("localm_cors_credentials"):  # cookies only for the owner's own pages
                        cors.append((b"access-control-allow-credentials", b"true"))
                    message["headers"] = [*message.get("headers", []), *cors]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                line.ended = True

        async def receive_wrapper() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.disconnect" and not line.ended:
                line.left = True
            return message

        metrics = self.kernel.metrics
        if metrics is not None:
            metrics.in_flight += 1
        try:
            if app is None:
                await _plain(send_wrapper, 503, b'{"detail":"Server is starting"}')
            else:
                await app(scope, receive_wrapper, send_wrapper)
        except Exception:
            line.failed = True
            raise
        finally:
            logs.end(token)
            if metrics is not None:
                metrics.in_flight -= 1
                metrics.observe_request(scope["method"], scope.get("path_template") or "other", line.final_status,
                                        time.perf_counter() - line.started)
            line.write()

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.kernel.start()
                except Exception as exc:
                    log.exception("startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await self.kernel.stop()
                finally:
                    await send({"type": "lifespan.shutdown.complete"})
                return


async def _plain(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
