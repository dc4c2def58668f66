"""The server's log: its format (text for people, one JSON object a line for machines) and
the request log, one line per request on the ``localm.access`` logger.

A request's line is written when its response has ended (a stream's when the stream ends)
by :class:`KernelASGI <localm.kernel.app.KernelASGI>`: method, path (never the query
string), status, duration, the caller's key id, and what the handlers added with
:func:`annotate` (the model, the tokens in, read from cache and out, the error code). Request bodies and
headers are never logged.

The last lines of the log are also kept in memory (:func:`keep_recent`), for the bug
reports that ask to include them (``POST /api/bug-report`` with ``include_log``).
"""

from __future__ import annotations

import collections
import contextvars
import datetime
import json
import logging
import sys
import threading
import time
from typing import Any

ACCESS = logging.getLogger("localm.access")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("text", "json")

#: What the kernel says of every request; annotate() cannot change these.
RESERVED = frozenset({"method", "path", "status", "duration_ms", "key_id", "client", "client_left"})
#: The order annotations are written in (others follow in the order they were added).
ORDER = ("code", "model", "tokens_in", "tokens_cached", "tokens_out")
SCOPE_KEY = "localm_request_line"

_current: contextvars.ContextVar["RequestLine | None"] = contextvars.ContextVar("localm_request_line",
                                                                                 default=None)
_json = [False]


def _path(scope: dict[str, Any]) -> str:
    """The request's path as the client sent it (percent-encoded; no query string), with any
    space or control character escaped so that one request stays one line."""
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else scope.get("path", "")
    path = path.partition("?")[0]
    return "".join(c if c.isprintable() and c != " " else f"%{ord(c):02X}" for c in path)


def _value(value: Any) -> str:
    text = str(value)
    if not text or any(not c.isprintable() or c in ' "=' for c in text):
        return json.dumps(text)
    return text


class RequestLine:
    """What the request log will say of one HTTP request."""

    def __init__(self, scope: dict[str, Any]) -> None:
        self.scope = scope
        self.started = time.perf_counter()
        self.status: int | None = None
        self.ended = False  # the response's last part was sent
        self.left = False  # the client went away before that
        self.failed = False  # the app raised instead of answering
        self.fields: dict[str, Any] = {}
        scope[SCOPE_KEY] = self

    @property
    def final_status(self) -> int:
        """The status sent; 499 when the client left before any answer (or the server
        stopped first), 500 when the app failed without one."""
        if self.status is not None:
            return self.status
        return 500 if self.failed and not self.left else 499

    def write(self) -> None:
        if not ACCESS.isEnabledFor(logging.INFO):
            return
        scope = self.scope
        fields: dict[str, Any] = {
            "method": scope.get("method", "-"), "path": _path(scope), "status": self.final_status,
            "duration_ms": round((time.perf_counter() - self.started) * 1000, 1)}
        for key in ORDER:
            if key in self.fields:
                fields[key] = self.fields[key]
        fields.update((k, v) for k, v in self.fields.items() if k not in fields)
        if fields["status"] == 499:
            fields.pop("code", None)  # the error the client left before hearing
        key_id = _key_id(scope.get("localm_principal"))
        if key_id:
            fields["key_id"] = key_id
        client = scope.get("client")
        if client:
            fields["client"] = client[0]
        if self.left:
            fields["client_left"] = True
        words = [fields["method"], fields["path"], str(fields["status"]), f"{fields['duration_ms']}ms"]
        words += [f"{k}={_value(v)}" for k, v in fields.items() if k not in RESERVED]
        words += [f"{k}={_value(fields[k])}" for k in ("key_id", "client") if k in fields]
        if self.left:
            words.append("client_left")
        ACCESS.info(" ".join(words), extra={"localm_fields": fields})


def _key_id(principal: Any) -> str | None:
    """Who called, by a name that is safe to log: a key's public id, "owner" or "attach"
    (the attach token); nothing for an open-mode or anonymous caller."""
    if principal is None:
        return None
    if principal.key_id:
        return str(principal.key_id)
    return principal.kind if principal.kind in ("owner", "attach") else None


def begin(scope: dict[str, Any]) -> tuple[RequestLine, contextvars.Token[Any]]:
    """Start the line of the request ``scope``; it is the current one in this task (and in
    the tasks it starts) until :func:`end`."""
    line = RequestLine(scope)
    return line, _current.set(line)


def end(token: contextvars.Token[Any]) -> None:
    _current.reset(token)


def forget_request() -> None:
    """Work that outlives its request (a job) annotates no request line from here on."""
    _current.set(None)


def annotate(request: Any = None, /, **fields: Any) -> None:
    """Add ``fields`` to a request's line in the request log: the line of ``request`` (a
    route's Request), or of the request being served when none is given (from a service a
    route awaits). ``model``, ``tokens_in``, ``tokens_out`` and ``code`` (an error's code)
    come first; a later value replaces an earlier one, and None removes one. Outside any
    request it does nothing."""
    line = request.scope.get(SCOPE_KEY) if request is not None else _current.get()
    if line is None:
        return
    for key, value in fields.items():
        if key in RESERVED:
            raise ValueError(f"{key} is written by the kernel on every request line; it cannot be annotated")
        if value is None:
            line.fields.pop(key, None)
        else:
            line.fields[key] = value


# --- the recent lines, for bug reports -------------------------------------------------

#: How many of the log's last lines the server keeps in memory (POST /api/bug-report
#: includes some of them when asked to); longer lines are cut.
RECENT_LINES = 1000
RECENT_LINE_CHARS = 1000


class RecentLines(logging.Handler):
    """The last lines of this process's log (the ``localm`` and ``uvicorn`` loggers) in
    memory, as text, whatever format stderr gets."""

    def __init__(self, capacity: int = RECENT_LINES) -> None:
        super().__init__()
        self.lines: collections.deque[str] = collections.deque(maxlen=capacity)
        self.setFormatter(logging.Formatter(TEXT_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:
            return
        for line in text.splitlines():
            self.lines.append(line if len(line) <= RECENT_LINE_CHARS else line[:RECENT_LINE_CHARS] + "…")

    def tail(self, count: int) -> list[str]:
        return list(self.lines)[-count:] if count > 0 else []


_recent: list[RecentLines] = []
_recent_lock = threading.Lock()


def keep_recent() -> RecentLines:
    """Start keeping the log's recent lines (once per process; later calls return the same)."""
    with _recent_lock:
        if not _recent:
            handler = RecentLines()
            for name in ("localm", "uvicorn"):
                logging.getLogger(name).addHandler(handler)
            _recent.append(handler)
        return _recent[0]


def recent_lines(count: int) -> list[str]:
    """The last ``count`` lines of this process's log (none before :func:`keep_recent`)."""
    return _recent[0].tail(count) if _recent else []


# --- the log's format -----------------------------------------------------------------

class JsonFormatter(logging.Formatter):
    """Each record as one JSON object on one line: time, level, logger, message, then a
    request line's fields, then the exception's traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        moment = datetime.datetime.fromtimestamp(record.created).astimezone()
        out: dict[str, Any] = {"time": moment.isoformat(timespec="milliseconds"), "level": record.levelname,
                               "logger": record.name, "message": record.getMessage()}
        out.update(getattr(record, "localm_fields", None) or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(level: str, fmt: str = "text") -> None:
    """Set up the server's log on stderr: ``level`` and ``fmt`` ("text" or "json")."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}")
    _json[0] = fmt == "json"
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if _json[0] else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    if _json[0]:
        logging.captureWarnings(True)  # a Python warning is a log line too, not loose text on stderr
    if level != "debug":  # httpx says INFO of every request the server makes (an upstream's, a download's)
        logging.getLogger("httpx").setLevel(logging.WARNING)


def announce(text: str) -> None:
    """A line the server always prints on stderr, whatever the log level (the address it
    serves on): as it is in the text format, as a JSON object in the JSON one."""
    if _json[0]:
        record = logging.LogRecord("localm", logging.INFO, __file__, 0, text, None, None)
        text = JsonFormatter().format(record)
    print(text, file=sys.stderr, flush=True)
