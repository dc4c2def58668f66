"""The transformers engine: Hugging Face model folders and GGUF files through PyTorch.

Chat and base models load with ``AutoModelForCausalLM`` (a GGUF file is de-quantised to
float32 by transformers on load); embedding models (a sentence-transformers folder, or
any folder without a causal-LM head) load with ``AutoModel`` and pool as the folder
declares; rerankers (a ``...ForSequenceClassification`` folder, a cross-encoder) load
with ``AutoModelForSequenceClassification`` and score each (query, document) pair with
their classifier head. Everything runs on the CPU in float32 and reads local files only.

Generation is a token-by-token loop over a KV cache in one worker thread, so a request
that is cancelled stops within a token, and the cache of the last request is reused
when the next prompt starts with the same tokens (a chat's earlier turns).

Interventions (steering) and activation reads are PyTorch forward hooks on the decoder
layer modules, registered on the worker thread when a request's decode begins and removed
when it ends: no hook is ever installed for a request without them, and embeddings and
scores (which run on the same thread, in turn) never meet one. The prompt cache is reused
only by a request with the same interventions as the one that filled it, and never by a
request with reads.

A vision-language folder (its config has a ``vision_config``) loads with its processor
(``AutoProcessor``) and its architecture's class (``AutoModelForImageTextToText`` when
transformers lacks the named one). Its ``media_marker`` is the token its chat template writes
for an image part; ``media_tokens`` runs the processor on that marker and the picture (once
per digest) and keeps the expansion (the image token repeated, with any tokens the
architecture puts around it) and the pixel inputs; ``generate`` puts each expansion at its
MediaSpan and passes the pixels on the prefill pass that holds the picture, so the model
computes what ``processor(text, images)`` then ``model(**inputs)`` would. The prompt cache
compares a picture by its digest, and steering hooks the text decoder's layers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hashlib
import inspect
import io
import json
import math
import os
import random
import re
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

import attrs

from localm import sdk
from localm.sdk import engines as spec

#: How many recent tokens the repetition penalties look at (llama.cpp's default).
PENALTY_LAST_N = 64
#: Tokens that end a turn in common chat templates, besides the model's declared EOS.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>", "<|endoftext|>",
               "<|end|>", "<|return|>", "</s>")
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_ABSOLUTE_PATH = re.compile(r"(?<![\w.])/(?:[^/\s'\"]+/)+([^/\s'\",:)]+)")
#: A reranker's window must hold the query, the special tokens and at least this many
#: tokens of each document, or the query is refused as too long.
RERANK_MIN_DOCUMENT_TOKENS = 8
#: Encoders whose positions start after the padding index (RoBERTa's offset): a window
#: of max_position_embeddings would run past their last position.
_OFFSET_POSITIONS = {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "longformer"}


@attrs.frozen
class Settings:
    n_ctx: int = sdk.setting(4096, min=256, description="Context window in tokens (at most the model's own)")
    n_threads: int = sdk.setting(0, min=0, description="CPU threads for PyTorch (0: one per core)")
    n_batch: int = sdk.setting(512, min=1, description="Prompt tokens processed per step")
    attention: str = sdk.setting("sdpa", choices=["sdpa", "eager"],
                                 description="Attention kernel (eager can be faster for short contexts)")
    device: str = sdk.setting("auto", choices=["auto", "cpu", "cuda", "mps"],
                              description="Where models run (auto: a CUDA GPU, else Apple's MPS, else the CPU)")
    dtype: str = sdk.setting("auto", choices=["auto", "float32", "bfloat16", "float16"],
                             description="The weights' precision (auto: bfloat16 on a GPU that has it, float16 "
                                         "on another accelerator, float32 on the CPU)")
    hf_embed_max_texts: int = sdk.setting(2048, min=1, description="The most texts one embeddings request may give "
                                                                   "a model of this engine (a 413 past it)")
    hf_embed_max_chars: int = sdk.setting(8_000_000, min=1, description="The most characters, all texts together, one "
                                                                        "embeddings request may give a model of this "
                                                                        "engine (a 413 past it)")


def _placement(torch: Any, device: str, dtype: str) -> tuple[Any, Any]:
    """(torch device, torch dtype) for the ``device`` and ``dtype`` settings; an accelerator
    that is asked for and absent is an error, not a silent CPU load."""
    cuda = torch.cuda.is_available()
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    if device == "auto":
        device = "cuda" if cuda else "mps" if mps else "cpu"
    elif (device == "cuda" and not cuda) or (device == "mps" and not mps):
        raise spec.EngineError(f"The device setting is {device}, and PyTorch finds no {device.upper()} device here "
                               f"(torch {torch.__version__}): set it to auto or cpu", code="no_device")
    if dtype == "auto":
        if device == "cuda":
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        else:
            dtype = "float16" if device == "mps" else "float32"
    return torch.device(device), getattr(torch, dtype)


def _threads(n: int) -> int:
    return n if n > 0 else spec.usable_cores()


def _redact(text: str, *places: str) -> str:
    """An error message with the model's folder and every other absolute path cut to a base name."""
    for place in sorted((p for p in places if p), key=len, reverse=True):
        text = text.replace(place.rstrip("/") + "/", "").replace(place, os.path.basename(place.rstrip("/")))
    return _ABSOLUTE_PATH.sub(r"\1", text)


def _first_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line of at most ``limit`` characters."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[:limit - 1].rstrip() + "…"
    return text or exc.__class__.__name__


_LOADING = threading.Lock()


@contextlib.contextmanager
def _quick_gguf_load():
    """Parse a GGUF file once per load, not once for the config, the weights and the tokenizer.

    transformers opens a fresh ``gguf.GGUFReader`` (seconds for a 49k-token vocabulary) at
    each step and rebuilds gguf's tensor-name map for every module; both are pure, so they
    are memoised for the duration of one load, and its progress bar is silenced.
    """
    with _LOADING:
        try:
            import gguf
            from transformers import modeling_gguf_pytorch_utils as hf_gguf
        except ImportError:
            yield
            return
        saved = {name: getattr(gguf, name, None) for name in ("GGUFReader", "get_tensor_name_map")}
        saved_tqdm = getattr(hf_gguf, "tqdm", None)
        readers: dict[Any, Any] = {}

        def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
            key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
            if key not in readers:
                readers[key] = saved["GGUFReader"](path, *args, **kwargs)
            return readers[key]

        try:
            if saved["GGUFReader"] is not None:
                gguf.GGUFReader = reader
            if saved["get_tensor_name_map"] is not None:
                gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved["get_tensor_name_map"])
            if saved_tqdm is not None:
                hf_gguf.tqdm = functools.partial(saved_tqdm, disable=True)
            yield
        finally:
            for name, value in saved.items():
                if value is not None:
                    setattr(gguf, name, value)
            if saved_tqdm is not None:
                hf_gguf.tqdm = saved_tqdm
            readers.clear()


def _byte_decoder(tokenizer: Any) -> dict[str, int]:
    """GPT-2's byte-to-character map, inverted, when the tokenizer is byte-level BPE ({} otherwise)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or "ByteLevel" not in type(decoder).__name__ + repr(decoder)[:200]:
        return {}
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


#: Where causal-LM architectures keep their decoder layers (Llama-like first).
_LAYER_PATHS = ("model.layers", "model.decoder.layers", "model.language_model.layers", "transformer.h",
                "transformer.layers", "transformer.blocks", "gpt_neox.layers", "model.transformer.h", "layers")


def _decoder_layers(model: Any) -> Any:
    """The model's decoder layers (a ``torch.nn.ModuleList``), in order; None when not found."""
    import torch
    candidates = []
    decoder = getattr(model, "get_decoder", None)
    try:
        base = decoder() if callable(decoder) else None
    except Exception:  # noqa: BLE001 - a model without one
        base = None
    if base is not None:
        candidates.append(getattr(base, "layers", None))
    for path in _LAYER_PATHS:
        node = model
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        candidates.append(node)
    for found in candidates:
        if isinstance(found, torch.nn.ModuleList) and len(found) > 0:
            return found
    return None


class _Steering:
    """One request's interventions and reads, checked and ready for the hooks.

    ``deltas``: layer → float32 torch vector (the sum of that layer's interventions);
    ``reads``: layer → points; ``key`` identifies the interventions (what the prompt cache
    was computed with); ``rows``: (layer, point) → the captured arrays, one per forward pass.
    """

    def __init__(self, request: spec.GenerateRequest, layers: int | None, hidden: int | None) -> None:
        import torch
        sums, self.reads = spec.steering_of(request, layers, hidden)
        self.key = tuple((layer, sums[layer].tobytes()) for layer in sorted(sums))
        self.deltas: dict[int, Any] = {layer: torch.from_numpy(vector) for layer, vector in sums.items()}
        self.rows: dict[tuple[int, str], list[Any]] = {
            (layer, point): [] for layer, points in self.reads.items() for point in points}

    def __bool__(self) -> bool:
        return bool(self.deltas or self.reads)

    def hook(self, layer: int, dtype: Any, device: Any) -> Callable[..., Any]:
        delta = self.deltas.get(layer)
        if delta is not None:
            delta = delta.to(device=device, dtype=dtype)
        points = self.reads.get(layer, set())
        pre = self.rows[(layer, "pre")] if "pre" in points else None
        post = self.rows[(layer, "post")] if "post" in points else None

        def run(module: Any, args: Any, output: Any) -> Any:
            hidden = output[0] if isinstance(output, tuple) else output
            if pre is not None:
                pre.append(hidden[0].detach().float().cpu().numpy().copy())
            if delta is not None:
                hidden = hidden + delta
            if post is not None:
                post.append(hidden[0].detach().float().cpu().numpy().copy())
            if delta is None:
                return None  # the output as it was
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        return run

    @contextlib.contextmanager
    def installed(self, modules: Any, dtype: Any, device: Any):
        handles = []
        try:
            for layer in sorted(set(self.deltas) | set(self.reads)):
                handles.append(modules[layer].register_forward_hook(self.hook(layer, dtype, device)))
            yield
        finally:
            for handle in handles:
                handle.remove()

    def activations(self, hidden: int) -> dict[tuple[int, str], Any] | None:
        import numpy as np
        if not self.rows:
            return None
        return {key: (np.concatenate(parts, axis=0).astype(np.float32, copy=False) if parts
                      else np.zeros((0, hidden), dtype=np.float32))
                for key, parts in self.rows.items()}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _vision_class(transformers: Any, folder: str) -> Any:
    """The class that loads a vision-language folder: its declared architecture when transformers
    has it (the exact head the weights were saved from), else AutoModelForImageTextToText."""
    archs = (_read_json(Path(folder) / "config.json") or {}).get("architectures") or []
    for name in archs:
        found = getattr(transformers, name, None) if isinstance(name, str) else None
        if found is not None and hasattr(found, "from_pretrained"):
            return found
    return transformers.AutoModelForImageTextToText


#: How many encoded pictures an engine keeps (by digest) for the generations that follow.
MEDIA_KEPT = 16
#: Keys of a processor's output that run along the token sequence, not along the pictures.
_TEXT_KEYS = ("input_ids", "attention_mask")


def _picture(data: bytes) -> Any:
    """An encoded image file as an RGB PIL image, read whole (a truncated file fails here, not in
    the model); anything PIL cannot read is ``invalid_media``."""
    from PIL import Image
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return image.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - PIL raises many kinds for a bad file
        raise spec.EngineError(f"The image could not be decoded: {_first_line(exc, 200)}",
                               code="invalid_media") from exc


@attrs.frozen(eq=False)
class _Encoded:
    """One picture as the processor prepares it: ``ids``, the tokens its marker expands to (the
    image token repeated, and for some architectures text tokens around or between tiles);
    ``aligned``, inputs that run along those tokens (token type ids: 1-D, ``len(ids)`` long);
    ``inputs``, the rest (pixel values, image sizes, pixel masks), batched along dim 0."""

    digest: str
    ids: tuple[int, ...]
    aligned: dict[str, Any]
    inputs: dict[str, Any]
    picture: Any


class _MediaCache:
    """Encoded pictures by digest, the most recent MEDIA_KEPT: ``media_tokens`` fills it on the
    event loop's side, ``generate`` reads it on the worker thread (and encodes a picture it lacks)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[str, _Encoded] = {}

    def get(self, digest: str) -> _Encoded | None:
        with self._lock:
            found = self._kept.pop(digest, None)
            if found is not None:
                self._kept[digest] = found  # most recently used last
            return found

    def put(self, digest: str, encoded: _Encoded) -> None:
        with self._lock:
            self._kept.pop(digest, None)
            self._kept[digest] = encoded
            while len(self._kept) > MEDIA_KEPT:
                self._kept.pop(next(iter(self._kept)))

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()


@attrs.frozen(eq=False)
class _Placed:
    """A picture in a generation's full sequence: positions ``start`` .. ``end`` (exclusive)."""

    start: int
    end: int
    encoded: _Encoded


class TransformersEngine:
    engine = "transformers"

    def __init__(self, path: str, kind: str, role: str, settings: dict[str, Any],
                 live: Callable[[], Any] | None = None) -> None:
        #: the plugin's settings now (the limits a request is checked against); None: ``settings``
        self._live = live
        self._path = path
        name = os.path.basename(path.rstrip("/"))
        self._name = name
        try:
            import torch
            import transformers
        except ImportError as exc:
            raise spec.EngineError(f"transformers cannot be imported: {_first_line(exc)}") from exc
        self._torch = torch
        self._settings = settings
        self._device, self._dtype = _placement(torch, settings.get("device", "auto"), settings.get("dtype", "auto"))
        self._threads = _threads(settings["n_threads"])
        torch.set_num_threads(self._threads)
        transformers.utils.logging.disable_progress_bar()
        if kind == "gguf":
            folder, kwargs = os.path.dirname(path), {"gguf_file": name}
        else:
            folder, kwargs = path, {}
        kwargs["local_files_only"] = True  # never the network: the registry holds local files only
        self.role = role
        self.embedding = role == "embedding"
        self.reranker = role == "reranker"
        if self.reranker:
            self._check_classifier(kind, folder)
        # a vision-language folder (its config has a vision tower) loads with its processor
        self._vision = role == "chat" and kind != "gguf" and "vision_config" in (
            _read_json(Path(folder) / "config.json") or {})
        self._processor: Any = None
        missing: list[str] = []
        try:
            with _quick_gguf_load() if kind == "gguf" else contextlib.nullcontext():
                if self._vision:
                    self._processor = transformers.AutoProcessor.from_pretrained(folder, **kwargs)
                self.tokenizer = getattr(self._processor, "tokenizer", None) \
                    or transformers.AutoTokenizer.from_pretrained(folder, **kwargs)
                self.model = self._load_model(transformers, folder, kwargs, settings["attention"], missing)
        except Exception as exc:
            raise spec.EngineError(f"transformers could not load {name}: "
                                   f"{_redact(_first_line(exc), path, folder)}") from exc
        if missing:  # transformers would score with a freshly initialised, random head
            raise spec.EngineError(f"{name} has no classifier head: its weights lack {', '.join(missing[:4])}",
                                   code="no_classifier_head")
        self.model.eval()
        self.placement = self._placed()
        config = self.model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        native = next((getattr(c, name, None) for c in (text_config, config)  # a VLM's window is its text model's
                       for name in ("max_position_embeddings", "n_positions", "max_sequence_length")
                       if getattr(c, name, None)), None)
        template = getattr(self.tokenizer, "chat_template", None) or getattr(self._processor, "chat_template", None)
        if isinstance(template, dict):  # several named templates: the default one renders chats
            template = template.get("default") or next(iter(template.values()), None)
        self.template = template if isinstance(template, str) and template else None
        if self.embedding:
            self._pooling = self._read_pooling(Path(folder))
            limit = (_read_json(Path(folder) / "sentence_bert_config.json") or {}).get("max_seq_length")
            window = min(x for x in (limit, native, getattr(self.tokenizer, "model_max_length", None), 512)
                         if isinstance(x, int) and x > 0)
        elif self.reranker:  # the encoder's positions and the tokenizer's declared limit bound the pair
            limit = getattr(self.tokenizer, "model_max_length", None)
            if isinstance(native, int) and getattr(config, "model_type", None) in _OFFSET_POSITIONS:
                native -= (getattr(config, "pad_token_id", None) or 1) + 1
            window = min(x for x in (settings["n_ctx"], native, limit) if isinstance(x, int) and x > 0)
        else:
            window = min(settings["n_ctx"], native) if isinstance(native, int) and native > 0 else settings["n_ctx"]
        causal = role == "chat"
        self._layers = _decoder_layers(self.model) if causal else None
        hidden = getattr(text_config, "hidden_size", None)
        self._hidden = hidden if isinstance(hidden, int) else None
        count = len(self._layers) if self._layers is not None else getattr(text_config, "num_hidden_layers", None)
        self._media = _MediaCache()
        marker = self._image_marker() if self._vision else None
        if marker is not None:
            self.media_marker = marker  # only a model that sees is a MediaEngine
        self.capabilities = spec.Capabilities(
            vision=marker is not None,
            interventions=self._layers is not None and self._hidden is not None,
            hidden_size=self._hidden, layers=count if isinstance(count, int) else None,
            context_window=window, chat_template=bool(self.template), embeddings=not self.reranker,
            rerank=self.reranker, dtype=str(self._dtype).removeprefix("torch."),
            reasoning=bool(self.template and "<think>" in self.template),
            tool_use=bool(self.template and "tools" in self.template), logprobs=causal,
            grammar=causal and spec.Constrainer.available()
            and isinstance(self.tokenizer, transformers.PreTrainedTokenizerFast))
        self._n_ctx = window
        self._n_batch = settings["n_batch"]
        self._eog = self._end_tokens()
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._keep_kwarg = "logits_to_keep" if "logits_to_keep" in params else (
            "num_logits_to_keep" if "num_logits_to_keep" in params else None)
        self._cache: Any = None  # the KV cache of the last request and the tokens it holds
        self._cached: list[Any] = []  # token ids; (digest, i) at a picture's positions
        self._cache_key: tuple = ()  # the interventions the cache was computed with
        self._prompt_logits: tuple[tuple, Any] | None = None  # the last prompt's keys and the logits after it
        self._serial = spec.Serial("transformers", initializer=torch.set_num_threads, initargs=(self._threads,))
        # a fast tokenizer is not safe to use from two threads at once (its truncation settings
        # are mutable state): the event loop and the worker take turns
        self._tokenizing = threading.Lock()
        self._byte_decoder: dict[str, int] | None = None
        self._constrainer = spec.Constrainer(self._grammar_tokenizer, self.token_bytes)

    def _logits_width(self) -> int:
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        weight = getattr(head, "weight", None)
        if weight is not None and weight.dim() == 2:
            return int(weight.shape[0])
        return int(getattr(self.model.config, "vocab_size", None) or len(self.tokenizer))

    def _grammar_tokenizer(self) -> Any:
        """The llguidance tokenizer of this vocabulary, as wide as the model's logits; its end tokens
        are the model's end-of-generation ones."""
        import transformers
        if self.role != "chat" or not isinstance(self.tokenizer, transformers.PreTrainedTokenizerFast):
            raise sdk.LocalmError(400, "Constrained output needs a chat model with a fast tokenizer",
                                  code="grammar_unavailable")
        from llguidance.hf import from_tokenizer
        ends = sorted(self._eog) or None
        with self._tokenizing:
            return from_tokenizer(self.tokenizer, n_vocab=max(self._logits_width(), len(self.tokenizer)),
                                  eos_token=ends)

    def _load_model(self, transformers: Any, folder: str, kwargs: dict[str, Any], attention: str,
                    missing: list[str]) -> Any:
        """The model; for a reranker, ``missing`` gets the classifier-head weights the files lack."""
        if self.reranker:
            load = transformers.AutoModelForSequenceClassification
        elif self._vision:
            load = _vision_class(transformers, folder)
        else:
            load = transformers.AutoModel if self.embedding else transformers.AutoModelForCausalLM
        dtype = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        options: dict[str, Any] = {**kwargs, dtype: self._dtype, "attn_implementation": attention}
        if self.reranker:
            options["output_loading_info"] = True
        try:
            loaded = load.from_pretrained(folder, **options)
        except (ValueError, ImportError) as exc:
            if "attention" not in str(exc).lower() and "attn" not in str(exc).lower():
                raise
            del options["attn_implementation"]  # an architecture without that attention kernel
            loaded = load.from_pretrained(folder, **options)
        if self._device.type != "cpu":
            (loaded[0] if self.reranker else loaded).to(self._device)
        if not self.reranker:
            return loaded
        model, info = loaded
        prefix = getattr(model, "base_model_prefix", "") + "."
        missing.extend(sorted(k for k in info.get("missing_keys", ()) if not k.startswith(prefix)))
        return model

    def _check_classifier(self, kind: str, folder: str) -> None:
        """A reranker is a sequence-classification model: refuse any other before loading it."""
        if kind == "gguf":
            raise spec.EngineError(f"transformers cannot run the GGUF reranker {self._name}: "
                                   "enable the llamacpp plugin")
        archs = (_read_json(Path(folder) / "config.json") or {}).get("architectures") or []
        if not any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in archs):
            named = ", ".join(str(a) for a in archs) or "none"
            raise spec.EngineError(f"{self._name} has no classifier head (its architectures: {named}); a reranker "
                                   "is a ...ForSequenceClassification model", code="no_classifier_head")

    @staticmethod
    def _read_pooling(folder: Path) -> str:
        """The pooling a sentence-transformers folder declares ("mean" when it declares none)."""
        modules = _read_json(folder / "modules.json") or []
        for module in modules if isinstance(modules, list) else []:
            if isinstance(module, dict) and str(module.get("type", "")).endswith("Pooling"):
                config = _read_json(folder / module.get("path", "") / "config.json") or {}
                for key, mode in (("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "last"),
                                  ("pooling_mode_max_tokens", "max"), ("pooling_mode_mean_sqrt_len_tokens", "sqrt"),
                                  ("pooling_mode_mean_tokens", "mean")):
                    if config.get(key):
                        return mode
        return "mean"

    def _end_tokens(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.config, "eos_token_id", None),
                       getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(i for i in source if isinstance(i, int))
        specials = set(getattr(self.tokenizer, "all_special_tokens", []) or [])
        for text in END_OF_TURN:
            if text in specials:
                token = self.tokenizer.convert_tokens_to_ids(text)
                if isinstance(token, int) and token != self.tokenizer.unk_token_id:
                    ids.add(token)
        return ids

    # --- text ------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        kwargs: dict[str, Any] = {} if parse_special else {"split_special_tokens": True}
        bos = self.tokenizer.bos_token
        if add_special and parse_special and bos and text.startswith(bos):
            add_special = False  # a chat template that writes the BOS itself: never two
        with self._tokenizing:
            return list(self.tokenizer(text, add_special_tokens=add_special, **kwargs)["input_ids"])

    def detokenize(self, ids: Sequence[int]) -> str:
        with self._tokenizing:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def token_bytes(self, token: int) -> bytes:
        """The token's bytes: an added (special) token's text; a byte-level BPE piece through the
        GPT-2 byte map; a byte-fallback piece (``<0x0A>``) as its byte; a SentencePiece piece with
        its ``▁`` as a space."""
        with self._tokenizing:
            added = getattr(self.tokenizer, "added_tokens_decoder", {}).get(token)
            if added is not None:
                return str(added).encode("utf-8")
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if self._byte_decoder is None:
                self._byte_decoder = _byte_decoder(self.tokenizer)
        if not isinstance(piece, str):
            return b""
        if self._byte_decoder:
            try:
                return bytes(self._byte_decoder[c] for c in piece)
            except KeyError:
                pass
        fallback = _BYTE_PIECE.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    template_kwargs: dict | None = None) -> str:
        if self.template is None:
            raise sdk.LocalmError(400, "This model has no chat template: use /v1/completions",
                                  code="no_chat_template")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self.template,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **(template_kwargs or {}))
        except Exception as exc:  # the template itself refused these messages (jinja raise_exception)
            raise sdk.LocalmError(400, f"The chat template could not render these messages: {_first_line(exc)}",
                                  code="chat_template_error") from exc

    # --- pictures ------------------------------------------------------------------------
    def _image_marker(self) -> str | None:
        """The text the chat template writes for one image part and the processor expands: the
        processor's begin-of-image token where it has one (Gemma 3's template writes that), else
        its image token. None when the template writes neither exactly once for an image part:
        the model then serves text only (``capabilities.vision`` False)."""
        probe = [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "image"},
                                              {"type": "text", "text": "B"}]}]
        try:
            rendered = self.render_chat(probe)
        except sdk.LocalmError:
            return None
        for candidate in (getattr(self._processor, "boi_token", None), getattr(self._processor, "image_token", None)):
            if isinstance(candidate, str) and candidate and rendered.count(candidate) == 1:
                return candidate
        return None

    def _blind(self) -> str:
        """Why this model takes no media."""
        if self._vision:
            return f"{self._name} has a vision tower, but its chat template writes no image token: it serves text only"
        return f"{self._name} does not see images or hear sound"

    @property
    def media_device(self) -> str:
        """Where pictures and sound are encoded: ``gpu`` or ``cpu`` (the model's device)."""
        return "cpu" if self._device.type == "cpu" else "gpu"

    async def media_tokens(self, media: spec.Media) -> int:
        """How many positions ``media`` takes: the length of the processor's expansion of one
        marker with this picture. The picture is decoded and preprocessed here, off the event
        loop, and kept by digest for the generation that follows."""
        encoded = await asyncio.to_thread(self._encoded, media)
        return len(encoded.ids)

    def _encoded(self, media: spec.Media) -> _Encoded:
        """``media`` encoded (from the kept ones when its digest is there); EngineError
        ``invalid_media`` for a sound, a file that is no picture, or a model that does not see."""
        if not self.capabilities.vision:
            raise spec.EngineError(self._blind(), code="invalid_media")
        if media.kind != "image":
            raise spec.EngineError(f"{self._name} sees images; it does not take {media.kind}", code="invalid_media")
        digest = media.digest or hashlib.sha256(media.data).hexdigest()
        found = self._media.get(digest)
        if found is None:
            found = self._encode(digest, _picture(media.data))
            self._media.put(digest, found)
        return found

    def _encode(self, digest: str, picture: Any) -> _Encoded:
        """The processor's own preparation of one picture behind one marker, so that the ids and
        pixel values are exactly those of the processor path."""
        torch = self._torch
        try:
            with self._tokenizing:
                out = self._processor(text=self.media_marker, images=[picture], add_special_tokens=False,
                                      return_tensors="pt")
        except Exception as exc:  # noqa: BLE001 - a picture the processor refuses (too small, odd mode)
            raise spec.EngineError(f"The image could not be prepared for {self._name}: {_first_line(exc, 200)}",
                                   code="invalid_media") from exc
        ids = out["input_ids"]
        aligned = {key: value[0] for key, value in out.items()
                   if key.endswith("token_type_ids") and torch.is_tensor(value) and value.shape == ids.shape}
        inputs = {key: value for key, value in out.items() if key not in _TEXT_KEYS and key not in aligned}
        return _Encoded(digest=digest, ids=tuple(int(i) for i in ids[0]), aligned=aligned, inputs=inputs,
                        picture=picture)

    def _layout(self, request: spec.GenerateRequest) -> tuple[list[int], list[Any], list[_Placed]]:
        """A request's full sequence: its token ids with each picture's expansion at its span, the
        keys the prompt cache compares (a text token's id; ``(digest, i)`` at a picture's
        positions, so two pictures never share a cached prefix), and where each picture sits.
        A ValueError or EngineError says why the media cannot be placed."""
        if not self.capabilities.vision:
            raise ValueError(f"{self._blind()}; this request holds {len(request.media)} media part(s)")
        prompt = list(request.prompt)
        ids: list[int] = []
        keys: list[Any] = []
        placed: list[_Placed] = []
        at = 0
        for span in request.media:
            if not at <= span.at <= len(prompt):
                raise ValueError(f"A media span sits at {span.at}: spans must be in order, within the prompt")
            encoded = self._encoded(span.media)
            if span.tokens != len(encoded.ids):
                raise ValueError(f"This picture takes {len(encoded.ids)} positions in {self._name}, "
                                 f"not {span.tokens}")
            ids += prompt[at:span.at]
            keys += prompt[at:span.at]
            placed.append(_Placed(len(ids), len(ids) + len(encoded.ids), encoded))
            ids += encoded.ids
            keys += [(encoded.digest, i) for i in range(len(encoded.ids))]
            at = span.at
        return ids + prompt[at:], keys + prompt[at:], placed

    def _pixel_inputs(self, pictures: list[_Encoded]) -> dict[str, Any]:
        """The per-picture inputs of ``pictures`` as one batch, as the processor gives them for a
        prompt that holds them all: concatenated along dim 0 when their shapes agree, else
        (a varying number of tiles) batched by the processor itself."""
        torch = self._torch
        if len(pictures) == 1:
            return dict(pictures[0].inputs)
        merged: dict[str, Any] = {}
        for key in pictures[0].inputs:
            parts = [p.inputs.get(key) for p in pictures]
            if not all(torch.is_tensor(x) for x in parts) or len({tuple(x.shape[1:]) for x in parts}) != 1:
                break
            merged[key] = torch.cat(parts, dim=0)
        else:
            return merged
        with self._tokenizing:
            out = self._processor(text=self.media_marker * len(pictures), images=[p.picture for p in pictures],
                                  add_special_tokens=False, return_tensors="pt")
        return {key: value for key, value in out.items()
                if key not in _TEXT_KEYS and not key.endswith("token_type_ids")}

    def _chunk_inputs(self, placed: list[_Placed], length: int, at: int, end: int) -> dict[str, Any]:
        """What a prefill forward over positions ``at`` .. ``end`` passes besides the ids: the
        pixel inputs of the pictures inside it, and the token-aligned inputs (0 at text)."""
        torch = self._torch
        inside = [p.encoded for p in placed if at <= p.start and p.end <= end]
        extra = self._pixel_inputs(inside) if inside else {}
        for key in {key for p in placed for key in p.encoded.aligned}:
            sample = next(p.encoded.aligned[key] for p in placed if key in p.encoded.aligned)
            row = torch.zeros(length, dtype=sample.dtype)
            for p in placed:
                if key in p.encoded.aligned:
                    row[p.start:p.end] = p.encoded.aligned[key]
            extra[key] = row[at:end].unsqueeze(0)
        return extra

    # --- generation --------------------------------------------------------------------
    @property
    def busy(self) -> int:
        return self._serial.busy

    def _not_chat(self) -> sdk.LocalmError | None:
        """The refusal of a generation on a model that does not generate (None on a chat model)."""
        if self.embedding:
            return sdk.LocalmError(400, "This is an embedding model: use /v1/embeddings", code="not_a_chat_model")
        if self.reranker:
            return sdk.LocalmError(400, "This is a reranker: use /v1/rerank", code="not_a_chat_model")
        return None

    def check_constraint(self, constraint: spec.Constraint) -> None:
        if (refusal := self._not_chat()) is not None:
            raise refusal
        self._constrainer.check(constraint)

    def generate(self, request: spec.GenerateRequest) -> AsyncIterator[spec.Event]:
        if (refusal := self._not_chat()) is not None:
            raise refusal
        return self._serial.generate(request, self._decode)

    def _new_cache(self) -> Any:
        from transformers import DynamicCache
        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # transformers before 4.56
            return DynamicCache()

    def _forward(self, ids: list[int], cache: Any, last_only: bool = True, extra: dict[str, Any] | None = None) -> Any:
        torch = self._torch
        kwargs: dict[str, Any] = {self._cache_kwarg: cache, "use_cache": True, **(extra or {})}
        if last_only and self._keep_kwarg:
            kwargs[self._keep_kwarg] = 1
        out = self.model(torch.tensor([ids], dtype=torch.long, device=self._device), **self._on_device(kwargs))
        return out.logits[0, -1].float().cpu()

    def _prefill(self, prompt: list[int], reuse: bool, cancel: threading.Event, key: tuple = (),
                 keys: list[Any] | None = None, placed: Sequence[_Placed] = ()) -> tuple[Any, int]:
        """Logits after ``prompt`` (None when cancelled first) and how many of its positions came
        from the cache: the cached prefix of the last request is reused when allowed and computed
        with the same interventions (``key``). With
        pictures (``placed``), ``keys`` is what the cache compares (see ``_layout``): a picture is
        computed whole, in the forward pass that holds all of its positions, from its pixels."""
        keys = list(keys) if keys is not None else prompt
        start = 0
        cache = self._cache
        reuse = reuse and key == self._cache_key
        if reuse and cache is not None and (kept := self._repeat(keys, cache)) is not None:
            return kept, len(prompt)
        if reuse and cache is not None:
            common = 0
            for a, b in zip(self._cached, keys):
                if a != b:
                    break
                common += 1
            start = min(common, len(prompt) - 1)  # at least one token runs, for its logits
            for p in placed:  # never resume inside a picture: its features come from its pixels at once
                if p.start < start < p.end:
                    start = p.start
            try:
                if start <= 0:
                    raise ValueError("nothing to reuse")
                held = cache.get_seq_length()
                if held > start:  # a negative count removes that many: transformers 4 and 5 both read it so
                    cache.crop(start - held)
            except Exception:  # an uncroppable cache (sliding windows) starts over
                start, cache = 0, None
        if not reuse or cache is None or start == 0:
            start, cache = 0, self._new_cache()
        self._cache, self._cached, self._cache_key = cache, keys[:start], key
        logits = None
        at = start
        while at < len(prompt):
            if cancel.is_set():
                return None, start
            end = min(at + self._n_batch, len(prompt))
            for p in placed:  # a chunk ends after a picture, never inside one
                if p.start < end < p.end:
                    end = p.end
            extra = self._chunk_inputs(list(placed), len(prompt), at, end) if placed else None
            logits = self._forward(prompt[at:end], cache, extra=extra)
            self._cached = keys[:end]
            at = end
        self._prompt_logits = (tuple(keys), logits.clone()) if logits is not None else None
        return logits, start

    def _repeat(self, keys: list[Any], cache: Any) -> Any:
        """The last prompt's own logits when ``keys`` is that prompt again (a regenerated reply): the
        cache is cut back to it and nothing runs, so the reply draws from the very numbers a fresh
        prompt gives (recomputing its last token alone would differ in float32's last bits).
        None when it is another prompt."""
        kept = self._prompt_logits
        if kept is None or kept[0] != tuple(keys) or self._cached[:len(keys)] != keys:
            return None
        try:
            held = cache.get_seq_length()
            if held > len(keys):
                cache.crop(len(keys) - held)
        except Exception:  # an uncroppable cache: computed afresh
            return None
        self._cached = list(keys)
        return kept[1].clone()

    def _decode(self, request: spec.GenerateRequest, cancel: threading.Event,
                emit: Callable[[spec.Event], None]) -> None:
        torch = self._torch
        s = request.sampling
        prompt = list(request.prompt)
        started = time.perf_counter()
        first = None
        n = 0
        reason: spec.FinishReason = "length"
        error = None
        if not prompt:
            emit(spec.Finished(reason="error", prompt_tokens=0, completion_tokens=0, error="The prompt is empty"))
            return
        keys: list[Any] | None = None
        placed: list[_Placed] = []
        if request.media:
            try:
                prompt, keys, placed = self._layout(request)
            except (ValueError, spec.EngineError) as exc:
                emit(spec.Finished(reason="error", prompt_tokens=len(prompt), completion_tokens=0, error=str(exc)))
                return
        if len(prompt) >= self._n_ctx:
            emit(spec.Finished(reason="error", prompt_tokens=len(prompt), completion_tokens=0,
                               error=f"The prompt is {len(prompt)} tokens; the context window is {self._n_ctx}"))
            return
        masker, refused = self._constrainer.start(request)
        if refused is not None:
            emit(spec.Finished(reason="error", prompt_tokens=len(prompt), completion_tokens=0, error=refused))
            return
        k = request.logprobs
        try:
            steering = _Steering(request, self.capabilities.layers, self._hidden) \
                if request.interventions or request.reads else None
            if steering and not self.capabilities.interventions:
                raise ValueError("This model does not accept interventions or activation reads")
        except ValueError as exc:
            emit(spec.Finished(reason="error", prompt_tokens=len(prompt), completion_tokens=0, error=str(exc)))
            return
        hooks = contextlib.nullcontext()
        if steering:
            weight = next(self.model.parameters())
            hooks = steering.installed(self._layers, weight.dtype, weight.device)
        generator = torch.Generator().manual_seed(
            (s.seed if s.seed is not None else random.randrange(2**63)) & 0x7FFF_FFFF_FFFF_FFFF)
        generated: list[int] = []
        prefix = read = 0  # incremental detokenization window over ``generated``
        try:
            with torch.inference_mode(), hooks:
                logits, cached = self._prefill(prompt, request.cache_prompt and not request.reads, cancel,
                                               steering.key if steering else (), keys, placed)
                while True:
                    if cancel.is_set() or logits is None:
                        reason = "cancelled"
                        break
                    token = self._pick(logits, prompt + generated, s, generator, masker)
                    if first is None:
                        first = time.perf_counter()
                    if token in self._eog:
                        reason = "stop"
                        break
                    if masker is not None and not masker.accept(token):
                        reason = "error"
                        error = f"The output left the grammar: {masker.error}"
                        break
                    entry = spec.logprob_entry(logits.numpy(), token, k) if k is not None else (None, ())
                    generated.append(token)
                    n += 1
                    before = self.detokenize(generated[prefix:read])
                    after = self.detokenize(generated[prefix:])
                    text = ""
                    if len(after) > len(before) and not after.endswith("\ufffd"):
                        text = after[len(before):]
                        prefix, read = read, len(generated)
                    emit(spec.Token(id=token, text=text, logprob=entry[0], top=entry[1]))
                    if masker is not None and masker.finished:
                        reason = "stop"
                        break
                    if (s.max_tokens is not None and n >= s.max_tokens) or len(prompt) + n >= self._n_ctx:
                        reason = "length"
                        break
                    if cancel.is_set():
                        reason = "cancelled"
                        break
                    logits = self._forward([token], self._cache)
                    self._cached.append(token)
        except Exception as exc:  # a failure inside the model after the stream opened
            self._cache, self._cached = None, []
            emit(spec.Finished(reason="error", prompt_tokens=len(prompt), completion_tokens=n,
                               error=f"transformers: {_redact(_first_line(exc), self._path)}"))
            return
        if not request.cache_prompt:
            self._cache, self._cached = None, []
        ended = time.perf_counter()
        first = first or ended
        emit(spec.Finished(reason=reason, prompt_tokens=len(prompt), completion_tokens=n,
                           prompt_seconds=first - started, generate_seconds=ended - first, error=error,
                           activations=steering.activations(self._hidden or 0) if steering else None,
                           cached_tokens=cached))

    def _pick(self, logits: Any, history: list[int], s: spec.Sampling, generator: Any,
              masker: spec.TokenMasker | None = None) -> int:
        """The next token: the grammar's mask, penalties, then greedy (temperature 0) or top-k,
        top-p, min-p and temperature before a seeded draw (llama.cpp's order). ``logits`` (the raw
        logits, which the log probabilities read) is left as it is."""
        torch = self._torch
        logits = logits.clone()
        if masker is not None and masker.active:
            masker.apply(logits.numpy())  # shares the tensor's memory
        if history and (s.repeat_penalty != 1.0 or s.frequency_penalty or s.presence_penalty):
            ids, counts = torch.unique(torch.tensor(history[-PENALTY_LAST_N:], dtype=torch.long), return_counts=True)
            ids, counts = ids[ids < logits.shape[0]], counts[ids < logits.shape[0]]
            chosen = logits[ids]
            if s.repeat_penalty != 1.0:
                chosen = torch.where(chosen > 0, chosen / s.repeat_penalty, chosen * s.repeat_penalty)
            chosen = chosen - counts.float() * s.frequency_penalty - (counts > 0).float() * s.presence_penalty
            logits[ids] = chosen
        if s.temperature <= 0:
            return int(torch.argmax(logits))
        if 0 < s.top_k < logits.shape[0]:
            values, ids = torch.topk(logits, s.top_k)
        else:
            values, ids = torch.sort(logits, descending=True)
        probs = torch.softmax(values, dim=0)
        keep = torch.ones_like(probs, dtype=torch.bool)
        if s.top_p < 1.0:
            keep &= (torch.cumsum(probs, dim=0) - probs) < s.top_p
        if s.min_p > 0.0:
            keep &= probs >= s.min_p * probs[0]
        keep[0] = True
        values, ids = values[keep], ids[keep]
        probs = torch.softmax(values / s.temperature, dim=0)
        return int(ids[torch.multinomial(probs, 1, generator=generator)])

    # --- embeddings and scores -----------------------------------------------------------
    async def embed(self, texts: list[str]) -> list[list[float]]:
        """One normalised vector per text: pooled as an embedding model declares, or the mean of a
        generative model's final hidden states (as llama.cpp embeds a GGUF chat model)."""
        if self.reranker:
            raise sdk.LocalmError(422, "This is a reranker: use /v1/rerank", code="not_an_embedding_model")
        now = self._live() if self._live is not None else self._settings
        most_texts, most_chars = int(now.get("hf_embed_max_texts", 2048)), int(now.get("hf_embed_max_chars", 8_000_000))
        if len(texts) > most_texts:
            raise sdk.LocalmError(413, f"The request gives {len(texts)} texts; this engine embeds at most {most_texts} "
                                       "a request (the transformers plugin's hf_embed_max_texts)",
                                  code="too_many_inputs", field="input")
        chars = sum(len(text) for text in texts)
        if chars > most_chars:
            raise sdk.LocalmError(413, f"The request's texts hold {chars} characters; this engine embeds at most "
                                       f"{most_chars} a request (the transformers plugin's hf_embed_max_chars)",
                                  code="input_too_large", field="input")
        if not self.embedding:
            for text in texts:
                size = len(self.tokenize(text))
                if size > self._n_ctx:
                    raise sdk.LocalmError(413, f"An input is {size} tokens; the model embeds at most {self._n_ctx}",
                                          code="context_length_exceeded")
        return await self._serial.call(lambda: self._embed(texts))

    def _embed(self, texts: list[str]) -> list[list[float]]:
        # one text a pass, unpadded: a text's vector never depends on the others in its request
        torch = self._torch
        out: list[list[float]] = []
        with torch.inference_mode():
            for text in texts:
                if not self.embedding:  # a generative model: the mean of its final hidden states
                    base = getattr(self.model, "base_model", None) or self.model
                    ids = self.tokenize(text) or [self.tokenizer.eos_token_id or 0]
                    hidden = base(input_ids=torch.tensor([ids], dtype=torch.long, device=self._device),
                                  use_cache=False).last_hidden_state
                    out.append(torch.nn.functional.normalize(hidden[0].float().mean(dim=0), p=2, dim=0).tolist())
                    continue
                with self._tokenizing:
                    batch = self.tokenizer([text], truncation=True, max_length=self._n_ctx, return_tensors="pt")
                hidden = self.model(**self._on_device(dict(batch))).last_hidden_state[0].float()
                if self._pooling == "cls":
                    pooled = hidden[0]
                elif self._pooling == "last":
                    pooled = hidden[-1]
                elif self._pooling == "max":
                    pooled = hidden.max(dim=0).values
                elif self._pooling == "sqrt":
                    pooled = hidden.sum(dim=0) / math.sqrt(hidden.shape[0])
                else:
                    pooled = hidden.mean(dim=0)
                out.append(torch.nn.functional.normalize(pooled, p=2, dim=0).tolist())
        return out

    async def next_token_logits(self, prompt: Sequence[int]) -> Any:
        import numpy as np
        logits = await self._score(prompt)
        return np.array(logits.numpy(), dtype=np.float32, copy=True)

    async def next_token_logprobs(self, prompt: Sequence[int]) -> list[float]:
        logits = await self._score(prompt)
        return self._torch.log_softmax(logits.double(), dim=0).tolist()

    async def _score(self, prompt: Sequence[int]) -> Any:
        """The raw logits (a float32 tensor) for the token after ``prompt``, from a fresh cache."""
        if self.role != "chat":
            raise sdk.LocalmError(400, f"This is {'a reranker' if self.reranker else 'an embedding model'}: "
                                       "it does not predict tokens", code="not_a_chat_model")
        ids = list(prompt)
        if not ids:
            raise sdk.LocalmError(400, "The prompt is empty")
        if len(ids) > self._n_ctx:
            raise sdk.LocalmError(413, f"The prompt is {len(ids)} tokens; the context window is {self._n_ctx}",
                                  code="context_length_exceeded")

        def score() -> Any:
            torch = self._torch
            with torch.inference_mode():
                cache = self._new_cache()
                logits = None
                for at in range(0, len(ids), self._n_batch):
                    logits = self._forward(ids[at:at + self._n_batch], cache)
                return logits.clone()
        return await self._serial.call(score)

    # --- reranking -------------------------------------------------------------------
    async def rerank(self, query: str, documents: list[str]) -> list[spec.Ranked]:
        """One score per document: the classifier head over the tokenizer's pair encoding of
        (query, document), the document cut to fit the window. One pair a pass, unpadded, so a
        document's score never depends on the others."""
        if not self.reranker:
            raise sdk.LocalmError(422, "This model is not a reranker", code="not_a_reranker")
        with self._tokenizing:
            asked = len(self.tokenizer(query, add_special_tokens=False)["input_ids"])
            specials = self.tokenizer.num_special_tokens_to_add(pair=True)
        if asked + specials + RERANK_MIN_DOCUMENT_TOKENS > self._n_ctx:
            raise sdk.LocalmError(400, f"The query is {asked} tokens; this reranker reads {self._n_ctx} tokens, "
                                       f"which must hold the query, {specials} special tokens and at least "
                                       f"{RERANK_MIN_DOCUMENT_TOKENS} tokens of each document",
                                  code="query_too_long")
        return await self._serial.call(self._rerank, query, list(documents), asked + specials)

    def _rerank(self, query: str, documents: list[str], fixed: int) -> list[spec.Ranked]:
        torch = self._torch
        out: list[spec.Ranked] = []
        with torch.inference_mode():
            for document in documents:
                with self._tokenizing:
                    size = len(self.tokenizer(document, add_special_tokens=False)["input_ids"])
                    pair = self.tokenizer(query, document, truncation="only_second", max_length=self._n_ctx,
                                          return_tensors="pt")
                if getattr(self.model.config, "type_vocab_size", 2) < 2:  # one segment embedding (RoBERTa)
                    pair.pop("token_type_ids", None)
                logits = self.model(**self._on_device(dict(pair))).logits[0].float().tolist()
                out.append(spec.Ranked(score=float(logits[0]),
                                       label_scores=tuple(float(x) for x in logits) if len(logits) > 1 else None,
                                       truncated=fixed + size > self._n_ctx,
                                       tokens=int(pair["input_ids"].shape[1])))
        return out

    def _on_device(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """``inputs`` with their tensors on the model's device (pictures' pixels in its dtype)."""
        if self._device.type == "cpu":
            return inputs
        torch = self._torch
        out = {}
        for key, value in inputs.items():
            if torch.is_tensor(value):
                value = value.to(self._device, dtype=self._dtype if value.is_floating_point() else None)
            out[key] = value
        return out

    def _placed(self) -> spec.Placement:
        """Where the model runs: the CPU, or the accelerator and the memory its weights took there."""
        if self._device.type == "cpu":
            return spec.Placement(device="cpu")
        took = None
        if self._device.type == "cuda":
            took = int(self._torch.cuda.memory_allocated(self._device))
        return spec.Placement(device=str(self._device), vram_bytes=took)

    def vram(self) -> tuple[int, int] | None:
        """(free, total) bytes of the CUDA device this model runs on; None elsewhere."""
        if self._device.type != "cuda":
            return None
        free, total = self._torch.cuda.mem_get_info(self._device)
        return int(free), int(total)

    def close(self) -> None:
        self._serial.close()
        self._cache, self._cached = None, []
        self._media.clear()
        self._processor = None
        self.model = None
        self.tokenizer = None
        gc.collect()
        if self._device.type == "cuda":  # give the freed blocks back to the driver
            self._torch.cuda.empty_cache()


@sdk.hookimpl
def register_settings(register):
    register(Settings)


@sdk.hookimpl
def register_engines(register, plugin):
    def load(entry: Any, options: dict[str, Any]) -> TransformersEngine:
        return TransformersEngine(entry.path, entry.type, getattr(entry, "role", "chat"),
                                  {**plugin.settings, **options}, live=lambda: plugin.settings)

    register("transformers", load, formats=["hf"], fallback=["gguf"])
