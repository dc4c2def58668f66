"""Kernel overhead benchmark: localm against a bare Litestar app, and ``localm serve`` start-up time.

Run it from the repository root with the project's interpreter::

    .venv/bin/python bench/kernel.py                 # wrk when on PATH, else a Python load generator
    .venv/bin/python bench/kernel.py --loadgen python --duration 3 --starts 3

It prints, in one run:

1. requests/second (and mean latency) for ``GET /health`` and ``GET /v1/config`` served by
   ``localm serve --plugins ""`` and by a bare Litestar app that gives the same answers
   (same status codes, same JSON bodies: the bare app serves the bodies localm returned)
   on a socket made by the kernel's own ``bind_socket`` and under the same ``uvicorn.Config``
   settings, with the ratio localm/bare; and, in the same run, by ``localm serve --loop asyncio
   --http h11`` (uvicorn's pure-Python event loop and parser), with the ratio of localm on
   uvloop and httptools (what ``localm serve`` picks when they are installed) to it;
2. mean ms per request for one client sending ``GET /health`` sequentially on one keep-alive
   connection, on each server;
3. the time from starting ``localm serve`` to the server answering on its port (median of
   a few cold starts, each on a fresh data dir), next to the same for the bare app.

Every server is a subprocess on 127.0.0.1 and the load generator only targets loopback.
Every loop is bounded in time and count; the default run takes about half a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvicorn
from litestar import Litestar, Request, Response, get

HOST = "127.0.0.1"
START_TIMEOUT = 60.0  # seconds a server may take to answer before we give up
POLL = 0.005  # readiness poll interval, seconds

# The uvicorn settings kernel/server.py gives ``localm serve`` (log_level: the config default, "info").
UVICORN_SETTINGS: dict[str, Any] = dict(lifespan="on", log_level="info", access_log=False,
                                        timeout_graceful_shutdown=5, log_config=None, server_header=False)


# --- the bare app (runs in a subprocess: ``python bench/kernel.py --serve-bare BODIES READY``) ------

def serve_bare(bodies_path: str, ready_path: str) -> None:
    """A plain Litestar app on uvicorn answering /health and /v1/config with localm's bodies."""
    from localm.kernel.server import bind_socket

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bodies = json.loads(Path(bodies_path).read_text())
    health_status, health_body = bodies["health"]["status"], bodies["health"]["body"]
    config_status, config_body = bodies["config"]["status"], bodies["config"]["body"]

    @get("/health")
    async def health(request: Request) -> Response:
        return Response(health_body, status_code=health_status)

    @get("/v1/config")
    async def read_config(request: Request) -> Response:
        return Response(config_body, status_code=config_status)

    sock = bind_socket(HOST, 0, bump=False)  # the very socket setup ``localm serve`` uses
    port = sock.getsockname()[1]

    def announce() -> None:  # like localm's on_ready: once lifespan startup is done
        tmp = ready_path + ".tmp"
        Path(tmp).write_text(json.dumps({"pid": os.getpid(), "port": port, "url": f"http://{HOST}:{port}"}))
        os.replace(tmp, ready_path)

    app = Litestar(route_handlers=[health, read_config], on_startup=[announce], logging_config=None,
                   openapi_config=None, debug=False)
    server = uvicorn.Server(uvicorn.Config(app, **UVICORN_SETTINGS))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


# --- servers as subprocesses ------------------------------------------------------------------

#: The servers measured: localm as it serves (uvloop and httptools when installed), localm on
#: uvicorn's pure-Python loop and parser, and the bare Litestar app.
SLOW_STACK = ["--loop", "asyncio", "--http", "h11"]


def localm_command(data: Path, extra: list[str] | None = None) -> list[str]:
    try:  # the SDK's own command line, so the bench follows it
        from localm.sdk.testing import LocalmServer
        return LocalmServer(data, plugins=[], host=HOST, args=extra).command()
    except ImportError:  # pytest missing: the same command by hand
        return [sys.executable, "-m", "localm.kernel", "--data-dir", str(data), "serve",
                "--host", HOST, "--port", "0", *(extra or []), "--plugins", ""]


class Server:
    """One server subprocess: ``localm``, ``localm-h11`` (asyncio and h11) or ``bare``."""

    def __init__(self, kind: str, workdir: Path, bodies: Path | None = None) -> None:
        self.kind = kind
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.bodies = bodies
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.port = 0
        self.token = ""
        self.ready_s = 0.0
        self.log_path = workdir / "server.log"
        self._log: Any = None

    def command(self) -> tuple[list[str], Path]:
        if self.kind in ("localm", "localm-h11"):
            data = self.workdir / "data"
            return localm_command(data, SLOW_STACK if self.kind == "localm-h11" else None), data / "server.json"
        assert self.bodies is not None
        ready = self.workdir / "ready.json"
        return [sys.executable, os.path.abspath(__file__), "--serve-bare", str(self.bodies), str(ready)], ready

    def start(self) -> "Server":
        """Start the process and wait until it has announced itself and answers GET /health."""
        cmd, info_path = self.command()
        with contextlib.suppress(OSError):
            info_path.unlink()
        env = dict(os.environ)
        env.pop("LOCALM_API_KEY", None)  # open mode: /v1/config takes the attach token
        self._log = open(self.log_path, "ab")
        started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        for _ in range(int(START_TIMEOUT / POLL) + 100):
            if time.monotonic() >= deadline:
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                info = json.loads(info_path.read_text())
            except (OSError, ValueError):
                info = None
            if info and info.get("pid") == self.proc.pid:
                try:
                    status = http_get(int(info["port"]), "/health", timeout=1.0)[0]
                except OSError:
                    status = 0
                if status:
                    self.ready_s = time.perf_counter() - started
                    self.url, self.port, self.token = info["url"], int(info["port"]), info.get("token", "")
                    return self
            time.sleep(POLL)
        self.stop()
        raise RuntimeError(f"{self.kind} server was not ready within {START_TIMEOUT:.0f} s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stack(self) -> str:
        """The event loop and HTTP parser a localm server says it runs on ("uvloop, httptools")."""
        found = re.search(r"localm serving on .*; (\w+), (\w+)\)$", self.log(), re.M)
        return f"{found.group(1)}, {found.group(2)}" if found else "unknown"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None


def http_get(port: int, path: str, *, headers: dict[str, str] | None = None,
             timeout: float = 5.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


# --- load generators ----------------------------------------------------------------------------

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


class Wrk:
    def __init__(self, threads: int, connections: int) -> None:
        self.threads = threads
        self.connections = connections
        self.exe = shutil.which("wrk") or "wrk"

    def describe(self, duration: float) -> str:
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        return f"wrk ({threads}, {self.connections} connections, {duration:g} s)"

    def run(self, port: int, path: str, headers: dict[str, str], duration: float) -> dict[str, Any]:
        cmd = [self.exe, f"-t{self.threads}", f"-c{self.connections}", f"-d{max(1, round(duration))}s",
               "--timeout", "5s"]
        for key, value in headers.items():
            cmd += ["-H", f"{key}: {value}"]
        cmd.append(f"http://{HOST}:{port}{path}")
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 30).stdout
        rps = re.search(r"Requests/sec:\s*([\d.]+)", out)
        if rps is None:
            raise RuntimeError(f"could not parse wrk output:\n{out}")
        latency = re.search(r"Latency\s+([\d.]+)(us|ms|s|m)\b", out)
        total = re.search(r"(\d+) requests in", out)
        non2xx = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", out)
        errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
        return {"rps": float(rps.group(1)),
                "latency_ms": float(latency.group(1)) * _UNITS[latency.group(2)] if latency else float("nan"),
                "requests": int(total.group(1)) if total else 0,
                "non2xx": int(non2xx.group(1)) if non2xx else 0,
                "errors": sum(int(g) for g in errors.groups()) if errors else 0}


async def _py_connection(port: int, request: bytes, deadline: float, max_requests: int,
                         counts: dict[str, float]) -> None:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 5)
    except (OSError, asyncio.TimeoutError):
        counts["errors"] += 1
        return
    try:
        for _ in range(max_requests):
            sent = time.monotonic()
            if sent >= deadline:
                break
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
                    break
            if length:
                await asyncio.wait_for(reader.readexactly(length), 5)
            counts["latency"] += time.monotonic() - sent
            counts["requests"] += 1
            if not 200 <= status < 400:
                counts["non2xx"] += 1
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError, asyncio.LimitOverrunError):
        counts["errors"] += 1
    finally:
        writer.close()


def _py_worker(args: tuple[int, bytes, float, int, int]) -> dict[str, float]:
    port, request, duration, connections, max_requests = args
    counts = {"requests": 0, "non2xx": 0, "errors": 0, "latency": 0.0}

    async def main() -> None:
        deadline = time.monotonic() + duration
        await asyncio.gather(*(_py_connection(port, request, deadline, max_requests, counts)
                               for _ in range(connections)))

    asyncio.run(main())
    return counts


class PyLoad:
    """Keep-alive HTTP/1.1 over raw asyncio sockets in a few processes, for a fixed time.

    Much slower than wrk: on a small machine it competes with the server for CPU, so its
    absolute numbers are low; the ratio is still comparable between servers.
    """

    MAX_REQUESTS_PER_CONNECTION = 1_000_000

    def __init__(self, processes: int, connections: int) -> None:
        self.processes = processes
        self.connections = max(connections, processes)

    def describe(self, duration: float) -> str:
        return (f"python (raw asyncio sockets, {self.processes} processes, {self.connections} connections, "
                f"{duration:g} s)")

    def run(self, port: int, path: str, headers: dict[str, str], duration: float) -> dict[str, Any]:
        lines = [f"GET {path} HTTP/1.1", f"Host: {HOST}:{port}", *(f"{k}: {v}" for k, v in headers.items())]
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        per = [self.connections // self.processes + (1 if i < self.connections % self.processes else 0)
               for i in range(self.processes)]
        ctx = multiprocessing.get_context("fork" if sys.platform != "win32" else "spawn")
        with ctx.Pool(self.processes) as pool:
            results = pool.map_async(_py_worker, [(port, request, duration, n, self.MAX_REQUESTS_PER_CONNECTION)
                                                  for n in per]).get(timeout=duration + 30)
        total = {k: sum(r[k] for r in results) for k in ("requests", "non2xx", "errors", "latency")}
        return {"rps": total["requests"] / duration,
                "latency_ms": 1e3 * total["latency"] / total["requests"] if total["requests"] else float("nan"),
                "requests": int(total["requests"]), "non2xx": int(total["non2xx"]), "errors": int(total["errors"])}


# --- the benchmark --------------------------------------------------------------------------------

ROUTES = [("GET /health", "/health", "health", False), ("GET /v1/config", "/v1/config", "config", True)]


def sequential_ms(port: int, path: str, headers: dict[str, str], count: int = 25) -> float:
    """Mean ms per request for one client sending requests one after another on one keep-alive connection."""
    conn = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        for i in range(count + 3):
            if i == 3:  # the first few ride on TCP quick-ACK mode; time the steady state
                started = time.perf_counter()
            conn.request("GET", path, headers=headers)
            conn.getresponse().read()
        return (time.perf_counter() - started) / count * 1e3
    finally:
        conn.close()


def measure_throughput(args: argparse.Namespace, loadgen: Any,
                       workdir: Path) -> tuple[dict[str, dict[str, dict[str, float]]], list[str]]:
    """{server: {route label: {"rps", "latency_ms"}}} for localm, localm-h11 and bare, and notes."""
    notes: list[str] = []
    servers: dict[str, Server] = {}
    try:
        localm = servers["localm"] = Server("localm", workdir / "localm").start()
        auth = {"Authorization": f"Bearer {localm.token}"}
        bodies: dict[str, Any] = {}
        for label, path, key, needs_auth in ROUTES:
            status, body = http_get(localm.port, path, headers=auth if needs_auth else {})
            bodies[key] = {"status": status, "body": json.loads(body)}
        if bodies["config"]["status"] != 200:
            raise RuntimeError(f"localm GET /v1/config answered {bodies['config']['status']}: "
                               f"{bodies['config']['body']}")
        bodies_path = workdir / "bodies.json"
        bodies_path.write_text(json.dumps(bodies))
        servers["localm-h11"] = Server("localm-h11", workdir / "localm-h11").start()
        servers["bare"] = Server("bare", workdir / "bare", bodies=bodies_path).start()
        notes.append(f"stacks (from the start-up lines): localm {servers['localm'].stack()}, "
                     f"localm-h11 {servers['localm-h11'].stack()}")

        def headers(name: str, needs_auth: bool) -> dict[str, str]:
            """Each localm's own attach token (the bare app gets localm's, and ignores it)."""
            server = servers[name] if name != "bare" else localm
            return {"Authorization": f"Bearer {server.token}"} if needs_auth else {}

        def same(name: str, key: str, body: Any) -> bool:
            """The bodies match; another localm process reports its own instance id and port."""
            want = bodies[key]["body"]
            if name == "localm-h11" and key == "config" and isinstance(body, dict):
                body = {**body, "instance_id": want.get("instance_id"), "instance_port": want.get("instance_port")}
            return bool(body == want)

        # Same answers on all.
        for label, path, key, needs_auth in ROUTES:
            for name, server in servers.items():
                status, body = http_get(server.port, path, headers=headers(name, needs_auth))
                if status != bodies[key]["status"] or not same(name, key, json.loads(body)):
                    notes.append(f"MISMATCH {name} {label}: {status} {body[:200]!r} (localm: {bodies[key]})")
        if not notes:
            notes.append(f"answers match: /health {bodies['health']['status']}, /v1/config "
                         f"{bodies['config']['status']}, same JSON bodies on localm, localm-h11 and bare")

        sequential = {name: sequential_ms(server.port, "/health", {}) for name, server in servers.items()}
        notes.append("one client, sequential keep-alive GET /health: "
                     + ", ".join(f"{name} {ms:.2f} ms/request" for name, ms in sequential.items()))

        for name, server in servers.items():  # warm up: lazy imports, caches, first-call paths
            for label, path, key, needs_auth in ROUTES:
                loadgen.run(server.port, path, headers(name, needs_auth), args.warmup)

        results: dict[str, dict[str, dict[str, float]]] = {name: {} for name in servers}
        for label, path, key, needs_auth in ROUTES:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
            for _ in range(args.rounds):  # alternate servers so drift hits all alike
                for name, server in servers.items():
                    result = loadgen.run(server.port, path, headers(name, needs_auth), args.duration)
                    if result["errors"]:
                        notes.append(f"{name} {label}: {result['errors']} socket errors")
                    if result["non2xx"] and bodies[key]["status"] < 400:
                        notes.append(f"{name} {label}: {result['non2xx']} unexpected non-2xx answers")
                    runs[name].append(result)
            for name, rs in runs.items():
                results[name][label] = {"rps": statistics.median(r["rps"] for r in rs),
                                        "latency_ms": statistics.median(r["latency_ms"] for r in rs)}
        return results, notes
    finally:
        for server in servers.values():
            server.stop()


def measure_startup(kind: str, starts: int, workdir: Path, bodies: Path | None = None) -> list[float]:
    times = []
    for i in range(starts):
        server = Server(kind, workdir / f"{kind}-start-{i}", bodies=bodies)  # a fresh data dir each time
        try:
            times.append(server.start().ready_s)
        finally:
            server.stop()
    return times


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def describe_stack() -> str:
    from importlib.metadata import version
    cfg = uvicorn.Config(app=None)  # type: ignore[arg-type]
    loop = ("uvloop" if _has("uvloop") else "asyncio") if cfg.loop == "auto" else cfg.loop
    http_impl = ("httptools" if _has("httptools") else "h11") if cfg.http == "auto" else cfg.http
    metrics = " (LOCALM_METRICS=1: metrics on)" if os.environ.get("LOCALM_METRICS") == "1" else ""
    load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    return (f"python {sys.version.split()[0]}, litestar {version('litestar')}, uvicorn {version('uvicorn')} "
            f"(loop {loop}, http {http_impl}), {os.cpu_count()} CPUs{load}{metrics}")


def print_table(results: dict[str, dict[str, dict[str, float]]]) -> None:
    print(f"{'route':<16}{'localm req/s':>13}{'bare req/s':>12}{'ratio':>7}{'localm ms':>11}{'bare ms':>9}")
    for label, *_ in ROUTES:
        a, b = results["localm"][label], results["bare"][label]
        ratio = a["rps"] / b["rps"] if b["rps"] else float("nan")
        print(f"{label:<16}{a['rps']:>13.0f}{b['rps']:>12.0f}{ratio:>7.2f}"
              f"{a['latency_ms']:>11.2f}{b['latency_ms']:>9.2f}")
    print("localm on its event loop and parser against localm --loop asyncio --http h11 (same run):")
    print(f"{'route':<16}{'localm req/s':>13}{'h11 req/s':>12}{'ratio':>7}{'localm ms':>11}{'h11 ms':>9}")
    for label, *_ in ROUTES:
        a, b = results["localm"][label], results["localm-h11"][label]
        ratio = a["rps"] / b["rps"] if b["rps"] else float("nan")
        print(f"{label:<16}{a['rps']:>13.0f}{b['rps']:>12.0f}{ratio:>7.2f}"
              f"{a['latency_ms']:>11.2f}{b['latency_ms']:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement (1-30, default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up per server and route")
    parser.add_argument("--rounds", type=int, default=1, help="measurements per server and route (median; 1-5)")
    parser.add_argument("--connections", type=int, default=32, help="concurrent keep-alive connections")
    parser.add_argument("--threads", type=int, default=1, help="wrk threads")
    parser.add_argument("--processes", type=int, default=2, help="processes of the Python load generator")
    parser.add_argument("--loadgen", choices=("auto", "wrk", "python"), default="auto",
                        help="auto: wrk when it is on PATH, else python")
    parser.add_argument("--starts", type=int, default=5, help="cold starts to time (median; 1-20)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (server logs)")
    parser.add_argument("--serve-bare", nargs=2, metavar=("BODIES", "READY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        serve_bare(*args.serve_bare)
        return
    args.duration = min(max(args.duration, 1.0), 30.0)
    args.warmup = min(max(args.warmup, 0.5), 10.0)
    args.rounds = min(max(args.rounds, 1), 5)
    args.starts = min(max(args.starts, 1), 20)
    args.connections = min(max(args.connections, 1), 1000)

    if args.loadgen == "wrk" or (args.loadgen == "auto" and shutil.which("wrk")):
        if not shutil.which("wrk"):
            sys.exit("wrk is not on PATH (apt-get install -y wrk), or use --loadgen python")
        loadgen: Any = Wrk(args.threads, args.connections)
    else:
        loadgen = PyLoad(args.processes, args.connections)

    workdir = Path(tempfile.mkdtemp(prefix="localm-bench-"))
    t0 = time.perf_counter()
    try:
        print(describe_stack(), flush=True)
        print(f"load generator: {loadgen.describe(args.duration)}"
              + (f", median of {args.rounds} rounds" if args.rounds > 1 else ""), flush=True)
        results, notes = measure_throughput(args, loadgen, workdir)
        print_table(results)
        for note in notes:
            print(f"  {note}")
        sys.stdout.flush()
        localm_starts = measure_startup("localm", args.starts, workdir)
        bare_starts = measure_startup("bare", args.starts, workdir, bodies=workdir / "bodies.json")

        def line(times: list[float]) -> str:
            return (f"median {statistics.median(times):.2f} s over {len(times)} starts "
                    f"(min {min(times):.2f}, max {max(times):.2f})")
        print(f"localm serve → ready: {line(localm_starts)}")
        print(f"bare app     → ready: {line(bare_starts)}")
        print(f"(bench took {time.perf_counter() - t0:.0f} s" + (f"; logs in {workdir}" if args.keep else "") + ")")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
