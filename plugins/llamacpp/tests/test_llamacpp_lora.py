"""LoRA adapters on the llama.cpp engine: the real SmolLM2-135M GGUF with a small real LoRA
written here (``write_lora``: a GGUF adapter as llama.cpp's convert_lora_to_gguf.py writes one,
random non-zero A and B matrices for some of the model's attention and feed-forward weights).

What is asserted holds whatever the weights: an adapter changes the next-token logits, a
scale of 0 and the model without it give the model's own logits to the bit (also after a
model with it was loaded, and after the engine grew its window), the persisted prompt cache
never serves states computed with other adapters, the registry keeps an adapter file apart
from the models (listed, never loaded or chatted with), ``localm pull MODEL --lora`` refuses
what would not apply (another architecture, a file that is no LoRA, tensors that do not fit)
without changing the registry, and what is reported (the load, GET /v1/models/{id}) names
files, never their folders."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from localm.sdk import engines as spec
from localm.sdk.testing import LocalmServer, plugin_module
from lora_fixtures import model_facts, smollm2, write_lora
from project_fixtures import offline_cli

pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

PROMPT = "The capital of France is"
MODEL_ID = "smollm2-135m-instruct"
#: What llama-cpp-python is loaded with here: one thread, a small window, two slots.
BASE = {"n_ctx": 512, "n_threads": 1, "n_batch": 64, "n_parallel": 2, "cache_ram_mb": 64}


def llamacpp() -> Any:
    return plugin_module("llamacpp", "llamacpp")


def load(adapters: list[dict[str, Any]] | None = None, **settings: Any) -> Any:
    return llamacpp().LlamaEngine(str(smollm2()), {**BASE, **settings, **({"adapters": adapters} if adapters else {})})


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def logits(engine: Any, text: str = PROMPT) -> Any:
    return np.asarray(run(engine.next_token_logits(engine.tokenize(text))), dtype=np.float32)


def logits_of(adapters: list[dict[str, Any]] | None = None, **settings: Any) -> Any:
    engine = load(adapters, **settings)
    try:
        return logits(engine)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_lora(tmp_path_factory.mktemp("lora") / "smol-lora.gguf")


def adapter(path: Path, scale: float = 1.0, name: str = "smol-lora") -> list[dict[str, Any]]:
    return [{"name": name, "path": str(path), "scale": scale}]


# --- the engine -------------------------------------------------------------------------------

def test_an_adapter_changes_the_logits_and_scale_zero_or_none_gives_the_models_own(lora: Path) -> None:
    own = logits_of()
    engine = load(adapter(lora))
    try:
        assert engine.adapters == [{"name": "smol-lora", "scale": 1.0, "path": "smol-lora.gguf"}]
        adapted = logits(engine)
        assert np.array_equal(adapted, logits(engine))  # the same computation, to the bit
    finally:
        engine.close()
    assert float(np.abs(adapted - own).max()) > 0.1
    half = logits_of(adapter(lora, 0.5))
    assert 0 < float(np.abs(half - own).max()) < float(np.abs(adapted - own).max()) * 2
    assert np.array_equal(logits_of(adapter(lora, 0.0)), own)  # llama.cpp leaves a scale-0 adapter out
    assert np.array_equal(logits_of(), own)  # a model loaded after one with an adapter: its own numbers
    # two adapters add up: the second changes what the first gave
    other = write_lora(lora.parent / "other-lora.gguf", seed=1, kinds=("attn_k",))
    both = logits_of(adapter(lora) + adapter(other, name="other-lora"))
    assert float(np.abs(both - adapted).max()) > 1e-3


def test_every_context_the_engine_opens_has_the_adapters(lora: Path) -> None:
    """The engine opens a new context when a request asks for another window (and for probes):
    the adapters are set on each, so the numbers do not change with the window."""
    engine = load(adapter(lora))
    try:
        before = logits(engine)
        window = engine.capabilities.context_window
        request = spec.GenerateRequest(prompt=tuple(engine.tokenize(PROMPT)), num_ctx=window * 2,
                                       sampling=spec.Sampling(temperature=0, max_tokens=1))
        events = run(_collect(engine, request))
        assert events[-1].reason != "error", events[-1].error
        assert engine.capabilities.context_window > window  # a new context
        assert np.array_equal(logits(engine), before)
    finally:
        engine.close()


async def _collect(engine: Any, request: spec.GenerateRequest) -> list[Any]:
    return [event async for event in engine.generate(request)]


def test_embeddings_come_from_the_adapted_model(lora: Path) -> None:
    """The embedding context the engine opens on first use has the adapters too: a model embeds
    as the model it serves (scale 0: as the model without them)."""
    def embedding(adapters: list[dict[str, Any]] | None) -> Any:
        engine = load(adapters)
        try:
            return np.asarray(run(engine.embed(["LoRA adapters change a model's numbers."]))[0])
        finally:
            engine.close()
    own = embedding(None)
    assert float(np.abs(embedding(adapter(lora)) - own).max()) > 1e-4
    assert np.array_equal(embedding(adapter(lora, 0.0)), own)


def test_the_persisted_prompt_cache_is_kept_apart_by_adapter(lora: Path, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A state computed through an adapter is the adapter's: a model without it (or with
    another scale) skips it with a warning; the same adapters read it back."""
    folder = tmp_path / "kv"
    folder.mkdir()
    persist = {"cache_persist": True, "cache_dir": str(folder)}
    long_prompt = " ".join(f"Line {i} of a long shared preamble." for i in range(60))

    def warm(adapters: list[dict[str, Any]] | None) -> int:
        """A model's host cache as it opens, then a reply that leaves its state to be saved."""
        engine = load(adapters, **persist)
        try:
            found = len(engine._cache.entries)
            request = spec.GenerateRequest(prompt=tuple(engine.tokenize(long_prompt)),
                                           sampling=spec.Sampling(temperature=0, max_tokens=1))
            assert run(_collect(engine, request))[-1].reason != "error"
        finally:
            engine.close()
        return found

    assert warm(adapter(lora)) == 0
    assert list(folder.glob("*.kv"))  # written at close
    # (each registry entry has a folder of its own; a copy stands for another entry's here, as a
    # model clears the states it did not keep from its folder when it closes)
    for other in (None, adapter(lora, 0.5)):
        copy = tmp_path / f"kv-{len(caplog.records)}"
        shutil.copytree(folder, copy)
        with caplog.at_level(logging.WARNING, logger="localm.plugin.llamacpp"):
            caplog.clear()
            engine = load(other, cache_persist=True, cache_dir=str(copy))
            assert engine._cache.entries == []  # neither the plain model's nor another scale's
            engine.close()
        assert "written for another model" in caplog.text
    engine = load(adapter(lora), **persist)
    try:
        assert len(engine._cache.entries) >= 1  # the same adapter reads it back
    finally:
        engine.close()


def test_the_engine_refuses_what_is_not_a_lora_for_this_model(lora: Path, tmp_path: Path) -> None:
    cases = {
        "missing": (adapter(tmp_path / "gone.gguf"), "does not exist"),
        "model": (adapter(smollm2(), name="smol"), "is not a LoRA adapter"),
        "arch": (adapter(write_lora(tmp_path / "qwen.gguf", architecture="qwen2")), "for qwen2 models"),
        "shape": (adapter(write_lora(tmp_path / "wide.gguf", wrong_width=True)), "tensors do not match"),
        "scale": (adapter(lora, float("nan")), "finite number"),
    }
    for name, (wanted, reason) in cases.items():
        with pytest.raises(spec.EngineError) as caught:
            load(wanted)
        assert reason in str(caught.value), (name, str(caught.value))
        assert caught.value.code == "bad_adapter"
    assert np.array_equal(logits_of(), logits_of(adapter(lora, 0.0)))  # nothing left behind


# --- the registry, pull --lora and the routes ----------------------------------------------------

def registry(data: Path) -> list[dict[str, Any]]:
    return json.loads((data / "models.json").read_text())["models"]


def test_pull_lora_registers_the_model_with_its_adapters_and_refuses_what_would_not_apply(
        lora: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    model = str(smollm2())
    out = offline_cli(data, "pull", str(lora))  # an adapter file on its own: role adapter
    assert "Registered smol-lora (gguf, adapter," in out
    [entry] = [m for m in registry(data) if m["id"] == "smol-lora"]
    assert entry["role"] == "adapter" and entry["adapters"] == []
    assert entry["capabilities"]["architecture"] == "llama" and entry["capabilities"]["alpha"] == 16.0
    assert entry["capabilities"]["adapter_type"] == "lora"

    out = offline_cli(data, "pull", model, "--lora", "smol-lora:0.5")  # by its registered name
    assert "Registered smollm2-135m-instruct-smol-lora (gguf, chat, LoRA smol-lora x0.5," in out
    [entry] = [m for m in registry(data) if m["id"] == "smollm2-135m-instruct-smol-lora"]
    assert entry["adapters"] == [{"name": "smol-lora", "path": str(lora.resolve()), "scale": 0.5}]
    offline_cli(data, "pull", model, "--name", "by-file", "--lora", str(lora))  # by its file
    [entry] = [m for m in registry(data) if m["id"] == "by-file"]
    assert entry["adapters"] == [{"name": "smol-lora", "path": str(lora.resolve()), "scale": 1.0}]
    assert "lora: smol-lora x1.0" in offline_cli(data, "models")

    before = (data / "models.json").read_bytes()
    qwen = write_lora(tmp_path / "qwen-lora.gguf", architecture="qwen2")
    wide = write_lora(tmp_path / "wide-lora.gguf", wrong_width=True)
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    refusals = [
        (["--lora", str(qwen)], "qwen-lora is a LoRA adapter for qwen2 models; this model's architecture is llama"),
        (["--lora", model], "is not a LoRA adapter: it is a GGUF model"),
        (["--lora", str(text)], "notes.gguf is not a LoRA adapter: it is not a GGUF file"),
        (["--lora", str(wide)], "The LoRA adapter wide-lora does not fit SmolLM2-135M-Instruct.Q4_1.gguf: its "
                                "blk.0.attn_q.weight pair"),
        (["--lora", "nosuch"], "No LoRA adapter nosuch: it is neither a registered adapter nor a file"),
        (["--lora", "smol-lora:lots"], "(a scale after the last ':' must be a number)"),
        (["--lora", "smol-lora:nan"], "must be a finite number"),
        (["--lora", "by-file"], "by-file is a chat model, not a LoRA adapter"),
        (["--lora", "smol-lora", "--lora", str(lora)], "The LoRA adapter smol-lora is named twice"),
    ]
    for args, reason in refusals:
        result = LocalmServer(data).cli("pull", model, "--name", "refused", *args)
        assert result.returncode == 1 and reason in result.stderr, (args, result.stderr)
    result = LocalmServer(data).cli("pull", str(lora), "--lora", "smol-lora")
    assert result.returncode == 1 and "smol-lora.gguf is a LoRA adapter itself" in result.stderr
    assert (data / "models.json").read_bytes() == before  # a refused pull changes nothing


@pytest.fixture(scope="module")
def server(module_server: Any, lora: Path) -> LocalmServer:
    def prepare(data: Path) -> None:
        model = str(smollm2())
        offline_cli(data, "pull", str(lora), "--name", "my-lora")
        offline_cli(data, "pull", model, "--name", "smol-lora", "--lora", "my-lora")
        offline_cli(data, "pull", model, "--name", "smol-lora-off", "--lora", f"{lora}:0")
        (data / "config.json").write_text(json.dumps({"plugins": {"llamacpp": {"n_threads": 1, "n_ctx": 1024}}}))

    return module_server(prepare=prepare, plugins=["chat", "llamacpp", "openai", "ollama"])


def first_logprobs(server: LocalmServer, model: str) -> dict[str, float]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300)
    reply = client.chat.completions.create(model=model, max_tokens=1, temperature=0, logprobs=True, top_logprobs=8,
                                           messages=[{"role": "user", "content": PROMPT}])
    return {t.token: t.logprob for t in reply.choices[0].logprobs.content[0].top_logprobs}


def test_chat_through_the_server_with_and_without_the_adapter(server: LocalmServer) -> None:
    owner = server.owner()
    loaded = owner.post("/v1/models/load", params={"model": "smol-lora"})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["adapters"] == [{"name": "my-lora", "scale": 1.0}]
    adapted = first_logprobs(server, "smol-lora")
    own = first_logprobs(server, MODEL_ID)
    assert "adapters" not in owner.post("/v1/models/load", params={"model": MODEL_ID}).json()
    assert adapted != own
    assert first_logprobs(server, "smol-lora-off") == own  # scale 0: the model's own numbers
    # unloaded and loaded again, each model computes as before
    assert owner.post("/v1/models/unload").status_code == 200
    assert first_logprobs(server, MODEL_ID) == own
    assert first_logprobs(server, "smol-lora") == adapted


def test_the_adapter_is_reported_by_file_name_only(server: LocalmServer) -> None:
    for key in (None, server.token):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        shown = httpx.get(f"{server.url}/v1/models/smol-lora", headers=headers).json()
        assert shown["adapters"] == [{"name": "my-lora", "scale": 1.0, "path": "smol-lora.gguf"}]
        off = httpx.get(f"{server.url}/v1/models/smol-lora-off", headers=headers).json()
        assert off["adapters"] == [{"name": "smol-lora", "scale": 0.0, "path": "smol-lora.gguf"}]
        assert "adapters" not in httpx.get(f"{server.url}/v1/models/{MODEL_ID}", headers=headers).json()


def test_a_registered_adapter_is_listed_but_never_loaded_or_chatted_with(server: LocalmServer) -> None:
    listed = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert listed["my-lora"]["role"] == "adapter" and listed["smol-lora"]["role"] == "chat"
    assert "my-lora" not in {m["name"] for m in httpx.get(f"{server.url}/api/tags").json()["models"]}
    shown = httpx.get(f"{server.url}/v1/models/my-lora").json()
    assert shown["role"] == "adapter" and shown["capabilities"]["architecture"] == "llama"

    hint = "my-lora is a LoRA adapter, not a model: apply it to a model with `localm pull MODEL_FILE --lora my-lora`"
    refused = server.owner().post("/v1/models/load", params={"model": "my-lora"})
    assert refused.status_code == 400 and refused.json()["detail"].startswith(hint), refused.text
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="my-lora", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert hint in str(caught.value)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="my-lora", input="Hi")
    ollama = httpx.post(f"{server.url}/api/chat", json={"model": "my-lora", "stream": False,
                                                        "messages": [{"role": "user", "content": "Hi"}]})
    assert ollama.status_code == 400 and hint in ollama.json()["error"]
    assert "my-lora" not in {m["id"] for m in httpx.get(f"{server.url}/api/models/loaded").json()["models"]}
