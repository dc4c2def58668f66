"""Every surface shares the chat pipeline: a chat inlet hook registered by a test plugin
reaches the OpenAI chat route, the Ollama API, Anthropic Messages and OpenAI Responses,
and disabling the plugin takes it away from all of them at once."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from conftest import offline_cli

anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Say hi."}]
SURFACES = ["openai.chat", "ollama", "anthropic", "responses"]


def prompt_tokens(s: Any) -> dict[str, int]:
    """The prompt size each surface reports for the same one-message conversation."""
    url = s.url
    # Ollama's prompt_eval_count counts the tokens the model computed: it goes first, on an
    # empty cache, or it would count none of what the requests before it left cached
    s.owner().post("/v1/models/unload", params={"model": MODEL})
    out = {"ollama": ollama.Client(host=url, timeout=120).chat(
        model=MODEL, messages=ASK, options={"num_predict": 1}).prompt_eval_count}
    chat = openai.OpenAI(base_url=url + "/v1", api_key="open", timeout=120)
    out["openai.chat"] = chat.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1).usage.prompt_tokens
    out["anthropic"] = anthropic.Anthropic(base_url=url, api_key="open", timeout=120).messages.create(
        model=MODEL, messages=ASK, max_tokens=1).usage.input_tokens
    out["responses"] = chat.responses.create(model=MODEL, input="Say hi.", max_output_tokens=16).usage.input_tokens
    return out


def test_an_inlet_hook_reaches_every_surface(module_server: Callable[..., Any]) -> None:
    def prepare(data_dir: Path) -> None:
        offline_cli(data_dir, "plugin", "install", "inletprobe")

    s = module_server(prepare=prepare,
                      plugins=["chat", "llamacpp", "ollama", "anthropic", "responses", "inletprobe"])
    hooked = prompt_tokens(s)
    seen = httpx.get(s.url + "/inletprobe/seen").json()["routes"]
    assert len(seen) == len(SURFACES) and len(set(seen)) == len(SURFACES), seen
    disabled = s.cli("plugin", "disable", "inletprobe")
    assert disabled.returncode == 0, disabled.stderr + disabled.stdout
    plain = prompt_tokens(s)
    for surface in SURFACES:
        assert hooked[surface] - plain[surface] >= 20, (surface, hooked, plain)
    assert httpx.get(s.url + "/inletprobe/seen").status_code == 404


def test_each_surface_resolves_the_model_once_per_request(module_server: Callable[..., Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The surface that reads a model name (Ollama's tags) hands its registry entry to the chat
    service, which resolves the model itself only when no surface did."""
    from localm.kernel.manager import ModelManager

    s = module_server(plugins=["chat", "llamacpp", "ollama", "anthropic", "responses"])
    calls: list[str | None] = []
    resolve = ModelManager.resolve

    def counted(self: ModelManager, name: str | None) -> Any:
        if not sys._getframe(1).f_code.co_filename.endswith("manager.py"):  # not the manager's own lookups by id
            calls.append(name)
        return resolve(self, name)

    monkeypatch.setattr(ModelManager, "resolve", counted)
    url = s.url
    chat = openai.OpenAI(base_url=url + "/v1", api_key="open", timeout=120)
    asks = {
        "openai.chat": lambda: chat.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1),
        "openai.completions": lambda: chat.completions.create(model=MODEL, prompt="Hi", max_tokens=1),
        "ollama.chat": lambda: ollama.Client(host=url, timeout=120).chat(
            model=MODEL, messages=ASK, options={"num_predict": 1}),
        "ollama.generate": lambda: ollama.Client(host=url, timeout=120).generate(
            model=MODEL, prompt="Hi", options={"num_predict": 1}),
        "anthropic": lambda: anthropic.Anthropic(base_url=url, api_key="open", timeout=120).messages.create(
            model=MODEL, messages=ASK, max_tokens=1),
        "responses": lambda: chat.responses.create(model=MODEL, input="Say hi.", max_output_tokens=16),
    }
    counts = {}
    for surface, ask in asks.items():
        calls.clear()
        ask()
        counts[surface] = len(calls)
    assert counts == dict.fromkeys(asks, 1), counts
