"""What a peer route costs: a chat through instance B forwarded to instance A (which has the
model loaded) against the same chat straight to A, in one run; and the resident memory of the
two instances sharing one load against two separate loads.

    .venv/bin/python bench/peers.py                      # about a minute
    .venv/bin/python bench/peers.py --rounds 20 --tokens 64 --ttft-rounds 60

It starts two ``localm serve`` processes (plugins chat, openai, llamacpp, remote) on temporary
data dirs sharing one runtime folder (LOCALM_RUNTIME_DIR), loads the default model
(SmolLM2-135M-Instruct) in A and routes it from B to A (``POST /v1/models/{model}/peer-route``).

- Throughput: ``--rounds`` rounds, each one streamed /v1/chat/completions of ``--tokens``
  tokens straight to A and one through B (the order alternates between rounds; each request a
  prompt not sent before, so no prompt cache helps either). Tokens/s is per stream, from its
  first content chunk to its last; reported: p50 of each and the ratio via B / straight
  (target >= 0.95).
- Time to first token: ``--ttft-rounds`` further pairs with ``max_tokens`` 1 (fresh prompts,
  alternating); reported: p50 of each and the p50 of the paired differences (target < 5 ms).
- Memory: the summed RSS of both processes while B routes to A (B has loaded nothing), then
  after B drops the route and loads the model itself (two separate loads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chat import new_prompt, running, stream_chat, took  # noqa: E402

from localm.sdk.testing import LocalmServer  # noqa: E402

PLUGINS = ["chat", "openai", "llamacpp", "remote"]


class Instance:
    """A ``localm serve`` process, named for ``running()``'s log tails."""

    def __init__(self, name: str, data_dir: Path, runtime: Path) -> None:
        self.name = name
        self.server = LocalmServer(data_dir, process=True, plugins=PLUGINS, env={"LOCALM_RUNTIME_DIR": str(runtime)})

    def log(self) -> str:
        return self.server.log()

    def stop(self) -> None:
        self.server.stop()

    def rss(self) -> int:
        return psutil.Process(self.server.pid).memory_info().rss


def instance_id(runtime: Path, pid: int) -> str:
    for path in (runtime / "instances").glob("*.json"):
        data = json.loads(path.read_text())
        if data["pid"] == pid:
            return data["instance_id"]
    raise RuntimeError(f"no registry entry for pid {pid}")


def p50(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="throughput pairs")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of a throughput stream")
    parser.add_argument("--ttft-rounds", type=int, default=40, help="time-to-first-token pairs")
    parser.add_argument("--keep", action="store_true", help="keep the work folder and its logs")
    args = parser.parse_args()
    t0 = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="localm-bench-peers-"))
    runtime = workdir / "rt"
    a = Instance("A", workdir / "a", runtime)
    b = Instance("B", workdir / "b", runtime)
    clients: dict[str, httpx.Client] = {}
    with running([a, b], workdir, args.keep, clients):
        a.server.start()
        b.server.start()
        clients["a"] = a.server.owner()
        clients["b"] = b.server.owner()
        clients["a"].timeout = clients["b"].timeout = httpx.Timeout(120)
        model = clients["a"].post("/v1/models/load").json()["model"]
        routed = clients["b"].post(f"/v1/models/{model}/peer-route",
                                   json={"instance_id": instance_id(runtime, a.server.pid), "api_key": ""})
        if routed.status_code != 200:
            raise RuntimeError(f"routing failed: {routed.status_code} {routed.text}")
        for target in ("a", "b", "a", "b"):  # warm both paths (connections, the model's first decode)
            stream_chat(clients[target], "Write a short poem about the sea.", 8, model)
        i = 0
        rows: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        for r in range(args.rounds):
            for target in (("a", "b") if r % 2 == 0 else ("b", "a")):
                rows[target].append(stream_chat(clients[target], new_prompt(i), args.tokens, model))
                i += 1
        ttft: dict[str, list[float]] = {"a": [], "b": []}
        diffs = []
        for r in range(args.ttft_rounds):
            pair = {}
            for target in (("a", "b") if r % 2 == 0 else ("b", "a")):
                pair[target] = stream_chat(clients[target], new_prompt(i) + " Begin.", 1, model)["ttft_ms"]
                i += 1
                ttft[target].append(pair[target])
            diffs.append(pair["b"] - pair["a"])
        loaded_b = clients["b"].get("/api/models/loaded").json()
        assert loaded_b["models"] == [] and loaded_b["peer_served"], loaded_b  # B loaded nothing
        shared = a.rss() + b.rss()
        clients["b"].delete(f"/v1/models/{model}/peer-route")
        clients["b"].post("/v1/models/load", json={"model": model})
        stream_chat(clients["b"], "Write a short poem about the sea.", 8, model)  # its pages touched, as A's are
        separate = a.rss() + b.rss()

    tok_a, tok_b = p50([r["tok_s"] for r in rows["a"]]), p50([r["tok_s"] for r in rows["b"]])
    print(f"model {model}; {args.rounds} throughput pairs of {args.tokens} tokens, {args.ttft_rounds} TTFT pairs")
    print(f"{'':<22} {'straight to A':>14} {'B -> A':>10}")
    print(f"{'tokens/s (p50)':<22} {tok_a:>14.1f} {tok_b:>10.1f}   ratio {tok_b / tok_a:.3f} (target >= 0.95)")
    print(f"{'TTFT ms (p50)':<22} {p50(ttft['a']):>14.2f} {p50(ttft['b']):>10.2f}   overhead p50 "
          f"{p50(diffs):.2f} ms (target < 5 ms)")
    print(f"resident memory, A + B: {shared / 2**20:.0f} MiB routed (one load) vs {separate / 2**20:.0f} MiB with "
          f"two separate loads ({(separate - shared) / 2**20:.0f} MiB saved)")
    print(took(t0, workdir, args.keep))


if __name__ == "__main__":
    main()
