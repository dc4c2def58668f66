"""A transcript in each response_format OpenAI's transcription route answers with."""

from __future__ import annotations

import math
from typing import Any

from .engine import Transcript
from .languages import name as language_name

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")


def _stamp(seconds: float, sep: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def srt(t: Transcript) -> str:
    return "".join(f"{i}\n{_stamp(s.start, ',')} --> {_stamp(s.end, ',')}\n{s.text.strip()}\n\n"
                   for i, s in enumerate(t.segments, 1))


def vtt(t: Transcript) -> str:
    return "WEBVTT\n\n" + "".join(f"{_stamp(s.start, '.')} --> {_stamp(s.end, '.')}\n{s.text.strip()}\n\n"
                                  for s in t.segments)


def usage(t: Transcript) -> dict[str, Any]:
    return {"type": "duration", "seconds": math.ceil(t.duration)}


def verbose(t: Transcript, granularities: set[str]) -> dict[str, Any]:
    """task, language (its name), duration, text; segments (with timing and confidence) and/or words."""
    out: dict[str, Any] = {"task": "transcribe", "language": language_name(t.language),
                           "duration": round(t.duration, 3), "text": t.text}
    if "segment" in granularities or not granularities:
        out["segments"] = [{"id": s.id, "seek": s.seek, "start": round(s.start, 3), "end": round(s.end, 3),
                            "text": s.text, "tokens": list(s.tokens), "temperature": s.temperature,
                            "avg_logprob": s.avg_logprob, "compression_ratio": s.compression_ratio,
                            "no_speech_prob": s.no_speech_prob, "confidence": round(math.exp(s.avg_logprob), 4)}
                           for s in t.segments]
    if "word" in granularities:
        out["words"] = [{"word": w.word.strip(), "start": round(w.start, 3), "end": round(w.end, 3),
                         "probability": round(w.probability, 4)} for s in t.segments for w in s.words]
    out["usage"] = usage(t)
    return out
