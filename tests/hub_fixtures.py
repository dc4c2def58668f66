"""A Hugging Face-compatible file server on loopback, for the pull tests and bench/pull.py.

It speaks the part of the hub's HTTP protocol that huggingface_hub and localm's downloader
use: ``GET /api/models/{repo}[/revision/{rev}]`` lists a repository (``sha``, ``siblings``
with ``rfilename``, ``size`` and ``lfs: {sha256, size}``; ``/tree/{rev}`` the same as
huggingface_hub's snapshot_download reads it), and ``GET|HEAD
/{repo}/resolve/{rev}/{file}`` answers a 302 to the file's bytes on a "CDN" path of the same
server (named ``localhost``, another host, as the hub's CDN is), carrying ``X-Repo-Commit``,
``ETag``, ``X-Linked-Etag`` (the sha256) and ``X-Linked-Size`` as the hub does; the bytes
are served with ``Range`` support (206 and ``Content-Range``), from disk with sendfile.

What a test can change: a repository that needs a token (``private``: 401 without
``Authorization: Bearer TOKEN``), a file whose listed sha256 is not its content's
(``lie``), and a file whose next downloads stop half-way (``drop``: the connection closes
after that many bytes). Every request is recorded (``requests``: method, path, headers)::

    with HubServer() as hub:
        hub.add("org/model-GGUF", "model-Q4_K_M.gguf", Path("model.gguf"))
        os.environ["HF_ENDPOINT"] = hub.url
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_HASHES: dict[tuple[str, int, int], str] = {}


def sha256_file(path: Path) -> str:
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


class Blob:
    def __init__(self, data: Path | bytes, sha256: str | None = None) -> None:
        self.data = data
        self.size = data.stat().st_size if isinstance(data, Path) else len(data)
        self.real_sha256 = sha256_file(data) if isinstance(data, Path) else hashlib.sha256(data).hexdigest()
        self.sha256 = sha256 or self.real_sha256  # what the hub says (a test may make it lie)


class HubServer:
    """The server (``url``), its repositories and what it was asked."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, Blob]] = {}
        self.private: dict[str, str] = {}  # repo -> the token it needs
        self.drops: dict[tuple[str, str], list[int]] = {}  # (repo, file) -> byte counts to stop at, one a request
        self.requests: list[dict[str, Any]] = []
        self.blobs: list[tuple[str, str]] = []  # the CDN's index: (repo, file)
        self.lock = threading.Lock()
        self.httpd: ThreadingHTTPServer | None = None
        self.url = self.cdn = ""

    # --- content ----------------------------------------------------------------------
    def add(self, repo: str, name: str, data: Path | bytes, *, lie: str | None = None) -> Blob:
        blob = Blob(data, lie)
        with self.lock:
            self.repos.setdefault(repo, {})[name] = blob
            if (repo, name) not in self.blobs:
                self.blobs.append((repo, name))
        return blob

    def drop(self, repo: str, name: str, *after: int) -> None:
        """The next downloads of ``name`` stop after these many bytes (one count a request)."""
        self.drops[(repo, name)] = list(after)

    def seen(self, method: str | None = None, path_part: str = "") -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.requests if (method is None or r["method"] == method) and path_part in r["path"]]

    # --- lifecycle --------------------------------------------------------------------
    def __enter__(self) -> "HubServer":
        server = self

        class Handler(_Handler):
            hub = server
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        #: the file bytes come from another host name (as the hub's CDN), so a client does not
        #: send its token there and huggingface_hub reads the file's metadata off the redirect
        self.cdn = f"http://localhost:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: HubServer

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, status: int, value: Any, head: bool = False, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(value).encode(), {"Content-Type": "application/json", **(headers or {})}, head)

    def _answer(self, head: bool) -> None:
        hub = self.hub
        path = unquote(urlsplit(self.path).path)
        with hub.lock:
            hub.requests.append({"method": self.command, "path": path,
                                 "headers": {k.lower(): v for k, v in self.headers.items()}})
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo = "/".join(parts[2:4])
            if not self._allowed(repo, head):
                return
            files = hub.repos.get(repo)
            if files is None:
                self._json(404, {"error": "Repository not found"}, head, {"X-Error-Code": "RepoNotFound"})
                return
            if len(parts) >= 6 and parts[4] == "tree":  # huggingface_hub's snapshot_download lists the tree
                self._json(200, [{"type": "file", "path": name, "size": blob.size, "oid": blob.sha256[:40],
                                  "lfs": {"oid": blob.sha256, "size": blob.size, "pointerSize": 134}}
                                 for name, blob in files.items()], head)
                return
            siblings = [{"rfilename": name, "size": blob.size,
                         "lfs": {"sha256": blob.sha256, "size": blob.size, "pointerSize": 134}}
                        for name, blob in files.items()]
            self._json(200, {"id": repo, "modelId": repo, "sha": COMMIT, "private": repo in hub.private,
                             "siblings": siblings}, head)
            return
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            if not self._allowed(repo, head):
                return
            blob = hub.repos.get(repo, {}).get(name)
            if blob is None:
                self._json(404, {"error": "Entry not found"}, head, {"X-Error-Code": "EntryNotFound",
                                                                     "X-Repo-Commit": COMMIT})
                return
            index = hub.blobs.index((repo, name))
            self._send(302, b"", {"Location": f"{hub.cdn}/cdn/{index}/{name.rsplit('/', 1)[-1]}",
                                  "X-Repo-Commit": COMMIT, "ETag": f'"{blob.sha256}"',
                                  "X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(blob.size)}, head)
            return
        if parts[0] == "cdn" and len(parts) >= 2 and parts[1].isdigit() and int(parts[1]) < len(hub.blobs):
            repo, name = hub.blobs[int(parts[1])]
            self._bytes(repo, name, hub.repos[repo][name], head)
            return
        self._json(404, {"error": "not found"}, head)

    def _allowed(self, repo: str, head: bool) -> bool:
        needed = self.hub.private.get(repo)
        if needed is None or self.headers.get("Authorization") == f"Bearer {needed}":
            return True
        self._json(401, {"error": "Invalid credentials in Authorization header"}, head,
                   {"X-Error-Code": "GatedRepo" if self.headers.get("Authorization") else "RepoNotFound"})
        return False

    def _bytes(self, repo: str, name: str, blob: Blob, head: bool) -> None:
        start, end = 0, blob.size - 1
        status = 200
        ranged = self.headers.get("Range", "")
        if ranged.startswith("bytes="):
            first, _, last = ranged[6:].partition("-")
            start = int(first or 0)
            end = min(int(last), blob.size - 1) if last else blob.size - 1
            if start >= blob.size:
                self._send(416, b"", {"Content-Range": f"bytes */{blob.size}"}, head)
                return
            status = 206
        length = end - start + 1
        self.send_response(status)
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("ETag", f'"{blob.sha256}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{blob.size}")
        self.end_headers()
        if head:
            return
        stop = None
        with self.hub.lock:
            pending = self.hub.drops.get((repo, name))
            if pending:
                stop = pending.pop(0)
        count = length if stop is None else max(0, min(length, stop - start))
        if isinstance(blob.data, Path):
            self.wfile.flush()
            with open(blob.data, "rb") as fh:
                offset, left = start, count
                while left > 0:
                    sent = os.sendfile(self.connection.fileno(), fh.fileno(), offset, min(left, 1 << 24))
                    if sent == 0:
                        break
                    offset += sent
                    left -= sent
        else:
            self.wfile.write(blob.data[start:start + count])
        if stop is not None:  # the connection drops half-way
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)


def split_gguf(source: Path, folder: Path, stem: str, parts: int = 3) -> list[Path]:
    """Write ``source`` (a GGUF model) again as ``parts`` files, as llama.cpp's gguf-split
    does: ``STEM-00001-of-0000N.gguf`` holding every metadata key and the first tensors, the
    rest holding further tensors; each has ``split.no``, ``split.count`` and
    ``split.tensors.count``. llama.cpp loads the first and finds the others beside it."""
    import math

    import gguf

    reader = gguf.GGUFReader(str(source), "r")
    arch = next(str(bytes(f.parts[f.data[0]]), "utf-8") for f in reader.fields.values()
                if f.name == gguf.Keys.General.ARCHITECTURE)
    per = math.ceil(len(reader.tensors) / parts)
    folder.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(folder / f"{stem}.gguf"), arch, split_max_tensors=per)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return [folder / f"{stem}-{i:05d}-of-{parts:05d}.gguf" for i in range(1, parts + 1)]
