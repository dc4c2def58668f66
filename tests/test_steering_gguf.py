"""Steering on GGUF through llama.cpp, against a reference PyTorch forward hook on the same
weights loaded through transformers.

The exact checks run on SmolLM2 with its Q4_1 weights dequantized to a float32 GGUF (the
weights transformers computes with when it loads the Q4_1 file): an SAE feature, a plugin's
delta (layer 0 through the eval callback, the others through the control vector) and a
3-layer circuit shift the steered token's log-probability as the reference does, within
0.05 (measured: under 0.003); SAE activations read through the eval callback match the
reference's residuals. On the Q4_1 file itself llama.cpp quantises each matmul's input to 8
bits in blocks of 32, and a residual stream with outlier dimensions then moves any
log-probability by up to ~0.3 for the smallest change upstream (a delta of norm 0.001 at
layer 1 moves one by 0.1): there the shift is checked within 0.25. Then: a steered request
never reaches an unsteered one, scoring or embeddings, and steered and unsteered requests
sent together each reply what they reply alone."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import offline_cli
from sae_fixtures import decoder_rows, dequantized_gguf, smollm2_gguf, write_saelens_sae
import sae_fixtures as fixtures

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"  # the default model: Q4_1
F32 = "smollm2-float32"  # its weights, dequantized
ASK = [{"role": "user", "content": "Name a colour."}]
HIDDEN = 576
D_SAE = 8
LAYERS = (6, 13, 20)  # the circuit's layers; the single-feature SAE sits at 20
SHIFT_TOLERANCE = 0.05
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}


@pytest.fixture(scope="module")
def f32_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dequantized_gguf(smollm2_gguf(), tmp_path_factory.mktemp("f32") / "smollm2-f32.gguf")


@pytest.fixture(scope="module")
def reference(f32_path: Path) -> Any:
    return fixtures.reference_model(f32_path)


@pytest.fixture(scope="module")
def server(module_server: Callable[..., Any], f32_path: Path) -> Any:
    def prepare(data_dir: Path) -> None:
        offline_cli(data_dir, "plugin", "install", "steerprobe")
        offline_cli(data_dir, "pull", str(f32_path), "--name", F32)

    # llama.cpp is the only engine plugin: every request below is served by it
    return module_server(prepare=prepare, plugins=["chat", "llamacpp", "steering", "circuits", "steerprobe"],
                         env=OFFLINE)


@pytest.fixture(scope="module")
def owner(server: Any) -> httpx.Client:
    return server.owner()


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused-in-open-mode")


def first_token(client: Any, model: str = F32, **extra: Any) -> tuple[dict[int, float], dict[str, str]]:
    """The first reply token's 20 most likely alternatives by token id, and the headers. The
    prompt cache is off, so every call computes the prompt afresh."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=ASK, max_tokens=2, temperature=0, logprobs=True, top_logprobs=20,
        extra_body={"return_tokens_as_token_ids": True, "cache_prompt": False, **extra})
    entry = raw.parse().choices[0].logprobs.content[0]
    return {int(alt.token.split(":")[1]): alt.logprob for alt in entry.top_logprobs}, dict(raw.headers)


def reference_logprobs(reference: Any, deltas: dict[int, np.ndarray]) -> Any:
    return fixtures.reference_logprobs(reference, ASK, deltas)


def reference_residuals(reference: Any, layer: int) -> np.ndarray:
    """The residual stream at ``layer``'s output for every prompt position, unsteered."""
    tokenizer, model = reference
    text = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model(ids, output_hidden_states=True)
    return out.hidden_states[layer + 1][0].float().numpy()


@pytest.fixture(scope="module")
def plain(client: Any) -> dict[int, float]:
    return first_token(client)[0]


@pytest.fixture(scope="module")
def target(plain: dict[int, float]) -> int:
    """A token among the unsteered reply's 20 likeliest, but not its first: steering toward
    it keeps it in the list, so its log-probability can be read before and after."""
    ranked = sorted(plain, key=lambda token: -plain[token])
    return ranked[8]


@pytest.fixture(scope="module")
def decoders(reference: Any, target: int) -> dict[int, np.ndarray]:
    """W_dec per layer, row 0 along the target token's unembedding, the rest random unit rows."""
    return {layer: decoder_rows(reference[1], [target], d_sae=D_SAE, seed=layer) for layer in LAYERS}


@pytest.fixture(scope="module")
def saes(owner: httpx.Client, decoders: dict[int, np.ndarray], tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.mktemp("gguf-saes")
    for layer, w in decoders.items():
        path = write_saelens_sae(root / f"l{layer}", d_in=HIDDEN, d_sae=D_SAE, layer=layer, W_dec=w)
        r = owner.post("/api/saes", json={"path": str(path), "id": f"l{layer}"})
        assert r.status_code == 201, r.text
        r = owner.post(f"/api/saes/l{layer}/attach")
        assert r.status_code == 200, r.text


def shift_error(steered: dict[int, float], plain: dict[int, float], expected: Any, unsteered: Any,
                token: int) -> float:
    """How far llama.cpp's shift of ``token``'s log-probability is from the reference's."""
    assert token in steered and token in plain
    return abs((steered[token] - plain[token]) - float(expected[token] - unsteered[token]))


def test_a_feature_shifts_its_token_as_the_reference_does(client: Any, owner: httpx.Client, reference: Any,
                                                           saes: None, decoders: dict[int, np.ndarray],
                                                           plain: dict[int, float], target: int) -> None:
    strength = 16.0
    r = owner.post("/api/profiles", json={"name": "gguf-one", "sae": {"id": "l20"},
                                          "features": [{"index": 0, "strength": strength}]})
    assert r.status_code in (200, 201), r.text
    steered, _ = first_token(client, profile="gguf-one")
    expected = reference_logprobs(reference, {20: strength * decoders[20][0]})
    unsteered = reference_logprobs(reference, {})
    assert float(expected[target] - unsteered[target]) > 1.0  # the reference moved it a lot
    error = shift_error(steered, plain, expected, unsteered, target)
    assert error <= SHIFT_TOLERANCE, error
    assert steered[target] > plain[target]
    # the unsteered request after it computes exactly what it did before
    assert first_token(client)[0] == plain


@pytest.mark.parametrize("layer", [0, 12, 29])
def test_a_plugin_delta_on_any_layer_matches_the_reference(client: Any, reference: Any, plain: dict[int, float],
                                                           target: int, layer: int) -> None:
    """Layer 0 has no row in a control vector: the eval callback adds it; the others go in
    the control vector."""
    model = reference[1]
    row = model.get_output_embeddings().weight[target].detach().float().numpy()
    delta = (6.0 * row / np.linalg.norm(row)).astype(np.float32)
    steered, headers = first_token(client, probe_delta={"layer": layer, "delta": delta.tolist()})
    assert headers["x-steerprobe"] == str(layer)
    expected = reference_logprobs(reference, {layer: delta})
    unsteered = reference_logprobs(reference, {})
    error = shift_error(steered, plain, expected, unsteered, target)
    assert error <= SHIFT_TOLERANCE, error
    assert first_token(client)[0] == plain


def test_a_three_layer_circuit_matches_the_reference(client: Any, owner: httpx.Client, reference: Any, saes: None,
                                                     decoders: dict[int, np.ndarray], plain: dict[int, float],
                                                     target: int) -> None:
    members = [{"layer": 6, "feature": 0, "strength": 3.0}, {"layer": 13, "feature": 0, "strength": 3.0},
               {"layer": 20, "feature": 0, "strength": 4.0}]
    r = owner.post("/api/circuits", json={"name": "gguf-three", "rung": 1, "members": members})
    assert r.status_code in (200, 201), r.text
    steered, headers = first_token(client, circuit="gguf-three")
    assert "x-millm-circuit-rung" in headers
    deltas = {m["layer"]: m["strength"] * decoders[m["layer"]][m["feature"]] for m in members}
    expected = reference_logprobs(reference, deltas)
    unsteered = reference_logprobs(reference, {})
    error = shift_error(steered, plain, expected, unsteered, target)
    assert error <= SHIFT_TOLERANCE, error
    assert first_token(client)[0] == plain


def test_reads_pre_and_post_and_every_position(server: Any) -> None:
    """A probe reads the prompt and each generated token fed back; post - pre is the delta,
    at a middle layer and at the last (whose output llama.cpp keeps only for rows with logits,
    so a read there asks for every row's)."""
    for layer in (10, 29):
        delta = np.full(HIDDEN, 0.25, dtype=np.float32)
        body = {"model": F32, "messages": ASK, "max_tokens": 5, "temperature": 0,
                "probe_delta": {"layer": layer, "delta": delta.tolist()}, "probe_read": "both"}
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300).json()
        probe, usage = reply["probe"], reply["usage"]
        generated = usage["completion_tokens"]
        assert probe["positions"] == usage["prompt_tokens"] + generated - (1 if generated == 5 else 0)
        assert probe["max_delta_error"] < 1e-3


def test_sae_activations_match_the_reference(client: Any, reference: Any, saes: None,
                                             decoders: dict[int, np.ndarray], tmp_path_factory: Any) -> None:
    """return_sae_activations encodes the rows llama.cpp's eval callback read at layer 20: the
    top features at each prompt position match the reference residuals encoded by the same
    SAE."""
    from safetensors.numpy import load_file
    raw = client.chat.completions.with_raw_response.create(
        model=F32, messages=ASK, max_tokens=1, temperature=0,
        extra_body={"return_sae_activations": {"sae_id": "l20", "top_k": D_SAE, "positions": "prompt"}})
    body = raw.http_response.json()
    positions = body["millm"]["sae_activations"]["positions"]
    residuals = reference_residuals(reference, 20)
    assert len(positions) == residuals.shape[0]
    folder = next(Path(p) for p in tmp_path_factory.getbasetemp().glob("gguf-saes*/l20"))
    w = load_file(str(folder / "sae_weights.safetensors"))
    acts = np.maximum((residuals - w["b_dec"]) @ w["W_enc"] + w["b_enc"], 0.0)
    worst = 0.0
    for entry in positions:
        row = acts[entry["position"]]
        scale = max(1.0, float(np.abs(row).max()))
        for feature in entry["features"]:
            worst = max(worst, abs(feature["value"] - float(row[feature["index"]])) / scale)
    assert worst < 5e-3, worst  # float32 on both sides, summed in other orders


def test_the_default_model_steers_within_its_quantisation(client: Any, reference: Any) -> None:
    """The Q4_1 model: a delta along a likely token's unembedding at layer 20 raises it by
    the reference's shift, within what 8-bit activations allow."""
    plain_q4 = first_token(client, model=MODEL)[0]
    token = sorted(plain_q4, key=lambda t: -plain_q4[t])[8]
    row = reference[1].get_output_embeddings().weight[token].detach().float().numpy()
    delta = (8.0 * row / np.linalg.norm(row)).astype(np.float32)
    steered, _ = first_token(client, model=MODEL, probe_delta={"layer": 20, "delta": delta.tolist()})
    expected = reference_logprobs(reference, {20: delta})
    unsteered = reference_logprobs(reference, {})
    assert float(expected[token] - unsteered[token]) > 0.3
    error = shift_error(steered, plain_q4, expected, unsteered, token)
    assert error <= 0.25, error
    assert first_token(client, model=MODEL)[0] == plain_q4


def test_scoring_and_embeddings_are_never_steered(server: Any, owner: httpx.Client, saes: None) -> None:
    score = {"model": MODEL, "prompt": "The sky is", "max_tokens": 1, "logprobs": 5}
    embed = {"model": MODEL, "input": "The sky is blue."}
    plain_score = httpx.post(server.url + "/v1/completions", json=score, timeout=300).json()["choices"]
    plain_vec = httpx.post(server.url + "/v1/embeddings", json=embed, timeout=300).json()["data"]
    r = owner.post("/api/steering/features", json={"index": 0, "strength": 12.0, "sae_id": "l20"})
    assert r.status_code == 200, r.text
    try:
        # a steered generation leaves its control vector on the context; scoring lifts it
        r = httpx.post(server.url + "/v1/chat/completions", timeout=300,
                       json={"model": MODEL, "messages": ASK, "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert httpx.post(server.url + "/v1/completions", json=score, timeout=300).json()["choices"] == plain_score
        assert httpx.post(server.url + "/v1/embeddings", json=embed, timeout=300).json()["data"] == plain_vec
    finally:
        r = owner.post("/api/steering/features", json={"index": 0, "strength": 0.0, "sae_id": "l20"})
        assert r.status_code == 200, r.text


def test_steered_and_unsteered_requests_at_once(server: Any, reference: Any, target: int) -> None:
    """Three unsteered streams and a steered one sent together: the unsteered ones reply what
    they reply alone (they never share a batch with the steered one's vector), the steered one
    what it replies alone."""
    model = reference[1]
    row = model.get_output_embeddings().weight[target].detach().float().numpy()
    probe = {"probe_delta": {"layer": 15, "delta": (8.0 * row / np.linalg.norm(row)).tolist()}}
    asks = [[{"role": "user", "content": f"Write one sentence about the number {n}."}] for n in range(3)]

    def reply(messages: list[dict], extra: dict) -> str:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
            "model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0, "cache_prompt": False,
            **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    alone = [reply(m, {}) for m in asks] + [reply(ASK, probe)]
    assert alone[3] != reply(ASK, {})
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(reply, m, {}) for m in asks[:2]] + [pool.submit(reply, ASK, probe)] + \
                  [pool.submit(reply, asks[2], {})]
        together = [f.result() for f in futures]
    assert together[:2] == alone[:2] and together[3] == alone[2] and together[2] == alone[3]
