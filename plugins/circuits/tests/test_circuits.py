"""The circuits plugin, through a real server: a circuit's members across three layers steer a
chat completion exactly as a reference PyTorch hook adding each layer's Σ clamp(λ·strength)·W_dec[i]
does; one λ scales them all, clamped at both ends into the declared range; each member is clamped
to ±200; the X-miLLM-Circuit-Rung header (RFC 8941) and GET /api/circuits/active say when a
circuit is actually steering; circuits persist across a restart."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from localm.sdk.testing import LocalmServer
from sae_fixtures import decoder_rows, write_saelens_sae
import sae_fixtures as fixtures

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
openai = pytest.importorskip("openai")
http_sfv = pytest.importorskip("http_sfv")

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Name a colour."}]
LAYERS = (6, 13, 20)
HIDDEN = 576
D_SAE = 8
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
RUNG = "x-millm-circuit-rung"
MEMBERS = [{"layer": 6, "feature": 1, "strength": 3.0}, {"layer": 13, "feature": 2, "strength": -2.0},
           {"layer": 20, "feature": 0, "strength": 4.0}, {"layer": 20, "feature": 3, "strength": 1.5}]


@pytest.fixture(scope="module")
def reference() -> Any:
    return fixtures.smollm2_reference()


@pytest.fixture(scope="module")
def decoders(reference: Any) -> dict[int, np.ndarray]:
    """W_dec per layer: at layer 20 row 0 is along " red"'s unembedding; the rest random unit rows."""
    red = reference[0].encode(" red", add_special_tokens=False)[0]
    return {layer: decoder_rows(reference[1], [red] if layer == 20 else [], d_sae=D_SAE, seed=layer)
            for layer in LAYERS}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, decoders: dict[int, np.ndarray]) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("circuit-saes")
    return {layer: write_saelens_sae(root / f"l{layer}", d_in=HIDDEN, d_sae=D_SAE, layer=layer, W_dec=w)
            for layer, w in decoders.items()}


def reference_logprobs(reference: Any, deltas: dict[int, np.ndarray]) -> Any:
    return fixtures.reference_logprobs(reference, ASK, deltas)


def circuit_deltas(decoders: dict[int, np.ndarray], lam: float, members: list[dict] = MEMBERS) -> dict:
    out: dict[int, np.ndarray] = {}
    for m in members:
        step = max(-200.0, min(200.0, lam * m["strength"]))
        row = decoders[m["layer"]][m["feature"]].astype(np.float64)
        out[m["layer"]] = out.get(m["layer"], np.zeros(HIDDEN)) + step * row
    return {layer: d.astype(np.float32) for layer, d in out.items()}


@pytest.fixture(scope="module")
def server(module_server: Callable[..., Any]) -> Any:
    s = module_server(plugins=["chat", "transformers", "steering", "circuits"], env=OFFLINE)
    r = s.owner().post("/v1/plugins/transformers/settings", json={"n_threads": 1})
    assert r.status_code == 200, r.text
    return s


@pytest.fixture(scope="module")
def owner(server: Any) -> httpx.Client:
    return server.owner()


@pytest.fixture(scope="module")
def saes(owner: httpx.Client, files: dict[int, Path]) -> list[str]:
    for layer, path in files.items():
        r = owner.post("/api/saes", json={"path": str(path), "id": f"l{layer}"})
        assert r.status_code == 201, r.text
        r = owner.post(f"/api/saes/l{layer}/attach")
        assert r.status_code == 200, r.text
    return [f"l{layer}" for layer in LAYERS]


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused-in-open-mode")


def first_token(client: Any, **extra: Any) -> tuple[dict[int, float], dict[str, str]]:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, max_tokens=2, temperature=0, logprobs=True, top_logprobs=20,
        extra_body={"return_tokens_as_token_ids": True, **extra})
    entry = raw.parse().choices[0].logprobs.content[0]
    return {int(alt.token.split(":")[1]): alt.logprob for alt in entry.top_logprobs}, dict(raw.headers)


def matches(steered: dict[int, float], expected: Any) -> bool:
    return max(abs(lp - float(expected[i])) for i, lp in steered.items()) <= 1e-4


def rung_of(headers: dict[str, str]) -> tuple[int, str]:
    item = http_sfv.Item()
    item.parse(headers[RUNG].encode())
    return item.value, item.params["language"]


DOC = {"name": "redwards", "description": "three layers toward red", "rung": 2, "intensity_range": [0.5, 1.5],
       "members": MEMBERS}


def test_documents_and_refusals(owner: httpx.Client) -> None:
    r = owner.post("/api/circuits", json=DOC)
    assert r.status_code == 201, r.text
    assert r.json()["intensity"] == 1.0 and r.json()["mode"] == "circuit" and len(r.json()["members"]) == 4
    assert owner.post("/api/circuits", json=DOC).json()["code"] == "circuit_exists"
    for bad in ({**DOC, "name": "x", "rung": 4}, {**DOC, "name": "x", "members": []},
                {**DOC, "name": "x", "intensity_range": [1.5, 0.5]},
                {**DOC, "name": "x", "members": [{"layer": 1, "feature": -1, "strength": 1}]},
                {**DOC, "name": "x", "mode": "slice_fallback"}):
        r = owner.post("/api/circuits", json=bad)
        assert r.status_code == 400 and r.json()["code"] == "invalid_parameter", bad
    assert [c["name"] for c in owner.get("/api/circuits").json()["circuits"]] == ["redwards"]
    assert owner.get("/api/circuits/redwards").json()["rung"] == 2
    assert owner.get("/api/circuits/nobody").json()["code"] == "circuit_not_found"
    assert owner.post("/api/circuits/nobody/activate").status_code == 404
    assert owner.put("/api/circuits/active/intensity", json={"intensity": 1.0}).status_code == 409
    assert owner.get("/api/circuits/active").json()["active"] is None


def test_a_circuit_steers_as_a_reference_hook(owner: httpx.Client, client: Any, saes: list[str], reference: Any,
                                              decoders: dict[int, np.ndarray]) -> None:
    plain, headers = first_token(client)
    unsteered = reference_logprobs(reference, {})
    assert matches(plain, unsteered) and RUNG not in headers

    active = owner.post("/api/circuits/redwards/activate").json()
    assert active["active"] == "redwards" and active["steering"]["steering"] is True
    assert active["steering"]["language"] == "causally validated (edge)" and active["steering"]["layers"] == [6, 13, 20]
    assert owner.delete("/api/circuits/redwards").json()["code"] == "circuit_active"

    steered, headers = first_token(client)
    exp = reference_logprobs(reference, circuit_deltas(decoders, 1.0))
    assert matches(steered, exp)
    assert rung_of(headers) == (2, "causally validated (edge)")
    assert headers[RUNG] == active["steering"]["header"]

    # one λ scales every member; both ends clamped into [0.5, 1.5]; only 0/"off" below the floor
    for dial, lam in ((0.8, 0.8), ("min", 0.5), (0.1, 0.5), ("max", 1.5), (1.9, 1.5)):
        steered, headers = first_token(client, steering_intensity=dial)
        assert matches(steered, reference_logprobs(reference, circuit_deltas(decoders, lam))), dial
        assert rung_of(headers)[0] == 2
        assert headers["x-millm-steering-intensity"] == repr(float(lam))  # the resolved λ, echoed
    for dial in (0, "off"):
        steered, headers = first_token(client, steering_intensity=dial)
        assert matches(steered, unsteered) and RUNG not in headers

    # the persistent dial: absolute (re-derived from the authored strengths), clamped
    view = owner.put("/api/circuits/active/intensity", json={"intensity": 0.1}).json()
    assert view["intensity"] == 0.5 and view["circuit"]["members"] == MEMBERS
    view = owner.put("/api/circuits/active/intensity", json={"intensity": 1.2}).json()
    assert view["intensity"] == 1.2
    steered, _ = first_token(client)
    assert matches(steered, reference_logprobs(reference, circuit_deltas(decoders, 1.2)))
    assert owner.put("/api/circuits/active/intensity", json={"intensity": 3}).status_code == 400
    view = owner.put("/api/circuits/active/intensity", json={"intensity": "off"}).json()
    assert view["intensity"] == 0.0 and view["steering"]["steering"] is False
    assert RUNG not in first_token(client)[1]
    owner.put("/api/circuits/active/intensity", json={"intensity": 1.0})

    # no SAE on a member layer: unsteered, no header, and the active view says so
    assert owner.post("/api/saes/l13/detach").status_code == 200
    try:
        assert owner.get("/api/circuits/active").json()["steering"]["steering"] is False
        steered, headers = first_token(client)
        assert matches(steered, unsteered) and RUNG not in headers
    finally:
        assert owner.post("/api/saes/l13/attach").status_code == 200

    view = owner.post("/api/circuits/deactivate").json()
    assert view["active"] is None and view["steering"]["steering"] is False
    steered, headers = first_token(client)
    assert matches(steered, unsteered) and RUNG not in headers


def test_members_clamp_at_200_and_an_open_range(owner: httpx.Client, client: Any, saes: list[str], reference: Any,
                                                decoders: dict[int, np.ndarray]) -> None:
    members = [{"layer": 20, "feature": 0, "strength": 150.0}, {"layer": 20, "feature": 1, "strength": 10.0},
               {"layer": 6, "feature": 2, "strength": -120.0}]
    r = owner.post("/api/circuits", json={"name": "strong", "rung": 0, "members": members})
    assert r.status_code == 201, r.text
    owner.post("/api/circuits/strong/activate")
    try:
        # no declared range: [circuit_intensity_min = 0, intensity_max = 2]; at λ=2 the big members hit ±200
        steered, headers = first_token(client, steering_intensity="max")
        assert matches(steered, reference_logprobs(reference, circuit_deltas(decoders, 2.0, members)))
        assert rung_of(headers) == (0, "associated")
        steered, headers = first_token(client, steering_intensity="min")  # "min" is "off" here
        assert matches(steered, reference_logprobs(reference, {})) and RUNG not in headers
        # a per-request circuit by name, over the active one
        steered, headers = first_token(client, circuit="redwards", steering_intensity=0.7)
        assert matches(steered, reference_logprobs(reference, circuit_deltas(decoders, 0.7)))
        assert rung_of(headers)[0] == 2
        with pytest.raises(openai.NotFoundError):
            first_token(client, circuit="nobody")
    finally:
        owner.post("/api/circuits/deactivate")


def test_slice_fallback_serves_by_its_cluster(owner: httpx.Client, client: Any, saes: list[str], reference: Any,
                                              decoders: dict[int, np.ndarray]) -> None:
    r = owner.post("/api/profiles/import", json={"name": "slice", "sae": {"id": "l20", "layer": 20, "d_sae": D_SAE},
                                                 "features": [{"index": 0, "strength": 6.0}], "cluster": True})
    assert r.status_code == 201, r.text
    doc = {"name": "fallback", "rung": 3, "mode": "slice_fallback", "fallback_profile": "slice",
           "members": [{"layer": 20, "feature": 0, "strength": 6.0}]}
    assert owner.post("/api/circuits", json=doc).status_code == 201
    view = owner.post("/api/circuits/fallback/activate").json()
    assert view["steering"]["steering"] is False and view["steering"]["mode"] == "slice_fallback"
    try:
        # the cluster rule: "min" is cluster_intensity_min (0.5), not the circuit floor; no rung header
        steered, headers = first_token(client, steering_intensity="min")
        assert matches(steered, reference_logprobs(reference, {20: 0.5 * 6.0 * decoders[20][0]}))
        assert RUNG not in headers
    finally:
        owner.post("/api/circuits/deactivate")
    assert owner.post("/api/circuits", json={**doc, "name": "orphan", "fallback_profile": "nobody"}).status_code == 201
    assert owner.post("/api/circuits/orphan/activate").json()["code"] == "profile_not_found"


def test_an_unparseable_definition_does_not_steer(server: Any, owner: httpx.Client, client: Any, saes: list[str],
                                                  reference: Any) -> None:
    owner.post("/api/circuits/redwards/activate")
    path = server.data_dir / "plugin-data" / "circuits" / "circuits.json"
    kept = path.read_text()
    data = json.loads(kept)
    data["circuits"]["redwards"]["rung"] = "high"
    path.write_text(json.dumps(data))
    try:
        steered, headers = first_token(client)
        assert matches(steered, reference_logprobs(reference, {})) and RUNG not in headers
        view = owner.get("/api/circuits/active").json()
        assert view["steering"]["steering"] is False and "rung" in view["error"]
        with pytest.raises(openai.ConflictError):
            first_token(client, circuit="redwards")
    finally:
        path.write_text(kept)
        owner.post("/api/circuits/deactivate")


def test_llamacpp_checks_the_circuit_field_before_loading(module_server: Callable[..., Any]) -> None:
    pytest.importorskip("llama_cpp")
    s = module_server(plugins=["chat", "llamacpp", "steering", "circuits"])
    r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={"model": MODEL, "messages": ASK, "circuit": "x"})
    assert r.status_code == 404 and r.json()["code"] == "circuit_not_found", r.text
    assert s.owner().get("/v1/models").json()["data"][0]["loaded"] is False


def test_circuits_persist_across_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = LocalmServer(data, plugins=["chat", "steering", "circuits"], env=OFFLINE).start()
    try:
        owner = first.owner()
        assert owner.post("/api/circuits", json=DOC).status_code == 201
        owner.post("/api/circuits/redwards/activate")
        owner.put("/api/circuits/active/intensity", json={"intensity": 1.25})
        kept = owner.get("/api/circuits/redwards").json()
    finally:
        first.stop()
    assert not [p for p in (data / "plugin-data" / "circuits").iterdir() if p.name.endswith(".tmp")]
    second = LocalmServer(data, plugins=["chat", "steering", "circuits"], env=OFFLINE).start()
    try:
        owner = second.owner()
        assert owner.get("/api/circuits/redwards").json() == kept and kept["intensity"] == 1.25
        view = owner.get("/api/circuits/active").json()
        assert view["active"] == "redwards" and view["steering"]["steering"] is False  # no SAE attached here
    finally:
        second.stop()
