"""Limits on what a client sends: body size, JSON nesting, string and list lengths.

Every route reads its body through :class:`LimitedRequest` (the app's request class), so
a body nested deeper than ``max_json_depth`` is a 400 before any route parses it, and a
body larger than ``max_body_bytes`` is a 413 before it is fully read, on the kernel's
routes and every plugin's alike. Routes check their own fields' sizes with
:func:`check_length` and :func:`check_count`, which refuse with a 400 naming the field.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import deque
from itertools import accumulate
from typing import Any

from litestar import Request

from .errors import LocalmError

#: The code every refusal of an over-long or over-large input carries.
CODE = "limit_exceeded"

# Defaults of the kernel settings (kernel/config.py) that bound every request.
MAX_BODY_BYTES = 10_000_000
MAX_JSON_DEPTH = 100

# POST /v1/keys (and `localm key create`)
KEY_NAME_CHARS = 200
KEY_SCOPES = 64
SCOPE_CHARS = 100
KEY_RAG_ROOTS = 64
PATH_CHARS = 4096
# model names in query strings and bodies (load, unload, rename)
MODEL_NAME_CHARS = 512

_STRING = re.compile(rb'"(?:[^"\\]+|\\.)*"?', re.DOTALL)  # a string literal (to the end when unterminated)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def json_depth(raw: bytes, limit: int) -> int:
    """How deeply ``raw`` nests arrays and objects (brackets inside strings do not count);
    0 when it holds no more than ``limit`` brackets in all, which is the common case."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return 0
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def check_json_depth(raw: bytes, limit: int) -> None:
    """Refuse a JSON body nested deeper than ``limit`` levels (a 400)."""
    head = raw.lstrip()[:1]
    if head not in (b"[", b"{"):
        return
    if json_depth(raw, limit) > limit:
        raise LocalmError(400, f"The JSON body is nested more than {limit} levels deep (the max_json_depth setting)",
                          code=CODE, field="body", limit=limit)


def check_length(field: str, value: Any, limit: int) -> None:
    """Refuse a string longer than ``limit`` characters (a 400 naming the field)."""
    if isinstance(value, str) and len(value) > limit:
        raise LocalmError(400, f"{field} is {len(value)} characters; at most {limit} are accepted",
                          code=CODE, field=field, limit=limit)


def check_count(field: str, value: Any, limit: int) -> None:
    """Refuse a list holding more than ``limit`` items (a 400 naming the field)."""
    if isinstance(value, (list, tuple, dict)) and len(value) > limit:
        raise LocalmError(400, f"{field} holds {len(value)} items; at most {limit} are accepted",
                          code=CODE, field=field, limit=limit)


def too_large(limit: int | None) -> LocalmError:
    """The 413 for a body over its route's size limit."""
    bound = f"at most {limit} bytes" if limit else "a smaller body"
    return LocalmError(413, f"The request body is too large: this route accepts {bound} "
                            "(the max_body_bytes setting, or the route's own limit)",
                       code="body_too_large", limit=limit)


#: Default of the kernel setting expensive_requests_per_minute (0: no limit).
EXPENSIVE_PER_MINUTE = 0
RATE_CODE = "rate_limited"


class RateLimiter:
    """How many expensive requests (the inference routes: generation, embeddings, reranking,
    token counts) each caller started in the last minute; past the limit a 429 with
    Retry-After. A scoped key is counted by its id, the owner key and the attach token as
    one caller, and in open mode each client address is a caller of its own."""

    WINDOW = 60.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, deque[float]] = {}

    def check(self, who: str, per_minute: int, now: float | None = None) -> None:
        if per_minute <= 0:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            times = self._seen.setdefault(who, deque())
            while times and times[0] <= now - self.WINDOW:
                times.popleft()
            if len(times) >= per_minute:
                wait = max(1, math.ceil(times[0] + self.WINDOW - now))
                raise LocalmError(429, f"Too many expensive requests: this caller may start {per_minute} a minute "
                                       f"(the expensive_requests_per_minute setting); retry in {wait} s",
                                  code=RATE_CODE, headers={"Retry-After": str(wait)}, limit=per_minute)
            times.append(now)
            if len(self._seen) > 10_000:  # callers gone quiet are forgotten
                for key in [k for k, v in self._seen.items() if not v or v[-1] <= now - self.WINDOW]:
                    del self._seen[key]


def caller_id(principal: Any, client: str | None) -> str:
    """Whom a rate limit counts: a key by its id, the owner as one, an open-mode caller by address."""
    if principal.key_id:
        return f"key:{principal.key_id}"
    if principal.kind in ("owner", "attach"):
        return "owner"
    return f"{principal.kind}:{client or '-'}"


class LimitedRequest(Request):
    """A request whose JSON body is refused when nested deeper than the ``max_json_depth`` setting."""

    async def body(self) -> bytes:
        raw = await super().body()
        if raw and not self.scope.get("localm_depth_checked"):
            self.scope["localm_depth_checked"] = True  # type: ignore[typeddict-unknown-key]
            kernel = self.app.state.kernel
            check_json_depth(raw, int(kernel.config.get("max_json_depth")))
        return raw

