"""Background jobs: events replay then follow, cancel, failure, visibility."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import offline_cli


def read_events(client: Any, job_id: str, *, stop_after: int | None = None, **kw: Any) -> list[dict[str, Any]]:
    events = []
    with client.stream("GET", f"/api/jobs/{job_id}/events", **kw) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if stop_after is not None and len(events) >= stop_after:
                    break
    return events


@pytest.fixture
def jobber(server: Any, tmp_path: Path) -> Any:
    data_dir = tmp_path / "data"
    offline_cli(data_dir, "plugin", "install", "jobber")
    return server(data_dir=data_dir)


def test_events_replay_then_follow(jobber: Any) -> None:
    owner = jobber.owner()
    job_id = owner.post("/jobber/start", json={"steps": 5, "delay": 0.2}).json()["job_id"]
    # a follower that joins mid-way gets everything so far, then the rest as it happens
    time.sleep(0.5)
    events = read_events(owner, job_id)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert events[0] == {**events[0], "type": "status", "status": "queued"}
    assert [e["line"] for e in events if e["type"] == "log"] == [f"step {i}" for i in range(1, 6)]
    assert [e["progress"] for e in events if e["type"] == "progress"] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert events[-1]["type"] == "end" and events[-1]["status"] == "done" and events[-1]["result"] == {"steps": 5}
    # after the job ended, a new follower gets the same history
    assert read_events(owner, job_id) == events
    # and can resume after an event it already has
    assert read_events(owner, job_id, headers={"Last-Event-ID": "3"}) == events[3:]
    job = owner.get(f"/api/jobs/{job_id}").json()
    assert job["status"] == "done" and job["progress"] == 1.0 and job["plugin"] == "jobber"
    assert job_id in [j["id"] for j in owner.get("/api/jobs").json()["jobs"]]


def test_two_followers_see_the_same_live_stream(jobber: Any) -> None:
    owner = jobber.owner()
    job_id = owner.post("/jobber/start", json={"steps": 4, "delay": 0.15}).json()["job_id"]
    seen: list[list[dict[str, Any]]] = [[], []]

    def follow(i: int) -> None:
        seen[i] = read_events(jobber.owner(), job_id)

    threads = [threading.Thread(target=follow, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert seen[0] == seen[1] and seen[0][-1]["type"] == "end"


@pytest.mark.parametrize("thread", [False, True])
def test_cancel(jobber: Any, thread: bool) -> None:
    owner = jobber.owner()
    job_id = owner.post("/jobber/start", json={"steps": 100, "delay": 0.05, "thread": thread}).json()["job_id"]
    read_events(owner, job_id, stop_after=4)  # it is running
    assert owner.post(f"/api/jobs/{job_id}/cancel").status_code == 200
    events = read_events(owner, job_id)
    assert events[-1]["type"] == "end" and events[-1]["status"] == "cancelled"
    steps = [e for e in events if e["type"] == "log"]
    assert len(steps) < 100
    assert owner.get(f"/api/jobs/{job_id}").json()["status"] == "cancelled"


def test_failure_is_reported(jobber: Any) -> None:
    owner = jobber.owner()
    job_id = owner.post("/jobber/start", json={"steps": 5, "delay": 0.01, "fail_at": 2}).json()["job_id"]
    events = read_events(owner, job_id)
    assert events[-1] == {**events[-1], "type": "end", "status": "failed", "error": "failed at step 2"}
    assert owner.get(f"/api/jobs/{job_id}").json()["error"] == "failed at step 2"


def test_jobs_are_visible_to_their_starter_and_the_owner(server: Any, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    offline_cli(data_dir, "plugin", "install", "jobber")
    owner_key = offline_cli(data_dir, "key", "generate").strip()
    a = offline_cli(data_dir, "key", "create", "--scope", "jobber").strip()
    b = offline_cli(data_dir, "key", "create", "--scope", "jobber").strip()
    s = server(data_dir=data_dir)
    job_id = s.client(a).post("/jobber/start", json={"steps": 1, "delay": 0}).json()["job_id"]
    assert s.client(a).get(f"/api/jobs/{job_id}").status_code == 200
    assert s.client(b).get(f"/api/jobs/{job_id}").status_code == 404
    assert s.client(b).post(f"/api/jobs/{job_id}/cancel").status_code == 404
    assert s.client(b).get(f"/api/jobs/{job_id}/events").status_code == 404
    assert s.client(b).get("/api/jobs").json() == {"jobs": []}
    assert s.client(owner_key).get(f"/api/jobs/{job_id}").status_code == 200


def test_unknown_job(jobber: Any) -> None:
    assert jobber.owner().get("/api/jobs/job_nope").status_code == 404
    assert jobber.owner().get("/api/jobs/job_nope/events").status_code == 404
