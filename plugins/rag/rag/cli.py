"""``localm rag``: collections from the command line, through the running server, or through
one started in this process on the data dir when none runs (``sdk.server``)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from localm import sdk


def _follow(server: sdk.ServerClient, job_id: str, label: str) -> dict[str, Any]:
    """Follow a job's events with a progress bar; its result, or its failure as an error."""
    end: dict[str, Any] = {}
    with click.progressbar(length=1000, label=label, show_eta=False, file=sys.stderr,
                           item_show_func=lambda item: item) as bar:
        shown = 0
        for event in server.events(f"/api/jobs/{job_id}/events"):
            if event.get("type") == "progress":
                if event.get("progress") is not None:
                    target = int(1000 * event["progress"])
                    if target > shown:
                        bar.update(target - shown, event.get("message"))
                        shown = target
                elif event.get("message"):
                    bar.update(0, event["message"])
            elif event.get("type") == "end":
                end = event
                if shown < 1000 and end.get("status") == "done":
                    bar.update(1000 - shown)
                break
    if end.get("status") != "done":
        raise sdk.LocalmError(500, f"The job {end.get('status', 'ended')}: {end.get('error') or 'no result'}")
    return end.get("result") or {}


def _summary(result: dict[str, Any]) -> None:
    parts = [f"{len(result.get(k, []))} {k}" for k in ("added", "updated", "unchanged", "failed")]
    click.echo(f"{result.get('collection')}: " + ", ".join(parts) + f"; {result.get('chunks', 0)} chunks"
               + ("" if result.get("embedded") else " (lexical only)"))
    for item in result.get("failed", []):
        click.echo(f"  failed: {item['path']}: {item['error']}")
    for path in result.get("missing", []):
        click.echo(f"  missing: {path}")
    if result.get("vector_degrade_reason"):
        click.echo(f"  note: {result['vector_degrade_reason']}")


@click.group("rag", help="Knowledge collections: create them, add files, search, remove, repair.")
def rag() -> None:
    pass


@rag.command("create", help="Create an empty collection.")
@click.argument("name")
def create(name: str) -> None:
    with sdk.server() as server:
        out = server.call("POST", "/api/rag/collections", json={"name": name})
    click.echo(f"created {out['name']}")


@rag.command("add", help="Index files and folders into a collection (created if needed).")
@click.argument("name")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, resolve_path=True))
@click.option("--no-embed", is_flag=True, help="Index for lexical search only.")
@click.option("--reindex", is_flag=True, help="Re-index files even when they did not change.")
@click.option("--yes", "consent", is_flag=True, help="Consent to indexing folders outside allowed_roots.")
def add(name: str, paths: tuple[str, ...], no_embed: bool, reindex: bool, consent: bool) -> None:
    with sdk.server() as server:
        try:
            server.call("GET", f"/api/rag/collections/{name}")
        except sdk.ServerError as exc:
            if exc.status != 404:
                raise
            server.call("POST", "/api/rag/collections", json={"name": name})
        body = {"paths": list(paths), "embed": not no_embed, "reindex": reindex, "consent": consent}
        try:
            job = server.call("POST", f"/api/rag/collections/{name}/add", json=body)
        except sdk.ServerError as exc:
            if exc.status == 409 and "consent" in exc.detail:
                raise sdk.LocalmError(409, exc.detail.split(": re-send")[0] + ": run again with --yes to index "
                                           "them anyway") from None
            raise
        _summary(_follow(server, job["job_id"], f"indexing {name}"))


@rag.command("ls", help="List collections, or one collection's documents.")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ls(name: str | None, as_json: bool) -> None:
    with sdk.server() as server:
        out = server.call("GET", f"/api/rag/collections/{name}" if name else "/api/rag/collections")
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    if name is None:
        for c in out["collections"]:
            vectors = f"{c['vector_dim']}-dim vectors" if c["has_vectors"] else "lexical only"
            missing = f", {c['n_missing']} missing" if c["n_missing"] else ""
            click.echo(f"{c['name']}\t{c['n_docs']} docs{missing}, {c['n_chunks']} chunks, {vectors}")
        return
    for d in out["docs"]:
        click.echo(f"{d['path']}\t{d['chunks']} chunks{' (missing)' if d['missing'] else ''}")


@rag.command("query", help="Search a collection.")
@click.argument("name")
@click.argument("text")
@click.option("-k", default=4, show_default=True, help="Hits to return (1-20).")
@click.option("--relevant-only", is_flag=True, help="Drop hits below the collection's relevance floor.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def query(name: str, text: str, k: int, relevant_only: bool, as_json: bool) -> None:
    with sdk.server() as server:
        out = server.call("POST", f"/api/rag/collections/{name}/query",
                          json={"query": text, "k": k, "relevant_only": relevant_only})
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    if not out["hits"]:
        click.echo("no hits")
    for n, h in enumerate(out["hits"], 1):
        where = h["filename"] + (f" ({h['heading']})" if h.get("heading") else "")
        snippet = " ".join(h["text"].split())[:160]
        click.echo(f"[{n}] {where}  score {h['score']:.4f}\n    {snippet}")


@rag.command("rm", help="Delete a collection, or with --doc remove one document from it.")
@click.argument("name")
@click.option("--doc", "doc", default=None, help="The path of one document to remove.")
def rm(name: str, doc: str | None) -> None:
    with sdk.server() as server:
        if doc is None:
            server.call("DELETE", f"/api/rag/collections/{name}")
            click.echo(f"deleted {name}")
        else:
            server.call("POST", f"/api/rag/collections/{name}/remove-doc", json={"path": doc})
            click.echo(f"removed {doc} from {name}")


@rag.command("repair", help="Re-index every document that can be rebuilt.")
@click.argument("name")
@click.option("--no-embed", is_flag=True, help="Rebuild for lexical search only (removes vectors).")
@click.option("--yes", "confirm", is_flag=True, help="Confirm removing vectors with --no-embed.")
def repair(name: str, no_embed: bool, confirm: bool) -> None:
    with sdk.server() as server:
        out = server.call("POST", f"/api/rag/collections/{name}/repair",
                          json={"embed": not no_embed, "confirm": confirm})
        if out.get("needs_confirm"):
            raise sdk.LocalmError(409, out["detail"].replace('Re-send with "confirm": true', "Run again with --yes"))
        result = _follow(server, out["job_id"], f"repairing {name}")
    _summary(result)
    for key, label in (("uploads_not_rebuilt", "upload, not rebuilt"), ("missing_not_rebuilt", "missing, kept")):
        for path in result.get(key, []):
            click.echo(f"  {label}: {path}")
