"""What Open WebUI stream Filters cost per token: localm with N Functions holding a ``stream``
handler (installed with ``localm plugin install FILE.py``, run by the openwebui plugin)
against localm without them, in the same run, on the same GGUF and threads.

    .venv/bin/python bench/filters.py                  # 3 stream filters, 5 rounds
    .venv/bin/python bench/filters.py --filters 3 --rounds 9 --max-tokens 128

Each Filter is a sync ``stream(self, event)`` that reads and rewrites every chunk's
``delta.content`` as public stream filters do (a text replacement), so each token passes
through N Function calls, each in a worker thread. Everything else (rounds, the quiet-
machine check, the printed table: tokens/s, TTFT, CPU per request, the ratio) is
``bench/chat.py``'s ``--stream-hooks`` comparison; its other options pass through.
Target: tokens/s with 3 filters at least 0.9x of localm without (the issue's target; the
verdict line says it, not bench/chat.py's 0.97: ``--target-ratio`` changes it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import chat  # noqa: E402  (bench/chat.py, beside this file)
from localm.sdk.testing import LocalmServer  # noqa: E402

FILTER = '''"""
title: Bench Stream {n}
version: 1.0
"""

from pydantic import BaseModel, Field


class Filter:
    class Valves(BaseModel):
        priority: int = Field(default={n})
        replace: str = Field(default="\\u00a0", description="Text replaced by a space in each chunk")

    def __init__(self):
        self.valves = self.Valves()

    def stream(self, event: dict) -> dict:
        for choice in event.get("choices", []):
            delta = choice.get("delta", {{}})
            if delta.get("content"):
                delta["content"] = delta["content"].replace(self.valves.replace, " ")
        return event
'''


def write_functions(folder: Path, count: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for n in range(count):
        path = folder / f"bench_stream_{n}.py"
        path.write_text(FILTER.format(n=n))
        out.append(path)
    return out


#: tokens/s with the filters over tokens/s without, at least (the verdict line's target)
TARGET = 0.9


class WithFilters(chat.Localm):
    """bench/chat.py's localm; with ``hooks``, that many Open WebUI stream Filters installed."""

    def __init__(self, args: argparse.Namespace, workdir: Path, *, hooks: int = 0) -> None:
        super().__init__(args, workdir)
        self.functions: list[Path] = []
        if hooks:
            self.name = f"localm+{hooks} Open WebUI stream filter{'s' if hooks > 1 else ''}"
            self.functions = write_functions(workdir / "functions", hooks)
            plugins = ["chat", "llamacpp", "openwebui", *(path.stem for path in self.functions)]
            self.server = LocalmServer(workdir / "localm-data-functions", process=True, plugins=plugins)

    def start(self) -> None:
        self.server.data_dir.mkdir(parents=True, exist_ok=True)
        for path in self.functions:
            done = self.server.cli("plugin", "install", str(path), timeout=60)
            if done.returncode != 0:
                raise RuntimeError(f"localm plugin install {path.name} failed:\n{done.stdout}{done.stderr}")
        super().start()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--filters", type=int, default=3)
    known, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        return
    chat.Localm = WithFilters  # bench/chat.py's --stream-hooks comparison, with Functions as the hooks
    target = [] if any(a.startswith("--target-ratio") for a in rest) else ["--target-ratio", str(TARGET)]
    sys.argv = [sys.argv[0], "--stream-hooks", str(max(known.filters, 1)), *target, *rest]
    chat.main()


if __name__ == "__main__":
    main(sys.argv[1:])
