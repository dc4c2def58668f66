"""A Hugging Face vision-language folder served by localm: the tiny random Llava of
vlm_fixtures pulled like a downloaded model, asked about pictures through the official openai,
ollama and anthropic clients. Its picture positions are counted in the usage, and its log probabilities
depend on which picture was sent."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import pytest

from localm.sdk.testing import offline_cli

pytest.importorskip("torch")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
anthropic = pytest.importorskip("anthropic")

from vlm_fixtures import IMAGE_TOKENS, png_bytes, write_tiny_vlm  # noqa: E402

MODEL = "tiny-vlm"


@pytest.fixture(scope="module")
def server(localm_module_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = write_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-vlm")

    def prepare(data: Path) -> None:
        offline_cli(data, "pull", str(folder), "--name", MODEL)

    return localm_module_server(prepare=prepare, plugins=["chat", "transformers", "openai", "ollama", "anthropic"],
                                env={"HF_HUB_OFFLINE": "1"})


def ask(client: Any, seed: int) -> Any:
    uri = "data:image/png;base64," + base64.b64encode(png_bytes(seed)).decode()
    return client.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0, logprobs=True, top_logprobs=3,
        messages=[{"role": "user", "content": [{"type": "text", "text": "what is in this image?"},
                                               {"type": "image_url", "image_url": {"url": uri}}]}])


def test_the_folder_is_a_chat_model_that_sees(server: Any) -> None:
    owner = {"Authorization": f"Bearer {server.token}"}
    model = httpx.get(f"{server.url}/v1/models/{MODEL}", headers=owner).json()
    assert model["role"] == "chat" and model["vision"] is True and model["capabilities"]["context_window"] == 256
    assert "vision" in httpx.post(f"{server.url}/api/show", json={"model": MODEL}).json()["capabilities"]


def test_pictures_through_the_openai_client(server: Any) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    plain = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                           messages=[{"role": "user", "content": "what is in this image?"}])
    one, again, other = ask(client, 1), ask(client, 1), ask(client, 2)
    assert one.usage.prompt_tokens >= plain.usage.prompt_tokens + IMAGE_TOKENS - 1
    first = [{t.token: t.logprob for t in r.choices[0].logprobs.content[0].top_logprobs} for r in (one, again, other)]
    assert first[0] == pytest.approx(first[1], abs=1e-4)
    assert first[0] != pytest.approx(first[2], abs=1e-4)


def test_ollama_images(server: Any) -> None:
    r = ollama.Client(host=server.url).chat(model=MODEL, options={"temperature": 0, "num_predict": 2}, messages=[
        {"role": "user", "content": "what is in this image?", "images": [png_bytes(3)]}])
    assert r.done and r.prompt_eval_count >= IMAGE_TOKENS


def test_anthropic_image_blocks_change_the_reply(server: Any) -> None:
    c = anthropic.Anthropic(base_url=server.url, api_key="unused")

    def ask(seed: int) -> Any:
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(png_bytes(seed)).decode()}}
        return c.messages.create(model=MODEL, max_tokens=6, messages=[
            {"role": "user", "content": [image, {"type": "text", "text": "what is in this image?"}]}],
            extra_body={"temperature": 0, "top_k": 1})

    one, again = ask(11), ask(11)
    assert one.usage.input_tokens >= IMAGE_TOKENS and one.content == again.content
    replies = {tuple(block.text for block in ask(seed).content) for seed in (12, 13, 14, 15)}
    assert len(replies | {tuple(block.text for block in one.content)}) > 1  # the picture changes the reply
