"""Atomic files: a write that fails leaves the old file byte-identical."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from localm.kernel.errors import Unreadable
from localm.kernel.storage import JsonFile, atomic_write_json


def test_write_that_fails_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    """A real failure: the process may write at most 4 KiB per file (RLIMIT_FSIZE)."""
    target = tmp_path / "config.json"
    atomic_write_json(target, {"port": 8642})
    before = target.read_bytes()
    script = textwrap.dedent(f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        from localm.kernel.storage import atomic_write_json
        try:
            atomic_write_json({str(target)!r}, {{"cors_origins": ["x" * 100] * 1000}})
        except OSError as exc:
            print("failed:", exc.errno)
            sys.exit(0)
        sys.exit("the write should have failed")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("failed: 27")  # EFBIG
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_refused_update_writes_nothing(tmp_path: Path) -> None:
    f = JsonFile(tmp_path / "x.json", what="x.json", default=dict, expect=dict)
    f.write({"a": 1})
    before = f.path.read_bytes()

    def refuse(current: dict) -> dict:
        current["a"] = 2
        raise ValueError("no")

    with pytest.raises(ValueError):
        f.update(refuse)
    assert f.path.read_bytes() == before


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_unreadable_file_is_reported_and_never_overwritten(tmp_path: Path, content: bytes) -> None:
    f = JsonFile(tmp_path / "x.json", what="x.json", default=dict, expect=dict)
    f.path.write_bytes(content)
    with pytest.raises(Unreadable) as err:
        f.update(lambda cur: {"a": 1})
    assert err.value.status == 409
    with pytest.raises(Unreadable):
        f.write({"a": 1})
    assert f.path.read_bytes() == content


def test_cached_read_sees_replacements(tmp_path: Path) -> None:
    f = JsonFile(tmp_path / "x.json", what="x.json", default=dict, expect=dict)
    assert f.cached() == {}
    atomic_write_json(f.path, {"a": 1})
    assert f.cached() == {"a": 1}
    atomic_write_json(f.path, {"a": 2})
    assert f.cached() == {"a": 2}
    assert json.loads(f.path.read_text()) == {"a": 2}


def test_private_files_are_0600(tmp_path: Path) -> None:
    f = JsonFile(tmp_path / "keys.json", what="keys", default=list, expect=list, mode=0o600)
    f.write([])
    assert f.path.stat().st_mode & 0o777 == 0o600


def test_a_json_file_is_a_dict_unless_told_otherwise(tmp_path: Path) -> None:
    # docs/plugins.md: default and expect are dict when left out
    notes = JsonFile(tmp_path / "notes.json", what="the notes file")
    assert notes.read() == {}
    notes.update(lambda value: {**value, "a": 1})
    assert notes.read() == {"a": 1}
    items = JsonFile(tmp_path / "items.json", what="the items file", default=list, expect=list)
    items.update(lambda value: [*value, 1])
    assert items.read() == [1]
