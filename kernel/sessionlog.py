"""The session log: a record of chat turns in ``<data dir>/session-log.sqlite``.

What a turn leaves depends on the session mode it was recorded under (the ``session_mode``
setting, which a request may lower, see :func:`effective_mode`):

- ``none``: nothing.
- ``metadata``: when, the route, the model, whose key, how it ended and its token counts.
- ``full``: that, and the user's own words (their last message, without the messages a
  client marked with ``origin``) and the reply's text.

The file is SQLite in WAL mode with full syncing: a turn is on disk once ``record`` returns,
and the chat service records a turn before the reply's last chunk goes out, so a turn a
client saw end survives the server being killed. Old turns go when the log passes
``session_log_days`` (at most one pruning an hour). Reading and clearing are the owner's for
every turn, and a key's for its own (``GET`` / ``DELETE /api/session/log``).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from .errors import LocalmError

MODES = ("none", "metadata", "full")
HEADER = "X-Localm-Session-Mode"
FILE = "session-log.sqlite"
#: The longest user line and reply a turn keeps, in characters (the rest is cut, and said so).
MAX_TEXT = 200_000
#: The most turns one listing answers.
MAX_LIST = 500
PRUNE_EVERY = 3600.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS turns (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    mode TEXT NOT NULL,
    route TEXT NOT NULL,
    model TEXT,
    owner TEXT NOT NULL,
    finish_reason TEXT,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    user TEXT,
    reply TEXT
);
CREATE INDEX IF NOT EXISTS turns_owner ON turns (owner, id);
CREATE INDEX IF NOT EXISTS turns_at ON turns (at);
"""


def rank(mode: str) -> int:
    return MODES.index(mode)


def effective_mode(configured: Any, asked: str | None, *, may_lower: bool) -> str:
    """The mode a chat is recorded under: the ``session_mode`` setting, or less when the
    request's X-Localm-Session-Mode asks for less and the caller may lower it (the owner, or
    any caller while no key exists). Asking for more than the setting is never granted; a value
    that is not a mode is a 400."""
    mode = configured if configured in MODES else "none"
    if asked is None or asked == "":
        return mode
    asked = asked.strip().lower()
    if asked not in MODES:
        raise LocalmError(400, f"{HEADER} must be one of {', '.join(MODES)}", code="invalid_session_mode")
    if may_lower and rank(asked) < rank(mode):
        return asked
    return mode


def _cut(text: str | None) -> str | None:
    if text is None or len(text) <= MAX_TEXT:
        return text
    return text[:MAX_TEXT] + f" [... {len(text) - MAX_TEXT} more characters not kept]"


class SessionLog:
    def __init__(self, data_dir: Path, keep_days: Any = None) -> None:
        self.path = Path(data_dir) / FILE
        #: () -> the session_log_days setting (None: turns stay until cleared)
        self._keep_days = keep_days
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._pruned = 0.0

    @contextlib.contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._db is None:
                try:
                    db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
                    self.path.chmod(0o600)
                    db.execute("PRAGMA journal_mode=WAL")
                    db.execute("PRAGMA synchronous=FULL")
                    db.executescript(_SCHEMA)
                except sqlite3.DatabaseError as exc:
                    raise LocalmError(409, f"The session log ({FILE}) cannot be opened: {exc}",
                                      code="session_log_unreadable") from None
                self._db = db
            try:
                yield self._db
            except sqlite3.DatabaseError as exc:
                raise LocalmError(409, f"The session log ({FILE}) cannot be read or written: {exc}",
                                  code="session_log_unreadable") from None

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    # --- writing ---------------------------------------------------------------------------
    def record(self, *, mode: str, route: str, model: str | None, owner: str, finish_reason: str | None,
               prompt_tokens: int | None, completion_tokens: int | None, user: str | None = None,
               reply: str | None = None) -> int | None:
        """Write one turn (blocking: call it off the event loop); its id, or None in mode none.
        ``user`` and ``reply`` are kept in full mode only."""
        if mode not in MODES or mode == "none":
            return None
        full = mode == "full"
        with self._connection() as db:
            cursor = db.execute(
                "INSERT INTO turns (at, mode, route, model, owner, finish_reason, prompt_tokens, completion_tokens,"
                " user, reply) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (time.time(), mode, route, model, owner, finish_reason, prompt_tokens, completion_tokens,
                 _cut(user) if full else None, _cut(reply) if full else None))
            turn = cursor.lastrowid
            now = time.monotonic()
            keep_days = self._keep_days() if self._keep_days is not None else None
            if isinstance(keep_days, (int, float)) and keep_days > 0 and (not self._pruned or now - self._pruned > PRUNE_EVERY):
                self._pruned = now
                db.execute("DELETE FROM turns WHERE at < ?", (time.time() - keep_days * 86400,))
        return turn

    # --- reading ---------------------------------------------------------------------------
    def turns(self, *, owner: str | None, limit: int = 100, before: int | None = None) -> list[dict[str, Any]]:
        """Newest first: every owner's (``owner`` None) or one owner's turns, ``limit`` at most
        (capped at MAX_LIST), with ids below ``before``."""
        if not self.path.exists():
            return []
        limit = max(1, min(MAX_LIST, limit))
        where, args = [], []
        if owner is not None:
            where.append("owner = ?")
            args.append(owner)
        if before is not None:
            where.append("id < ?")
            args.append(before)
        sql = ("SELECT id, at, mode, route, model, owner, finish_reason, prompt_tokens, completion_tokens, user,"
               " reply FROM turns" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id DESC LIMIT ?")
        with self._connection() as db:
            rows = db.execute(sql, (*args, limit)).fetchall()
        keys = ("id", "at", "mode", "route", "model", "owner", "finish_reason", "prompt_tokens", "completion_tokens",
                "user", "reply")
        return [dict(zip(keys, row)) for row in rows]

    def user_lines(self, *, owner: str | None, since: float = 0.0, limit: int = 200) -> list[dict[str, Any]]:
        """The user's own words of full-mode turns after ``since`` (epoch seconds), oldest first:
        ``{"id", "at", "owner", "text"}`` (what memory consolidation learns from)."""
        if not self.path.exists():
            return []
        sql = "SELECT id, at, owner, user FROM turns WHERE user IS NOT NULL AND user != '' AND at > ?"
        args: list[Any] = [since]
        if owner is not None:
            sql += " AND owner = ?"
            args.append(owner)
        sql += " ORDER BY id DESC LIMIT ?"
        with self._connection() as db:
            rows = db.execute(sql, (*args, max(1, min(MAX_LIST, limit)))).fetchall()
        return [{"id": r[0], "at": r[1], "owner": r[2], "text": r[3]} for r in reversed(rows)]

    def clear(self, *, owner: str | None) -> int:
        """Delete every turn (``owner`` None) or one owner's; how many went."""
        if not self.path.exists():
            return 0
        with self._connection() as db:
            if owner is None:
                gone = db.execute("DELETE FROM turns").rowcount
            else:
                gone = db.execute("DELETE FROM turns WHERE owner = ?", (owner,)).rowcount
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the deleted text leaves the WAL file too
        return int(gone or 0)
