"""What joining a streamed reply's tokens costs or saves: localm with the llamacpp plugin's
``stream_interval_ms`` at one value against localm at another, one stream at a time.

Run it from the repository root with the project's interpreter::

    .venv/bin/python bench/stream_interval.py                   # 0 (a message a token) against -1 (the default)
    .venv/bin/python bench/stream_interval.py --intervals 25,40 --rounds 12

It starts two ``localm serve --plugins chat,llamacpp`` servers as bench/chat.py does (the
same n_threads, n_ctx and n_batch), the first with ``stream_interval_ms`` set to the first
value and the second to the second, warms both up, then sends streaming
``/v1/chat/completions`` requests (temperature 0, a new prompt each, the same to both), a
few per server per round, alternating which server goes first. Printed per round: each
server's mean tokens/s (bench/chat.py's measure: completion tokens less one over the time
from the first content chunk to the last) and the ratio B/A; then the mean and median ratio,
their spread, and the content chunks per reply on each. Both servers share the machine's
cores with the benchmark's own client, as a front end's would.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chat  # noqa: E402  (bench/chat.py: the servers and the streaming client)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--intervals", default="0,-1", help="two stream_interval_ms values, A,B (default 0,-1)")
    parser.add_argument("--rounds", type=int, default=12, help="measured rounds (1-50)")
    parser.add_argument("--per-round", type=int, default=3, help="requests per server per round (1-10)")
    parser.add_argument("--threads", type=int, default=2, help="n_threads on both servers")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (8-1024)")
    parser.add_argument("--time-limit", type=float, default=900, help="stop measuring after this many seconds")
    args = parser.parse_args()
    a, b = (int(v) for v in args.intervals.split(","))
    rounds = min(max(args.rounds, 1), 50)
    per_round = min(max(args.per_round, 1), 10)
    max_tokens = min(max(args.max_tokens, 8), 1024)
    options = argparse.Namespace(threads=args.threads, n_ctx=4096, n_batch=512, concurrency=4, model=None,
                                 max_tokens=max_tokens)
    workdir = Path(tempfile.mkdtemp(prefix="localm-bench-interval-"))
    servers = []
    try:
        for i, interval in enumerate((a, b)):
            (workdir / f"server-{i}").mkdir(parents=True)
            server = chat.Localm(options, workdir / f"server-{i}")
            server.settings["stream_interval_ms"] = interval
            server.start()
            servers.append(server)
        for server in servers:
            chat.stream_chat(server.client(), chat.WARMUP_PROMPT, 16, server.model)
        print(f"localm A: stream_interval_ms {a}; localm B: stream_interval_ms {b}; n_threads {args.threads}, "
              f"max_tokens {max_tokens}, {per_round} request(s) per server per round")
        ratios, rates, chunks = [], ([], []), ([], [])
        started = time.monotonic()
        for r in range(rounds):
            if time.monotonic() - started > args.time_limit:
                print(f"time limit reached after {r} round(s)")
                break
            got = {}
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                server, tok_s = servers[i], []
                for k in range(per_round):
                    out = chat.stream_chat(server.client(), chat.new_prompt(1000 + r * per_round + k), max_tokens,
                                           server.model)
                    tok_s.append(out["tok_s"])
                    chunks[i].append(out["chunks"])
                got[i] = statistics.mean(tok_s)
                rates[i].append(got[i])
            ratios.append(got[1] / got[0])
            print(f"round {r + 1:2d}: A {got[0]:6.1f} tok/s  B {got[1]:6.1f} tok/s  B/A {ratios[-1]:.3f}", flush=True)
        if not ratios:
            return 1
        spread = statistics.stdev(ratios) if len(ratios) > 1 else float("nan")
        print(f"\nA mean {statistics.mean(rates[0]):.1f} tok/s, {statistics.mean(chunks[0]):.1f} content chunks a reply")
        print(f"B mean {statistics.mean(rates[1]):.1f} tok/s, {statistics.mean(chunks[1]):.1f} content chunks a reply")
        print(f"B/A: mean {statistics.mean(ratios):.3f}, median {statistics.median(ratios):.3f}, "
              f"standard deviation {spread:.3f} over {len(ratios)} rounds "
              f"(standard error {spread / len(ratios) ** 0.5:.3f})")
        return 0
    finally:
        for server in servers:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
