"""The ignored-fields report and strict mode, the same on every surface that has them.

A field a route does not use is named in ``X-Localm-Ignored-Fields`` (an RFC 8941 list of
strings, capped at 1,024 bytes with a final ``"+N more"``; a character outside printable
ASCII is percent-encoded), and logged once per request as a ``request_fields_unused``
warning, without its value. ``X-Localm-Strict: true`` (or ``1``) refuses such a request
with 400 ``unused_fields_refused`` naming every location; ``false``, ``0`` or no header keeps
reporting, and any other value is a 400 ``invalid_header`` naming the header. The
``X-miLLM-`` spellings of both headers are accepted and answered too.

:class:`Reader` reads a JSON body's fields by type, collecting every field of the wrong
type into one 422 (:class:`Invalid`) that names them all, each as the client spelled it.

The errors are ``LocalmError``: the route's error family gives them its shape.
"""

from __future__ import annotations

import logging
from typing import Any

from localm.kernel.errors import LocalmError

from .chat import Origins

__all__ = ["STRICT_HEADERS", "IGNORED_HEADERS", "HEADER_MAX_BYTES", "strict_mode", "report_ignored",
           "ignored_header_value", "Invalid", "Reader", "convert"]

#: The strict-mode request headers, in the order they are read (the first one sent decides).
STRICT_HEADERS = ("x-localm-strict", "x-millm-strict")
#: The response headers that name the ignored fields (both carry the same value).
IGNORED_HEADERS = ("X-Localm-Ignored-Fields", "X-miLLM-Ignored-Fields")
#: The longest X-Localm-Ignored-Fields value.
HEADER_MAX_BYTES = 1024

_log = logging.getLogger("localm")


def strict_mode(headers: Any) -> bool:
    """Whether the request asks for strict mode: ``true``/``1`` yes, ``false``/``0`` or no
    header no; any other value is a 400 ``invalid_header``."""
    for name in STRICT_HEADERS:
        value = headers.get(name)
        if value is None:
            continue
        value = value.strip().lower()
        if value in ("true", "1"):
            return True
        if value in ("false", "0"):
            return False
        raise LocalmError(400, f"{name} must be true, 1, false or 0, got {value!r}", code="invalid_header")
    return False


def report_ignored(unused: list[str], headers: Any, where: str, *,
                   log: logging.Logger | None = None) -> dict[str, str]:
    """The response headers naming ``unused`` (the locations of the fields the route did not
    use: ``"user"``, ``"messages[2].name"``, ...), none when it is empty; in strict mode a 400
    ``unused_fields_refused`` instead. ``headers`` are the request's; ``where`` names the
    route in the warning, which goes to ``log`` (the ``localm`` logger when left out).

    A malformed strict header is refused even when nothing was ignored.
    """
    strict = strict_mode(headers)
    if not unused:
        return {}
    if strict:
        raise LocalmError(400, "Unused fields (X-Localm-Strict): " + ", ".join(unused),
                          code="unused_fields_refused", fields=unused)
    (log or _log).warning("request_fields_unused on %s: %s", where, ", ".join(unused))
    value = ignored_header_value(unused)
    return {name: value for name in IGNORED_HEADERS}


def _sf_string(text: str) -> str:
    safe = "".join(c if 0x20 <= ord(c) < 0x7F else "".join(f"%{b:02x}" for b in c.encode()) for c in text)
    return '"' + safe.replace("\\", "\\\\").replace('"', '\\"') + '"'


def ignored_header_value(locations: list[str]) -> str:
    """An RFC 8941 list of strings of at most HEADER_MAX_BYTES, ending "+N more" when cut."""
    items = [_sf_string(loc) for loc in locations]
    out: list[str] = []
    for i, item in enumerate(items):
        rest = len(items) - i - 1
        tail = f', "+{rest} more"' if rest else ""
        candidate = ", ".join([*out, item])
        if len(candidate) + len(tail) > HEADER_MAX_BYTES:
            more = len(items) - len(out)
            return ", ".join([*out, f'"+{more} more"'])
        out.append(item)
    return ", ".join(out)


class Invalid(LocalmError):
    """A field of the wrong type: 422 with one sentence per field and the structured list
    (``errors``: ``[{"key": "messages[2].content", "message": "must be a string"}, ...]``)."""

    def __init__(self, errors: list[dict[str, str]]) -> None:
        detail = " ".join(f"{e['key']}: {e['message']}." for e in errors)
        super().__init__(422, detail, errors=errors)


class Reader:
    """Collects type errors across fields, so one 422 names them all, each field named as the
    client sent it (``origins``). A body that is not a JSON object is a 422 at once.

    ``get(key, kinds, what, default)`` is the field if it is one of ``kinds`` (a bool is not an
    int unless ``bool`` is listed), else ``default`` with an error noted; ``done()`` raises the
    422 when any was noted."""

    def __init__(self, body: Any, origins: Origins | None = None) -> None:
        if not isinstance(body, dict):
            raise Invalid([{"key": "body", "message": "must be a JSON object"}])
        self.body = body
        self.origins = origins if origins is not None else Origins()
        self.errors: list[dict[str, str]] = []

    def name(self, *path: str | int) -> str:
        """The client's name for a place of the body (``messages[3].content`` → ``input[2].content``)."""
        return self.origins.name(*path)

    def error(self, message: str, *path: str | int) -> None:
        """Note a field of the wrong type, for the 422."""
        self.errors.append({"key": self.name(*path), "message": message})

    def get(self, key: str, kinds: tuple[type, ...], what: str, default: Any = None) -> Any:
        value = self.body.get(key, default)
        if value is None:
            return default
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            self.error(f"must be {what}", key)
            return default
        return value

    def number(self, key: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
        value = self.get(key, (int, float), "a number", default)
        if value is not default and ((lo is not None and value < lo) or (hi is not None and value > hi)):
            raise LocalmError(400, f"{self.name(key)} must be between {lo} and {hi}, got {value}")
        return float(value)

    def done(self) -> None:
        if self.errors:
            raise Invalid(self.errors)


# --- a body read by the schema that documents it ---------------------------------------------

_KINDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
          "object": "an object", "array": "a list", "null": "null"}


def _plain(message: str) -> tuple[str, str]:
    """(where, what) from a msgspec validation message, in the words of localm's other refusals."""
    import re

    where = ""
    found = re.search(r" - at `\$(.*)`$", message)
    if found:
        message, where = message[:found.start()], found.group(1).lstrip(".")
        where = re.sub(r"\.(\w+)", r".\1", where)
    missing = re.fullmatch(r"Object missing required field `(.+)`", message)
    if missing:
        name = f"{where}.{missing.group(1)}" if where else missing.group(1)
        return name, f"{name} is required"
    typed = re.fullmatch(r"Expected `(.+?)`, got `(.+?)`", message)
    if typed:
        wanted = " or ".join(_KINDS.get(k.strip(), k.strip()) for k in typed.group(1).split("|")
                             if k.strip() != "null")
        return where, f"{where or 'the body'} must be {wanted}, not {_KINDS.get(typed.group(2), typed.group(2))}"
    if re.fullmatch(r"Expected `str` (of length >= 1|matching regex '\\\\S')", message):
        return where, f"{where} must not be empty"
    bounded = re.fullmatch(r"Expected `(\w+)` (.+)", message)  # a bound: ">= 1", "of length <= 200"
    if bounded:
        kind = bounded.group(1)
        return where, f"{where or 'the body'} must be {_KINDS.get(kind, kind)} {bounded.group(2)}"
    return where, f"{where or 'the body'}: {message[0].lower()}{message[1:]}"


def convert(body: Any, schema: type, *, code: str | None = None) -> Any:
    """``body`` (a decoded JSON body) as an instance of ``schema``, the msgspec ``Struct`` the
    route names as its ``body=``: one model both documents the body in the OpenAPI document
    and checks it, so the two cannot disagree. Fields the schema does not name are left out
    (report them with :func:`report_ignored`). A field of the wrong type or shape, or one
    missing, is a 400 naming it (``field``), as the client spelled it."""
    import msgspec

    try:
        return msgspec.convert(body, schema, strict=True)
    except msgspec.ValidationError as exc:
        where, what = _plain(str(exc))
        extra = {"field": where} if where else {}
        raise LocalmError(400, what, code=code, **extra) from None
