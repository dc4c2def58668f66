"""Long-term memory in one SQLite file (WAL): facts, their archive, correction proposals, the
user's own lines of each session, an FTS5 index, and a vector per fact.

Every change is one transaction, committed before the route answers: a fact the server
acknowledged survives a SIGKILL. A fact that is deleted or replaced is archived first, in
the same transaction, so it can be restored. Every table is bounded: the facts by their
caps (a write past them is refused), the archive, the log of the user's lines and the
pending corrections by keeping their newest rows (the oldest are dropped in the transaction
that adds one). The namespace (this data directory's memory) belongs to one server process
at a time: the first to write holds ``namespace.lock`` until it stops, and another
process's writes answer 409.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import sqlite3
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import filelock
from localm import sdk

MAX_RECORDS = 256
MAX_CHARS = 64_000
#: The archive of forgotten facts keeps the newest this many, and this many characters of
#: them (four times what memory itself holds): the oldest go in the transaction that archives more.
MAX_ARCHIVED = 1024
MAX_ARCHIVED_CHARS = 4 * MAX_CHARS
#: The log of the user's own lines keeps the newest this many (consolidation reads the newest
#: 40 it has not read); a line is cut to LINE_CHARS when it is logged.
MAX_TURNS = 500
LINE_CHARS = 4000
#: Pending correction proposals kept, the newest.
MAX_CORRECTIONS = 64
KINDS = ("fact", "preference", "episodic")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS facts (
    rowid INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    text TEXT NOT NULL,
    importance REAL NOT NULL DEFAULT 0.5,
    source TEXT NOT NULL,
    kind TEXT NOT NULL DEFAULT 'fact',
    uses INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    vec BLOB,
    vec_model TEXT
);
CREATE VIRTUAL TABLE IF NOT EXISTS facts_fts USING fts5(text, content='facts', content_rowid='rowid');
CREATE TRIGGER IF NOT EXISTS facts_ai AFTER INSERT ON facts BEGIN
    INSERT INTO facts_fts(rowid, text) VALUES (new.rowid, new.text);
END;
CREATE TRIGGER IF NOT EXISTS facts_ad AFTER DELETE ON facts BEGIN
    INSERT INTO facts_fts(facts_fts, rowid, text) VALUES ('delete', old.rowid, old.text);
END;
CREATE TRIGGER IF NOT EXISTS facts_au AFTER UPDATE OF text ON facts BEGIN
    INSERT INTO facts_fts(facts_fts, rowid, text) VALUES ('delete', old.rowid, old.text);
    INSERT INTO facts_fts(rowid, text) VALUES (new.rowid, new.text);
END;
CREATE TABLE IF NOT EXISTS archive (
    id TEXT PRIMARY KEY,
    fact_id TEXT NOT NULL,
    text TEXT NOT NULL,
    importance REAL NOT NULL,
    source TEXT NOT NULL,
    kind TEXT NOT NULL,
    reason TEXT NOT NULL,
    forgotten_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS corrections (
    id TEXT PRIMARY KEY,
    action TEXT NOT NULL,
    proposed_text TEXT,
    target_id TEXT NOT NULL,
    target_text TEXT NOT NULL,
    confidence REAL NOT NULL,
    created REAL NOT NULL,
    target_updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS turns (
    rowid INTEGER PRIMARY KEY,
    session TEXT NOT NULL,
    text TEXT NOT NULL,
    created REAL NOT NULL,
    consumed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS turns_open ON turns(consumed, session);
"""


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(6)}"


def pack(vector: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(vector)}f", *vector)


def unpack(blob: bytes | None) -> list[float] | None:
    if not blob:
        return None
    return list(struct.unpack(f"<{len(blob) // 4}f", blob))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


def item(row: sqlite3.Row) -> dict[str, Any]:
    """A fact as the routes show it."""
    return {"id": row["id"], "text": row["text"], "importance": row["importance"], "source": row["source"],
            "kind": row["kind"], "uses": row["uses"], "updated": row["updated"]}


class Store:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "memory.db"
        self._lock = filelock.FileLock(str(self.folder / "namespace.lock"), thread_local=False)
        self._holding = threading.Lock()  # one thread at a time takes (or releases) the namespace
        self._held = False
        self._writing = threading.Lock()
        with self.connect() as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(_SCHEMA)

    # --- connections and the namespace ----------------------------------------------------
    @contextlib.contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            conn.execute("PRAGMA busy_timeout=30000")
            conn.execute("PRAGMA synchronous=FULL")  # an acknowledged write is on disk
            conn.row_factory = sqlite3.Row
            yield conn
        finally:
            conn.close()

    def hold(self) -> bool:
        """Take the namespace for this process (kept until ``release``); False when another holds it.

        Writes arrive from several threads at once (each route's ``asyncio.to_thread``): they
        take the namespace one at a time, so the first takes it and the others find it held by
        this process, where two racing for the file lock would see each other as another process."""
        with self._holding:
            if self._held:
                return True
            try:
                self._lock.acquire(timeout=0)
            except filelock.Timeout:
                return False
            self._held = True
            return True

    def claim(self) -> None:
        """``hold``, or a 409 when another process holds the namespace: a route calls it before
        any costly work (embedding), and every write transaction again."""
        if not self.hold():
            raise sdk.LocalmError(409, "Another localm process holds this memory namespace; stop it, or write "
                                       "through it", code="namespace_busy")

    def release(self) -> None:
        with self._holding:
            if self._held:
                self._lock.release(force=True)
                self._held = False

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction in this process's namespace (409 when another process holds it)."""
        self.claim()
        with self._writing, self.connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    # --- reading ---------------------------------------------------------------------------
    def facts(self) -> list[sqlite3.Row]:
        with self.connect() as conn:
            return conn.execute("SELECT * FROM facts ORDER BY created, rowid").fetchall()

    def fact(self, fact_id: str) -> sqlite3.Row | None:
        with self.connect() as conn:
            return conn.execute("SELECT * FROM facts WHERE id = ?", (fact_id,)).fetchone()

    def corrections(self) -> list[dict[str, Any]]:
        with self.connect() as conn:
            return [dict(r) for r in conn.execute("SELECT * FROM corrections ORDER BY created")]

    def forgotten(self) -> list[dict[str, Any]]:
        with self.connect() as conn:
            return [{"id": r["id"], "fact_id": r["fact_id"], "text": r["text"], "importance": r["importance"],
                     "source": r["source"], "kind": r["kind"], "reason": r["reason"],
                     "forgotten_at": r["forgotten_at"]}
                    for r in conn.execute("SELECT * FROM archive ORDER BY forgotten_at DESC")]

    def lexical(self, match: str, n: int) -> list[tuple[str, float]]:
        if not match:
            return []
        with self.connect() as conn:
            try:
                rows = conn.execute("SELECT facts.id AS id, bm25(facts_fts) AS rank FROM facts_fts JOIN facts ON "
                                    "facts.rowid = facts_fts.rowid WHERE facts_fts MATCH ? ORDER BY rank LIMIT ?",
                                    (match, n)).fetchall()
            except sqlite3.OperationalError:
                return []
        return [(r["id"], -float(r["rank"])) for r in rows]

    def open_turns(self) -> list[dict[str, Any]]:
        with self.connect() as conn:
            return [dict(r) for r in conn.execute("SELECT rowid, session, text, created FROM turns "
                                                  "WHERE consumed = 0 ORDER BY rowid")]

    # --- writing (each inside ``write()``) ---------------------------------------------------
    @staticmethod
    def check_caps(conn: sqlite3.Connection, *, adding: int = 0, chars: int = 0, removing_chars: int = 0,
                   removing: int = 0) -> None:
        count, total = conn.execute("SELECT count(*), coalesce(sum(length(text)), 0) FROM facts").fetchone()
        if count - removing + adding > MAX_RECORDS:
            raise sdk.LocalmError(413, f"Memory holds at most {MAX_RECORDS} facts ({count} now)",
                                  code="memory_full")
        if total - removing_chars + chars > MAX_CHARS:
            raise sdk.LocalmError(413, f"Memory holds at most {MAX_CHARS} characters of facts ({total} now)",
                                  code="memory_full")

    @staticmethod
    def insert(conn: sqlite3.Connection, text: str, *, source: str, kind: str = "fact", importance: float = 0.5,
               vector: Sequence[float] | None = None, model: str | None = None, fact_id: str | None = None,
               created: float | None = None) -> str:
        now = time.time()
        fact_id = fact_id or new_id("mem")
        conn.execute("INSERT INTO facts(id, text, importance, source, kind, created, updated, vec, vec_model) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     (fact_id, text, importance, source, kind, created or now, now,
                      pack(vector) if vector is not None else None, model if vector is not None else None))
        return fact_id

    @staticmethod
    def archive(conn: sqlite3.Connection, row: sqlite3.Row, reason: str) -> str:
        """Archive a fact's current value; past the archive's bounds the oldest archived go."""
        archive_id = new_id("forgot")
        conn.execute("INSERT INTO archive(id, fact_id, text, importance, source, kind, reason, forgotten_at) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                     (archive_id, row["id"], row["text"], row["importance"], row["source"], row["kind"], reason,
                      time.time()))
        conn.execute("DELETE FROM archive WHERE rowid IN (SELECT rowid FROM (SELECT rowid, row_number() OVER newest "
                     "AS n, sum(length(text)) OVER newest AS chars FROM archive WINDOW newest AS (ORDER BY "
                     "forgotten_at DESC, rowid DESC)) WHERE n > ? OR chars > ?)",
                     (MAX_ARCHIVED, MAX_ARCHIVED_CHARS))
        return archive_id

    def delete(self, conn: sqlite3.Connection, row: sqlite3.Row, reason: str) -> None:
        self.archive(conn, row, reason)
        conn.execute("DELETE FROM facts WHERE id = ?", (row["id"],))
        conn.execute("DELETE FROM corrections WHERE target_id = ?", (row["id"],))

    @staticmethod
    def log_turn(conn: sqlite3.Connection, session: str, text: str) -> bool:
        """Remember a user line of a session once (cut to LINE_CHARS); False when it is already
        there. Past MAX_TURNS lines, the oldest go."""
        text = text[:LINE_CHARS]
        seen = conn.execute("SELECT 1 FROM turns WHERE session = ? AND text = ?", (session, text)).fetchone()
        if seen:
            return False
        conn.execute("INSERT INTO turns(session, text, created) VALUES (?, ?, ?)", (session, text, time.time()))
        conn.execute("DELETE FROM turns WHERE rowid <= (SELECT rowid FROM turns ORDER BY rowid DESC LIMIT 1 OFFSET ?)",
                     (MAX_TURNS,))
        return True

    @staticmethod
    def prune_corrections(conn: sqlite3.Connection) -> None:
        """Keep the newest MAX_CORRECTIONS pending proposals."""
        conn.execute("DELETE FROM corrections WHERE id IN (SELECT id FROM corrections ORDER BY created DESC, "
                     "rowid DESC LIMIT -1 OFFSET ?)", (MAX_CORRECTIONS,))
