"""The instances on this machine: a registry in a per-user runtime folder, and the vouch
one localm instance proves itself to another with.

Registry. Each ``localm serve`` writes one file, ``<instance_id>.json`` (0600, written
atomically), into the runtime folder when it starts serving and removes it when it stops:
``{"instance_id", "pid", "host", "port", "scheme", "data_dir", "started", "version",
"secret"}``. The folder is ``$LOCALM_RUNTIME_DIR/instances`` when that is set, else
``$XDG_RUNTIME_DIR/localm/instances``, else ``<temp dir>/localm-<uid>/instances``; it is
created 0700 and used only while it belongs to this user and nobody else can enter it.
Listing skips (never reads further) a file that is a link, not owned by this user or readable
by anyone else, and an entry whose host is not a loopback address; it removes the files of
instances whose process is gone or whose port no longer accepts a connection.

Identity. An instance's ``secret`` never leaves the machine's file system: only the same OS
user can read it. Every request one instance makes to another's instance routes carries a
*vouch*:

- ``X-Localm-Instance``: the caller's instance id;
- ``X-Localm-Vouch``: ``t=<unix seconds>,n=<random nonce>,s=<hex HMAC-SHA256>`` where the
  HMAC is keyed with the caller's secret over ``localm-vouch-v1``, the method, the path with
  its query, the SHA-256 of the body, ``t``, ``n`` and the receiver's instance id (one line
  each). The receiver reads the caller's registry file, refuses a timestamp more than
  ``VOUCH_WINDOW`` seconds away and a nonce it has seen in that window (a replay), and
  answers 403 otherwise.

The answer to ``GET /v1/instances/status?nonce=N`` proves the receiver in turn: its
``proof`` is the HMAC, under its own secret, of ``localm-status-v1``, ``N`` and the
caller's instance id, which the caller checks with the secret in the receiver's file.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from .errors import LocalmError
from .storage import atomic_write_json

log = logging.getLogger("localm.instances")

ENV = "LOCALM_RUNTIME_DIR"
INSTANCE_HEADER = "X-Localm-Instance"
VOUCH_HEADER = "X-Localm-Vouch"
#: How far (seconds) a vouch's timestamp may be from now.
VOUCH_WINDOW = 30.0


def runtime_dir() -> Path:
    """The per-user folder instances announce themselves in (see the module's docstring)."""
    explicit = os.environ.get(ENV)
    if explicit:
        return Path(explicit) / "instances"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "localm" / "instances"
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"localm-{uid}" / "instances"


def _private_dir(path: Path) -> bool:
    """Create ``path`` (0700, with its localm parent); True when it is this user's and closed
    to others (and so is ``<temp>/localm-<uid>``, the fallback parent)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        folders = [path]
        if os.environ.get(ENV) is None and os.environ.get("XDG_RUNTIME_DIR") is None:
            folders.append(path.parent)
        for folder in folders:
            info = os.lstat(folder)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                return False
            if info.st_mode & 0o077:  # ours, made with the umask's mode: closed now
                os.chmod(folder, 0o700)
        return True
    except OSError:
        return False


def sign(secret: str, *parts: str) -> str:
    return hmac.new(secret.encode(), "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def body_hash(body: bytes) -> str:
    return hashlib.sha256(body or b"").hexdigest()


def is_loopback(host: Any) -> bool:
    from .app import is_loopback as loopback
    return isinstance(host, str) and loopback(host)


@attrs.frozen
class Peer:
    """Another instance's registry entry (its secret stays here, for checking its proofs)."""

    instance_id: str
    pid: int
    host: str
    port: int
    scheme: str
    data_dir: str
    started: float
    secret: str = attrs.field(repr=False)

    @property
    def base(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def public(self) -> dict[str, Any]:
        return {"instance_id": self.instance_id, "host": self.host, "port": self.port, "scheme": self.scheme}


def _pid_alive(pid: int) -> bool | None:
    """True alive, False gone, None another user's (never ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return None
    except OSError as exc:
        return exc.errno != errno.ESRCH
    return True


def _contact_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "::1"
    return host


class Instances:
    """This instance's registry entry, the others', and vouches (see the module's docstring)."""

    def __init__(self) -> None:
        self.instance_id = secrets.token_hex(8)
        self._secret = secrets.token_urlsafe(32)
        self._file: Path | None = None
        #: nonce → when it was seen (the replay window's)
        self._seen: dict[str, float] = {}

    # --- this instance's entry -----------------------------------------------------------
    def announce(self, *, host: str, port: int, scheme: str, data_dir: Path, started: float, version: str) -> None:
        folder = runtime_dir()
        if not _private_dir(folder):
            log.warning("instances: %s is not a private folder of this user; this instance is not announced", folder)
            return
        path = folder / f"{self.instance_id}.json"
        atomic_write_json(path, {"instance_id": self.instance_id, "pid": os.getpid(), "host": _contact_host(host),
                                 "port": port, "scheme": scheme, "data_dir": str(data_dir), "started": started,
                                 "version": version, "secret": self._secret}, mode=0o600)
        self._file = path

    def forget(self) -> None:
        if self._file is not None:
            try:
                self._file.unlink()
            except OSError:
                pass
            self._file = None

    @property
    def announced(self) -> bool:
        return self._file is not None

    # --- the others ----------------------------------------------------------------------
    def read(self, instance_id: str) -> Peer | None:
        """The entry of ``instance_id`` when it passes every check (owner, mode, loopback), else None."""
        if not isinstance(instance_id, str) or not instance_id.isalnum() or len(instance_id) > 64:
            return None
        return self._read(runtime_dir() / f"{instance_id}.json")

    def _read(self, path: Path) -> Peer | None:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                log.info("instances: ignoring %s (not a private file of this user)", path.name)
                return None
            with os.fdopen(fd, "rb", closefd=False) as fh:
                data = json.loads(fh.read(65536))
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        try:
            peer = Peer(instance_id=str(data["instance_id"]), pid=int(data["pid"]), host=str(data["host"]),
                        port=int(data["port"]), scheme=str(data.get("scheme", "http")),
                        data_dir=str(data.get("data_dir", "")), started=float(data.get("started", 0)),
                        secret=str(data["secret"]))
        except (KeyError, TypeError, ValueError):
            return None
        if peer.instance_id != path.stem or peer.scheme not in ("http", "https") or not peer.secret:
            return None
        if not is_loopback(peer.host):
            log.info("instances: ignoring %s (host %s is not a loopback address)", path.name, peer.host)
            return None
        return peer

    async def others(self, *, probe: float = 0.5) -> list[Peer]:
        """The other live instances; the files of dead ones are removed."""
        folder = runtime_dir()
        try:
            paths = sorted(p for p in folder.glob("*.json") if p.stem != self.instance_id)
        except OSError:
            return []
        found = [peer for peer in (self._read(p) for p in paths) if peer is not None]

        async def alive(peer: Peer) -> bool:
            state = _pid_alive(peer.pid)
            if state is False:
                self._remove(folder / f"{peer.instance_id}.json", "its process is gone")
                return False
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(peer.host, peer.port), probe)
                writer.close()
                return True
            except (OSError, asyncio.TimeoutError):
                if state is True and not _listening(peer.host, peer.port):
                    self._remove(folder / f"{peer.instance_id}.json", "its port does not answer")
                return False
        answers = await asyncio.gather(*(alive(p) for p in found))
        return [p for p, ok in zip(found, answers) if ok]

    @staticmethod
    def _remove(path: Path, why: str) -> None:
        try:
            path.unlink()
            log.info("instances: removed the stale entry %s (%s)", path.name, why)
        except OSError:
            pass

    # --- vouches ---------------------------------------------------------------------------
    def vouch_headers(self, peer_id: str, method: str, path: str, body: bytes = b"") -> dict[str, str]:
        """The headers that vouch for a request from this instance to ``peer_id``."""
        stamp, nonce = str(int(time.time())), secrets.token_hex(12)
        mac = sign(self._secret, "localm-vouch-v1", method.upper(), path, body_hash(body), stamp, nonce, peer_id)
        return {INSTANCE_HEADER: self.instance_id, VOUCH_HEADER: f"t={stamp},n={nonce},s={mac}"}

    def check_vouch(self, headers: Any, method: str, path: str, body: bytes) -> Peer:
        """The caller a request's vouch proves; 403 ``vouch_refused`` for anything else."""
        def refuse(why: str) -> LocalmError:
            return LocalmError(403, f"Instance vouch refused: {why}", code="vouch_refused")
        caller = headers.get(INSTANCE_HEADER) or ""
        raw = headers.get(VOUCH_HEADER) or ""
        if not caller or not raw:
            raise refuse(f"send {INSTANCE_HEADER} and {VOUCH_HEADER} (only another localm instance on this "
                         "machine, run by the same user, can)")
        fields = dict(part.split("=", 1) for part in raw.split(",") if "=" in part)
        stamp, nonce, mac = fields.get("t", ""), fields.get("n", ""), fields.get("s", "")
        if not stamp.isdigit() or not nonce or not mac or len(nonce) > 64:
            raise refuse("malformed")
        now = time.time()
        if abs(now - int(stamp)) > VOUCH_WINDOW:
            raise refuse("its timestamp is stale")
        peer = self.read(caller)
        if peer is None or caller == self.instance_id:
            raise refuse("no such instance on this machine")
        if _pid_alive(peer.pid) is False:
            raise refuse("that instance is no longer running")
        expected = sign(peer.secret, "localm-vouch-v1", method.upper(), path, body_hash(body), stamp, nonce,
                        self.instance_id)
        if not hmac.compare_digest(expected, mac):
            raise refuse("the signature does not verify")
        for old in [n for n, at in self._seen.items() if now - at > 2 * VOUCH_WINDOW]:
            del self._seen[old]
        key = f"{caller}:{nonce}"
        if key in self._seen:
            raise refuse("replayed")
        self._seen[key] = now
        return peer

    def proof(self, nonce: str, caller_id: str) -> str:
        """This instance's answer to a status nonce from ``caller_id``."""
        return sign(self._secret, "localm-status-v1", nonce, caller_id)

    def check_proof(self, peer: Peer, nonce: str, proof: Any) -> bool:
        """Whether ``proof`` is ``peer``'s answer to ``nonce`` (it holds the secret in its file)."""
        return isinstance(proof, str) and hmac.compare_digest(
            sign(peer.secret, "localm-status-v1", nonce, self.instance_id), proof)


def _listening(host: str, port: int) -> bool:
    """A blocking second look (a refused connection is certain; a timeout is not)."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return True
