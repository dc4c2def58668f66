"""``localm run``: talk to a model from the terminal (the command this plugin registers).

With a prompt (or text piped in) it streams the answer to stdout and exits; without one it
opens an interactive chat. Either way it talks to the server running on the data dir,
over this plugin's ``POST /v1/chat/completions`` with ``stream: true``, and prints
each piece of the answer the moment it arrives. When no server runs it starts
``localm serve`` in the background and says so. Requests carry the caller's key
(``--key`` or ``LOCALM_API_KEY``) when there is one, else the server's attach token.

The CLI imports this module only for the command (``register_commands``): it imports
nothing the ``localm`` command has not loaded already.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any, Iterator, TextIO

import attrs
import click
import httpx
from localm import sdk
from localm.sdk import cli as sdk_cli

LocalmError = sdk.LocalmError
ServerClient = sdk.ServerClient
ServerError = sdk.ServerError

#: Sampling parameters ``/set parameter`` and ``--parameter`` accept: (request field, type,
#: lowest, highest); the bounds are those the chat routes enforce.
PARAMETERS: dict[str, tuple[str, type, float | None, float | None]] = {
    "temperature": ("temperature", float, 0, 2),
    "top_p": ("top_p", float, 0, 1),
    "top_k": ("top_k", int, 0, None),
    "min_p": ("min_p", float, 0, 1),
    "seed": ("seed", int, 0, 2**32 - 1),
    "max_tokens": ("max_tokens", int, 1, None),
    "num_predict": ("max_tokens", int, 1, None),  # Ollama's name for it
    "presence_penalty": ("presence_penalty", float, -2, 2),
    "frequency_penalty": ("frequency_penalty", float, -2, 2),
    "repeat_penalty": ("repeat_penalty", float, 0, None),
    "stop": ("stop", str, None, None),
}
MAX_STOPS = 16

HELP = """Commands:
  /set system TEXT           Set the system message (clears nothing else)
  /set parameter NAME VALUE  Set a sampling parameter for the next answers
                             (temperature, top_p, top_k, min_p, seed, max_tokens,
                             presence_penalty, frequency_penalty, repeat_penalty, stop)
  /set verbose | quiet       Show or hide token counts and speed after each answer
  /unset system | parameter NAME
  /show info | parameters | system | template | license
  /load MODEL                Talk to another model (the conversation stays)
  /clear                     Forget the conversation
  /bye                       Leave (or Ctrl-D)

Start and end a multi-line message with \"\"\". Ctrl-C stops an answer."""


def parse_parameter(name: str, value: str) -> tuple[str, Any]:
    """(request field, value) for ``NAME VALUE``; a LocalmError naming what is accepted."""
    spec = PARAMETERS.get(name)
    if spec is None:
        raise LocalmError(400, f"Unknown parameter: {name}; one of {', '.join(PARAMETERS)}")
    field, kind, lo, hi = spec
    if kind is str:
        if not value or len(value) > 1024:
            raise LocalmError(400, "stop must be 1 to 1024 characters")
        return field, value
    try:
        number: Any = int(value) if kind is int else float(value)
    except ValueError:
        raise LocalmError(400, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}") \
            from None
    if number != number or (lo is not None and number < lo) or (hi is not None and number > hi):
        bounds = (f"between {lo:g} and {hi:g}" if hi is not None else f"at least {lo:g}") if lo is not None else ""
        raise LocalmError(400, f"{name} must be {bounds}, got {value}")
    return field, number


# --- the connection ------------------------------------------------------------------------

class Connection:
    """HTTP to the server, as the caller: their key when they have one, else the attach token."""

    def __init__(self, server: ServerClient, key: str | None) -> None:
        self.url = server.url
        self.auth = f"Bearer {key}" if key else str(server.http.headers["Authorization"])
        self.verify = server.verify  # an HTTPS server: what its own clients trust (its CA)
        self.http = self._client()

    def _client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": self.auth}, verify=self.verify,
                            timeout=httpx.Timeout(None, connect=10.0))

    def reset(self) -> None:
        """A fresh connection (after an answer was cut off mid-stream)."""
        self.http.close()
        self.http = self._client()

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise self._lost(exc) from None
        if response.status_code >= 400:
            raise ServerError(response.status_code, _detail(response))
        return response.json()

    def chunks(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The chunks of a streamed chat completion, each as soon as it arrives."""
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ServerError(response.status_code, _detail(response))
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        return
                    if line.startswith("data: "):
                        yield json.loads(line[6:])
        except httpx.HTTPError as exc:
            self.reset()
            raise self._lost(exc) from None

    def _lost(self, exc: httpx.HTTPError) -> LocalmError:
        return LocalmError(503, f"The localm server at {self.url} did not answer ({exc.__class__.__name__}"
                                + (f": {exc}" if str(exc) else "") + "); is it still running?",
                           code="server_not_running")


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail", response.text))
    except ValueError:
        return response.text


# --- one answer ------------------------------------------------------------------------------

@attrs.define
class Answer:
    content: str = ""
    reasoning: str = ""
    usage: dict[str, Any] | None = None
    interrupted: bool = False


class Writer:
    """Writes an answer as it streams: the reasoning dimmed (on a terminal only), then the text."""

    def __init__(self, out: TextIO, *, tty: bool, show_reasoning: bool) -> None:
        self.out = out
        self.tty = tty
        self.show_reasoning = show_reasoning and tty
        self.state = "start"  # "reasoning" once thinking is shown, "content" once the answer starts
        self.last = "\n"

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
        if text:
            self.last = text[-1]

    def reasoning(self, text: str) -> None:
        if not self.show_reasoning or not text:
            return
        self.state = "reasoning"
        self._write(click.style(text, dim=True))

    def content(self, text: str) -> None:
        if not text:
            return
        if self.state == "reasoning":
            self._write("\n\n" if self.last != "\n" else "\n")
        self.state = "content"
        self._write(text)

    def end(self) -> None:
        if self.last != "\n":
            self._write("\n")


def stream_answer(conn: Connection, body: dict[str, Any], writer: Writer) -> Answer:
    """Send one chat request and write its answer as it streams. Ctrl-C stops it (the server
    stops generating when the connection closes) and marks the answer interrupted."""
    answer = Answer()
    try:
        for chunk in conn.chunks(body):
            if chunk.get("usage"):
                answer.usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                error = choice.get("localm_error")
                if error:
                    raise LocalmError(int(error.get("status") or 500), str(error.get("detail")),
                                      code=error.get("code"))
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    answer.reasoning += delta["reasoning_content"]
                    writer.reasoning(delta["reasoning_content"])
                if delta.get("content"):
                    answer.content += delta["content"]
                    writer.content(delta["content"])
    except KeyboardInterrupt:
        answer.interrupted = True
        conn.reset()
    finally:
        writer.end()
    return answer


def stats_line(usage: dict[str, Any] | None) -> str:
    if not usage:
        return "(no usage reported)"
    parts = [f"{usage.get('completion_tokens', 0)} tokens"]
    if usage.get("tokens_per_sec") is not None:
        parts.append(f"{usage['tokens_per_sec']:.1f} tokens/s")
    if usage.get("ttft_ms") is not None:
        parts.append(f"first token after {usage['ttft_ms']:.0f} ms")
    parts.append(f"prompt {usage.get('prompt_tokens', 0)} tokens")
    return ", ".join(parts)


# --- a conversation ------------------------------------------------------------------------

class Chat:
    """A conversation with one model: its messages, system message and parameters."""

    def __init__(self, conn: Connection, data_dir: Path, model: str | None, *, system: str | None = None,
                 parameters: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                 verbose: bool = False, show_reasoning: bool = True, out: TextIO | None = None) -> None:
        self.conn = conn
        self.data_dir = data_dir
        self.model = model
        self.system = system
        self.parameters: dict[str, Any] = dict(parameters or {})
        self.extra = dict(extra or {})
        self.messages: list[dict[str, str]] = []
        self.verbose = verbose
        self.show_reasoning = show_reasoning
        self.out = out if out is not None else sys.stdout

    @property
    def tty(self) -> bool:
        return _isatty(self.out)

    def body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        body: dict[str, Any] = {"messages": head + messages, "stream": True,
                                "stream_options": {"include_usage": True}, **self.extra, **self.parameters}
        if self.model:
            body["model"] = self.model
        return body

    def ask(self, text: str) -> Answer:
        """Ask ``text`` and stream the answer; it joins the conversation unless it was cut off."""
        turn = [*self.messages, {"role": "user", "content": text}]
        writer = Writer(self.out, tty=self.tty, show_reasoning=self.show_reasoning)
        answer = stream_answer(self.conn, self.body(turn), writer)
        if answer.interrupted:
            return answer
        self.messages = [*turn, {"role": "assistant", "content": answer.content}]
        if self.verbose:
            line = stats_line(answer.usage)
            if self.tty:
                click.echo(click.style(line, dim=True), file=self.out)
            else:
                click.echo(line, err=True)
        return answer

    # --- what the model is ---------------------------------------------------------------
    def resolve_model(self, name: str | None) -> str:
        """The registered id ``name`` (None: the server's active or default model) stands for;
        a LocalmError when no model of that name is registered."""
        if name is None:
            return str(self.conn.call("GET", "/health").get("model"))
        try:
            return str(self.conn.call("GET", f"/v1/models/{name}")["id"])
        except ServerError as exc:
            if exc.status in (401, 403):  # a key without models:read: the chat request will tell
                return name
            if exc.status == 404:
                raise not_found(name) from None
            raise

    def card(self) -> dict[str, Any]:
        out = sdk_cli.model_card(self.model or "", self.data_dir)
        try:
            out["server"] = self.conn.call("GET", f"/v1/models/{out['id']}")
        except ServerError:
            out["server"] = {}
        return out


def not_found(name: str) -> LocalmError:
    """The 404 for a model name the registry does not hold (a prompt given first says so)."""
    hint = (" (localm run MODEL PROMPT: the model comes first; `localm models` lists them)"
            if " " in name else " (`localm models` lists the registered ones)")
    return LocalmError(404, f"Model not found: {name}{hint}")


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def stdin_text(stream: TextIO | None = None) -> str | None:
    """What was piped in: stdin's text when it is a pipe or a file, None when it is a terminal
    or a device (such as /dev/null), which are never read."""
    stream = stream if stream is not None else sys.stdin
    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (AttributeError, OSError, ValueError):
        return None
    if stream.isatty() or not (stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or stat.S_ISSOCK(mode)):
        return None
    return stream.read()


# --- the interactive chat ------------------------------------------------------------------------

class Repl:
    """The interactive chat: a prompt with line editing and history, commands that start with /."""

    PROMPT = ">>> "
    MORE = "... "

    def __init__(self, chat: Chat) -> None:
        self.chat = chat
        self.history = chat.data_dir / "history"

    def run(self) -> int:
        self._readline()
        tip = "Type /? for help, /bye to leave; Ctrl-C stops an answer."
        click.echo(f"Chatting with {self.chat.model}. {tip}")
        while True:
            try:
                text = self.read()
            except EOFError:
                click.echo()
                return 0
            except KeyboardInterrupt:
                click.echo("\nUse Ctrl + d or /bye to exit.")
                continue
            if not text.strip():
                continue
            if text.lstrip().startswith("/"):
                try:
                    if self.command(text.strip()) == "bye":
                        return 0
                except LocalmError as exc:
                    click.echo(f"Error: {exc.detail}", err=True)
                except KeyboardInterrupt:  # a /load or /show that takes long: back to the prompt
                    self.chat.conn.reset()
                    click.echo(click.style("\n(interrupted)", dim=self.chat.tty))
                continue
            try:
                answer = self.chat.ask(text)
            except LocalmError as exc:
                click.echo(f"Error: {exc.detail}" + (f" (HTTP {exc.status})" if isinstance(exc, ServerError) else ""),
                           err=True)
                if exc.status == 413 and self.chat.messages:
                    click.echo("The conversation no longer fits the model's context window: /clear starts afresh.",
                               err=True)
                continue
            if answer.interrupted:
                click.echo(click.style("(stopped)", dim=True))

    def read(self) -> str:
        """One message: a line, or the lines between \"\"\" and \"\"\"."""
        first = input(self.PROMPT)
        if not first.lstrip().startswith('"""'):
            return first
        rest = first.lstrip()[3:]
        if rest.rstrip().endswith('"""'):
            return rest.rstrip()[:-3]
        lines = [rest] if rest else []
        while True:
            line = input(self.MORE)
            if line.rstrip().endswith('"""'):
                lines.append(line.rstrip()[:-3])
                return "\n".join(lines).strip("\n")
            lines.append(line)

    def _readline(self) -> None:
        try:
            import readline
        except ImportError:  # no line editing on this platform: input() still works
            return
        try:
            readline.read_history_file(self.history)
        except OSError:
            pass
        readline.set_history_length(1000)
        import atexit

        def save() -> None:
            try:
                readline.write_history_file(self.history)
            except OSError:
                pass
        atexit.register(save)

    # --- commands ------------------------------------------------------------------------
    def command(self, line: str) -> str | None:
        words = line.split(maxsplit=2)
        name = words[0].lower()
        chat = self.chat
        if name in ("/bye", "/exit", "/quit"):
            return "bye"
        if name in ("/?", "/help"):
            click.echo(HELP)
        elif name == "/clear":
            chat.messages = []
            click.echo("Cleared the conversation.")
        elif name == "/set":
            self._set(words[1:], line)
        elif name == "/unset":
            self._unset(words[1:])
        elif name == "/show":
            self._show(words[1] if len(words) > 1 else "")
        elif name == "/load":
            if len(words) != 2:
                raise LocalmError(400, "Usage: /load MODEL")
            self._load(words[1])
        else:
            raise LocalmError(400, f"Unknown command {words[0]}; type /? for help")
        return None

    def _set(self, words: list[str], line: str) -> None:
        chat = self.chat
        what = words[0].lower() if words else ""
        if what == "system":
            text = line.split(maxsplit=2)[2] if len(words) > 1 else ""
            if not text.strip():
                raise LocalmError(400, "Usage: /set system TEXT")
            chat.system = text.strip().strip('"')
            click.echo("Set the system message.")
        elif what == "parameter":
            parts = line.split(maxsplit=3)
            if len(parts) != 4:
                raise LocalmError(400, "Usage: /set parameter NAME VALUE")
            field, value = parse_parameter(parts[2], parts[3])
            if field == "stop":
                stops = list(chat.parameters.get("stop", []))
                if len(stops) >= MAX_STOPS:
                    raise LocalmError(400, f"At most {MAX_STOPS} stop sequences; /unset parameter stop clears them")
                chat.parameters["stop"] = [*stops, value]
            else:
                chat.parameters[field] = value
            click.echo(f"Set parameter {parts[2]} to {parts[3]}.")
        elif what == "verbose":
            chat.verbose = True
            click.echo("Set verbose: token counts and speed follow each answer.")
        elif what == "quiet":
            chat.verbose = False
            click.echo("Set quiet.")
        else:
            raise LocalmError(400, "Usage: /set system TEXT | /set parameter NAME VALUE | /set verbose | /set quiet")

    def _unset(self, words: list[str]) -> None:
        chat = self.chat
        if words[:1] == ["system"]:
            chat.system = None
            click.echo("Cleared the system message.")
        elif words[:1] == ["parameter"] and len(words) == 2:
            name = words[1].strip()
            if name not in PARAMETERS:
                raise LocalmError(400, f"Unknown parameter: {name}; one of {', '.join(PARAMETERS)}")
            chat.parameters.pop(PARAMETERS[name][0], None)
            click.echo(f"Unset parameter {name}.")
        else:
            raise LocalmError(400, "Usage: /unset system | /unset parameter NAME")

    def _show(self, what: str) -> None:
        chat = self.chat
        if what == "system":
            click.echo(chat.system or "No system message is set.")
            return
        if what == "parameters":
            shown = {**sdk_cli.default_parameters(), **chat.parameters}
            for key, value in shown.items():
                mark = "" if key in chat.parameters else "  (default)"
                click.echo(f"{key:<18} {json.dumps(value)}{mark}")
            return
        if what not in ("info", "template", "license"):
            raise LocalmError(400, "Usage: /show info | parameters | system | template | license")
        card = chat.card()
        if what == "template":
            click.echo(card["template"] or "This model has no chat template.")
        elif what == "license":
            click.echo(card["license"] or "No licence is recorded for this model.")
        else:
            human_count = sdk_cli.human_count
            server = card.get("server") or {}
            rows = [("model", card["id"]), ("architecture", card.get("architecture") or "unknown"),
                    ("parameters", human_count(card.get("parameter_count"))),
                    ("context length", card.get("context_window") or "unknown"),
                    ("quantization", card.get("quantization") or "unknown"),
                    ("capabilities", ", ".join(card["capability_names"])),
                    ("engine", server.get("engine") or "(not loaded)"),
                    ("system message", chat.system or "(none)"),
                    ("parameters set", ", ".join(f"{k}={json.dumps(v)}" for k, v in chat.parameters.items())
                     or "(none: the defaults)")]
            for key, value in rows:
                click.echo(f"{key:<16} {value}")

    def _load(self, name: str) -> None:
        chat = self.chat
        model = chat.resolve_model(name)
        try:
            chat.conn.call("POST", "/v1/models/load", params={"model": model})
        except ServerError as exc:
            if exc.status not in (401, 403):  # a key that may not load models: the first message loads it
                raise
        chat.model = model
        click.echo(f"Talking to {model} now.")


# --- the command -----------------------------------------------------------------------------

@click.command("run")
@click.argument("model", required=False, shell_complete=sdk_cli.complete_models)
@click.argument("prompt", nargs=-1)
@click.option("-s", "--system", help="A system message.")
@click.option("-p", "--parameter", "parameters", type=(str, str), multiple=True, metavar="NAME VALUE",
              help="A sampling parameter, as /set parameter takes it: temperature 0.2, seed 7, max_tokens 64, "
                   "stop '###'... (repeat for several).")
@click.option("--format", "format_", type=click.Choice(["json"]), help="Answer with a JSON object.")
@click.option("--think/--no-think", default=None,
              help="Ask a reasoning model to think before answering, or not (default: the model's own).")
@click.option("--hide-thinking", is_flag=True, help="Do not show a reasoning model's thinking.")
@click.option("--verbose", is_flag=True, help="After each answer, show token counts and speed.")
@click.option("--key", envvar="LOCALM_API_KEY", metavar="KEY", help="The API key to call the server with "
              "(default: $LOCALM_API_KEY, else the running server's own token, as the owner).")
def run(model: str | None, prompt: tuple[str, ...], system: str | None, parameters: tuple[tuple[str, str], ...],
        format_: str | None, think: bool | None, hide_thinking: bool, verbose: bool, key: str | None) -> None:
    """Talk to MODEL (default: the active model). With PROMPT, or with text piped in, print
    the answer and exit; otherwise chat interactively (/? for help)."""
    # A refusal (LocalmError, ServerError) leaves as `Error: ...` and exit status 1: the CLI
    # guards every plugin command so.
    try:
        _run(model, prompt, system=system, parameters=parameters, format_=format_, think=think,
             hide_thinking=hide_thinking, verbose=verbose, key=key)
    except KeyboardInterrupt:  # before the answer streams (a server starting, a model loading)
        click.echo(err=True)
        sys.exit(130)


def _run(model: str | None, prompt: tuple[str, ...], *, system: str | None, parameters: tuple[tuple[str, str], ...],
         format_: str | None, think: bool | None, hide_thinking: bool, verbose: bool, key: str | None) -> None:
    data_dir = sdk_cli.data_dir()
    chosen: dict[str, Any] = {}
    for name, value in parameters:
        field, parsed = parse_parameter(name, value)
        if field == "stop":
            chosen["stop"] = [*chosen.get("stop", []), parsed]
            if len(chosen["stop"]) > MAX_STOPS:
                raise LocalmError(400, f"At most {MAX_STOPS} stop sequences")
        else:
            chosen[field] = parsed
    extra: dict[str, Any] = {}
    if format_ == "json":
        extra["response_format"] = {"type": "json_object"}
    if think is not None:
        extra["chat_template_kwargs"] = {"enable_thinking": think}
    if model is not None and not sdk_cli.model_known(model, data_dir):  # before any server starts for it
        raise not_found(model)
    piped = stdin_text()
    words = " ".join(prompt)
    text = "\n\n".join(part for part in ((piped or "").strip(), words) if part)
    interactive = not prompt and piped is None
    if interactive and not sys.stdin.isatty():
        raise LocalmError(400, "Nothing to ask: give a PROMPT or pipe text in "
                               "(the interactive chat needs a terminal)")
    if not interactive and not text.strip():
        raise LocalmError(400, "Nothing to ask: the prompt is empty")
    server, started = sdk_cli.ensure_server(data_dir)
    if started:
        click.echo(started, err=True)
    chat = Chat(Connection(server, key), data_dir, None, system=system, parameters=chosen, extra=extra,
                verbose=verbose, show_reasoning=not hide_thinking)
    chat.model = chat.resolve_model(model)
    if interactive:
        sys.exit(Repl(chat).run())
    if chat.ask(text).interrupted:
        sys.exit(130)
