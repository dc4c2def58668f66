"""llama.cpp's own ``llama-server``, built once from the llama.cpp that the installed
llama-cpp-python vendors, for benchmarks and tests that need it as a peer or an upstream.

``ensure()`` returns the path of the binary, building it when the cache has none for this
llama-cpp-python version: it downloads that version's sdist from the package index,
configures ``vendor/llama.cpp`` with the same portable CPU flags as the README's install
(a native build crashes on CPUs that advertise AMX) and builds only the ``llama-server``
target. The cache folder is ``$LOCALM_LLAMA_SERVER_CACHE`` or ``~/.cache/localm/llama-server``;
a file lock lets several processes ask at once and build it once.

    python bench/llama_server.py          # build (if needed) and print the path
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

#: The README's portable build (threads through OpenMP, as llama-cpp-python's build has them),
#: plus what llama-server needs and nothing it does not.
CMAKE_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
               "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
               "-DGGML_AMX_BF16=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]


def cache_dir() -> Path:
    return Path(os.environ.get("LOCALM_LLAMA_SERVER_CACHE") or Path.home() / ".cache" / "localm" / "llama-server")


def version() -> str:
    return importlib.metadata.version("llama-cpp-python")


def path() -> Path:
    """Where the binary for the installed llama-cpp-python and these flags lives (it may not
    exist yet)."""
    flags = hashlib.sha256(" ".join(CMAKE_FLAGS).encode()).hexdigest()[:8]
    return cache_dir() / f"{version()}-{flags}" / "llama-server"


def ensure(log=sys.stderr) -> Path:
    """The llama-server binary, built first if the cache has none."""
    target = path()
    if target.exists():
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir() / ".build.lock")):
        if target.exists():  # another process built it while this one waited
            return target
        with tempfile.TemporaryDirectory(prefix="llama-server-") as tmp:
            work = Path(tmp)
            print(f"building llama-server from llama-cpp-python {version()} (once, a few minutes)", file=log,
                  flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={version()}", "-d", str(work)], check=True)
            sdist = next(work.glob("llama_cpp_python-*.tar.gz"), None) or next(work.glob("*.tar.gz"))
            with tarfile.open(sdist) as tar:
                tar.extractall(work, filter="data")
            source = next(p for p in work.iterdir() if p.is_dir()) / "vendor" / "llama.cpp"
            build = work / "build"
            jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 2)
            subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], check=True,
                           stdout=subprocess.DEVNULL)
            subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True,
                           stdout=subprocess.DEVNULL)
            built = build / "bin" / "llama-server"
            partial = target.with_suffix(".partial")
            shutil.copy2(built, partial)
            partial.replace(target)
    return target


if __name__ == "__main__":
    print(ensure())
