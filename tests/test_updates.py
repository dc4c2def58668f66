"""Updates: check, apply and roll back signed builds, against a real release server on loopback.

Each server is a real ``localm serve`` whose ``LOCALM_INSTALL_ROOT`` names a small fake build
made here (never the checkout); the release feed and its signed ``.tar.gz`` come from an
``http.server`` on 127.0.0.1, signed with an Ed25519 key whose public half the test places in
``<data dir>/update-keys/``.
"""

from __future__ import annotations

import base64
import io
import json
import os
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from conftest import offline_cli
from localm.kernel import updates
from localm.sdk.testing import LocalmServer

OLD, NEW = "1.0.0", "2.0.0"


# --- builds, archives and signatures ---------------------------------------------------------

def build_tree(root: Path, version: str) -> None:
    """A small stand-in for a localm build: what an update replaces."""
    files = {"kernel/__init__.py": f'__version__ = "{version}"\n',
             f"kernel/only_in_{version.replace('.', '_')}.py": "HERE = True\n",
             "sdk/__init__.py": f"# sdk {version}\n",
             "plugins/hello/plugin.toml": f'id = "hello"\nversion = "{version}"\n',
             "CHANGELOG.md": f"# Changelog\n\n## {version}\n",
             "localm-release.json": json.dumps({"version": version, "klass": "code"})}
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def snapshot(root: Path) -> dict[str, Any]:
    """Every path under ``root`` with its bytes (a folder as "<dir>"): byte-identical or not."""
    return {p.relative_to(root).as_posix(): "<dir>" if p.is_dir() else "<fifo>" if p.is_fifo() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def tarball(tree: Path | None, extra: Callable[[tarfile.TarFile], None] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        if tree is not None:
            for path in sorted(tree.rglob("*")):
                tar.add(path, arcname=path.relative_to(tree).as_posix(), recursive=False)
        if extra is not None:
            extra(tar)
    return buf.getvalue()


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def raw_gzip_tar(*headers: bytes) -> bytes:
    """A .tar.gz of hand-made headers (with no data after them): what tarfile will not write."""
    import gzip

    return gzip.compress(b"".join(headers) + b"\0" * tarfile.BLOCKSIZE * 2)


def sign(key: Ed25519PrivateKey, data: bytes) -> str:
    return base64.b64encode(key.sign(data)).decode()


def public_pem(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)


# --- the release server --------------------------------------------------------------------

class ReleaseServer:
    """A release feed on 127.0.0.1: ``publish`` what ``/releases/latest.json`` and its asset say."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self.seen: list[tuple[str, str | None]] = []
        self.gate: threading.Event | None = None  # set: asset downloads wait for it
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                owner.seen.append((self.path, self.headers.get("Authorization")))
                status, headers, body = owner.files.get(self.path, (404, {}, b"not found"))
                if self.path.endswith(".tar.gz") and owner.gate is not None:
                    owner.gate.wait(30)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/releases"

    def publish(self, version: str, archive: bytes, signature: str | None, *, klass: str = "code",
                prerelease: bool = False, asset: str | None = None) -> None:
        asset = asset or f"localm-{version}.tar.gz"
        feed = {"version": version, "notes": f"Release {version}", "published_at": "2026-12-01T00:00:00Z",
                "asset": asset, "klass": klass, "prerelease": prerelease}
        if signature is not None:
            feed["signature"] = signature
        self.files["/releases/latest.json"] = (200, {"Content-Type": "application/json"}, json.dumps(feed).encode())
        self.files[f"/releases/{asset}"] = (200, {"Content-Type": "application/gzip"}, archive)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def release() -> Iterator[ReleaseServer]:
    server = ReleaseServer()
    yield server
    server.close()


@pytest.fixture
def signer() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


# --- a localm server over a fake build --------------------------------------------------------

class Setup:
    def __init__(self, server: LocalmServer, root: Path, keys: dict[str, str]) -> None:
        self.server, self.root, self.keys = server, root, keys

    def client(self, who: str = "owner") -> httpx.Client:
        return self.server.client(self.keys[who])


def start(localm_server: Callable[..., LocalmServer], tmp_path: Path, url: str, *,
          trusted: Ed25519PrivateKey | None, config: dict[str, Any] | None = None) -> Setup:
    data, root = tmp_path / "data", tmp_path / "install"
    build_tree(root, OLD)
    data.mkdir(parents=True)
    if config:
        (data / "config.json").write_text(json.dumps(config))
    offline_cli(data, "config", "set", "update_url", url)
    if trusted is not None:
        (data / "update-keys").mkdir()
        (data / "update-keys" / "release.pem").write_bytes(public_pem(trusted))
    keys = {"owner": offline_cli(data, "key", "generate").strip()}
    for scope in ("config:read", "config:write"):
        keys[scope] = offline_cli(data, "key", "create", "--name", scope, "--scope", scope).strip()
    server = localm_server(data_dir=data, plugins=[], env={updates.INSTALL_ROOT_ENV: str(root)})
    return Setup(server, root, keys)


def wait_restart(s: LocalmServer, old_token: str) -> None:
    s.wait_restarted(old_token)
    assert s.token != old_token


def new_build(tmp_path: Path, version: str = NEW) -> Path:
    tree = tmp_path / f"release-{version}"
    build_tree(tree, version)
    return tree


# --- the whole round: check, apply, rollback -------------------------------------------------

def test_check_apply_and_roll_back(localm_server: Any, tmp_path: Path, release: ReleaseServer,
                                   signer: Ed25519PrivateKey) -> None:
    tree = new_build(tmp_path)
    archive = tarball(tree)
    release.publish(NEW, archive, sign(signer, archive))
    setup = start(localm_server, tmp_path, release.url, trusted=signer)
    s, root = setup.server, setup.root
    before = snapshot(root)
    owner = setup.client()
    assert owner.patch("/v1/config", json={"update_token": "feed-token"}).status_code == 200

    check = owner.get("/api/update/check").json()
    assert check == {"available": True, "current": OLD, "latest": NEW, "newer": True, "comparable": True,
                     "notes": f"Release {NEW}", "published_at": "2026-12-01T00:00:00Z",
                     "asset": f"{release.url}/localm-{NEW}.tar.gz", "signature": sign(signer, archive),
                     "klass": "code", "prerelease": False}
    assert release.seen[-1] == ("/releases/latest.json", "Bearer feed-token")
    # a config:read key sees neither the owner-only update_url nor the data dir
    scoped = setup.client("config:read").get("/api/update/check").json()
    assert scoped["asset"] == f"<update_url>/localm-{NEW}.tar.gz" and release.url not in json.dumps(scoped)
    assert owner.get("/api/update/rollback").json() == {"available": False, "backup": None, "version": None,
                                                        "current": OLD}

    # a config:write key applies it; the backup path reaches it scrubbed
    applied = setup.client("config:write").post("/api/update/apply")
    assert applied.status_code == 200, applied.text
    assert applied.json() == {"applied": True, "version": NEW, "klass": "code", "backup": "<data>/updates/backup",
                              "restart_needed": True, "available": True, "restarting": True}
    assert snapshot(root) == snapshot(tree)  # every file replaced, the old version's own file gone
    assert release.seen[-1] == (f"/releases/localm-{NEW}.tar.gz", "Bearer feed-token")
    backup = s.data_dir / "updates" / "backup"
    assert {k: v for k, v in snapshot(backup).items() if k != "localm-backup.json"} == before
    wait_restart(s, s.token)

    owner = setup.client()
    after = owner.get("/api/update/check").json()
    assert after["current"] == NEW and after["newer"] is False
    assert owner.post("/api/update/apply").json() == {"applied": False, "reason": "already up to date",
                                                      "current": NEW}
    assert owner.get("/api/update/rollback").json() == {"available": True, "backup": str(backup), "version": OLD,
                                                        "current": NEW}
    assert setup.client("config:read").get("/api/update/rollback").json()["backup"] == "<data>/updates/backup"

    # rollback is admin's alone
    refused = setup.client("config:write").post("/api/update/rollback")
    assert refused.status_code == 403 and refused.json()["detail"] == "Key lacks required scope: admin"
    assert snapshot(root) == snapshot(tree)

    # a damaged backup (a file that cannot be copied): a 500, the build as it was, the backup kept
    pipe = backup / "plugins" / "pipe"
    os.mkfifo(pipe)
    broken = owner.post("/api/update/rollback")
    assert broken.status_code == 500 and broken.json()["code"] == "rollback_failed", broken.text
    assert "the backup is kept" in broken.json()["detail"]
    assert snapshot(root) == snapshot(tree) and backup.is_dir()
    pipe.unlink()

    rolled = owner.post("/api/update/rollback")
    assert rolled.status_code == 200, rolled.text
    assert rolled.json() == {"rolled_back": True, "backup": str(backup), "version": OLD, "restarting": True}
    assert snapshot(root) == before
    wait_restart(s, s.token)
    owner = setup.client()
    assert owner.get("/api/update/check").json()["current"] == OLD
    again = owner.post("/api/update/rollback")
    assert again.status_code == 409 and again.json()["code"] == "no_backup"
    assert owner.get("/api/update/rollback").json()["available"] is False


# --- refusals that change nothing ------------------------------------------------------------

def test_refused_releases_change_nothing(localm_server: Any, tmp_path: Path, release: ReleaseServer,
                                         signer: Ed25519PrivateKey) -> None:
    tree = new_build(tmp_path)
    good = tarball(tree)
    setup = start(localm_server, tmp_path, release.url, trusted=signer)
    root, owner = setup.root, setup.client()
    before = snapshot(root)

    def refused(code: str, archive: bytes, signature: str | None, version: str = NEW) -> None:
        release.publish(version, archive, signature)
        r = owner.post("/api/update/apply")
        assert r.status_code == 200, r.text
        assert r.json()["applied"] is False and r.json()["code"] == code, r.json()
        assert snapshot(root) == before
        assert not (setup.server.data_dir / "updates" / "backup").exists()
        assert list((setup.server.data_dir / "updates").glob("work-*")) == []

    tampered = bytearray(good)
    tampered[len(tampered) // 2] ^= 0xFF
    refused("update_signature_invalid", bytes(tampered), sign(signer, good))
    refused("update_signature_invalid", good, sign(Ed25519PrivateKey.generate(), good))
    refused("update_unsigned", good, None)
    refused("update_signature_invalid", good, "not base64 at all!")

    def signed(archive: bytes) -> tuple[bytes, str]:
        return archive, sign(signer, archive)

    # unsafe members, each in an otherwise good build
    refused("update_unsafe_archive", *signed(tarball(tree, lambda t: add_bytes(t, "kernel/../../escape.py", b"x"))))
    refused("update_unsafe_archive", *signed(tarball(tree, lambda t: add_bytes(t, "/etc/evil", b"x"))))

    def link(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("kernel/passwd")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)

    refused("update_unsafe_archive", *signed(tarball(tree, link)))

    def device(tar: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("kernel/null")
        info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
        tar.addfile(info)

    refused("update_unsafe_archive", *signed(tarball(tree, device)))
    refused("update_unsafe_archive", *signed(tarball(tree, lambda t: add_bytes(t, "setup.py", b"import os"))))
    refused("update_unsafe_archive", *signed(tarball(tree, lambda t: add_bytes(t, "kernel/__init__.py", b"again"))))
    refused("update_unsafe_archive", *signed(b"this is not a tarball"))

    # decompression bombs, refused from their headers before any data is read: a member that
    # says it holds 2 GB, and an extended header that would be read into memory whole
    bomb = tarfile.TarInfo("kernel/bomb.bin")
    bomb.size = 2 * 1024 ** 3
    refused("update_too_large", *signed(raw_gzip_tar(bomb.tobuf(format=tarfile.GNU_FORMAT))))
    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type, pax.size = tarfile.XHDTYPE, 2 * 1024 ** 3
    refused("update_too_large", *signed(raw_gzip_tar(pax.tobuf(format=tarfile.USTAR_FORMAT))))

    # a signed older build under a newer feed version (a replayed release) is no downgrade path
    old_tree = new_build(tmp_path, "0.5.0")
    refused("update_version_mismatch", *signed(tarball(old_tree)), version="3.0.0")

    # a deps-class release: the owner is told to run pip, nothing is downloaded
    release.publish(NEW, good, sign(signer, good), klass="deps")
    seen = len(release.seen)
    r = owner.post("/api/update/apply")
    assert r.status_code == 400 and r.json()["code"] == "update_needs_pip" and "pip install" in r.json()["detail"]
    assert [p for p, _ in release.seen[seen:]] == ["/releases/latest.json"] and snapshot(root) == before

    # an asset on another origin is never fetched
    release.publish(NEW, good, sign(signer, good), asset="http://127.0.0.2:9/localm.tar.gz")
    r = owner.post("/api/update/apply")
    assert r.status_code == 502 and "not on update_url's origin" in r.json()["detail"]
    assert snapshot(root) == before

    # nor through a redirect
    release.publish(NEW, good, sign(signer, good))
    release.files[f"/releases/localm-{NEW}.tar.gz"] = (302, {"Location": "http://127.0.0.2:9/x.tar.gz"}, b"")
    r = owner.post("/api/update/apply")
    assert r.status_code == 502 and "not on update_url's origin" in r.json()["detail"]
    assert snapshot(root) == before

    # a feed past its size bound is an error, not a read into memory
    release.files["/releases/latest.json"] = (200, {}, b" " * (updates.FEED_MAX_BYTES + 1))
    assert "is over 64 KB" in owner.get("/api/update/check").json()["error"]

    # one update at a time: while one waits on its download, another and a rollback are 409s
    release.publish(NEW, bytes(tampered), sign(signer, good))
    release.gate = threading.Event()
    first: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: first.append(setup.client().post("/api/update/apply")))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while not any(p.endswith(".tar.gz") for p, _ in release.seen[-1:]) and time.monotonic() < deadline:
            time.sleep(0.05)
        busy = owner.post("/api/update/apply")
        assert busy.status_code == 409 and busy.json()["code"] == "update_busy"
        assert owner.post("/api/update/rollback").status_code == 409
    finally:
        release.gate.set()
        worker.join(60)
    assert first[0].json()["code"] == "update_signature_invalid" and snapshot(root) == before
    release.gate = None

    # a good release whose backup cannot be made (the build holds a file that cannot be copied)
    release.publish(NEW, good, sign(signer, good))
    os.mkfifo(root / "plugins" / "pipe")
    with_pipe = snapshot(root)
    r = owner.post("/api/update/apply").json()
    assert r["applied"] is False and "could not be backed up" in r["error"] and "nothing was changed" in r["error"]
    assert snapshot(root) == with_pipe and not (setup.server.data_dir / "updates" / "backup").exists()


def test_no_trusted_key_no_update(localm_server: Any, tmp_path: Path, release: ReleaseServer,
                                  signer: Ed25519PrivateKey) -> None:
    archive = tarball(new_build(tmp_path))
    release.publish(NEW, archive, sign(signer, archive))
    setup = start(localm_server, tmp_path, release.url, trusted=None)
    before = snapshot(setup.root)
    r = setup.client().post("/api/update/apply").json()
    assert r["applied"] is False and r["code"] == "update_no_trusted_key" and "update-keys" in r["error"]
    assert snapshot(setup.root) == before


def test_prerelease_waits_for_its_setting_and_setup_class_does_not_restart(
        localm_server: Any, tmp_path: Path, release: ReleaseServer, signer: Ed25519PrivateKey) -> None:
    version = "2.0.0rc1"
    tree = tmp_path / "rc"
    build_tree(tree, version)
    (tree / "localm-release.json").write_text(json.dumps({"version": version, "klass": "setup"}))
    archive = tarball(tree)
    release.publish(version, archive, sign(signer, archive), klass="setup", prerelease=True)
    setup = start(localm_server, tmp_path, release.url, trusted=signer)
    owner = setup.client()
    check = owner.get("/api/update/check").json()
    assert check["newer"] is False and check["prerelease"] is True and "update_allow_prerelease" in check["note"]
    r = owner.post("/api/update/apply").json()
    assert r["applied"] is False and "prerelease" in r["reason"]
    assert owner.patch("/v1/config", json={"update_allow_prerelease": True}).status_code == 200
    applied = owner.post("/api/update/apply").json()
    assert applied == {"applied": True, "version": version, "klass": "setup",
                       "backup": str(setup.server.data_dir / "updates" / "backup"), "restart_needed": True,
                       "available": True}
    assert snapshot(setup.root) == snapshot(tree)
    time.sleep(1)
    assert owner.get("/api/update/check").json()["current"] == version  # the same process: no restart


# --- no updater, no network --------------------------------------------------------------------

def test_without_update_url(localm_server: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    owner_key = offline_cli(data, "key", "generate").strip()
    writer = offline_cli(data, "key", "create", "--name", "w", "--scope", "config:write").strip()
    s = localm_server(data_dir=data, plugins=[])
    owner = s.client(owner_key)
    assert owner.get("/api/update/check").json() == {"available": False}
    r = owner.post("/api/update/apply")
    assert r.status_code == 400 and r.json()["code"] == "update_not_configured"
    assert owner.get("/api/update/rollback").json()["available"] is False
    r = owner.post("/api/update/rollback")
    assert r.status_code == 409 and r.json()["code"] == "no_backup"
    assert s.client(writer).post("/api/update/rollback").status_code == 403
    # update settings are the owner's: a config:write key neither sees nor sets them
    assert "update_url" not in s.client(writer).get("/v1/config").json()
    assert s.client(writer).patch("/v1/config", json={"update_url": "http://127.0.0.1:1"}).status_code == 403
    # a token never travels over plain http to another machine: refused before any request
    assert owner.patch("/v1/config", json={"update_url": "http://updates.invalid/localm",
                                           "update_token": "secret-token"}).status_code == 200
    assert "https only" in owner.get("/api/update/check").json()["error"]
    r = owner.post("/api/update/apply")
    assert r.status_code == 400 and r.json()["code"] == "update_not_configured"
    assert owner.patch("/v1/config", json={"update_url": "ftp://updates.invalid/"}).status_code == 200
    assert "http:// or https://" in owner.get("/api/update/check").json()["error"]
    assert not (data / "updates" / "backup").exists()


def test_unreachable_feed_and_net_mode_off(localm_server: Any, tmp_path: Path, signer: Ed25519PrivateKey) -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    setup = start(localm_server, tmp_path, f"http://127.0.0.1:{port}/releases", trusted=signer,
                  config={"net_mode": "off"})
    before = snapshot(setup.root)
    owner = setup.client()
    check = owner.get("/api/update/check")
    assert check.status_code == 200 and check.json()["available"] is True and "net_mode" in check.json()["error"]
    r = owner.post("/api/update/apply")
    assert r.status_code == 502 and r.json()["code"] == "net_mode_off"

    assert owner.patch("/v1/config", json={"update_ignore_net_policy": True}).status_code == 200
    check = owner.get("/api/update/check")
    assert check.status_code == 200 and "could not be fetched" in check.json()["error"]
    r = owner.post("/api/update/apply")
    assert r.status_code == 502 and r.json()["code"] == "update_check_failed"
    assert snapshot(setup.root) == before


# --- the swap itself -------------------------------------------------------------------------

def test_a_swap_that_fails_midway_puts_the_old_files_back(tmp_path: Path) -> None:
    root, source = tmp_path / "install", tmp_path / "new"
    build_tree(root, OLD)
    build_tree(source, NEW)
    os.mkfifo(source / "plugins" / "pipe")  # copied after kernel/ and sdk/ were replaced: the copy fails
    before = snapshot(root)
    with pytest.raises(OSError):
        updates.replace_tree(root, source, list(updates.TREE))
    assert snapshot(root) == before


def test_net_mode_is_read_whether_or_not_the_setting_is_declared(tmp_path: Path) -> None:
    from localm.kernel.config import Config

    config = Config(tmp_path)
    assert updates.net_mode(config) == "on"  # unset (or not declared at all)
    for value, read in (("off", "off"), ("ask", "ask"), ("on", "on"), ("of", "off"), (False, "off")):
        (tmp_path / "config.json").write_text(json.dumps({"net_mode": value}))
        assert updates.net_mode(config) == read, value
    (tmp_path / "config.json").write_text("{not json")
    assert updates.net_mode(config) == "on"  # unreadable: update_url reads as unset too, so no updater runs
