"""The spec coverage page: every route the API spec names, whether this build serves it, and
the tests that call it; then every rule of the spec, as docs/spec-rules.toml judges it.
Writes docs/spec-coverage.md.

    .venv/bin/python scripts/spec_coverage.py                  # from ../shared/spec/*.md
    .venv/bin/python scripts/spec_coverage.py --spec FILE.md   # from the spec files named
    .venv/bin/python scripts/spec_coverage.py --check          # exit 1 when the page is stale

A route is ``served`` when a server with every shipped plugin enabled (and metrics on) registers it (its OpenAPI
document lists the method and path), ``served, untested`` when no test file spells its path,
and ``missing`` otherwise. A test "spells" a path when its source holds the path with any
text in place of each ``{parameter}``: a test that builds the path another way is not found,
so an untested mark is a lead to follow, not a verdict. ``--check`` reads the routes from
the page itself (the spec lives outside this repository), so the page stays current with
every change to the routes and tests; tests/test_spec_coverage.py runs it.

The rules are hand-curated in docs/spec-rules.toml: one ``[[rule]]`` per rule of a spec
section, with ``spec`` (the spec file's stem), ``section`` (its heading, exactly as the spec
writes it), ``rule`` (a short name), ``state`` (implemented, partial, missing or out of
scope), ``tests`` (``path::test_function`` names that show it; empty only when missing or
out of scope) and ``note`` (what is missing; required for partial and missing). Every test
named must exist. When the spec files are read (not under ``--check``), every entry's
section must be a line of its spec file and every heading (see :func:`spec_headings`) must
have an entry, so a new section of the spec cannot go unjudged. ``--check`` renders the
rules from the TOML alone and compares them with the page too.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "spec-coverage.md"
RULES = ROOT / "docs" / "spec-rules.toml"
STATES = ("implemented", "partial", "missing", "out of scope")
SPEC = ROOT.parent / "shared" / "spec"
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD")
_ROUTE = re.compile(r"\b((?:GET|POST|PUT|PATCH|DELETE|HEAD)(?:\|(?:GET|POST|PUT|PATCH|DELETE|HEAD))*) (/[A-Za-z0-9_./{}:-]+)")
_ROW = re.compile(r"^\| `(GET|POST|PUT|PATCH|DELETE|HEAD) (/[^`]*)` \|")
_PARAM = re.compile(r"\{[^}]*\}")
#: The most test files one route (or tests one rule) lists.
SHOWN = 3
#: Lines the heading test takes for a heading that are not one (a file name, an example header).
NOT_HEADINGS = {
    "server-api.md",
    'X-miLLM-Circuit-Rung: 2; language="causally validated (edge)"',
}
#: How a heading may not start: code, a command, JSON, a list item.
_NOT_HEADING_START = ("{", '"', "[", "$", "curl", "from ", "import ", "localm ", "•", "-", "#")
#: A line that reads as code: an assignment or a call.
_CODE = re.compile(r"^(?:[A-Za-z_][\w.]*\s*=|[A-Za-z_][\w.]*\()")
_DEF = r"^[ \t]*(?:async[ \t]+)?def[ \t]+{}[ \t]*\("


def normal(path: str) -> str:
    """A path as the page writes it: no trailing punctuation, every parameter ``{}``-named as written."""
    return path.rstrip(".,:;")


def key(method: str, path: str) -> tuple[str, str]:
    """What a spec route and a registered one are matched on: parameter names left out."""
    return method, _PARAM.sub("{}", path.rstrip("/") or "/")


def spec_routes(files: list[Path]) -> list[tuple[str, str]]:
    found: dict[tuple[str, str], tuple[str, str]] = {}
    for file in files:
        for methods, path in _ROUTE.findall(file.read_text()):
            for method in methods.split("|"):
                route = (method, normal(path))
                found.setdefault(key(*route), route)
    return sorted(found.values(), key=lambda r: (r[1], METHODS.index(r[0])))


def page_routes(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for line in text.splitlines() if (m := _ROW.match(line))]


def spec_headings(text: str) -> list[str]:
    """The section headings of a spec file: a line after a blank line (or the first), under 100
    characters, not indented, not a table row (no tab), not ending in ``.``, ``:`` or ``,``,
    not starting like code, a command or JSON, and not in :data:`NOT_HEADINGS`."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        line = line.rstrip()
        if (i and lines[i - 1].strip()) or not line or len(line) >= 100 or line[0].isspace() or "\t" in line:
            continue
        if line.endswith((".", ":", ",")) or line.startswith(_NOT_HEADING_START) or _CODE.match(line):
            continue
        if line not in NOT_HEADINGS:
            found.append(line)
    return found


class RuleError(ValueError):
    """docs/spec-rules.toml says something the page cannot be written from."""


def load_rules(path: Path = RULES) -> list[dict[str, object]]:
    """The rules of docs/spec-rules.toml, checked on their own (no spec needed)."""
    rules = tomllib.loads(path.read_text()).get("rule", [])
    if not rules:
        raise RuleError(f"{path.name} holds no [[rule]] entries")
    sources: dict[str, str] = {}
    for n, rule in enumerate(rules, 1):
        where = f"{path.name}, rule {n} ({rule.get('section', '?')!s}: {rule.get('rule', '?')!s})"
        check_rule(rule, where, sources)
    return rules


def check_rule(rule: dict[str, object], where: str, sources: dict[str, str]) -> None:
    for field in ("spec", "section", "rule", "state"):
        if not isinstance(rule.get(field), str) or not rule[field]:
            raise RuleError(f"{where}: {field} must be a non-empty string")
    unknown = set(rule) - {"spec", "section", "rule", "state", "tests", "note"}
    if unknown:
        raise RuleError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    state, tests, note = rule["state"], rule.get("tests", []), rule.get("note")
    if state not in STATES:
        raise RuleError(f"{where}: state {state!r} is not one of {', '.join(STATES)}")
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise RuleError(f"{where}: tests must be a list of 'path::test_function' strings")
    if not tests and state in ("implemented", "partial"):
        raise RuleError(f"{where}: a rule {state} names the tests that show it")
    if state in ("partial", "missing") and not (isinstance(note, str) and note):
        raise RuleError(f"{where}: a {state} rule has a note saying what is missing")
    for test in tests:
        check_test(test, where, sources)


def check_test(test: str, where: str, sources: dict[str, str]) -> None:
    """``test`` is ``path::name``, the file exists and defines ``name``."""
    path, sep, name = test.partition("::")
    if not sep or not name.isidentifier():
        raise RuleError(f"{where}: {test!r} is not 'path::test_function'")
    if path not in sources:
        file = ROOT / path
        if not file.is_file():
            raise RuleError(f"{where}: {path} does not exist")
        sources[path] = file.read_text()
    if not re.search(_DEF.format(re.escape(name)), sources[path], re.MULTILINE):
        raise RuleError(f"{where}: {path} has no def {name}")


def check_sections(rules: list[dict[str, object]], files: list[Path], every_spec: bool = True) -> None:
    """Every entry's section is a line of its spec file; every heading of a file read has an
    entry. ``every_spec``: the files are the whole spec, so a rule naming another file is wrong."""
    texts = {file.stem: file.read_text() for file in files}
    for rule in rules:
        text = texts.get(str(rule["spec"]))
        if text is None:
            if every_spec:
                raise RuleError(f"{RULES.name}: spec {rule['spec']!r} is none of the spec files ({', '.join(texts)})")
            continue
        if str(rule["section"]) not in (line.rstrip() for line in text.splitlines()):
            raise RuleError(f"{RULES.name}: section {rule['section']!r} is not a line of {rule['spec']}.md")
    judged = {(str(r["spec"]), str(r["section"])) for r in rules}
    for stem, text in texts.items():
        for heading in spec_headings(text):
            if (stem, heading) not in judged:
                raise RuleError(f"{RULES.name} has no rule for the section {heading!r} of {stem}.md "
                                "(or add it to NOT_HEADINGS in scripts/spec_coverage.py if it is no heading)")


def registered() -> set[tuple[str, str]]:
    """(method, path) of every route a server with every shipped plugin serves."""
    from localm.sdk.testing import LocalmServer

    shipped = sorted(p.parent.name for p in (ROOT / "plugins").glob("*/plugin.toml"))
    with tempfile.TemporaryDirectory(prefix="localm-coverage-") as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        config = {"metrics_enabled": True, "plugins_enabled": {name: True for name in shipped}}
        (data_dir / "config.json").write_text(json.dumps(config))
        server = LocalmServer(data_dir, plugins=shipped, process=False).start()
        try:
            with server.owner() as owner:
                document = owner.get("/openapi/openapi.json").json()
        finally:
            server.stop()
    return {key(method.upper(), path) for path, item in document.get("paths", {}).items()
            for method in item if method.upper() in METHODS}


def test_files() -> dict[Path, str]:
    files = [*sorted((ROOT / "tests").glob("test_*.py")), *sorted((ROOT / "plugins").glob("*/tests/test_*.py"))]
    return {file: file.read_text() for file in files if file.name != "test_spec_coverage.py"}


def tests_for(path: str, sources: dict[Path, str]) -> list[str]:
    parts = _PARAM.split(path)
    pattern = re.compile(r"[^\s\"'/?]+".join(re.escape(p) for p in parts) + r"(?![A-Za-z0-9_/-])")
    return [str(file.relative_to(ROOT)) for file, text in sources.items() if pattern.search(text)]


def shorten(items: list[str]) -> str:
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(f"`{t}`" for t in items[:SHOWN]) + more or "-"


def cell(text: object) -> str:
    """Text safe in a table cell."""
    return str(text).replace("|", "\\|")


def render_rules(rules: list[dict[str, object]]) -> list[str]:
    counts = {state: sum(r["state"] == state for r in rules) for state in STATES}
    rows, notes = [], []
    for r in rules:
        state = str(r["state"])
        if r.get("note"):
            note = str(r["note"])
            notes.append(f"{len(notes) + 1}. {r['spec']}, {cell(r['section'])}: {cell(r['rule'])}. "
                         f"{cell(note[:1].upper() + note[1:])}")
            state += f" ({len(notes)})"
        rows.append(f"| {r['spec']} | {cell(r['section'])} | {cell(r['rule'])} | {state} | "
                    f"{shorten(list(r.get('tests', [])))} |")  # type: ignore[arg-type]
    sections = len({(r["spec"], r["section"]) for r in rules})
    return [
        "## Rules",
        "",
        f"{len(rules)} rules in {sections} sections: {counts['implemented']} implemented, {counts['partial']} partial, "
        f"{counts['missing']} missing, {counts['out of scope']} out of scope.",
        "",
        "| Spec | Section | Rule | State | Tests |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
        "Notes (the number after a state):",
        "",
        *notes,
        "",
    ]


def render(routes: list[tuple[str, str]], rules: list[dict[str, object]] | None = None) -> str:
    rules = load_rules() if rules is None else rules
    served = registered()
    sources = test_files()
    rows = []
    counts = {"served": 0, "served, untested": 0, "missing": 0}
    for method, path in routes:
        tests = tests_for(path, sources)
        state = ("served" if tests else "served, untested") if key(method, path) in served else "missing"
        counts[state] += 1
        rows.append(f"| `{method} {path}` | {state} | {shorten(tests)} |")
    return "\n".join([
        "# Spec coverage",
        "",
        "Every route the API spec names, whether this build serves it (a server with every shipped",
        "plugin), and the test files that call it. `scripts/spec_coverage.py` writes this page from",
        "the spec; `tests/test_spec_coverage.py` fails when a route or a test changed and the page",
        "was not written again. A route marked untested may still be tested through a client that",
        "builds its path itself (an SDK): the mark is a lead, not a verdict. The Rules section below",
        "judges every section of the spec rule by rule (fields, status codes, headers): implemented,",
        "partial, missing or out of scope, with the tests that show it. Those judgements are made by",
        "hand in `docs/spec-rules.toml`; the script checks that every heading of the spec has one and",
        "that every test named exists, and the test fails when the table and the TOML disagree.",
        "",
        "## Routes",
        "",
        f"{len(routes)} routes: {counts['served']} served and tested, {counts['served, untested']} served with no test "
        f"that spells the path, {counts['missing']} missing.",
        "",
        "| Route | State | Tests |",
        "| --- | --- | --- |",
        *rows,
        "",
        *render_rules(rules),
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, nargs="*", help="spec files (default: ../shared/spec/*.md)")
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/spec-coverage.md is stale")
    args = parser.parse_args()
    try:
        rules = load_rules()
    except RuleError as e:
        print(e, file=sys.stderr)
        return 2
    if args.check:
        current = PAGE.read_text()
        if render(page_routes(current), rules) != current:
            print(f"{PAGE.relative_to(ROOT)} is stale: run scripts/spec_coverage.py", file=sys.stderr)
            return 1
        return 0
    files = args.spec or sorted(SPEC.glob("*.md"))
    if not files:
        print(f"No spec files: pass --spec, or put them in {SPEC}", file=sys.stderr)
        return 2
    try:
        check_sections(rules, files, every_spec=not args.spec)
    except RuleError as e:
        print(e, file=sys.stderr)
        return 2
    PAGE.write_text(render(spec_routes(files), rules))
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
