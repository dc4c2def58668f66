"""Shared fixtures: real servers on loopback, with the test plugins of tests/plugins/
visible as a catalog (LOCALM_PLUGIN_STORE)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from localm.sdk.testing import LocalmServer, wants_process

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


#: Test files that install packages into this interpreter's environment or remove them (pip,
#: directly or through a documented command): under pytest-xdist (README: ``-n 2 --dist
#: loadfile``, a file to a worker) they take turns, one file at a time (environment_turn).
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


def sse_events(server: Any, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """POST a streaming request and yield each server-sent event's JSON until [DONE]."""
    with httpx.Client(base_url=server.url, timeout=120) as http, http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return
            if line.startswith("data: "):
                yield json.loads(line[6:])


def wait_job(client: httpx.Client, job_id: str, timeout: float = 300) -> dict[str, Any]:
    """A job's record once it has ended (done, failed or cancelled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/api/jobs/{job_id}").json()
        if job["status"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish")


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


@pytest.fixture
def server(localm_server: Callable[..., LocalmServer]) -> Callable[..., LocalmServer]:
    """``server(**kwargs)``: a real server that also sees the test plugin catalog."""
    def start(**kwargs: Any) -> LocalmServer:
        kwargs["env"] = {**STORE_ENV, **kwargs.get("env", {})}
        return localm_server(**kwargs)
    return start


def sigint_default() -> None:
    """A pseudo-terminal child's ``preexec_fn``: Ctrl-C (SIGINT) back to its default. A suite
    started in the background by a shell without job control runs with SIGINT ignored, and a
    child would inherit that and never see the Ctrl-C a test sends."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def offline_cli(data_dir: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Run a CLI command against a data dir with no server; return its stdout (must succeed)."""
    result = LocalmServer(data_dir, env={**STORE_ENV, **(env or {})}).cli(*args)
    assert result.returncode == 0, result.stderr + result.stdout
    return result.stdout


@pytest.fixture(scope="module")
def module_server(tmp_path_factory: pytest.TempPathFactory,
                  request: pytest.FixtureRequest) -> Iterator[Callable[..., LocalmServer]]:
    started: list[LocalmServer] = []

    def start(*, prepare: Callable[[Path], Any] | None = None, **kwargs: Any) -> LocalmServer:
        data_dir = tmp_path_factory.mktemp("localm") / "data"
        data_dir.mkdir(parents=True)
        if prepare is not None:
            prepare(data_dir)
        kwargs["env"] = {**STORE_ENV, **kwargs.get("env", {})}
        kwargs.setdefault("process", wants_process(request))
        s = LocalmServer(data_dir, **kwargs).start()
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
