"""The growing context window: time to first token of a 6,000-token prompt on a model opened
at the default n_ctx (4,096), whose window grows for it, against the same model opened at
8,192 from the start, in the same run.

    .venv/bin/python bench/context.py                  # about two minutes on 2 CPUs
    .venv/bin/python bench/context.py --rounds 7 --prompt-tokens 6000

Two ``localm serve --plugins chat,llamacpp`` servers on 127.0.0.1, each on a fresh data dir,
the llamacpp plugin set to the same ``n_threads`` and ``n_batch``: **grows** keeps the
default ``n_ctx`` 4096; **fixed** has ``n_ctx`` 8192. Each round, on each server in turn
(alternating which goes first): the model is unloaded and loaded again (outside the timing),
so the grows server starts the round at 4,096 and its first request opens the larger window;
then one streamed chat request with a prompt neither server has seen (``max_tokens`` 16)
is timed from sending it to its first content chunk (TTFT). A second request with another
new prompt, on the window already grown, is timed too (**steady**). The table gives medians
and the ratio fixed/grows (target >= 0.9 for the first request).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from localm.sdk.testing import LocalmServer  # noqa: E402

MODEL = "smollm2-135m-instruct"


def prompt(n: int, tokens: int) -> str:
    """A prompt of about ``tokens`` tokens that no earlier request began with."""
    common = ("the sea and the boat went out to the bay at dawn while gulls called over the harbour wall and "
              "fishermen mended their nets in the cold morning light").split()
    words = [common[k % len(common)] for k in range(tokens - 40)]
    return f"Request {n}: read this text and say only OK.\n" + " ".join(words)


def ttft(server: LocalmServer, text: str) -> tuple[float, int, int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 16, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    started = time.perf_counter()
    first = None
    usage: dict[str, Any] = {}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    return ((first or time.perf_counter()) - started) * 1000, usage.get("prompt_tokens", 0), \
        usage.get("context_capacity", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=6000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-batch", type=int, default=512)
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="localm-bench-context-"))
    servers: dict[str, LocalmServer] = {}
    try:
        for name, n_ctx in (("grows", 4096), ("fixed", 8192)):
            data = work / name
            data.mkdir()
            settings = {"llamacpp": {"n_threads": args.threads, "n_batch": args.n_batch, "n_ctx": n_ctx}}
            (data / "config.json").write_text(json.dumps({"plugins": settings}))
            servers[name] = LocalmServer(data, process=True, plugins=["chat", "llamacpp"]).start()
        rows: dict[str, dict[str, list[float]]] = {name: {"first": [], "steady": []} for name in servers}
        seen: dict[str, tuple[int, int]] = {}
        n = 0
        for round_ in range(args.rounds + 1):  # round 0 warms both up and is not counted
            order = list(servers) if round_ % 2 else list(reversed(servers))
            for name in order:
                server = servers[name]
                owner = server.owner()
                owner.post("/v1/models/unload", params={"model": MODEL})
                owner.post("/v1/models/load", params={"model": MODEL}).raise_for_status()
                window = owner.get(f"/v1/models/{MODEL}").json().get("context_capacity")
                n += 1
                first, tokens, capacity = ttft(server, prompt(n, args.prompt_tokens))
                n += 1
                steady, _, _ = ttft(server, prompt(n, args.prompt_tokens))
                seen[name] = (window, capacity)
                if round_:
                    rows[name]["first"].append(first)
                    rows[name]["steady"].append(steady)
                    print(f"round {round_} {name}: loaded at {window}, served at {capacity}, prompt {tokens} tokens,"
                          f" TTFT {first:.0f} ms, then {steady:.0f} ms", file=sys.stderr)
        print(f"prompt ~{args.prompt_tokens} tokens, {args.threads} threads, n_batch {args.n_batch}, "
              f"{args.rounds} rounds (medians)")
        print(f"{'':28}{'grows (4096 →)':>16}{'fixed (8192)':>14}{'fixed/grows':>13}")
        for key, label in (("first", "TTFT, first request (ms)"), ("steady", "TTFT, next request (ms)")):
            g, f = statistics.median(rows["grows"][key]), statistics.median(rows["fixed"][key])
            target = "   (target >= 0.9)" if key == "first" else ""
            print(f"{label:28}{g:>16.0f}{f:>14.0f}{f / g:>13.2f}{target}")
        print(f"windows (loaded at, served at): grows {seen['grows']}, fixed {seen['fixed']}")
    finally:
        for server in servers.values():
            server.stop()
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
