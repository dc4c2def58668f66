"""Speculative decoding at a long context: localm's drafting on and off, with flash attention on
and off, on replies that follow a few thousand tokens of earlier text (a RAG answer's sources, a
long conversation).

Run it from the repository root with the project's interpreter::

    .venv/bin/python bench/speculation_context.py                    # about 12 minutes on a 2-CPU machine
    .venv/bin/python bench/speculation_context.py --rounds 5 --notes-chars 12000 --tasks quote,edit,free

``bench/speculation.py`` measures short prompts (about 300 tokens), where a checked row's cost
barely depends on the context. Here every prompt of its tasks is preceded by ``--notes-chars``
characters of the project's own docs (docs/plugins.md, then docs/models.md: about 2,000 tokens
for the default 7,000), so each step attends to a long cache. For each ``flash_attn`` setting
of ``--flash-attn`` a ``localm serve --plugins chat,llamacpp`` (``n_parallel`` 1, ``n_threads``,
``n_ctx`` 8192) reads each prompt once (a request of 8 tokens: the prompt stays in the slot's
cache), then answers it ``--rounds`` times with ``spec_source`` off and ngram in turn (temperature
0, ``max_tokens``, the prompt reused from the cache). tokens/s is the decode rate: the reply's
tokens after the first over the time from the first content chunk to the last, so the prompt's
reading (far slower without flash attention, see bench/attention.py) is left out.

Printed: per task and setting, the median decode rate off and with ngram, their ratio, the
drafted and accepted tokens, and the ratio of each to the same configuration with flash
attention on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat import Localm, running, took  # noqa: E402
from speculation import TASKS, stream  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NOTES = ("docs/plugins.md", "docs/models.md")


class ContextLocalm(Localm):
    """localm with one slot, a window of ``n_ctx`` and the given ``flash_attn``."""

    def __init__(self, args: argparse.Namespace, workdir: Path, flash: bool) -> None:
        super().__init__(args, workdir / f"flash-{'on' if flash else 'off'}")
        self.name = f"localm, flash_attn {'on' if flash else 'off'}"
        self.settings.update({"n_parallel": 1, "flash_attn": flash})


def notes(chars: int) -> str:
    text = "\n\n".join((ROOT / name).read_text() for name in NOTES)
    return text[:chars]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--threads", type=int, default=2, help="n_threads (and n_threads_batch)")
    parser.add_argument("--n-ctx", type=int, default=8192, help="context window")
    parser.add_argument("--n-batch", type=int, default=512, help="n_batch")
    parser.add_argument("--notes-chars", type=int, default=7000, help="characters of earlier text before each prompt")
    parser.add_argument("--max-tokens", type=int, default=256, help="max_tokens per request (8-1024)")
    parser.add_argument("--rounds", type=int, default=3, help="requests of each configuration per prompt (1-20)")
    parser.add_argument("--tasks", default="quote,edit", help="comma-separated: quote, edit, free")
    parser.add_argument("--flash-attn", default="on,off", help="comma-separated flash_attn settings: on, off")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every request")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (server logs)")
    args = parser.parse_args()
    tasks = [t for t in args.tasks.split(",") if t]
    flashes = [f for f in args.flash_attn.split(",") if f]
    if not tasks or any(t not in TASKS for t in tasks):
        sys.exit(f"--tasks takes a comma-separated list of {', '.join(TASKS)}")
    if not flashes or any(f not in ("on", "off") for f in flashes):
        sys.exit("--flash-attn takes on, off or on,off")
    if not 1 <= args.rounds <= 20 or not 8 <= args.max_tokens <= 1024 or not 0 <= args.notes_chars <= 200_000:
        sys.exit("--rounds takes 1-20, --max-tokens 8-1024, --notes-chars 0-200000")
    args.model = args.model and args.model.resolve()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout` still stops the servers
    t0 = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="localm-bench-spec-context-"))
    servers = [ContextLocalm(args, workdir, f == "on") for f in flashes]
    earlier = notes(args.notes_chars)
    # results[server][task]: {"off": [rows], "ngram": [rows]}
    results: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    prompt_tokens: dict[str, int] = {}
    with running(servers, workdir, args.keep):
        print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; n_threads {args.threads}, n_ctx "
              f"{args.n_ctx}, one slot, max_tokens {args.max_tokens}, {args.rounds} rounds, temperature 0; "
              f"{len(earlier)} characters of docs before each prompt", flush=True)
        for server in servers:  # one at a time: the other is stopped, so it takes no core
            server.start()
            client = server.client()
            client.timeout = 900
            results[server.name] = {}
            try:
                for task in tasks:
                    rows: dict[str, list[dict[str, Any]]] = {"off": [], "ngram": []}
                    for prompt in TASKS[task]:
                        text = f"Here are some notes:\n\n{earlier}\n\n{prompt}"
                        warm = stream(client, text, argparse.Namespace(max_tokens=8), server.model,
                                      {"cache_prompt": True, "spec_source": "off"})
                        prompt_tokens[task] = warm["prompt_tokens"] or 0
                        for r in range(args.rounds):
                            for source in (("off", "ngram") if r % 2 == 0 else ("ngram", "off")):
                                row = stream(client, text, args, server.model,
                                             {"cache_prompt": True, "spec_source": source})
                                rows[source].append(row)
                                if args.verbose:
                                    print(f"  {server.name} {task} {source}: {row['tokens']} tokens, decode "
                                          f"{row['decode_tok_s']:.1f} tok/s, first token {row['ttft_ms']:.0f} ms, "
                                          f"drafted {row['drafted']}, accepted {row['accepted']}", flush=True)
                    results[server.name][task] = rows
            finally:
                client.close()
                server.stop()

        print(f"\nprompt tokens (docs and task prompt): "
              + ", ".join(f"{t} {n}" for t, n in prompt_tokens.items()))
        print("median decode tokens/s (tokens after the first / time from the first content chunk to the last)")
        print(f"{'task':<7}{'configuration':<26}{'off':>8}{'ngram':>8}{'ngram/off':>11}{'drafted':>9}"
              f"{'accepted':>10}{'vs flash on':>13}")
        med: dict[tuple[str, str, str], float] = {}
        for task in tasks:
            for server in servers:
                rows = results[server.name][task]
                for source in ("off", "ngram"):
                    med[(task, server.name, source)] = statistics.median(r["decode_tok_s"] for r in rows[source])
                off, ngram = med[(task, server.name, "off")], med[(task, server.name, "ngram")]
                drafted = sum(r["drafted"] or 0 for r in rows["ngram"])
                accepted = sum(r["accepted"] or 0 for r in rows["ngram"])
                versus = ""
                on = "localm, flash_attn on"
                if server.name != on and (task, on, "off") in med:
                    versus = f"{off / med[(task, on, 'off')]:.2f}/{ngram / med[(task, on, 'ngram')]:.2f}"
                print(f"{task:<7}{server.name:<26}{off:>8.1f}{ngram:>8.1f}{ngram / off:>10.2f}x{drafted:>9}"
                      f"{accepted:>10}{versus:>13}")
        print("vs flash on: off/off and ngram/ngram against flash_attn on, same task")
        print(took(t0, workdir, args.keep))
        if args.keep:
            (workdir / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
