"""What /api/tags, /api/ps and /api/show say about a registered model.

GGUF headers and Hugging Face config files are read once per file version (cached), so
listing models stays cheap. Paths never leave the server: only file names are shown.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import struct
import time
from pathlib import Path
from typing import Any

from localm.sdk import engines as spec
from localm.sdk import gguf

#: Ollama's "forever": what its /api/ps shows for a model kept loaded (time.Duration's maximum).
FOREVER_NS = 2**63 - 1

# --- time -----------------------------------------------------------------------------


def rfc3339(ns: int | None = None) -> str:
    """UTC, RFC 3339 with nanoseconds (trailing zeros cut), as Ollama writes times."""
    ns = time.time_ns() if ns is None else ns
    seconds, frac = divmod(ns, 1_000_000_000)
    text = dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return text + (f".{frac:09d}".rstrip("0") if frac else "") + "Z"


def from_epoch(seconds: float) -> str:
    return rfc3339(int(seconds * 1_000_000_000))


# --- GGUF headers ----------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _gguf(path: str, _version: tuple[int, int]) -> tuple[dict[str, Any], int]:
    """(metadata with long arrays as null, as Ollama shows them; parameter count from the
    tensor shapes)."""
    meta, parameters = gguf.header(Path(path), parameters=True)
    return {k: None if isinstance(v, dict) and "array_of" in v else v for k, v in meta.items()}, parameters or 0


# --- Hugging Face folders -----------------------------------------------------------------

def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _safetensors_parameters(path: Path) -> int:
    try:
        with open(path, "rb") as fh:
            size = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(size))
    except (OSError, ValueError, struct.error, gguf.GGUFError):
        return 0
    total = 0
    for name, tensor in header.items():
        if name != "__metadata__" and isinstance(tensor, dict):
            n = 1
            for d in tensor.get("shape", []):
                n *= d
            total += n
    return total


@functools.lru_cache(maxsize=64)
def _hf(folder: str, _version: tuple[int, int]) -> tuple[dict[str, Any], int, str | None]:
    """(config.json, parameter count, chat template)."""
    root = Path(folder)
    config = _json(root / "config.json")
    index = _json(root / "model.safetensors.index.json").get("weight_map")
    files = sorted(set(index.values())) if isinstance(index, dict) else ["model.safetensors"]
    parameters = sum(_safetensors_parameters(root / f) for f in files)
    template = _json(root / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) and (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text()
    return config, parameters, template if isinstance(template, str) else None


def _version(path: str) -> tuple[int, int]:
    try:
        stat = Path(path).stat()
    except OSError:
        return (0, 0)
    return (stat.st_mtime_ns, stat.st_size)


class Facts:
    """What can be read cheaply from a model's files."""

    def __init__(self, entry: Any) -> None:
        self.entry = entry
        self.meta: dict[str, Any] = {}
        self.config: dict[str, Any] = {}
        self.parameters = 0
        self.template: str | None = None
        try:
            if not entry.path:  # a model a plugin provides (an Open WebUI Pipe): no files to read
                pass
            elif entry.type == "gguf":
                self.meta, self.parameters = _gguf(entry.path, _version(entry.path))
                template = self.meta.get("tokenizer.chat_template")
                self.template = template if isinstance(template, str) else None
            else:
                self.config, self.parameters, self.template = _hf(entry.path, _version(entry.path))
        except (OSError, ValueError, struct.error, gguf.GGUFError):
            pass  # a file that moved or cannot be read: the registry's own facts still stand

    @property
    def family(self) -> str:
        if self.entry.type == "gguf":
            return str(self.meta.get("general.architecture") or self.entry.capabilities.get("architecture") or "")
        return str(self.config.get("model_type") or self.entry.capabilities.get("architecture") or "")

    @property
    def quantization(self) -> str:
        caps = self.entry.capabilities
        if self.entry.type == "gguf":
            return str(caps.get("quantization") or gguf.FILE_TYPES.get(self.meta.get("general.file_type", -1), ""))
        dtype = str(caps.get("dtype") or self.config.get("torch_dtype") or "")
        return {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}.get(dtype, dtype.upper())

    def details(self) -> dict[str, Any]:
        family = self.family
        fmt = {"gguf": "gguf", "hf": "safetensors"}.get(self.entry.type, self.entry.type)
        return {"parent_model": "", "format": fmt,
                "family": family, "families": [family] if family else None,
                "parameter_size": human_number(self.parameters) if self.parameters else "",
                "quantization_level": self.quantization}

    def model_info(self) -> dict[str, Any]:
        """GGUF metadata (long arrays as null, the chat template left to ``template``); for a
        Hugging Face folder, the same keys read from config.json."""
        if self.entry.type == "gguf":
            info = {k: v for k, v in self.meta.items() if k != "tokenizer.chat_template"}
            info["general.parameter_count"] = self.parameters
            return dict(sorted(info.items()))
        family, c = self.family, self.config
        info: dict[str, Any] = {"general.architecture": family, "general.parameter_count": self.parameters}
        for key, name in (("max_position_embeddings", "context_length"), ("hidden_size", "embedding_length"),
                          ("num_hidden_layers", "block_count"), ("intermediate_size", "feed_forward_length"),
                          ("num_attention_heads", "attention.head_count"),
                          ("num_key_value_heads", "attention.head_count_kv"), ("vocab_size", "vocab_size")):
            if isinstance(c.get(key), int):
                info[f"{family}.{name}"] = c[key]
        return info


def human_number(n: int) -> str:
    """Ollama's parameter_size: 8.0B, 134.52M, 22M."""
    for size, unit, digits in ((1_000_000_000, "B", 1), (1_000_000, "M", 2), (1_000, "K", 0)):
        if n >= size:
            value = n / size
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.{digits}f}{unit}"
    return str(n)


# --- the answers --------------------------------------------------------------------

def tag(entry: Any) -> dict[str, Any]:
    """One model in /api/tags."""
    return {"name": entry.id, "model": entry.id, "modified_at": from_epoch(entry.created),
            "size": entry.size_bytes, "digest": entry.sha256 or "", "details": Facts(entry).details()}


def process(resident: Any, expires: float | None = None) -> dict[str, Any]:
    """One loaded model in /api/ps: ``expires`` (epoch seconds) is when a keep_alive unloads it,
    as Ollama computes it (the last request's end plus its keep_alive); without one localm keeps
    a model loaded until it is unloaded (Ollama's "forever"). ``context_length`` is the window
    it serves with now (a num_ctx request sets it; it grows as prompts need). ``size_vram`` is the
    GPU memory its load took, as its engine measured it (0 on the CPU). ``parallel_slots`` (localm's own field) is how many requests
    the model answers at once, when more than one."""
    entry = resident.entry
    at = int(expires * 1e9) if expires is not None else int(resident.loaded_at * 1e9) + FOREVER_NS
    placed = spec.placement_of(resident.engine)
    vram = placed.vram_bytes if placed is not None and placed.vram_bytes is not None else 0
    out = {**tag(entry), "expires_at": rfc3339(at), "size_vram": vram,
           "context_length": resident.engine.capabilities.context_window}
    slots = int(getattr(resident.engine, "slots", 1) or 1)
    if slots > 1:
        out["parallel_slots"] = slots
    return out


def chats(entry: Any) -> bool:
    """Whether /api/tags lists the model. Open WebUI offers every model of /api/tags in its
    chat picker (it reads neither capabilities nor details to choose), so a model that does
    not chat (an embedding model, a reranker, a speech model) is left out; /api/show and
    /api/embed still answer it by name, and /v1/models lists it with its role."""
    return entry.role == "chat"


def capabilities(entry: Any) -> list[str]:
    """Ollama's capability names. Every chat model takes tools here: localm describes them
    in the prompt and reads the calls from the reply, whatever the template knows. A model
    that does not chat has only ``embedding`` (an embedding model) or none."""
    caps = entry.capabilities
    if entry.role == "embedding":
        return ["embedding"]
    if entry.role != "chat":
        return []
    out = ["completion", "tools"]
    if caps.get("reasoning"):
        out.append("thinking")
    if caps.get("vision"):
        out.append("vision")
    return out


def parameters_text(num_ctx: int | None = None) -> str:
    """The sampling the Ollama routes use when a request sets no option (Ollama's defaults), and
    the window the model serves with, as Modelfile PARAMETER lines."""
    from .translate import OLLAMA_DEFAULTS

    d = spec.Sampling()
    lines = [("num_ctx", num_ctx)] if num_ctx else []
    lines += [("temperature", d.temperature), ("top_k", d.top_k), ("top_p", OLLAMA_DEFAULTS["top_p"]),
              ("min_p", OLLAMA_DEFAULTS["min_p"]), ("repeat_penalty", OLLAMA_DEFAULTS["repeat_penalty"])]
    return "\n".join(f"{k:<15}{v:g}" for k, v in lines)


def shown_source(entry: Any) -> str:
    source = entry.source
    return "file:" + Path(source[5:]).name if source.startswith("file:") else source


def show(entry: Any, num_ctx: int | None = None) -> dict[str, Any]:
    """/api/show. Long GGUF arrays (token lists, merges) are null, verbose or not: localm
    never reads them. ``num_ctx``: the window the loaded model serves with."""
    from . import modelfile as mf

    facts = Facts(entry)
    file_name = Path(entry.path).name
    defaults = entry.defaults if isinstance(getattr(entry, "defaults", None), dict) else {}
    adapters = [str(a.get("name") or Path(str(a.get("path", ""))).name) for a in getattr(entry, "adapters", ())]
    if defaults or adapters:  # made by /api/create or an Ollama library pull: its Modelfile, as Ollama shows it
        note = (f"Modelfile generated by localm for {entry.id} (registered from {shown_source(entry)}).\n"
                "Weights and adapters are named by file; localm renders prompts with the model's own chat "
                "template (TEMPLATE is kept and shown).")
        text = mf.render(file_name, defaults, adapters, note)
    else:
        text = (f"# localm does not use Modelfiles: {entry.id} is registered from {shown_source(entry)}.\n"
                f"# Change it with `localm pull`, `localm rename` and `localm rm`.\nFROM {file_name}\n")
    options = defaults.get("options") if isinstance(defaults.get("options"), dict) else None
    params = "\n".join(mf.parameter_lines(options)) if options else parameters_text(num_ctx)
    details = facts.details()
    out: dict[str, Any] = {"modelfile": text, "parameters": params,
                           "template": defaults.get("template") or facts.template or "",
                           "details": details, "model_info": facts.model_info(),
                           "capabilities": capabilities(entry), "modified_at": from_epoch(entry.created)}
    if defaults.get("system"):
        out["system"] = defaults["system"]
    if defaults.get("messages"):
        out["messages"] = defaults["messages"]
    license_ = defaults.get("license") or facts.meta.get("general.license")
    if isinstance(license_, list):
        license_ = "\n".join(license_)
    if isinstance(license_, str) and license_:
        out["license"] = license_
    return out
