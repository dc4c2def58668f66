"""The spec coverage page: every route the API spec names, whether this build serves it, and
the tests that call it. Writes docs/spec-coverage.md.

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
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "spec-coverage.md"
SPEC = ROOT.parent / "shared" / "spec"
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD")
_ROUTE = re.compile(r"\b((?:GET|POST|PUT|PATCH|DELETE|HEAD)(?:\|(?:GET|POST|PUT|PATCH|DELETE|HEAD))*) (/[A-Za-z0-9_./{}:-]+)")
_ROW = re.compile(r"^\| `(GET|POST|PUT|PATCH|DELETE|HEAD) (/[^`]*)` \|")
_PARAM = re.compile(r"\{[^}]*\}")
#: The most test files one route lists.
SHOWN = 3


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


def render(routes: list[tuple[str, str]]) -> str:
    served = registered()
    sources = test_files()
    rows = []
    counts = {"served": 0, "served, untested": 0, "missing": 0}
    for method, path in routes:
        tests = tests_for(path, sources)
        state = ("served" if tests else "served, untested") if key(method, path) in served else "missing"
        counts[state] += 1
        shown = ", ".join(f"`{t}`" for t in tests[:SHOWN]) + (f" and {len(tests) - SHOWN} more" if len(tests) > SHOWN else "")
        rows.append(f"| `{method} {path}` | {state} | {shown or '-'} |")
    return "\n".join([
        "# Spec coverage",
        "",
        "Every route the API spec names, whether this build serves it (a server with every shipped",
        "plugin), and the test files that call it. `scripts/spec_coverage.py` writes this page from",
        "the spec; `tests/test_spec_coverage.py` fails when a route or a test changed and the page",
        "was not written again. A route marked untested may still be tested through a client that",
        "builds its path itself (an SDK): the mark is a lead, not a verdict. The spec's rules (status",
        "codes, fields, headers) are checked by the tests of each route, not listed here.",
        "",
        f"{len(routes)} routes: {counts['served']} served and tested, {counts['served, untested']} served with no test "
        f"that spells the path, {counts['missing']} missing.",
        "",
        "| Route | State | Tests |",
        "| --- | --- | --- |",
        *rows,
        "",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, nargs="*", help="spec files (default: ../shared/spec/*.md)")
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/spec-coverage.md is stale")
    args = parser.parse_args()
    if args.check:
        current = PAGE.read_text()
        if render(page_routes(current)) != current:
            print(f"{PAGE.relative_to(ROOT)} is stale: run scripts/spec_coverage.py", file=sys.stderr)
            return 1
        return 0
    files = args.spec or sorted(SPEC.glob("*.md"))
    if not files:
        print(f"No spec files: pass --spec, or put them in {SPEC}", file=sys.stderr)
        return 2
    PAGE.write_text(render(spec_routes(files)))
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
