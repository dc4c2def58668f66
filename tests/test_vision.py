"""Pictures into a chat model through every surface, with the official clients: SmolLM2 paired
with a small real LLaVA-style projector (random weights, mmproj_fixtures) on the llama.cpp
engine. Nothing here depends on what the picture shows: the reply's log probabilities depend
on which picture was sent, the image positions are counted in the usage, a text-only model
refuses a picture clearly, and a picture that would decode to too many pixels is refused
before anything decodes it."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import TEST_STORE
from localm.sdk.testing import offline_cli

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
anthropic = pytest.importorskip("anthropic")
mmproj_fixtures = pytest.importorskip("mmproj_fixtures")

VISION = "smolvlm-test"
TEXT = "smollm2-135m-instruct"
IMAGE_POSITIONS = mmproj_fixtures.tokens_per_image()


def png(seed: int) -> bytes:
    return mmproj_fixtures.png_bytes(seed)


def data_uri(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(seed)).decode()


@pytest.fixture(scope="module")
def server(localm_module_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("vision")
    projector = mmproj_fixtures.write_projector(folder / "mmproj-test-f32.gguf")

    def prepare(data: Path) -> None:  # the default model, and the same weights paired with a projector
        offline_cli(data, "pull", str(mmproj_fixtures.smollm2_gguf()), "--name", VISION, "--mmproj", str(projector))
        (data / "config.json").write_text(json.dumps({"plugins": {"llamacpp": {"n_threads": 1}}}))
        offline_cli(data, "plugin", "install", str(TEST_STORE / "slowinlet"))  # holds a stream open early

    return localm_module_server(prepare=prepare, plugins=["chat", "llamacpp", "openai", "ollama", "anthropic",
                                                          "responses", "slowinlet"])


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def ask(client: Any, seed: int, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=VISION, max_tokens=1, temperature=0, logprobs=True, top_logprobs=5,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                               {"type": "image_url", "image_url": {"url": data_uri(seed)}}]}],
        **extra)


def first_logprobs(reply: Any) -> dict[str, float]:
    return {t.token: t.logprob for t in reply.choices[0].logprobs.content[0].top_logprobs}


def test_the_registry_pairs_the_projector_and_says_the_model_sees(server: Any) -> None:
    owner = {"Authorization": f"Bearer {server.token}"}
    model = httpx.get(f"{server.url}/v1/models/{VISION}", headers=owner).json()
    assert model["vision"] is True and model["audio_input"] is False
    assert model["capabilities"]["projector"] == "mmproj-test-f32.gguf"  # its name: no path leaves the server
    assert httpx.get(f"{server.url}/v1/models/{TEXT}", headers=owner).json()["vision"] is False
    shown = httpx.post(f"{server.url}/api/show", json={"model": VISION}).json()
    assert "vision" in shown["capabilities"]


def test_a_stream_open_while_its_request_is_prepared_says_it_is_encoding_the_image(server: Any) -> None:
    """An inlet hook slower than the opening delay opens the stream; what follows (the picture
    encoded on the CPU) is said live, before the reply."""
    body = {"model": VISION, "max_tokens": 2, "stream": True, "slow": 0.7,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                      {"type": "image_url", "image_url": {"url": data_uri(7)}}]}]}
    with httpx.Client(base_url=server.url, timeout=120) as c, \
            c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    codes = [e["choices"][0]["delta"].get("status_code") for e in events if e.get("choices")]
    codes = [c for c in codes if c]
    assert codes[:2] == ["chat_hooks", "slowinlet"], codes
    assert codes.index("processing") < codes.index("encoding_image_cpu") < len(codes) - 1, codes
    assert [e["choices"][0]["finish_reason"] for e in events if e.get("choices")][-1] == "length"


def test_openai_a_picture_changes_the_reply_and_counts_its_positions(client: Any) -> None:
    text_only = client.chat.completions.create(
        model=VISION, max_tokens=1, temperature=0,
        messages=[{"role": "user", "content": "What is in this picture?"}])
    one, again, other = ask(client, 1), ask(client, 1), ask(client, 2)
    assert one.usage.prompt_tokens == text_only.usage.prompt_tokens + IMAGE_POSITIONS  # give or take the joins
    assert first_logprobs(one) == pytest.approx(first_logprobs(again), abs=1e-3)  # the same picture repeats
    a, b = first_logprobs(one), first_logprobs(other)
    assert a.keys() != b.keys() or any(not math.isclose(a[k], b[k], abs_tol=1e-3) for k in a)


def test_ollama_images_on_chat_and_generate(server: Any) -> None:
    c = ollama.Client(host=server.url)
    r = c.chat(model=VISION, messages=[{"role": "user", "content": "Describe it.", "images": [png(3)]}],
               options={"temperature": 0, "num_predict": 4})
    assert r.done and r.prompt_eval_count > IMAGE_POSITIONS
    g = c.generate(model=VISION, prompt="Describe it.", images=[png(6)], options={"temperature": 0, "num_predict": 4})
    assert g.done and g.prompt_eval_count > IMAGE_POSITIONS


def test_anthropic_image_blocks(server: Any) -> None:
    c = anthropic.Anthropic(base_url=server.url, api_key="unused")
    r = c.messages.create(model=VISION, max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(png(4)).decode()}},
        {"type": "text", "text": "Describe it."}]}])
    assert r.usage.input_tokens > IMAGE_POSITIONS
    count = c.messages.count_tokens(model=VISION, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(png(4)).decode()}},
        {"type": "text", "text": "Describe it."}]}])
    assert count.input_tokens == r.usage.input_tokens


def test_responses_input_image(client: Any) -> None:
    r = client.responses.create(model=VISION, max_output_tokens=4, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Describe it."}, {"type": "input_image", "image_url": data_uri(5)}]}])
    assert r.usage.input_tokens > IMAGE_POSITIONS


def test_a_text_only_model_refuses_a_picture_clearly(client: Any, server: Any) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=TEXT, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(1)}}]}])
    assert "messages[0].content[0]: this model takes text only" in str(err.value)
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=server.url).chat(model=TEXT, messages=[{"role": "user", "content": "x",
                                                                   "images": [png(1)]}])
    assert refused.value.error == "messages[0].images[0]: this model takes text only"


def test_a_picture_too_large_is_refused_before_it_is_decoded(client: Any) -> None:
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    bomb = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 50_000, 50_000, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 1024)) + chunk(b"IEND", b""))
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=VISION, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(bomb).decode()}}]}])
    assert err.value.status_code == 413 and "50000x50000 pixels" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=VISION, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}]}])
    assert "the server fetches no URL" in str(err.value)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=VISION, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(1)}}] * 17}])
    assert err.value.status_code == 413 and "at most 16 images" in str(err.value)


def jpeg_uri(seed: int) -> str:
    """A picture as Open WebUI's image upload sends it: the browser's canvas re-encodes it (JPEG)."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.open(io.BytesIO(png(seed))).convert("RGB").save(out, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


def test_open_webui_image_upload_on_both_connections(server: Any) -> None:
    """Open WebUI's request shapes, replayed: on an OpenAI connection the chat form goes out as
    is (a content list with an image_url data URI, streamed, with its metadata); on an Ollama
    connection its payload converter (open_webui/utils/payload.py,
    convert_messages_openai_to_ollama) joins the text, strips the data: prefix into images."""
    uri = jpeg_uri(7)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                             {"type": "image_url", "image_url": {"url": uri}}]}]
    form = {"model": VISION, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
            "metadata": {"chat_id": "c1", "message_id": "m1", "session_id": "s1"}, "max_tokens": 4}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=form, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])["usage"]
    assert usage["prompt_tokens"] > IMAGE_POSITIONS
    converted = {"model": VISION, "stream": True, "options": {"num_predict": 4},
                 "messages": [{"role": "user", "content": "What is in this picture?",
                               "images": [jpeg_uri(8).split(",")[-1]]}],
                 "metadata": form["metadata"]}
    with httpx.stream("POST", server.url + "/api/chat", json=converted, timeout=120) as r:
        chunks = [json.loads(line) for line in r.iter_lines() if line]
    assert r.status_code == 200 and chunks[-1]["done"] is True
    assert chunks[-1]["prompt_eval_count"] > IMAGE_POSITIONS


def test_pulling_one_file_of_a_hub_repository_fails_clearly_offline(server: Any) -> None:
    """ORG/REPO:FILE.gguf fetches that file and the projector the repository pairs with it; this
    machine has no network, so the answer says so at once."""
    r = httpx.post(server.url + "/api/pull", json={"model": "ggml-org/gemma-3-4b-it-GGUF:gemma-3-4b-it-Q4_K_M.gguf",
                                                   "stream": False},
                   headers={"Authorization": f"Bearer {server.token}"}, timeout=60)
    assert r.status_code == 502 and "Cannot fetch ggml-org/gemma-3-4b-it-GGUF" in r.json()["error"]
