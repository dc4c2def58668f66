"""Audio out: Piper's float samples as wav, pcm, mp3, opus, aac or flac.

wav is 16-bit mono at the voice's own rate; pcm is the same samples, raw little-endian,
resampled to the 24 kHz OpenAI clients assume for it. The compressed formats are encoded
with PyAV. An encoder is fed one sentence at a time and hands back the bytes it can send
at once, so a streamed response carries audio while later sentences are still spoken.
"""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np

#: response_format -> (PyAV container, codec, sample rate; None keeps the voice's)
COMPRESSED = {"mp3": ("mp3", "libmp3lame", None), "opus": ("ogg", "libopus", 48000),
              "aac": ("adts", "aac", None), "flac": ("flac", "flac", None)}
FORMATS = ("wav", "pcm", *COMPRESSED)
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "mp3": "audio/mpeg", "opus": "audio/ogg",
               "aac": "audio/aac", "flac": "audio/flac"}
PCM_RATE = 24000
#: A streamed WAV's sizes are not known when its header is sent.
UNKNOWN_SIZE = 0xFFFFFFFF


def int16(samples: np.ndarray) -> np.ndarray:
    return (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2")


def wav_header(rate: int, data_bytes: int) -> bytes:
    riff = UNKNOWN_SIZE if data_bytes == UNKNOWN_SIZE else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data_bytes))


class _Sink:
    """A write-only, non-seekable file for PyAV: what the muxer wrote since the last take."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: Any) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


class Encoder:
    """Encode a voice's samples (float32, mono, at ``rate``) as ``fmt``.

    ``feed`` returns the bytes ready so far and ``finish`` the rest. With ``streamed`` False,
    the whole file is returned by ``finish`` (a WAV then has its exact sizes)."""

    def __init__(self, fmt: str, rate: int, *, streamed: bool) -> None:
        self.fmt, self.rate, self.streamed = fmt, rate, streamed
        self.media_type = MEDIA_TYPES[fmt]
        self.out_rate = PCM_RATE if fmt == "pcm" else (COMPRESSED[fmt][2] or rate) if fmt in COMPRESSED else rate
        self._pcm: list[bytes] = []
        self._started = False
        self._resampler: Any = None
        self._container: Any = None
        if fmt == "pcm" and rate != PCM_RATE:
            import av
            self._resampler = av.AudioResampler(format="s16", layout="mono", rate=PCM_RATE)
        elif fmt in COMPRESSED:
            import av
            container, codec, _ = COMPRESSED[fmt]
            self._sink: Any = _Sink() if streamed else io.BytesIO()
            self._container = av.open(self._sink, mode="w", format=container)
            self._stream = self._container.add_stream(codec, rate=self.out_rate)
            self._stream.layout = "mono"
            self._resampler = av.AudioResampler(format=self._stream.format, layout="mono", rate=self.out_rate)

    def _frames(self, samples: np.ndarray | None) -> list[Any]:
        import av
        if samples is None:
            return self._resampler.resample(None)
        frame = av.AudioFrame.from_ndarray(int16(samples).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.rate
        return self._resampler.resample(frame)

    def _mux(self, frames: list[Any], flush: bool = False) -> None:
        for frame in frames:
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        if flush:
            for packet in self._stream.encode(None):
                self._container.mux(packet)

    def _ready(self) -> bytes:
        return self._sink.take() if self.streamed else b""

    def feed(self, samples: np.ndarray) -> bytes:
        if self._container is not None:
            self._mux(self._frames(samples))
            return self._ready()
        if self._resampler is not None:
            data = b"".join(bytes(f.to_ndarray().astype("<i2").tobytes()) for f in self._frames(samples))
        else:
            data = int16(samples).tobytes()
        if not self.streamed:
            self._pcm.append(data)
            return b""
        if self.fmt == "wav" and not self._started:
            self._started = True
            return wav_header(self.rate, UNKNOWN_SIZE) + data
        return data

    def finish(self) -> bytes:
        if self._container is not None:
            self._mux(self._frames(None), flush=True)
            self._container.close()
            return self._ready() if self.streamed else self._sink.getvalue()
        tail = b""
        if self._resampler is not None:
            tail = b"".join(bytes(f.to_ndarray().astype("<i2").tobytes()) for f in self._frames(None))
        if not self.streamed:
            data = b"".join(self._pcm) + tail
            return wav_header(self.rate, len(data)) + data if self.fmt == "wav" else data
        if self.fmt == "wav" and not self._started:  # nothing was spoken: still a (streamed) WAV
            return wav_header(self.rate, UNKNOWN_SIZE) + tail
        return tail
