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

    def __init__(self, display: "Display", label: str, total: float | None, unit: str,
                 announce: bool = True, prefix: str = "") -> None:
        self.display = display
        self.label = label
        self.prefix = prefix  # indents this task's plain lines
        self.total = total or None  # 0: not known
        self.unit = unit
        self.done = 0.0
        self.message: str | None = None
        self.started = time.monotonic()
        self.finished = False
        self._last_plain = self.started
        self._id: Any = None
        if display.live:
            self._id = display._rich.add_task(label, total=self.total, unit=unit)
        elif unit == "bytes" and announce:
            display.log(f"{prefix}{label} ({human_bytes(self.total)})" if self.total else prefix + label)

    def update(self, done: float | None = None, *, total: float | None = None, message: str | None = None) -> None:
        """Move the task to ``done`` (bytes, or percent for steps); a new ``message`` is a new step."""
        if self.finished:
            return
        if total is not None:
            self.total = total or None
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
                self.display.log(f"{self.prefix}  {self.label}: {100 * self.done / self.total:.0f}% "
                                 f"({human_bytes(self.done)} of {human_bytes(self.total)}, {human_bytes(rate)}/s)")
        elif step:
            share = f"[{self.done:3.0f}%] " if self.total else ""
            self.display.log(f"{self.prefix}{share}{self.label}: {self.message}")

    def finish(self) -> None:
        """The task ended well: its full bar moves up among the lines logged so far (so the
        output reads in order), or in plain mode a transfer writes its closing line."""
        if self.finished:
            return
        self.finished = True
        if self.display.live:
            rich = self.display._rich
            total = self.total if self.total else max(self.done, 1)
            rich.update(self._id, completed=total, total=total)
            done = [task for task in rich.tasks if task.id == self._id]
            rich.console.print(rich.make_tasks_table(done))
            rich.remove_task(self._id)
            return
        if self.unit == "bytes":
            seconds = time.monotonic() - self.started
            size = self.total or self.done
            rate = f", {human_bytes(size / seconds)}/s" if seconds > 0.05 else ""
            self.display.log(f"{self.prefix}{self.label}: {human_bytes(size)} in {seconds:.1f} s{rate}")


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

            from rich.table import Column

            console = Console(file=self.file, highlight=False)
            # the numbers keep their width on any terminal: the label gives way, cut with an ellipsis
            # (the spinner, a 20-cell bar, "1023.9/1024.0 MB", "1023.9 MB/s", "0:00:00" and the gaps
            # take 60 cells)
            label = Column(no_wrap=True, overflow="ellipsis", max_width=max(10, console.width - 60))
            self._rich = Progress(SpinnerColumn(), TextColumn("{task.description}", table_column=label),
                                  BarColumn(bar_width=20), *_columns(), TimeElapsedColumn(), console=console)
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

    def task(self, label: str, *, total: float | None = None, unit: str = "steps", announce: bool = True,
             prefix: str = "") -> Task:
        """A new task: ``unit`` "bytes" (a transfer: size and rate) or "steps" (percent of a job).
        Without ``announce`` a transfer writes no opening line in plain mode (pip's own
        ``Downloading NAME (SIZE)`` line already said it), only its closing one; ``prefix``
        indents its plain lines."""
        return Task(self, label, total, unit, announce, prefix)


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

class Transfers:
    """The byte transfers of one piece of work, by name: each drawn as a bar with its size and
    rate, or in plain mode closed with one line. A transfer pip announced with its own
    ``Downloading NAME (SIZE)`` line (the last line logged) is not announced again."""

    def __init__(self, display: Display, prefix: str = "") -> None:
        self.display = display
        self.prefix = prefix
        self.open: dict[str, Task] = {}
        self.announced: str | None = None  # the file of the last "Downloading NAME" line logged

    def logged(self, line: str) -> None:
        self.announced = pip_download_name(line)

    def update(self, label: str, file: str | None, done: float, total: float | None) -> None:
        task = self.open.get(label)
        if task is None:
            task = self.open[label] = self.display.task(label, total=total, unit="bytes", prefix=self.prefix,
                                                        announce=file is None or file != self.announced)
        task.update(done, total=total)
        if task.total and done >= task.total:
            self.finish(label)

    def finish(self, label: str | None = None) -> None:
        """End the transfer ``label`` (None: every open one) as complete."""
        for name in [label] if label is not None else list(self.open):
            task = self.open.pop(name, None)
            if task is not None:
                task.finish()

    def settle(self) -> None:
        """The work moved on: a transfer of unknown size has ended; one that stopped short of
        its size did not complete, and its bar stays where it stopped."""
        for name, task in list(self.open.items()):
            del self.open[name]
            if not task.total:
                task.finish()


class PipOutput:
    """Feeds the lines of ``pip install --progress-bar raw`` to a display: each download
    becomes a transfer (its bytes and rate), every other line is logged as it comes."""

    def __init__(self, display: Display, prefix: str = "") -> None:
        self.display = display
        self.prefix = prefix
        self.file = "a file"
        self.transfers = Transfers(display, prefix)

    def line(self, line: str) -> None:
        progress = pip_progress(line)
        if progress is None:
            self.transfers.settle()  # pip moved on: a download of unknown size has ended
            self.file = pip_download_name(line) or self.file
            self.display.log(self.prefix + line)
            self.transfers.logged(line)
            return
        done, total = progress
        self.transfers.update(f"Downloading {self.file}", self.file, done, total or None)

    def close(self) -> None:
        self.transfers.settle()


# --- server jobs -----------------------------------------------------------------------

def show_events(events: Iterator[dict[str, Any]], *, label: str, display: Display | None = None) -> dict[str, Any]:
    """Show a job's events (``GET /api/jobs/{id}/events``) until it ends; its ``end`` event.

    ``log`` events are written as lines; ``progress`` events move a bar: a transfer's
    (``unit: "bytes"`` with ``done`` and ``total``; ``file`` names what moves) in bytes with
    its rate, any other in percent, with the event's message as the current step."""
    own = display is None
    shown = display if display is not None else Display()
    if own:
        shown.__enter__()
    steps: Task | None = None
    transfers = Transfers(shown)
    end: dict[str, Any] = {"status": "failed", "error": "the event stream ended early"}
    try:
        for event in events:
            kind = event.get("type")
            if kind == "log":
                line = str(event.get("line", ""))
                shown.log(line)
                transfers.logged(line)
            elif kind == "progress" and event.get("unit") == "bytes":
                transfers.update(str(event.get("message") or label), event.get("file"),
                                 float(event.get("done") or 0), event.get("total") or None)
            elif kind == "progress":
                fraction = event.get("progress")
                if steps is None:
                    steps = shown.task(label, total=100 if fraction is not None else None)
                steps.update(None if fraction is None else 100 * fraction, total=100 if fraction is not None else None,
                             message=event.get("message"))
            elif kind == "end":
                end = event
                if event.get("status") == "done":
                    transfers.finish()
                    if steps is not None:
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
