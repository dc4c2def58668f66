"""Small real draft models for SmolLM2-135M (``write_draft``), for the tests of speculative
decoding on the llama.cpp engine: an "early exit" of the model, its first blocks under its own
embeddings, final norm and output head, so its greedy tokens often agree with the model's
(``acceptance`` measures how often), and a variant whose vocabulary differs from the model's
(a draft that a vocabulary check must refuse)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from lora_fixtures import smollm2

#: The keys GGUFWriter writes itself (``general.architecture``, the header's ``GGUF.*``) or
#: that are written through its own call (``general.alignment``).
WRITER_KEYS = ("general.architecture", "general.alignment")
#: The tensors outside the blocks a draft keeps (``output.weight`` is absent where the model
#: ties its head to the embeddings, as SmolLM2 does).
GLOBAL_TENSORS = ("token_embd.weight", "output_norm.weight", "output.weight")
#: The token ids whose texts the ``other`` vocabulary swaps pairwise (ordinary BPE tokens,
#: past the special ones, so the file still loads and tokenizes, to other ids).
SWAPPED = range(1000, 1016)


def field_value(field: Any) -> tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]:
    """(value, type, array item type) of a reader's metadata field, as GGUFWriter.add_key_value
    takes them: strings as their bytes (copied whatever their encoding), numbers as Python
    scalars of the field's own GGUF type."""
    vtype = gguf.GGUFValueType(field.types[0])
    if vtype == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]), vtype, None
    if vtype != gguf.GGUFValueType.ARRAY:
        return field.parts[field.data[0]].tolist()[0], vtype, None
    if len(field.types) != 2:
        raise ValueError(f"{field.name}: arrays of arrays are not copied")
    item = gguf.GGUFValueType(field.types[1])
    if item == gguf.GGUFValueType.STRING:
        return [bytes(field.parts[i]) for i in field.data], vtype, item
    return [field.parts[i].tolist()[0] for i in field.data], vtype, item


def write_draft(path: Path, *, layers: int = 6, model: Path | None = None, vocabulary: str = "same") -> Path:
    """An early-exit draft of ``model`` (SmolLM2 by default): every metadata key and value of
    the model (the tokenizer's included, with their GGUF types) but ``{arch}.block_count`` =
    ``layers``, and the tensors ``token_embd``, ``output_norm``, ``output`` (if there) and
    those of blocks 0 to ``layers`` - 1, byte for byte in their own quantization types.
    ``vocabulary="other"``: the same, with the texts of some ordinary tokens swapped in pairs
    (as many tokens, another vocabulary)."""
    if vocabulary not in ("same", "other"):
        raise ValueError(f"vocabulary is 'same' or 'other', not {vocabulary!r}")
    reader = gguf.GGUFReader(model or smollm2())
    arch = reader.fields["general.architecture"].contents()
    blocks = int(reader.fields[f"{arch}.block_count"].contents())
    if not 1 <= layers <= blocks:
        raise ValueError(f"layers is 1 to {blocks}, not {layers}")
    writer = gguf.GGUFWriter(str(path), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in WRITER_KEYS:
            continue
        value, vtype, item = field_value(field)
        if key == f"{arch}.block_count":
            value = layers
        elif key == gguf.Keys.Tokenizer.LIST and vocabulary == "other":
            value = list(value)
            for a, b in zip(SWAPPED[::2], SWAPPED[1::2]):
                value[a], value[b] = value[b], value[a]
        writer.add_key_value(key, value, vtype, sub_type=item)
    if "general.alignment" in reader.fields:
        writer.add_custom_alignment(int(reader.fields["general.alignment"].contents()))
    kept = re.compile(rf"blk\.({'|'.join(str(i) for i in range(layers))})\.")
    for tensor in reader.tensors:
        if tensor.name not in GLOBAL_TENSORS and not kept.match(tensor.name):
            continue
        # The reader's data is in numpy order (the reverse of ``tensor.shape``, llama.cpp's ne
        # order); a quantized tensor comes as uint8 rows of blocks, its shape in bytes, which
        # GGUFWriter turns back into elements for the ``raw_dtype`` it is told.
        data = tensor.data
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if data.dtype == np.uint8:
            assert gguf.quant_shape_from_byte_shape(data.shape, tensor.tensor_type) == shape, tensor.name
        else:
            assert data.shape == shape, tensor.name
        writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tokens_of(model: Path) -> list[str]:
    """The token texts (``tokenizer.ggml.tokens``) of a GGUF model."""
    return list(gguf.GGUFReader(model).fields[gguf.Keys.Tokenizer.LIST].contents())


def acceptance(draft: Path, prompts: list[str], tokens: int = 64, *, model: Path | None = None) -> float:
    """How often the draft's greedy next token is the model's (SmolLM2 by default) along the
    model's own greedy continuation of ``tokens`` tokens (fewer where it ends), over ``prompts`` (user messages,
    rendered with the model's chat template): the acceptance rate of one drafted token a step."""
    import llama_cpp
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    # llama-cpp-python keeps ``scores`` (the logits) only with logits_all.
    target = llama_cpp.Llama(model_path=str(model or smollm2()), n_ctx=512, logits_all=True, verbose=False)
    guess = llama_cpp.Llama(model_path=str(draft), n_ctx=512, logits_all=True, verbose=False)
    render = Jinja2ChatFormatter(target.metadata["tokenizer.chat_template"], eos_token="<|im_end|>",
                                 bos_token="<|im_start|>", add_generation_prompt=True)
    agreed = total = 0
    for prompt in prompts:
        text = render(messages=[{"role": "user", "content": prompt}]).prompt
        ids = target.tokenize(text.encode(), add_bos=False, special=True)
        target.reset()
        target.eval(ids)
        continuation: list[int] = []
        while len(continuation) < tokens and (not continuation or continuation[-1] != target.token_eos()):
            continuation.append(int(np.argmax(target.scores[target.n_tokens - 1])))
            target.eval(continuation[-1:])
        guess.reset()
        guess.eval(ids + continuation[:-1])
        guessed = np.argmax(guess.scores[len(ids) - 1:len(ids) - 1 + len(continuation)], axis=1)
        agreed += int((guessed == np.asarray(continuation)).sum())
        total += len(continuation)
    return agreed / total
