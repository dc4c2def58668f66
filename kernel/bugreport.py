"""Bug reports: written here, saved for review in ``<data dir>/reports/bug-<stamp>.md``, and
filed through the bug-report proxy only once reviewed (:mod:`.bugproxy`).

A report holds what the caller wrote, this build's version, Python and the platform, the
plugins' states, the settings any key may read (no owner-only setting, no secret) and, when
asked, the last lines of the server's log. Before it is saved the whole text is scrubbed:
every secret the server knows (tokens in the config, the attach token, ``LOCALM_API_KEY``)
and anything shaped like a key or a token is replaced by ``<redacted>``, the data directory
is written ``<data>`` and the home directory ``~``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import secrets
import stat
import sys
import time
from pathlib import Path
from typing import Any, Callable

import attrs

from . import __version__, logs
from .config import KERNEL_FIELDS
from .errors import LocalmError
from .storage import atomic_write_bytes

FOLDER = "reports"
#: A saved report's file name: ``bug-<UTC time to the microsecond>-<6 hex digits>.md``, so that
#: names sort in the order the reports were written; no other name is read. (ASCII digits only:
#: ``\d`` takes any script's.)
NAME = re.compile(r"bug-[0-9]{8}T[0-9]{6}\.[0-9]{6}Z-[0-9a-f]{6}\.md")
TEXT_FIELDS = ("description", "message", "what_i_expected", "what_happened")
FIELDS = (*TEXT_FIELDS, "include_log", "client")
#: Characters a text field may hold.
MAX_TEXT_CHARS = 20_000
#: Log lines a report includes (the last ones).
LOG_LINES = 200
#: A saved report larger than this is not read back.
MAX_REPORT_BYTES = 512 * 1024
#: What a client may say of itself, and how long each value may be; anything else is dropped.
CLIENT_FIELDS = ("name", "version", "platform", "user_agent", "language", "screen")
CLIENT_VALUE_CHARS = 200
TITLE_CHARS = 80
REDACTED = "<redacted>"
CLOSING_NOTE = ("\n---\n\n_This report was saved on this machine and has not been sent anywhere. "
                "It is filed only as it was shown: to change it, write a new report._\n")

#: Text shaped like a credential, whatever the server knows of it.
_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\blm-[A-Za-z0-9_-]{16,}"), "lm-" + REDACTED),
    (re.compile(r"\bhf_[A-Za-z0-9]{16,}"), "hf_" + REDACTED),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"), REDACTED),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"), "sk-" + REDACTED),
    (re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]{8,}"), r"\1 " + REDACTED),
    (re.compile(r"(?i)\b(token|api[_-]?key|key|secret|password|passwd|auth)=([^&\s\"',;]+)"), r"\1=" + REDACTED),
    (re.compile(r"(?i)(\"(?:[a-z_]*token|[a-z_]*api_key|[a-z_]*secret|password)\"\s*:\s*)\"[^\"]*\""),
     r'\1"' + REDACTED + '"'),
]


@attrs.frozen
class ReportRequest:
    """What POST /api/bug-report was asked to write."""

    description: str
    what_i_expected: str
    what_happened: str
    include_log: bool
    client: dict[str, str]


def _refuse(errors: list[dict[str, str]]) -> LocalmError:
    return LocalmError(422, ". ".join(f"{e['key']}: {e['message']}" for e in errors), errors=errors)


def parse(body: Any) -> ReportRequest:
    """POST /api/bug-report's body, checked: 400 for ``upload`` or a report with nothing to
    say, 422 for a field of the wrong type, too long, or unknown."""
    if not isinstance(body, dict):
        raise _refuse([{"key": "body", "message": "a JSON object is required"}])
    if "upload" in body:
        raise LocalmError(400, "upload is refused: POST /api/bug-report only saves a report; file a saved, "
                               "reviewed one with POST /api/bug-report/send", code="upload_refused")
    errors: list[dict[str, str]] = []
    for key in sorted(set(body) - set(FIELDS)):
        errors.append({"key": key, "message": "unknown field (description, message, what_i_expected, "
                                              "what_happened, include_log and client are read)"})
    for key in TEXT_FIELDS:
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            errors.append({"key": key, "message": "must be a string"})
        elif isinstance(value, str) and len(value) > MAX_TEXT_CHARS:
            errors.append({"key": key, "message": f"must be at most {MAX_TEXT_CHARS} characters"})
    if body.get("include_log") is not None and not isinstance(body.get("include_log"), bool):
        errors.append({"key": "include_log", "message": "must be true or false"})
    if body.get("client") is not None and not isinstance(body.get("client"), dict):
        errors.append({"key": "client", "message": "must be an object"})
    if errors:
        raise _refuse(errors)
    description, message = (body.get("description") or "").strip(), (body.get("message") or "").strip()
    if description and message and description != message:
        raise _refuse([{"key": "message", "message": "is another name for description; send one of them"}])
    text = description or message
    happened = (body.get("what_happened") or "").strip()
    if not text and not happened:
        raise LocalmError(400, "A bug report needs description (or message) or what_happened; "
                               "what_i_expected alone is not enough", code="empty_report")
    return ReportRequest(description=text, what_i_expected=(body.get("what_i_expected") or "").strip(),
                         what_happened=happened, include_log=bool(body.get("include_log")),
                         client=reduce_client(body.get("client")))


def _one_line(value: str, limit: int) -> str:
    text = " ".join("".join(c if c.isprintable() else " " for c in value).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def reduce_client(client: Any) -> dict[str, str]:
    """The client object as a report keeps it: the known fields, each one short line."""
    if not isinstance(client, dict):
        return {}
    out: dict[str, str] = {}
    for key in CLIENT_FIELDS:
        value = client.get(key)
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            continue
        text = _one_line(str(value), CLIENT_VALUE_CHARS)
        if text:
            out[key] = text
    return out


# --- secrets and paths -----------------------------------------------------------------

def known_secrets(k: Any) -> list[str]:
    """Every secret value the server holds in plain text: secret settings (the kernel's and
    the plugins'), the attach token, and the keys and tokens of its environment."""
    values: list[Any] = [getattr(k, "attach_token", None), os.environ.get("LOCALM_API_KEY"),
                         os.environ.get("HF_TOKEN")]
    for key, spec in KERNEL_FIELDS.items():
        if spec.secret:
            values.append(k.config.get(key))
    for p in list(k.plugins.plugins.values()):
        secret_keys = [key for key, spec in p.fields.items() if spec.secret]
        if secret_keys:
            try:
                resolved = k.plugins.resolved_settings(p.name)
            except Exception:
                resolved = {}
            block = k.config.plugin_block(p.name)
            values += [resolved.get(key) for key in secret_keys] + [block.get(key) for key in secret_keys]
    out = {v.strip() for v in values if isinstance(v, str) and len(v.strip()) >= 4}
    return sorted(out, key=len, reverse=True)


def _path_pattern(path: str) -> re.Pattern[str]:
    return re.compile(re.escape(path) + r"(?![\w.-])")


def path_scrubber(data_dir: Path) -> Callable[[str], str]:
    """Writes the data directory as ``<data>`` and the home directory as ``~``."""
    pairs: list[tuple[re.Pattern[str], str]] = []
    data = {str(data_dir), str(Path(data_dir).resolve())}
    for value in sorted(data, key=len, reverse=True):
        if len(value) > 1:
            pairs.append((_path_pattern(value), "<data>"))
    home = str(Path.home())
    if len(home) > 1:
        pairs.append((_path_pattern(home), "~"))

    def scrub(text: str) -> str:
        for pattern, repl in pairs:
            text = pattern.sub(repl, text)
        return text
    return scrub


def scrubber(k: Any) -> Callable[[str], str]:
    """Scrubs a report's text of every secret and credential-shaped string, and of paths."""
    known = known_secrets(k)
    paths = path_scrubber(k.data_dir)

    def scrub(text: str) -> str:
        for value in known:
            text = text.replace(value, REDACTED)
        for pattern, repl in _PATTERNS:
            text = pattern.sub(repl, text)
        return paths(text)
    return scrub


def public_path(k: Any, path: Path | str, caller: Any) -> str:
    """A path as a caller may see it: whole for the owner, the data dir as ``<data>`` for a key."""
    return str(path) if caller.is_owner else path_scrubber(k.data_dir)(str(path))


# --- writing ---------------------------------------------------------------------------

def _fence(text: str) -> str:
    """A code fence longer than any run of backticks in ``text``."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def _cell(value: Any) -> str:
    text = _one_line(str(value), 300) if value not in (None, "") else ""
    return text.replace("|", "\\|")


def _settings(k: Any) -> dict[str, Any]:
    """The settings any key may read: no owner-only setting, no secret."""
    out: dict[str, Any] = {}
    try:
        k.config.raw()
    except LocalmError:
        return {"error": "config.json cannot be read"}
    for key, spec in KERNEL_FIELDS.items():
        if not spec.owner_only and not spec.secret:
            out[key] = k.config.get(key)
    try:
        out["plugins_enabled"] = dict(k.config.enabled_overrides())
    except Exception:
        pass
    plugins: dict[str, Any] = {}
    for p in sorted(k.plugins.plugins.values(), key=lambda p: p.name):
        if not p.active or not p.fields:
            continue
        block = k.config.plugin_block(p.name)
        visible = {key: block[key] for key, spec in p.fields.items()
                   if key in block and not spec.owner_only and not spec.secret}
        if visible:
            plugins[p.name] = visible
    if plugins:
        out["plugins"] = plugins
    return out


def build(k: Any, req: ReportRequest, *, now: float | None = None) -> str:
    """The report's Markdown, scrubbed."""
    moment = time.gmtime(now if now is not None else time.time())
    summary = _one_line((req.description or req.what_happened).split("\n", 1)[0], TITLE_CHARS) or "a problem"
    parts = [f"# Bug report: {summary}\n"]
    for heading, text in (("Description", req.description), ("What happened", req.what_happened),
                          ("What I expected", req.what_i_expected)):
        if text:
            parts.append(f"## {heading}\n\n{text}\n")
    parts.append("## Environment\n\n"
                 f"- localm: {__version__}\n"
                 f"- Python: {platform.python_version()} ({platform.python_implementation()})\n"
                 f"- Platform: {platform.platform()}\n"
                 f"- Executable: {sys.executable}\n"
                 f"- Written: {time.strftime('%Y-%m-%d %H:%M:%S UTC', moment)}\n")
    rows = ["| Plugin | Version | Enabled | Active | Loaded | Problem |", "| --- | --- | --- | --- | --- | --- |"]
    try:
        listing = k.plugins.listing()
    except Exception as exc:  # the report is what a user sends when things are broken
        listing = []
        rows.append(f"| (the plugin list failed: {_cell(type(exc).__name__)}) | | | | | |")
    for p in listing:
        problem = p.get("error") or (("missing: " + ", ".join(p["missing_deps"])) if p.get("missing_deps") else "")
        rows.append("| " + " | ".join(_cell(v) for v in (p.get("name"), p.get("version"),
                                                           "yes" if p.get("enabled") else "no",
                                                           "yes" if p.get("active") else "no",
                                                           "yes" if p.get("loaded") else "no", problem)) + " |")
    parts.append("## Plugins\n\n" + "\n".join(rows) + "\n")
    settings = json.dumps(_settings(k), indent=2, sort_keys=True, default=str)
    fence = _fence(settings)
    parts.append(f"## Settings\n\nOwner-only settings and secrets are left out.\n\n{fence}json\n{settings}\n{fence}\n")
    if req.client:
        parts.append("## Client\n\n" + "".join(f"- {key}: {value}\n" for key, value in req.client.items()))
    if req.include_log:
        lines = logs.recent_lines(LOG_LINES)
        body = "\n".join(lines) if lines else "(no log lines yet)"
        fence = _fence(body)
        parts.append(f"## Server log (last {len(lines)} lines)\n\n{fence}text\n{body}\n{fence}\n")
    text = "\n".join(parts)
    return _utf8(scrubber(k)(text)) + CLOSING_NOTE


def _utf8(text: str) -> str:
    """``text`` as UTF-8 can hold it: a lone surrogate (JSON lets a string carry one) reads ``?``."""
    return text.encode("utf-8", "replace").decode("utf-8")


def folder(data_dir: Path) -> Path:
    return Path(data_dir) / FOLDER


def new_name(now: float | None = None) -> str:
    moment = now if now is not None else time.time()
    micro = min(int((moment % 1) * 1_000_000), 999_999)  # floored: a name never sorts before an older one
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(int(moment))) + f".{micro:06d}Z"
    return f"bug-{stamp}-{secrets.token_hex(3)}.md"


def save(data_dir: Path, text: str, *, keep: int) -> Path:
    """Write the report atomically (mode 0600) and remove the oldest beyond ``keep`` (by name:
    the names sort by the time they were written)."""
    where = folder(data_dir)
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = where / new_name()
    while path.exists():  # two reports in one second: another random suffix
        path = where / new_name()
    atomic_write_bytes(path, text.encode("utf-8"), mode=0o600)
    try:
        saved = sorted(name for name in os.listdir(where) if NAME.fullmatch(name))
    except OSError:
        return path
    for name in saved[: max(0, len(saved) - max(keep, 1))]:
        if name != path.name:
            try:
                os.unlink(where / name)
            except OSError:
                pass
    return path


def check_name(filename: Any) -> str:
    if not isinstance(filename, str) or not NAME.fullmatch(filename):
        raise LocalmError(400, "filename must be the bare name of a saved report (bug-<stamp>.md), as POST "
                               "/api/bug-report returned it", code="invalid_filename")
    return filename


def read(data_dir: Path, filename: str) -> bytes:
    """A saved report's bytes: 400 for a name that is not a report's, 404 when it cannot be
    read (missing, not a regular file, a link, too large)."""
    name = check_name(filename)
    where = folder(data_dir)
    missing = LocalmError(404, f"No saved report {name} can be read", code="report_not_found")
    try:
        if not stat.S_ISDIR(os.lstat(where).st_mode):
            raise missing
        fd = os.open(where / name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        raise missing from None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise missing
        data = fh.read(MAX_REPORT_BYTES + 1)
    if len(data) > MAX_REPORT_BYTES:
        raise missing
    return data


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def for_filing(text: str) -> tuple[str, str]:
    """(title, body) of a saved report as it is filed: the title is its heading, and the
    closing note about editing is left out."""
    body = text[: -len(CLOSING_NOTE)] if text.endswith(CLOSING_NOTE) else text
    first = body.split("\n", 1)[0]
    title = first[2:].strip() if first.startswith("# ") else ""
    return _one_line(title, 200) or "Bug report", body.rstrip("\n") + "\n"
