"""The llama.cpp engine: GGUF models through llama-cpp-python.

llama-cpp-python builds llama.cpp from source. On CPUs that advertise AMX, a native
build crashes on the first prompt; install it as a portable AVX2 build (see
docs/engines.md, or `.ci/run`).

A GGUF reranker (rank pooling, a cross-encoder such as bge-reranker-v2-m3) loads as
llama-server loads one: an embedding context with ``LLAMA_POOLING_TYPE_RANK``, whose
pooled output for a sequence is the classifier head's output. Each (query, document) pair
is formatted as llama-server formats it and scored in a pass of its own.
"""

from __future__ import annotations

import codecs
import ctypes
import logging
import os
import random
import struct
import time
import warnings
from collections import deque
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import attrs

from localm import sdk
from localm.sdk import engines as spec
from localm.sdk.gguf import GGUFError, find_projector, metadata, tensor_names
from localm.sdk.storage import atomic_write_bytes

from . import lora, placement, speculation, vision

log = logging.getLogger("localm.plugin.llamacpp")

@attrs.frozen
class Settings:
    n_ctx: int = sdk.setting(4096, min=256, description="The context window a model opens at, in tokens; it grows "
                                                        "on demand up to n_ctx_max")
    n_ctx_max: int = sdk.setting(0, min=0, description="The most tokens the context window grows to (0: the context "
                                                       "the model was trained for), within ctx_memory_mb")
    ctx_memory_mb: int = sdk.setting(4096, min=16, description="The memory a model's context (its KV cache) may take "
                                                               "as it grows, in MiB")
    n_threads: int = sdk.setting(0, min=0, description="CPU threads for generation (0: one per core this process "
                                                       "may run on)")
    n_batch: int = sdk.setting(512, min=1, description="Prompt tokens read per step beside the running replies' "
                                                       "next tokens; a prompt is read in chunks of this size")
    n_parallel: int = sdk.setting(4, min=1, max=64, description="Requests a model decodes at once, in one batch a "
                                                                "step; each has a window of its own (restart-free: "
                                                                "takes effect when a model loads)")
    flash_attn: bool = sdk.setting(True, description="Flash attention, as llama-server has it: a step of several "
                                                     "replies decodes about a fifth faster on CPU. Off: every reply "
                                                     "computes the same numbers alone or beside others, whatever "
                                                     "its length (takes effect when a model loads)")
    cache_ram_mb: int = sdk.setting(-1, min=-1, description="Host memory for conversations whose slot another "
                                                           "request took, in MiB: their KV state is kept here and "
                                                           "restored instead of read again (-1: a quarter of the "
                                                           "memory free when the model loads, at most 8192; 0: off)")
    n_gpu_layers: int = sdk.setting(-1, min=-1, description="Layers a model puts on the GPU (-1: all that fit in "
                                                             "its free memory beside the context; 0: none, CPU "
                                                             "only). A load that does not fit is tried with fewer "
                                                             "and says degraded; POST /v1/models/load?gpu_layers= "
                                                             "sets one load's")
    main_gpu: int = sdk.setting(0, min=0, max=63, description="The GPU a model goes to when it is not split "
                                                              "across several (tensor_split)")
    tensor_split: str = sdk.setting("", description="How a model is split across GPUs, as proportions by GPU "
                                                    "index (\"3,1\": three quarters on GPU 0); empty: one GPU")
    cache_persist: bool = sdk.setting(False, description="Write the prompt cache to the data dir when a model "
                                                         "unloads or the server stops, and read it back when the "
                                                         "model loads: a front end's tool definitions and system "
                                                         "prompt are warm after a restart")
    spec_source: str = sdk.setting("off", choices=("off", "ngram", "draft"),
                                   description="Speculative drafting for requests that do not set spec_source: off, "
                                               "ngram (prompt lookup: pays where replies repeat their context) or "
                                               "draft (a small model sharing the vocabulary, spec_draft_model). A "
                                               "reply drafts while it decodes alone, and only while drafting is "
                                               "measured to pay")
    spec_draft_model: str = sdk.setting("", owner_only=True,
                                        description="The draft model's GGUF file for spec_source draft (the same "
                                                    "vocabulary as the models it drafts for; takes effect when a "
                                                    "model loads)")
    spec_draft_max: int = sdk.setting(64, min=1, max=64, description="The most tokens drafted a step (adaptive "
                                                                      "drafting goes past 16 only round a loop)")
    spec_adaptive: bool = sdk.setting(True, description="Draft only as far as the measured step costs and "
                                                        "acceptance say it pays (off: draft every step a draft "
                                                        "is found, as far as spec_draft_max)")
    stream_interval_ms: int = sdk.setting(-1, min=-1, max=1000,
                                          description="The shortest time between two messages of a streamed "
                                                      "reply: the tokens decoded meanwhile travel together (-1: "
                                                      "40 ms where the model runs on the CPU with a thread on "
                                                      "every core, else 0; 0: a message a token; takes effect "
                                                      "when a model loads)")


def _meta_int(meta: dict[str, Any], key: str) -> int | None:
    """A GGUF metadata value as a positive int (llama-cpp-python gives them as strings); None when absent."""
    try:
        value = int(meta[key])
    except (KeyError, TypeError, ValueError):
        return None
    return value if value > 0 else None


def _kv_bytes_per_token(meta: dict[str, Any], arch: str) -> int | None:
    """The bytes one token takes in a context's KV cache (f16 keys and values in every
    layer), from the GGUF metadata; None when the metadata does not say."""
    layers = _meta_int(meta, f"{arch}.block_count")
    heads = _meta_int(meta, f"{arch}.attention.head_count")
    embedding = _meta_int(meta, f"{arch}.embedding_length")
    kv_heads = _meta_int(meta, f"{arch}.attention.head_count_kv") or heads
    if not (layers and heads and embedding and kv_heads):
        return None
    key = _meta_int(meta, f"{arch}.attention.key_length") or embedding // heads
    value = _meta_int(meta, f"{arch}.attention.value_length") or embedding // heads
    return layers * kv_heads * (key + value) * 2


#: A window grows in steps of this many tokens (and at least doubles).
WINDOW_STEP = 256

#: A reranker's window must hold the query, the special tokens and at least this many
#: tokens of each document, or the query is refused as too long.
RERANK_MIN_DOCUMENT_TOKENS = 8
#: The classifier-head tensors of a GGUF reranker (llama.cpp's cls / cls_out).
CLASSIFIER_TENSORS = ("cls.weight", "cls.output.weight")


def _shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (compared 64 at a time, then one by one;
    a slot's tokens are a list, a prompt a tuple)."""
    n, end = 0, min(len(a), len(b))
    same = type(a) is type(b)
    while n + 64 <= end and (a[n:n + 64] == b[n:n + 64] if same else list(a[n:n + 64]) == list(b[n:n + 64])):
        n += 64
    for x, y in zip(a[n:end], b[n:end]):
        if x != y:
            break
        n += 1
    return n


class _Steer:
    """One request's interventions and activation reads, checked, for llama.cpp.

    ``deltas``: layer → float32 vector (the sum of that layer's interventions); ``reads``:
    layer → points; ``key`` identifies the deltas (a slot's cached prompt is reused only
    under the same key). Deltas go into a control vector, which llama.cpp adds to each
    layer's output (``l_out``, after the FFN's residual add: SAELens' ``hook_resid_post``).
    A control vector has no row for layer 0, and reading needs llama.cpp's eval callback,
    so a request with reads or a layer-0 delta is a ``probe``: it decodes alone in a context
    opened with the callback, which adds its deltas and copies the rows it reads.
    """

    def __init__(self, request: spec.GenerateRequest, layers: int | None, hidden: int | None) -> None:
        sums, self.reads = spec.steering_of(request, layers, hidden)
        self.deltas = sums
        self.key = tuple((layer, sums[layer].tobytes()) for layer in sorted(sums))
        self.rows: dict[tuple[int, str], list[Any]] = {
            (layer, point): [] for layer, points in self.reads.items() for point in points}
        self.hidden = hidden or 0
        self.probe = bool(self.reads) or 0 in sums
        #: the last layer's output holds only the rows whose logits are asked for
        self.every_row = layers is not None and layers - 1 in self.reads
        self.names = {f"l_out-{layer}".encode(): layer for layer in set(sums) | set(self.reads)} if self.probe else {}
        self.error: str | None = None

    def control_vector(self, layers: int) -> tuple[Any, int, int] | None:
        """The deltas as llama.cpp's control vector: layers 1..n-1's rows in one buffer (there is
        never a row for layer 0), and the first and last layer it applies to."""
        import numpy as np
        steered = [layer for layer in self.deltas if layer > 0]
        if not steered:
            return None
        buffer = np.zeros((layers - 1, self.hidden), dtype=np.float32)
        for layer in steered:
            buffer[layer - 1] = self.deltas[layer]
        return buffer, min(steered), max(steered)

    def observe(self, layer: int, rows: Any) -> bool:
        """The eval callback's work at ``layer``'s output: read "pre", add the delta, read
        "post". True when ``rows`` changed (to be written back)."""
        points = self.reads.get(layer, ())
        if "pre" in points:
            self.rows[(layer, "pre")].append(rows.copy())
        delta = self.deltas.get(layer)
        if delta is not None:
            rows += delta
        if "post" in points:
            self.rows[(layer, "post")].append(rows.copy())
        return delta is not None

    def activations(self) -> dict[tuple[int, str], Any] | None:
        import numpy as np
        if not self.rows:
            return None
        return {key: (np.concatenate(parts, axis=0) if parts else np.zeros((0, self.hidden), dtype=np.float32))
                for key, parts in self.rows.items()}


class _Ggml:
    """The few ggml calls the eval callback makes on a tensor (from the ggml library
    llama-cpp-python ships): its name, shape and data."""

    def __init__(self) -> None:
        from llama_cpp import _ggml
        lib = _ggml.libggml
        self.name = lib.ggml_get_name
        self.name.argtypes, self.name.restype = [ctypes.c_void_p], ctypes.c_char_p
        self.nrows = lib.ggml_nrows
        self.nrows.argtypes, self.nrows.restype = [ctypes.c_void_p], ctypes.c_int64
        self.nelements = lib.ggml_nelements
        self.nelements.argtypes, self.nelements.restype = [ctypes.c_void_p], ctypes.c_int64
        self.nbytes = lib.ggml_nbytes
        self.nbytes.argtypes, self.nbytes.restype = [ctypes.c_void_p], ctypes.c_size_t
        self.get = lib.ggml_backend_tensor_get
        self.get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self.get.restype = None
        self.set = lib.ggml_backend_tensor_set
        self.set.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self.set.restype = None


class _Sequence:
    """A request's state in the decode loop."""

    __slots__ = ("masker", "steer", "slot", "feed", "sampler", "greedy", "decoder", "prompting", "n", "started",
                 "first", "cached", "positions", "media", "spec")

    def __init__(self, masker: spec.TokenMasker | None, steer: _Steer | None = None) -> None:
        self.masker = masker
        self.steer = steer
        self.slot: int | None = None
        self.feed: list[int] = []  # tokens to decode next: the prompt's rest, then the last token drawn
        self.sampler: Any = None
        #: Drawn by argmax over the logits (see LlamaEngine._greedy): no chain to run.
        self.greedy = False
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.prompting = True
        self.n = 0
        self.started: float | None = None
        self.first: float | None = None
        self.cached = 0  # prompt tokens a cache held (a slot's or one restored from host memory)
        #: With media: the prompt's positions, each media's ids in place (see vision.expand), and
        #: for each of its rows' ids the piece and row that holds its embedding. None: text only.
        self.positions: list[int] | None = None
        self.media: dict[int, tuple[vision.Piece, int]] | None = None
        #: The reply's drafting (None: no draft source on)
        self.spec: speculation.Speculating | None = None


def _positions(request: spec.GenerateRequest) -> int:
    """The positions a request's prompt takes: its tokens and its media's."""
    return len(request.prompt) + sum(span.tokens for span in request.media) if request.media else len(request.prompt)


#: A draft model whose tokens were kept less often than this in the last replies is probed in
#: one reply of eight only.
DRAFT_WORTH = 0.2

#: Prompt chunks shorter than this are read together, several newcomers' in one decode: below
#: it llama.cpp's CPU attention computes each row on its own (its tiled kernel starts at 64
#: rows), so a prompt gives the same numbers read alone or beside others.
TOGETHER_BELOW = 64

#: Where the decode's threads take every core, a streamed reply's tokens reach the server's event
#: loop at most once this often (ms; the stream_interval_ms setting's -1), about a film's frame
#: rate: each handing wakes the loop, which writes to a socket and wakes a client, on the cores
#: the decode runs on (bench/stream_interval.py: 2.6% faster than a message a token on two cores).
STREAM_INTERVAL_MS = 40

#: A cached prefix this much longer than another slot's wins over keeping the busy slots in a row;
#: a slot whose cache would lose more than this many tokens is taken only when every free one would.
PREFIX_OVER_ROW = 256


def _pick_slot(prefix: dict[int, int], busy: list[bool], used: list[float],
               cached: dict[int, int] | None = None) -> int:
    """The free slot for a newcomer, from ``prefix`` (free slot -> tokens its cache shares with
    the prompt), which slots are busy, when each was last used and ``cached`` (free slot -> the
    tokens its cache holds; None: all empty).

    Only the slots whose shared prefix is within ``PREFIX_OVER_ROW`` tokens of the longest are
    candidates: a follow-up turn of a long conversation takes its own slot. Among them, taking a
    slot costs what its cache loses (the tokens past the shared prefix): a slot that would lose
    more than ``PREFIX_OVER_ROW`` is taken only when every candidate would, and then the one that
    loses least, so a front end's short side request (a title, tags) never takes a long
    conversation's slot while a cheaper one is free. Then the slot that keeps the busy slots in
    the fewest runs (llama.cpp decodes the running sequences' next tokens in one pass only when
    their ids follow each other: busy slots 0, 1 and 3 take two passes a step); then the fewest
    tokens lost, the longest shared prefix, the least recently used."""
    def runs(slot: int) -> int:
        taken = [b or i == slot for i, b in enumerate(busy)]
        return sum(1 for i, b in enumerate(taken) if b and (i == 0 or not taken[i - 1]))

    def lost(slot: int) -> int:
        return max(0, (cached or {}).get(slot, 0) - prefix[slot])

    best = max(prefix.values())
    near = [slot for slot, n in prefix.items() if n >= best - PREFIX_OVER_ROW]
    return min(near, key=lambda slot: (max(0, lost(slot) - PREFIX_OVER_ROW), runs(slot), lost(slot), -prefix[slot],
                                       used[slot], slot))


#: A slot's cache is kept in host memory when a newcomer would drop at least this many of its tokens.
#: Copying a sequence's state costs microseconds a token where reading a prompt costs milliseconds a
#: token on a CPU, so a short conversation is worth keeping too (a front end's next turn, a task
#: sent again with another suffix).
SAVE_FROM = 16
#: A state in host memory is restored when it holds at least this many more of the prompt's tokens
#: than the slot, and at least one in ``RESTORE_COPY`` of the tokens it copies (its whole length:
#: restoring a long conversation for a few tokens of it would copy more than it saves).
RESTORE_FROM = 8
RESTORE_COPY = 64
#: The host-memory cache keeps at most this many states (a newcomer's prompt is compared with each).
CACHE_ENTRIES = 256


def _worth_restoring(kept: int, shared: int, length: int) -> bool:
    """Whether a state of ``length`` tokens sharing ``kept`` tokens with the prompt is worth
    copying into a slot that shares ``shared`` (RESTORE_FROM, RESTORE_COPY)."""
    return kept - shared >= max(RESTORE_FROM, length // RESTORE_COPY)


#: The first bytes of a persisted prompt-cache file.
CACHE_MAGIC = b"LOCALMKV\x01"


class _Saved:
    """A sequence's KV state kept in host memory: the tokens it holds and llama.cpp's bytes."""

    __slots__ = ("tokens", "data")

    def __init__(self, tokens: tuple[int, ...], data: Any) -> None:
        self.tokens = tokens
        self.data = data


class PromptCache:
    """The KV state of sequences that lost their slot, within ``budget`` bytes and
    ``CACHE_ENTRIES`` states, the least recently used dropped first. A state covered by a
    longer one (its tokens are the longer one's start) is not kept twice."""

    def __init__(self, budget: int) -> None:
        self.budget = max(0, budget)
        self.entries: list[_Saved] = []  # least recently used first
        self.size = 0

    def best(self, prompt: Sequence[int]) -> tuple[_Saved | None, int]:
        """The entry sharing the longest prefix with ``prompt``, and how many tokens it shares."""
        found, most = None, 0
        prompt = tuple(prompt)
        for entry in self.entries:
            n = _shared_prefix(entry.tokens, prompt)
            if n > most:
                found, most = entry, n
        return found, most

    def covers(self, tokens: Sequence[int]) -> bool:
        tokens = tuple(tokens)
        return any(len(e.tokens) >= len(tokens) and _shared_prefix(e.tokens, tokens) == len(tokens)
                   for e in self.entries)

    def touch(self, entry: _Saved) -> None:
        if entry in self.entries:
            self.entries.remove(entry)
            self.entries.append(entry)

    def add(self, tokens: Sequence[int], data: Any) -> bool:
        """Keep ``data`` (the state of a sequence holding ``tokens``); False when it cannot fit."""
        size = len(data)
        if not tokens or size > self.budget:
            return False
        tokens = tuple(tokens)
        for entry in [e for e in self.entries if _shared_prefix(e.tokens, tokens) == len(e.tokens)]:
            self.drop(entry)  # a shorter state this one extends
        while self.entries and (self.size + size > self.budget or len(self.entries) >= CACHE_ENTRIES):
            self.drop(self.entries[0])
        self.entries.append(_Saved(tokens, data))
        self.size += size
        return True

    def drop(self, entry: _Saved) -> None:
        if entry in self.entries:
            self.entries.remove(entry)
            self.size -= len(entry.data)


def _cache_budget(setting: int) -> int:
    """The prompt cache's bytes: the setting in MiB, or for -1 a quarter of the memory free now
    (at most 8 GiB)."""
    if setting >= 0:
        return setting * 2**20
    available = 0
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    if not available:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            available = 4 * 2**30
    return min(available // 4, 8 * 2**30)


class LlamaEngine:
    engine = "llamacpp"

    def __init__(self, path: str, settings: dict[str, Any], role: str = "chat") -> None:
        try:
            import llama_cpp
            from llama_cpp import Llama
        except ImportError as exc:  # the plugin only activates with it installed; a broken build lands here
            raise spec.EngineError(f"llama-cpp-python cannot be imported: {exc}") from exc
        threads = settings["n_threads"] or spec.usable_cores()
        self.role = role
        self.reranker = role == "reranker"
        name = os.path.basename(path)
        options: dict[str, Any] = {"n_threads": threads, "n_threads_batch": threads, "n_batch": settings["n_batch"],
                                   "verbose": False}
        if self.reranker:
            try:
                head = set(CLASSIFIER_TENSORS) & tensor_names(path)
            except (OSError, ValueError, GGUFError, struct.error) as exc:
                raise spec.EngineError(f"llama.cpp could not read {name}: {exc}") from exc
            if not head:  # llama.cpp would abort the process on the first pass
                raise spec.EngineError(f"{name} has no classifier head (no {' or '.join(CLASSIFIER_TENSORS)} "
                                       "tensor)", code="no_classifier_head")
            # an encoder reads a whole pair in one pass: the batch is the window
            options.update(embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK, n_batch=settings["n_ctx"],
                           n_ubatch=settings["n_ctx"])
        self.llm = self._open_placed(Llama, path, settings, options, name)
        model = getattr(self.llm, "_model", None)
        n_ctx_train = model.n_ctx_train() if hasattr(model, "n_ctx_train") else self.llm.n_ctx()
        if 0 < n_ctx_train < self.llm.n_ctx():  # past its trained positions an encoder aborts the process
            if self.reranker:
                options.update(n_batch=n_ctx_train, n_ubatch=n_ctx_train)
            self.llm.close()
            self.llm = Llama(model_path=path, n_ctx=n_ctx_train, **options)
        #: The positions a pair may take (llama.cpp rounds a context up; an encoder's positions end at
        #: what it was trained with).
        self._window = min(self.llm.n_ctx(), n_ctx_train or self.llm.n_ctx())
        meta = self.llm.metadata
        self.template = meta.get("tokenizer.chat_template")
        arch = meta.get("general.architecture", "")
        #: The ceiling the window grows to: the trained context (or n_ctx_max), within the memory budget.
        self._ctx_max = self.llm.n_ctx()
        #: Requests decoded at once; each slot is a sequence with a window of its own.
        self._slots = 1 if self.reranker else int(settings.get("n_parallel") or 1)
        if not self.reranker:
            ceiling = min(n_ctx_train or 1 << 30, settings.get("n_ctx_max") or 1 << 30)
            per_token = _kv_bytes_per_token(meta, arch)
            if per_token:
                ceiling = min(ceiling, int(settings.get("ctx_memory_mb", 4096)) * 2**20 // (per_token * self._slots))
            if ceiling == 1 << 30:
                ceiling = self.llm.n_ctx()
            self._ctx_max = max(self.llm.n_ctx(), ceiling)
        self.capabilities = spec.Capabilities(
            hidden_size=_meta_int(meta, f"{arch}.embedding_length"), layers=_meta_int(meta, f"{arch}.block_count"),
            context_window=self._window if self.reranker else self.llm.n_ctx(), chat_template=bool(self.template),
            embeddings=not self.reranker,
            # llama.cpp picks kernels by batch size: a reply over a reused cache can differ
            cache_exact=False,
            reasoning=bool(self.template and "<think>" in self.template),
            tool_use=bool(self.template and "tools" in self.template),
            logprobs=not self.reranker, grammar=not self.reranker and spec.Constrainer.available(),
            rerank=self.reranker, context_max=None if self.reranker else self._ctx_max)
        # steering: a control vector per request, reads through the eval callback (see _Steer)
        self.capabilities = attrs.evolve(self.capabilities, interventions=not self.reranker and bool(
            self.capabilities.hidden_size and self.capabilities.layers and self.capabilities.layers > 1))
        #: A decoder reranker's prompt (Qwen3-Reranker), with {query} and {document} in it.
        self._rerank_template = meta.get("tokenizer.chat_template.rerank") or None
        bos = self.llm.token_bos()
        self._bos_text = self.llm._model.token_get_text(bos) if bos >= 0 else ""
        self._formatter = None
        if self.template:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter
            vocab = self.llm
            self._formatter = Jinja2ChatFormatter(
                template=self.template, eos_token=vocab._model.token_get_text(vocab.token_eos()),
                bos_token=vocab._model.token_get_text(vocab.token_bos()), add_generation_prompt=True)
        self._n_vocab = self.llm.n_vocab()
        self._views: dict[int, Any] = {}  # logits row views by address (_logits_row)
        self._pieces: dict[int, bytes] = {}  # detokenized tokens (_piece)
        self._n_batch = max(int(settings["n_batch"]), self._slots)
        self._flash = bool(settings.get("flash_attn", True))
        self._batch: Any = None
        self._queue: Any
        #: steering state: the control vector set on the context (its key; () for none), whether
        #: the context was opened with the eval callback, the deltas the running requests are
        #: decoded with and whether one of them is a probe, and the probe decoding now
        self._cvec: tuple = ()
        self._probing = False
        self._mode: tuple = ()
        self._mode_probe = False
        self._reader: _Steer | None = None
        self._ggml: _Ggml | None = None
        self._callback: Any = None
        #: The projector that places images and sounds in a prompt (None: this model takes none, for
        #: the reason in _no_media), the marker a rendered chat holds where a message has one, and
        #: the batch a media's rows are decoded in (made when the first is)
        self._projector, self._no_media = (None, "it is a reranker") if self.reranker else \
            self._open_projector(path, settings, threads)
        self.media_marker = self._projector.marker if self._projector is not None else vision.new_marker()
        self._media_batch: Any = None
        if self._projector is not None:
            self.capabilities = attrs.evolve(self.capabilities, vision=self._projector.vision,
                                             audio=self._projector.audio)
        #: The LoRA adapters the entry names (lora.py), set on every context the engine opens.
        try:
            self._adapters = lora.Adapters(self.llm._model.model, settings.get("adapters") or (), arch)
        except Exception:
            if self._projector is not None:
                self._projector.close()
            self.llm.close()  # frees the adapters opened so far with the model
            raise
        self.adapters = self._adapters.public
        if self.reranker:
            self._adapters.apply(self.llm._ctx.ctx)
            self._queue = spec.Serial("llamacpp")
            self._n_ctx_slot = self._window
        else:
            try:
                fresh = self._new_context(self.llm.n_ctx())
            except Exception as exc:
                if self._projector is not None:
                    self._projector.close()
                self.llm.close()
                raise spec.EngineError(f"llama.cpp could not open {self._slots} slots of {self.llm.n_ctx()} tokens "
                                       f"for {name}: {exc}") from exc
            self.llm._ctx.close()
            self.llm._ctx = fresh
            self._n_ctx_slot = self._slot_window()
            self.capabilities = attrs.evolve(self.capabilities, context_window=self._n_ctx_slot)
            self._batch = llama_cpp.llama_batch_init(self._n_batch, 0, 1)
            self._slot_tokens: list[list[int]] = [[] for _ in range(self._slots)]
            self._slot_key: list[tuple] = [() for _ in range(self._slots)]  # the deltas each cache holds
            self._slot_user: list[spec.Job | None] = [None] * self._slots
            self._slot_background = [False] * self._slots  # the cache a front end's side request wrote
            #: conversations whose slot another request took (see PromptCache)
            self._cache = PromptCache(_cache_budget(int(settings.get("cache_ram_mb", -1))))
            self._cache_dir = settings.get("cache_dir") if settings.get("cache_persist") else None
            self._identity = self._cache_identity(path, settings.get("sha256"))
            if self._cache_dir and self._cache.budget:
                self._load_cache()
            self._slot_used = [0.0] * self._slots
            self._waiting: deque[spec.Job] = deque()
            self._running: list[spec.Job] = []
            interval = int(settings.get("stream_interval_ms", -1))
            if interval < 0:
                interval = STREAM_INTERVAL_MS if not self._gpus and threads >= spec.usable_cores() else 0
            self._queue = spec.Batched("llamacpp", self._slots, admit=self._admit, step=self._step,
                                       abort=self._abort, interval=interval / 1000)
        self._eog = self._end_of_generation_check()
        self._path = path
        self._threads = threads
        self._embedder: Any = None
        self.placement = self._placed()
        self._constrainer = spec.Constrainer(self._grammar_tokenizer, self.token_bytes)
        #: speculative drafting (speculation.py): the source a request without spec_source gets,
        #: the most tokens a step drafts, the measured step costs and acceptance, the draft model
        self._spec_default = settings.get("spec_source") or "off"
        self._draft_max = int(settings.get("spec_draft_max") or 64)
        self._adaptive = bool(settings.get("spec_adaptive", True))
        self._costs = speculation.Costs()
        self._prior = {"ngram": 0.6, "draft": 0.6}
        self._draft_replies = 0
        self._drafter: speculation.DraftModel | None = None
        if not self.reranker:
            self.capabilities = attrs.evolve(self.capabilities, speculation=speculation.SOURCES)
            if settings.get("spec_draft_model"):
                self._drafter = speculation.DraftModel(
                    str(settings["spec_draft_model"]), self.llm, n_ctx=min(self._ctx_max, max(self._n_ctx_slot, 8192)),
                    n_batch=self._n_batch, threads=threads, gpu=self.placement.device != "cpu")
                if self._drafter.refused:
                    log.warning("the draft model cannot serve %s: %s", name, self._drafter.refused)

    def _open_placed(self, Llama: Any, path: str, settings: dict[str, Any], options: dict[str, Any],
                     name: str) -> Any:
        """The model loaded with as many of its layers on the GPU as the settings ask and its
        memory holds (placement.py): a load that fails with layers on the GPU is tried again
        with fewer. ``options`` keeps the placement that loaded, for the loads that follow."""
        meta = {}
        try:
            meta = metadata(path)
        except (OSError, ValueError, GGUFError, struct.error):
            pass  # llama.cpp says what is wrong with the file below
        arch = str(meta.get("general.architecture", ""))
        layers = settings.get("n_gpu_layers", -1)
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < -1:
            raise spec.EngineError(f"n_gpu_layers must be -1 (all that fit), 0 or a layer count, not {layers!r}",
                                   code="invalid_setting")
        try:
            split = placement.tensor_split(str(settings.get("tensor_split") or ""))
        except ValueError as exc:
            raise spec.EngineError(str(exc), code="invalid_setting") from None
        main_gpu = int(settings.get("main_gpu") or 0)
        per_token = _kv_bytes_per_token(meta, arch) or 0
        slots = 1 if self.reranker else int(settings.get("n_parallel") or 1)
        plan = placement.plan(layers, path=path, blocks=meta.get(f"{arch}.block_count") if isinstance(
            meta.get(f"{arch}.block_count"), int) else None, kv_bytes=per_token * int(settings["n_ctx"]) * slots,
            split=split, main_gpu=main_gpu)
        used = [d.index for d in plan.devices]
        self._vram_start = placement.vram(used) if plan.tries[0] else None
        failures = []
        for count in plan.tries:
            placed = placement.llama_options(count, split, main_gpu)
            try:
                llm = Llama(model_path=path, n_ctx=settings["n_ctx"], **options, **placed)
            except Exception as exc:
                failures.append(f"{count} GPU layers: {exc}")
                if count:
                    log.warning("%s did not load with %d layers on the GPU (%s); trying fewer", name, count, exc)
                    continue
                raise spec.EngineError(f"llama.cpp could not load {name}: {exc}") from exc
            options.update(placed)
            self._gpu_options = placed
            self._gpus = used if count else []
            self._gpu_plan = attrs.evolve(plan, tries=(count,), note=plan.note if not failures else (
                f"{plan.tries[0]} GPU layers did not load ({failures[0]}); {count} did"))
            return llm
        raise spec.EngineError(f"llama.cpp could not load {name}: {'; '.join(failures)}")

    def _placed(self) -> spec.Placement:
        """Where the model runs, as llama.cpp placed it: on the CPU, or this many of its layers on
        the GPU, and the GPU memory its load took (the free memory's fall, where it is read)."""
        plan = self._gpu_plan
        count = plan.tries[0]
        if not count or not plan.devices:
            return spec.Placement(device="cpu")
        now = placement.vram(self._gpus)
        took = None
        if self._vram_start is not None and now is not None:
            took = max(0, self._vram_start[0] - now[0])
        return spec.Placement(device="gpu", gpu_layers_offloaded=min(count, plan.total),
                              gpu_layers_total=plan.total, vram_bytes=took,
                              devices=tuple(d.name for d in plan.devices), note=plan.note)

    def vram(self) -> tuple[int, int] | None:
        """(free, total) bytes of the GPUs this model was placed on; None on the CPU."""
        return placement.vram(self._gpus) if self._gpus else None

    def _open_projector(self, path: str, settings: dict[str, Any], threads: int) -> tuple[Any, str]:
        """The projector for this model and, without one, why: the load option ``mmproj`` (a
        path; False: none), else one found beside the model file (sdk.gguf.find_projector). A
        projector named by the option that cannot serve this model fails the load; one found
        beside it is only skipped with a warning (a folder may hold another model's), and a
        request with media is told why."""
        import llama_cpp
        chosen = settings.get("mmproj")
        if chosen is False or chosen == "none":
            return None, "its projector is turned off (mmproj: none)"
        found = find_projector(path) if not chosen else Path(str(chosen))
        if found is None:
            return None, "no projector (mmproj) was given for it or found beside it"
        model = self.llm._model.model
        width = (llama_cpp.llama_model_n_embd_inp(model) if hasattr(llama_cpp, "llama_model_n_embd_inp")
                 else llama_cpp.llama_model_n_embd(model))
        try:
            if not found.is_file():
                raise spec.EngineError(f"The projector {found.name} does not exist")
            return vision.Projector(found, model, threads=threads, width=int(width), flash=self._flash,
                                     gpu=bool(self._gpus)), ""
        except spec.EngineError as exc:
            if chosen:
                self.llm.close()
                raise
            log.warning("%s: %s; it serves text only", os.path.basename(path), exc)
            return None, str(exc)

    def _grammar_tokenizer(self) -> Any:
        """The llguidance tokenizer of this vocabulary; its end tokens are the model's end-of-generation ones."""
        import llama_cpp
        from llguidance.llamacpp import lltokenizer_from_vocab
        vocab = self.llm._model.vocab
        n = llama_cpp.llama_vocab_n_tokens(vocab)
        ends = [token for token in range(n) if self._eog(token)] or [self.llm.token_eos()]
        with warnings.catch_warnings():  # it reads each token's attributes through a deprecated alias
            warnings.simplefilter("ignore", DeprecationWarning)
            return lltokenizer_from_vocab(vocab, n_vocab=self._n_vocab, eos_token=ends)

    def _end_of_generation_check(self) -> Any:
        """A fast per-token test for end-of-generation tokens (EOS, end of turn)."""
        import llama_cpp
        vocab = getattr(self.llm._model, "vocab", None)
        if vocab is not None and hasattr(llama_cpp, "llama_vocab_is_eog"):
            is_eog = llama_cpp.llama_vocab_is_eog
            return lambda token: bool(is_eog(vocab, token))
        eos = self.llm.token_eos()
        return lambda token: token == eos

    # --- text ------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        if add_special and parse_special and self._bos_text and text.startswith(self._bos_text):
            add_special = False  # a chat template that writes the BOS itself: never two
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.llm.detokenize(list(ids)).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        import llama_cpp
        vocab = self.llm._model.vocab
        size = 64
        while True:
            buffer = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(vocab, token, buffer, size, 0, True)
            if n >= 0:
                return buffer.raw[:n]
            size = -n  # too small: llama.cpp says how many bytes it needs

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    template_kwargs: dict | None = None) -> str:
        if self._formatter is None:
            raise sdk.LocalmError(400, "This model has no chat template: use /v1/completions",
                                  code="no_chat_template")
        self._formatter.add_generation_prompt = add_generation_prompt
        # a content list (text, image and audio parts) is text with the media marker in it
        if any(isinstance(m.get("content"), list) for m in messages):
            messages = vision.flatten(messages, self.media_marker)
        return self._formatter(messages=messages, **(template_kwargs or {})).prompt

    # --- media -------------------------------------------------------------------------
    async def media_tokens(self, media: spec.Media) -> int:
        """The positions ``media`` takes in a prompt: encoded now by the projector (off the event
        loop, beside the running decodes) and kept for the generate that follows."""
        import asyncio
        projector = self._media_projector(media)
        return (await asyncio.to_thread(projector.encode, media)).tokens

    @property
    def media_device(self) -> str:
        """Where the projector encodes images and sound: ``gpu`` or ``cpu``."""
        return "gpu" if self._projector is not None and self._projector.on_gpu else "cpu"

    def _media_projector(self, media: spec.Media) -> Any:
        """The projector that takes ``media``; EngineError when this model has none for its kind."""
        projector = self._projector
        if projector is None:
            raise spec.EngineError(f"This model takes no images or sounds: {self._no_media}",
                                   code="media_unsupported")
        if (media.kind == "image" and not projector.vision) or (media.kind == "audio" and not projector.audio):
            raise spec.EngineError(f"This model's projector does not take {media.kind}", code="media_unsupported")
        return projector

    # --- generation --------------------------------------------------------------------
    @property
    def busy(self) -> int:
        return self._queue.busy

    @property
    def slots(self) -> int:
        """How many requests the engine decodes at once."""
        return self._slots

    @property
    def active(self) -> int:
        """Requests decoding now."""
        return getattr(self._queue, "active", min(self._queue.busy, 1))

    def _is_eog(self, token: int) -> bool:
        return self._eog(token)

    def _refuse_unless_chat(self) -> None:
        if self.reranker:
            raise sdk.LocalmError(400, "This is a reranker: use /v1/rerank", code="not_a_chat_model")

    def check_constraint(self, constraint: spec.Constraint) -> None:
        self._refuse_unless_chat()
        self._constrainer.check(constraint)

    def generate(self, request: spec.GenerateRequest) -> AsyncIterator[spec.Event]:
        self._refuse_unless_chat()
        return self._queue.generate(request)

    def _mask_processor(self, masker: spec.TokenMasker) -> Any:
        """The grammar's mask over the candidates array llama.cpp's sampler chain has just
        filled from the raw logits in token order (it runs first in the chain: before
        penalties, top-k/p, min-p, temperature and the draw); the logits themselves are left as
        the model wrote them, which is where the log probabilities are read. It runs inside a
        ctypes callback, where an exception would be printed and lost, so a failure is kept on
        the masker instead."""
        import llama_cpp
        import numpy as np
        n_vocab = self._n_vocab
        dtype = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)

        def apply(candidates: Any) -> None:
            try:
                size = candidates.contents.size
                if size != n_vocab:
                    raise RuntimeError(f"llama.cpp offered {size} candidates, not {n_vocab}")
                address = ctypes.addressof(candidates.contents.data.contents)
                rows = np.recarray(shape=(size,), dtype=dtype,
                                   buf=(llama_cpp.llama_token_data * size).from_address(address))
                logits = np.array(rows.logit)
                masker.apply(logits)
                rows.logit[:] = logits
            except Exception as exc:  # noqa: BLE001 - reported through the masker
                masker.error = masker.error or f"the grammar mask failed: {exc}"
        return apply

    def _sampler(self, request: spec.GenerateRequest, masker: spec.TokenMasker | None) -> Any:
        """The request's own sampler chain, as llama-cpp-python builds one: the grammar mask,
        penalties over the last tokens drawn, then greedy, or top-k, typical, top-p, min-p,
        temperature and a draw seeded for this request alone."""
        from llama_cpp import _internals as internals
        s = request.sampling
        chain = internals.LlamaSampler()
        if masker is not None:
            chain.add_custom(self._mask_processor(masker))
        chain.add_penalties(n_vocab=self._n_vocab, penalty_last_n=self.llm.last_n_tokens_size,
                            penalty_repeat=s.repeat_penalty, penalty_freq=s.frequency_penalty,
                            penalty_present=s.presence_penalty)
        seed = s.seed if s.seed is not None else random.randrange(2**31)
        if s.temperature < 0:
            chain.add_dist(seed)
        elif s.temperature == 0:
            chain.add_greedy()
        else:
            chain.add_top_k(s.top_k)
            chain.add_typical(1.0, 1)
            chain.add_top_p(s.top_p, 1)
            chain.add_min_p(s.min_p, 1)
            chain.add_temp(s.temperature)
            chain.add_dist(seed)
        return chain

    #: Draw a greedy request's tokens by numpy's argmax over the logits row instead of the
    #: sampler chain (class attribute: a test compares the two).
    ARGMAX = True

    def _greedy(self, request: spec.GenerateRequest, masker: spec.TokenMasker | None) -> bool:
        """Whether the request's chain (see _sampler) is greedy with nothing before it that
        changes a logit: no grammar and penalties at their neutral values. Its draw is then the
        first highest logit, as llama.cpp's greedy sampler picks it, and numpy's argmax finds
        it in a tenth of the time the chain takes to fill and scan its candidates array (on
        the path between two decodes, where llama.cpp's threads wait)."""
        s = request.sampling
        return self.ARGMAX and masker is None and s.temperature == 0 and s.repeat_penalty == 1.0 \
            and s.frequency_penalty == 0.0 and s.presence_penalty == 0.0

    def _logits_row(self, row: int) -> Any:
        """A view of the logits the last decode wrote for batch row ``row`` (valid until the
        next decode)."""
        import llama_cpp
        import numpy as np
        pointer = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, row)
        if not pointer:
            raise RuntimeError("llama.cpp holds no logits for that token")
        # a view of the n_vocab floats at an address, made once: as_array takes about 50 µs a call,
        # a tenth of a small model's time between two decodes. llama.cpp has just returned this
        # address for this row, so the view reads what it holds now, wherever the buffer moved.
        address = ctypes.cast(pointer, ctypes.c_void_p).value
        view = self._views.get(address)
        if view is None:
            if len(self._views) >= 4 * max(self._n_batch, 64):
                self._views.clear()
            view = self._views[address] = np.ctypeslib.as_array(pointer, shape=(self._n_vocab,))
        return view

    def _piece(self, token: int) -> bytes:
        """The bytes a reply's token adds to it (the detokenized token), kept per token id."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.llm.detokenize([token])
        return piece

    # --- the slots -------------------------------------------------------------------
    def _memory(self) -> Any:
        import llama_cpp
        return llama_cpp.llama_get_memory(self.llm._ctx.ctx)

    def _forget(self, slot: int, keep: int = 0) -> None:
        """Drop slot ``slot``'s cached tokens from position ``keep`` on."""
        import llama_cpp
        llama_cpp.llama_memory_seq_rm(self._memory(), slot, keep, -1)
        del self._slot_tokens[slot][keep:]

    def _keep(self, slot: int, keep: int) -> None:
        """Before slot ``slot``'s cache is cut to ``keep`` tokens: when that drops at least
        ``SAVE_FROM`` tokens of an interactive request's unsteered cache, keep its state in host
        memory, so the conversation it holds is restored instead of read again."""
        tokens = self._slot_tokens[slot]
        if (len(tokens) - keep < SAVE_FROM or self._slot_key[slot] or self._slot_background[slot]
                or not self._cache.budget or self._cache.covers(tokens)):
            return
        data = self._state_of(slot)
        if data is not None:
            self._cache.add(tokens, data)

    def _state_of(self, slot: int) -> Any:
        """llama.cpp's bytes for slot ``slot``'s sequence (None when it cannot give them)."""
        import llama_cpp
        ctx = self.llm._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, slot)
        if size <= 0:
            return None
        buffer = (ctypes.c_uint8 * size)()
        return buffer if llama_cpp.llama_state_seq_get_data(ctx, buffer, size, slot) == size else None

    def _restore(self, slot: int, entry: _Saved) -> bool:
        """Put ``entry``'s state into slot ``slot`` (emptied first); False, with the entry
        dropped, when llama.cpp refuses it."""
        import llama_cpp
        self._forget(slot)
        if llama_cpp.llama_state_seq_set_data(self.llm._ctx.ctx, entry.data, len(entry.data), slot) == 0:
            log.warning("a prompt-cache entry of %d tokens could not be restored; dropped", len(entry.tokens))
            llama_cpp.llama_memory_seq_rm(self._memory(), slot, 0, -1)
            self._cache.drop(entry)
            return False
        self._slot_tokens[slot] = list(entry.tokens)
        self._slot_key[slot] = ()
        self._cache.touch(entry)
        return True

    # --- the persisted prompt cache --------------------------------------------------------
    def _cache_identity(self, path: str, sha256: str | None) -> dict[str, Any]:
        """What a persisted state must have been written for: this model file, this llama.cpp
        and this KV layout."""
        import llama_cpp
        stat = os.stat(path)
        meta = self.llm.metadata
        return {"file": os.path.basename(path), "size": stat.st_size,
                "sha256": sha256 or f"mtime:{stat.st_mtime_ns}", "arch": meta.get("general.architecture", ""),
                "layers": self.capabilities.layers, "hidden": self.capabilities.hidden_size,
                "vocab": self._n_vocab, "flash_attn": self._flash,
                "llama_cpp": getattr(llama_cpp, "__version__", ""),
                # states computed through LoRA adapters are theirs (files, scales)
                **({"adapters": self._adapters.identity} if self._adapters else {}),
                # a picture's cached rows are this projector's output
                **({"mmproj": self._projector.identity} if self._projector is not None else {})}

    def _load_cache(self) -> None:
        """Read the persisted states, newest first, within the cache's budget. A file that is
        damaged or was written for another model is skipped with a warning."""
        import hashlib
        import json
        folder = self._cache_dir
        try:
            names = sorted((e for e in os.scandir(folder) if e.name.endswith(".kv") and e.is_file()),
                           key=lambda e: e.stat().st_mtime, reverse=True)
        except OSError:
            return
        loaded: list[tuple[tuple[int, ...], Any]] = []
        room = self._cache.budget
        for found in names:
            try:
                with open(found.path, "rb") as fh:
                    if fh.read(len(CACHE_MAGIC)) != CACHE_MAGIC:
                        raise ValueError("it is not a prompt-cache file")
                    length = struct.unpack("<I", fh.read(4))[0]
                    if length > 64 * 2**20:
                        raise ValueError("its header is too long")
                    header = json.loads(fh.read(length))
                    if header.get("identity") != self._identity:
                        log.warning("prompt cache %s was written for another model or llama.cpp build; ignored",
                                    found.name)
                        continue
                    size = int(header["size"])
                    tokens = tuple(int(t) for t in header["tokens"])
                    if size > room:
                        continue
                    data = bytearray(size)
                    if fh.readinto(data) != size or fh.read(1):
                        raise ValueError("its length is wrong")
                    if hashlib.sha256(data).hexdigest() != header["sha256"]:
                        raise ValueError("its checksum is wrong")
            except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
                log.warning("prompt cache %s is damaged (%s); ignored", found.name, exc)
                continue
            room -= size
            loaded.append((tokens, (ctypes.c_uint8 * size).from_buffer(data)))
        for tokens, data in reversed(loaded):  # the newest is the most recently used
            self._cache.add(tokens, data)
        if loaded:
            log.info("prompt cache: %d states read from %s", len(loaded), folder)

    def _save_cache(self) -> None:
        """Write the host cache and the slots' unsteered caches to the data dir, newest first,
        within the budget; files of states no longer kept are removed."""
        import hashlib
        import json
        for slot in range(self._slots):
            if self._slot_user[slot] is None:
                self._keep(slot, 0)
        written: set[str] = set()
        room = self._cache.budget
        for entry in reversed(self._cache.entries):
            size = len(entry.data)
            if size > room:
                continue
            room -= size
            view = memoryview(entry.data).cast("B")
            header = json.dumps({"identity": self._identity, "tokens": list(entry.tokens), "size": size,
                                 "sha256": hashlib.sha256(view).hexdigest()}).encode()
            name = hashlib.sha256(json.dumps(entry.tokens).encode()).hexdigest()[:24] + ".kv"
            blob = bytearray(CACHE_MAGIC)
            blob += struct.pack("<I", len(header)) + header
            blob += view
            try:
                atomic_write_bytes(os.path.join(self._cache_dir, name), bytes(blob))
            except OSError as exc:
                log.warning("could not write the prompt cache to %s: %s", self._cache_dir, exc)
                return
            written.add(name)
        try:
            for found in os.scandir(self._cache_dir):
                if found.name.endswith(".kv") and found.name not in written:
                    os.unlink(found.path)
        except OSError:
            pass

    def _new_context(self, per_slot: int, probe: bool = False) -> Any:
        """A context of ``per_slot`` tokens for each slot: one KV stream a sequence, so a
        sequence's numbers never depend on what the other slots hold. ``probe``: with the eval
        callback (every graph node passes through it: only while a probe decodes)."""
        from llama_cpp import _internals as internals
        import llama_cpp
        params = self.llm.context_params
        old = (params.n_ctx, params.n_seq_max, params.kv_unified, params.n_batch, params.flash_attn_type)
        params.n_ctx = per_slot * self._slots
        params.n_seq_max = self._slots
        params.kv_unified = False
        params.n_batch = max(params.n_batch, self._slots)
        # flash attention (llama-server's default): a step of several sequences decodes about a
        # fifth faster on CPU. A row's numbers then depend on how many rows of its sequence a
        # step decodes (llama.cpp's tiled kernel from 64 rows on), so a prompt is always read in
        # the same chunks (see _step) and scoring reads it in them too
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if self._flash \
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.cb_eval = self._eval_callback() if probe else llama_cpp.ggml_backend_sched_eval_callback()
        try:
            fresh = internals.LlamaContext(model=self.llm._model, params=params, verbose=False)
            try:
                self._adapters.apply(fresh.ctx)  # every context computes with the model's LoRA adapters
            except Exception:
                fresh.close()
                raise
            return fresh
        except Exception:
            params.n_ctx, params.n_seq_max, params.kv_unified, params.n_batch, params.flash_attn_type = old
            raise
        finally:  # a later context (the embedder's) is opened without it
            params.cb_eval = llama_cpp.ggml_backend_sched_eval_callback()

    def _eval_callback(self) -> Any:
        """llama.cpp's eval callback, for a probe's context: asked about every node of the
        graph, it claims the outputs of the layers the probe decoding now steers or reads,
        then gets each as it is computed and before the next layer reads it."""
        if self._callback is not None:
            return self._callback
        import llama_cpp
        import numpy as np
        ggml = self._ggml = _Ggml()

        def observe(tensor: int, ask: bool, _data: Any) -> bool:
            reader = self._reader
            if reader is None:
                return False if ask else True
            layer = reader.names.get(ggml.name(tensor))
            if layer is None:
                return False if ask else True
            if ask:
                return True
            try:
                size, rows = ggml.nelements(tensor), ggml.nrows(tensor)
                nbytes = ggml.nbytes(tensor)
                if rows <= 0 or nbytes != size * 4 or size // rows != reader.hidden:
                    raise RuntimeError(f"layer {layer}'s output is not {reader.hidden} float32 columns")
                data = np.empty((rows, size // rows), dtype=np.float32)
                ggml.get(tensor, data.ctypes.data, 0, nbytes)
                if reader.observe(layer, data):
                    ggml.set(tensor, data.ctypes.data, 0, nbytes)
            except Exception as exc:  # noqa: BLE001 - inside a ctypes callback: kept, reported after the decode
                reader.error = reader.error or f"reading layer {layer}: {exc}"
            return True
        self._callback = llama_cpp.ggml_backend_sched_eval_callback(observe)
        return self._callback

    def _set_cvec(self, steer: _Steer | None) -> None:
        """Set the context's control vector to ``steer``'s deltas (None: none); each change
        costs llama.cpp a graph reservation, so an unchanged one is left."""
        key = steer.key if steer is not None else ()
        if key == self._cvec:
            return
        vector = steer.control_vector(self.capabilities.layers) if steer is not None else None
        self._apply_cvec(vector)
        self._cvec = key if vector is not None else ()

    def _apply_cvec(self, vector: tuple[Any, int, int] | None) -> None:
        import llama_cpp
        hidden = self.capabilities.hidden_size
        if vector is None:
            status = llama_cpp.llama_set_adapter_cvec(self.llm._ctx.ctx, None, 0, hidden, -1, -1)
        else:
            buffer, first, last = vector
            pointer = buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            status = llama_cpp.llama_set_adapter_cvec(self.llm._ctx.ctx, pointer, buffer.size, hidden, first, last)
        if status != 0:
            raise RuntimeError(f"llama.cpp could not set the control vector (status {status})")

    def _slot_window(self) -> int:
        import llama_cpp
        ctx = self.llm._ctx.ctx
        if hasattr(llama_cpp, "llama_n_ctx_seq"):
            return int(llama_cpp.llama_n_ctx_seq(ctx))
        return int(llama_cpp.llama_n_ctx(ctx)) // self._slots

    # --- the window ------------------------------------------------------------------
    def _window_for(self, request: spec.GenerateRequest) -> int | None:
        """The window to open before ``request`` (None: the one open will do)."""
        current = self._n_ctx_slot
        need = min(self._ctx_max, max(request.window or 0, _positions(request) + 1))
        if request.num_ctx:
            wanted = min(self._ctx_max, max(request.num_ctx, need, 256))
            return wanted if wanted != current else None
        if need <= current:
            return None
        steps = -(-need // WINDOW_STEP) * WINDOW_STEP
        return min(self._ctx_max, max(steps, 2 * current))

    def _resize(self, n_ctx: int, probe: bool | None = None) -> None:
        """Open every slot's window at ``n_ctx`` tokens on the same weights (with the eval
        callback when ``probe``; None: as it is), keeping each slot's cached prompt (its KV
        cells) where it fits. Runs on the engine's thread while no sequence decodes. The new
        context has no control vector."""
        import llama_cpp
        llm = self.llm
        saved: dict[int, Any] = {}
        for slot, tokens in enumerate(self._slot_tokens):
            kept = min(len(tokens), n_ctx - 1)
            if kept <= 0:
                self._forget(slot)
                continue
            self._forget(slot, kept)
            size = llama_cpp.llama_state_seq_get_size(llm._ctx.ctx, slot)
            buffer = (ctypes.c_uint8 * size)()
            if llama_cpp.llama_state_seq_get_data(llm._ctx.ctx, buffer, size, slot) == size:
                saved[slot] = buffer
        probe = self._probing if probe is None else probe
        fresh = self._new_context(n_ctx, probe)
        llm._ctx.close()
        llm._ctx = fresh
        llm._n_ctx = fresh.n_ctx()
        self._probing = probe
        self._cvec = ()
        for slot, tokens in enumerate(self._slot_tokens):
            buffer = saved.get(slot)
            if buffer is None or not llama_cpp.llama_state_seq_set_data(fresh.ctx, buffer, len(buffer), slot):
                tokens.clear()
                llama_cpp.llama_memory_seq_rm(self._memory(), slot, 0, -1)
        self._n_ctx_slot = self._slot_window()
        self.capabilities = attrs.evolve(self.capabilities, context_window=self._n_ctx_slot)

    # --- the decode loop (on the engine's thread) -----------------------------------------
    def _admit(self, job: spec.Job) -> None:
        request = job.request
        steer = None
        if request.interventions or request.reads:
            try:
                if not self.capabilities.interventions:
                    raise ValueError("This model does not accept interventions or activation reads")
                steer = _Steer(request, self.capabilities.layers, self.capabilities.hidden_size)
            except ValueError as exc:
                self._end(job, "error", str(exc))
                return
        masker, refused = self._constrainer.start(request)
        if refused is not None:
            self._end(job, "error", refused)
            return
        job.state = _Sequence(masker, steer)
        if request.media:
            refused = self._place_media(job.state, request)
            if refused is not None:
                self._end(job, "error", refused)
                return
        job.state.spec = self._speculating(request, steer)
        self._waiting.append(job)

    def _speculating(self, request: spec.GenerateRequest, steer: _Steer | None) -> speculation.Speculating | None:
        """The reply's drafting for the source it asks for (the spec_source setting when it
        names none); None when no source is on. mtp is not here: the chat service reports it
        unavailable (Capabilities.speculation)."""
        source = request.speculation if request.speculation is not None else self._spec_default
        if source not in speculation.SOURCES:
            return None
        state = speculation.Speculating(source, self._prior[source])
        if request.media:
            state.state = "off"
            state.reason = "image" if any(span.media.kind == "image" for span in request.media) else "audio"
        elif steer is not None and steer.probe:
            state.state, state.reason = "off", "activation reads need every row a reply decodes"
        elif source == "draft" and (self._drafter is None or self._drafter.refused):
            state.state = "unavailable"
            state.reason = self._drafter.refused if self._drafter is not None else \
                "draft-model-missing: no spec_draft_model is set"
        elif source == "draft" and self._adaptive:
            # a draft model measured not to pay in the last replies (its agreement carries over):
            # one reply in eight probes it again; the others do not pay its reading of the prompt
            self._draft_replies += 1
            if self._prior["draft"] < DRAFT_WORTH and self._draft_replies % 8:
                state.probes_left = 0
        return state

    def _place_media(self, seq: _Sequence, request: spec.GenerateRequest) -> str | None:
        """Put the request's media in its prompt (``seq.positions``, ``seq.media``): each encoded
        by now (media_tokens), else here. The refusal's message when it cannot be."""
        spans = request.media
        if any(not 0 <= span.at <= len(request.prompt) for span in spans) or \
                any(a.at > b.at for a, b in zip(spans, spans[1:])):
            return "The media spans must be in order, each within the prompt"
        encoded = []
        for span in spans:
            try:
                media = self._media_projector(span.media).encode(span.media)
            except spec.EngineError as exc:
                return str(exc)
            if media.tokens != span.tokens:
                return (f"A media span says it takes {span.tokens} positions; this model's projector gives "
                        f"{media.tokens}")
            encoded.append(media)
        limit = min(self._n_batch, self._ubatch())
        for media in encoded:
            for piece in media.pieces:
                if piece.non_causal and len(piece.ids) > limit:
                    return (f"A picture takes {len(piece.ids)} positions, which this model reads in one batch; "
                            f"the batch holds {limit} (raise n_batch)")
        seq.positions = vision.expand(request.prompt, spans, encoded)
        seq.media = {key: value for media in encoded for key, value in media.rows.items()}
        return None

    def _ubatch(self) -> int:
        import llama_cpp
        return int(llama_cpp.llama_n_ubatch(self.llm._ctx.ctx))

    def _take(self) -> None:
        """Move waiting requests into free slots, in order: each to the free slot whose cache
        shares the longest prefix with its prompt (the least recently used on a tie)."""
        while self._waiting:
            job = self._waiting[0]
            if job.cancelled.is_set():
                self._waiting.popleft()
                self._end(job, "cancelled")
                continue
            free = [slot for slot, user in enumerate(self._slot_user) if user is None]
            if not free:
                return
            request = job.request
            steer: _Steer | None = job.state.steer
            key, probe = (steer.key, steer.probe) if steer is not None else ((), False)
            # requests decode together under one control vector; a probe decodes alone
            if self._running and (probe or self._mode_probe or key != self._mode):
                return
            wanted = self._window_for(request)
            if wanted is not None:
                if self._running:  # the window changes between batches: after the running ones end
                    return
                try:
                    self._resize(wanted, probe)
                except Exception as exc:  # noqa: BLE001 - the window it has still serves
                    log.warning("could not open a context of %d tokens a slot: %s", wanted, exc)
            if not self._running:
                try:
                    if probe != self._probing:
                        self._resize(self._n_ctx_slot, probe)
                    self._set_cvec(None if probe else steer)
                except Exception as exc:  # noqa: BLE001 - this request fails, the context serves on
                    self._waiting.popleft()
                    self._end(job, "error", f"llama.cpp could not steer this request: {exc}")
                    continue
                self._mode, self._mode_probe = key, probe
            self._waiting.popleft()
            seq: _Sequence = job.state
            prompt = request.prompt if seq.positions is None else seq.positions
            if not prompt:
                self._end(job, "error", "The prompt is empty")
                continue
            if len(prompt) >= self._n_ctx_slot:
                self._end(job, "error", f"The prompt is {len(prompt)} tokens; the context window is "
                                        f"{self._n_ctx_slot} tokens")
                continue
            reuse = request.cache_prompt and not (steer is not None and steer.reads)  # a read needs every row
            prefix = {candidate: _shared_prefix(self._slot_tokens[candidate], prompt)
                      if reuse and self._slot_key[candidate] == key else 0 for candidate in free}
            slot = _pick_slot(prefix, [user is not None for user in self._slot_user], self._slot_used,
                              {candidate: len(self._slot_tokens[candidate]) for candidate in free})
            shared = prefix[slot]
            entry, kept = self._cache.best(prompt) if reuse and not key and self._cache.entries else (None, 0)
            if entry is not None and _worth_restoring(kept, shared, len(entry.tokens)) \
                    and len(entry.tokens) < self._n_ctx_slot:
                self._keep(slot, 0)
                if self._restore(slot, entry):
                    shared = kept
                else:
                    shared = 0
            else:
                self._keep(slot, shared)
            shared = min(shared, len(prompt) - 1)  # the last prompt token is decoded again for its logits
            if seq.media and 0 < shared < len(prompt) and prompt[shared] in seq.media:
                shared -= seq.media[prompt[shared]][1]  # a picture is decoded from its first row
            self._forget(slot, max(shared, 0))
            self._slot_key[slot] = key
            seq.cached = max(shared, 0)
            seq.slot = slot
            seq.feed = list(prompt[len(self._slot_tokens[slot]):])
            if seq.spec is not None and seq.spec.state is None:
                seq.spec.history = list(prompt)  # what drafts are drawn from, with the reply as it grows
            seq.started = time.perf_counter()
            seq.greedy = self._greedy(request, seq.masker)
            seq.sampler = None if seq.greedy else self._sampler(request, seq.masker)
            self._slot_user[slot] = job
            self._running.append(job)

    def _step(self, jobs: list[spec.Job]) -> None:
        """One step: every sequence past its prompt feeds its last token, all in one batch; then
        prompts are read, up to ``n_batch`` tokens in all, in arrival order; each sequence whose
        prompt is done draws its next token.

        A prompt is read in chunks of ``n_batch`` tokens from where its cache ends, each chunk in
        a decode of its own: llama.cpp splits a batch holding several sequences into equal shares
        of each, and with flash attention a row's numbers depend on how many rows of its sequence
        are decoded together. Read the same way alone, beside others and when scored, a prompt
        gives the same numbers on every path."""
        for job in list(self._running):
            if job.cancelled.is_set():
                self._end(job, "cancelled")
        for job in [job for job in self._waiting if job.cancelled.is_set()]:  # one behind a window change
            self._waiting.remove(job)
            self._end(job, "cancelled")
        self._take()
        for _ in range(self._slots):  # requests that arrived while this step took the others in
            if not self._queue.arrivals():
                break
            self._take()
        if not self._running:
            return
        if len(self._running) == 1:
            seq = self._running[0].state
            if seq.spec is not None and seq.spec.state is None and not seq.prompting and seq.feed \
                    and self._speculate(self._running[0]):
                return
        else:
            for job in self._running:
                if job.state.spec is not None and not job.state.prompting:
                    job.state.spec.shared += 1
        # in slot order: over one KV stream a sequence, llama.cpp puts in one ubatch only
        # sequences whose ids follow each other in the batch (2, 3, 0, 1 would be two passes)
        drawing = sorted(((job, job.state.feed[:1]) for job in self._running
                          if not job.state.prompting and job.state.feed), key=lambda item: item[0].state.slot)
        groups = [drawing] if drawing else []
        budget = self._n_batch
        together: list[tuple[spec.Job, list[int]]] = []
        for job in self._running:
            seq: _Sequence = job.state
            if not seq.prompting or not seq.feed:
                continue
            chunk = seq.feed[:self._n_batch] if seq.media is None else self._media_chunk(seq)
            if len(chunk) > budget and budget < self._n_batch:  # the next step reads it whole
                break
            if len(chunk) < TOGETHER_BELOW and chunk[0] >= 0 and not (seq.steer is not None and seq.steer.probe):
                together.append((job, chunk))
            else:
                groups.append([(job, chunk)])
            budget -= len(chunk)
            if budget <= 0:
                break
        if together:  # short prompt chunks, read in one decode, in slot order (see TOGETHER_BELOW)
            groups.append(sorted(together, key=lambda item: item[0].state.slot))
        if not groups:  # nothing to decode: never the case, but a job must not wait for ever
            for job in list(self._running):
                self._end(job, "error", "The engine had nothing to decode for this request")
            return
        for group in groups:
            self._decode(group)

    def _speculate(self, job: spec.Job) -> bool:
        """One step of a reply decoding alone, with a draft (speculation.py): decode its last
        token and the draft in one batch, draw each row in order with the reply's sampler while
        the token drawn is the one drafted, and drop the rest of the draft from the cache.
        False when this step decodes one token as usual (no draft, or drafting does not pay
        now)."""
        import llama_cpp
        seq: _Sequence = job.state
        state = seq.spec
        costs = self._costs
        if not costs.known and self._adaptive:  # one-token steps are measured first
            return False
        request = job.request
        room = self._n_ctx_slot - len(self._slot_tokens[seq.slot]) - 2
        if request.sampling.max_tokens is not None:
            room = min(room, request.sampling.max_tokens - seq.n - 1)
        most = min(self._draft_max, room, self._n_batch - 1)
        if most < 1:
            return False
        per_draft = 0.0
        if state.source == "ngram":
            if state.ngrams is None:
                state.ngrams = speculation.Ngrams(state.history)
            candidate, match = state.ngrams.draft(most)
            if not candidate:
                return False
            loop = state.ngrams.loop
            if loop:  # a loop's acceptance is measured apart from copies'
                match = speculation.LOOP
            length = state.length(costs, len(candidate), match, self._adaptive, candidate[0], most, loop)
        elif self._adaptive:
            match = 0
            per_draft = costs.draft_token if costs.draft_token is not None else 0.1 * costs.of(1)
            length, _ = costs.best(state.acceptance(), min(most, speculation.DRAFT_MOST), per_draft)
        else:
            match, length = 0, most
        probing = length == 0
        if probing:
            if not state.paused():
                return False
            length = 2  # now and then a short draft, to see whether the text turned repetitive
        if state.source == "ngram":
            draft = candidate[:length]
        else:
            draft = self._drafter.draft(state.history, length, costs)
            if not draft:
                return False
        for i, token in enumerate(draft):
            if self._is_eog(token):  # the reply ends there if it is kept: nothing after it is
                draft = draft[:i + 1]
                break
        slot = seq.slot
        fed = seq.feed[:1] + draft
        at = len(self._slot_tokens[slot])
        batch = self._batch
        for i, token in enumerate(fed):
            batch.token[i] = token
            batch.pos[i] = at + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = slot
            batch.logits[i] = True
        batch.n_tokens = len(fed)
        started = time.perf_counter()
        status = llama_cpp.llama_decode(self.llm._ctx.ctx, batch)
        if status != 0:
            self._forget(slot, at)
            return False  # decoded again without the draft
        costs.add(len(fed), time.perf_counter() - started)
        self._slot_tokens[slot].extend(fed)
        seq.feed = []
        kept = 0
        state.checking(len(draft), match)  # counted even if the reply ends on one of the rows
        for row in range(len(fed)):
            token, going = self._draw(job, row, draft[row] if row < len(draft) else None)
            if row < len(draft) and token == draft[row]:
                kept += 1
                if going:
                    continue
            break
        self._forget(slot, at + 1 + kept)  # the rejected tail's cells
        state.settle()
        if probing:
            state.probed(kept)
        return True

    def _media_chunk(self, seq: _Sequence) -> list[int]:
        """The next chunk of a prompt holding media: up to ``n_batch`` text tokens before the next
        media row, or up to ``n_batch`` consecutive rows of one piece (a non-causal piece whole,
        as _place_media checked it fits)."""
        feed, media, limit = seq.feed, seq.media, self._n_batch
        found = media.get(feed[0])
        if found is None:
            n = 0
            for token in feed[:limit]:
                if token < 0:
                    break
                n += 1
            return feed[:n]
        piece, row = found
        return feed[:min(limit, len(piece.ids) - row)]

    def _decode(self, group: list[tuple[spec.Job, list[int]]]) -> None:
        """Decode each job's ``tokens`` in one batch, then draw for each job whose feed that ends.
        A media's rows (negative ids, see _media_chunk) come in a group of their own."""
        import llama_cpp
        gaps: list[tuple[int, int]] = []
        if group[0][1][0] < 0:
            batch, rows, reader, non_causal = self._fill_media(*group[0])
        else:
            batch, rows, reader, non_causal = self._fill_tokens(group)
            if len(group) > 1 and all(len(take) == 1 for _, take in group):
                gaps, moved = self._fill_gaps(batch)
                rows = [(job, moved.get(row, row)) for job, row in rows]
        self._reader = reader
        ctx = self.llm._ctx.ctx
        if non_causal:
            llama_cpp.llama_set_causal_attn(ctx, False)
        # one reply's one-token step: what drafting is measured against
        alone = len(group) == 1 and len(group[0][1]) == 1 and not group[0][0].state.prompting \
            and len(self._running) == 1
        started = time.perf_counter()
        try:
            status = llama_cpp.llama_decode(ctx, batch)
        finally:
            self._reader = None
            if non_causal:
                llama_cpp.llama_set_causal_attn(ctx, True)
        if alone and status == 0:
            self._costs.add(1, time.perf_counter() - started)
        for slot, at in gaps:  # the stand-ins' cells
            llama_cpp.llama_memory_seq_rm(self._memory(), slot, at, -1)
        if status == 0 and reader is not None and reader.error:
            status = reader.error
        if status != 0:
            for job, _ in group:
                self._forget(job.state.slot)
                self._end(job, "error", f"llama.cpp could not decode the batch (status {status})"
                          if isinstance(status, int) else f"llama.cpp could not steer this request: {status}")
            return
        for job, take in group:
            seq = job.state
            self._slot_tokens[seq.slot].extend(take)
            del seq.feed[:len(take)]
        for job, row in rows:
            self._draw(job, row)

    def _fill_tokens(self, group: list[tuple[spec.Job, list[int]]]) -> tuple[Any, list[tuple[spec.Job, int]],
                                                                          _Steer | None, bool]:
        """The token batch of ``group``: the batch, the rows to draw after (a job whose feed it
        ends), the probe reading it (None) and False (causal)."""
        batch = self._batch
        n = 0
        rows: list[tuple[spec.Job, int]] = []
        reader: _Steer | None = None
        for job, take in group:
            seq: _Sequence = job.state
            pos = len(self._slot_tokens[seq.slot])
            every = False
            if seq.steer is not None and seq.steer.probe:  # it decodes alone (see _take)
                reader = seq.steer
                every = reader.every_row
            for i, token in enumerate(take):
                batch.token[n] = token
                batch.pos[n] = pos + i
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq.slot
                batch.logits[n] = every
                n += 1
            if len(take) == len(seq.feed):  # its last token: draw after it
                batch.logits[n - 1] = True
                rows.append((job, n - 1))
        batch.n_tokens = n
        return batch, rows, reader, False

    def _fill_gaps(self, batch: Any) -> tuple[list[tuple[int, int]], dict[int, int]]:
        """Give a one-token-a-sequence batch (a step's draws, in slot order) a stand-in row for
        each slot missing between its first and last: with one KV stream a slot, llama.cpp puts
        in one pass only sequences whose ids follow each other in the batch (llama-batch.cpp,
        split_equal), so a reply ending in a middle slot would cost every later step a second
        pass over the weights. A stand-in is one row at the free slot's next position, with no
        logits, and its cell is dropped after the decode (the slot's cache is left as it was).
        The (slot, position) of each stand-in, and where the batch's rows moved."""
        n = batch.n_tokens
        present = [batch.seq_id[i][0] for i in range(n)]
        missing = [slot for slot in range(present[0] + 1, present[-1]) if slot not in present]
        if not missing or n + len(missing) > self._n_batch:
            return [], {}
        old = [(batch.token[i], batch.pos[i], batch.seq_id[i][0], batch.logits[i], i) for i in range(n)]
        rows, gaps = [], []
        for slot in missing:
            at = len(self._slot_tokens[slot])
            if at >= self._n_ctx_slot - 1:
                return [], {}
            tokens = self._slot_tokens[slot]
            rows.append((tokens[-1] if tokens else 0, at, slot, False, -1))
            gaps.append((slot, at))
        moved = {}
        for i, (token, pos, slot, logits, was) in enumerate(sorted(old + rows, key=lambda row: row[2])):
            if was >= 0:
                moved[was] = i
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = slot
            batch.logits[i] = logits
        batch.n_tokens = n + len(rows)
        return gaps, moved

    def _fill_media(self, job: spec.Job, take: list[int]) -> tuple[Any, list[tuple[spec.Job, int]],
                                                                    _Steer | None, bool]:
        """The embedding batch of ``take``: consecutive rows of one piece of a media (see
        _media_chunk), at the slot's next positions, as _fill_tokens gives a token batch; the
        last flag says the rows attend to each other both ways."""
        import llama_cpp
        seq: _Sequence = job.state
        piece, first = seq.media[take[0]]
        width = piece.embd.shape[1]
        if self._media_batch is None:
            self._media_batch = llama_cpp.llama_batch_init(self._n_batch, width, 1)
        batch = self._media_batch
        n = len(take)
        ctypes.memmove(batch.embd, piece.embd[first:first + n].ctypes.data, n * width * 4)
        pos = len(self._slot_tokens[seq.slot])
        reader = seq.steer if seq.steer is not None and seq.steer.probe else None
        every = reader is not None and reader.every_row
        for i in range(n):
            batch.pos[i] = pos + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq.slot
            batch.logits[i] = every
        rows = []
        if n == len(seq.feed):  # a prompt that ends with a media: draw after its last row
            batch.logits[n - 1] = True
            rows.append((job, n - 1))
        batch.n_tokens = n
        return batch, rows, reader, piece.non_causal

    def _draw(self, job: spec.Job, row: int, drafted: int | None = None) -> tuple[int, bool]:
        """Draw the sequence's next token from its logits at batch row ``row`` and emit it:
        the token, and whether the reply goes on (its feed is then that token). A row checking
        the ``drafted`` token counts it kept when that is the token drawn."""
        seq: _Sequence = job.state
        request = job.request
        if seq.greedy:
            token = int(self._logits_row(row).argmax())
        else:
            token = seq.sampler.sample(self.llm._ctx, row)
        if drafted is not None and token == drafted:
            seq.spec.keep()
        seq.prompting = False
        if seq.first is None:
            seq.first = time.perf_counter()
        if job.cancelled.is_set():
            self._end(job, "cancelled")
            return token, False
        if self._is_eog(token):
            self._end(job, "stop")
            return token, False
        masker = seq.masker
        if masker is not None and not masker.accept(token):
            self._end(job, "error", f"The output left the grammar: {masker.error}")
            return token, False
        seq.n += 1
        if seq.spec is not None:
            seq.spec.history.append(token)
            if seq.spec.ngrams is not None:
                seq.spec.ngrams.extend((token,))
        text = seq.decoder.decode(self._piece(token))
        if request.logprobs is not None:
            logprob, top = spec.logprob_entry(self._logits_row(row), token, request.logprobs)
            job.emit(spec.Token(id=token, text=text, logprob=logprob, top=top))
        else:
            job.emit(spec.Token(id=token, text=text))
        if masker is not None and masker.finished:
            self._end(job, "stop")
        elif (request.sampling.max_tokens is not None and seq.n >= request.sampling.max_tokens) \
                or (len(request.prompt) if seq.positions is None else len(seq.positions)) + seq.n \
                >= self._n_ctx_slot:
            self._end(job, "length")
        else:
            seq.feed = [token]
            return token, True
        return token, False

    def _end(self, job: spec.Job, reason: spec.FinishReason, error: str | None = None) -> None:
        """Free the job's slot (its cache stays for a follow-up), then emit its Finished."""
        seq: _Sequence | None = job.state
        ended = time.perf_counter()
        n, first, started = 0, ended, ended
        if seq is not None:
            if seq.slot is not None and self._slot_user[seq.slot] is job:
                self._slot_user[seq.slot] = None
                self._slot_used[seq.slot] = time.monotonic()
                self._slot_background[seq.slot] = job.request.background
            if job in self._running:
                self._running.remove(job)
            if seq.sampler is not None:
                seq.sampler.close()
                seq.sampler = None
            n, started = seq.n, seq.started or ended
            first = seq.first or ended
        activations = seq.steer.activations() if seq is not None and seq.steer is not None else None
        report = None
        if seq is not None and seq.spec is not None:
            spec_state = seq.spec
            if spec_state.verified and spec_state.source == "draft":  # how well the draft model agrees:
                self._prior["draft"] = 0.5 * self._prior["draft"] + 0.5 * spec_state.overall  # the next starts there
            report = spec_state.report(self._adaptive and self._costs.can_pay(
                spec_state.source, min(self._draft_max, speculation.DRAFT_MOST)) is False)
            if report["state"] == "on" and spec_state.source == "draft" and self._drafter is not None \
                    and self._drafter.on_cpu:
                report["reason"] = "draft-on-cpu"
        job.emit(spec.Finished(reason=reason, prompt_tokens=_positions(job.request), completion_tokens=n,
                               prompt_seconds=max(0.0, first - started), generate_seconds=ended - first, error=error,
                               activations=activations, cached_tokens=seq.cached if seq is not None else 0,
                               speculation=report))

    def _abort(self) -> None:
        """After a failed step: every slot empty and free, nothing waiting."""
        import llama_cpp
        llama_cpp.llama_memory_clear(self._memory(), True)
        for tokens in self._slot_tokens:
            tokens.clear()
        self._slot_key = [() for _ in range(self._slots)]
        self._slot_background = [False] * self._slots
        for job in list(self._running) + list(self._waiting):
            if job.state is not None and job.state.sampler is not None:
                job.state.sampler.close()
                job.state.sampler = None
        self._slot_user = [None] * self._slots
        self._running.clear()
        self._waiting.clear()

    def _decode_alone(self, slot: int, ids: list[int]) -> int:
        """Decode ``ids`` into slot ``slot`` from an empty cache, in batches of n_batch; the
        batch row of the last token's logits."""
        import llama_cpp
        self._forget(slot)
        batch = self._batch
        row = -1
        for start in range(0, len(ids), self._n_batch):
            chunk = ids[start:start + self._n_batch]
            for i, token in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = slot
                batch.logits[i] = start + i == len(ids) - 1
            batch.n_tokens = len(chunk)
            status = llama_cpp.llama_decode(self.llm._ctx.ctx, batch)
            if status != 0:
                self._forget(slot)
                raise RuntimeError(f"llama.cpp could not decode the prompt (status {status})")
            self._slot_tokens[slot].extend(chunk)
            row = len(chunk) - 1
        return row

    async def embed(self, texts: list[str]) -> list[list[float]]:
        """Mean-pooled, normalised hidden states, from a second context opened for embeddings."""
        if self.reranker:
            raise sdk.LocalmError(422, "This is a reranker: use /v1/rerank", code="not_an_embedding_model")
        return await self._queue.call(self._embed, texts)

    def _embed(self, texts: list[str]) -> list[list[float]]:
        import llama_cpp
        if self._embedder is None:
            window = self._n_ctx_slot
            self._embedder = llama_cpp.Llama(model_path=self._path, embedding=True, n_ctx=window,
                                             n_threads=self._threads, n_batch=window,
                                             pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, verbose=False,
                                             **self._gpu_options)
            if self._adapters:  # it embeds as the model it serves: with the same LoRA adapters
                try:
                    lora.attach(self._embedder, self._adapters.applied)
                except spec.EngineError as exc:
                    self._embedder.close()
                    self._embedder = None
                    raise sdk.LocalmError(500, f"llama.cpp could not embed with the model's LoRA adapters: {exc}",
                                          code="embedding_failed") from exc
        window = self._embedder.n_ctx()
        for text in texts:
            size = len(self._embedder.tokenize(text.encode("utf-8"), add_bos=False))
            if size == 0:  # llama.cpp cannot decode an empty batch
                raise sdk.LocalmError(400, "An input is empty: there is nothing to embed", code="empty_input")
            if size > window:
                raise sdk.LocalmError(413, f"An input is {size} tokens; the model embeds at most {window}",
                                      code="context_length_exceeded")
        try:
            return [[float(x) for x in v] for v in self._embedder.embed(texts, normalize=True)]
        except Exception as exc:  # a failed pass leaves nothing behind: the next opens afresh
            self._embedder.close()
            self._embedder = None
            raise sdk.LocalmError(500, f"llama.cpp could not embed the input: {exc}", code="embedding_failed") from exc

    async def next_token_logits(self, prompt: Sequence[int]) -> Any:
        self._refuse_unless_chat()
        ids = list(prompt)
        if not ids:
            raise sdk.LocalmError(400, "The prompt is empty")
        if len(ids) > self._ctx_max:
            raise sdk.LocalmError(413, f"The prompt is {len(ids)} tokens; the context window is {self._ctx_max}",
                                  code="context_length_exceeded")
        return await self._queue.call(self._logits_after, ids)

    def _logits_after(self, ids: list[int]) -> Any:
        """One pass over ``ids`` from an empty cache, in the least recently used slot. Runs alone.
        The slot is left empty: a generation over a reused cache decodes its last prompt token
        on its own, which computes slightly other numbers than a fresh pass, and a generation
        after scoring must compute what a fresh one does."""
        if len(ids) > self._n_ctx_slot:
            self._resize(self._window_for(spec.GenerateRequest(prompt=tuple(ids))) or len(ids))
        # the slot whose cache loses least (a conversation's is kept in host memory first)
        slot = min(range(self._slots), key=lambda i: (len(self._slot_tokens[i]), self._slot_used[i]))
        self._keep(slot, 0)
        self._set_cvec(None)  # scoring is never steered (the next steered request sets its vector again)
        try:
            row = self._decode_alone(slot, ids)
            return self._logits_row(row).copy()
        finally:
            self._forget(slot)
            self._slot_key[slot] = ()

    async def next_token_logprobs(self, prompt: Sequence[int]) -> list[float]:
        import numpy as np
        logits = (await self.next_token_logits(prompt)).astype(np.float64)
        logits -= logits.max()
        logits -= np.log(np.exp(logits).sum())
        return logits.tolist()

    # --- reranking -------------------------------------------------------------------
    def _pair(self, query: list[int] | str, document: list[int] | str) -> list[int]:
        """A (query, document) pair as llama-server's rerank formats it: the model's rerank
        template with {query} and {document} filled in (tokenised with special tokens), or
        [BOS] query [EOS] [SEP] document [EOS], each special as the vocabulary asks for it."""
        import llama_cpp
        llm = self.llm
        if self._rerank_template:
            prompt = self._rerank_template.replace("{query}", str(query)).replace("{document}", str(document))
            return llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        vocab = llm._model.vocab

        def flag(name: str, default: bool) -> bool:
            fn = getattr(llama_cpp, name, None)
            return bool(fn(vocab)) if fn is not None else default

        eos = llm.token_eos()
        sep = llama_cpp.llama_vocab_sep(vocab)
        if eos == llama_cpp.LLAMA_TOKEN_NULL:
            eos = sep
        out = [llm.token_bos()] if flag("llama_vocab_get_add_bos", True) else []
        out += list(query)
        if flag("llama_vocab_get_add_eos", True):
            out.append(eos)
        if flag("llama_vocab_get_add_sep", True):
            out.append(sep)
        out += list(document)
        if flag("llama_vocab_get_add_eos", True):
            out.append(eos)
        return out

    def _words(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    async def rerank(self, query: str, documents: list[str]) -> list[spec.Ranked]:
        """One score per document: the classifier head over the formatted (query, document)
        pair, the document cut to fit the window. One pair a pass."""
        if not self.reranker:
            raise sdk.LocalmError(422, "This model is not a reranker", code="not_a_reranker")
        window = self._window
        fixed = len(self._pair(query if self._rerank_template else self._words(query),
                               "" if self._rerank_template else []))
        if fixed + RERANK_MIN_DOCUMENT_TOKENS > window:
            raise sdk.LocalmError(400, f"The query takes {fixed} tokens with the special ones; this reranker reads "
                                       f"{window} tokens, which must hold them and at least "
                                       f"{RERANK_MIN_DOCUMENT_TOKENS} tokens of each document",
                                  code="query_too_long")
        return await self._queue.call(self._rerank, query, list(documents))

    def _rerank(self, query: str, documents: list[str]) -> list[spec.Ranked]:
        window = self._window
        templated = bool(self._rerank_template)
        asked = self._words(query)

        def pair(words: list[int], text: str | None = None) -> list[int]:
            if not templated:
                return self._pair(asked, words)
            if text is None:
                text = self.llm.detokenize(words).decode("utf-8", errors="ignore")
            return self._pair(query, text)

        out = []
        for document in documents:
            words = self._words(document)
            tokens = pair(words, document)
            truncated = len(tokens) > window
            while len(tokens) > window and words:  # cut the document, never the query
                words = words[:len(words) - (len(tokens) - window)]
                tokens = pair(words)
            tokens = tokens[:window]
            scores = self._rank(tokens)
            out.append(spec.Ranked(score=scores[0], label_scores=tuple(scores) if len(scores) > 1 else None,
                                   truncated=truncated, tokens=len(tokens)))
        return out

    def _rank(self, tokens: list[int]) -> list[float]:
        """The classifier head's outputs for one sequence (llama.cpp's rank pooling)."""
        import llama_cpp
        llm = self.llm
        llm._ctx.kv_cache_clear()
        llm._batch.reset()
        llm._batch.add_sequence(tokens, 0, True)
        llm._ctx.decode(llm._batch)
        llm._batch.reset()
        count = 1
        if hasattr(llama_cpp, "llama_model_n_cls_out"):
            count = max(1, int(llama_cpp.llama_model_n_cls_out(llm.model)))
        pointer = llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)
        if not pointer:
            raise RuntimeError("llama.cpp returned no score for the pair")
        return [float(pointer[i]) for i in range(count)]

    def close(self) -> None:
        import llama_cpp
        self._queue.close()
        if self._batch is not None and self._cache_dir and self._cache.budget:
            try:
                self._save_cache()
            except Exception as exc:  # noqa: BLE001 - a cache that cannot be written is only lost
                log.warning("could not save the prompt cache: %s", exc)
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
            self.llm._ctx.close()  # the slots' context (the one llama-cpp-python opened is closed already)
        if self._media_batch is not None:
            llama_cpp.llama_batch_free(self._media_batch)
            self._media_batch = None
        if self._drafter is not None:
            self._drafter.close()
        if self._projector is not None:  # before the model it reads
            self._projector.close()
        if self._adapters:  # off the contexts, before the model (lora.py)
            if self.reranker:  # its context is llama-cpp-python's own, still open
                self._adapters.clear(self.llm._ctx.ctx)
            self._adapters.close()
        for llm in (self.llm, self._embedder):
            if llm is not None and hasattr(llm, "close"):
                llm.close()


@sdk.hookimpl
def register_settings(register):
    register(Settings)


@sdk.hookimpl
def register_engines(register, plugin):
    def load(entry: Any, options: dict[str, Any]) -> LlamaEngine:
        settings = {**plugin.settings, **options, "sha256": getattr(entry, "sha256", None)}
        paired = (getattr(entry, "capabilities", None) or {}).get("projector")
        if paired and "mmproj" not in options:  # registered with localm pull --mmproj
            settings["mmproj"] = paired
        if getattr(entry, "adapters", None) and "adapters" not in options:  # pull --lora, a Modelfile's ADAPTER
            settings["adapters"] = [dict(a) for a in entry.adapters]
        if settings.get("cache_persist"):
            name = "".join(c if c.isalnum() or c in "-_." else "_" for c in entry.id).lstrip(".") or "model"
            settings["cache_dir"] = str(plugin.data_dir / "prompt-cache" / name)
        return LlamaEngine(entry.path, settings, getattr(entry, "role", "chat"))

    register("llamacpp", load, formats=["gguf"])
