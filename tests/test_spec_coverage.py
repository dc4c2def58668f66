"""docs/spec-coverage.md is current: the routes it lists are served (or not) and tested (or
not) as it says, and its rules are those of docs/spec-rules.toml, every test they name
existing. After a change to the routes, the tests or the TOML, run scripts/spec_coverage.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load() -> object:
    spec = importlib.util.spec_from_file_location("spec_coverage", ROOT / "scripts" / "spec_coverage.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_the_spec_coverage_page_is_current() -> None:
    coverage = load()
    current = coverage.PAGE.read_text()
    routes = coverage.page_routes(current)
    assert len(routes) >= 100  # the page lists the spec's routes
    rules = coverage.load_rules()  # raises when a rule names a test that does not exist
    assert len({(r["spec"], r["section"]) for r in rules}) >= 70  # every section of both spec files
    fresh = coverage.render(routes, rules)
    assert fresh == current, "docs/spec-coverage.md is stale: run .venv/bin/python scripts/spec_coverage.py"


def test_the_route_finder_reads_the_spec_forms(tmp_path: Path) -> None:
    coverage = load()
    text = ("GET /api/session answers; POST /v1/keys. GET|POST|DELETE /v1/models/{model}/peer-route, "
            "and GET /v1/models/{id} then GET /v1/models/{model_id}.")
    spec = Path(tmp_path) / "spec.md"
    spec.write_text(text)
    assert coverage.spec_routes([spec]) == [
        ("GET", "/api/session"), ("POST", "/v1/keys"), ("GET", "/v1/models/{id}"),
        ("GET", "/v1/models/{model}/peer-route"), ("POST", "/v1/models/{model}/peer-route"),
        ("DELETE", "/v1/models/{model}/peer-route")]
    sources = {ROOT / "tests" / "x.py": 'c.get(f"/v1/models/{MODEL}") and c.get("/api/models/loaded")'}
    assert coverage.tests_for("/v1/models/{id}", sources) == ["tests/x.py"]
    assert coverage.tests_for("/api/models", sources) == []  # /api/models/loaded is another route


SPEC_TEXT = """server-api.md

HTTP Server API

Authentication: open until a key exists.

Errors

A failed request answers {"detail": "<message>"}:

{
  "model": "mymodel"
}

Field\tNotes
seed\tthe sampling seed

from openai import OpenAI
client = OpenAI(base_url="http://127.0.0.1:8642/v1")

X-miLLM-Circuit-Rung: 2; language="causally validated (edge)"

POST /v1/messages (Anthropic Messages API)
"""


def test_the_heading_finder_reads_the_spec_forms() -> None:
    coverage = load()
    assert coverage.spec_headings(SPEC_TEXT) == [
        "HTTP Server API", "Errors", "POST /v1/messages (Anthropic Messages API)"]


def test_every_section_needs_a_rule_and_every_rule_a_real_test(tmp_path: Path) -> None:
    coverage = load()
    spec = tmp_path / "demo.md"
    spec.write_text(SPEC_TEXT)
    real = "tests/test_spec_coverage.py::test_the_heading_finder_reads_the_spec_forms"
    rules = [{"spec": "demo", "section": s, "rule": "r", "state": "implemented", "tests": [real]}
             for s in coverage.spec_headings(SPEC_TEXT)]
    coverage.check_sections(rules, [spec])
    with pytest.raises(coverage.RuleError, match="no rule for the section 'Errors'"):
        coverage.check_sections([r for r in rules if r["section"] != "Errors"], [spec])
    with pytest.raises(coverage.RuleError, match="is not a line of demo.md"):
        coverage.check_sections([*rules, {**rules[0], "section": "Nowhere"}], [spec])
    toml = tmp_path / "rules.toml"
    for rule, error in [
        ('state = "done"\ntests = []', "state 'done' is not one of"),
        ('state = "implemented"\ntests = ["tests/test_spec_coverage.py::test_gone"]', "has no def test_gone"),
        ('state = "implemented"\ntests = ["tests/nowhere.py::test_x"]', "tests/nowhere.py does not exist"),
        ('state = "implemented"\ntests = []', "names the tests that show it"),
        ('state = "missing"\ntests = []', "has a note"),
    ]:
        toml.write_text(f'[[rule]]\nspec = "demo"\nsection = "Errors"\nrule = "r"\n{rule}\n')
        with pytest.raises(coverage.RuleError, match=error):
            coverage.load_rules(toml)
