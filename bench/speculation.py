"""Speculative decoding benchmark: localm's drafting (``spec_source`` off, ngram, draft) against
llama.cpp's own ``llama-server`` with and without its speculation, one stream at a time.

Run it from the repository root with the project's interpreter::

    .venv/bin/python bench/speculation.py                      # SmolLM2-135M-Instruct Q4_1, 2 threads, 5 rounds
    .venv/bin/python bench/speculation.py -v --rounds 9        # every request printed; steadier medians
    .venv/bin/python bench/speculation.py --draft /path/to/draft.gguf --model /path/to/model.gguf
    .venv/bin/python bench/speculation.py --tasks quote,edit --spec-types ngram-mod

Three tasks, each with several prompts (one a round, rotating): ``quote`` (a reply that repeats a
supplied passage, or a sentence of it), ``edit`` (a ~30-line Python function to return whole with
a variable renamed or a docstring added) and ``free`` (free writing, where drafting should not
pay). Configurations, all measured in the same run and interleaved (each round, every task's
prompt goes to every configuration, one request at a time, in an order that rotates):

- localm (``localm serve --plugins chat,llamacpp``, the llamacpp plugin at ``n_threads``,
  ``n_ctx``, ``n_batch`` and ``n_parallel 1``) with the request field ``spec_source`` at
  ``off``, ``ngram`` and, with ``--draft PATH``, ``draft`` (the plugin's ``spec_draft_model``
  set to PATH in the data dir's config before the server starts);
- ``llama-server --parallel 1`` (built once by bench/llama_server.py from the llama.cpp
  that llama-cpp-python vendors) without speculation, with each ``--spec-type`` of
  ``--spec-types`` (its n-gram drafters, each a server of its own) and, with ``--draft``,
  with ``--spec-type draft-simple --spec-draft-model PATH``.

Every request is a streamed ``/v1/chat/completions`` with ``stream_options.include_usage``,
temperature 0 (chat.py's explicit sampling settings), ``max_tokens`` (default 256) and
``cache_prompt: false`` (the same prompt reaches localm's one server three times a round: each
reads it anew, as every llama-server does). tokens/s is ``usage.completion_tokens`` over the
time from sending the request to the last content chunk (the prompt's reading included; it is
the same on every configuration of a task). From localm's ``usage.speculation`` and
llama-server's ``timings`` (``draft_n``, ``draft_n_accepted``) the drafted and accepted tokens
are summed per configuration. Greedy decoding must not change with drafting: each localm
configuration's text is compared with localm off's for the same prompt in the same round, each
llama-server configuration's with plain llama-server's (and plain llama-server's with localm
off's, apart).

The machine's other processes disturb a CPU benchmark: as in chat.py, the script waits for
half a quiet second before each request and measures a request again (at most ``--max-redo``
times in all, while ``--time-limit`` allows) when processes outside the bench used more than
``--max-other-load`` cores during it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat import (WARMUP_PROMPT, CpuMeter, LlamaServer, Localm, default_model,  # noqa: E402
                  request_body, running, took, wait_quiet)

# --- the tasks --------------------------------------------------------------------------------------

PASSAGES = [
    "The harbour town of Kellen Bay was built on a slope so steep that the houses seemed to stand on "
    "one another's shoulders. Every morning the fishing boats left before dawn, their lanterns swinging "
    "like slow fireflies above the black water, and every evening the whole town came down to the quay "
    "to watch them return. The catch was weighed on an iron scale that had belonged to the harbour master's "
    "grandfather, and the numbers were written in chalk on a board beside the fish market. Children raced "
    "along the sea wall, gulls argued over scraps, and the old women who mended nets sat in a row on the "
    "bench by the chapel, talking about the weather as if it were a neighbour who could not be trusted. "
    "In winter the storms closed the harbour for weeks at a time, and the town lived on dried cod, potatoes "
    "and the stories people told each other by the fire.",
    "A compiler reads a program written in a high-level language and translates it into instructions that "
    "a machine can execute. The work is usually split into stages. First the lexer turns the stream of "
    "characters into tokens such as names, numbers and operators. Then the parser arranges those tokens "
    "into a tree that reflects the grammar of the language. Semantic analysis walks the tree to check that "
    "names are defined before they are used and that the types of values fit together. After that, the "
    "compiler lowers the tree into an intermediate representation that is easier to optimise, removes code "
    "that can never run, folds constant expressions and keeps frequently used values in registers. Finally "
    "the code generator emits assembly or machine code for the target processor, and a linker joins it "
    "with the libraries the program needs.",
    "Bees communicate the location of food through a movement known as the waggle dance. A forager that "
    "has found a rich patch of flowers returns to the hive and walks in a straight line across the "
    "vertical comb while shaking her body from side to side, then circles back to repeat the run. The "
    "angle of the straight run relative to the vertical tells the other bees the direction of the food "
    "relative to the sun, and the length of the run tells them how far away it is. Bees that follow the "
    "dance pick up the scent of the flowers from the dancer and then fly out to search for the patch "
    "themselves. Because the sun moves across the sky during the day, the dancers adjust the angle of "
    "their runs as the hours pass, which means the bees keep track of time as well as space.",
]

QUOTE_PROMPTS = [
    f"Here is a passage:\n\n{PASSAGES[0]}\n\nRepeat the passage word for word.",
    f"Here is a passage:\n\n{PASSAGES[1]}\n\nQuote the passage exactly, from its first sentence to its last.",
    f"Read this text:\n\n{PASSAGES[2]}\n\nQuote the sentence that says what the angle of the straight run "
    "tells the other bees, then quote the rest of the text word for word.",
]

FUNCTION = '''def summarize_orders(orders, min_total=0.0, limit=None):
    if min_total < 0:
        raise ValueError("min_total must not be negative")
    totals = {}
    counts = {}
    for order in orders:
        customer = order.get("customer")
        if customer is None:
            continue
        amount = float(order.get("amount", 0))
        if amount < 0:
            raise ValueError(f"negative amount in order {order.get('id')}")
        totals[customer] = totals.get(customer, 0.0) + amount
        counts[customer] = counts.get(customer, 0) + 1
    result = []
    for customer, total in totals.items():
        if total < min_total:
            continue
        average = total / counts[customer]
        result.append({
            "customer": customer,
            "total": round(total, 2),
            "orders": counts[customer],
            "average": round(average, 2),
        })
    result.sort(key=lambda row: row["total"], reverse=True)
    if limit is not None:
        result = result[:limit]
    return result
'''

EDIT_PROMPTS = [
    f"Here is a Python function:\n\n```python\n{FUNCTION}```\n\nRename the variable `totals` to "
    "`sum_by_customer` everywhere in the function. Return the whole function.",
    f"Here is a Python function:\n\n```python\n{FUNCTION}```\n\nAdd a docstring that explains what the "
    "function does and returns. Return the whole function, unchanged apart from the docstring.",
    f"Here is a Python function:\n\n```python\n{FUNCTION}```\n\nRename the parameter `min_total` to "
    "`threshold` and the variable `result` to `rows`. Return the whole function.",
]

FREE_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, in plain words, for a curious child.",
    "Write a short story about a clockmaker who builds a clock that runs backwards.",
]

TASKS = {"quote": QUOTE_PROMPTS, "edit": EDIT_PROMPTS, "free": FREE_PROMPTS}
#: llama-server's n-gram drafters measured by default (``--spec-type``; it also offers ngram-map-k4v
#: and ngram-cache).
DEFAULT_SPEC_TYPES = "ngram-simple,ngram-map-k,ngram-mod"
REQUEST_TIMEOUT = 180.0  # seconds one streamed request may take (256 tokens on a busy machine)


# --- the servers and their configurations -----------------------------------------------------------

class SpecLlamaServer(LlamaServer):
    """``llama-server --parallel 1`` with the given speculation options (none: plain)."""

    def __init__(self, model: Path, args: argparse.Namespace, workdir: Path, label: str, spec: list[str]) -> None:
        one = argparse.Namespace(**{**vars(args), "concurrency": 1})
        super().__init__(model, one, workdir)
        self.name = f"llama-server {label}" if label else "llama-server"
        self.cmd += spec
        self.spec = spec
        self.log_path = workdir / f"{self.name.replace(' ', '-')}.log"


class SpecLocalm(Localm):
    """localm with one slot (``n_parallel 1``, as llama-server here) and, with ``--draft``, the
    llamacpp plugin's ``spec_draft_model``."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        super().__init__(args, workdir)
        self.settings["n_parallel"] = 1
        if args.draft is not None:  # written to the data dir's config.json (plugins.llamacpp) before the start
            self.settings["spec_draft_model"] = str(args.draft)


class Config:
    """One measured configuration: a server and the request fields that select it."""

    def __init__(self, name: str, server: Any, fields: dict[str, Any], kind: str, drafting: bool) -> None:
        self.name, self.server, self.fields, self.kind, self.drafting = name, server, fields, kind, drafting


# --- one streamed request ---------------------------------------------------------------------------

def stream(client: httpx.Client, prompt: str, args: argparse.Namespace, model: str | None,
           fields: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat completion: the time from sending it to its last content chunk, the token count
    from the final usage, the text, and the speculation figures the server reports."""
    body = request_body(prompt, args.max_tokens, model, True)
    body.update({"cache_prompt": False, "stream_options": {"include_usage": True}, **fields})
    pieces: list[str] = []
    first = last = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    sent = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{client.base_url}: {response.status_code} {response.text[:500]}")
        for line in response.iter_lines():
            now = time.perf_counter()
            if now - sent > REQUEST_TIMEOUT:
                raise RuntimeError(f"{client.base_url}: the request took over {REQUEST_TIMEOUT:.0f} s")
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            for choice in event.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    first = first if first is not None else now
                    last = now
                    pieces.append(text)
            if event.get("usage"):
                usage = event["usage"]
            if event.get("timings"):
                timings = event["timings"]
    if usage is None or not usage.get("completion_tokens"):
        raise RuntimeError(f"{client.base_url}: the stream reported no usage.completion_tokens")
    tokens = usage["completion_tokens"]
    spec = usage.get("speculation")  # localm's
    drafted = accepted = None
    if isinstance(spec, dict):
        drafted, accepted = spec.get("drafted"), spec.get("accepted")
    elif timings is not None and "draft_n" in timings:  # llama-server's
        drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
    return {"tokens": tokens, "text": "".join(pieces), "ttft_ms": (first - sent) * 1000 if first else float("nan"),
            "tok_s": tokens / (last - sent) if last else float("nan"),
            "decode_tok_s": (tokens - 1) / (last - first) if first is not None and last > first else float("nan"),
            "drafted": drafted, "accepted": accepted,
            "speculation": spec, "prompt_tokens": usage.get("prompt_tokens")}


# --- the benchmark ----------------------------------------------------------------------------------

def median(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--draft", type=Path,
                        help="a draft GGUF sharing the model's vocabulary: adds localm spec_source=draft "
                             "and llama-server --spec-draft-model")
    parser.add_argument("--threads", type=int, default=2, help="n_threads (and n_threads_batch) on every server")
    parser.add_argument("--n-ctx", type=int, default=4096, help="context window on every server")
    parser.add_argument("--n-batch", type=int, default=512, help="n_batch on every server")
    parser.add_argument("--max-tokens", type=int, default=256, help="max_tokens per request (8-1024)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (1-30)")
    parser.add_argument("--tasks", default="quote,edit,free", help="comma-separated: quote, edit, free")
    parser.add_argument("--spec-types", default=DEFAULT_SPEC_TYPES,
                        help=f"llama-server --spec-type values, a server each (default {DEFAULT_SPEC_TYPES}; "
                             "empty: plain llama-server only)")
    parser.add_argument("--max-other-load", type=float, default=0.1,
                        help="measure a request again when other processes used more cores than this")
    parser.add_argument("--max-redo", type=int, default=None, help="most requests measured again (default: "
                                                                   "the number of configurations x rounds)")
    parser.add_argument("--wait-quiet", type=float, default=15.0,
                        help="before each request, wait up to this many seconds for the machine to be quiet")
    parser.add_argument("--time-limit", type=float, default=900.0,
                        help="start no new round this many seconds after the start (default 900)")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every request")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary directory (server logs, and every reply in replies.json)")
    args = parser.parse_args()
    args.rounds = min(max(args.rounds, 1), 30)
    args.threads = max(args.threads, 1)
    args.max_tokens = min(max(args.max_tokens, 8), 1024)
    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks or any(t not in TASKS for t in tasks):
        sys.exit(f"--tasks takes a comma-separated list of {', '.join(TASKS)}")
    spec_types = [t for t in args.spec_types.split(",") if t]
    model = args.model or default_model()
    if not model.is_file():
        sys.exit(f"no such model file: {model}")
    if args.draft is not None and not args.draft.is_file():
        sys.exit(f"no such draft model file: {args.draft}")
    args.model = args.model and args.model.resolve()
    args.draft = args.draft and args.draft.resolve()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout` still stops the servers
    t0 = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="localm-bench-spec-"))
    localm = SpecLocalm(args, workdir)
    servers: list[Any] = [localm, SpecLlamaServer(model, args, workdir, "", [])]
    servers += [SpecLlamaServer(model, args, workdir, t, ["--spec-type", t]) for t in spec_types]
    if args.draft is not None:
        servers.append(SpecLlamaServer(model, args, workdir, "draft model",
                                       ["--spec-type", "draft-simple", "--spec-draft-model", str(args.draft)]))
    configs = [Config("localm off", localm, {"spec_source": "off"}, "localm", False),
               Config("localm ngram", localm, {"spec_source": "ngram"}, "localm", True)]
    if args.draft is not None:
        configs.append(Config("localm draft", localm, {"spec_source": "draft"}, "localm", True))
    configs += [Config(s.name, s, {}, "llama-server", bool(s.spec)) for s in servers[1:]]
    args.max_redo = len(configs) * args.rounds if args.max_redo is None else max(args.max_redo, 0)
    clients: dict[str, httpx.Client] = {}
    meter = CpuMeter()
    # rows[config][task]: one dict per measured request
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {c.name: {t: [] for t in tasks} for c in configs}
    redone: list[str] = []
    with running(servers, workdir, args.keep, clients):
        version = importlib.metadata.version("llama_cpp_python")
        print(f"python {platform.python_version()}, llama-cpp-python {version}, {os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        for server in servers:
            server.start()
            clients[server.name] = server.client()
            stream(clients[server.name], WARMUP_PROMPT, argparse.Namespace(max_tokens=16), server.model, {})
        name = model.name.removesuffix(".gguf").replace(".", " ")
        print(f"model: {name}, n_threads {args.threads}, n_batch {args.n_batch}, n_ctx {args.n_ctx}, one slot, "
              f"max_tokens {args.max_tokens}, {args.rounds} rounds, temperature 0, cache_prompt false"
              + (f"; draft model {args.draft.name}" if args.draft else ""))
        print(f"llama-server: {' '.join(servers[1].cmd[1:])}")
        for server in servers[2:]:
            print(f"  {server.name}: + {' '.join(server.spec)}")
        print("tasks: " + ", ".join(f"{t} ({len(TASKS[t])} prompts, one a round)" for t in tasks), flush=True)

        for r in range(args.rounds):
            if time.monotonic() - t0 > args.time_limit:
                print(f"time limit reached after {r} rounds")
                break
            for ti, task in enumerate(tasks):
                prompts = TASKS[task]
                prompt = prompts[r % len(prompts)]
                shift = (r * len(tasks) + ti) % len(configs)
                for config in configs[shift:] + configs[:shift]:
                    while True:  # measured again while processes outside the bench took CPU meanwhile
                        wait_quiet(meter, args.max_other_load, args.wait_quiet)
                        before = meter.sample()
                        row = stream(clients[config.server.name], prompt, args, config.server.model, config.fields)
                        others = CpuMeter.others(before, meter.sample())
                        row["others"] = others
                        if config.drafting and row["drafted"] is None and config.kind == "llama-server":
                            row["drafted"] = row["accepted"] = 0  # its timings leave draft_n out when it drafted none
                        row["prompt_index"], row["round"] = r % len(prompts), r
                        if (others > args.max_other_load and len(redone) < args.max_redo
                                and time.monotonic() - t0 < args.time_limit):
                            redone.append(f"{config.name} {task} ({others:.2f} cores)")
                            if args.verbose:
                                print(f"  round {r + 1} {task} {config.name}: disturbed (other processes used "
                                      f"{others:.2f} cores), measured again", flush=True)
                            continue
                        break
                    rows[config.name][task].append(row)
                    if args.verbose:
                        spec = row["speculation"]
                        state = f", speculation {spec.get('state')}" + (
                            f" ({spec.get('reason')})" if spec.get("reason") else "") if isinstance(spec, dict) else ""
                        drafted = (f", drafted {row['drafted']} accepted {row['accepted']}"
                                   if row["drafted"] is not None else "")
                        print(f"  round {r + 1} {task} {config.name}: {row['tok_s']:.1f} tok/s, {row['tokens']} "
                              f"tokens, TTFT {row['ttft_ms']:.0f} ms{drafted}{state}, others {others:.2f} cores",
                              flush=True)

        report(configs, tasks, rows, args, redone)
        if args.keep:  # every reply, to read what each configuration wrote
            (workdir / "replies.json").write_text(json.dumps(rows, indent=1))
        print("\n" + took(t0, workdir, args.keep))


def report(configs: list[Config], tasks: list[str], rows: dict[str, dict[str, list[dict[str, Any]]]],
           args: argparse.Namespace, redone: list[str]) -> None:
    med = {c.name: {t: median([r["tok_s"] for r in rows[c.name][t]]) for t in tasks} for c in configs}
    n = min(len(rows[c.name][t]) for c in configs for t in tasks)
    print(f"\nmedian tokens/s over {n} round(s) (completion tokens / time from request to last token, streamed)")
    head = "".join(f"{t + ' tok/s':>13}" for t in tasks)
    print(f"{'configuration':<28}{head}{'drafted':>10}{'accepted':>10}{'rate':>8}  same text")
    base_of = {"localm": "localm off", "llama-server": "llama-server"}
    for c in configs:
        all_rows = [r for t in tasks for r in rows[c.name][t]]
        counted = [r for r in all_rows if r["drafted"] is not None]
        drafted = sum(r["drafted"] or 0 for r in counted)
        accepted = sum(r["accepted"] or 0 for r in counted)
        rate = f"{100 * accepted / drafted:.0f}%" if drafted else "-"
        same = ""
        if c.name != base_of[c.kind]:
            same = identical(rows, c.name, base_of[c.kind], tasks)
        cells = "".join(f"{med[c.name][t]:>13.1f}" for t in tasks)
        print(f"{c.name:<28}{cells}{drafted if counted else '-':>10}{accepted if counted else '-':>10}{rate:>8}  "
              f"{same}")
    # per task acceptance, for the drafting configurations
    for c in configs:
        if not c.drafting:
            continue
        parts = []
        for t in tasks:
            d = sum(r["drafted"] or 0 for r in rows[c.name][t])
            a = sum(r["accepted"] or 0 for r in rows[c.name][t])
            parts.append(f"{t} {a}/{d}" + (f" ({100 * a / d:.0f}%)" if d else ""))
        states = sorted({f"{r['speculation'].get('state')}" + (f" ({r['speculation'].get('reason')})"
                                                               if r["speculation"].get("reason") else "")
                         for t in tasks for r in rows[c.name][t] if isinstance(r["speculation"], dict)})
        print(f"  {c.name}: accepted/drafted " + ", ".join(parts)
              + (f"; usage.speculation state: {', '.join(states)}" if states else ""))

    print("\ngreedy text against the configuration without drafting (same prompt, same round):")
    for c in configs:
        if c.name in base_of.values():
            continue
        print(f"  {c.name} vs {base_of[c.kind]}: {identical(rows, c.name, base_of[c.kind], tasks)}")
    if "llama-server" in rows:
        print(f"  llama-server vs localm off (different servers, counted apart): "
              f"{identical(rows, 'llama-server', 'localm off', tasks)}")

    print("\nratios of the medians against the targets:")
    localm_drafting = [c for c in configs if c.kind == "localm" and c.drafting]
    servers = [c for c in configs if c.kind == "llama-server"]

    def line(label: str, ratio: float, target: float) -> None:
        verdict = "met" if ratio >= target else "NOT met"
        print(f"  {label:<72} {ratio:6.2f}x  {verdict} (target >= {target})")

    def best(candidates: list[Config], task: str) -> Config:
        return max(candidates, key=lambda c: med[c.name][task] if med[c.name][task] == med[c.name][task] else -1)

    for task in ("quote", "edit"):
        if task in tasks:
            b = best(localm_drafting, task)
            line(f"{task}: {b.name} / localm off", med[b.name][task] / med["localm off"][task], 1.3)
    for task in tasks:
        b, s = best(localm_drafting, task), best(servers, task)
        line(f"{task}: {b.name} / {s.name} (llama-server's best)", med[b.name][task] / med[s.name][task], 1.0)
    if "free" in tasks:
        for c in localm_drafting:
            line(f"free: {c.name} / localm off", med[c.name]["free"] / med["localm off"]["free"], 0.95)
    others = [r["others"] for c in configs for t in tasks for r in rows[c.name][t]]
    print(f"\nother processes used {median(others):.2f} cores (median over requests; at most {max(others):.2f}); "
          f"{len(redone)} disturbed request(s) measured again" + (f": {', '.join(redone)}" if redone and
                                                                    args.verbose else ""))
    if median(others) > args.max_other_load:
        print(f"WARNING: other processes kept {median(others):.2f} cores busy during the median request: "
              f"llama.cpp's {args.threads} threads then wait on each other, and these numbers say little")


def identical(rows: dict[str, dict[str, list[dict[str, Any]]]], name: str, base: str, tasks: list[str]) -> str:
    """'identical N/M replies' of ``name`` against ``base``, request by request (same task, same round)."""
    same = total = 0
    for t in tasks:
        by_round = {r["round"]: r["text"] for r in rows[base][t]}
        for r in rows[name][t]:
            if r["round"] in by_round:
                total += 1
                same += r["text"] == by_round[r["round"]]
    return f"identical {same}/{total} replies"


if __name__ == "__main__":
    main()
