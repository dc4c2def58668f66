"""The faster_whisper engine: a CTranslate2 Whisper model (``ct2`` in the registry) loaded
by the model manager like any other model, transcribing on a thread of its own.

Requests wait their turn in the engine's queue (``sdk.engines.Serial``): one clip is
transcribed at a time, off the event loop, so a transcription never blocks the server nor
a chat (which decodes on its own engine's thread). A request that is cancelled while it
waits leaves the queue; one cancelled while it runs stops at the next segment. The audio
is decoded from memory with PyAV (what faster-whisper reads files with), within the
request's length limit (audio.py), and never written anywhere.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import attrs
from localm import sdk
from localm.sdk import engines as spec

from .audio import decode

#: A transcription's longest clip unless the request says otherwise (the max_minutes setting's default).
MAX_MINUTES = 60


@attrs.frozen
class Options:
    """One transcription's choices (already checked by the route)."""

    language: str | None = None
    prompt: str | None = None
    temperature: float | None = None  # None: Whisper's fallback ladder, 0.0 to 1.0
    words: bool = False
    beam_size: int = 5
    vad_filter: bool = True
    #: The clip may be at most this long (by its header before decoding, and while decoding)
    #: and at least min_seconds. None: the voice plugin's max_minutes setting.
    max_seconds: float | None = None
    min_seconds: float = 0.0


@attrs.frozen
class Word:
    word: str
    start: float
    end: float
    probability: float


@attrs.frozen
class Segment:
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: tuple[int, ...]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: tuple[Word, ...] = ()


@attrs.frozen
class Transcript:
    language: str
    language_probability: float
    duration: float
    segments: tuple[Segment, ...]

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments).strip()


class Cancelled(Exception):
    """The client left; the work stopped."""


def threads(setting: int) -> int:
    """CPU threads for CTranslate2: the setting, or every core this process may run on, up to four."""
    return setting or min(4, spec.usable_cores())


def load_model(path: str, settings: dict[str, Any]) -> Any:
    """A faster-whisper WhisperModel on the CPU, from a CTranslate2 folder (never from a hub)."""
    try:
        from faster_whisper import WhisperModel
    except ImportError as exc:
        raise spec.EngineError("Transcription needs faster-whisper: pip install 'localm[voice]' (or localm plugin "
                               "install-deps voice)", code="engine_missing") from exc
    if not Path(path, "model.bin").is_file():
        raise spec.EngineError(f"The model's files are missing (no model.bin in {Path(path).name})",
                               code="model_files_missing")
    try:
        return WhisperModel(path, device="cpu", compute_type=settings.get("compute_type", "int8"),
                            cpu_threads=threads(settings.get("threads", 0)), num_workers=1, local_files_only=True)
    except Exception as exc:  # CTranslate2's own errors: a damaged or unsupported folder
        raise spec.EngineError(f"CTranslate2 could not load the model: {str(exc).splitlines()[0][:200]}") from exc


def run(model: Any, audio: Any, options: Options, cancelled: threading.Event | None = None) -> Transcript:
    """Transcribe decoded samples, segment by segment (stopping when ``cancelled`` is set)."""
    temperature: Any = options.temperature if options.temperature is not None else (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    pieces, info = model.transcribe(audio, language=options.language, initial_prompt=options.prompt or None,
                                    temperature=temperature, word_timestamps=options.words,
                                    beam_size=options.beam_size, vad_filter=options.vad_filter)
    duration = float(info.duration)
    out = []
    for s in pieces:
        if cancelled is not None and cancelled.is_set():
            raise Cancelled()
        words = tuple(Word(w.word, min(float(w.start), duration), min(float(w.end), duration), float(w.probability))
                      for w in (s.words or ()))
        out.append(Segment(id=s.id, seek=s.seek, start=float(s.start), end=min(float(s.end), duration), text=s.text,
                           tokens=tuple(s.tokens), temperature=float(s.temperature or 0.0),
                           avg_logprob=float(s.avg_logprob), compression_ratio=float(s.compression_ratio),
                           no_speech_prob=float(s.no_speech_prob), words=words))
    return Transcript(language=info.language, language_probability=float(info.language_probability),
                      duration=duration, segments=tuple(out))


class WhisperEngine:
    """A loaded Whisper model (an sdk.engines.SpeechToTextEngine): it transcribes, and does nothing else."""

    engine = "faster_whisper"

    def __init__(self, entry: Any, settings: dict[str, Any]) -> None:
        self.id = entry.id
        self.model = load_model(entry.path, settings)
        self.languages: tuple[str, ...] = tuple(self.model.supported_languages)
        self.capabilities = spec.Capabilities(context_window=self.model.max_length, audio=True)
        self.beam_size = int(settings.get("beam_size", 5))
        self.vad_filter = bool(settings.get("vad_filter", True))
        self.queue_limit = int(settings.get("queue_limit", 16))
        self._serial = spec.Serial(f"localm-whisper-{entry.id}")

    @property
    def busy(self) -> int:
        return self._serial.busy

    async def transcribe(self, data: bytes, options: Options) -> Transcript:
        """Decode and transcribe ``data`` in this engine's queue. Cancelling the awaiting task
        takes a waiting request out of the queue, and stops a running one at its next segment."""
        if self._serial.busy >= self.queue_limit:
            raise sdk.LocalmError(503, f"{self.busy} transcriptions are running or waiting; retry in a moment",
                                  code="speech_busy")
        options = attrs.evolve(options, beam_size=self.beam_size, vad_filter=self.vad_filter)
        cancelled = threading.Event()

        def work() -> Transcript:
            if cancelled.is_set():
                raise Cancelled()
            limit = options.max_seconds if options.max_seconds is not None else MAX_MINUTES * 60.0
            return run(self.model, decode(data, limit, options.min_seconds), options, cancelled)

        try:
            return await self._serial.call(work)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def close(self) -> None:
        self._serial.close()
        self.model = None
