"""The draft models of ``draft_fixtures`` themselves: an early-exit draft of SmolLM2-135M has
the blocks it is asked for, the model's metadata and vocabulary, and the model's own tensors
byte for byte; the ``other`` vocabulary has as many tokens, not the same ones; a draft loads
in llama.cpp and generates."""

from __future__ import annotations

from pathlib import Path

import pytest

from draft_fixtures import GLOBAL_TENSORS, tokens_of, write_draft
from lora_fixtures import smollm2

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("drafts")
    return {"same": write_draft(folder / "draft-2.gguf", layers=2),
            "other": write_draft(folder / "draft-other-2.gguf", layers=2, vocabulary="other")}


def test_a_draft_has_its_blocks_and_the_model_s_metadata_and_tensors(drafts: dict[str, Path]) -> None:
    model, draft = gguf.GGUFReader(smollm2()), gguf.GGUFReader(drafts["same"])
    assert draft.fields["llama.block_count"].contents() == 2
    assert model.fields["llama.block_count"].contents() == 30
    for key, field in model.fields.items():
        if key.startswith("GGUF.") or key == "llama.block_count":
            continue
        assert list(draft.fields[key].types) == list(field.types), key
        assert draft.fields[key].contents() == field.contents(), key
    source = {t.name: t for t in model.tensors}
    names = [t.name for t in draft.tensors]
    assert names == [n for n in source if n in GLOBAL_TENSORS or n.startswith(("blk.0.", "blk.1."))]
    assert {source[n].tensor_type for n in names} > {gguf.GGMLQuantizationType.F32}
    for tensor in draft.tensors:
        kept = source[tensor.name]
        assert (tensor.tensor_type, list(tensor.shape)) == (kept.tensor_type, list(kept.shape)), tensor.name
        assert np.array_equal(tensor.data, kept.data), tensor.name


def test_the_other_vocabulary_has_as_many_tokens_not_the_same(drafts: dict[str, Path]) -> None:
    tokens = tokens_of(smollm2())
    assert tokens_of(drafts["same"]) == tokens
    other = tokens_of(drafts["other"])
    assert len(other) == len(tokens) and other != tokens
    assert sorted(other) == sorted(tokens)


def test_a_draft_loads_in_llama_cpp_and_generates(drafts: dict[str, Path]) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(drafts["same"]), n_ctx=128, n_threads=1, verbose=False)
    try:
        assert llm.n_vocab() == len(tokens_of(smollm2()))
        out = llm("The capital of France is", max_tokens=4, temperature=0.0)
        assert out["usage"]["completion_tokens"] >= 1
    finally:
        llm.close()
