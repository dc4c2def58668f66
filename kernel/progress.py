"""Progress for long work a command waits for: downloads, copies, checksums and server jobs.

On a terminal it is drawn with rich's progress bars (bytes and rate for a transfer, a
percentage or a moving bar for a job's steps); when stdout is not a terminal (a pipe, a
log file, CI) the same work is written as plain lines, one per step, so a log stays
readable and nothing depends on carriage returns.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Iterator, TextIO

import click

from .deps import pip_download_name, pip_progress
from .errors import LocalmError

#: In plain mode, a transfer that takes a while reports where it is this often (seconds).
PLAIN_EVERY = 10.0



def is_terminal(stream: TextIO) -> bool:
    """True when ``stream`` is an interactive terminal that can redraw a bar."""
    try:
        return stream.isatty() and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):
        return False


def human_bytes(n: float) -> str:
    """98 MB, 1.2 GB, 133 kB: decimal units, as the model listing shows sizes."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            value = n / size
            return f"{value:.1f} {unit}" if value < 10 and unit != "kB" else f"{value:.0f} {unit}"
    return f"{int(n)} bytes"


class Task:
    """One piece of work in a :class:`Display`: a transfer measured in bytes, or a job's steps."""

    def __init__(self, display: "Display", label: str, total: float | None, unit: str) -> None:
        self.display = display
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0.0
        self.message: str | None = None
        self.started = time.monotonic()
        self.finished = False
        self._last_plain = self.started
        self._id: Any = None
        if display.live:
            self._id = display._rich.add_task(label, total=total, unit=unit)
        elif unit == "bytes":
            display.log(f"{label} ({human_bytes(total)})" if total else label)

    def update(self, done: float | None = None, *, total: float | None = None, message: str | None = None) -> None:
        """Move the task to ``done`` (bytes, or percent for steps); a new ``message`` is a new step."""
        if self.finished:
            return
        if total is not None:
            self.total = total
        if done is not None:
            self.done = done
        step = message is not None and message != self.message
        if step:
            self.message = message
        if self.display.live:
            description = f"{self.label}: {self.message}" if self.message and self.unit != "bytes" else self.label
            self.display._rich.update(self._id, completed=self.done, total=self.total, description=description)
            return
        now = time.monotonic()
        if self.unit == "bytes":
            if self.total and now - self._last_plain >= PLAIN_EVERY and self.done < self.total:
                self._last_plain = now
                rate = self.done / max(now - self.started, 1e-6)
                self.display.log(f"  {self.label}: {100 * self.done / self.total:.0f}% "
                                 f"({human_bytes(self.done)} of {human_bytes(self.total)}, {human_bytes(rate)}/s)")
        elif step:
            share = f"[{self.done:3.0f}%] " if self.total else ""
            self.display.log(f"{share}{self.label}: {self.message}")

    def finish(self) -> None:
        """The task ended well: fill the bar, or write the closing line of a transfer."""
        if self.finished:
            return
        self.finished = True
        if self.display.live:
            total = self.total if self.total else max(self.done, 1)
            self.display._rich.update(self._id, completed=total, total=total)
            return
        if self.unit == "bytes":
            seconds = time.monotonic() - self.started
            size = self.total or self.done
            rate = f", {human_bytes(size / seconds)}/s" if seconds > 0.05 else ""
            self.display.log(f"{self.label}: {human_bytes(size)} in {seconds:.1f} s{rate}")


class Display:
    """The progress of one command, drawn on ``file`` (stdout by default) while the ``with``
    block runs; lines logged meanwhile appear above the bars."""

    def __init__(self, file: TextIO | None = None, *, live: bool | None = None) -> None:
        self.file = file if file is not None else sys.stdout
        self.live = is_terminal(self.file) if live is None else live
        self._rich: Any = None

    def __enter__(self) -> "Display":
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            console = Console(file=self.file, highlight=False)
            self._rich = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), *_columns(),
                                  TimeElapsedColumn(), console=console)
            self._rich.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    def log(self, line: str) -> None:
        """A line of output (pip's, a job's log)."""
        if self._rich is not None:
            self._rich.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            click.echo(line, file=self.file)

    def task(self, label: str, *, total: float | None = None, unit: str = "steps") -> Task:
        """A new task: ``unit`` "bytes" (a transfer: size and rate) or "steps" (percent of a job)."""
        return Task(self, label, total, unit)


def _columns() -> tuple[Any, Any]:
    """The amount column (bytes done of the total, or a percentage) and the rate column
    (a transfer's speed), each rendered by the task's unit."""
    from rich.progress import DownloadColumn, ProgressColumn, TransferSpeedColumn
    from rich.text import Text

    class Amount(ProgressColumn):
        """Bytes done of the total for a transfer, the percentage for a job with a known end."""

        def render(self, task: Any) -> Any:
            if task.fields.get("unit") == "bytes":
                return DownloadColumn().render(task)
            return Text(f"{task.percentage:>3.0f}%" if task.total else "")

    class Rate(ProgressColumn):
        def render(self, task: Any) -> Any:
            return TransferSpeedColumn().render(task) if task.fields.get("unit") == "bytes" else Text("")

    return Amount(), Rate()


# --- pip's output ----------------------------------------------------------------------

class PipOutput:
    """Feeds the lines of ``pip install --progress-bar raw`` to a display: each download
    becomes a transfer task (its bytes and rate), every other line is logged as it comes."""

    def __init__(self, display: Display, prefix: str = "") -> None:
        self.display = display
        self.prefix = prefix
        self.file = "download"
        self.task: Task | None = None

    def line(self, line: str) -> None:
        progress = pip_progress(line)
        if progress is None:
            self.file = pip_download_name(line) or self.file
            self.display.log(self.prefix + line)
            return
        done, total = progress
        if self.task is None or self.task.finished:
            self.task = self.display.task(f"Downloading {self.file}", total=total, unit="bytes")
        self.task.update(done, total=total)
        if done >= total:
            self.task.finish()


# --- server jobs -----------------------------------------------------------------------

def show_events(events: Iterator[dict[str, Any]], *, label: str, display: Display | None = None) -> dict[str, Any]:
    """Show a job's events (``GET /api/jobs/{id}/events``) until it ends; its ``end`` event.

    ``log`` events are written as lines; ``progress`` events move a bar: a transfer's
    (``unit: "bytes"`` with ``done`` and ``total``) in bytes with its rate, any other in
    percent, with the event's message as the current step."""
    own = display is None
    shown = display if display is not None else Display()
    if own:
        shown.__enter__()
    steps: Task | None = None
    transfers: dict[str, Task] = {}
    end: dict[str, Any] = {"status": "failed", "error": "the event stream ended early"}
    try:
        for event in events:
            kind = event.get("type")
            if kind == "log":
                shown.log(str(event.get("line", "")))
            elif kind == "progress":
                if event.get("unit") == "bytes" and event.get("total"):
                    name = str(event.get("message") or label)
                    task = transfers.get(name)
                    if task is None or task.finished:
                        task = transfers[name] = shown.task(name, total=event["total"], unit="bytes")
                    task.update(event.get("done") or 0, total=event["total"])
                    if (event.get("done") or 0) >= event["total"]:
                        task.finish()
                    continue
                fraction = event.get("progress")
                if steps is None:
                    steps = shown.task(label, total=100 if fraction is not None else None)
                steps.update(None if fraction is None else 100 * fraction, total=100 if fraction is not None else None,
                             message=event.get("message"))
            elif kind == "end":
                end = event
                if steps is not None and event.get("status") == "done":
                    steps.finish()
                break
    finally:
        if own:
            shown.__exit__(None, None, None)
    return end


def watch_job(client: Any, job_id: str, *, label: str) -> dict[str, Any]:
    """Show a server job's progress until it ends; its ``end`` event (``status``, ``error``,
    ``result``). Ctrl-C asks the server to cancel the job and exits with status 130."""
    try:
        return show_events(client.events(f"/api/jobs/{job_id}/events"), label=label)
    except KeyboardInterrupt:
        try:
            client.call("POST", f"/api/jobs/{job_id}/cancel")
        finally:
            click.echo(f"Cancelled: {label}.", err=True)
            sys.exit(130)


def follow_job(client: Any, job_id: str, *, label: str) -> Any:
    """Follow a server job with a progress display until it ends; its result. A job that
    failed or was cancelled is a LocalmError naming ``label``."""
    end = watch_job(client, job_id, label=label)
    if end.get("status") != "done":
        raise LocalmError(500, f"{label} {end.get('status', 'ended')}: {end.get('error') or 'no result'}")
    return end.get("result")
