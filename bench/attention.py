"""Flash attention on and off, on this machine: what a prompt's reading, a one-token step and a
step of several rows of one reply (what drafting checks) cost at a few context lengths.

Run it from the repository root with the project's interpreter::

    .venv/bin/python bench/attention.py                          # contexts 512 and 2048, about 3 minutes
    .venv/bin/python bench/attention.py --contexts 512,2048,4096 --rows 1,8,16,32,48,63,64

The llamacpp plugin's ``flash_attn`` setting (on by default, as in ``llama-server``) is read
when a model loads; this bench loads the model twice, once each way, with the plugin's other
defaults (``n_batch`` 512, the threads given), and for each context length:

- reads a prompt of that many tokens in chunks of ``n_batch`` (the prompt's tokens a second);
- decodes steps of each ``--rows`` size after it, every row's logits as a drafted step needs
  them, ``--reps`` times in a row in each of three passes over the sizes, and takes the median.

The figures are llama.cpp's own (the same kernels ``llama-server`` runs); the ratio column is
off / on, so below 1 flash attention costs more. On a CPU, llama.cpp computes attention for
fewer than 64 query rows one row at a time (each row reads the whole cache) and from 64 rows
in tiles, so a drafted step's cost per row can change at 64.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat import default_model  # noqa: E402
from speculation_replay import timed_decode  # noqa: E402

PASSES = 3


def measure(model: Path, flash: bool, threads: int, contexts: list[int], rows: list[int],
            reps: int) -> dict[int, dict[str, Any]]:
    """For each context length: the prompt's reading in seconds, and each step size's median seconds."""
    import llama_cpp
    from llama_cpp import Llama

    n_ctx = max(contexts) + max(rows) + 16
    llm = Llama(str(model), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                flash_attn=flash, verbose=False)
    ctx = llm._ctx.ctx
    memory = llama_cpp.llama_get_memory(ctx)
    text = llm.tokenize(b"def f(x):\n    return x + 1\n\nThe quick brown fox jumps over the lazy dog. ",
                        add_bos=False)
    filler = (text * (n_ctx // len(text) + 1))[:n_ctx]
    batch = llama_cpp.llama_batch_init(512, 0, 1)

    def decode(tokens: Sequence[int], pos: int, all_logits: bool) -> float:
        return timed_decode(ctx, batch, tokens, pos, all_logits)

    out: dict[int, dict[str, Any]] = {}
    try:
        for at in contexts:
            llama_cpp.llama_memory_clear(memory, True)
            reading = sum(decode(filler[start:min(at, start + 512)], start, False) for start in range(0, at, 512))
            samples: dict[int, list[float]] = {n: [] for n in rows}
            for _ in range(PASSES):
                for n in rows:
                    for _ in range(reps):
                        samples[n].append(decode(filler[at:at + n], at, True))
                        llama_cpp.llama_memory_seq_rm(memory, 0, at, -1)
            out[at] = {"reading": reading, "steps": {n: statistics.median(v) for n, v in samples.items()}}
    finally:
        llama_cpp.llama_batch_free(batch)
        llm.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--threads", type=int, default=2, help="n_threads (and n_threads_batch)")
    parser.add_argument("--contexts", default="512,2048", help="comma-separated context lengths (tokens)")
    parser.add_argument("--rows", default="1,16,48,63,64", help="comma-separated step sizes (rows, 1-128)")
    parser.add_argument("--reps", type=int, default=3, help="decodes of each size in a row, in each pass (1-20)")
    args = parser.parse_args()
    try:
        contexts = sorted({int(c) for c in args.contexts.split(",") if c.strip()})
        rows = sorted({int(r) for r in args.rows.split(",") if r.strip()})
    except ValueError:
        sys.exit("--contexts and --rows take comma-separated whole numbers")
    if not contexts or not rows or min(contexts) < 1 or max(contexts) > 32768 or min(rows) < 1 or max(rows) > 128:
        sys.exit("--contexts takes 1-32768 tokens and --rows 1-128 rows")
    if not 1 <= args.reps <= 20:
        sys.exit("--reps takes 1-20")
    model = args.model or default_model()
    import llama_cpp

    print(f"llama-cpp-python {llama_cpp.__version__}, model {model.name}, {args.threads} threads, n_batch 512",
          flush=True)
    began = time.perf_counter()
    on = measure(model, True, args.threads, contexts, rows, args.reps)
    off = measure(model, False, args.threads, contexts, rows, args.reps)
    print(f"\n{'context':>8}  {'what':<22}{'flash on':>12}{'flash off':>12}{'off/on':>9}")
    for at in contexts:
        a, b = on[at]["reading"], off[at]["reading"]
        print(f"{at:>8}  {'prompt read, tok/s':<22}{at / a:>12.1f}{at / b:>12.1f}{a / b:>9.2f}")
        one_on, one_off = on[at]["steps"].get(1), off[at]["steps"].get(1)
        for n in rows:
            s_on, s_off = on[at]["steps"][n], off[at]["steps"][n]
            label = f"step of {n} row{'s' if n > 1 else ''}, ms"
            extra = ""
            if n > 1 and one_on and one_off:  # what each further checked row costs, as a share of a step
                extra = (f"   a further row: {(s_on - one_on) / (n - 1) / one_on:.2f} of a step on, "
                         f"{(s_off - one_off) / (n - 1) / one_off:.2f} off")
            print(f"{'':>8}  {label:<22}{s_on * 1000:>12.1f}{s_off * 1000:>12.1f}{s_on / s_off:>9.2f}{extra}")
    print("\noff/on: the speed without flash attention over the speed with it (above 1: off is faster)")
    print(f"(bench took {time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
