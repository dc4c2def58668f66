"""The batched scheduler (localm.sdk.scheduling.Batched) with a small engine of its own: real
threads and a real event loop, no model. Requests sent together reach the engine a few
milliseconds apart; a step that calls ``arrivals()`` before its decode takes in those that came
while it prepared, and a step that raises ends them too."""

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
