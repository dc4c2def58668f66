"""Calling a Function's handlers as Open WebUI does, more safely.

A handler gets its payload by keyword (``body``, or ``event`` for ``stream``) plus only the
reserved arguments its signature names (``__user__``, ``__event_emitter__`` ...); one it
requires that localm cannot give gets None, never a TypeError. ``**kwargs`` gets nothing.

Sync handlers run in a worker thread (Open WebUI runs them on its event loop, where a
``time.sleep`` or a ``requests`` call stops the server); async ones are awaited; an async
generator is returned to be iterated.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable

_PLANS: dict[Any, tuple[tuple[str, bool], ...]] = {}


def _plan(handler: Callable[..., Any], payload: str) -> tuple[tuple[str, bool], ...]:
    """(name, required) of each keyword argument besides the payload, cached per function."""
    key = getattr(handler, "__func__", handler)
    plan = _PLANS.get(key)
    if plan is None:
        out = []
        for name, p in inspect.signature(handler).parameters.items():
            if name == payload or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
                continue
            out.append((name, p.default is p.empty))
        plan = _PLANS[key] = tuple(out)
    return plan


def arguments(handler: Callable[..., Any], payload: str, value: Any, extras: dict[str, Any]) -> dict[str, Any]:
    params = {payload: value}
    for name, required in _plan(handler, payload):
        if name in extras:
            params[name] = extras[name]
        elif required:
            params[name] = None
    return params


async def call(handler: Callable[..., Any], payload: str, value: Any, extras: dict[str, Any]) -> Any:
    """Call ``handler``; what it returns (an async generator is returned, not iterated)."""
    params = arguments(handler, payload, value, extras)
    target = getattr(handler, "__func__", handler)
    if inspect.isasyncgenfunction(target):
        return handler(**params)
    if inspect.iscoroutinefunction(target):
        return await handler(**params)
    result = await asyncio.to_thread(handler, **params)
    if inspect.isawaitable(result):  # a sync function that returns a coroutine
        result = await result
    return result


def refusal_text(exc: BaseException) -> str:
    """What a Function's exception says to the caller: its message, as Open WebUI sends it
    (``str(e)``), with the exception's type where the message alone says little."""
    text = str(exc)
    if type(exc) in (Exception, ValueError, RuntimeError, PermissionError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
