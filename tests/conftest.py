"""The helpers tests/ files import as ``from conftest import ...``. The fixtures, hooks and
helpers themselves live in project_fixtures.py (beside this file), which the repository's
conftest.py loads for tests/ and plugins/<id>/tests/ alike; new code imports from there."""

from __future__ import annotations

from project_fixtures import (
    AUTH_REFUSALS,
    SHARED_ENVIRONMENT,
    STORE_ENV,
    TEST_STORE,
    add,
    offline_cli,
    refused_by_guard,
    sigint_default,
    sse_events,
    wait_job,
)

__all__ = ["AUTH_REFUSALS", "SHARED_ENVIRONMENT", "STORE_ENV", "TEST_STORE", "add", "offline_cli", "refused_by_guard",
           "sigint_default", "sse_events", "wait_job"]
