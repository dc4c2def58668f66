"""Soak test: many clients doing everything at once against one ``localm serve`` for a fixed
time; afterwards nothing has leaked and every acknowledged write survives a SIGKILL.

Run it from the repository root with the project's interpreter (it is not part of the test
run)::

    .venv/bin/python bench/soak.py --minutes 5
    .venv/bin/python bench/soak.py --minutes 1 --clients 4 --keep

It starts ``localm serve --plugins chat,llamacpp,ollama,anthropic,responses`` on a fresh
data dir with an owner key and metrics on, loads the default model, and runs ``--clients`` clients
(default 8) for ``--minutes``. Each client picks its next action at random, weighted:

- a streamed chat completion on the default model, read to ``[DONE]``;
- a streamed chat completion dropped after its first chunks (a client that disconnects);
- a non-streamed chat completion;
- unloading the model and loading it again, at most every ``--reload-every`` seconds
  (requests meanwhile may get 503 ``model_busy``, the retryable status the spec gives for
  it; counted, not failed; a client waits half a second after one);
- minting a scoped key (and using it), or revoking one minted earlier;
- a config write (``max_json_depth`` through PATCH /v1/config, the chat plugin's
  ``task_max_tokens`` through POST /v1/plugins/chat/settings);
- disabling or enabling the anthropic plugin (no client uses its routes).

It prints the requests served, disconnects, responses by status, and the server process's
RSS, open file descriptors and threads at the start (after one of each action, so lazy
start-up is not counted as growth) and at the end, with the busy inference slots
(``localm_inference_slots_active`` in /metrics) once every client has stopped. Then it
SIGKILLs the server, starts it again on the same data dir, and checks every acknowledged
write: the keys minted and not revoked are listed and authenticate, the revoked ones do
neither, and the last config values and plugin state written are the ones read back.

It exits 1 when a check fails: a 5xx other than 503 ``model_busy``, a client error (a
refused connection, a timeout), a stream that ended in an error, a busy slot left at the
end, fd, thread or RSS growth over ``--max-fd-growth``, ``--max-thread-growth`` and
``--max-rss-growth-mb``, or a lost write. Both servers' logs go to a temporary directory,
kept with ``--keep``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from localm.sdk.testing import LocalmServer

MODEL = "smollm2-135m-instruct"
PLUGINS = ["chat", "llamacpp", "ollama", "anthropic", "responses"]
TOGGLED = "anthropic"  # the plugin disabled and enabled again; no client uses its routes
PROMPTS = ["Write one sentence about the sea.", "Name three colours.", "Say hello to Ada.",
           "What is two plus two?", "Describe a cat in a few words.", "Give me a word that rhymes with moon."]
#: action: weight
ACTIONS = {"stream": 5, "disconnect": 3, "chat": 2, "reload": 0.4, "key": 2, "config": 1.5, "plugin": 0.4}
#: statuses an action may answer without failing the run
EXPECTED = {"reload": {409, 503}, "stream": {503}, "disconnect": {503}, "chat": {503}}


def proc_stats(pid: int) -> dict[str, int]:
    """RSS (kB), open fds and threads of a process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1))
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
    return {"rss_kb": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": threads}


def slots_active(http: httpx.Client) -> int:
    text = http.get("/metrics").text
    return int(float(re.search(r"^localm_inference_slots_active (\S+)", text, re.M).group(1)))


class Soak:
    """The clients' shared record: counts, and every write the server acknowledged."""

    def __init__(self, server: LocalmServer, owner_key: str, args: argparse.Namespace) -> None:
        self.server, self.owner_key, self.args = server, owner_key, args
        self.done: collections.Counter[str] = collections.Counter()
        self.statuses: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []
        self.disconnects = 0
        self.served = 0
        self.busy = 0
        self.live_keys: dict[str, str] = {}  # id -> plaintext: minted, not revoked
        self.revoked: dict[str, str] = {}
        self.written: dict[str, int] = {}  # what was last acknowledged
        self.plugin_enabled: bool | None = None
        self.write_lock = asyncio.Lock()  # writes of one value go in order, so "last" is well defined
        self.reload_lock = asyncio.Lock()
        self.last_reload = 0.0

    def note(self, action: str, r: httpx.Response, body: Any = None) -> bool:
        """Count a response; True for a 2xx. A status the action may not answer is a failure."""
        code = r.status_code
        label = str(code)
        if code >= 400:
            try:
                data = body if body is not None else r.json()
                err = data.get("error") if isinstance(data.get("error"), dict) else {}
                label += f" {data.get('code') or err.get('code') or ''}".rstrip()
            except (ValueError, AttributeError):
                pass
        self.statuses[label] += 1
        if 200 <= code < 300:
            self.served += 1
            return True
        if code in EXPECTED.get(action, ()) and "model_busy" in label:
            self.busy += 1
            return False
        self.failures.append(f"{action}: {label}: {r.text[:200] if body is None else json.dumps(body)[:200]}")
        return False

    # --- the actions ------------------------------------------------------------------------
    async def stream(self, http: httpx.AsyncClient, rng: random.Random, drop: bool) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                "max_tokens": rng.randint(16, 48), "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                self.note("disconnect" if drop else "stream", r)
                return
            chunks, text = 0, []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                choices = chunk.get("choices") or [{}]
                text.append(choices[0].get("delta", {}).get("content") or "")
                if "error" in chunk or choices[0].get("finish_reason") == "error":
                    problem = chunk.get("error") or choices[0].get("localm_error") or "".join(text)[-300:]
                    self.failures.append(f"stream: ended in an error: {problem}")
                chunks += 1
                if drop and chunks >= 3:
                    self.disconnects += 1
                    break  # leaving the block closes the connection mid-stream
            self.note("disconnect" if drop else "stream", r)

    async def chat(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                "max_tokens": rng.randint(8, 32)}
        r = await http.post("/v1/chat/completions", json=body)
        if self.note("chat", r) and r.json()["choices"][0]["finish_reason"] == "error":
            self.failures.append(f"chat: ended in an error: {r.text[:200]}")

    async def reload(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        self.last_reload = time.monotonic()
        async with self.reload_lock:  # one unload and load at a time; requests keep coming meanwhile
            self.note("reload", await http.post("/v1/models/unload", params={"model": MODEL}))
            await asyncio.sleep(rng.uniform(0, 0.5))
            self.note("reload", await http.post("/v1/models/load", params={"model": MODEL}))

    async def key(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        if self.live_keys and rng.random() < 0.3:
            key_id = rng.choice(sorted(self.live_keys))
            plaintext = self.live_keys.pop(key_id)  # no other client revokes it meanwhile
            r = await http.delete(f"/v1/keys/{key_id}")
            if self.note("key", r):
                self.revoked[key_id] = plaintext
            else:
                self.live_keys[key_id] = plaintext
            return
        r = await http.post("/v1/keys", json={"name": f"soak-{rng.getrandbits(32):08x}", "scopes": ["models:read"]})
        if self.note("key", r):
            minted = r.json()
            self.live_keys[minted["id"]] = minted["key"]
            used = await http.get("/v1/models", headers={"Authorization": f"Bearer {minted['key']}"})
            self.note("key", used)

    async def config(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        async with self.write_lock:
            if rng.random() < 0.5:
                value = rng.randint(50, 200)
                if self.note("config", await http.patch("/v1/config", json={"max_json_depth": value})):
                    self.written["max_json_depth"] = value
            else:
                value = rng.randint(16, 512)
                r = await http.post("/v1/plugins/chat/settings", json={"task_max_tokens": value})
                if self.note("config", r):
                    self.written["chat.task_max_tokens"] = value

    async def plugin(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        async with self.write_lock:
            enable = self.plugin_enabled is False
            r = await http.post(f"/api/plugins/{TOGGLED}/{'enable' if enable else 'disable'}")
            if self.note("plugin", r):
                self.plugin_enabled = enable

    async def one(self, http: httpx.AsyncClient, rng: random.Random, action: str) -> None:
        busy = self.busy
        if action == "reload" and time.monotonic() - self.last_reload < self.args.reload_every:
            action = "stream"  # too soon after the last reload
        try:
            if action in ("stream", "disconnect"):
                await self.stream(http, rng, drop=action == "disconnect")
            else:
                await getattr(self, action)(http, rng)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            self.statuses[f"client error {type(exc).__name__}"] += 1
            self.failures.append(f"{action}: {type(exc).__name__}: {exc}")
        self.done[action] += 1
        if self.busy > busy:  # a 503: wait a moment before the next request, as a client should
            await asyncio.sleep(0.5)

    async def client(self, n: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + n)
        names, weights = list(ACTIONS), list(ACTIONS.values())
        async with httpx.AsyncClient(base_url=self.server.url, timeout=self.args.timeout,
                                     headers={"Authorization": f"Bearer {self.owner_key}"}) as http:
            while time.monotonic() < deadline:
                await self.one(http, rng, rng.choices(names, weights)[0])

    async def run(self, seconds: float, clients: int) -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(self.client(n, deadline) for n in range(clients)))

    async def warm_up(self) -> None:
        """One of each action, so what starts lazily is running before the first figures."""
        rng = random.Random(self.args.seed)
        async with httpx.AsyncClient(base_url=self.server.url, timeout=self.args.timeout,
                                     headers={"Authorization": f"Bearer {self.owner_key}"}) as http:
            for action in ACTIONS:
                await self.one(http, rng, action)
            if self.plugin_enabled is False:
                await self.one(http, rng, "plugin")


def check_after_restart(soak: Soak, server: LocalmServer, key: str) -> list[str]:
    """Every acknowledged write, read back from a server started again on the same data dir."""
    lost: list[str] = []
    with server.client(key, timeout=60) as http:
        listed = {k["id"] for k in http.get("/v1/keys").json()["keys"]}
        for key_id, plaintext in soak.live_keys.items():
            if key_id not in listed:
                lost.append(f"key {key_id} (minted, never revoked) is not listed")
            elif server.client(plaintext).get("/v1/models").status_code != 200:
                lost.append(f"key {key_id} (minted, never revoked) does not authenticate")
        for key_id, plaintext in soak.revoked.items():
            if key_id in listed:
                lost.append(f"key {key_id} (revoked) is listed again")
            elif server.client(plaintext).get("/v1/models").status_code not in (401, 403):
                lost.append(f"key {key_id} (revoked) still authenticates")
        config = http.get("/v1/config").json()
        read = {"max_json_depth": config.get("max_json_depth"),
                "chat.task_max_tokens": config.get("plugins", {}).get("chat", {}).get("task_max_tokens")}
        for name, want in soak.written.items():
            if read[name] != want:
                lost.append(f"config {name} is {read[name]!r}, last written {want!r}")
        if soak.plugin_enabled is not None:
            state = next(p for p in http.get("/api/plugins").json()["plugins"] if p["name"] == TOGGLED)
            if state["enabled"] != soak.plugin_enabled:
                lost.append(f"plugin {TOGGLED} enabled={state['enabled']}, last written {soak.plugin_enabled}")
    return lost


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="how long the clients run (default 5)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the clients' choices")
    parser.add_argument("--reload-every", type=float, default=15.0,
                        help="unload and load the model at most once in this many seconds (default 15)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a client waits for one response")
    parser.add_argument("--max-fd-growth", type=int, default=16, help="open fds the server may gain (default 16)")
    parser.add_argument("--max-thread-growth", type=int, default=8, help="threads it may gain (default 8)")
    parser.add_argument("--max-rss-growth-mb", type=float, default=200.0,
                        help="RSS it may gain, in MB (default 200)")
    parser.add_argument("--keep", action="store_true", help="keep the data dir and the server logs")
    args = parser.parse_args()
    if args.clients < 1 or args.minutes <= 0:
        parser.error("--clients must be at least 1 and --minutes above 0")

    workdir = Path(tempfile.mkdtemp(prefix="localm-soak-"))
    data_dir = workdir / "data"
    server = LocalmServer(data_dir, process=True, plugins=PLUGINS)
    failures: list[str] = []
    try:
        data_dir.mkdir(parents=True)
        made = server.cli("key", "generate", timeout=60)
        if made.returncode != 0:
            raise RuntimeError(f"localm key generate failed:\n{made.stdout}{made.stderr}")
        owner_key = made.stdout.strip()
        made = server.cli("config", "set", "metrics_enabled", "true", timeout=60)
        if made.returncode != 0:
            raise RuntimeError(f"localm config set metrics_enabled failed:\n{made.stdout}{made.stderr}")
        server.start()
        pid = server.proc.pid
        with server.client(owner_key, timeout=120) as http:
            loaded = http.post("/v1/models/load", params={"model": MODEL})
            if loaded.status_code != 200:
                raise RuntimeError(f"POST /v1/models/load: {loaded.status_code} {loaded.text}")
        soak = Soak(server, owner_key, args)
        asyncio.run(soak.warm_up())
        if soak.failures:
            raise RuntimeError("the warm-up failed: " + "; ".join(soak.failures))
        soak.done.clear()
        soak.statuses.clear()
        soak.served = soak.disconnects = soak.busy = 0
        start = proc_stats(pid)
        print(f"soak: {args.clients} clients for {args.minutes:g} min against localm serve --plugins "
              f"{','.join(PLUGINS)} on {MODEL}, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        began = time.monotonic()
        asyncio.run(soak.run(args.minutes * 60, args.clients))
        took = time.monotonic() - began
        with server.client(owner_key, timeout=120) as http:
            # the model loaded, as at the start (a client may have left it unloaded)
            http.post("/v1/models/load", params={"model": MODEL})
            busy, waited = slots_active(http), time.monotonic()
            while busy and time.monotonic() - waited < 10:
                time.sleep(0.5)
                busy = slots_active(http)
        end = proc_stats(pid)

        print(f"ran {took:.0f} s; actions: " + ", ".join(f"{a} {soak.done[a]}" for a in ACTIONS))
        print(f"requests served (2xx): {soak.served}, disconnects mid-stream: {soak.disconnects}, "
              f"503 model_busy while the model reloaded: {soak.busy}")
        print("responses by status: " + ", ".join(f"{k} {v}" for k, v in sorted(soak.statuses.items())))
        print(f"{'server process':<16}{'start':>10}{'end':>10}")
        print(f"{'RSS MB':<16}{start['rss_kb'] / 1024:>10.1f}{end['rss_kb'] / 1024:>10.1f}")
        print(f"{'open fds':<16}{start['fds']:>10}{end['fds']:>10}")
        print(f"{'threads':<16}{start['threads']:>10}{end['threads']:>10}")
        print(f"busy inference slots at the end: {busy}")
        failures += soak.failures
        if busy:
            failures.append(f"{busy} inference slots still busy after every client stopped")
        if end["fds"] - start["fds"] > args.max_fd_growth:
            failures.append(f"open fds grew by {end['fds'] - start['fds']} (bound {args.max_fd_growth})")
        if end["threads"] - start["threads"] > args.max_thread_growth:
            failures.append(f"threads grew by {end['threads'] - start['threads']} (bound {args.max_thread_growth})")
        if (end["rss_kb"] - start["rss_kb"]) / 1024 > args.max_rss_growth_mb:
            failures.append(f"RSS grew by {(end['rss_kb'] - start['rss_kb']) / 1024:.0f} MB "
                            f"(bound {args.max_rss_growth_mb:g})")

        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        server._log.close()
        server = LocalmServer(data_dir, process=True, plugins=PLUGINS)
        server.start()
        lost = check_after_restart(soak, server, owner_key)
        print(f"after SIGKILL and a restart on the same data dir: {len(soak.live_keys)} live keys listed and "
              f"authenticating, {len(soak.revoked)} revoked keys refused, config "
              + ", ".join(f"{k}={v}" for k, v in sorted(soak.written.items()))
              + f", plugin {TOGGLED} enabled={soak.plugin_enabled}: "
              + ("all present" if not lost else f"{len(lost)} lost"))
        failures += lost
    finally:
        server.stop()
        if args.keep:
            print(f"kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if failures:
        shown = collections.Counter(failures)
        print(f"FAILED: {len(failures)} checks")
        for text, count in shown.most_common(20):
            print(f"  {count} x {text}")
        return 1
    print("passed: no server error, no leaked slot, fds, threads and RSS within bounds, no lost write")
    return 0


if __name__ == "__main__":
    sys.exit(main())
