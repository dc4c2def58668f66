"""The ``ct2`` model format: a CTranslate2 conversion of Whisper (what faster-whisper loads).

Registered with the model registry (``register_model_formats``), so ``localm pull`` finds
such folders in a path or a pypi: package and registers them as speech-to-text models.
Standard library only: the CLI imports this for ``localm pull`` without faster-whisper.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from localm import sdk

#: The vocabulary file of a CTranslate2 Whisper conversion, and the config keys only Whisper's has.
VOCABULARIES = ("vocabulary.txt", "vocabulary.json")
WHISPER_KEYS = ("lang_ids", "suppress_ids", "alignment_heads")
#: Whisper's vocabulary size for English-only checkpoints; multilingual ones have more tokens.
WHISPER_ENGLISH_VOCAB = 51864


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_ct2_whisper(path: Path) -> bool:
    """A CTranslate2 Whisper folder: model.bin, config.json with Whisper's keys, and a vocabulary."""
    if not ((path / "model.bin").is_file() and any((path / v).is_file() for v in VOCABULARIES)):
        return False
    config = _json(path / "config.json")
    return isinstance(config, dict) and any(k in config for k in WHISPER_KEYS)


def inspect_ct2(folder: Path) -> tuple[dict[str, Any], str]:
    """(capabilities, role) of a CTranslate2 Whisper folder: a speech-to-text model."""
    vocab = 0
    if (folder / "vocabulary.txt").is_file():
        with open(folder / "vocabulary.txt", "rb") as fh:
            vocab = sum(1 for _ in fh)
    elif isinstance(words := _json(folder / "vocabulary.json"), list):
        vocab = len(words)
    return {"architecture": "whisper", "format": "ctranslate2", "audio_input": True,
            "multilingual": vocab > WHISPER_ENGLISH_VOCAB, "vocabulary": vocab}, "stt"


CT2 = sdk.ModelFormat("ct2", detect=is_ct2_whisper, inspect=inspect_ct2, folder=True,
                      describe="a CTranslate2 Whisper folder (model.bin, config.json, vocabulary)")
