"""What steering costs: tokens/s unsteered, with one SAE feature steered, and with a 3-layer
circuit, on the same model and server, for each engine.

Run it from the repository root with the project's interpreter::

    .venv/bin/python bench/steering.py                      # SmolLM2-135M on both engines, 5 rounds
    .venv/bin/python bench/steering.py --engine llamacpp --rounds 9

For each engine it starts ``localm serve --plugins chat,ENGINE,steering,circuits`` (the
engine plugin's n_threads set before the model loads: ``--threads`` for transformers, every
CPU for llama.cpp, as it serves by default), writes three SAELens SAEs of SmolLM2's
width (576; 64 features, random unit decoder rows) for layers 5, 15 and 25, registers and
attaches them through ``/api/saes``, saves a profile steering one feature of the layer-15
SAE (strength 8) and imports a circuit with one member on each of the three layers
(strength 8 each). Then it sends non-streamed chat completions, greedy, ``--max-tokens``
tokens each, one at a time, the three variants interleaved in a rotating order:

- ``unsteered``: no steering field (no live features, no active profile or circuit);
- ``one feature``: ``profile`` naming the one-feature profile;
- ``3-layer circuit``: ``circuit`` naming the circuit.

tokens/s is completion tokens over the request's wall time minus its ``usage.ttft_ms``; the
ratio is against ``unsteered`` on the same engine in the same run (the targets: steering
costs under 10% on transformers, under 5% on llama.cpp). The last lines put the engines side
by side: llama.cpp's tokens/s over transformers', per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from localm.sdk.testing import LocalmServer
from safetensors.numpy import save_file

MODEL = "smollm2-135m-instruct"
HIDDEN, WIDTH, LAYERS = 576, 64, (5, 15, 25)  # SmolLM2-135M's residual width; SAE features; layers
PROMPT = [{"role": "user", "content": "Write a long story about the sea."}]
VARIANTS: dict[str, dict[str, Any]] = {
    "unsteered": {},
    "one feature": {"profile": "one-feature"},
    "3-layer circuit": {"circuit": "three-layers"},
}


def write_sae(folder: Path, layer: int) -> Path:
    rng = np.random.default_rng(layer)
    w_dec = rng.standard_normal((WIDTH, HIDDEN)).astype(np.float32)
    w_dec /= np.linalg.norm(w_dec, axis=1, keepdims=True)
    folder.mkdir(parents=True)
    (folder / "cfg.json").write_text(json.dumps({"d_in": HIDDEN, "d_sae": WIDTH, "dtype": "float32",
                                                 "hook_name": f"blocks.{layer}.hook_resid_post",
                                                 "hook_layer": layer}))
    save_file({"W_enc": np.ascontiguousarray(w_dec.T), "b_enc": np.zeros(WIDTH, np.float32), "W_dec": w_dec,
               "b_dec": np.zeros(HIDDEN, np.float32)}, str(folder / "sae_weights.safetensors"))
    return folder


def set_up(owner: httpx.Client, workdir: Path) -> None:
    for layer in LAYERS:
        path = write_sae(workdir / f"sae-{layer}", layer)
        owner.post("/api/saes", json={"path": str(path), "id": f"sae-{layer}"}).raise_for_status()
        owner.post(f"/api/saes/sae-{layer}/attach").raise_for_status()
    owner.post("/api/profiles", json={"name": "one-feature", "sae": {"id": "sae-15"},
                                      "features": [{"index": 3, "strength": 8.0}]}).raise_for_status()
    owner.post("/api/circuits", json={"name": "three-layers", "rung": 1, "members": [
        {"layer": layer, "feature": 3, "strength": 8.0} for layer in LAYERS]}).raise_for_status()


def measure(client: httpx.Client, variant: str, max_tokens: int) -> dict[str, float]:
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, **VARIANTS[variant]}
    started = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body)
    wall = time.perf_counter() - started
    r.raise_for_status()
    if variant == "3-layer circuit" and "x-millm-circuit-rung" not in r.headers:
        sys.exit("the circuit did not steer (no X-miLLM-Circuit-Rung)")
    usage = r.json()["usage"]
    generating = wall - usage["ttft_ms"] / 1000
    return {"tokens": usage["completion_tokens"], "tok_s": (usage["completion_tokens"] - 1) / generating}


def run(engine: str, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    env = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    threads = args.threads if engine == "transformers" else 0
    with tempfile.TemporaryDirectory(prefix="localm-bench-steering-") as tmp:
        server = LocalmServer(Path(tmp) / "data", process=True, plugins=["chat", engine, "steering", "circuits"], env=env)
        server.start()
        try:
            owner = server.owner()
            owner.post(f"/v1/plugins/{engine}/settings", json={"n_threads": threads}).raise_for_status()
            set_up(owner, Path(tmp))
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
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["both", "llamacpp", "transformers"], default="both")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1,
                        help="PyTorch threads (1 is fastest for this model on a 2-CPU machine)")
    args = parser.parse_args()
    engines = ["llamacpp", "transformers"] if args.engine == "both" else [args.engine]
    print(f"SmolLM2-135M-Instruct on {' and '.join(engines)}, {args.max_tokens} tokens, {args.rounds} rounds, "
          f"transformers on {args.threads} threads, llama.cpp on {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    targets = {"llamacpp": 0.95, "transformers": 0.9}
    medians: dict[str, dict[str, float]] = {}
    for engine in engines:
        rows = run(engine, args)
        medians[engine] = {variant: statistics.median(row["tok_s"] for row in measured)
                           for variant, measured in rows.items()}
        base = medians[engine]["unsteered"]
        print(f"\n{engine} (model file: the GGUF; steering ratio target >= {targets[engine]})")
        print(f"  {'variant':<18}{'tokens/s':>10}{'ratio':>8}{'tokens':>8}   (median; tokens/s min-max)")
        for variant, measured in rows.items():
            values = [row["tok_s"] for row in measured]
            median = medians[engine][variant]
            tokens = statistics.median(row["tokens"] for row in measured)
            verdict = "" if variant == "unsteered" else "  met" if median / base >= targets[engine] else "  NOT MET"
            print(f"  {variant:<18}{median:>10.1f}{median / base:>8.2f}{tokens:>8.0f}   "
                  f"({min(values):.1f}-{max(values):.1f}){verdict}")
    if len(medians) == 2:
        print("\nllama.cpp over transformers, tokens/s:")
        for variant in VARIANTS:
            print(f"  {variant:<18}{medians['llamacpp'][variant] / medians['transformers'][variant]:>8.2f}x")
    print(f"\nload average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
