"""Ollama Modelfiles: the text ``ollama create -f Modelfile`` reads, parsed into the fields of
a create request, and written back from a registry entry's defaults (/api/show's ``modelfile``).

A Modelfile is one instruction a line, the instruction's name in any case::

    # a comment
    FROM smollm2-135m-instruct          (a registered model, a file path, or @sha256:<digest>)
    SYSTEM You are a pirate.
    PARAMETER temperature 0.2           (repeatable; stop may repeat)
    PARAMETER stop "<|im_end|>"
    TEMPLATE \"\"\"{{ .Prompt }}\"\"\"        (a value in triple quotes may span lines)
    MESSAGE user Who are you?
    MESSAGE assistant A pirate.
    ADAPTER ./lora.gguf
    LICENSE \"\"\"MIT\"\"\"

Parameter values are typed as Ollama types them (integers, numbers, true/false, or a list of
strings for stop). A line the parser cannot read is a :class:`ModelfileError` naming it.
"""

from __future__ import annotations

import json
import math
from typing import Any

INT_PARAMETERS = ("num_keep", "seed", "num_predict", "top_k", "repeat_last_n", "mirostat", "num_ctx", "num_batch",
                  "num_gpu", "main_gpu", "num_thread")
FLOAT_PARAMETERS = ("temperature", "top_p", "min_p", "typical_p", "tfs_z", "repeat_penalty", "presence_penalty",
                    "frequency_penalty", "mirostat_tau", "mirostat_eta")
BOOL_PARAMETERS = ("penalize_newline", "numa", "use_mmap", "use_mlock", "low_vram", "f16_kv", "vocab_only")
LIST_PARAMETERS = ("stop",)
KNOWN = (*INT_PARAMETERS, *FLOAT_PARAMETERS, *BOOL_PARAMETERS, *LIST_PARAMETERS)
#: The parameters localm's chat pipeline applies (the others are kept, shown, and not applied).
APPLIED = ("temperature", "top_p", "top_k", "min_p", "seed", "num_predict", "num_ctx", "stop", "repeat_penalty",
           "presence_penalty", "frequency_penalty")
#: Bounds the chat readers hold a request's values to (a model's defaults must pass them too).
BOUNDS = {"temperature": (0, 2), "top_p": (0, 1), "min_p": (0, 1), "presence_penalty": (-2, 2),
          "frequency_penalty": (-2, 2), "repeat_penalty": (0, math.inf), "seed": (-1, 2**32 - 1),
          "num_ctx": (1, 10_000_000)}
ROLES = ("system", "user", "assistant")
COMMANDS = ("from", "adapter", "template", "system", "parameter", "message", "license", "requires")
#: The longest Modelfile read (characters).
MAX_CHARS = 1_000_000


class ModelfileError(ValueError):
    """A Modelfile that cannot be read: the message names the line."""


def _value(text: str, lines: list[str], i: int) -> tuple[str, int]:
    """The value starting at ``text`` (the rest of line ``i``): triple-quoted (maybe over
    several lines), double-quoted, or bare to the end of the line. Returns (value, next line)."""
    if text.startswith('"""'):
        rest = text[3:]
        if '"""' in rest:
            value, _, after = rest.partition('"""')
            if after.strip():
                raise ModelfileError(f'line {i + 1}: text after the closing """')
            return value, i + 1
        parts = [rest]
        for j in range(i + 1, len(lines)):
            if '"""' in lines[j]:
                head, _, after = lines[j].partition('"""')
                if after.strip():
                    raise ModelfileError(f'line {j + 1}: text after the closing """')
                parts.append(head)
                return "\n".join(parts), j + 1
            parts.append(lines[j])
        raise ModelfileError(f'line {i + 1}: the """ opened here is never closed')
    if text.startswith('"') and len(text) >= 2 and text.endswith('"'):
        try:
            return json.loads(text), i + 1
        except ValueError:
            return text[1:-1], i + 1
    if text.startswith('"'):
        raise ModelfileError(f"line {i + 1}: unterminated quoted string")
    return text, i + 1


def typed(name: str, value: Any, where: str) -> Any:
    """A parameter's value as Ollama types it (text from a Modelfile, or JSON); a ValueError
    naming ``where`` when it is not of that type."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{where}: {name} must be {what}, not {value!r}")
    if name in INT_PARAMETERS:
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise bad("an integer") from None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
    elif name in FLOAT_PARAMETERS:
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                raise bad("a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad("a number")
        value = float(value)
    elif name in BOOL_PARAMETERS:
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            value = value.strip().lower() == "true"
        if not isinstance(value, bool):
            raise bad("true or false")
    elif name in LIST_PARAMETERS:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
            raise bad("a string or a list of non-empty strings")
    else:
        raise ValueError(f"{where}: unknown parameter {name!r} (Ollama's parameters: {', '.join(KNOWN)})")
    low, high = BOUNDS.get(name, (None, None))
    if low is not None and not low <= value <= high:
        raise ValueError(f"{where}: {name} must be from {low:g} to {high:g}, not {value!r}")
    return value


def parse(text: str) -> dict[str, Any]:
    """A Modelfile as the fields of a create request: ``from``, ``system``, ``template``,
    ``license`` (a list), ``parameters``, ``messages``, ``adapters`` (paths or @digests, in
    order). Raises ModelfileError naming the line it cannot read."""
    if len(text) > MAX_CHARS:
        raise ModelfileError(f"the Modelfile is {len(text)} characters; at most {MAX_CHARS} are read")
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    out: dict[str, Any] = {}
    parameters: dict[str, Any] = {}
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if not line or line.startswith("#"):
            i += 1
            continue
        command, _, rest = line.partition(" ") if " " in line else line.partition("\t")
        command = command.lower()
        rest = rest.strip()
        at = i
        if command not in COMMANDS:
            raise ModelfileError(f"line {at + 1}: unknown instruction {line.split()[0]!r}: a Modelfile line is "
                                 "FROM, PARAMETER, SYSTEM, TEMPLATE, MESSAGE, ADAPTER or LICENSE")
        if not rest:
            raise ModelfileError(f"line {at + 1}: {command.upper()} needs a value")
        if command == "parameter":
            name, _, raw = rest.partition(" ")
            name = name.strip().lower()
            raw = raw.strip()
            if not raw:
                raise ModelfileError(f"line {at + 1}: PARAMETER {name} needs a value")
            value, i = _value(raw, lines, i)
            try:
                value = typed(name, value, f"line {at + 1}")
            except ValueError as exc:
                raise ModelfileError(str(exc)) from None
            if name in LIST_PARAMETERS:
                parameters.setdefault(name, []).extend(value)
            else:
                parameters[name] = value
            continue
        if command == "message":
            role, _, raw = rest.partition(" ")
            role = role.strip().lower()
            if role not in ROLES:
                raise ModelfileError(f"line {at + 1}: MESSAGE role {role!r} is not one of system, user, assistant")
            content, i = _value(raw.strip(), lines, i)
            out.setdefault("messages", []).append({"role": role, "content": content})
            continue
        value, i = _value(rest, lines, i)
        if command == "from":
            if "from" in out:
                raise ModelfileError(f"line {at + 1}: a second FROM (a Modelfile has one)")
            out["from"] = value.strip()
        elif command == "adapter":
            out.setdefault("adapters", []).append(value.strip())
        elif command == "license":
            out.setdefault("license", []).append(value)
        elif command == "requires":
            out["requires"] = value.strip()
        else:
            out[command] = value
    if "from" not in out:
        raise ModelfileError("no FROM line: a Modelfile names the model it starts from")
    if parameters:
        out["parameters"] = parameters
    return out


def _quoted(text: str) -> str:
    return f'"""{text}"""' if ("\n" in text or text != text.strip() or '"' in text or not text) else text


def _number(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}" if value == value and abs(value) < 1e15 else repr(value)
    return str(value)


def parameter_lines(options: dict[str, Any]) -> list[str]:
    """``PARAMETER`` values as /api/show's ``parameters`` text writes them: ``name value``."""
    out = []
    for name, value in options.items():
        for one in (value if isinstance(value, list) else [value]):
            text = json.dumps(one) if isinstance(one, str) else _number(one)
            out.append(f"{name:<15}{text}")
    return out


def render(source: str, defaults: dict[str, Any], adapters: list[str], note: str = "") -> str:
    """A Modelfile that would make this model again: FROM, then what its defaults hold."""
    lines = [f"# {line}" for line in note.splitlines()] if note else []
    lines.append(f"FROM {source}")
    if defaults.get("template"):
        lines.append(f"TEMPLATE {_quoted(defaults['template'])}")
    if defaults.get("system"):
        lines.append(f"SYSTEM {_quoted(defaults['system'])}")
    for name, value in (defaults.get("options") or {}).items():
        for one in (value if isinstance(value, list) else [value]):
            lines.append(f"PARAMETER {name} {json.dumps(one) if isinstance(one, str) else _number(one)}")
    for adapter in adapters:
        lines.append(f"ADAPTER {adapter}")
    for message in defaults.get("messages") or []:
        lines.append(f"MESSAGE {message['role']} {_quoted(message['content'])}")
    license_ = defaults.get("license")
    for text in (license_ if isinstance(license_, list) else [license_] if license_ else []):
        lines.append(f"LICENSE {_quoted(text)}")
    return "\n".join(lines) + "\n"
