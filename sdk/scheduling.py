"""The queues an engine may run its requests through: :class:`Serial` (one decode at a time
on a thread of its own) and :class:`Batched` (several requests decoded in one step), both
taking turns through :class:`Turns` (arrival order, a front end's background requests after
people's). They turn an engine's blocking decode loop into :meth:`Engine.generate`'s event
stream (see :mod:`localm.kernel.engines`, re-exported by :mod:`localm.sdk.engines`).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from localm.kernel.engines import Event, Finished, GenerateRequest, Queued, Started, Stop, Token


def positions(request: GenerateRequest) -> int:
    """The positions a request's prompt takes: its tokens and its media's (GenerateRequest.media)."""
    return len(request.prompt) + sum(span.tokens for span in request.media)


class Turns:
    """Up to ``capacity`` holders at a time (one by default). Waiters take their turn in
    arrival order, except that a background request (``GenerateRequest.background``) lets
    every interactive one that arrives while it waits go first. A waiter may ask for several
    turns at once (``weight``; :meth:`Batched.call` asks for all of them, to run alone); the
    first in line waits until that many are free, and those behind it wait behind it. A
    waiter that is cancelled leaves the line."""

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = max(1, int(capacity))
        self.held = 0
        self._line: list[tuple[int, int, int, asyncio.Future]] = []
        self._arrivals = 0

    async def acquire(self, background: bool = False, weight: int = 1) -> None:
        weight = max(1, min(weight, self.capacity))
        if not self._line and self.held + weight <= self.capacity:
            self.held += weight
            return
        turn: asyncio.Future = asyncio.get_running_loop().create_future()
        self._arrivals += 1
        heapq.heappush(self._line, (1 if background else 0, self._arrivals, weight, turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed the turn as it was cancelled: pass it on
                self.release(weight)
            else:  # it may have held up the line: those behind it may go now
                self._wake()
            raise

    def release(self, weight: int = 1) -> None:
        self.held -= max(1, min(weight, self.capacity))
        self._wake()

    @property
    def waiting(self) -> int:
        """Waiters still in line."""
        return sum(1 for *_, turn in self._line if not turn.done())

    def _wake(self) -> None:
        while self._line:
            _, _, weight, turn = self._line[0]
            if turn.done():  # a waiter that left
                heapq.heappop(self._line)
                continue
            if self.held + weight > self.capacity:
                return
            heapq.heappop(self._line)
            self.held += weight
            turn.set_result(None)

    @contextlib.asynccontextmanager
    async def __call__(self, background: bool = False, weight: int = 1) -> AsyncIterator[None]:
        await self.acquire(background, weight)
        try:
            yield
        finally:
            self.release(weight)


class Serial:
    """One decode at a time on a thread of its own, in arrival order (background requests
    after interactive ones: see :class:`Turns`).

    An engine that decodes one request at a time hands each request to ``generate`` with
    a blocking ``decode(request, cancelled, emit)`` function; ``decode`` runs on the
    engine's thread, calls ``emit(event)`` for each Token and ends with a Finished, and
    checks ``cancelled.is_set()`` between tokens. The consumer closing the event stream
    sets ``cancelled``, and the next request starts only once ``decode`` has returned.
    """

    def __init__(self, name: str, *, initializer: Callable[..., Any] | None = None, initargs: tuple = ()) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=initializer,
                                            initargs=initargs)
        self._turn = Turns()
        self.busy = 0

    async def generate(self, request: GenerateRequest,
                       decode: Callable[[GenerateRequest, threading.Event, Callable[[Event], None]], None],
                       ) -> AsyncIterator[Event]:
        ahead = self.busy
        self.busy += 1
        try:
            if ahead:
                yield Queued(ahead=ahead)
            async with self._turn(request.background):
                yield Started(prompt_tokens=positions(request))
                loop = asyncio.get_running_loop()
                events: asyncio.Queue[Event] = asyncio.Queue()
                cancelled = threading.Event()

                def emit(event: Event) -> None:
                    loop.call_soon_threadsafe(events.put_nowait, event)

                future = loop.run_in_executor(self._executor, decode, request, cancelled, emit)
                try:
                    while True:
                        event = await events.get()
                        yield event
                        if isinstance(event, Finished):
                            break
                finally:
                    cancelled.set()
                    await asyncio.shield(future)
        finally:
            self.busy -= 1

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the engine's thread, in turn with generations."""
        self.busy += 1
        try:
            async with self._turn():
                return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self.busy -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def _deliver_all(items: list[tuple[Callable[[Event], None], Event]]) -> None:
    for deliver, event in items:
        deliver(event)


class Job:
    """A request handed to a :class:`Batched` engine's stepping thread: the request, the flag
    its consumer sets when it leaves, and ``emit`` for its events (Token, Status, and one
    Finished, which ends the job), called on the engine's thread; the events of one step
    reach the consumer together when the step ends."""

    __slots__ = ("request", "cancelled", "emit", "loop", "finished", "state", "delivered")

    def __init__(self, request: GenerateRequest, cancelled: threading.Event, emit: Callable[[Event], None],
                 loop: Any = None) -> None:
        self.request = request
        self.cancelled = cancelled
        self.emit = emit
        #: The event loop the request's consumer runs on.
        self.loop = loop
        self.finished = False
        #: The engine's own record of the job (its slot, sampler, position ...).
        self.state: Any = None
        #: When its events last went to its event loop (``time.monotonic()``; None: never).
        self.delivered: float | None = None


class Events:
    """What :meth:`Batched.generate` returns: the request's events, read as from an async
    generator (``async for``, ``athrow``, ``aclose``), and ``ready``, how many of them have
    arrived and are not read yet: a consumer that turns each token into a message may join
    the tokens that came together into one."""

    __slots__ = ("_events", "_queue")

    def __init__(self, events: AsyncIterator[Event], queue: asyncio.Queue[Event]) -> None:
        self._events: Any = events
        self._queue = queue

    @property
    def ready(self) -> int:
        return self._queue.qsize()

    def __aiter__(self) -> "Events":
        return self

    def __anext__(self) -> Any:
        return self._events.__anext__()

    def asend(self, value: Any) -> Any:
        return self._events.asend(value)

    def athrow(self, *args: Any) -> Any:
        return self._events.athrow(*args)

    def aclose(self) -> Any:
        return self._events.aclose()


class Batched:
    """Up to ``slots`` decodes at once, stepped together on one thread of their own: the
    scheduler of an engine that decodes several sequences in one batch (continuous batching).

    The engine gives two blocking functions, both called on the engine's thread:

    - ``admit(job)``: a new :class:`Job` arrived. The engine takes it into its own line;
      it may end it at once (an error: ``job.emit(Finished(...))``).
    - ``step(jobs)``: advance every job it holds by one batch (take waiting jobs into free
      sequences, decode, draw a token for each sequence whose prompt is done) and emit their
      events. A job ends when the engine emits its Finished, and the engine frees the job's
      sequence before it does. ``jobs`` is every job not yet finished; ``step`` checks each
      job's ``cancelled`` flag and ends a cancelled job within a step.

    The thread steps while any job is unfinished and sleeps otherwise. Requests beyond
    ``slots`` wait in arrival order (background ones behind interactive ones, as in
    :class:`Turns`) and are told so (Queued). When ``step`` raises, every unfinished job ends
    with an error and ``abort()`` (when given) lets the engine reset its state.
    :meth:`call` runs a function alone: it waits for the running decodes to end, and the
    requests that arrive meanwhile wait behind it. ``step`` may call :meth:`arrivals` before
    its decode to take in the requests that arrived while it prepared.

    ``interval`` (seconds, 0 by default) hands a job's tokens to its consumer at most once
    per interval: its first token at once, later ones when the interval since the last
    handing has passed, anything else (a Status, the Finished) at once with the tokens held
    before it. Each handing wakes the consumer's event loop, which then writes to a socket
    and wakes a client; where the decode's threads take every core, that work is taken from
    the decode, and handing several tokens at once costs about what handing one does.
    """

    def __init__(self, name: str, slots: int, *, admit: Callable[[Job], None], step: Callable[[list[Job]], None],
                 abort: Callable[[], None] | None = None, interval: float = 0.0) -> None:
        self.slots = max(1, int(slots))
        #: Seconds between two handings of a job's tokens to its consumer (0: every step's).
        self.interval = max(0.0, float(interval))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._turn = Turns(self.slots)
        self._admit, self._step, self._abort = admit, step, abort
        self._inbox: list[Job] = []
        self._live: list[Job] = []
        self._lock = threading.Lock()
        self._stepping = False
        #: Events emitted in this step, delivered to their event loops together when it ends (one
        #: wake-up of the loop a step, not one a token), or later when ``interval`` holds them.
        self._outbox: list[tuple[Job, Callable[[Event], None], Event]] = []
        self.busy = 0

    @property
    def active(self) -> int:
        """Requests decoding now (holding a slot)."""
        return min(self.busy, self._turn.held)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return self._turn.waiting

    def generate(self, request: GenerateRequest) -> Events:
        events: asyncio.Queue[Event] = asyncio.Queue()
        return Events(self._generate(request, events), events)

    async def _generate(self, request: GenerateRequest, events: asyncio.Queue[Event]) -> AsyncIterator[Event]:
        self.busy += 1
        try:
            if self._turn.held >= self.slots or self._turn.waiting:
                yield Queued(ahead=self.busy - 1)
            async with self._turn(request.background):
                yield Started(prompt_tokens=positions(request))
                loop = asyncio.get_running_loop()
                cancelled = threading.Event()
                ended = loop.create_future()

                def deliver(event: Event) -> None:  # on the event loop
                    events.put_nowait(event)
                    if isinstance(event, Finished) and not ended.done():
                        ended.set_result(None)

                self._submit(Job(request, cancelled, deliver, loop))
                try:
                    while True:
                        event = await events.get()
                        try:
                            yield event
                        except Stop:  # the consumer has what it needs, but for the Finished
                            cancelled.set()
                            continue
                        if isinstance(event, Finished):
                            break
                finally:
                    cancelled.set()
                    await asyncio.shield(ended)  # its sequence is free once the engine ended it
        finally:
            self.busy -= 1

    def _submit(self, job: Job) -> None:
        with self._lock:
            self._inbox.append(job)
            if self._stepping:
                return
            self._stepping = True
        self._executor.submit(self._run)

    @staticmethod
    def _end(job: Job, event: Finished) -> None:
        job.emit(event)  # tracked: a job's second Finished is dropped

    def _run(self) -> None:
        while True:
            with self._lock:
                arrived, self._inbox = self._inbox, []
                self._live = [job for job in self._live if not job.finished]
                if not arrived and not self._live:
                    self._stepping = False
                    return
            self._welcome(arrived)
            live = [job for job in self._live if not job.finished]
            if live:
                try:
                    self._step(live)
                except Exception as exc:  # noqa: BLE001 - every unfinished job ends with the error
                    for job in [job for job in self._live if not job.finished]:  # those arrived in the step too
                        self._end(job, Finished(reason="error", prompt_tokens=positions(job.request),
                                                completion_tokens=0, error=f"{type(exc).__name__}: {exc}"))
                    if self._abort is not None:
                        try:
                            self._abort()
                        except Exception:  # noqa: BLE001
                            pass
            self._flush()

    def _welcome(self, arrived: list[Job]) -> None:
        for job in arrived:
            self._track(job)
            self._live.append(job)
            try:
                self._admit(job)
            except Exception as exc:  # noqa: BLE001 - the job ends; the others go on
                self._end(job, Finished(reason="error", prompt_tokens=positions(job.request),
                                        completion_tokens=0, error=f"{type(exc).__name__}: {exc}"))

    def arrivals(self) -> int:
        """Admit the requests that arrived since this step began (``admit`` for each), and
        return how many. For ``step`` to call, on the engine's thread, before its decode:
        requests sent together reach the engine a few milliseconds apart, and a step that
        takes in those that came while it prepared reads their prompts in the same decode,
        instead of one now and the others a whole prompt-reading step later."""
        with self._lock:
            arrived, self._inbox = self._inbox, []
        self._welcome(arrived)
        return len(arrived)

    def _flush(self) -> None:
        """Hand this step's events to their event loops, one call a loop; with an ``interval``,
        a job's tokens wait in the outbox until they are due."""
        if not self._outbox:
            return
        due: dict[Job, bool] = {}
        if self.interval:
            now = time.monotonic()
            for job, _, event in self._outbox:
                if not due.get(job):
                    due[job] = job.delivered is None or not isinstance(event, Token) \
                        or now - job.delivered >= self.interval
            if not any(due.values()):  # every job's tokens wait for their interval
                return
            for job, go in due.items():
                if go:
                    job.delivered = now
        by_loop: dict[Any, list[tuple[Callable[[Event], None], Event]]] = {}
        held = []
        for job, deliver, event in self._outbox:
            if due.get(job, True):
                by_loop.setdefault(job.loop, []).append((deliver, event))
            else:
                held.append((job, deliver, event))
        self._outbox = held
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:  # the loop closed: nobody reads these events
                pass

    def _track(self, job: Job) -> None:
        """Queue the job's events for the end of the step, and mark the job finished when its
        Finished passes, whoever emits it."""
        deliver = job.emit

        def tracked(event: Event) -> None:
            if isinstance(event, Finished):
                if job.finished:
                    return
                job.finished = True
            self._outbox.append((job, deliver, event))
        job.emit = tracked

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the engine's thread, alone: after the running decodes end, and
        before the requests that arrive while it waits."""
        self.busy += 1
        try:
            async with self._turn(weight=self.slots):
                return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self.busy -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=True)
