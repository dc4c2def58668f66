"""The project's own test setup, shared by tests/ and the builtin plugins' tests
(plugins/<id>/tests/): loaded as a pytest plugin by the repository's conftest.py, with
tests/ on the import path (pyproject.toml: ``pythonpath``), so a test file anywhere imports
these helpers as ``from project_fixtures import ...`` and the modules beside this one
(sae_fixtures, rag_files, comfyui_env, ...) by their names.

What a third-party plugin's tests would want too lives in ``localm.sdk.testing``
(``localm_server``, ``localm_module_server``, ``offline_cli``, ``sse_events``, ``wait_job``,
``plugin_module``); this module adds the project's own: the test plugin catalog of
tests/plugins/ (``STORE_ENV``) in every server and CLI call, and the per-worker CPU pinning
and pip turns of the README's ``-n 2 --dist loadfile`` run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from localm.sdk import testing
from localm.sdk.testing import LocalmServer, sse_events, wait_job

__all__ = ["AUTH_REFUSALS", "SHARED_ENVIRONMENT", "STORE_ENV", "TEST_STORE", "add", "offline_cli",
           "refused_by_guard", "sigint_default", "sse_events", "wait_job"]

TEST_STORE = Path(__file__).parent / "plugins"
STORE_ENV = {"LOCALM_PLUGIN_STORE": str(TEST_STORE)}

#: Details the guard answers with when it refuses a caller.
AUTH_REFUSALS = ("Missing API key", "Invalid API key", "Key lacks required scope",
                 "Open-mode management requires", "Cross-origin request refused", "API key expired",
                 "Missing or invalid CSRF token", "Session expired")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker runs on cores of its own (its share of this process's
    affinity mask), so the engines of two workers' servers (sized by sdk.engines.usable_cores)
    never spin on the same core."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if not worker or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= count:
        os.sched_setaffinity(0, cores[int(worker.removeprefix("gw")) % count::count])


#: Test files (by name, wherever they live: names are unique across tests/ and plugins/) that
#: install packages into this interpreter's environment or remove them (pip, directly or
#: through a documented command): under pytest-xdist (README: ``-n 2 --dist loadfile``, a
#: file to a worker) they take turns, one file at a time (environment_turn).
SHARED_ENVIRONMENT = frozenset({"test_cli.py", "test_cli_catalog.py", "test_cli_progress.py", "test_docs.py",
                                "test_openwebui.py", "test_plugins.py", "test_speech.py"})


@pytest.fixture(scope="module", autouse=True)
def environment_turn(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A file of SHARED_ENVIRONMENT holds a lock shared by the run's workers (in the folder
    above each worker's own temporary folder) from its first test to its last."""
    if request.path.name not in SHARED_ENVIRONMENT or not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    import fcntl

    with open(tmp_path_factory.getbasetemp().parent / "environment.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def add(client: httpx.Client, name: str, *paths: Path | str, **body: Any) -> dict[str, Any]:
    """Index ``paths`` into the RAG collection ``name`` and wait: the job's result."""
    r = client.post(f"/api/rag/collections/{name}/add", json={"paths": [str(p) for p in paths], **body})
    assert r.status_code == 200, r.text
    job = wait_job(client, r.json()["job_id"])
    assert job["status"] == "done", job
    return job["result"]


def refused_by_guard(response: Any) -> bool:
    if response.status_code not in (401, 403):
        return False
    try:
        detail = response.json().get("detail", "")
    except ValueError:
        return False
    return detail.startswith(AUTH_REFUSALS)


def sigint_default() -> None:
    """A pseudo-terminal child's ``preexec_fn``: Ctrl-C (SIGINT) back to its default. A suite
    started in the background by a shell without job control runs with SIGINT ignored, and a
    child would inherit that and never see the Ctrl-C a test sends."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def offline_cli(data_dir: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """``localm.sdk.testing.offline_cli`` with the test plugin catalog: a CLI command against
    a data dir with no server; its stdout (it must succeed)."""
    return testing.offline_cli(data_dir, *args, env={**STORE_ENV, **(env or {})})


@pytest.fixture
def server(localm_server: Callable[..., LocalmServer]) -> Callable[..., LocalmServer]:
    """``server(**kwargs)``: ``localm_server`` that also sees the test plugin catalog."""
    def start(**kwargs: Any) -> LocalmServer:
        kwargs["env"] = {**STORE_ENV, **kwargs.get("env", {})}
        return localm_server(**kwargs)
    return start


@pytest.fixture(scope="module")
def module_server(localm_module_server: Callable[..., LocalmServer]) -> Callable[..., LocalmServer]:
    """``module_server(prepare=None, **kwargs)``: ``localm_module_server`` that also sees the
    test plugin catalog."""
    def start(**kwargs: Any) -> LocalmServer:
        kwargs["env"] = {**STORE_ENV, **kwargs.get("env", {})}
        return localm_module_server(**kwargs)
    return start
