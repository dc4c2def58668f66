"""An encoded clip decoded into bounded memory.

A compressed clip can hold far more sound than its size suggests: a 49 KB FLAC of silence
holds four hours, and 25 MB of it two thousand hours, which would decode to hundreds of
gigabytes. So a clip's length is bounded twice:

- before anything is decoded, by what its container and stream headers say (a clip whose
  header says it is longer than the limit is refused at once);
- while it is decoded, since a header can lie or say nothing: PyAV decodes it frame by frame
  into a buffer of the limit's size (16-bit, mono, 16 kHz), and the moment the clip passes
  the limit (a frame's length is known before it is resampled) decoding stops and the clip
  is refused. Nothing past the limit is ever decoded or held.

Nothing is written anywhere: the clip is read from memory.
"""

from __future__ import annotations

import gc
import io
from collections.abc import Iterator
from typing import Any

SAMPLE_RATE = 16000  # what Whisper listens at


class Undecodable(Exception):
    """The bytes are not audio PyAV can read (the reason, without any path)."""


class TooLong(Exception):
    """The clip is longer than ``limit`` seconds: ``seconds`` long by its header, or None when
    decoding passed the limit (the header did not say, or said less)."""

    def __init__(self, limit: float, seconds: float | None) -> None:
        super().__init__(limit, seconds)
        self.limit = limit
        self.seconds = seconds

    def length(self, limit: str | None = None) -> str:
        """How long the clip is, as far as anyone looked (``limit``: the limit in the caller's words)."""
        if self.seconds is not None:
            return f"{span(self.seconds)} long (so says its header)"
        return f"longer than {limit or span(self.limit)} (found while decoding it)"


class TooShort(Exception):
    """The clip is shorter than ``limit`` seconds (``seconds``)."""

    def __init__(self, limit: float, seconds: float) -> None:
        super().__init__(limit, seconds)
        self.limit = limit
        self.seconds = seconds


def span(seconds: float) -> str:
    """A length for a person: 0.05 seconds, 9.5 seconds, 1 minute, 1 min 0.5 s, 4 hours, 4 h 0 min 23 s."""
    if seconds < 60:
        return f"{seconds:.2g} seconds" if seconds < 1 else f"{seconds:.3g} seconds"
    hours, rest = divmod(round(seconds, 1), 3600)
    minutes, secs = divmod(rest, 60)
    hours, minutes, secs = int(hours), int(minutes), round(secs, 1)
    if not secs and not minutes:
        return "1 hour" if hours == 1 else f"{hours} hours"
    if not secs and not hours:
        return "1 minute" if minutes == 1 else f"{minutes} minutes"
    parts = [f"{hours} h"] if hours else []
    parts += [f"{minutes} min"] if minutes or hours else []
    parts += [f"{secs:g} s"] if secs else []
    return " ".join(parts)


def header_seconds(container: Any, stream: Any) -> float | None:
    """The longest length the clip's headers claim (the container's, the stream's, or the
    stream's frame count at its rate), or None when none of them says."""
    import av

    claims = []
    if container.duration and container.duration > 0:
        claims.append(container.duration / av.time_base)
    if stream.duration and stream.duration > 0 and stream.time_base:
        claims.append(float(stream.duration * stream.time_base))
    rate = getattr(stream, "rate", None) or getattr(stream, "sample_rate", None)
    if stream.frames and stream.frames > 0 and rate and stream.codec_context.frame_size:
        claims.append(stream.frames * stream.codec_context.frame_size / rate)
    return max(claims) if claims else None


def _frames(container: Any, stream: Any) -> Iterator[Any]:
    """The stream's decoded frames, skipping any that fail to decode (as faster-whisper does)."""
    import av

    frames = container.decode(stream)
    while True:
        try:
            frame = next(frames)
        except StopIteration:
            return
        except av.error.InvalidDataError:
            continue
        yield frame


def decode(data: bytes, max_seconds: float, min_seconds: float = 0.0) -> Any:
    """Mono float32 samples at 16 kHz from an encoded clip held in memory: TooLong past
    ``max_seconds`` (by its header, before decoding; else as soon as decoding passes it),
    TooShort under ``min_seconds``, Undecodable when it is not audio."""
    import av
    import numpy as np

    # the bounded buffer: reserved whole (its pages are only taken as they are written, and
    # all given back at once when it goes), never grown; the clip's own seconds are the limit,
    # and the room a resampler's rounding might add at the end
    limit = int(max_seconds * SAMPLE_RATE) + 1024
    buffer = np.empty(limit, dtype=np.int16)
    count = 0  # samples kept, at 16 kHz
    heard = 0.0  # seconds decoded, at the clip's own rate

    def keep(frames: Any) -> None:
        nonlocal count
        for out in frames:
            array = out.to_ndarray().reshape(-1)
            if count + array.size > limit:
                raise TooLong(max_seconds, None)
            buffer[count:count + array.size] = array
            count += array.size

    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise Undecodable("it holds no audio stream")
            stream = container.streams.audio[0]
            claimed = header_seconds(container, stream)
            if claimed is not None and claimed > max_seconds:
                raise TooLong(max_seconds, claimed)
            resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
            try:
                for frame in _frames(container, stream):
                    if not frame.sample_rate or frame.sample_rate <= 0:
                        raise Undecodable("a frame has no sample rate")
                    # a frame's length is known before it is resampled: one frame at a tiny
                    # sample rate would otherwise resample to hours in one call
                    heard += frame.samples / frame.sample_rate
                    if heard > max_seconds:
                        raise TooLong(max_seconds, None)
                    keep(resampler.resample(frame))
                keep(resampler.resample(None))
            finally:
                del resampler
    except (TooLong, Undecodable):
        buffer = None  # the traceback keeps this frame: the samples go now, not with it
        raise
    except (av.error.FFmpegError, IndexError, ValueError, OSError, EOFError, ZeroDivisionError) as exc:
        buffer = None
        reason = getattr(exc, "strerror", None) or str(exc).split(";")[0].strip() or type(exc).__name__
        raise Undecodable(reason) from None
    finally:
        gc.collect()  # PyAV's resampler frees its buffers late otherwise (faster-whisper does the same)
    if count < min_seconds * SAMPLE_RATE:
        buffer = None
        raise TooShort(min_seconds, count / SAMPLE_RATE)
    return buffer[:count].astype(np.float32) / 32768.0
