"""Background work with an id, a status, progress, log lines, cancel and an event stream.

A job function receives a :class:`JobContext`; it may be a coroutine function (run on
the event loop) or a plain function (run in a worker thread). Every change is an event
with a sequence number, so a client can replay a job's history and then follow it
(``GET /api/jobs/{id}/events``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import time
from typing import Any, AsyncIterator, Callable

from . import logs

log = logging.getLogger("localm.jobs")

TERMINAL = ("done", "failed", "cancelled")
KEEP_FINISHED = 200


class JobCancelled(Exception):
    """Raised inside a job by ``ctx.check_cancelled()`` once a cancel was asked for."""


class Job:
    def __init__(self, kind: str, title: str, owner: str, plugin: str | None) -> None:
        self.id = "job_" + secrets.token_hex(8)
        self.kind = kind
        self.title = title
        self.owner = owner
        self.plugin = plugin
        self.status = "queued"
        self.progress: float | None = None
        self.message: str | None = None
        self.created = time.time()
        self.started: float | None = None
        self.finished: float | None = None
        self.error: str | None = None
        self.result: Any = None
        self.events: list[dict[str, Any]] = []
        self.cancel_requested = False
        self.in_thread = False
        self._changed = asyncio.Event()
        self._task: asyncio.Task[Any] | None = None

    @property
    def done(self) -> bool:
        return self.status in TERMINAL

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "title": self.title, "plugin": self.plugin,
                "status": self.status, "progress": self.progress, "message": self.message,
                "created": self.created, "started": self.started, "finished": self.finished,
                "error": self.error, "result": self.result, "events": len(self.events)}

    def _emit(self, type_: str, **fields: Any) -> None:
        self.events.append({"seq": len(self.events) + 1, "type": type_, "time": time.time(), **fields})
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int = 0) -> AsyncIterator[dict[str, Any]]:
        """Every event after sequence number ``after``, then new ones until the job ends."""
        seen = after
        while True:
            waiter = self._changed
            while seen < len(self.events):
                seen += 1
                yield self.events[seen - 1]
            if self.done:
                return
            await waiter.wait()


class JobContext:
    """What a job function uses to report progress and notice a cancel."""

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop) -> None:
        self._job = job
        self._loop = loop

    @property
    def job_id(self) -> str:
        return self._job.id

    @property
    def cancelled(self) -> bool:
        return self._job.cancel_requested

    def check_cancelled(self) -> None:
        if self._job.cancel_requested:
            raise JobCancelled()

    def _call(self, fn: Callable[[], None]) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            fn()
        else:
            self._loop.call_soon_threadsafe(fn)

    def log(self, line: str) -> None:
        self._call(lambda: self._job._emit("log", line=line))

    def progress(self, fraction: float | None, message: str | None = None, **detail: Any) -> None:
        """Report how far the job is (0..1, None when it cannot tell) and what it is doing;
        ``detail`` (JSON values: a file name, items done and total...) rides on the event."""
        def apply() -> None:
            self._job.progress = None if fraction is None else max(0.0, min(1.0, float(fraction)))
            if message is not None:
                self._job.message = message
            self._job._emit("progress", **detail, progress=self._job.progress, message=message)
        self._call(apply)


class Jobs:
    """The registry of this process's jobs."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}

    def start(self, fn: Callable[[JobContext], Any], *, kind: str, title: str, owner: str = "owner",
              plugin: str | None = None) -> Job:
        loop = asyncio.get_running_loop()
        job = Job(kind, title, owner, plugin)
        self._jobs[job.id] = job
        self._trim()
        job._emit("status", status="queued")
        ctx = JobContext(job, loop)
        job.in_thread = not inspect.iscoroutinefunction(fn)

        async def run() -> None:
            logs.forget_request()  # the job outlives the request that started it
            job.status = "running"
            job.started = time.time()
            job._emit("status", status="running")
            try:
                if inspect.iscoroutinefunction(fn):
                    result = await fn(ctx)
                else:
                    result = await asyncio.to_thread(fn, ctx)
            except (JobCancelled, asyncio.CancelledError):
                job.status = "cancelled"
            except Exception as exc:  # a job's failure is its own, reported in its events
                log.exception("job %s (%s) failed", job.id, job.kind)
                job.status = "failed"
                job.error = str(exc) or exc.__class__.__name__
                job.result = getattr(exc, "result", None)  # a job may say what it got done before failing
            else:
                job.status = "cancelled" if job.cancel_requested else "done"
                job.result = result
            job.finished = time.time()
            job._emit("end", status=job.status, error=job.error, result=job.result)

        job._task = loop.create_task(run(), name=job.id)
        return job

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def all(self) -> list[Job]:
        return sorted(self._jobs.values(), key=lambda j: j.created, reverse=True)

    def cancel(self, job: Job) -> None:
        if job.done:
            return
        job.cancel_requested = True
        job._emit("status", status="cancelling")
        # coroutine jobs stop at their next await; thread jobs at ctx.check_cancelled()
        task = job._task
        if task is not None and not task.done() and not job.in_thread:
            task.cancel()

    async def cancel_all(self) -> None:
        for job in list(self._jobs.values()):
            self.cancel(job)

    def _trim(self) -> None:
        finished = [j for j in self._jobs.values() if j.done]
        for job in sorted(finished, key=lambda j: j.created)[: max(0, len(finished) - KEEP_FINISHED)]:
            self._jobs.pop(job.id, None)
