"""Every example in docs/ is executed by a test.

The pages mark their examples so this file can find them:

- A fenced block whose info string holds ``title="PATH"`` is a file: it is written to
  PATH in the page's project folder. ``title="PATH (continued)"`` appends to that file.
- A ``console`` block is part of a terminal session. A line starting with ``$ `` is a
  command (a line ending in a backslash continues on the next one); the lines after it,
  up to the next command, are its output. In an output line ``...`` matches any text,
  and a line that is only ``...`` matches any number of lines.
- A ``text`` block whose title ends in ``/`` is a folder layout: it must list exactly the
  files the page writes under the folders it names.

Any other fenced block in docs/ fails ``test_every_block_is_checked``.

Each page that has files or commands runs as one session, top to bottom, in an empty
folder. Commands run with bash there, with ``LOCALM_HOME`` naming a fresh data directory
and ``localm``, ``python`` and ``pytest`` meaning this interpreter's (and ``curl`` a small
stand-in when curl is not installed). ``localm serve ARGS`` starts the server through the
``localm_server`` fixture instead: the same command, on a free port. The documented
address http://127.0.0.1:8642 is replaced by the server's own in commands, and the
other way round in outputs; the data directory reads as /home/you/.localm.
``NAME=$(command)`` keeps the command's stdout in ``$NAME`` for later commands, and its
output is only what it prints on stderr. Every command must exit with status 0.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

DOC_URL = "http://127.0.0.1:8642"
DOC_PORT = "8642"
DOC_HOME = "/home/you/.localm"

FENCE = re.compile(r"^(`{3,})(.*)$")
TITLE = re.compile(r'title="([^"]*)"')
ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=\$\((.*)\)$", re.S)
SERVE = re.compile(r"^localm serve(\s|$)")
CONTINUED = " (continued)"


# --- reading the pages ----------------------------------------------------------------

@dataclass
class Block:
    page: str
    line: int
    lang: str
    title: str | None
    text: str

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"

    @property
    def kind(self) -> str | None:
        if self.lang == "console" and self.title is None:
            return "console"
        if self.lang == "text" and self.title and self.title.endswith("/"):
            return "layout"
        if self.title:
            return "file"
        return None


def read_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2).strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].rstrip() != fence:
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"docs/{path.name}:{start + 1}: unclosed code block")
        i += 1
        title = TITLE.search(info)
        out.append(Block(path.name, start + 1, info.split()[0] if info else "", title.group(1) if title else None,
                         "\n".join(body) + "\n"))
    return out


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def runnable_pages() -> list[str]:
    return [p.name for p in pages() if any(b.kind in ("file", "console") for b in read_blocks(p))]


def commands(block: Block) -> list[tuple[str, list[str]]]:
    """The (command, expected output lines) pairs of a console block."""
    out: list[tuple[str, list[str]]] = []
    lines = block.text.rstrip("\n").split("\n")
    i = 0
    if lines and not lines[0].startswith("$ "):
        raise AssertionError(f"{block.where}: a console block starts with a `$ ` command")
    while i < len(lines):
        command = lines[i][2:]
        while command.endswith("\\") and i + 1 < len(lines):
            i += 1
            command += "\n" + lines[i]
        i += 1
        expected: list[str] = []
        while i < len(lines) and not lines[i].startswith("$ "):
            expected.append(lines[i].rstrip())
            i += 1
        while expected and not expected[-1]:
            expected.pop()
        out.append((command, expected))
    return out


# --- matching output ------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def line_pattern(expected: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in expected.split("...")))


def lines_match(expected: list[str], actual: list[str]) -> bool:
    @functools.lru_cache(maxsize=None)
    def match(i: int, j: int) -> bool:
        if i == len(expected):
            return j == len(actual)
        if expected[i] == "...":
            return any(match(i + 1, k) for k in range(j, len(actual) + 1))
        return j < len(actual) and bool(line_pattern(expected[i]).fullmatch(actual[j])) and match(i + 1, j + 1)
    return match(0, 0)


# --- running a page -------------------------------------------------------------------

CURL_STAND_IN = r'''
import sys

import httpx

method, headers, data, include, output, write_out, url = None, {}, None, False, None, None, None
args = sys.argv[1:]
i = 0
while i < len(args):
    a = args[i]
    if a in ("-X", "--request"):
        method = args[i + 1]
    elif a in ("-H", "--header"):
        key, _, value = args[i + 1].partition(":")
        headers[key.strip()] = value.strip()
    elif a in ("-d", "--data"):
        data = args[i + 1]
    elif a in ("-o", "--output"):
        output = args[i + 1]
    elif a in ("-w", "--write-out"):
        write_out = args[i + 1]
    elif a.startswith("-") and not a.startswith("--") and set(a[1:]) <= set("siSN"):
        include = include or "i" in a
        i += 1
        continue
    elif a.startswith("-"):
        sys.exit(f"curl stand-in: unsupported option {a}")
    else:
        url = a
        i += 1
        continue
    i += 2
if data is not None:
    method = method or "POST"
    headers.setdefault("Content-Type", "application/x-www-form-urlencoded")
r = httpx.request(method or "GET", url, headers=headers, content=data, timeout=60)
text = ""
if include:
    text += f"HTTP/1.1 {r.status_code} {r.reason_phrase}\r\n"
    text += "".join(f"{k}: {v}\r\n" for k, v in r.headers.multi_items()) + "\r\n"
if output != "/dev/null":
    text += r.text
if write_out:
    text += write_out.replace("%{http_code}", str(r.status_code)).replace("\\n", "\n")
sys.stdout.write(text)
'''


class Session:
    """One page's examples, run in order in an empty folder."""

    def __init__(self, tmp: Path, start_server: Callable[..., Any]) -> None:
        self.cwd = tmp / "project"
        self.home = tmp / "home"
        self.cwd.mkdir()
        self.start_server = start_server
        self.server: Any = None
        self.written: list[str] = []
        self.layouts: list[Block] = []
        self.vars: dict[str, str] = {}
        bindir = tmp / "bin"
        bindir.mkdir()
        python = shlex.quote(sys.executable)
        self._shim(bindir / "localm", f'#!/bin/sh\nexec {python} -m localm.kernel "$@"\n')
        self._shim(bindir / "python", f'#!/bin/sh\nexec {python} "$@"\n')
        self._shim(bindir / "pytest", f'#!/bin/sh\nexec {python} -m pytest "$@"\n')
        if shutil.which("curl") is None:
            self._shim(bindir / "curl", f"#!{sys.executable}\n{CURL_STAND_IN}")
        (tmp / "pytest-tmp").mkdir()
        self.env = {k: v for k, v in os.environ.items() if k != "LOCALM_API_KEY"}
        self.env.update(LOCALM_HOME=str(self.home), PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
                        PYTEST_DEBUG_TEMPROOT=str(tmp / "pytest-tmp"))

    @staticmethod
    def _shim(path: Path, text: str) -> None:
        path.write_text(text)
        path.chmod(0o755)

    # --- blocks ---------------------------------------------------------------
    def run_block(self, block: Block) -> None:
        if block.kind == "file":
            self.write(block)
        elif block.kind == "console":
            for command, expected in commands(block):
                self.run(block, command, expected)
        elif block.kind == "layout":
            self.layouts.append(block)

    def write(self, block: Block) -> None:
        assert block.title is not None
        append = block.title.endswith(CONTINUED)
        rel = block.title[: -len(CONTINUED)] if append else block.title
        path = self.cwd / rel
        if append:
            assert rel in self.written, f"{block.where}: continues {rel}, which no earlier block starts"
            path.write_text(path.read_text() + "\n\n" + block.text)
        else:
            assert rel not in self.written, f"{block.where}: {rel} is written twice (mark the second one continued)"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.text)
            self.written.append(rel)

    # --- commands ---------------------------------------------------------------
    def normalize(self, text: str) -> list[str]:
        text = text.replace("\r\n", "\n")
        if self.server is not None:
            text = text.replace(self.server.url, DOC_URL)
            text = re.sub(rf"(?<!\d){self.server.port}(?!\d)", DOC_PORT, text)
        text = text.replace(str(self.home), DOC_HOME)
        lines = [line.rstrip() for line in text.split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    def run(self, block: Block, command: str, expected: list[str]) -> None:
        where = f"{block.where}: `{command}`"
        if SERVE.match(command):
            assert self.server is None, f"{where}: a server is already running"
            self.server = self.start_server(data_dir=self.home, args=shlex.split(command)[2:])
            log = self.normalize(self.server.log())
            for line in expected:
                assert any(line_pattern(line).fullmatch(got) for got in log), \
                    f"{where}: no line of the server's output matches {line!r}:\n" + "\n".join(log)
            return
        if self.server is not None:
            command = command.replace(DOC_URL, self.server.url)
        env = {**self.env, **self.vars}
        assign = ASSIGN.match(command)
        if assign:
            proc = subprocess.run(["bash", "-c", assign.group(2)], cwd=self.cwd, env=env, capture_output=True,
                                  text=True, timeout=300)
            shown, everything = proc.stderr, proc.stdout + proc.stderr
            self.vars[assign.group(1)] = proc.stdout.strip()
        else:
            proc = subprocess.run(["bash", "-c", command], cwd=self.cwd, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=300)
            shown = everything = proc.stdout
        assert proc.returncode == 0, f"{where} exited with status {proc.returncode}:\n{everything}"
        actual = self.normalize(shown)
        assert lines_match(expected, actual), (
            f"{where}: the output differs from the documented one.\n--- documented\n" + "\n".join(expected)
            + "\n--- actual\n" + "\n".join(actual))

    # --- after the last block -------------------------------------------------------
    def check_layouts(self) -> None:
        for block in self.layouts:
            listed = layout_files(block)
            roots = {path.split("/")[0] for path in listed}
            written = {path for path in self.written if path.split("/")[0] in roots}
            assert listed == written, (f"{block.where}: the layout lists {sorted(listed)}, "
                                       f"but the page writes {sorted(written)}")

    def check_imports(self) -> None:
        """The plugins on a page import localm.sdk only: never localm.kernel nor another plugin."""
        plugin_dirs = {str(Path(p).parent) for p in self.written if Path(p).name == "plugin.toml"}
        for rel in self.written:
            if not rel.endswith(".py") or not any(rel.startswith(d + "/") for d in plugin_dirs):
                continue
            tree = ast.parse((self.cwd / rel).read_text(), filename=rel)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = ([f"{node.module}.{alias.name}" for alias in node.names] if node.module == "localm"
                             else [node.module])
                else:
                    continue
                for name in names:
                    if name == "localm" or name.startswith("localm."):
                        assert name == "localm.sdk" or name.startswith("localm.sdk."), \
                            f"{rel}: imports {name}; a plugin imports localm.sdk only"
                    assert not name.startswith("localm_plugins"), f"{rel}: imports another plugin ({name})"


def layout_files(block: Block) -> set[str]:
    """The files a layout block lists: four spaces of indent per folder level."""
    stack: list[str] = []
    files: set[str] = set()
    for line in block.text.rstrip("\n").split("\n"):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        assert indent % 4 == 0 and indent // 4 <= len(stack), f"{block.where}: bad indent in {line!r}"
        del stack[indent // 4:]
        name = line.strip()
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
        else:
            files.add("/".join([*stack, name]))
    return files


# --- the tests ------------------------------------------------------------------------

def test_every_block_is_checked() -> None:
    assert pages(), "docs/ has no pages"
    unchecked = [f"{b.where} (```{b.lang})" for p in pages() for b in read_blocks(p) if b.kind is None]
    assert not unchecked, ("these code blocks are run by no test; give each a title (a file), make it a console "
                           "session, or make it a layout:\n" + "\n".join(unchecked))


def test_the_runner_matches_output_as_documented() -> None:
    assert lines_match(["Key key_...: shown once"], ["Key key_1a2b: shown once"])
    assert lines_match(["...", "1 passed in ..."], [".   [100%]", "1 passed in 0.5s"])
    assert lines_match(["a", "..."], ["a"])
    assert not lines_match(["a"], ["a", "b"])
    assert not lines_match(["{\"ok\":true}"], ["{\"ok\":false}"])


@pytest.mark.parametrize("page", runnable_pages())
def test_page_runs(page: str, tmp_path: Path, localm_server: Callable[..., Any],
                   monkeypatch: pytest.MonkeyPatch) -> None:
    session = Session(tmp_path, localm_server)
    if page == "images.md":  # a real ComfyUI, built once by tests/comfyui_env.py, is $COMFY
        import comfyui_env
        reason = comfyui_env.unavailable()
        if reason is not None:
            pytest.skip(reason)
        session.env["COMFY"] = str(comfyui_env.cache_dir())
    monkeypatch.chdir(session.cwd)
    for block in read_blocks(DOCS / page):
        session.run_block(block)
    session.check_layouts()
    session.check_imports()
