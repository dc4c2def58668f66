"""Prompt lookup drafting replayed offline: the engine's drafting decisions on fixed replies,
priced with step costs measured on this machine, against llama.cpp's ``ngram-simple`` rule on
the same replies. No timing noise and no text that changes with drafting: what this compares
is the drafting policy alone.

Run it from the repository root with the project's interpreter::

    .venv/bin/python bench/speculation_replay.py                       # bench/speculation.py's prompts
    .venv/bin/python bench/speculation_replay.py --draft-max 8,16,32   # several spec_draft_max values
    .venv/bin/python bench/speculation_replay.py --tasks edit -v       # every drafted step of each reply
    .venv/bin/python bench/speculation_replay.py --oracle              # and the bound: a rule that knows the reply
    .venv/bin/python bench/speculation_replay.py --replies /tmp/localm-bench-spec-XXXX/replies.json

What it does, in three parts:

1. **Replies.** Each prompt of ``bench/speculation.py``'s tasks (``quote``, ``edit``, ``free``)
   is put in the model's chat template and decoded greedily without drafting (llama-cpp-python,
   the model's own template, ``--max-tokens`` tokens at most). Those tokens are the replies
   every policy replays. With ``--replies``, the replies are instead the texts a
   ``bench/speculation.py --keep`` run wrote (its ``replies.json``), one per configuration and
   round, tokenized again: what each server's own replies would have cost under each policy.
2. **Step costs.** The seconds a decode of n rows takes (n = 1 to ``--cost-max``, every row's
   logits, flash attention on as the llamacpp plugin has it, after ``--cost-at`` tokens of
   context), the median of three passes over the sizes, each decoding a size ``--cost-reps``
   times in a row (as a reply's steps come, one after another).
3. **Replay.** Each reply is decoded again on paper: at each step a policy proposes a draft
   from the prompt and the reply so far; the step keeps the drafted tokens up to the first that
   differs from the reply, plus one (the token the model draws at that row), and costs the
   measured seconds of a decode of 1 + the draft's length. tokens/s is the reply's tokens over
   the sum of its steps (its prompt's reading left out).

Policies:

- **off**: one token a step.
- **localm, spec_draft_max N** (``--draft-max``): the llamacpp plugin's own code
  (``plugins/llamacpp/speculation.py``: ``Ngrams.draft``, ``Speculating.length``, ``paused``,
  ``checked``, ``probed``, and ``Costs`` learning the step costs as the engine does: no draft
  before a one-token step is measured, then each step's size as it is used), one engine for
  all replies in turn, as one server answering them, in ``LlamaEngine._speculate``'s order of
  calls.
- **oracle** (``--oracle``): knows the reply, and drafts exactly the part of prompt lookup's
  proposal that the reply goes on with (when that beats a one-token step), at the largest
  ``--draft-max`` and at ``--cost-max`` - 1 tokens: the bound on any rule that drafts from
  prompt lookup, at this machine's step costs.
- **ngram-simple**: llama.cpp's ``--spec-type ngram-simple`` rule with its defaults (as its
  ``common/ngram-map.cpp`` describes it): when the last 12 tokens occurred before, draft the
  up to 48 tokens that followed their latest earlier occurrence (none when fewer than 12).

The figures are the policies' relative speeds on identical replies; the absolute tokens/s of a
server is lower (its event loop, the prompt) and, with drafting on, its replies differ (see
bench/README.md, "speculation.py").

With ``--replies``, a last table puts the prompt back: ``speculation.py``'s ratios are end to
end, and its prompts are read on every request, with drafting or without. For each reply of
``localm off`` that run timed, the request's time is taken as its time to the first token (the
prompt's reading, as timed) plus its decoding (the rest, as timed) sped up by a policy's
replayed ratio over off on that reply. The oracle's line there is the most any prompt-lookup
rule could show in ``speculation.py`` on this machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat import default_model  # noqa: E402
from speculation import TASKS  # noqa: E402


def engine_module() -> Any:
    """plugins/llamacpp/speculation.py, loaded as a module of its own (it imports nothing of the plugin)."""
    spec = importlib.util.spec_from_file_location("localm_replay_speculation",
                                                  ROOT / "plugins" / "llamacpp" / "speculation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


S = engine_module()


# --- replies and costs ------------------------------------------------------------------------------

def load(model: Path, threads: int, n_ctx: int) -> Any:
    from llama_cpp import Llama

    return Llama(str(model), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                 flash_attn=True, verbose=False)


def prompt_tokens(llm: Any, text: str) -> list[int]:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata.get("tokenizer.chat_template")
    if not template:
        sys.exit("the model has no chat template")
    formatter = Jinja2ChatFormatter(template=template, eos_token=llm.detokenize([llm.token_eos()]).decode(),
                                    bos_token=llm.detokenize([llm.token_bos()]).decode())
    rendered = formatter(messages=[{"role": "user", "content": text}]).prompt
    return llm.tokenize(rendered.encode(), add_bos=llm._model.add_bos_token(), special=True)


def greedy(llm: Any, prompt: list[int], most: int) -> tuple[list[int], bool]:
    """The greedy reply (its end-of-generation token left out) and whether it ended by one."""
    import llama_cpp

    reply: list[int] = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
            return reply, True
        reply.append(token)
        if len(reply) >= most:
            break
    return reply, False


PASSES = 3


def timed_decode(ctx: Any, batch: Any, tokens: Sequence[int], pos: int, all_logits: bool) -> float:
    """Seconds of one ``llama_decode`` of ``tokens`` at positions ``pos``.. of sequence 0: every
    row's logits, or only the last row's."""
    import llama_cpp

    for i, token in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos + i, 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = all_logits or i == len(tokens) - 1
    batch.n_tokens = len(tokens)
    started = time.perf_counter()
    if llama_cpp.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")
    return time.perf_counter() - started


def step_costs(llm: Any, most: int, at: int, reps: int) -> dict[int, float]:
    """Seconds of a decode of n rows (every row's logits) after ``at`` tokens, n = 1..most: the
    median of ``reps`` decodes in a row, in each of PASSES passes over the sizes."""
    import llama_cpp

    ctx = llm._ctx.ctx
    memory = llama_cpp.llama_get_memory(ctx)
    filler = (llm.tokenize(b"def f(x):\n    return x + 1\n", add_bos=False) * (at + most))[:at + most]
    batch = llama_cpp.llama_batch_init(max(512, most), 0, 1)

    def decode(tokens: Sequence[int], pos: int, all_logits: bool) -> float:
        return timed_decode(ctx, batch, tokens, pos, all_logits)

    try:
        llama_cpp.llama_memory_clear(memory, True)
        for start in range(0, at, 256):
            decode(filler[start:min(at, start + 256)], start, False)
        samples: dict[int, list[float]] = {n: [] for n in range(1, most + 1)}
        for _ in range(PASSES):  # sizes in turn, so a slow moment spreads over all of them
            for n in range(1, most + 1):
                for _ in range(reps):  # in a row, as a reply's steps come: the first warms the caches
                    samples[n].append(decode(filler[at:at + n], at, True))
                    llama_cpp.llama_memory_seq_rm(memory, 0, at, -1)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_memory_clear(memory, True)
    return {n: statistics.median(values) for n, values in samples.items()}


def written(llm: Any, path: Path, tasks: list[str], max_tokens: int,
            measured: dict[str, tuple[float, float]]) -> list[tuple[str, list[int], list[int], bool]]:
    """The replies of a speculation.py ``--keep`` run, tokenized again, named task, prompt, round and
    the configuration that wrote them (a reply shorter than max_tokens ended by itself). For each
    reply of ``localm off`` the run timed, ``measured`` gets its seconds to the first token (the
    prompt's reading) and to the last."""
    import json

    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        sys.exit(f"cannot read {path}: {exc}")
    found = []
    for config, by_task in rows.items():
        for task in tasks:
            for row in by_task.get(task, []):
                prompt = prompt_tokens(llm, TASKS[task][row["prompt_index"]])
                reply = llm.tokenize(row["text"].encode(), add_bos=False, special=False)[:max_tokens]
                label = config.replace("llama-server", "ls").replace("localm", "lm").replace(" ", "-")
                name = f"{task}{row['prompt_index']}r{row['round'] + 1}:{label}"
                found.append((name, prompt, reply, row["tokens"] < max_tokens))
                if config == "localm off" and row.get("ttft_ms") and row.get("tok_s"):
                    measured[name] = (row["ttft_ms"] / 1000, row["tokens"] / row["tok_s"])
    if not found:
        sys.exit(f"{path} holds no replies of the tasks {', '.join(tasks)}")
    return found


# --- the policies -----------------------------------------------------------------------------------

class Off:
    name = "off"

    def begin(self, history: list[int]) -> None:
        pass

    def draft(self, history: list[int], room: int) -> list[int]:
        return []

    def after(self, drafted: int, kept: int, drawn: Sequence[int], seconds: float) -> None:
        pass


class Localm:
    """The llamacpp plugin's prompt lookup, as ``LlamaEngine._speculate`` calls it: one engine (one
    Costs, learning as it goes) for every reply replayed."""

    PRIOR = 0.6  # LlamaEngine._prior["ngram"]

    def __init__(self, draft_max: int, costs: dict[int, float]) -> None:
        self.name = f"localm, spec_draft_max {draft_max}"
        self.draft_max = draft_max
        self.table = costs
        self.costs = S.Costs()
        self.state: Any = None
        self.match = 0
        self.probing = False

    def begin(self, history: list[int]) -> None:
        self.state = S.Speculating("ngram", self.PRIOR)
        self.state.history = list(history)

    def draft(self, history: list[int], room: int) -> list[int]:
        state, costs = self.state, self.costs
        if not costs.known:  # the engine measures one-token steps first
            return []
        most = min(self.draft_max, room)
        if most < 1:
            return []
        if state.ngrams is None:
            state.ngrams = S.Ngrams(state.history)
        candidate, self.match = state.ngrams.draft(most)
        if not candidate:
            return []
        loop = state.ngrams.loop
        if loop:
            self.match = S.LOOP
        length = state.length(costs, len(candidate), self.match, first=candidate[0], most=most, loop=loop)
        self.probing = length == 0
        if self.probing:
            if not state.paused():
                return []
            length = 2
        return candidate[:length]

    def after(self, drafted: int, kept: int, drawn: Sequence[int], seconds: float) -> None:
        state = self.state
        state.history.extend(drawn)
        if state.ngrams is not None:
            state.ngrams.extend(drawn)
        if drafted:
            self.costs.add(drafted + 1, seconds)
            state.checked(drafted, kept, self.match)
            if self.probing:
                state.probed(kept)
        else:
            self.costs.add(1, seconds)


class NgramSimple:
    """llama.cpp's ngram-simple: the up to ``m`` tokens after the latest earlier occurrence of the
    last ``n`` tokens, when at least ``n`` of them follow it."""

    def __init__(self, n: int = 12, m: int = 48) -> None:
        self.name = f"ngram-simple (n {n}, m {m})"
        self.n, self.m = n, m

    def begin(self, history: list[int]) -> None:
        pass

    def draft(self, history: list[int], room: int) -> list[int]:
        n, size = self.n, len(history)
        if size <= n + self.m + 1 or room < 1:
            return []
        pattern = history[size - n:]
        for start in range(size - n - 1, 0, -1):
            if history[start:start + n] == pattern:
                follow = min(self.m, size - (start + n))
                if follow < n:
                    return []
                return history[start + n:start + n + follow][:room]
        return []

    def after(self, drafted: int, kept: int, drawn: Sequence[int], seconds: float) -> None:
        pass


class Oracle:
    """Knows the reply: drafts exactly the part of prompt lookup's proposal (up to ``most`` tokens,
    going round a loop as ``Ngrams`` does) that the reply goes on with, when that beats a
    one-token step at the measured costs. No rule drafting from prompt lookup does better at
    this ``most``; the gap to it is what knowing where a copy ends would be worth."""

    def __init__(self, most: int, costs: dict[int, float]) -> None:
        self.name = f"oracle, {most} at most"
        self.most, self.costs = most, costs
        self.ngrams: Any = None
        self.future: Sequence[int] = ()
        self.at = 0

    def begin(self, history: list[int]) -> None:
        self.ngrams = S.Ngrams(history)

    def draft(self, history: list[int], room: int) -> list[int]:
        candidate, _ = self.ngrams.draft(min(self.most, room))
        right = 0
        while right < len(candidate) and self.at + right < len(self.future) \
                and candidate[right] == self.future[self.at + right]:
            right += 1
        if right and (right + 1) / self.costs[right + 1] > 1 / self.costs[1]:
            return candidate[:right]
        return []

    def after(self, drafted: int, kept: int, drawn: Sequence[int], seconds: float) -> None:
        self.ngrams.extend(drawn)


def replay(policy: Any, prompt: list[int], reply: list[int], ended: bool, max_tokens: int,
           costs: dict[int, float], verbose: Any = None) -> float:
    """The reply's tokens per second under ``policy``: its first token comes with the prompt; each
    step after it costs the measured decode of 1 + the draft's length."""
    future = reply + ([-1] if ended else [])  # the end-of-generation token: a draft past it is not kept
    history = list(prompt) + reply[:1]
    policy.begin(history)
    seconds, i, biggest = 0.0, 1, max(costs)
    peek = isinstance(policy, Oracle)
    if peek:
        policy.future = future
    while i < len(reply):
        room = min(max_tokens - i - 1, biggest - 1)
        if peek:
            policy.at = i
        draft = policy.draft(history, room)[:max(room, 0)]
        kept = 0
        while kept < len(draft) and i + kept < len(future) and draft[kept] == future[i + kept]:
            kept += 1
        step = costs[1 + len(draft)]
        seconds += step
        drawn = reply[i:i + kept + 1]
        history.extend(drawn)
        policy.after(len(draft), kept, drawn, step)
        if verbose is not None and draft:
            verbose(i, len(draft), kept, getattr(policy, "match", None))
        i += len(drawn)
    return (len(reply) - 1) / seconds if seconds else float("nan")


# --- the benchmark ----------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--threads", type=int, default=2, help="n_threads (and n_threads_batch)")
    parser.add_argument("--max-tokens", type=int, default=256, help="the longest reply (8-1024)")
    parser.add_argument("--tasks", default="quote,edit,free", help="comma-separated: quote, edit, free")
    parser.add_argument("--draft-max", default="64", help="comma-separated spec_draft_max values (1-64; the "
                        "plugin's default: 64)")
    parser.add_argument("--cost-max", type=int, default=64, help="the largest step measured, in rows (2-128)")
    parser.add_argument("--cost-at", type=int, default=400, help="context tokens before the measured steps")
    parser.add_argument("--cost-reps", type=int, default=3, help="decodes of each size in a row, in each of 3 "
                                                                 "passes (1-50)")
    parser.add_argument("--replies", type=Path, help="replay the replies of a bench/speculation.py --keep run "
                                                      "(its replies.json) instead of decoding new ones")
    parser.add_argument("--oracle", action="store_true", help="also replay a policy that knows the reply (drafts "
                        "exactly what will be kept, at the largest --draft-max and at --cost-max - 1): the bound "
                        "on any prompt-lookup rule at these step costs")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every drafted step of localm's "
                                                                     "first spec_draft_max")
    args = parser.parse_args()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks or any(t not in TASKS for t in tasks):
        sys.exit(f"--tasks takes a comma-separated list of {', '.join(TASKS)}")
    try:
        draft_maxes = [int(v) for v in args.draft_max.split(",") if v.strip()]
    except ValueError:
        sys.exit("--draft-max takes comma-separated integers")
    if not draft_maxes or any(not 1 <= v <= 64 for v in draft_maxes):
        sys.exit("--draft-max values must be 1-64")
    if not 8 <= args.max_tokens <= 1024 or not 2 <= args.cost_max <= 128 or not 1 <= args.cost_reps <= 50 \
            or not 0 <= args.cost_at <= 2048:
        sys.exit("--max-tokens 8-1024, --cost-max 2-128, --cost-reps 1-50, --cost-at 0-2048")
    model = args.model or default_model()
    if not model.is_file():
        sys.exit(f"no such model file: {model}")
    t0 = time.monotonic()
    llm = load(model, args.threads, 4096)
    print(f"model: {model.name}, {args.threads} threads, replies of up to {args.max_tokens} tokens, greedy", flush=True)

    replies: list[tuple[str, list[int], list[int], bool]] = []
    measured: dict[str, tuple[float, float]] = {}
    if args.replies is not None:
        replies = written(llm, args.replies, tasks, args.max_tokens, measured)
    else:
        for task in tasks:
            for k, text in enumerate(TASKS[task]):
                prompt = prompt_tokens(llm, text)
                reply, ended = greedy(llm, prompt, args.max_tokens)
                replies.append((f"{task}{k}", prompt, reply, ended))
    print(f"replies: {len(replies)} ({', '.join(f'{name} {len(r)}' for name, _, r, _ in replies)} tokens), "
          f"{time.monotonic() - t0:.0f} s", flush=True)

    costs = step_costs(llm, args.cost_max, args.cost_at, args.cost_reps)
    print("step costs (ms, rows: median of {}): ".format(args.cost_reps * PASSES)
          + " ".join(f"{n}:{costs[n] * 1000:.1f}" for n in sorted(costs)), flush=True)

    policies: list[Any] = [Off()] + [Localm(v, costs) for v in draft_maxes] + [NgramSimple()]
    if args.oracle:
        policies[-1:-1] = [Oracle(v, costs) for v in sorted({min(max(draft_maxes), args.cost_max - 1),
                                                             args.cost_max - 1})]
    speeds: dict[str, dict[str, float]] = {p.name: {} for p in policies}
    for policy in policies:
        show = None
        if args.verbose and policy.name == policies[1].name:
            print(f"\n{policy.name}: drafted steps (reply, at token, drafted, kept, match length)")
        for name, prompt, reply, ended in replies:
            if args.verbose and policy.name == policies[1].name:
                def show(i: int, drafted: int, kept: int, match: Any, name: str = name) -> None:
                    print(f"  {name} {i:4d}: {drafted:2d} drafted, {kept:2d} kept, match {match}")
            speeds[policy.name][name] = replay(policy, prompt, reply, ended, args.max_tokens, costs, show)

    print("\nreplayed tokens/s (reply tokens / summed step costs; prompt reading left out)")
    names = [name for name, *_ in replies]
    short = {p.name: p.name.replace("localm, spec_draft_max ", "localm ").replace(" at most", "").split(" (")[0]
             for p in policies}
    width, column = max(len(n) for n in names + ["reply"]) + 2, max(12, *(len(v) + 2 for v in short.values()))
    print(f"{'reply':<{width}}{'tokens':>7}" + "".join(f"{short[p.name]:>{column}}" for p in policies))
    for name, _, reply, _ in replies:
        print(f"{name:<{width}}{len(reply):7d}" + "".join(f"{speeds[p.name][name]:{column}.1f}" for p in policies))
    means = {p.name: {t: statistics.mean(speeds[p.name][n] for n in names if n.startswith(t)) for t in tasks}
             for p in policies}
    for t in tasks:
        print(f"{t + ' mean':<{width}}{'':7}" + "".join(f"{means[p.name][t]:{column}.1f}" for p in policies))
    simple = policies[-1].name
    print("\nratios of the task means")
    for policy in policies[1:]:
        parts = []
        for t in tasks:
            part = f"{t} {means[policy.name][t] / means['off'][t]:.2f}x off"
            if policy.name != simple:
                part += f", {means[policy.name][t] / means[simple][t]:.2f}x ngram-simple"
            parts.append(part)
        print(f"  {policy.name}: " + "; ".join(parts))
    if measured:
        # speculation.py's ratios are end to end: the prompt's reading, the same with drafting or
        # without, is in them. Each timed reply of localm off, with its decoding sped up by the
        # replayed ratio of a policy, and its prompt read as long as the run took.
        print("\nend to end, as speculation.py measures (localm off's timed replies: their prompt's reading as "
              "timed, their decoding at each policy's replayed speed; mean of the replies)")
        for t in tasks:
            timed = [n for n in measured if n.startswith(t)]
            if not timed:
                continue
            reading = statistics.mean(measured[n][0] / measured[n][1] for n in timed)
            parts = []
            for policy in policies[1:]:
                ratios = [total / (first + (total - first) * speeds["off"][n] / speeds[policy.name][n])
                          for n in timed for first, total in [measured[n]]]
                parts.append(f"{short[policy.name]} {statistics.mean(ratios):.2f}x")
            print(f"  {t} ({len(timed)} replies, prompt reading {reading:.0%} of the time): " + ", ".join(parts)
                  + " off")
    print(f"\n(replay took {time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
