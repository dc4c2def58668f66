"""The memory routes, /api/memory* (scope ``memory``)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any

from localm import sdk

from . import schema
from .service import clean
from .store import KINDS, MAX_CHARS, item, pack

#: The largest body a write route reads (832,000 bytes): everything memory can hold, as JSON
#: at its most escaped (a character as a 12-byte surrogate pair), and room for the rest. A
#: larger one is a 413 before it is read.
MAX_BODY = 13 * MAX_CHARS


async def _body(request: sdk.Request) -> dict[str, Any]:
    return await sdk.json_body(request, empty={})


def _text(body: dict[str, Any]) -> str:
    value = body.get("text")
    if not isinstance(value, str):
        raise sdk.LocalmError(400, "text must be a string", code="invalid_parameter")
    text = clean(value)
    if not text:
        raise sdk.LocalmError(400, "text must not be empty", code="empty_text")
    if len(text) > MAX_CHARS:
        raise sdk.LocalmError(413, f"The fact is {len(text)} characters: memory holds at most {MAX_CHARS} in all",
                              code="memory_full")
    return text


def _importance(body: dict[str, Any], default: float | None) -> float | None:
    value = body.get("importance", default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise sdk.LocalmError(400, "importance must be a number from 0 to 1", code="invalid_parameter")
    return float(value)


@sdk.get("/api/memory", summary="The saved facts, pending corrections, and whether memory is writable")
async def read_memory(request: sdk.Request) -> dict[str, Any]:
    m = sdk.service_of(request)
    rows = await asyncio.to_thread(m.store.facts)
    corrections = await asyncio.to_thread(m.store.corrections) if m.writable else []
    return {"text": "\n".join(r["text"] for r in rows), "writable": m.writable, "items": [item(r) for r in rows],
            "corrections": [{"id": c["id"], "action": c["action"], "proposed_text": c["proposed_text"],
                             "target_id": c["target_id"], "target_text": c["target_text"],
                             "confidence": c["confidence"], "created": c["created"],
                             "target_updated": c["target_updated"]} for c in corrections],
            "path": str(m.store.path), "can_download_embedder": m.can_download(),
            "embedder_model": m.embedder_name()}


@sdk.put("/api/memory", summary="Bulk edit: one fact per line", body=schema.BulkEdit, errors=schema.WRITE,
          request_max_body_size=MAX_BODY)
async def bulk_edit(request: sdk.Request) -> dict[str, Any]:
    m = sdk.service_of(request)
    m.check_writable()
    body = await _body(request)
    if not isinstance(body.get("text"), str):
        raise sdk.LocalmError(400, "text must be a string (one fact per line)", code="invalid_parameter")
    lines = list(dict.fromkeys(line for line in (clean(x) for x in body["text"].splitlines()) if line))
    wanted = set(lines)

    def changes(conn: Any) -> tuple[list[Any], list[str]]:
        """(the records to delete, the lines to add), refused with a 413 past the caps."""
        rows = conn.execute("SELECT * FROM facts").fetchall()
        existing = {r["text"] for r in rows}
        gone = [r for r in rows if r["text"] not in wanted]
        new = [line for line in lines if line not in existing]
        m.store.check_caps(conn, adding=len(new), chars=sum(map(len, new)), removing=len(gone),
                           removing_chars=sum(len(r["text"]) for r in gone))
        return gone, new

    def plan() -> list[str]:
        with m.store.connect() as conn:
            return changes(conn)[1]
    # refused before any embedding; only the lines that are new are embedded
    fresh = await asyncio.to_thread(plan)
    m.store.claim()  # a 409 before any embedding
    entry, vectors, _ = await m.embed(fresh) if fresh else (None, None, None)
    vector_of = dict(zip(fresh, vectors)) if vectors else {}

    def save() -> int:
        with m.store.write() as conn:
            gone, new = changes(conn)  # again, inside the transaction
            for row in gone:
                m.store.delete(conn, row, "bulk_edit")
            for line in new:
                m.store.insert(conn, line, source="manual", vector=vector_of.get(line),
                               model=entry.id if entry and line in vector_of else None)
            return len(lines)
    count = await asyncio.to_thread(save)
    m.forget_vectors()
    return {"status": "saved", "count": count}


@sdk.post("/api/memory/append", summary="Add one fact", body=schema.Append, errors=schema.WRITE,
          request_max_body_size=MAX_BODY)
async def append(request: sdk.Request) -> dict[str, Any]:
    m = sdk.service_of(request)
    m.check_writable()
    body = await _body(request)
    text = _text(body)
    importance = _importance(body, 0.5)
    kind = body.get("kind", "fact")
    if kind not in KINDS:
        raise sdk.LocalmError(400, f"kind must be one of {', '.join(KINDS)}", code="invalid_parameter")

    def fits() -> None:
        with m.store.connect() as conn:
            m.store.check_caps(conn, adding=1, chars=len(text))
    await asyncio.to_thread(fits)  # refused before any embedding (and again inside the transaction)
    m.store.claim()  # a 409 before any embedding
    entry, vectors, _ = await m.embed([text])

    def save() -> str:
        with m.store.write() as conn:
            m.store.check_caps(conn, adding=1, chars=len(text))
            return m.store.insert(conn, text, source="manual", kind=kind, importance=importance or 0.5,
                                  vector=vectors[0] if vectors else None, model=entry.id if entry else None)
    fact_id = await asyncio.to_thread(save)
    m.forget_vectors()
    return {"status": "appended", "id": fact_id}


@sdk.patch("/api/memory/{fact_id:str}", summary="Edit one fact's text or importance", body=schema.Edit,
           errors={**schema.WRITE, 404: "No such fact (fact_not_found)"}, request_max_body_size=MAX_BODY)
async def edit(request: sdk.Request, fact_id: str) -> dict[str, Any]:
    m = sdk.service_of(request)
    m.check_writable()
    body = await _body(request)
    if "text" not in body and "importance" not in body:
        raise sdk.LocalmError(400, "Send text, importance or both", code="invalid_parameter")
    text = _text(body) if "text" in body else None
    importance = _importance(body, None)

    def check(conn: Any) -> Any:
        row = conn.execute("SELECT * FROM facts WHERE id = ?", (fact_id,)).fetchone()
        if row is None:
            raise sdk.LocalmError(404, f"No fact {fact_id}", code="fact_not_found")
        if text is not None and text != row["text"]:
            m.store.check_caps(conn, chars=len(text), removing_chars=len(row["text"]))
        return row

    def fits() -> Any:
        with m.store.connect() as conn:
            return check(conn)
    before = await asyncio.to_thread(fits)  # refused before any embedding (and again inside the transaction)
    m.store.claim()  # a 409 before any embedding
    changed = text is not None and text != before["text"]
    entry, vectors, _ = await m.embed([text]) if changed else (None, None, None)

    def save() -> Any:
        with m.store.write() as conn:
            row = check(conn)
            if text is not None and text != row["text"]:
                m.store.archive(conn, row, "edited")
                conn.execute("UPDATE facts SET text = ?, vec = ?, vec_model = ?, updated = ? WHERE id = ?",
                             (text, None if vectors is None else pack(vectors[0]),
                              entry.id if entry else None, time.time(), fact_id))
            if importance is not None:
                conn.execute("UPDATE facts SET importance = ?, updated = ? WHERE id = ?",
                             (importance, time.time(), fact_id))
            return conn.execute("SELECT * FROM facts WHERE id = ?", (fact_id,)).fetchone()
    row = await asyncio.to_thread(save)
    m.forget_vectors()
    return {"status": "saved", "item": item(row)}


@sdk.delete("/api/memory/{fact_id:str}", summary="Delete one fact (it is archived)",
            errors={403: "Memory is in privacy mode (privacy_mode)"})
async def forget(request: sdk.Request, fact_id: str) -> dict[str, Any]:
    m = sdk.service_of(request)
    m.check_writable()

    def drop() -> str:
        with m.store.write() as conn:
            row = conn.execute("SELECT * FROM facts WHERE id = ?", (fact_id,)).fetchone()
            if row is None:
                return "absent"
            m.store.delete(conn, row, "deleted")
            return "deleted"
    status = await asyncio.to_thread(drop)
    m.forget_vectors()
    return {"status": status, "id": fact_id}


async def _correction(m: Any, correction_id: str, accept: bool) -> dict[str, Any]:
    m.check_writable()
    entry, vectors = None, None
    found = next((c for c in await asyncio.to_thread(m.store.corrections) if c["id"] == correction_id), None)
    if found is None:
        raise sdk.LocalmError(404, f"No correction {correction_id}", code="correction_not_found")
    m.store.claim()  # a 409 before any embedding
    if accept and found["action"] == "update" and found["proposed_text"]:
        entry, vectors, _ = await m.embed([found["proposed_text"]])

    def apply() -> dict[str, Any]:
        with m.store.write() as conn:
            c = conn.execute("SELECT * FROM corrections WHERE id = ?", (correction_id,)).fetchone()
            if c is None:
                raise sdk.LocalmError(404, f"No correction {correction_id}", code="correction_not_found")
            out = {"id": c["id"], "target_id": c["target_id"], "action": c["action"]}
            target = conn.execute("SELECT * FROM facts WHERE id = ?", (c["target_id"],)).fetchone()
            conn.execute("DELETE FROM corrections WHERE id = ?", (correction_id,))
            if target is None:
                return {"status": "target_gone", **out}
            if not accept:
                return {"status": "rejected", **out}
            if c["action"] == "update":  # within the caps, or a 413 that changes nothing (the proposal stays)
                m.store.check_caps(conn, chars=len(c["proposed_text"] or ""), removing_chars=len(target["text"]))
            try:
                m.store.archive(conn, target, "corrected")
            except sqlite3.Error as exc:
                raise sdk.LocalmError(500, f"The old value could not be archived ({exc}); nothing was applied",
                                      code="archive_failed") from None
            if c["action"] == "delete":
                conn.execute("DELETE FROM facts WHERE id = ?", (target["id"],))
                return {"status": "deleted", **out}
            conn.execute("UPDATE facts SET text = ?, vec = ?, vec_model = ?, updated = ? WHERE id = ?",
                         (c["proposed_text"], None if vectors is None else pack(vectors[0]),
                          entry.id if entry else None, time.time(), target["id"]))
            return {"status": "updated", **out}
    out = await asyncio.to_thread(apply)
    m.forget_vectors()
    return out


@sdk.post("/api/memory/corrections/{correction_id:str}/accept", summary="Apply a proposed correction",
          errors={403: "Memory is in privacy mode", 404: "No such correction (correction_not_found)"})
async def accept(request: sdk.Request, correction_id: str) -> dict[str, Any]:
    return await _correction(sdk.service_of(request), correction_id, True)


@sdk.post("/api/memory/corrections/{correction_id:str}/reject", summary="Discard a proposed correction",
          errors={403: "Memory is in privacy mode", 404: "No such correction (correction_not_found)"})
async def reject(request: sdk.Request, correction_id: str) -> dict[str, Any]:
    return await _correction(sdk.service_of(request), correction_id, False)


@sdk.post("/api/memory/consolidate", summary="Distil durable facts from recent sessions now")
async def consolidate(request: sdk.Request) -> dict[str, Any]:
    return await sdk.service_of(request).consolidate()


@sdk.get("/api/memory/forgotten", summary="Archived (forgotten) facts, for recovery")
async def forgotten(request: sdk.Request) -> dict[str, Any]:
    m = sdk.service_of(request)
    return {"items": await asyncio.to_thread(m.store.forgotten)}


@sdk.post("/api/memory/forgotten/{archive_id:str}/restore", summary="Bring an archived fact back",
          errors={403: "Memory is in privacy mode", 404: "No such archived fact (archive_not_found)",
                  413: "Past the memory's caps"})
async def restore(request: sdk.Request, archive_id: str) -> dict[str, Any]:
    m = sdk.service_of(request)
    m.check_writable()

    def back() -> Any:
        with m.store.write() as conn:
            a = conn.execute("SELECT * FROM archive WHERE id = ?", (archive_id,)).fetchone()
            if a is None:
                raise sdk.LocalmError(404, f"No archived fact {archive_id}", code="archive_not_found")
            m.store.check_caps(conn, adding=1, chars=len(a["text"]))
            taken = conn.execute("SELECT 1 FROM facts WHERE id = ?", (a["fact_id"],)).fetchone()
            fact_id = m.store.insert(conn, a["text"], source=a["source"], kind=a["kind"],
                                     importance=a["importance"], fact_id=None if taken else a["fact_id"])
            conn.execute("DELETE FROM archive WHERE id = ?", (archive_id,))
            return conn.execute("SELECT * FROM facts WHERE id = ?", (fact_id,)).fetchone()
    row = await asyncio.to_thread(back)
    m.forget_vectors()
    return {"status": "restored", "item": item(row)}


HANDLERS = [read_memory, bulk_edit, append, edit, forget, accept, reject, consolidate, forgotten, restore]
