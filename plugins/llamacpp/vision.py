"""Images and sounds in a llama.cpp prompt: a vision (or audio) projector through llama.cpp's
multimodal library, libmtmd, which llama-cpp-python ships with its ctypes bindings.

A projector ("mmproj" GGUF, ``general.architecture = clip``) turns a picture into rows of the
language model's input embeddings. :class:`Projector` opens one for a loaded model and
encodes a :class:`~localm.sdk.engines.Media` into an :class:`Encoded`: what the picture puts in
the prompt, in order. That is the picture's embeddings, and for some models the text tokens
libmtmd wraps them in (Gemma 3's ``<start_of_image>`` ... ``<end_of_image>``, SmolVLM's
``<fake_token_around_image>``): the same positions llama-server gives the picture, so a
model reads what it was trained on.

The engine keeps a sequence's cached positions as token ids. A picture's positions get
negative ids derived from its sha256 (:func:`media_ids`), so a cached prefix matches a later
prompt only through the same picture, and a prompt cache saved or persisted with them needs
no other record of which picture it holds.

M-RoPE models (Qwen2-VL and its successors) place a picture on a 2-D grid of positions that
is not one position a row; the engine's slots count one position a row, so such a projector
is refused, with a message that says so.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import os
import re
import secrets
import threading
from pathlib import Path
from typing import Any, Iterable, Sequence

from localm.sdk import engines as spec
from localm.sdk.gguf import architecture as gguf_architecture

log = logging.getLogger("localm.plugin.llamacpp")

#: A picture's position ids are -(1 + (base + i) % ID_SPAN): negative (never a token id) and
#: derived from its digest, 62 bits wide.
ID_SPAN = 1 << 62
#: Encoded pictures kept for the generates that follow, within this many bytes of embeddings
#: (the most recent always kept).
ENCODED_BUDGET = 256 * 2**20
#: ggml's log levels (ggml.h): a warning or an error is kept for the message of a failure.
_LOG_WARN, _LOG_ERROR, _LOG_CONT = 3, 4, 5


# --- where a projector comes from -------------------------------------------------------------

# --- the chat template -------------------------------------------------------------------------

def new_marker() -> str:
    """A media marker for one engine, as llama-server makes its own: random, so text a client
    writes can never pass for a picture."""
    return f"<__media_{secrets.token_hex(8)}__>"


def flatten(messages: Iterable[dict], marker: str) -> list[dict]:
    """Messages whose content lists (OpenAI parts) become strings, as llama-server flattens
    them before a template renders: text parts joined by a newline, each ``image`` or
    ``audio`` part the marker, with no newline before or after a marker. Other messages, and
    every other key, pass unchanged."""
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        text, after_marker = "", False
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image", "audio", "image_url", "input_audio"):
                text += marker
                after_marker = True
            elif kind == "text":
                if text and not after_marker:
                    text += "\n"
                text += str(part.get("text", ""))
                after_marker = False
        out.append({**message, "content": text})
    return out


# --- the projector ---------------------------------------------------------------------------

def media_ids(digest: str, count: int, start: int = 0) -> list[int]:
    """The position ids of rows ``start`` .. ``start + count - 1`` of a media's pictures:
    negative, derived from its sha256 hex ``digest``, so no two pictures share a first id
    and no id is a token's."""
    base = int(digest[:16], 16) + start
    return [-(1 + (base + i) % ID_SPAN) for i in range(count)]


class Piece:
    """A run of an encoded picture's positions: text tokens (``embd`` None) or rows of input
    embeddings (``embd``: float32 array, rows x the model's width). ``non_causal``: its rows
    attend to each other both ways (Gemma 3), so they must be decoded in one batch."""

    __slots__ = ("ids", "embd", "non_causal")

    def __init__(self, ids: list[int], embd: Any = None, non_causal: bool = False) -> None:
        self.ids = ids
        self.embd = embd
        self.non_causal = non_causal


class Encoded:
    """A picture as the prompt holds it: its pieces in order, the ids of all its positions
    (text tokens and its rows' negative ids) and, for each row id, its piece and row."""

    def __init__(self, kind: str, digest: str, pieces: list[Piece]) -> None:
        self.kind = kind
        self.digest = digest
        self.pieces = pieces
        self.ids: list[int] = [i for piece in pieces for i in piece.ids]
        self.rows: dict[int, tuple[Piece, int]] = {
            i: (piece, row) for piece in pieces if piece.embd is not None for row, i in enumerate(piece.ids)}
        self.size = sum(piece.embd.nbytes for piece in pieces if piece.embd is not None)

    @property
    def tokens(self) -> int:
        return len(self.ids)


class _Log:
    """libmtmd's log (it logs through a callback of its own): each line goes to this module's
    logger at debug level, and the last warnings and errors are kept, for the message of a
    failure. One callback for the process, since libmtmd has one."""

    def __init__(self) -> None:
        from llama_cpp import llama_cpp
        from llama_cpp import mtmd_cpp
        #: (sequence number, level, line) of the last warnings and errors
        self.recent: collections.deque[tuple[int, int, str]] = collections.deque(maxlen=32)
        self.count = 0
        self._level = 0

        def receive(level: int, text: bytes, _user: Any) -> None:
            line = (text or b"").decode("utf-8", errors="replace")
            if level != _LOG_CONT:
                self._level = level
            if self._level >= _LOG_WARN and line.strip():
                self.count += 1
                self.recent.append((self.count, self._level, line.strip()))
            log.debug("mtmd: %s", line.rstrip())
        self._callback = llama_cpp.llama_log_callback(receive)
        mtmd_cpp.mtmd_helper_log_set(self._callback, None)  # also sets libmtmd's (and clip's) own

    def since(self, mark: int, path: str | Path | None = None) -> str:
        """The errors logged after ``mark`` (a ``count``), or without any the warnings, joined;
        a path in them is shortened to its file name (errors never name absolute paths)."""
        lines = [(level, line) for number, level, line in self.recent if number > mark]
        chosen = [line for level, line in lines if level >= _LOG_ERROR] or [line for _, line in lines]
        text = " ".join(chosen)
        if path is not None:
            text = text.replace(str(path), os.path.basename(str(path)))
        return re.sub(r"\s+", " ", text).strip()


_LOG: _Log | None = None
_LOG_LOCK = threading.Lock()


def _mtmd_log() -> _Log:
    global _LOG
    with _LOG_LOCK:
        if _LOG is None:
            _LOG = _Log()
        return _LOG


def _file_identity(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"file": path.name, "size": stat.st_size, "mtime": stat.st_mtime_ns}


def _is_webp(data: bytes) -> bool:
    return len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP"


class Projector:
    """libmtmd over one projector file for one loaded model (``model``: its llama_model
    pointer, ``width``: its input embedding width). Encodings are kept per digest within
    ``ENCODED_BUDGET`` bytes. ``encode`` may be called from any thread: one encodes at a
    time."""

    def __init__(self, path: str | Path, model: Any, *, threads: int, width: int, flash: bool | None = None,
                 gpu: bool | None = None) -> None:
        from llama_cpp import mtmd_cpp as mtmd
        self._mtmd = mtmd
        self.path = Path(path)
        name = self.path.name
        arch = gguf_architecture(self.path)
        if arch != "clip":
            raise spec.EngineError(f"{name} is not a projector (a GGUF whose architecture is clip"
                                   + (f"; it says {arch})" if arch else ")"))
        self.width = width
        #: whether it encodes on the GPU (with the model's layers)
        self.on_gpu = bool(gpu)
        self.marker = new_marker()
        self._ctx: Any = None
        self._lock = threading.Lock()
        self._kept: collections.OrderedDict[str, Encoded] = collections.OrderedDict()
        self._kept_size = 0
        logs = _mtmd_log()
        params = mtmd.mtmd_context_params_default()
        params.n_threads = threads
        if flash is not None and hasattr(params, "flash_attn_type"):  # as the language model's (llama-server's too)
            params.flash_attn_type = 1 if flash else 0
        if gpu is not None and hasattr(params, "use_gpu"):  # on the GPU with the model's layers, or not
            params.use_gpu = gpu
        params.print_timings = False
        params.media_marker = self.marker.encode()
        mark = logs.count
        self._ctx = mtmd.mtmd_init_from_file(str(self.path).encode(), model, params)
        if not self._ctx:
            why = logs.since(mark, self.path) or "libmtmd gave no reason"
            raise spec.EngineError(f"llama.cpp could not open the projector {name} for this model: {why}")
        if mtmd.mtmd_decode_use_mrope(self._ctx):
            self.close()
            raise spec.EngineError(f"The projector {name} is for an M-RoPE model (Qwen2-VL and its successors), whose "
                                   "pictures take a 2-D grid of positions: localm's llama.cpp engine does not place "
                                   "those yet")
        self.vision = bool(mtmd.mtmd_support_vision(self._ctx))
        self.audio = bool(mtmd.mtmd_support_audio(self._ctx))
        self.identity = _file_identity(self.path)

    # --- encoding ----------------------------------------------------------------------------
    def encode(self, media: spec.Media) -> Encoded:
        """``media`` as the prompt holds it, encoded once per digest (the sha256 of its data,
        computed here: a digest the caller gives is not trusted for the cache).
        ``EngineError(code="invalid_media")`` when it cannot be decoded, or is not of its
        kind, or this projector does not take its kind."""
        digest = hashlib.sha256(media.data).hexdigest()
        key = f"{media.kind}:{digest}"
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
                return found
            if self._ctx is None:
                raise spec.EngineError("The projector is closed")
            encoded = self._encode(media, digest)
            self._keep(key, encoded)
            return encoded

    def _keep(self, key: str, encoded: Encoded) -> None:
        self._kept[key] = encoded
        self._kept_size += encoded.size
        while self._kept_size > ENCODED_BUDGET and len(self._kept) > 1:
            _, dropped = self._kept.popitem(last=False)
            self._kept_size -= dropped.size

    def _encode(self, media: spec.Media, digest: str) -> Encoded:
        if media.kind == "image" and not self.vision:
            raise spec.EngineError("This model's projector does not see images", code="invalid_media")
        if media.kind == "audio" and not self.audio:
            raise spec.EngineError("This model's projector does not hear sound", code="invalid_media")
        if media.kind not in ("image", "audio"):
            raise spec.EngineError(f"Unknown media kind {media.kind!r}", code="invalid_media")
        bitmap = self._bitmap(media)
        try:
            chunks = self._tokenize(bitmap)
            try:
                return Encoded(media.kind, digest, self._pieces(chunks, digest))
            finally:
                self._mtmd.mtmd_input_chunks_free(chunks)
        finally:
            self._mtmd.mtmd_bitmap_free(bitmap)

    def _bitmap(self, media: spec.Media) -> Any:
        """libmtmd's bitmap of ``media`` (a picture decoded by stb_image, a sound by miniaudio).
        Only a WebP picture may reach libmtmd's last resort, ffmpeg (stb_image has no WebP):
        other bytes that decode as neither are refused without starting a program on them."""
        mtmd = self._mtmd
        data = media.data
        if not data:
            raise spec.EngineError(f"The {media.kind} is empty", code="invalid_media")
        options = mtmd.mtmd_helper_init_opt_default()
        if not _is_webp(data):
            options.video_params.ffmpeg_bin_dir = b"/dev/null"  # no ffmpeg can be there
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self._ctx, buffer, len(data), False, options)
        if not bitmap:
            what = "a picture (PNG, JPEG, GIF, BMP, WebP ...)" if media.kind == "image" else "a sound (WAV, MP3, FLAC)"
            raise spec.EngineError(f"The {media.kind} could not be decoded as {what}", code="invalid_media")
        if bool(mtmd.mtmd_bitmap_is_audio(bitmap)) != (media.kind == "audio"):
            mtmd.mtmd_bitmap_free(bitmap)
            raise spec.EngineError(f"The {media.kind}'s data is not {'a sound' if media.kind == 'audio' else 'a picture'}",
                                   code="invalid_media")
        return bitmap

    def _tokenize(self, bitmap: Any) -> Any:
        """libmtmd's chunks for the marker alone with this bitmap: the picture and the text
        tokens the model wraps it in."""
        mtmd = self._mtmd
        marker = self.marker.encode()
        text = mtmd.mtmd_input_text()
        text.text, text.text_len, text.add_special, text.parse_special = marker, len(marker), False, True
        chunks = mtmd.mtmd_input_chunks_init()
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        status = mtmd.mtmd_tokenize(self._ctx, chunks, ctypes.byref(text), bitmaps, 1)
        if status != 0:
            mtmd.mtmd_input_chunks_free(chunks)
            raise spec.EngineError(f"llama.cpp could not prepare the media (status {status})", code="invalid_media")
        return chunks

    def _pieces(self, chunks: Any, digest: str) -> list[Piece]:
        """Each chunk as a Piece: a text chunk's tokens, or a picture's rows encoded now."""
        import numpy as np
        mtmd = self._mtmd
        pieces: list[Piece] = []
        rows = 0
        for index in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, index)
            count = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
            if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                size = ctypes.c_size_t(0)
                tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(size))
                if size.value:
                    pieces.append(Piece([int(tokens[i]) for i in range(size.value)]))
                continue
            if int(mtmd.mtmd_input_chunk_get_n_pos(chunk)) != count:
                raise spec.EngineError("This projector places a picture at other positions than its rows: "
                                       "not supported", code="invalid_media")
            status = mtmd.mtmd_encode_chunk(self._ctx, chunk)
            output = mtmd.mtmd_get_output_embd(self._ctx) if status == 0 else None
            if status != 0 or not output:
                raise spec.EngineError(f"llama.cpp could not encode the media (status {status})", code="invalid_media")
            embd = np.ctypeslib.as_array(output, shape=(count, self.width)).copy()
            ids = media_ids(digest, count, rows)  # ids go on across the media's pictures
            rows += count
            pieces.append(Piece(ids, embd, bool(mtmd.mtmd_decode_use_non_causal(self._ctx, chunk))))
        if not any(piece.embd is not None for piece in pieces):
            raise spec.EngineError("llama.cpp found nothing to encode in the media", code="invalid_media")
        return pieces

    def close(self) -> None:
        with self._lock:
            if self._ctx:
                self._mtmd.mtmd_free(self._ctx)
            self._ctx = None
            self._kept.clear()
            self._kept_size = 0


def expand(prompt: Sequence[int], spans: Sequence[spec.MediaSpan], encoded: Sequence[Encoded]) -> list[int]:
    """The prompt's positions with each media's ids in place (``spans[i]`` encoded as
    ``encoded[i]``): what a slot caches, compared with other prompts and fed to the model."""
    out: list[int] = []
    at = 0
    for span, media in zip(spans, encoded):
        out.extend(prompt[at:span.at])
        out.extend(media.ids)
        at = span.at
    out.extend(prompt[at:])
    return out
