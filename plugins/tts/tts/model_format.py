"""The ``piper`` model format: a Piper voice, an ``.onnx`` file beside its ``.onnx.json``.

Registered with the model registry (``register_model_formats``), so ``localm pull`` finds
voices in a path or a pypi: package and registers them as text-to-speech models. Standard
library only: the CLI imports this for ``localm pull`` without piper-tts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from localm import sdk


def _config(path: Path) -> Any:
    try:
        return json.loads(path.with_name(path.name + ".json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_piper_voice(path: Path) -> bool:
    """A Piper voice: an ``.onnx`` file beside its ``.onnx.json`` config (phonemes and sample rate)."""
    if path.suffix != ".onnx" or not path.is_file():
        return False
    config = _config(path)
    return isinstance(config, dict) and "phoneme_id_map" in config and isinstance(config.get("audio"), dict)


def inspect_piper(path: Path) -> tuple[dict[str, Any], str]:
    """(capabilities, role) of a Piper voice: a text-to-speech model."""
    config = _config(path) or {}
    audio = config.get("audio") or {}
    espeak = config.get("espeak") or {}
    language = config.get("language") or {}
    speakers = config.get("speaker_id_map") or {}
    return {"architecture": "vits", "format": "piper", "sample_rate": audio.get("sample_rate"),
            "quality": audio.get("quality"), "voice": espeak.get("voice"),
            "language": language.get("code") if isinstance(language, dict) else None,
            "speakers": sorted(speakers, key=lambda s: speakers[s]) if isinstance(speakers, dict) else [],
            "num_speakers": config.get("num_speakers", 1)}, "tts"


PIPER = sdk.ModelFormat("piper", detect=is_piper_voice, inspect=inspect_piper,
                        companions=lambda path: [path.with_name(path.name + ".json")],
                        describe="a Piper voice (.onnx beside its .onnx.json)")
