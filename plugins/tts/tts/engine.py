"""The piper engine: a Piper voice (``piper`` in the registry, an ``.onnx`` file with its
``.onnx.json``) loaded by the model manager like any other model, speaking on a thread of
its own.

Requests take turns in the engine's queue (``sdk.engines.Serial``), off the event loop.
Text is spoken sentence by sentence (Piper's own sentence split, through espeak-ng's
phonemes), and each sentence's samples are handed on as soon as they exist; a request
cancelled while it waits leaves the queue, one cancelled while it speaks stops after the
sentence in progress.

Piper's noise is drawn inside the ONNX session, from generators seeded when the session
is made. A request with a ``seed`` is therefore spoken by a fresh session made after
``onnxruntime.set_seed(seed)`` (about a second more), and repeats exactly; one without
uses the resident session.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any, Callable

import attrs
import numpy as np
from localm import sdk
from localm.sdk import engines as spec


@attrs.frozen
class Speech:
    """One request: the text and how to say it (already checked by the route)."""

    text: str
    speaker: int | None = None
    voice_file: str | None = None  # a Piper voice from the voices folder, instead of the model's own
    speed: float = 1.0
    seed: int | None = None


class Cancelled(Exception):
    """The client left (or the job was cancelled); speaking stopped."""


def _piper() -> Any:
    try:
        import piper
    except ImportError as exc:
        raise spec.EngineError("Speech needs piper-tts: pip install 'localm[tts]' (or localm plugin install-deps "
                               "tts)", code="engine_missing") from exc
    return piper


def load_voice(path: str) -> Any:
    piper = _piper()
    config = path + ".json"
    if not (Path(path).is_file() and Path(config).is_file()):
        raise spec.EngineError(f"The voice's files are missing ({Path(path).name} and its .json)",
                               code="model_files_missing")
    try:
        return piper.PiperVoice.load(path, config_path=config)
    except Exception as exc:  # onnxruntime's and the config's own errors
        raise spec.EngineError(f"Piper could not load the voice: {str(exc).splitlines()[0][:200]}") from exc


def seeded(voice: Any, path: str, seed: int) -> Any:
    """The voice with a fresh ONNX session whose noise generators start from ``seed``."""
    import onnxruntime

    piper = _piper()
    onnxruntime.set_seed(seed)
    session = onnxruntime.InferenceSession(path, sess_options=onnxruntime.SessionOptions(),
                                           providers=["CPUExecutionProvider"])
    return piper.PiperVoice(session=session, config=voice.config)


class PiperEngine:
    """A loaded Piper voice (an sdk.engines.TextToSpeechEngine): it speaks, and does nothing else."""

    engine = "piper"

    def __init__(self, entry: Any, settings: dict[str, Any]) -> None:
        self.id = entry.id
        self.path = entry.path
        self.voice = load_voice(entry.path)
        self.sample_rate = int(self.voice.config.sample_rate)
        self.capabilities = spec.Capabilities(context_window=0)
        self.sentence_silence = float(settings.get("sentence_silence", 0.0))
        self.queue_limit = int(settings.get("queue_limit", 16))
        self._extra: tuple[str, Any] | None = None  # the last voice used from the voices folder
        self._serial = spec.Serial(f"localm-piper-{entry.id}")

    @property
    def busy(self) -> int:
        return self._serial.busy

    def rate_of(self, voice_file: str | None) -> int:
        if voice_file is None:
            return self.sample_rate
        import json
        return int(json.loads(Path(voice_file + ".json").read_text())["audio"]["sample_rate"])

    def _voice(self, speech: Speech) -> tuple[Any, str]:
        if speech.voice_file is None:
            return self.voice, self.path
        if self._extra is None or self._extra[0] != speech.voice_file:
            self._extra = (speech.voice_file, load_voice(speech.voice_file))
        return self._extra[1], speech.voice_file

    def speak_sync(self, speech: Speech, emit: Callable[[int, int, np.ndarray], None],
                   cancelled: threading.Event | None = None) -> int:
        """Speak on the calling thread: ``emit(index, total, samples)`` for each sentence
        (float32 mono at the voice's rate). Returns the number of sentences."""
        piper = _piper()
        voice, path = self._voice(speech)
        if speech.seed is not None:
            voice = seeded(voice, path, speech.seed)
        total = sum(1 for p in voice.phonemize(speech.text) if p)
        config = piper.SynthesisConfig(speaker_id=speech.speaker,
                                       length_scale=float(voice.config.length_scale) / speech.speed)
        silence = np.zeros(int(self.rate_of(speech.voice_file) * self.sentence_silence), dtype=np.float32)
        done = 0
        for chunk in voice.synthesize(speech.text, config):
            if cancelled is not None and cancelled.is_set():
                raise Cancelled()
            samples = chunk.audio_float_array
            if done and silence.size:
                samples = np.concatenate([silence, samples])
            emit(done, total, samples)
            done += 1
        return done

    async def speak(self, speech: Speech, emit: Callable[[int, int, np.ndarray], None]) -> int:
        """Speak in this engine's queue; ``emit`` is called on the event loop for each sentence.
        Cancelling the awaiting task takes a waiting request out of the queue, and stops a
        speaking one after its current sentence."""
        if self._serial.busy >= self.queue_limit:
            raise sdk.LocalmError(503, f"{self.busy} speech requests are running or waiting; retry in a moment",
                                  code="speech_busy")
        loop = asyncio.get_running_loop()
        cancelled = threading.Event()

        def on_loop(index: int, total: int, samples: np.ndarray) -> None:
            loop.call_soon_threadsafe(emit, index, total, samples)

        def work() -> int:
            if cancelled.is_set():
                raise Cancelled()
            return self.speak_sync(speech, on_loop, cancelled)

        try:
            return await self._serial.call(work)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def close(self) -> None:
        self._serial.close()
        self.voice = None
        self._extra = None
