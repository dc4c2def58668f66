"""Collections on disk: chunk text, per-document state and a BM25 index in SQLite, vectors in
an embedded chromadb.

Layout under the plugin's data folder::

    collections/<name>/meta.db    SQLite (WAL): info, docs, chunks, and an FTS5 index of chunks
    collections/<name>/write.lock held by whoever writes the collection (any process)
    chroma/                        one chromadb PersistentClient; a chroma collection per
                                   localm collection (its name is kept in info.chroma);
                                   with the chroma_url setting, a Chroma server instead

SQLite is the collection's truth: a chunk exists when its row does. Vectors are written to
chroma before the rows that name them and removed after, so a crash at any point leaves the
collection readable: at worst chroma holds vectors no row names, which searches skip and
:meth:`Collection.sweep` removes. A collection is deleted by renaming its folder away first,
so it is either whole or gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import shutil
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import filelock
from localm import sdk

log = logging.getLogger("localm.plugin.rag")

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
SCHEMA = 1
_SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS info (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS docs (
    path TEXT PRIMARY KEY,      -- the file's absolute path, or upload:<filename>
    kind TEXT NOT NULL,         -- file | upload
    root TEXT,                  -- the path it was added under (a folder or the file itself)
    filename TEXT NOT NULL,
    format TEXT,                -- what the extractor read it as: text, markdown, html, pdf, docx, code
    size INTEGER, mtime REAL, sha256 TEXT,
    n_chunks INTEGER NOT NULL DEFAULT 0,
    indexed REAL
);
CREATE TABLE IF NOT EXISTS chunks (
    rowid INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    path TEXT NOT NULL,
    seq INTEGER NOT NULL,
    heading TEXT,
    text TEXT NOT NULL,
    vec INTEGER NOT NULL DEFAULT 0   -- 1 when chroma holds this chunk's vector
);
CREATE INDEX IF NOT EXISTS chunks_path ON chunks(path);
CREATE VIRTUAL TABLE IF NOT EXISTS fts USING fts5(text, heading, content='chunks', content_rowid='rowid');
CREATE TRIGGER IF NOT EXISTS chunks_ai AFTER INSERT ON chunks BEGIN
    INSERT INTO fts(rowid, text, heading) VALUES (new.rowid, new.text, coalesce(new.heading, ''));
END;
CREATE TRIGGER IF NOT EXISTS chunks_ad AFTER DELETE ON chunks BEGIN
    INSERT INTO fts(fts, rowid, text, heading) VALUES ('delete', old.rowid, old.text, coalesce(old.heading, ''));
END;
"""


def check_name(name: Any) -> str:
    """A legal collection name (letters, digits, - and _, at most 63), or a 400."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise sdk.LocalmError(400, f"Invalid collection name {name!r}: use 1 to 63 letters, digits, - and _, "
                                   "starting with a letter or digit", code="invalid_collection_name")
    return name


def chunk_id(path: str, sha256: str, seq: int) -> str:
    """A chunk's id: new for every version of a document, so old and new never collide."""
    return hashlib.sha1(f"{path}\0{sha256}\0{seq}".encode()).hexdigest()[:24]


@attrs.frozen
class Doc:
    path: str
    kind: str
    root: str | None
    filename: str
    format: str
    size: int
    mtime: float
    sha256: str


@attrs.frozen
class Row:
    """A chunk as stored."""
    id: str
    path: str
    seq: int
    heading: str | None
    text: str


class Vectors:
    """The vector store, opened on first use (importing chromadb takes a second or two): the
    embedded chromadb in ``folder``, or a Chroma server when ``url()`` names one (the rag
    plugin's ``chroma_url`` setting, read at each use, so a change applies without a restart).

    Never chroma's default embedding function (it reaches for the network): every vector
    comes from localm's embedder. Calls are serialised within the process.
    """

    def __init__(self, folder: Path, url: Any = None) -> None:
        self.folder = folder
        self._url = url or (lambda: None)
        self._opened: str | None = None  # the server the client talks to (None: embedded)
        self._client: Any = None
        self._error: str | None = None
        self._lock = threading.RLock()

    def client(self) -> Any:
        with self._lock:
            url = (self._url() or "").strip() or None
            if url != self._opened or (url and self._client is None):
                # another store, or a server that did not answer last time: (re)open
                self._client, self._error, self._opened = None, None, url
            if self._client is None and self._error is None:
                try:
                    import chromadb
                    from chromadb.config import Settings
                    settings = Settings(anonymized_telemetry=False, allow_reset=False)
                    if url:
                        parts = urllib.parse.urlsplit(url)
                        if parts.scheme not in ("http", "https") or not parts.hostname:
                            raise ValueError(f"chroma_url is not an http(s) URL: {url}")
                        self._client = chromadb.HttpClient(
                            host=parts.hostname, port=parts.port or (443 if parts.scheme == "https" else 8000),
                            ssl=parts.scheme == "https", settings=settings)
                    else:
                        self.folder.mkdir(parents=True, exist_ok=True)
                        self._client = chromadb.PersistentClient(path=str(self.folder), settings=settings)
                except ImportError as exc:
                    self._error = f"chromadb cannot be imported ({exc}): pip install 'localm[rag]'"
                    log.error("chromadb: %s", self._error)
                except Exception as exc:  # a store chromadb cannot open: lexical search still works
                    where = f"the Chroma server {url}" if url else "the vector store"
                    self._error = f"{where} cannot be opened: {type(exc).__name__}: {exc}"
                    log.error("chromadb: %s", self._error)
            if self._client is None:
                raise VectorsUnavailable(self._error or "the vector store is not available")
            return self._client

    @property
    def error(self) -> str | None:
        return self._error

    def collection(self, name: str, *, create: bool = False) -> Any:
        """The chroma collection ``name``; VectorsUnavailable when it is not there (the store
        lost it, or a Chroma server was changed or emptied) or cannot be read."""
        with self._lock:
            client = self.client()
            if create:
                return client.get_or_create_collection(name, embedding_function=None,
                                                       metadata={"hnsw:space": "cosine"})
            try:
                return client.get_collection(name, embedding_function=None)
            except Exception as exc:
                if type(exc).__name__ in ("NotFoundError", "InvalidCollectionException") \
                        or "does not exist" in str(exc):
                    raise VectorsMissing(f"the vector store has no collection {name}: run reembed to rebuild "
                                         "its vectors") from None
                raise VectorsUnavailable(f"the vector collection {name} cannot be read: "
                                         f"{type(exc).__name__}: {exc}") from None

    def upsert(self, name: str, ids: Sequence[str], vectors: Sequence[Sequence[float]], paths: Sequence[str]) -> None:
        if not ids:
            return
        with self._lock:
            col = self.collection(name, create=True)
            for start in range(0, len(ids), 4096):  # chromadb's batch limit is larger; stay well inside it
                end = start + 4096
                col.upsert(ids=list(ids[start:end]), embeddings=[list(map(float, v)) for v in vectors[start:end]],
                           metadatas=[{"path": p} for p in paths[start:end]])

    def delete(self, name: str, ids: Sequence[str]) -> None:
        if not ids:
            return
        with self._lock:
            try:
                col = self.collection(name)
            except VectorsMissing:  # no such chroma collection: nothing to delete
                return
            for start in range(0, len(ids), 4096):
                col.delete(ids=list(ids[start:start + 4096]))

    def query(self, name: str, vector: Sequence[float], n: int) -> list[tuple[str, float]]:
        """(chunk id, cosine similarity), best first."""
        with self._lock:
            col = self.collection(name)
            try:
                count = col.count()
                if not count:
                    return []
                out = col.query(query_embeddings=[list(map(float, vector))], n_results=min(n, count),
                                include=["distances"])
            except Exception as exc:  # a server that stopped answering, a store that cannot be read
                raise VectorsUnavailable(f"the vector collection {name} cannot be searched: "
                                         f"{type(exc).__name__}: {exc}") from None
        ids, distances = out["ids"][0], out["distances"][0]
        return [(i, 1.0 - float(d)) for i, d in zip(ids, distances)]

    def ids(self, name: str) -> set[str]:
        with self._lock:
            try:
                col = self.collection(name)
            except VectorsMissing:
                return set()
            return set(col.get(include=[])["ids"])

    def drop(self, name: str) -> None:
        with self._lock:
            try:
                self.client().delete_collection(name)
            except VectorsUnavailable:
                raise
            except Exception:  # already gone
                pass

    def names(self) -> list[str]:
        with self._lock:
            return [c if isinstance(c, str) else c.name for c in self.client().list_collections()]


class VectorsUnavailable(Exception):
    """chromadb is missing or its store cannot be opened (the reason)."""


class VectorsMissing(VectorsUnavailable):
    """The store answers, but has no collection by that name."""


class Collection:
    """One collection: its folder, its SQLite file, its chroma collection."""

    def __init__(self, store: "Store", name: str) -> None:
        self.store = store
        self.name = name
        self.folder = store.root / name
        self.db = self.folder / "meta.db"

    # --- SQLite ----------------------------------------------------------------------
    @contextlib.contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        """A connection for one operation; ``with conn:`` inside makes a transaction."""
        conn = sqlite3.connect(self.db, timeout=30, isolation_level=None)
        try:
            conn.execute("PRAGMA busy_timeout=30000")
            conn.row_factory = sqlite3.Row
            yield conn
        finally:
            conn.close()

    def info(self) -> dict[str, str]:
        with self.connect() as conn:
            return {r["key"]: r["value"] for r in conn.execute("SELECT key, value FROM info")}

    def set_info(self, conn: sqlite3.Connection, **values: Any) -> None:
        for key, value in values.items():
            if value is None:
                conn.execute("DELETE FROM info WHERE key = ?", (key,))
            else:
                conn.execute("INSERT OR REPLACE INTO info(key, value) VALUES (?, ?)", (key, str(value)))

    # --- writing -----------------------------------------------------------------------
    @contextlib.contextmanager
    def writing(self, *, wait: float = 0.0) -> Iterator[None]:
        """Hold the collection's write lock (any process); a 409 when another holds it past ``wait``."""
        lock = filelock.FileLock(str(self.folder / "write.lock"), thread_local=False)
        try:
            lock.acquire(timeout=wait)
        except filelock.Timeout:
            raise sdk.LocalmError(409, f"Collection {self.name} is being written by another job or process; "
                                       "try again when it finishes", code="collection_busy") from None
        try:
            yield
        finally:
            lock.release()

    def busy(self) -> bool:
        lock = filelock.FileLock(str(self.folder / "write.lock"), thread_local=False)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            return True
        lock.release()
        return False

    def replace(self, doc: Doc, rows: Sequence[Row], vectors: Sequence[Sequence[float]] | None,
                *, embed_model: str | None = None) -> None:
        """Make ``rows`` the document's chunks (its old ones go): vectors first, then the rows
        in one transaction, then the old vectors."""
        chroma = self.info().get("chroma")
        if vectors is not None and chroma:
            self.store.vectors.upsert(chroma, [r.id for r in rows], vectors, [r.path for r in rows])
        with self.connect() as conn:
            old = [r["id"] for r in conn.execute("SELECT id FROM chunks WHERE path = ?", (doc.path,))]
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute("DELETE FROM chunks WHERE path = ?", (doc.path,))
                conn.executemany("INSERT INTO chunks(id, path, seq, heading, text, vec) VALUES (?, ?, ?, ?, ?, ?)",
                                 [(r.id, r.path, r.seq, r.heading, r.text, int(vectors is not None)) for r in rows])
                conn.execute("INSERT OR REPLACE INTO docs(path, kind, root, filename, format, size, mtime, sha256, "
                             "n_chunks, indexed) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             (doc.path, doc.kind, doc.root, doc.filename, doc.format, doc.size, doc.mtime,
                              doc.sha256, len(rows), time.time()))
                if vectors is not None and rows:
                    self.set_info(conn, embed_model=embed_model, dim=len(vectors[0]))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        stale = sorted(set(old) - {r.id for r in rows})
        if stale and chroma:
            with contextlib.suppress(VectorsUnavailable):
                self.store.vectors.delete(chroma, stale)

    def touch(self, path: str, size: int, mtime: float) -> None:
        """A file whose content did not change: remember its new size and mtime."""
        with self.connect() as conn:
            conn.execute("UPDATE docs SET size = ?, mtime = ? WHERE path = ?", (size, mtime, path))

    def remove(self, path: str) -> bool:
        """Forget one document and its chunks; False when it is not indexed here."""
        chroma = self.info().get("chroma")
        with self.connect() as conn:
            old = [r["id"] for r in conn.execute("SELECT id FROM chunks WHERE path = ?", (path,))]
            conn.execute("BEGIN IMMEDIATE")
            found = conn.execute("DELETE FROM docs WHERE path = ?", (path,)).rowcount > 0
            conn.execute("DELETE FROM chunks WHERE path = ?", (path,))
            conn.execute("COMMIT")
        if old and chroma:
            with contextlib.suppress(VectorsUnavailable):
                self.store.vectors.delete(chroma, old)
        return found

    def sweep(self) -> int:
        """Remove vectors no chunk row names (left by a crash mid-write); how many."""
        chroma = self.info().get("chroma")
        if not chroma:
            return 0
        with self.connect() as conn:
            known = {r["id"] for r in conn.execute("SELECT id FROM chunks")}
        orphans = sorted(self.store.vectors.ids(chroma) - known)
        self.store.vectors.delete(chroma, orphans)
        return len(orphans)

    # --- reading -----------------------------------------------------------------------
    def docs(self, present: Callable[[str, str | None], bool] | None = None) -> list[dict[str, Any]]:
        """Every document; ``missing`` when a file is gone, or (by ``present(path, root)``, the
        caller's rules) no longer a file they may read."""
        with self.connect() as conn:
            rows = [dict(r) for r in conn.execute("SELECT * FROM docs ORDER BY path")]
        for row in rows:
            if row["kind"] != "file":
                row["missing"] = False
            elif present is not None:
                row["missing"] = not present(row["path"], row["root"])
            else:
                row["missing"] = not os.path.isfile(row["path"])
        return rows

    def sources(self) -> list[dict[str, Any]]:
        """Each document's ``path`` and ``kind`` only (what confinement checks), without a stat."""
        with self.connect() as conn:
            return [dict(r) for r in conn.execute("SELECT path, kind FROM docs")]

    def docs_for(self, paths: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The documents at ``paths`` (the hits of one query), by path."""
        wanted = sorted(set(paths))
        if not wanted:
            return {}
        with self.connect() as conn:
            marks = ",".join("?" * len(wanted))
            return {r["path"]: dict(r) for r in conn.execute(f"SELECT * FROM docs WHERE path IN ({marks})", wanted)}

    def doc(self, path: str) -> dict[str, Any] | None:
        with self.connect() as conn:
            row = conn.execute("SELECT * FROM docs WHERE path = ?", (path,)).fetchone()
        return dict(row) if row is not None else None

    def rows(self, ids: Sequence[str]) -> dict[str, Row]:
        out: dict[str, Row] = {}
        with self.connect() as conn:
            for start in range(0, len(ids), 500):
                part = list(ids[start:start + 500])
                marks = ",".join("?" * len(part))
                for r in conn.execute(f"SELECT id, path, seq, heading, text FROM chunks WHERE id IN ({marks})", part):
                    out[r["id"]] = Row(r["id"], r["path"], r["seq"], r["heading"], r["text"])
        return out

    def all_rows(self, batch: int = 256) -> Iterator[list[Row]]:
        last = 0
        while True:
            with self.connect() as conn:
                found = conn.execute("SELECT rowid, id, path, seq, heading, text FROM chunks WHERE rowid > ? "
                                     "ORDER BY rowid LIMIT ?", (last, batch)).fetchall()
            if not found:
                return
            last = found[-1]["rowid"]
            yield [Row(r["id"], r["path"], r["seq"], r["heading"], r["text"]) for r in found]

    def lexical(self, match: str, n: int) -> list[tuple[str, float]]:
        """(chunk id, BM25 score: higher is better) for an FTS5 ``match`` expression, best first."""
        with self.connect() as conn:
            try:
                found = conn.execute("SELECT chunks.id AS id, bm25(fts, 1.0, 0.5) AS rank FROM fts "
                                     "JOIN chunks ON chunks.rowid = fts.rowid WHERE fts MATCH ? "
                                     "ORDER BY rank LIMIT ?", (match, n)).fetchall()
            except sqlite3.OperationalError:  # an expression FTS5 cannot parse: nothing matches
                return []
        return [(r["id"], -float(r["rank"])) for r in found]

    def counts(self) -> dict[str, int]:
        with self.connect() as conn:
            one = conn.execute("SELECT (SELECT count(*) FROM docs) AS docs, (SELECT count(*) FROM chunks) AS chunks, "
                               "(SELECT count(*) FROM chunks WHERE vec = 1) AS vectors, "
                               "(SELECT count(*) FROM chunks WHERE length(trim(text)) = 0) AS bad, "
                               "(SELECT count(DISTINCT root) FROM docs WHERE kind = 'file') AS roots").fetchone()
        return dict(one)

    def stats(self, present: Callable[[str, str | None], bool] | None = None) -> dict[str, Any]:
        """The spec's collection stats (name, created, n_docs, n_missing, n_roots, n_chunks,
        has_vectors, corrupt, chunks_bad_lines, vector_degrade_reason, vector_dim)."""
        out: dict[str, Any] = {"name": self.name}
        try:
            info = self.info()
            counts = self.counts()
            docs = self.docs(present)
        except sqlite3.DatabaseError as exc:
            return {**out, "created": None, "n_docs": 0, "n_missing": 0, "n_roots": 0, "n_chunks": 0,
                    "has_vectors": False, "corrupt": True, "chunks_bad_lines": 0,
                    "vector_degrade_reason": f"the collection's index cannot be read: {exc}", "vector_dim": None,
                    "embedding_model": None}
        dim = info.get("dim")
        out.update(created=float(info.get("created") or 0) or None, n_docs=counts["docs"],
                   n_missing=sum(1 for d in docs if d["missing"]), n_roots=counts["roots"],
                   n_chunks=counts["chunks"], has_vectors=counts["vectors"] > 0, corrupt=False,
                   chunks_bad_lines=counts["bad"], vector_degrade_reason=info.get("degraded") or None,
                   vector_dim=int(dim) if dim else None, embedding_model=info.get("embed_model") or None)
        if counts["chunks"] and not counts["vectors"] and not out["vector_degrade_reason"]:
            out["vector_degrade_reason"] = "indexed without embeddings: lexical search only"
        return out


class Store:
    """Every collection under ``root``, and the vectors beside them."""

    def __init__(self, data_dir: Path, chroma_url: Any = None) -> None:
        self.root = Path(data_dir) / "collections"
        self.root.mkdir(parents=True, exist_ok=True)
        self.vectors = Vectors(Path(data_dir) / "chroma", chroma_url)
        self._create = threading.Lock()

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and NAME.fullmatch(p.name) and (p / "meta.db").is_file())

    def get(self, name: str) -> Collection:
        """The collection, or a 404 (a 400 for an illegal name)."""
        check_name(name)
        col = Collection(self, name)
        if not col.db.is_file():
            raise sdk.LocalmError(404, f"Collection not found: {name}", code="collection_not_found")
        return col

    def create(self, name: str) -> Collection:
        check_name(name)
        with self._create:
            col = Collection(self, name)
            if col.db.is_file():
                raise sdk.LocalmError(409, f"Collection {name} already exists", code="collection_exists")
            building = self.root / f".new-{name}-{secrets.token_hex(4)}"
            building.mkdir(parents=True)
            try:
                conn = sqlite3.connect(building / "meta.db", isolation_level=None)
                try:
                    conn.execute("PRAGMA journal_mode=WAL")
                    conn.executescript(_SCHEMA_SQL)
                    conn.executemany("INSERT INTO info(key, value) VALUES (?, ?)",
                                     [("name", name), ("created", repr(time.time())), ("schema", str(SCHEMA)),
                                      ("chroma", f"lm-{secrets.token_hex(10)}")])
                finally:
                    conn.close()
                try:
                    building.rename(col.folder)
                except OSError:
                    raise sdk.LocalmError(409, f"Collection {name} already exists", code="collection_exists") from None
            finally:
                if building.exists():
                    shutil.rmtree(building, ignore_errors=True)
        return col

    def delete(self, name: str) -> None:
        """Delete a collection whole: its folder is renamed away first, so a crash never leaves
        half of one. A 409 while it is being written."""
        col = self.get(name)
        with col.writing():
            chroma = col.info().get("chroma")
            gone = self.root / f".trash-{name}-{secrets.token_hex(4)}"
            col.folder.rename(gone)
        if chroma:
            with contextlib.suppress(VectorsUnavailable):
                self.vectors.drop(chroma)
        shutil.rmtree(gone, ignore_errors=True)

    def tidy(self) -> None:
        """At startup: finish deletions and creations a crash interrupted, and drop chroma
        collections no localm collection names."""
        for path in self.root.iterdir():
            if path.name.startswith((".trash-", ".new-")):
                shutil.rmtree(path, ignore_errors=True)
        if self.vectors.error is not None or not (self.vectors.folder / "chroma.sqlite3").exists():
            return
        known: set[str] = set()
        for name in self.names():
            with contextlib.suppress(sqlite3.DatabaseError):
                info = Collection(self, name).info()
                known.update(v for k, v in info.items() if k in ("chroma", "chroma_next"))
        try:
            for chroma in self.vectors.names():
                if chroma.startswith("lm-") and chroma not in known:
                    self.vectors.drop(chroma)
        except VectorsUnavailable:
            pass
