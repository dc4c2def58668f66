"""Pictures in chat on the transformers engine: a tiny random Llava saved as a Hugging Face
folder (vlm_fixtures) and reloaded offline through the engine object.

Random weights say nothing about meaning, so the tests assert what holds without it: a
picture takes the positions the processor expands it to; the engine's MediaSpan path computes
the same next-token distribution as the processor and model called directly on the same
messages and pictures; different pictures give different distributions and one picture the
same; seeded sampling repeats; bad media are refused as the spec says.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any, Iterator

import pytest

from localm.sdk import engines as spec
from localm.sdk.testing import plugin_module

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("PIL")

from vlm_fixtures import IMAGE_TOKEN, IMAGE_TOKENS, png_bytes, write_tiny_llm, write_tiny_vlm  # noqa: E402

#: A small n_batch, so a picture's positions straddle a chunk boundary of the prefill.
SETTINGS = {"n_ctx": 1024, "n_threads": 1, "n_batch": 5, "attention": "sdpa"}
QUESTION = "what is in this image?"
VOCAB_ALL = 10_000  # logprobs for more alternatives than the vocabulary holds: the whole distribution


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_vlm(tmp_path_factory.mktemp("vision") / "tiny-llava", seed=0)


@pytest.fixture(scope="module")
def engine(folder: Path) -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        loaded = plugin_module("transformers", "hf_engine").TransformersEngine(str(folder), "hf", "chat", SETTINGS)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def reference(folder: Path) -> Any:
    """The processor and model loaded by transformers itself: what the engine must agree with."""
    import transformers
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        processor = transformers.AutoProcessor.from_pretrained(folder, local_files_only=True)
        model = transformers.AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True).eval()
    return processor, model


def media(data: bytes, kind: str = "image") -> spec.Media:
    return spec.Media(kind=kind, data=data, digest=hashlib.sha256(data).hexdigest())


def messages(pictures: int, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(pictures)), {"type": "text", "text": text}]}]


def request(engine: Any, pictures: list[bytes], text: str = QUESTION, **kwargs: Any) -> spec.GenerateRequest:
    """What the chat service sends: the template rendered, split at the marker, the pieces
    tokenized, and a span per picture of the positions ``media_tokens`` says it takes."""
    pieces = engine.render_chat(messages(len(pictures), text)).split(engine.media_marker)
    assert len(pieces) == len(pictures) + 1
    ids = engine.tokenize(pieces[0])
    spans = []
    for data, piece in zip(pictures, pieces[1:]):
        item = media(data)
        spans.append(spec.MediaSpan(at=len(ids), media=item, tokens=asyncio.run(engine.media_tokens(item))))
        ids += engine.tokenize(piece, add_special=False)
    return spec.GenerateRequest(prompt=tuple(ids), media=tuple(spans), **kwargs)


def collect(engine: Any, req: spec.GenerateRequest) -> list[Any]:
    async def run() -> list[Any]:
        return [event async for event in engine.generate(req)]
    return asyncio.run(run())


def first_distribution(engine: Any, pictures: list[bytes], **kwargs: Any) -> dict[int, float]:
    """The engine's log-softmax over the whole vocabulary for the first generated token."""
    events = collect(engine, request(engine, pictures, sampling=spec.Sampling(temperature=0, max_tokens=1),
                                     logprobs=VOCAB_ALL, **kwargs))
    assert events[-1].reason in ("length", "stop"), events[-1]
    tokens = [e for e in events if isinstance(e, spec.Token)]
    if tokens:
        return dict(tokens[0].top)
    pytest.skip("the first token ended the generation: no distribution to read")


def reference_distribution(reference: Any, pictures: list[bytes]) -> dict[int, float]:
    """The processor + model path on the same messages and pictures."""
    import io

    import torch
    from PIL import Image
    processor, model = reference
    text = processor.apply_chat_template(messages(len(pictures)), tokenize=False, add_generation_prompt=True)
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in pictures]
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.inference_mode():
        logits = model(**inputs).logits[0, -1].double()
    return dict(enumerate(torch.log_softmax(logits, dim=0).tolist()))


def largest_gap(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys()
    return max(abs(a[i] - b[i]) for i in a)


def test_vision_folder_is_a_chat_model_that_sees(engine: Any, folder: Path) -> None:
    from localm.kernel.models import inspect_hf
    caps, role = inspect_hf(folder)
    assert role == "chat" and caps["vision"] is True and caps["chat_template"] is True
    assert engine.capabilities.vision and engine.capabilities.chat_template
    assert isinstance(engine, spec.MediaEngine) and engine.media_marker == IMAGE_TOKEN
    assert engine.capabilities.context_window == 256  # the text model's window, below n_ctx
    assert (engine.capabilities.layers, engine.capabilities.hidden_size) == (2, 32)  # the text decoder's
    rendered = engine.render_chat(messages(2))
    assert rendered.count(IMAGE_TOKEN) == 2 and rendered.endswith("assistant:")


def test_vision_media_tokens_are_the_processors_expansion(engine: Any, reference: Any) -> None:
    import io

    from PIL import Image
    processor, _ = reference
    picture = Image.open(io.BytesIO(png_bytes(1))).convert("RGB")
    expanded = processor(text=processor.apply_chat_template(messages(1), tokenize=False), images=[picture])
    count = list(expanded["input_ids"][0]).count(processor.image_token_id)
    assert asyncio.run(engine.media_tokens(media(png_bytes(1)))) == count == IMAGE_TOKENS


def test_vision_span_path_matches_the_processor_path(engine: Any, reference: Any) -> None:
    for pictures in ([png_bytes(1)], [png_bytes(1), png_bytes(2)]):
        ours = first_distribution(engine, pictures, cache_prompt=False)
        theirs = reference_distribution(reference, pictures)
        assert largest_gap(ours, theirs) < 1e-5, len(pictures)


def test_vision_different_pictures_differ_and_one_picture_repeats(engine: Any) -> None:
    one = first_distribution(engine, [png_bytes(1)], cache_prompt=False)
    again = first_distribution(engine, [png_bytes(1)], cache_prompt=False)
    assert largest_gap(one, again) == 0.0
    # the same text tokens around another picture: the prompt cache must tell them apart (resumed at the
    # picture, the prefill runs in other chunks than a fresh one: equal to float32 rounding, not bit for bit)
    first_distribution(engine, [png_bytes(1)])
    other = first_distribution(engine, [png_bytes(2)])
    assert largest_gap(one, other) > 1e-3
    assert largest_gap(other, first_distribution(engine, [png_bytes(2)], cache_prompt=False)) < 1e-6
    assert largest_gap(one, first_distribution(engine, [png_bytes(1)])) < 1e-6
    assert largest_gap(one, first_distribution(engine, [png_bytes(1)])) == 0.0  # the same prompt again: kept logits


def test_vision_the_same_prompt_again_comes_whole_from_the_cache(engine: Any) -> None:
    def run() -> tuple[list[int], int, int]:
        req = request(engine, [png_bytes(6)], sampling=spec.Sampling(temperature=1.0, seed=11, max_tokens=6))
        events = collect(engine, req)
        return [e.id for e in events if isinstance(e, spec.Token)], events[-1].cached_tokens, events[-1].prompt_tokens

    first, _, _ = run()
    again, cached, positions = run()
    assert again == first and cached == positions == len(request(engine, [png_bytes(6)]).prompt) + IMAGE_TOKENS
    assert largest_gap(first_distribution(engine, [png_bytes(1), png_bytes(2)]),
                       first_distribution(engine, [png_bytes(2), png_bytes(1)])) > 1e-4  # order counts


def test_vision_seeded_sampling_repeats(engine: Any) -> None:
    def sample(seed: int) -> list[int]:
        req = request(engine, [png_bytes(3)], sampling=spec.Sampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                                                      max_tokens=8, seed=seed))
        events = collect(engine, req)
        assert events[-1].prompt_tokens == len(req.prompt) + IMAGE_TOKENS
        return [e.id for e in events if isinstance(e, spec.Token)]

    assert sample(7) == sample(7)
    assert len({tuple(sample(s)) for s in (1, 2, 3)}) > 1


def test_vision_text_only_chat(engine: Any) -> None:
    rendered = engine.render_chat([{"role": "user", "content": "hello world"}])
    assert IMAGE_TOKEN not in rendered
    events = collect(engine, spec.GenerateRequest(prompt=tuple(engine.tokenize(rendered)),
                                                  sampling=spec.Sampling(max_tokens=4, seed=1)))
    assert events[-1].reason in ("stop", "length") and events[-1].error is None


def test_vision_undecodable_media_is_invalid_media(engine: Any) -> None:
    for bad in (media(b"this is not a picture"), media(png_bytes(1)[:60]), media(png_bytes(1), kind="audio")):
        with pytest.raises(spec.EngineError) as raised:
            asyncio.run(engine.media_tokens(bad))
        assert raised.value.code == "invalid_media"
    broken = spec.MediaSpan(at=2, media=media(b"\x89PNG garbage"), tokens=IMAGE_TOKENS)
    good = request(engine, [png_bytes(1)], sampling=spec.Sampling(max_tokens=2))
    end = collect(engine, spec.GenerateRequest(prompt=good.prompt, media=(broken,)))[-1]
    assert end.reason == "error" and "could not be decoded" in end.error


def test_vision_a_span_of_the_wrong_size_is_an_error(engine: Any) -> None:
    good = request(engine, [png_bytes(1)])
    span = good.media[0]
    wrong = spec.GenerateRequest(prompt=good.prompt, media=(spec.MediaSpan(at=span.at, media=span.media,
                                                                          tokens=span.tokens + 1),))
    end = collect(engine, wrong)[-1]
    assert end.reason == "error" and f"takes {IMAGE_TOKENS} positions" in end.error


def test_vision_steering_reaches_the_text_decoder(engine: Any) -> None:
    import numpy as np
    plain = first_distribution(engine, [png_bytes(1)])
    push = spec.Intervention(layer=1, delta=np.full(32, 3.0, dtype=np.float32))
    steered = first_distribution(engine, [png_bytes(1)], interventions=(push,))
    assert largest_gap(plain, steered) > 1e-3
    req = request(engine, [png_bytes(1)], sampling=spec.Sampling(temperature=0, max_tokens=1),
                  reads=(spec.ActivationRead(layer=0),))
    end = collect(engine, req)[-1]
    assert end.activations[(0, "post")].shape == (len(req.prompt) + IMAGE_TOKENS, 32)  # the pictures' rows too


def test_vision_media_on_a_text_only_model_is_an_error(tmp_path: Path) -> None:
    folder = write_tiny_llm(tmp_path / "tiny-llm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        blind = plugin_module("transformers", "hf_engine").TransformersEngine(str(folder), "hf", "chat", SETTINGS)
    try:
        assert not blind.capabilities.vision and not isinstance(blind, spec.MediaEngine)
        prompt = tuple(blind.tokenize(blind.render_chat([{"role": "user", "content": "hello"}])))
        span = spec.MediaSpan(at=2, media=media(png_bytes(1)), tokens=IMAGE_TOKENS)
        end = collect(blind, spec.GenerateRequest(prompt=prompt, media=(span,)))[-1]
        assert end.reason == "error" and "does not see images" in end.error and "1 media part" in end.error
        with pytest.raises(spec.EngineError) as raised:
            asyncio.run(blind.media_tokens(span.media))
        assert raised.value.code == "invalid_media"
    finally:
        blind.close()


def test_vision_a_follow_up_turn_matches_a_fresh_prompt(engine: Any) -> None:
    """The second turn starts with the first one's prompt (its picture included): resumed from
    the prompt cache or computed afresh, its distribution is the same."""
    first = request(engine, [png_bytes(4)])
    reply = engine.tokenize("a red square\n", add_special=False)
    more = engine.tokenize("user: and now?\nassistant:", add_special=False)
    positions = len(first.prompt) + IMAGE_TOKENS

    def turn(**kwargs: Any) -> tuple[dict[int, float], int]:
        req = spec.GenerateRequest(prompt=first.prompt + tuple(reply + more), media=first.media,
                                   sampling=spec.Sampling(temperature=0, max_tokens=1), logprobs=VOCAB_ALL, **kwargs)
        events = collect(engine, req)
        return dict(next(e for e in events if isinstance(e, spec.Token)).top), events[-1].cached_tokens

    fresh, none = turn(cache_prompt=False)
    first_distribution(engine, [png_bytes(4)])  # fills the cache with the first turn
    resumed, cached = turn()
    assert cached >= positions and none == 0  # the first turn, its picture included, came from the cache
    assert largest_gap(resumed, fresh) < 1e-6
    at = first.media[0].at
    other = request(engine, [png_bytes(5)], sampling=spec.Sampling(temperature=0, max_tokens=1))
    assert collect(engine, other)[-1].cached_tokens == at  # resumed where the pictures differ


def test_vision_a_template_without_image_parts_serves_text_only(tmp_path: Path) -> None:
    folder = write_tiny_vlm(tmp_path / "no-image-template")
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] if m['content'] is string else '' }}\n"
        "{% endfor %}assistant:")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        loaded = plugin_module("transformers", "hf_engine").TransformersEngine(str(folder), "hf", "chat", SETTINGS)
    try:
        assert not loaded.capabilities.vision and not isinstance(loaded, spec.MediaEngine)
        with pytest.raises(spec.EngineError, match="writes no image token") as raised:
            asyncio.run(loaded.media_tokens(media(png_bytes(1))))
        assert raised.value.code == "invalid_media"
    finally:
        loaded.close()
