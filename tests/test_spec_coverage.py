"""docs/spec-coverage.md is current: the routes it lists are served (or not) and tested (or
not) as it says. After a change to the routes or their tests, run scripts/spec_coverage.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
    fresh = coverage.render(routes)
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
