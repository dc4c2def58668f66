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
import threading
import time
import warnings
from typing import Any, AsyncIterator, Sequence

import attrs

from localm import sdk
from localm.sdk import engines as spec

log = logging.getLogger("localm.plugin.llamacpp")

@attrs.frozen
class Settings:
    n_ctx: int = sdk.setting(4096, min=256, description="The context window a model opens at, in tokens; it grows "
                                                        "on demand up to n_ctx_max")
    n_ctx_max: int = sdk.setting(0, min=0, description="The most tokens the context window grows to (0: the context "
                                                       "the model was trained for), within ctx_memory_mb")
    ctx_memory_mb: int = sdk.setting(4096, min=16, description="The memory a model's context (its KV cache) may take "
                                                               "as it grows, in MiB")
    n_threads: int = sdk.setting(0, min=0, description="CPU threads for generation (0: one per core)")
    n_batch: int = sdk.setting(512, min=1, description="Prompt tokens processed per step")


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


def _tensor_names(path: str) -> set[str]:
    """The tensor names of a GGUF file, read from its index (no weight is read)."""
    scalars = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def read(fh: Any, fmt: str) -> Any:
        data = fh.read(struct.calcsize(fmt))
        if len(data) != struct.calcsize(fmt):
            raise ValueError("the GGUF header is truncated")
        return struct.unpack(fmt, data)[0]

    def skip(fh: Any, kind: int) -> None:
        if kind in scalars:
            fh.seek(scalars[kind], 1)
        elif kind == 8:  # a string
            fh.seek(read(fh, "<Q"), 1)
        elif kind == 9:  # an array
            item, count = read(fh, "<I"), read(fh, "<Q")
            if item in scalars:
                fh.seek(scalars[item] * count, 1)
            else:
                for _ in range(count):
                    skip(fh, item)
        else:
            raise ValueError(f"unknown GGUF value type {kind}")

    names: set[str] = set()
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        read(fh, "<I")  # version
        tensors, kv_count = read(fh, "<Q"), read(fh, "<Q")
        for _ in range(kv_count):
            skip(fh, 8)  # the key
            skip(fh, read(fh, "<I"))
        for _ in range(tensors):
            names.add(fh.read(read(fh, "<Q")).decode("utf-8", errors="replace"))
            fh.seek(8 * read(fh, "<I") + 4 + 8, 1)  # dimensions, type, offset
    return names


class LlamaEngine:
    engine = "llamacpp"

    def __init__(self, path: str, settings: dict[str, Any], role: str = "chat") -> None:
        try:
            import llama_cpp
            from llama_cpp import Llama
        except ImportError as exc:  # the plugin only activates with it installed; a broken build lands here
            raise spec.EngineError(f"llama-cpp-python cannot be imported: {exc}") from exc
        threads = settings["n_threads"] or os.cpu_count() or 1
        self.role = role
        self.reranker = role == "reranker"
        name = os.path.basename(path)
        options: dict[str, Any] = {"n_threads": threads, "n_threads_batch": threads, "n_batch": settings["n_batch"],
                                   "verbose": False}
        if self.reranker:
            try:
                head = set(CLASSIFIER_TENSORS) & _tensor_names(path)
            except (OSError, ValueError) as exc:
                raise spec.EngineError(f"llama.cpp could not read {name}: {exc}") from exc
            if not head:  # llama.cpp would abort the process on the first pass
                raise spec.EngineError(f"{name} has no classifier head (no {' or '.join(CLASSIFIER_TENSORS)} "
                                       "tensor)", code="no_classifier_head")
            # an encoder reads a whole pair in one pass: the batch is the window
            options.update(embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK, n_batch=settings["n_ctx"],
                           n_ubatch=settings["n_ctx"])
        try:
            self.llm = Llama(model_path=path, n_ctx=settings["n_ctx"], **options)
        except Exception as exc:
            raise spec.EngineError(f"llama.cpp could not load {name}: {exc}") from exc
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
        if not self.reranker:
            ceiling = min(n_ctx_train or 1 << 30, settings.get("n_ctx_max") or 1 << 30)
            per_token = _kv_bytes_per_token(meta, arch)
            if per_token:
                ceiling = min(ceiling, int(settings.get("ctx_memory_mb", 4096)) * 2**20 // per_token)
            if ceiling == 1 << 30:
                ceiling = self.llm.n_ctx()
            self._ctx_max = max(self.llm.n_ctx(), ceiling)
        self.capabilities = spec.Capabilities(
            # llama.cpp offers no per-request hook on the residual stream: no steering, no reads
            interventions=False, hidden_size=_meta_int(meta, f"{arch}.embedding_length"),
            layers=_meta_int(meta, f"{arch}.block_count"),
            context_window=self._window if self.reranker else self.llm.n_ctx(), chat_template=bool(self.template),
            embeddings=not self.reranker,
            # llama.cpp picks kernels by batch size: a reply over a reused cache can differ
            cache_exact=False,
            reasoning=bool(self.template and "<think>" in self.template),
            tool_use=bool(self.template and "tools" in self.template),
            logprobs=not self.reranker, grammar=not self.reranker and spec.Constrainer.available(),
            rerank=self.reranker, context_max=None if self.reranker else self._ctx_max)
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
        self._serial = spec.Serial("llamacpp")
        self._eog = self._end_of_generation_check()
        self._path = path
        self._threads = threads
        self._embedder: Any = None
        self._n_vocab = self.llm.n_vocab()
        self._constrainer = spec.Constrainer(self._grammar_tokenizer, self.token_bytes)

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
        return self._formatter(messages=messages, **(template_kwargs or {})).prompt

    # --- generation --------------------------------------------------------------------
    @property
    def busy(self) -> int:
        return self._serial.busy

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
        return self._serial.generate(request, self._decode)

    def _mask_processor(self, masker: spec.TokenMasker) -> Any:
        """A llama-cpp-python logits processor that applies the grammar's mask.

        llama-cpp-python runs it first in its sampler chain (before penalties, top-k/p, min-p,
        temperature and the draw), on the candidates array it has just filled from the raw
        logits in token order; the logits themselves are left as the model wrote them, which is
        where the log probabilities are read. It runs inside a ctypes callback, where an
        exception would be printed and lost, so a failure is kept on the masker instead.
        """
        n_vocab = self._n_vocab

        def process(input_ids: Any, logits: Any) -> Any:
            try:
                if logits.shape[0] != n_vocab:
                    raise RuntimeError(f"llama.cpp offered {logits.shape[0]} candidates, not {n_vocab}")
                masker.apply(logits)
            except Exception as exc:  # noqa: BLE001 - reported through the masker
                masker.error = masker.error or f"the grammar mask failed: {exc}"
            return logits
        return process

    def _raw_logits(self) -> Any:
        """A view of the logits that produced the token just drawn (valid until the next decode)."""
        import llama_cpp
        import numpy as np
        pointer = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        if not pointer:
            raise RuntimeError("llama.cpp holds no logits for the last token")
        return np.ctypeslib.as_array(pointer, shape=(self._n_vocab,))

    # --- the window ------------------------------------------------------------------
    def _window_for(self, request: spec.GenerateRequest) -> int | None:
        """The window to open before ``request`` (None: the one open will do)."""
        current = self.llm.n_ctx()
        need = min(self._ctx_max, max(request.window or 0, len(request.prompt) + 1))
        if request.num_ctx:
            wanted = min(self._ctx_max, max(request.num_ctx, need, 256))
            return wanted if wanted != current else None
        if need <= current:
            return None
        steps = -(-need // WINDOW_STEP) * WINDOW_STEP
        return min(self._ctx_max, max(steps, 2 * current))

    def _resize(self, n_ctx: int) -> None:
        """Open the context at ``n_ctx`` tokens on the same weights, keeping the cached prompt
        (its KV cells) where it fits. Runs on the engine's thread, between requests."""
        import llama_cpp
        import numpy as np
        from llama_cpp import _internals as internals
        llm = self.llm
        kept = min(llm.n_tokens, n_ctx - 1)
        saved: Any = None
        if kept > 0:
            llm._ctx.kv_cache_seq_rm(-1, kept, -1)
            size = llama_cpp.llama_state_seq_get_size(llm._ctx.ctx, 0)
            saved = (ctypes.c_uint8 * size)()
            if llama_cpp.llama_state_seq_get_data(llm._ctx.ctx, saved, size, 0) != size:
                saved, kept = None, 0
        tokens = llm.input_ids[:kept].copy()
        params = llm.context_params
        old = params.n_ctx
        params.n_ctx = n_ctx
        try:
            fresh = internals.LlamaContext(model=llm._model, params=params, verbose=False)
        except Exception:
            params.n_ctx = old
            raise
        llm._ctx.close()
        llm._ctx = fresh
        llm._n_ctx = fresh.n_ctx()
        llm.input_ids = np.ndarray((llm._n_ctx,), dtype=np.intc)
        llm.input_ids[:kept] = tokens
        llm.n_tokens = 0
        llm._requires_eval = True
        if saved is not None and llama_cpp.llama_state_seq_set_data(fresh.ctx, saved, len(saved), 0):
            llm.n_tokens = kept
        self.capabilities = attrs.evolve(self.capabilities, context_window=llm._n_ctx)

    def _decode(self, request: spec.GenerateRequest, cancel: threading.Event, emit: Any) -> None:
        s = request.sampling
        llm = self.llm
        prompt = list(request.prompt)
        wanted = self._window_for(request)
        if wanted is not None:
            try:
                self._resize(wanted)
            except Exception as exc:  # noqa: BLE001 - the window it has still serves
                log.warning("could not open a context of %d tokens: %s", wanted, exc)
        n_ctx = llm.n_ctx()
        if len(prompt) >= n_ctx:
            emit(spec.Finished(reason="error", prompt_tokens=len(prompt), completion_tokens=0,
                               error=f"The prompt is {len(prompt)} tokens; the context window is {n_ctx} tokens"))
            return
        masker, refused = self._constrainer.start(request)
        if refused is not None:
            emit(spec.Finished(reason="error", prompt_tokens=len(prompt), completion_tokens=0, error=refused))
            return
        k = request.logprobs
        if request.interventions or request.reads:
            emit(spec.Finished(reason="error", prompt_tokens=len(prompt), completion_tokens=0,
                               error="The llama.cpp engine does not accept interventions or activation reads: "
                                     "load the model with the transformers engine to steer it"))
            return
        llm.set_seed(s.seed if s.seed is not None else random.randrange(2**31))
        if not request.cache_prompt:
            llm.reset()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        started = time.perf_counter()
        first = None
        n = 0
        reason = "length"
        try:
            # no processor at all without a grammar: llama-cpp-python's per-token callback costs time
            tokens = llm.generate(prompt, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, temp=s.temperature,
                                  repeat_penalty=s.repeat_penalty, frequency_penalty=s.frequency_penalty,
                                  presence_penalty=s.presence_penalty, reset=True,
                                  logits_processor=[self._mask_processor(masker)] if masker else None)
            for token in tokens:
                if first is None:
                    first = time.perf_counter()
                if cancel.is_set():
                    reason = "cancelled"
                    break
                if self._is_eog(token):
                    reason = "stop"
                    break
                if masker is not None and not masker.accept(token):
                    ended = time.perf_counter()
                    emit(spec.Finished(reason="error", prompt_tokens=len(prompt), completion_tokens=n,
                                       prompt_seconds=first - started, generate_seconds=ended - first,
                                       error=f"The output left the grammar: {masker.error}"))
                    return
                n += 1
                text = decoder.decode(llm.detokenize([token]))
                if k is not None:
                    logprob, top = spec.logprob_entry(self._raw_logits(), token, k)
                    emit(spec.Token(id=token, text=text, logprob=logprob, top=top))
                else:
                    emit(spec.Token(id=token, text=text))
                if masker is not None and masker.finished:
                    reason = "stop"
                    break
                if (s.max_tokens is not None and n >= s.max_tokens) or len(prompt) + n >= n_ctx:
                    reason = "length"
                    break
        except Exception as exc:  # a native decode failure after the stream opened
            emit(spec.Finished(reason="error", prompt_tokens=len(prompt), completion_tokens=n,
                               error=f"llama.cpp: {exc}"))
            return
        ended = time.perf_counter()
        first = first or ended
        emit(spec.Finished(reason=reason, prompt_tokens=len(prompt), completion_tokens=n,
                           prompt_seconds=first - started, generate_seconds=ended - first))

    async def embed(self, texts: list[str]) -> list[list[float]]:
        """Mean-pooled, normalised hidden states, from a second context opened for embeddings."""
        if self.reranker:
            raise sdk.LocalmError(422, "This is a reranker: use /v1/rerank", code="not_an_embedding_model")
        return await self._serial.call(self._embed, texts)

    def _embed(self, texts: list[str]) -> list[list[float]]:
        if self._embedder is None:
            import llama_cpp
            self._embedder = llama_cpp.Llama(model_path=self._path, embedding=True, n_ctx=self.llm.n_ctx(),
                                             n_threads=self._threads, n_batch=self.llm.n_ctx(),
                                             pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, verbose=False)
        window = self._embedder.n_ctx()
        for text in texts:
            size = len(self._embedder.tokenize(text.encode("utf-8")))
            if size > window:
                raise sdk.LocalmError(413, f"An input is {size} tokens; the model embeds at most {window}",
                                      code="context_length_exceeded")
        return [[float(x) for x in v] for v in self._embedder.embed(texts, normalize=True)]

    async def next_token_logits(self, prompt: Sequence[int]) -> Any:
        self._refuse_unless_chat()
        ids = list(prompt)
        if not ids:
            raise sdk.LocalmError(400, "The prompt is empty")
        if len(ids) > self._ctx_max:
            raise sdk.LocalmError(413, f"The prompt is {len(ids)} tokens; the context window is {self._ctx_max}",
                                  code="context_length_exceeded")
        return await self._serial.call(self._logits_after, ids)

    def _logits_after(self, ids: list[int]) -> Any:
        """One pass over ``ids`` from an empty cache. The context then holds exactly ``ids``
        (llama-cpp-python's token record agrees), so the next generation reuses what matches."""
        if len(ids) > self.llm.n_ctx():
            self._resize(self._window_for(spec.GenerateRequest(prompt=tuple(ids))) or len(ids))
        llm = self.llm
        llm.reset()
        try:
            llm.eval(ids)
            return self._raw_logits().copy()
        except Exception:
            llm.reset()
            raise

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
        return await self._serial.call(self._rerank, query, list(documents))

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
        self._serial.close()
        for llm in (self.llm, self._embedder):
            if llm is not None and hasattr(llm, "close"):
                llm.close()


@sdk.hookimpl
def register_settings(register):
    register(Settings)


@sdk.hookimpl
def register_engines(register, plugin):
    def load(entry: Any, options: dict[str, Any]) -> LlamaEngine:
        return LlamaEngine(entry.path, {**plugin.settings, **options}, getattr(entry, "role", "chat"))

    register("llamacpp", load)
