"""The steering plugin, through a real server: SAEs registered from SAELens folders and Gemma
Scope npz files, attached per layer; feature strengths steer a chat completion exactly as a
reference PyTorch forward hook adding Σ strength·W_dec[i] at the SAE's layer does; profiles,
the intensity dial and its header; embeddings and scoring never steered; profiles persist;
llama.cpp checks steering fields before loading."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from localm.sdk.testing import LocalmServer
import sae_fixtures as fixtures
from sae_fixtures import (
    decoder_rows,
    write_gemma_scope_npz,
    write_saelens_sae,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Name a colour."}]
LAYER = 20
HIDDEN = 576
D_SAE = 16
STRENGTH = 12.0
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
DIAL = "x-millm-steering-intensity"


@pytest.fixture(scope="module")
def reference() -> Any:
    return fixtures.smollm2_reference()


@pytest.fixture(scope="module")
def red(reference: Any) -> int:
    return reference[0].encode(" red", add_special_tokens=False)[0]


@pytest.fixture(scope="module")
def decoder(reference: Any, red: int) -> np.ndarray:
    """W_dec: row 0 along " red"'s unembedding, the rest random unit rows."""
    return decoder_rows(reference[1], [red], d_sae=D_SAE)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, decoder: np.ndarray) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("saes")
    return {"saelens": write_saelens_sae(root / "red", d_in=HIDDEN, d_sae=D_SAE, layer=LAYER, W_dec=decoder),
            "npz": write_gemma_scope_npz(root / "scope", d_in=HIDDEN, d_sae=32, seed=1),
            "narrow": write_saelens_sae(root / "narrow", d_in=64, d_sae=8, layer=3),
            "twin": write_saelens_sae(root / "twin", d_in=HIDDEN, d_sae=8, layer=LAYER, seed=2)}


def reference_logprobs(reference: Any, delta: np.ndarray | dict[int, np.ndarray] | None) -> Any:
    """The next-token log-probabilities after ASK, with ``delta`` added at LAYER's output (or
    each of ``{layer: delta}`` at its layer's) by a plain PyTorch forward hook."""
    deltas = {} if delta is None else delta if isinstance(delta, dict) else {LAYER: delta}
    return fixtures.reference_logprobs(reference, ASK, deltas)


@pytest.fixture(scope="module")
def server(module_server: Callable[..., Any]) -> Any:
    s = module_server(plugins=["chat", "transformers", "steering"], env=OFFLINE)
    r = s.owner().post("/v1/plugins/transformers/settings", json={"n_threads": 1})
    assert r.status_code == 200, r.text
    return s


@pytest.fixture(scope="module")
def owner(server: Any) -> httpx.Client:
    return server.owner()


@pytest.fixture(scope="module")
def sae(owner: httpx.Client, files: dict[str, Path]) -> str:
    """The " red" SAE, registered and attached at LAYER."""
    r = owner.post("/api/saes", json={"path": str(files["saelens"]), "id": "red"})
    assert r.status_code == 201, r.text
    assert r.status_code == 201 and (r.json()["layer"], r.json()["d_in"], r.json()["d_sae"]) == (LAYER, HIDDEN, D_SAE)
    r = owner.post("/api/saes/red/attach")
    assert r.status_code == 200, r.text
    return "red"


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused-in-open-mode")


def first_token(client: Any, **extra: Any) -> tuple[dict[int, float], dict[str, str]]:
    """The first reply token's 20 most likely alternatives by token id, and the response headers."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, max_tokens=2, temperature=0, logprobs=True, top_logprobs=20,
        extra_body={"return_tokens_as_token_ids": True, **extra})
    entry = raw.parse().choices[0].logprobs.content[0]
    return {int(alt.token.split(":")[1]): alt.logprob for alt in entry.top_logprobs}, dict(raw.headers)


def matches(steered: dict[int, float], expected: Any) -> bool:
    return max(abs(lp - float(expected[i])) for i, lp in steered.items()) <= 1e-4


def set_feature(owner: httpx.Client, index: int, strength: float, **extra: Any) -> dict[str, Any]:
    r = owner.post("/api/steering/features", json={"index": index, "strength": strength, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_registering_attaching_and_refusals(owner: httpx.Client, files: dict[str, Path], sae: str) -> None:
    assert owner.post("/api/saes", json={"path": str(files["npz"])}).json()["code"] == "invalid_parameter"  # no layer
    r = owner.post("/api/saes", json={"path": str(files["npz"]), "layer": 10, "id": "scope"})
    assert r.status_code == 201 and r.json()["format"] == "gemma_scope" and r.json()["d_sae"] == 32
    assert owner.post("/api/saes", json={"path": str(files["npz"]), "layer": 10, "id": "scope"}).status_code == 409
    assert owner.post("/api/saes", json={"path": "/nowhere"}).status_code == 400
    r = owner.post("/api/saes", json={"path": str(files["narrow"]), "id": "narrow"})
    assert r.status_code == 201
    r = owner.post("/api/saes/narrow/attach")  # d_in 64 against SmolLM2's 576, checked before any load
    assert r.status_code == 400 and r.json()["code"] == "sae_incompatible"
    assert "64" in r.json()["detail"] and "576" in r.json()["detail"]
    assert owner.post("/api/saes/twin/attach").status_code == 404

    assert owner.post("/api/saes/scope/attach").status_code == 200  # a second layer at once
    assert [(a["layer"], a["sae_id"]) for a in owner.get("/api/steering").json()["attached"]] == [(10, "scope"),
                                                                                                  (LAYER, "red")]
    owner.post("/api/saes", json={"path": str(files["twin"]), "id": "twin"})
    r = owner.post("/api/saes/twin/attach")  # one SAE per layer
    assert r.status_code == 409 and r.json()["code"] == "sae_layer_taken"
    assert owner.delete("/api/saes/scope").status_code == 409  # attached
    assert owner.post("/api/saes/scope/detach").status_code == 200
    assert owner.get("/api/saes/scope").json()["attached"] is False
    assert owner.get("/api/saes/red").json()["attached"] is True
    for sae_id in ("scope", "narrow", "twin"):
        assert owner.delete(f"/api/saes/{sae_id}").status_code == 200
    assert [s["id"] for s in owner.get("/api/saes").json()["saes"]] == ["red"]
    assert owner.get("/api/saes/scope").json()["code"] == "sae_not_found"


def test_a_feature_steers_as_a_reference_hook(owner: httpx.Client, client: Any, sae: str, reference: Any,
                                              decoder: np.ndarray, red: int) -> None:
    owner.post("/api/steering/clear")
    plain, headers = first_token(client)
    unsteered = reference_logprobs(reference, None)
    assert matches(plain, unsteered) and DIAL not in headers
    plain_text = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)

    state = set_feature(owner, 0, STRENGTH, label="red")
    assert state["live"] and state["features"] == [{"sae_id": "red", "index": 0, "strength": STRENGTH,
                                                    "label": "red", "layer": LAYER}]
    steered, headers = first_token(client)
    expected = reference_logprobs(reference, STRENGTH * decoder[0])
    assert matches(steered, expected) and DIAL not in headers
    assert float(expected[red]) > float(unsteered[red])  # steering raised " red"
    text = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    assert text.choices[0].message.content != plain_text.choices[0].message.content

    half, headers = first_token(client, steering_intensity=0.5)  # λ halves the delta
    assert matches(half, reference_logprobs(reference, STRENGTH / 2 * decoder[0]))
    assert headers[DIAL] == "0.5"

    off, headers = first_token(client, steering_intensity="off")
    assert matches(off, unsteered) and headers[DIAL] == "0.0"

    assert owner.post("/api/steering/disable").json()["live"] is False
    disabled, headers = first_token(client, steering_intensity=0.5)
    assert matches(disabled, unsteered) and DIAL not in headers  # a dial-only request while disabled
    assert owner.post("/api/steering/enable").json()["live"] is True


def test_two_layers_steer_at_once(owner: httpx.Client, client: Any, sae: str, reference: Any,
                                 decoder: np.ndarray, files: dict[str, Path]) -> None:
    r = owner.post("/api/saes", json={"path": str(files["npz"].parent), "layer": 10, "id": "scope10"})
    assert r.status_code == 201, r.text
    assert owner.post("/api/saes/scope10/attach").status_code == 200
    try:
        r = owner.post("/api/steering/features", json={"index": 0, "strength": STRENGTH})
        assert r.status_code == 400 and "name sae_id" in r.json()["detail"]  # two SAEs attached: which one?
        set_feature(owner, 0, STRENGTH, sae_id="red")
        set_feature(owner, 7, -6.0, sae_id="scope10")
        steered, _ = first_token(client)
        with np.load(files["npz"]) as z:
            scope = z["W_dec"]
        assert matches(steered, reference_logprobs(reference, {LAYER: STRENGTH * decoder[0], 10: -6.0 * scope[7]}))
    finally:
        owner.post("/api/saes/scope10/detach")
        owner.delete("/api/saes/scope10")
    assert [f["sae_id"] for f in owner.get("/api/steering").json()["features"]] == ["red"]


def test_strengths_are_clamped_and_checked(owner: httpx.Client, sae: str) -> None:
    state = owner.post("/api/steering/features/batch", json={"features": [
        {"index": 1, "strength": 500}, {"index": 2, "strength": -900.5}]}).json()
    assert {f["index"]: f["strength"] for f in state["features"]} == {0: STRENGTH, 1: 200.0, 2: -200.0}
    r = owner.post("/api/steering/features", json={"index": D_SAE, "strength": 1})
    assert r.status_code == 400 and r.json()["code"] == "invalid_feature_index"
    r = owner.post("/api/steering/features/batch", json={"features": [{"index": 3, "strength": 1},
                                                                      {"index": 4, "strength": "x"}]})
    assert r.status_code == 400 and len(owner.get("/api/steering").json()["features"]) == 3  # none applied
    assert owner.delete("/api/steering/features/1").status_code == 200
    assert owner.delete("/api/steering/features/1").status_code == 404
    assert owner.delete("/api/steering/features/2").status_code == 200
    assert [f["index"] for f in owner.get("/api/steering").json()["features"]] == [0]


def test_embeddings_and_scoring_are_never_steered(server: Any, owner: httpx.Client, sae: str) -> None:
    set_feature(owner, 0, STRENGTH)
    embed = {"model": MODEL, "input": "The sky is blue."}
    score = {"model": MODEL, "prompt": "The sky is", "max_tokens": 1, "logprobs": 5}
    steered_vec = httpx.post(server.url + "/v1/embeddings", json=embed, timeout=300).json()["data"]
    steered_score = httpx.post(server.url + "/v1/completions", json=score, timeout=300).json()["choices"]
    owner.post("/api/steering/disable")
    try:
        assert httpx.post(server.url + "/v1/embeddings", json=embed, timeout=300).json()["data"] == steered_vec
        assert httpx.post(server.url + "/v1/completions", json=score, timeout=300).json()["choices"] == steered_score
    finally:
        owner.post("/api/steering/enable")
    chat_score = {"model": MODEL, "messages": ASK, "max_tokens": 1, "logprobs": True, "profile": "x"}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat_score, timeout=60)
    assert r.status_code == 400 and "profile" in r.text
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                                     "steering_intensity": 0.5})
    assert r.status_code == 400 and r.json()["code"] == "field_not_honoured"


def test_profiles_and_the_intensity_dial(owner: httpx.Client, client: Any, sae: str, reference: Any,
                                         decoder: np.ndarray) -> None:
    owner.post("/api/steering/clear")
    doc = {"name": "crimson", "description": "a cluster toward red", "sae": {"id": "elsewhere", "layer": LAYER,
                                                                              "d_sae": D_SAE},
           "features": [{"index": 0, "strength": 8.0, "label": "red"}], "intensity_range": [0.5, 1.5]}
    r = owner.post("/api/profiles/import", json=doc)
    assert r.status_code == 201, r.text
    assert owner.post("/api/profiles/import", json=doc).json()["code"] == "profile_exists"

    def at(lam: float) -> Any:
        return reference_logprobs(reference, lam * 8.0 * decoder[0])

    before = owner.get("/api/steering").json()
    steered, headers = first_token(client, profile="crimson")  # the stored dial (1.0), no echo
    assert matches(steered, at(1.0)) and DIAL not in headers
    for dial, lam in (("max", 1.5), ("min", 0.5), (1.8, 1.5), (0.25, 0.25), (1.0, 1.0)):
        steered, headers = first_token(client, profile="crimson", steering_intensity=dial)
        assert matches(steered, at(lam)), dial
        assert float(headers[DIAL]) == lam, dial
    for dial in (0, "off"):
        steered, headers = first_token(client, profile="crimson", steering_intensity=dial)
        assert matches(steered, reference_logprobs(reference, None)) and float(headers[DIAL]) == 0.0
    assert owner.get("/api/steering").json() == before  # a per-request profile left the state alone

    for bad in (2.5, -0.1, "loud", True):
        with pytest.raises(openai.BadRequestError) as err:
            first_token(client, profile="crimson", steering_intensity=bad)
        assert err.value.body["code"] == "invalid_parameter"
    with pytest.raises(openai.NotFoundError) as err:
        first_token(client, profile="nobody")
    assert err.value.body["code"] == "profile_not_found"
    _, headers = first_token(client, steering_intensity=0.5)
    assert DIAL not in headers  # the live base is empty

    # a cluster without a declared range: "min" is cluster_intensity_min, "max" intensity_max
    owner.post("/api/profiles", json={"name": "open", "cluster": True, "features": [{"index": 0, "strength": 4.0}]})
    assert first_token(client, profile="open", steering_intensity="min")[1][DIAL] == "0.5"
    assert first_token(client, profile="open", steering_intensity="max")[1][DIAL] == "2.0"
    r = owner.post("/v1/plugins/steering/settings", json={"cluster_intensity_min": 0.75, "intensity_max": 1.25})
    assert r.status_code == 200, r.text
    try:
        assert first_token(client, profile="open", steering_intensity="min")[1][DIAL] == "0.75"
        assert first_token(client, profile="open", steering_intensity=1.9)[1][DIAL] == "1.25"
        assert first_token(client, profile="crimson", steering_intensity="max")[1][DIAL] == "1.25"  # range ∩ envelope
    finally:
        owner.post("/v1/plugins/steering/settings", json={"cluster_intensity_min": None, "intensity_max": None})

    # a profile made for another SAE width is refused; with no SAE attached a profile runs unsteered
    owner.post("/api/profiles", json={"name": "wide", "sae": {"layer": LAYER, "d_sae": 99},
                                      "features": [{"index": 0, "strength": 1.0}]})
    with pytest.raises(openai.BadRequestError):
        first_token(client, profile="wide")
    owner.post("/api/saes/red/detach")
    try:
        steered, headers = first_token(client, profile="crimson", steering_intensity="max")
        assert matches(steered, reference_logprobs(reference, None)) and DIAL not in headers
    finally:
        owner.post("/api/saes/red/attach")

    # activation: every request steers by the profile and its persistent dial
    assert owner.patch("/api/profiles/crimson", json={"intensity": 1.4}).json()["intensity"] == 1.4
    assert owner.patch("/api/profiles/crimson", json={"intensity": 1.6}).status_code == 400  # above the range
    state = owner.post("/api/profiles/crimson/activate").json()
    assert state["active_profile"] == "crimson" and state["base"] == "profile"
    steered, headers = first_token(client)
    assert matches(steered, at(1.4)) and DIAL not in headers
    owner.post("/api/profiles/deactivate")
    assert matches(first_token(client)[0], reference_logprobs(reference, None))

    # export, delete, import: the same document
    exported = owner.get("/api/profiles/crimson/export").json()
    assert exported["features"] == [{"index": 0, "strength": 8.0, "label": "red"}]
    assert exported["intensity_range"] == [0.5, 1.5] and exported["sae"]["d_sae"] == D_SAE
    assert owner.delete("/api/profiles/crimson").status_code == 200
    assert owner.get("/api/profiles/crimson").status_code == 404
    assert owner.post("/api/profiles/import", json=exported).status_code == 201
    assert owner.get("/api/profiles/crimson/export").json() == exported
    renamed = {**exported, "description": "replaced"}
    assert owner.post("/api/profiles/import", params={"overwrite": "true"}, json=renamed).status_code == 201
    assert owner.get("/api/profiles/crimson").json()["description"] == "replaced"
    assert {p["name"] for p in owner.get("/api/profiles").json()["profiles"]} == {"crimson", "open", "wide"}

    # a profile saved from the live values
    set_feature(owner, 3, -2.5)
    saved = owner.post("/api/profiles", json={"name": "live"}).json()
    assert saved["features"] == [{"index": 3, "strength": -2.5}] and saved["sae"]["id"] == "red"
    owner.post("/api/steering/clear")


def test_profiles_persist_across_a_restart(tmp_path: Path, files: dict[str, Path]) -> None:
    data = tmp_path / "data"
    first = LocalmServer(data, plugins=["chat", "steering"], env=OFFLINE).start()
    try:
        owner = first.owner()
        assert owner.post("/api/saes", json={"path": str(files["saelens"]), "id": "red"}).status_code == 201
        r = owner.post("/api/profiles", json={"name": "kept", "description": "d", "sae": {"id": "red"},
                                              "features": [{"index": 2, "strength": 3.0}], "intensity_range": [0, 1]})
        assert r.status_code == 201, r.text
        kept = owner.get("/api/profiles/kept").json()
    finally:
        first.stop()
    assert not [p for p in (data / "plugin-data" / "steering").iterdir() if p.name.endswith(".tmp")]
    second = LocalmServer(data, plugins=["chat", "steering"], env=OFFLINE).start()
    try:
        owner = second.owner()
        assert owner.get("/api/profiles/kept").json() == kept
        assert [s["id"] for s in owner.get("/api/saes").json()["saes"]] == ["red"]
    finally:
        second.stop()
    broken = data / "plugin-data" / "steering" / "profiles.json"
    broken.write_text("{not json")
    third = LocalmServer(data, plugins=["chat", "steering"], env=OFFLINE).start()
    try:
        owner = third.owner()
        r = owner.get("/api/profiles")
        assert r.status_code == 409 and r.json()["code"] == "unreadable_file"
        assert owner.post("/api/profiles", json={"name": "new", "features": []}).status_code == 409
        assert owner.get("/api/saes").status_code == 200  # the other files are served as before
    finally:
        third.stop()
    assert broken.read_text() == "{not json"  # never overwritten


def test_a_locked_model_is_the_only_one_listed(tmp_path: Path) -> None:
    from sae_fixtures import smollm2_gguf

    data = tmp_path / "data"
    first = LocalmServer(data, plugins=["chat", "steering"], env=OFFLINE)
    pulled = first.cli("pull", str(smollm2_gguf()), "--name", "other-model")
    assert pulled.returncode == 0, pulled.stderr + pulled.stdout
    first.start()
    try:
        owner = first.owner()
        listed = {m["id"] for m in owner.get("/v1/models").json()["data"]}
        assert {MODEL, "other-model"} <= listed
        assert owner.post("/api/steering/lock", json={"model": "nope"}).status_code == 404
        r = owner.post("/api/steering/lock", json={"model": "other-model"})
        assert r.status_code == 200 and r.json()["locked_model"] == "other-model"
        assert [m["id"] for m in owner.get("/v1/models").json()["data"]] == ["other-model"]
    finally:
        first.stop()
    second = LocalmServer(data, plugins=["chat", "steering"], env=OFFLINE).start()
    try:
        owner = second.owner()
        assert [m["id"] for m in owner.get("/v1/models").json()["data"]] == ["other-model"]  # kept
        assert owner.delete("/api/steering/lock").json()["locked_model"] is None
        assert {m["id"] for m in owner.get("/v1/models").json()["data"]} == listed
    finally:
        second.stop()


def test_llamacpp_checks_steering_fields_before_loading(module_server: Callable[..., Any]) -> None:
    """The default model steers on llama.cpp (tests/test_steering_gguf.py); what cannot be
    served is refused before it loads, as on transformers."""
    pytest.importorskip("llama_cpp")
    s = module_server(plugins=["chat", "llamacpp", "steering"])
    r = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": ASK, "profile": "anything"})
    assert r.status_code == 404 and r.json()["code"] == "profile_not_found", r.text
    r = httpx.post(s.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi", "profile": "x"})
    assert r.status_code == 400 and r.json()["code"] == "field_not_honoured" and r.json()["field"] == "profile"
    r = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": ASK, "return_sae_activations": {"positions": "last"}})
    assert r.status_code == 400 and r.json()["code"] == "no_sae_attached", r.text
    assert s.owner().get("/v1/models").json()["data"][0]["loaded"] is False


# --- return_sae_activations ----------------------------------------------------------------

def sae_weights(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    return {k: v.astype(np.float64) for k, v in load_file(str(folder / "sae_weights.safetensors")).items()}


def relu_encode(w: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """SAELens' standard encoder, written out here: ReLU((x - b_dec) @ W_enc + b_enc)."""
    return np.maximum((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"], 0.0)


def residual(reference: Any, ids: list[int], layer: int) -> np.ndarray:
    """The unsteered residual at ``layer``'s output for ``ids`` (positions × hidden)."""
    with torch.inference_mode():
        states = reference[1](torch.tensor([ids]), output_hidden_states=True).hidden_states
    return states[layer + 1][0].double().numpy()  # hidden_states[0] is the embeddings


def activations_of(reply: Any) -> dict[str, Any]:
    return reply.to_dict()["millm"]["sae_activations"]


def test_sae_activations_read_the_steered_residual(owner: httpx.Client, client: Any, sae: str, reference: Any,
                                                   decoder: np.ndarray, files: dict[str, Path]) -> None:
    owner.post("/api/steering/clear")
    set_feature(owner, 0, STRENGTH)
    ask = {"sae_id": "red", "features": list(range(D_SAE)), "top_k": D_SAE, "positions": "all"}

    def read(point: str) -> tuple[Any, dict[str, Any]]:
        reply = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=4, temperature=0,
            extra_body={"cache_prompt": False, "return_sae_activations": {**ask, "read_point": point}})
        return reply, activations_of(reply)

    reply, pre = read("pre_steering")
    again, post = read("post_steering")
    assert again.choices[0].message.content == reply.choices[0].message.content  # greedy: the same tokens
    assert (pre["sae_id"], pre["layer"], pre["read_point"], post["read_point"]) == ("red", LAYER, "pre_steering",
                                                                                   "post_steering")
    assert "counterfactual" in post["note"]
    used = reply.usage
    fed = used.prompt_tokens + used.completion_tokens - (1 if reply.choices[0].finish_reason == "length" else 0)
    assert [p["position"] for p in pre["positions"]] == list(range(fed))  # the last sampled token has no row
    assert [p["token_id"] for p in pre["positions"]] == [p["token_id"] for p in post["positions"]]
    tokenizer = reference[0]
    text = tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert [p["token_id"] for p in pre["positions"][:len(prompt_ids)]] == prompt_ids

    def table(read: dict[str, Any]) -> np.ndarray:
        out = np.zeros((len(read["positions"]), D_SAE))
        for n, p in enumerate(read["positions"]):
            assert len(p["features"]) == D_SAE
            values = [f["value"] for f in p["features"]]
            assert values == sorted(values, reverse=True)  # largest first
            for f in p["features"]:
                out[n, f["index"]] = f["value"]
        return out

    pre_acts, post_acts = table(pre), table(post)
    w = sae_weights(files["saelens"])
    delta = STRENGTH * decoder[0].astype(np.float64)
    # Exact, from the two replies alone: post's residual is pre's plus this layer's delta, so
    # wherever a feature is active at both read points its pre-activation moved by exactly
    # delta @ W_enc (the ReLU is the identity on both sides; b_dec and b_enc cancel).
    shift = delta @ w["W_enc"]
    both = (pre_acts > 0) & (post_acts > 0)
    assert both.sum() >= 10
    assert np.abs((post_acts - pre_acts - shift)[both]).max() <= 1e-2
    # And against an in-test encoding of a reference model's residual (the delta at layer L does
    # not reach layer L's own residual at any prompt position): pre == encode(x), post ==
    # encode(x + delta), zeros included.
    x = residual(reference, prompt_ids, LAYER)
    assert np.abs(pre_acts[:len(prompt_ids)] - relu_encode(w, x)).max() <= 2e-2
    assert np.abs(post_acts[:len(prompt_ids)] - relu_encode(w, x + delta)).max() <= 2e-2
    assert np.abs(post_acts - pre_acts).max() > 1.0  # the steering shows
    owner.post("/api/steering/clear")


def test_sae_activation_positions_top_k_and_streaming(owner: httpx.Client, client: Any, sae: str) -> None:
    owner.post("/api/steering/clear")
    plain = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0)
    assert "millm" not in plain.to_dict()  # did not ask: no millm key at all
    counts = plain.usage
    prompt, fed = counts.prompt_tokens, counts.prompt_tokens + counts.completion_tokens - 1

    def positions(where: Any, **extra: Any) -> list[dict[str, Any]]:
        reply = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0,
                                          extra_body={"return_sae_activations": {"positions": where, **extra}})
        assert reply.choices[0].text == plain.choices[0].text
        return activations_of(reply)["positions"]

    assert [p["position"] for p in positions("last")] == [fed - 1]
    assert [p["position"] for p in positions("prompt")] == list(range(prompt))
    assert [p["position"] for p in positions("completion")] == list(range(prompt, fed))
    assert [p["position"] for p in positions({"start": 1, "end": 3})] == [1, 2]
    assert [p["position"] for p in positions({"start": fed - 1, "end": fed + 50})] == [fed - 1]  # what was read
    some = positions("all", top_k=3, features=[2, 5, 7, 9])
    assert len(some) == fed and all(len(p["features"]) == 3 for p in some)
    assert all({f["index"] for f in p["features"]} <= {2, 5, 7, 9} for p in some)
    assert all(len(p["features"]) == 8 for p in positions("all"))  # top_k defaults to 8 of the whole width

    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0, stream=True,
                                            extra_body={"return_sae_activations": {"positions": "last"}})
    chunks = list(stream)
    extra = [c for c in chunks if not c.choices]
    assert len(extra) == 1 and chunks.index(extra[0]) == len(chunks) - 2  # just before the finishing chunk
    found = extra[0].to_dict()["millm"]["sae_activations"]
    assert found["sae_id"] == "red" and len(found["positions"]) == 1
    plain_stream = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, stream=True))
    assert all(c.choices and "millm" not in c.to_dict() for c in plain_stream)


def test_sae_activation_refusals(owner: httpx.Client, client: Any, sae: str, reference: Any,
                                 tmp_path: Path) -> None:
    def refused(extra: dict[str, Any], *, text: bool = False, **body: Any) -> dict[str, Any]:
        with pytest.raises(openai.BadRequestError) as err:
            if text:
                client.completions.create(model=MODEL, **{"prompt": "Hi", "max_tokens": 2, **body}, extra_body=extra)
            else:
                client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra,
                                               **{"max_tokens": 2, **body})
        return err.value.body

    def ask(**fields: Any) -> dict[str, Any]:
        return {"return_sae_activations": fields}

    assert "n must be 1" in refused(ask(), n=2)["message"]
    assert "prompt" in refused(ask(), text=True, prompt=["one", "two"])["message"]
    assert refused(ask(features=[D_SAE]))["code"] == "invalid_feature_index"
    assert "top_k 65" in refused(ask(top_k=65))["message"]
    worst = refused(ask(positions="completion", top_k=64), max_tokens=5000)["message"]  # top_k: the width, 16
    assert "5000 positions × top_k 16 = 80000" in worst and "65536" in worst
    assert "worst case" in refused(ask(positions="all", top_k=9), max_tokens=None)["message"]  # the window × 9
    assert "positions" in refused(ask(positions="middle"))["message"]
    assert "read_point" in refused(ask(read_point="during"))["message"]
    assert "unknown keys" in refused(ask(layer=3))["message"]
    assert refused(ask(sae_id="nobody"))["code"] == "no_sae_attached"

    scoring = {"model": MODEL, "messages": ASK, "max_tokens": 1, "logprobs": True, **ask()}
    r = httpx.post(str(client.base_url) + "chat/completions", json=scoring, timeout=60)
    assert r.status_code == 400 and r.json()["code"] == "field_not_honoured"  # scoring is never read

    # a Gemma Scope JumpReLU SAE whose threshold gates: pre = x @ W_enc + b_enc, kept where above it
    jump = write_gemma_scope_npz(tmp_path / "jump", d_in=HIDDEN, d_sae=32, seed=3, threshold=0.5)
    r = owner.post("/api/saes", json={"path": str(jump), "layer": 10, "id": "scope10"})
    assert r.status_code == 201, r.text
    assert owner.post("/api/saes/scope10/attach").status_code == 200
    try:
        message = refused(ask())["message"]
        assert "red (layer 20)" in message and "scope10 (layer 10)" in message and "sae_id" in message
        text = "The sky is"
        reply = client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0, extra_body={
            "return_sae_activations": {"sae_id": "scope10", "top_k": 32, "positions": "prompt"}})
        read = activations_of(reply)
        assert read["layer"] == 10 and read["read_point"] == "post_steering"
        ids = [p["token_id"] for p in read["positions"]]
        got = np.zeros((len(ids), 32))
        for n, p in enumerate(read["positions"]):
            for f in p["features"]:
                got[n, f["index"]] = f["value"]
        with np.load(jump) as z:
            w = {k: z[k].astype(np.float64) for k in z.files}
        pre = residual(reference, ids, 10) @ w["W_enc"] + w["b_enc"]
        assert ((pre > 0) & (pre <= 0.5)).any()  # the threshold matters here
        assert np.abs(got - pre * (pre > w["threshold"])).max() <= 2e-2
    finally:
        owner.post("/api/saes/scope10/detach")
        owner.delete("/api/saes/scope10")
    owner.post("/api/saes/red/detach")
    try:
        assert refused(ask())["code"] == "no_sae_attached"
    finally:
        owner.post("/api/saes/red/attach")
