"""Capability routing, as the spec writes it: an unpinned request goes to an installed model
that has what it needs (an image, min_context, required_capabilities), a named model is never
swapped unless pin_model is false, X-Localm-Model-Routing explains, the body's model names who
answered, and a routed model does not become the loaded model.

Models: SmolLM2 (text, the default), the same weights paired with a small real projector
(vision), a tiny random Llama on the transformers engine whose trained window is 32768
(context), and a vision entry whose projector was deleted after it was registered (it fails
to load, so routing falls back to the next capable model)."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from localm.sdk.testing import offline_cli

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
mmproj_fixtures = pytest.importorskip("mmproj_fixtures")

TEXT = "smollm2-135m-instruct"
VISION = "smolvlm-test"
BROKEN = "aaa-broken-vision"  # first by name: tried first, fails to load
LONG = "long-tiny"
HEADER = "x-localm-model-routing"


def image_message(seed: int = 1) -> list[dict[str, Any]]:
    uri = "data:image/png;base64," + base64.b64encode(mmproj_fixtures.png_bytes(seed)).decode()
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": uri}}]}]


@pytest.fixture(scope="module")
def server(localm_module_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("torch")
    vlm_fixtures = pytest.importorskip("vlm_fixtures")
    folder = tmp_path_factory.mktemp("routing")
    projector = mmproj_fixtures.write_projector(folder / "mmproj-test-f32.gguf")
    doomed = shutil.copy(projector, folder / "mmproj-doomed.gguf")
    long = vlm_fixtures.write_tiny_llm(folder / "long")
    config = json.loads((long / "config.json").read_text())
    (long / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))

    def prepare(data: Path) -> None:
        model = str(mmproj_fixtures.smollm2_gguf())
        offline_cli(data, "pull", model, "--name", VISION, "--mmproj", str(projector))
        offline_cli(data, "pull", model, "--name", BROKEN, "--mmproj", str(doomed))
        offline_cli(data, "pull", str(long), "--name", LONG)
        Path(doomed).unlink()
        (data / "config.json").write_text(json.dumps({"plugins": {"llamacpp": {"n_threads": 1},
                                                                  "transformers": {"n_ctx": 32768}}}))

    return localm_module_server(prepare=prepare, plugins=["chat", "llamacpp", "transformers", "openai",
                                                          "anthropic"],
                                env={"HF_HUB_OFFLINE": "1"})


def chat(server: Any, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(server.url + path, json={"max_tokens": 2, "temperature": 0, **body}, timeout=120)


def active(server: Any) -> str | None:
    owner = {"Authorization": f"Bearer {server.token}"}
    loaded = httpx.get(server.url + "/api/models/loaded", headers=owner).json()["models"]
    return next((m["id"] for m in loaded if m["active"]), None)


def test_an_unpinned_image_goes_to_a_model_that_sees(server: Any) -> None:
    plain = chat(server, {"messages": [{"role": "user", "content": "Hi"}]})
    assert plain.status_code == 200 and plain.json()["model"] == TEXT and HEADER not in plain.headers
    r = chat(server, {"model": "localm", "messages": image_message()})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == VISION  # the body names who answered
    header = json.loads(r.headers[HEADER])
    assert header["resolved"] == VISION and header["requested"] == "localm" and header["routed"] is True
    assert header["pinned"] is False and header["gaps"] == {"vision": "absent"} and header["unmet"] == []
    assert BROKEN in header["load_errors"] and "mmproj-doomed.gguf" in header["load_errors"][BROKEN]
    assert active(server) == TEXT  # loaded for the request, not made the loaded model
    after = chat(server, {"messages": [{"role": "user", "content": "Hi"}]})
    assert after.json()["model"] == TEXT and HEADER not in after.headers


def test_a_named_model_is_pinned_unless_pin_model_is_false(server: Any) -> None:
    refused = chat(server, {"model": TEXT, "messages": image_message()})
    assert refused.status_code == 400 and "this model takes text only" in refused.text
    r = chat(server, {"model": TEXT, "pin_model": False, "messages": image_message(2)})
    assert r.status_code == 200 and r.json()["model"] == VISION
    header = json.loads(r.headers[HEADER])
    assert header["requested"] == TEXT and header["routed"] is True
    pinned = chat(server, {"pin_model": True, "messages": image_message(3)})  # unnamed but pinned
    assert pinned.status_code == 400 and "this model takes text only" in pinned.text


def test_min_context_goes_to_a_model_trained_for_it(server: Any) -> None:
    r = chat(server, {"prompt": "Hello", "min_context": 20000}, "/v1/completions")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == LONG
    header = json.loads(r.headers[HEADER])
    assert header["gaps"] == {"context": "absent"} and header["routed"] is True and header["unmet"] == []
    r = chat(server, {"prompt": "Hello", "min_context": 100_000}, "/v1/completions")  # no model holds it
    assert r.status_code == 200 and r.json()["model"] == TEXT
    header = json.loads(r.headers[HEADER])
    assert header["routed"] is False and header["unmet"] == ["context"]


def test_a_capability_no_model_has_stays_put_and_says_unmet(server: Any) -> None:
    r = chat(server, {"messages": [{"role": "user", "content": "Hi"}], "required_capabilities": ["reasoning"]})
    assert r.status_code == 200 and r.json()["model"] == TEXT
    assert json.loads(r.headers[HEADER]) == {"resolved": TEXT, "requested": "localm", "routed": False,
                                             "pinned": False, "gaps": {"reasoning": "absent"},
                                             "unmet": ["reasoning"]}
    pinned = chat(server, {"model": TEXT, "messages": [{"role": "user", "content": "Hi"}],
                           "required_capabilities": ["reasoning"]})
    header = json.loads(pinned.headers[HEADER])
    assert header["pinned"] is True and header["unmet"] == [] and header["gaps"] == {"reasoning": "absent"}
    bad = chat(server, {"messages": [{"role": "user", "content": "Hi"}], "required_capabilities": ["telepathy"]})
    assert bad.status_code == 400 and "'telepathy' is not one of vision, audio_input, tool_use, reasoning" in bad.text
    assert "x-localm-ignored-fields" not in r.headers  # the routing fields are read, not ignored


def test_openai_and_anthropic_clients_are_routed_alike(server: Any) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(model="localm", max_tokens=2, messages=image_message(4))
    assert raw.parse().model == VISION and json.loads(raw.headers[HEADER])["routed"] is True
    c = anthropic.Anthropic(base_url=server.url, api_key="unused")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(mmproj_fixtures.png_bytes(5)).decode()}}
    message = [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
    r = c.messages.with_raw_response.create(model="localm", max_tokens=2, messages=message)
    assert r.parse().model == VISION and json.loads(r.headers[HEADER])["resolved"] == VISION
    counted = c.messages.with_raw_response.count_tokens(model="localm", messages=message)
    assert json.loads(counted.headers[HEADER])["resolved"] == VISION
    assert counted.parse().input_tokens == r.parse().usage.input_tokens


def test_a_conversation_too_long_for_the_model_goes_to_one_trained_for_it(server: Any) -> None:
    long = [{"role": "user", "content": "sea " * 9000 + "What is this about?"}]  # past SmolLM2's 8192
    r = chat(server, {"messages": long})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == LONG and "x-localm-context-compacted" not in r.headers
    header = json.loads(r.headers[HEADER])
    assert header["routed"] is True and header["resolved"] == LONG and header["gaps"] == {"context": "absent"}
    pinned = chat(server, {"model": TEXT, "messages": long, "max_tokens": 8000})  # pinned: compacted or refused
    assert pinned.status_code in (200, 400, 413) and HEADER not in pinned.headers
