"""The batched scheduler (localm.sdk.scheduling.Batched) with a small engine of its own: real
threads and a real event loop, no model. Requests sent together reach the engine a few
milliseconds apart; a step that calls ``arrivals()`` before its decode takes in those that came
while it prepared, and a step that raises ends them too. With an ``interval``, a reply's tokens
reach the consumer together, at most once per interval."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from localm.sdk.engines import Batched, Finished, GenerateRequest, Job, Sampling, Token


class Engine:
    """Admits jobs into a line; each step takes every waiting job, (on its first step) polls
    ``arrivals()`` until ``expect`` jobs are in, then emits one token and the Finished for each
    job it holds, recording which step read it."""

    def __init__(self, expect: int, fail: bool = False) -> None:
        self.expect, self.fail = expect, fail
        self.waiting: list[Job] = []
        self.step_of: dict[int, int] = {}
        self.steps = 0
        self.batched = Batched("test", 4, admit=self.waiting.append, step=self.step)

    def step(self, jobs: list[Job]) -> None:
        self.steps += 1
        held = list(self.waiting)
        if self.steps == 1:
            deadline = time.monotonic() + 30
            while len(held) < self.expect and time.monotonic() < deadline:
                if self.batched.arrivals():
                    held = list(self.waiting)
                else:
                    time.sleep(0.002)
        if self.fail:
            raise RuntimeError("the decode failed")
        self.waiting.clear()
        for job in held:
            self.step_of[job.request.prompt[0]] = self.steps
            job.emit(Token(id=job.request.prompt[0], text="x"))
            job.emit(Finished(reason="length", prompt_tokens=1, completion_tokens=1))


async def ask(engine: Engine, n: int, delay: float) -> list[Any]:
    await asyncio.sleep(delay)
    request = GenerateRequest(prompt=(n,), sampling=Sampling(max_tokens=1))
    return [event async for event in engine.batched.generate(request)]


def run_three(engine: Engine) -> list[list[Any]]:
    async def three() -> list[list[Any]]:
        # the first starts the engine's thread; the others come while its first step prepares
        return await asyncio.gather(ask(engine, 1, 0), ask(engine, 2, 0.02), ask(engine, 3, 0.04))
    try:
        return asyncio.run(asyncio.wait_for(three(), 60))
    finally:
        engine.batched.close()


def test_requests_arriving_while_a_step_prepares_are_read_in_that_step() -> None:
    engine = Engine(expect=3)
    replies = run_three(engine)
    assert engine.step_of == {1: 1, 2: 1, 3: 1}
    for n, events in zip((1, 2, 3), replies):
        assert [e.id for e in events if isinstance(e, Token)] == [n]
        assert isinstance(events[-1], Finished) and events[-1].reason == "length"


def test_a_failing_step_ends_the_requests_it_took_in_as_well() -> None:
    engine = Engine(expect=3, fail=True)
    replies = run_three(engine)
    assert engine.steps == 1  # the two that came during the step ended with it, not a step later
    for events in replies:
        assert isinstance(events[-1], Finished) and events[-1].reason == "error"
        assert "the decode failed" in (events[-1].error or "")


class Counter:
    """One token a step for each job, a step every few milliseconds, until ``tokens``; then the
    Finished."""

    def __init__(self, tokens: int, interval: float, seconds: float = 0.005) -> None:
        self.tokens = tokens
        self.seconds = seconds
        self.held: list[Job] = []
        self.batched = Batched("test", 2, admit=self.admit, step=self.step, interval=interval)

    def admit(self, job: Job) -> None:
        job.state = 0
        self.held.append(job)

    def step(self, jobs: list[Job]) -> None:
        time.sleep(self.seconds)  # the decode
        for job in list(self.held):
            job.state += 1
            job.emit(Token(id=job.state, text=f"{job.state} "))
            if job.state == self.tokens:
                self.held.remove(job)
                job.emit(Finished(reason="length", prompt_tokens=1, completion_tokens=self.tokens))


def read_in_groups(engine: Counter) -> list[list[Any]]:
    """The events of one request, as the consumer found them together: a group ends at an event
    read with nothing else ready (``Events.ready``)."""
    async def read() -> list[list[Any]]:
        groups: list[list[Any]] = [[]]
        events = engine.batched.generate(GenerateRequest(prompt=(1,), sampling=Sampling(max_tokens=engine.tokens)))
        async for event in events:
            if isinstance(event, (Token, Finished)):
                groups[-1].append(event)
                if not events.ready:
                    groups.append([])
        return [group for group in groups if group]
    try:
        return asyncio.run(asyncio.wait_for(read(), 60))
    finally:
        engine.batched.close()


def test_an_interval_hands_a_replys_tokens_over_together() -> None:
    groups = read_in_groups(Counter(tokens=20, interval=0.5))  # the whole reply takes about 0.1 s
    events = [event for group in groups for event in group]
    assert [event.id for event in events[:-1]] == list(range(1, 21))
    assert isinstance(events[-1], Finished)
    # the first token at once, alone; the others held until the Finished, which brings them
    assert len(groups[0]) == 1 and isinstance(groups[0][0], Token)
    assert len(groups) == 2 and len(groups[1]) == 20


def test_without_an_interval_each_steps_token_comes_as_it_is_drawn() -> None:
    groups = read_in_groups(Counter(tokens=10, interval=0, seconds=0.02))
    assert len(groups) >= 5  # a step's token reaches the consumer within that step, 20 ms apart
    assert [event.id for group in groups for event in group if isinstance(event, Token)] == list(range(1, 11))
