"""What steering costs: tokens/s unsteered, with one SAE feature steered (a delta at one
layer), and with a 3-layer circuit (deltas at three layers), on the same model and server.

Run it from the repository root with the project's interpreter::

    .venv/bin/python bench/steering.py                      # SmolLM2-135M via transformers, 5 rounds
    .venv/bin/python bench/steering.py --rounds 9 --threads 2

It starts ``localm serve --plugins chat,transformers,steerprobe`` (the transformers plugin's
n_threads set before the model loads). ``steerprobe`` is the test plugin of
``tests/plugins/`` that turns a request's ``probe_delta`` into forward interventions through
the ``forward_interventions`` hook, the same seam the steering and circuits plugins use; the
deltas are what they compute, a decoder row times a strength (here rows of a random SAE
decoder of the model's width, one feature per layer, strength 8). Then it sends non-streamed
chat completions, greedy, ``--max-tokens`` tokens each, one at a time, the three variants
interleaved in a rotating order:

- ``unsteered``: no intervention;
- ``one feature``: one delta at layer 15 (of SmolLM2's 30);
- ``3-layer circuit``: deltas at layers 5, 15 and 25.

tokens/s is completion tokens over the request's wall time minus its ``usage.ttft_ms``; the
ratio is against ``unsteered`` in the same run (the target: steering costs under 10%).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from localm.sdk.testing import LocalmServer

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
HIDDEN = 576  # SmolLM2-135M's residual width
PROMPT = [{"role": "user", "content": "Write a long story about the sea."}]


def decoder_row(seed: int, strength: float = 8.0) -> list[float]:
    rng = random.Random(seed)
    row = [rng.gauss(0.0, 1.0) for _ in range(HIDDEN)]
    norm = sum(x * x for x in row) ** 0.5
    return [strength * x / norm for x in row]


VARIANTS: dict[str, list[dict[str, Any]] | None] = {
    "unsteered": None,
    "one feature": [{"layer": 15, "delta": decoder_row(1)}],
    "3-layer circuit": [{"layer": layer, "delta": decoder_row(layer)} for layer in (5, 15, 25)],
}


def measure(client: httpx.Client, variant: str, max_tokens: int) -> dict[str, float]:
    body: dict[str, Any] = {"model": MODEL, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    if VARIANTS[variant] is not None:
        body["probe_delta"] = VARIANTS[variant]
    started = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body)
    wall = time.perf_counter() - started
    r.raise_for_status()
    usage = r.json()["usage"]
    generating = wall - usage["ttft_ms"] / 1000
    return {"tokens": usage["completion_tokens"], "tok_s": (usage["completion_tokens"] - 1) / generating}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1,
                        help="PyTorch threads (1 is fastest for this model on a 2-CPU machine)")
    args = parser.parse_args()
    print(f"SmolLM2-135M-Instruct via transformers, {args.threads} threads, {args.max_tokens} tokens, "
          f"{args.rounds} rounds, load average {os.getloadavg()[0]:.2f}")
    env = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9",
           "LOCALM_PLUGIN_STORE": str(ROOT / "tests" / "plugins")}
    with tempfile.TemporaryDirectory(prefix="localm-bench-steering-") as tmp:
        server = LocalmServer(Path(tmp) / "data", plugins=["chat", "transformers", "steerprobe"], env=env)
        installed = server.cli("plugin", "install", "steerprobe")
        if installed.returncode:
            sys.exit(installed.stderr + installed.stdout)
        server.start()
        try:
            server.owner().post("/v1/plugins/transformers/settings",
                                json={"n_threads": args.threads}).raise_for_status()
            rows: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
            with httpx.Client(base_url=server.url, timeout=600) as client:
                for variant in VARIANTS:  # warm-up: load the model
                    measure(client, variant, 8)
                names = list(VARIANTS)
                for i in range(args.rounds):
                    for variant in names[i % len(names):] + names[:i % len(names)]:
                        rows[variant].append(measure(client, variant, args.max_tokens))
        finally:
            server.stop()
    base = statistics.median(row["tok_s"] for row in rows["unsteered"])
    print(f"  {'variant':<18}{'tokens/s':>10}{'ratio':>8}{'tokens':>8}   (median; tokens/s min-max)")
    for variant, measured in rows.items():
        values = [row["tok_s"] for row in measured]
        median = statistics.median(values)
        tokens = statistics.median(row["tokens"] for row in measured)
        print(f"  {variant:<18}{median:>10.1f}{median / base:>8.2f}{tokens:>8.0f}   "
              f"({min(values):.1f}-{max(values):.1f})")


if __name__ == "__main__":
    main()
