"""Route decorators that carry localm's access rules.

Every route says who may call it, in its ``opt``:

- ``scope``: the scope a key needs (``None``: any valid key). A plugin's routes
  default to the plugin's primary scope.
- ``access``: ``"managed"`` (default: a key once keys exist, the attach token in open
  mode), ``"public"`` (no credential ever), ``"inference"`` (a key once keys exist,
  nothing in open mode, and a cross-origin call from any local app is accepted), or
  ``"open_read"`` (like managed, but open mode needs no attach token), or ``"session"``
  (public once keys exist; in open mode only its GET is exempt from the attach token).
- ``gate``: True makes open mode demand the attach token even for a GET outside /api and /v1.
- ``web``: False keeps an inference route from web pages of other origins (a local page, a
  ``cors_origins`` entry and programs still reach it): for a route that serves the owner's
  data rather than inference. In open mode the pages it admits call as ``web``.
- ``cancel_on_disconnect``: whether the handler is cancelled when its client goes away
  before the answer is sent (default: True for inference routes, whose work nobody else
  waits for; a management route finishes what it started).
- ``error_family``: which renderer shapes its errors (``"openai"``, ``"ollama"``, ...).

And what the OpenAPI document says of it (kernel/openapi.py): ``body`` (the model of the
JSON body the route reads itself; ``body_required=False`` when it may be left out),
``errors`` (``{status: "when it is answered"}``) and ``params`` (JSON schema keywords a
path or query parameter's schema gains, such as ``{"name": {"pattern": "...", "maxLength":
63}}``: the bounds the route checks itself, with its own status and message), and ``subpaths``
(``{path: summary}``: paths a ``{name:path}`` parameter takes that the handler answers as routes
of their own, each documented as its own operation).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import litestar

ACCESS = ("managed", "public", "inference", "open_read", "session")
_UNSET: Any = object()


def _opt(scope: Any, access: str, error_family: str | None, opt: dict[str, Any] | None,
         kwargs: dict[str, Any]) -> dict[str, Any]:
    if access not in ACCESS:
        raise ValueError(f"access must be one of {ACCESS}")
    out = dict(opt or {})
    for key in ("body", "body_required", "errors", "params", "expensive", "web", "cancel_on_disconnect", "subpaths"):
        if key in kwargs:
            out[key] = kwargs.pop(key)
    if scope is not _UNSET:
        out["scope"] = scope
    out["access"] = access
    if error_family:
        out["error_family"] = error_family
    return out


def _decorate(decorator: Callable[..., Any], path: Any, opt: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    def wrap(fn: Callable[..., Any]) -> Any:
        if not inspect.iscoroutinefunction(fn):
            kwargs.setdefault("sync_to_thread", True)  # a plain function never blocks the event loop
        return decorator(path, opt=opt, **kwargs)(fn)
    return wrap


def _make(decorator: Callable[..., Any]) -> Callable[..., Any]:
    def route(path: str | list[str], *, scope: str | None = _UNSET, access: str = "managed",
              error_family: str | None = None, opt: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        if decorator in (litestar.post, litestar.put, litestar.delete):
            kwargs.setdefault("status_code", 200)  # the spec answers 200 unless a route says otherwise
        return _decorate(decorator, path, _opt(scope, access, error_family, opt, kwargs), kwargs)
    route.__name__ = decorator.__name__
    route.__doc__ = (f"``@{decorator.__name__}(path, scope=..., access=...)``: a Litestar "
                     f"{decorator.__name__.upper()} route with localm's access rules.")
    return route


get = _make(litestar.get)
post = _make(litestar.post)
put = _make(litestar.put)
patch = _make(litestar.patch)
delete = _make(litestar.delete)
head = _make(litestar.head)


def route(path: str | list[str], *, http_method: Any, scope: str | None = _UNSET, access: str = "managed",
          error_family: str | None = None, opt: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """A route answering several methods (``http_method=["GET", "HEAD"]``)."""
    kwargs["http_method"] = http_method
    return _decorate(litestar.route, path, _opt(scope, access, error_family, opt, kwargs), kwargs)
