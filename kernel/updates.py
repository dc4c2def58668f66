"""Updates: ask a release feed for a newer build, apply a signed one, roll back to the last.

A *build* is the installed localm source tree: the folder holding the ``kernel``, ``sdk``
and ``plugins`` packages (found from this package, or named by ``LOCALM_INSTALL_ROOT``,
which tests point at a copy so that an update never touches the real checkout).

- The owner-only ``update_url`` names a release feed: ``GET {update_url}/latest.json``
  answers ``{"version", "notes", "published_at", "asset", "signature", "klass",
  "prerelease"}`` (``update_token``, when set, goes along as a bearer token). The feed and
  the asset are fetched from that URL's origin only (a redirect elsewhere is refused), with
  bounded sizes and timeouts.
- The asset is a ``.tar.gz`` of a build: ``kernel/``, ``sdk/``, ``plugins/``, ``CHANGELOG.md``
  if it has one, and ``localm-release.json`` (``{"version", "klass"}``, the signed word on
  what the release is). ``signature`` is a base64 Ed25519 signature over the asset's bytes.
- Trusted keys are Ed25519 public keys in PEM files: those the build ships
  (``kernel/update_keys/``) and those the owner places in ``<data dir>/update-keys/``. No
  route and no setting adds one. A release that no trusted key verifies changes nothing.
- Apply: download (at most ``ASSET_MAX_BYTES``), verify, check every member of the archive
  before unpacking any (regular files and folders only, no absolute path, no ``..``, a
  bounded count and total size: a decompression bomb is refused from its headers), unpack
  into a staging folder, back the current build up to ``<data dir>/updates/backup/`` (with
  the version it held), then swap the new files in. A failure midway puts the old files
  back. A ``code`` release restarts the server in place; a ``setup`` release is applied but
  not restarted into (the owner runs the release's setup step first, then restarts); a
  ``deps`` release changes localm's Python dependencies and is refused: the owner installs
  it with pip.
- Rollback puts the backup's files back (no network, no signature: it restores what was
  here) and restarts. One update or rollback runs at a time.

A restart re-executes the same command, so Python imports localm from wherever it is
installed. With ``LOCALM_INSTALL_ROOT`` naming a copy, the restarted server still runs the
installed code, while the copy holds the new build (and the update check reads the copy's
``localm-release.json``): that is what tests rely on, and why the variable is for tests and
for installs whose code lives outside the imported package.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import os
import shutil
import tarfile
import threading
import time
import zlib
from pathlib import Path, PurePosixPath
from typing import Any, Iterator
from urllib.parse import urljoin, urlsplit

import attrs
import filelock
import httpx
from packaging.version import InvalidVersion, Version

from . import __version__
from .errors import LocalmError
from .storage import atomic_write_json

log = logging.getLogger("localm")

INSTALL_ROOT_ENV = "LOCALM_INSTALL_ROOT"
RELEASE_FILE = "localm-release.json"
BACKUP_RECORD = "localm-backup.json"
#: What a build is made of: what an update replaces and a backup keeps.
TREE = ("kernel", "sdk", "plugins", "CHANGELOG.md", RELEASE_FILE)
FOLDERS = ("kernel", "sdk", "plugins")
KLASSES = ("code", "deps", "setup")
NET_MODES = ("on", "ask", "off")

FEED_MAX_BYTES = 64 * 1024
ASSET_MAX_BYTES = 200 * 1024 * 1024
EXTRACT_MAX_BYTES = 1024 * 1024 * 1024
EXTRACT_MAX_MEMBERS = 50_000
MEMBER_NAME_MAX = 1024
#: The most any one read of the unpacked stream may ask for (a tar header claiming a huge
#: extended header would otherwise be read into memory whole).
READ_MAX_BYTES = 16 * 1024 * 1024
KEY_FILE_MAX_BYTES = 16 * 1024
RECORD_MAX_BYTES = 64 * 1024
TIMEOUT = httpx.Timeout(30.0, connect=10.0)
DOWNLOAD_DEADLINE = 30 * 60.0
FEED_DEADLINE = 60.0
MAX_REDIRECTS = 3
CHUNK = 1024 * 1024

BUILTIN_KEYS = Path(__file__).resolve().parent / "update_keys"
KEY_SUFFIXES = (".pub", ".pem")


class Unreachable(Exception):
    """The feed or the asset could not be had (the network, the server, a redirect elsewhere)."""


class Refused(Exception):
    """The release was refused before anything changed (signature, archive, version)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


# --- where the build is, and what it holds ----------------------------------------------------

def install_root() -> Path:
    """The installed build's folder: ``LOCALM_INSTALL_ROOT``, or the folder above this package."""
    named = os.environ.get(INSTALL_ROOT_ENV)
    if named:
        return Path(named).expanduser().resolve()
    return Path(__file__).resolve().parent.parent


def _read_record(path: Path) -> dict[str, Any] | None:
    """A small JSON object file, or None when it is missing, too large or not one."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > RECORD_MAX_BYTES:
            return None
        value = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def current_version(root: Path) -> str:
    """The version the build at ``root`` holds: its ``localm-release.json``, else this code's."""
    record = _read_record(root / RELEASE_FILE)
    version = record.get("version") if record else None
    return version if isinstance(version, str) and version else __version__


def compare(current: str, latest: str) -> tuple[bool, bool]:
    """``(comparable, newer)``: newer is False when either is not a valid version."""
    try:
        return True, Version(latest) > Version(current)
    except InvalidVersion:
        return False, False


def is_prerelease(version: str, flagged: bool) -> bool:
    try:
        return flagged or Version(version).is_prerelease
    except InvalidVersion:
        return flagged


def net_mode(config: Any) -> str:
    """The ``net_mode`` setting ("on", "ask" or "off"), read raw so that this works whether or
    not the setting is declared: unset or undeclared reads as "on", a value that is none of
    the three as "off". The one place updates read it."""
    from .config import KERNEL_FIELDS

    spec = KERNEL_FIELDS.get("net_mode")
    default = spec.default if spec is not None else "on"
    try:
        raw = config.raw()
    except LocalmError:
        raw = {}
    value = raw.get("net_mode", default) if isinstance(raw, dict) else default
    return value if value in NET_MODES else "off"


# --- trust ----------------------------------------------------------------------------------

def key_folders(data_dir: Path) -> list[Path]:
    return [BUILTIN_KEYS, Path(data_dir) / "update-keys"]


def trusted_keys(data_dir: Path) -> list[tuple[str, Any]]:
    """``(file name, Ed25519 public key)`` for every PEM key the build ships or the owner placed
    in ``<data dir>/update-keys/``; a file that is not one is skipped (and logged)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    out: list[tuple[str, Any]] = []
    for folder in key_folders(data_dir):
        try:
            files = sorted(p for p in folder.iterdir() if p.suffix in KEY_SUFFIXES)
        except OSError:
            continue
        for path in files:
            try:
                if not path.is_file() or path.stat().st_size > KEY_FILE_MAX_BYTES:
                    raise ValueError("not a small regular file")
                key = load_pem_public_key(path.read_bytes())
                if not isinstance(key, Ed25519PublicKey):
                    raise ValueError("not an Ed25519 public key")
            except (OSError, ValueError, TypeError) as exc:
                log.warning("update key %s skipped: %s", path, exc)
                continue
            out.append((path.name, key))
    return out


def verify(data: bytes, signature: str | None, keys: list[tuple[str, Any]]) -> str:
    """The name of the trusted key whose signature ``signature`` is over ``data``; else Refused."""
    from cryptography.exceptions import InvalidSignature

    if not signature:
        raise Refused("The release carries no signature; it was not applied", "update_unsigned")
    try:
        raw = base64.b64decode(signature, validate=True)
    except (ValueError, TypeError):
        raw = b""
    if len(raw) != 64:
        raise Refused("The release's signature is not a base64 Ed25519 signature; it was not applied",
                      "update_signature_invalid")
    if not keys:
        raise Refused("No trusted update key: add the release signer's Ed25519 public key (a PEM file) to "
                      "the update-keys folder of the data dir; nothing was applied", "update_no_trusted_key")
    for name, key in keys:
        try:
            key.verify(raw, data)
        except InvalidSignature:
            continue
        return name
    raise Refused("The release's signature does not verify with any trusted update key; it was not applied",
                  "update_signature_invalid")


# --- the archive ------------------------------------------------------------------------------

class _Bounded(io.RawIOBase):
    """A read-only view of ``inner`` that refuses to go past ``limit`` bytes or to read more
    than READ_MAX_BYTES at once: what the unpacked stream of a .tar.gz may cost."""

    def __init__(self, inner: Any, limit: int) -> None:
        self.inner = inner
        self.limit = limit

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.inner.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        target = offset if whence == 0 else self.inner.tell() + offset if whence == 1 else None
        if target is None or target > self.limit:
            raise Refused("The release's archive unpacks to more than "
                          f"{EXTRACT_MAX_BYTES // (1024 * 1024)} MB; it was not applied", "update_too_large")
        return self.inner.seek(target)

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or size > READ_MAX_BYTES or self.inner.tell() + size > self.limit:
            raise Refused("The release's archive holds an entry over the size limits; it was not applied",
                          "update_too_large")
        return self.inner.read(size)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


def _member_parts(member: tarfile.TarInfo) -> tuple[str, ...]:
    """The member's path as safe parts under the staging folder, or Refused."""
    name = member.name
    if len(name) > MEMBER_NAME_MAX or "\x00" in name or "\\" in name:
        raise Refused(f"The release's archive holds an unsafe name ({name[:80]!r}); it was not applied",
                      "update_unsafe_archive")
    if name.startswith("/"):
        raise Refused(f"The release's archive holds an absolute path ({name[:80]}); it was not applied",
                      "update_unsafe_archive")
    parts = tuple(p for p in PurePosixPath(name).parts if p != ".")
    if ".." in parts:
        raise Refused(f"The release's archive holds a path that leaves its folder ({name[:80]}); "
                      "it was not applied", "update_unsafe_archive")
    return parts


def walk_archive(path: Path, into: Path | None = None) -> list[str]:
    """Check every member of the .tar.gz at ``path`` (and unpack it ``into`` a folder when one is
    given); the top-level names it holds. Anything but regular files and folders, a path that
    is absolute or leaves the archive, a name outside TREE, a duplicate, or more than the
    bounded count or total size is Refused before the member's data is read."""
    import gzip

    stream_limit = EXTRACT_MAX_BYTES + (EXTRACT_MAX_MEMBERS + 8) * 3 * tarfile.BLOCKSIZE
    seen: set[tuple[str, ...]] = set()
    tops: dict[str, str] = {}
    total = 0
    try:
        with gzip.open(path, "rb") as raw, tarfile.open(fileobj=_Bounded(raw, stream_limit), mode="r:") as tar:
            while True:
                member = tar.next()
                if member is None:
                    break
                parts = _member_parts(member)
                if not parts:
                    if member.isdir():
                        continue  # the archive's own top folder, "./"
                    raise Refused("The release's archive holds a member with no name; it was not applied",
                                  "update_unsafe_archive")
                if len(seen) >= EXTRACT_MAX_MEMBERS:
                    raise Refused(f"The release's archive holds more than {EXTRACT_MAX_MEMBERS} entries; "
                                  "it was not applied", "update_too_large")
                if member.isreg():
                    total += member.size
                    if total > EXTRACT_MAX_BYTES:
                        raise Refused(f"The release's archive unpacks to more than "
                                      f"{EXTRACT_MAX_BYTES // (1024 * 1024)} MB; it was not applied",
                                      "update_too_large")
                    kind = "file"
                elif member.isdir():
                    kind = "folder"
                else:
                    raise Refused(f"The release's archive holds {member.name[:80]}, which is not a regular "
                                  "file or folder (links and devices are refused); it was not applied",
                                  "update_unsafe_archive")
                if parts in seen:
                    raise Refused(f"The release's archive holds {member.name[:80]} twice; it was not applied",
                                  "update_unsafe_archive")
                seen.add(parts)
                top = parts[0]
                if top not in TREE:
                    raise Refused(f"The release's archive holds {top[:80]}, which is no part of a localm build "
                                  f"(expected only {', '.join(TREE)}); it was not applied", "update_unsafe_archive")
                want = "folder" if top in FOLDERS else "file"
                if len(parts) == 1 and kind != want:
                    raise Refused(f"The release's archive holds {top} as a {kind}, not a {want}; "
                                  "it was not applied", "update_unsafe_archive")
                if want == "file" and len(parts) > 1:
                    raise Refused(f"The release's archive holds {member.name[:80]} under a file; it was not applied",
                                  "update_unsafe_archive")
                tops.setdefault(top, want)
                if into is not None:
                    _unpack(tar, member, into.joinpath(*parts))
    except Refused:
        raise
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise Refused(f"The release's asset is not a .tar.gz that unpacks cleanly ({exc}); it was not applied",
                      "update_unsafe_archive") from exc
    missing = [name for name in (*FOLDERS, RELEASE_FILE) if name not in tops]
    if missing:
        raise Refused(f"The release's archive lacks {', '.join(missing)}: it is no localm build; it was not applied",
                      "update_unsafe_archive")
    return sorted(tops)


def _unpack(tar: tarfile.TarFile, member: tarfile.TarInfo, target: Path) -> None:
    if member.isdir():
        target.mkdir(parents=True, exist_ok=True)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    source = tar.extractfile(member)
    assert source is not None
    left = member.size
    with open(target, "xb") as out:
        while left > 0:
            chunk = source.read(min(CHUNK, left))
            if not chunk:
                raise Refused(f"The release's archive ends inside {member.name[:80]}; it was not applied",
                              "update_unsafe_archive")
            out.write(chunk)
            left -= len(chunk)
    os.chmod(target, 0o755 if member.mode & 0o100 else 0o644)


# --- moving builds around --------------------------------------------------------------------

def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def _copy(source: Path, target: Path) -> None:
    if source.is_dir() and not source.is_symlink():
        shutil.copytree(source, target, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
        shutil.copy2(source, target, follow_symlinks=False)


class Broken(Exception):
    """A swap failed and putting the old files back failed too."""


def replace_tree(root: Path, source: Path, names: list[str]) -> None:
    """Make ``root``'s build entries (TREE) those of ``source`` named in ``names`` (an entry not
    named is removed). The old entries are moved aside first and moved back when anything
    fails, which is then raised; Broken when they could not all be moved back."""
    aside = root / f".localm-update-old-{os.getpid()}"
    if os.path.lexists(aside):
        _remove(aside)
    aside.mkdir()
    done: list[str] = []
    try:
        for name in TREE:
            old = root / name
            if os.path.lexists(old):
                os.rename(old, aside / name)
            done.append(name)  # from here on, root / name holds nothing of the old build
            if name in names:
                _copy(source / name, old)
    except BaseException as exc:
        try:
            for name in reversed(done):
                if os.path.lexists(root / name):
                    _remove(root / name)
                if os.path.lexists(aside / name):
                    os.rename(aside / name, root / name)
            aside.rmdir()
        except OSError as undo:
            raise Broken(f"{exc}; then putting the old files back failed too ({undo}); what was there is "
                         f"in {aside}") from exc
        raise
    shutil.rmtree(aside, ignore_errors=True)


# --- the feed -------------------------------------------------------------------------------

@attrs.frozen
class Settings:
    """The update settings, read once for one check or apply."""

    url: str
    token: str
    allow_prerelease: bool
    ignore_net_policy: bool

    @classmethod
    def of(cls, config: Any) -> "Settings":
        return cls(url=str(config.get("update_url") or "").strip(), token=str(config.get("update_token") or ""),
                   allow_prerelease=bool(config.get("update_allow_prerelease")),
                   ignore_net_policy=bool(config.get("update_ignore_net_policy")))


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or {"http": 80, "https": 443}.get(scheme)
    return scheme, (parts.hostname or "").lower(), port


def _loopback_host(host: str) -> bool:
    from .app import is_loopback

    return host == "localhost" or is_loopback(host)


def url_problem(settings: Settings) -> str | None:
    """Why ``update_url`` cannot be used, or None."""
    try:
        scheme, host, _ = _origin(settings.url)
    except ValueError:
        return "update_url is not a valid URL"
    if scheme not in ("http", "https") or not host:
        return "update_url must be an http:// or https:// URL"
    if "?" in settings.url or "#" in settings.url:
        return "update_url must be the feed's folder, with no query or fragment"
    if settings.token and scheme != "https" and not _loopback_host(host):
        return "update_token is sent over https only (or to this machine): make update_url an https:// URL"
    return None


@attrs.frozen
class Release:
    version: str
    notes: str
    published_at: Any
    asset: str | None
    signature: str | None
    klass: str
    prerelease: bool


class Feed:
    """The release feed at ``update_url``: its latest release, and the asset's bytes."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.base = settings.url.rstrip("/") + "/"
        self.origin = _origin(settings.url)
        headers = {"User-Agent": f"localm/{__version__}", "Accept": "application/json"}
        if settings.token:
            headers["Authorization"] = f"Bearer {settings.token}"
        self.client = httpx.Client(headers=headers, follow_redirects=False, timeout=TIMEOUT)

    def close(self) -> None:
        self.client.close()

    @contextlib.contextmanager
    def _get(self, url: str, what: str) -> Iterator[httpx.Response]:
        for _ in range(MAX_REDIRECTS + 1):
            try:
                elsewhere = _origin(url) != self.origin
            except ValueError:
                elsewhere = True
            if elsewhere:
                raise Unreachable(f"{what} is at {url}, which is not on update_url's origin; updates are fetched "
                                  "from that origin only")
            try:
                with self.client.stream("GET", url) as response:
                    if response.is_redirect:
                        url = urljoin(url, response.headers.get("location", ""))
                        continue
                    if response.status_code in (401, 403):
                        raise Unreachable(f"{what} was refused (HTTP {response.status_code}): check update_token")
                    if response.status_code != 200:
                        raise Unreachable(f"{what} answered HTTP {response.status_code}")
                    yield response
                    return
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                raise Unreachable(f"{what} could not be fetched: {_reason(exc)}") from exc
        raise Unreachable(f"{what} redirected more than {MAX_REDIRECTS} times")

    def latest(self) -> Release:
        with self._get(urljoin(self.base, "latest.json"), "The release feed") as response:
            data = _bounded_body(response, FEED_MAX_BYTES, "The release feed")
        try:
            feed = json.loads(data)
        except ValueError:
            raise Unreachable("The release feed is not JSON") from None
        return self._release(feed)

    def _release(self, feed: Any) -> Release:
        if not isinstance(feed, dict):
            raise Unreachable("The release feed is not a JSON object")

        def field(name: str, kind: type | tuple[type, ...], default: Any) -> Any:
            value = feed.get(name, default)
            if value is not None and not isinstance(value, kind):
                raise Unreachable(f"The release feed's {name} is not a {getattr(kind, '__name__', 'value')}")
            return value

        version = field("version", str, None)
        if not version:
            raise Unreachable("The release feed names no version")
        klass = field("klass", str, "code") or "code"
        if klass not in KLASSES:
            raise Unreachable(f"The release feed's klass {klass[:40]!r} is none of {', '.join(KLASSES)}")
        asset = field("asset", str, None)
        return Release(version=version[:100], notes=field("notes", str, "") or "",
                       published_at=field("published_at", (str, int, float), None),
                       asset=urljoin(self.base, asset) if asset else None,
                       signature=field("signature", str, None) or None, klass=klass,
                       prerelease=bool(field("prerelease", bool, False)))

    def download(self, url: str, target: Path) -> None:
        """Stream the asset to ``target``: at most ASSET_MAX_BYTES, within DOWNLOAD_DEADLINE."""
        deadline = time.monotonic() + DOWNLOAD_DEADLINE
        with self._get(url, "The release's asset") as response, open(target, "wb") as out:
            declared = response.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > ASSET_MAX_BYTES:
                raise Unreachable(f"The release's asset is over {ASSET_MAX_BYTES // (1024 * 1024)} MB")
            got = 0
            try:
                for chunk in response.iter_bytes(CHUNK):
                    got += len(chunk)
                    if got > ASSET_MAX_BYTES:
                        raise Unreachable(f"The release's asset is over {ASSET_MAX_BYTES // (1024 * 1024)} MB")
                    if time.monotonic() > deadline:
                        raise Unreachable(f"The release's asset took over {DOWNLOAD_DEADLINE:.0f} s to download")
                    out.write(chunk)
            except httpx.HTTPError as exc:
                raise Unreachable(f"The release's asset could not be fetched: {_reason(exc)}") from exc


def _bounded_body(response: httpx.Response, limit: int, what: str) -> bytes:
    out = bytearray()
    deadline = time.monotonic() + FEED_DEADLINE
    try:
        for chunk in response.iter_bytes():
            out += chunk
            if len(out) > limit:
                raise Unreachable(f"{what} is over {limit // 1024} KB")
            if time.monotonic() > deadline:
                raise Unreachable(f"{what} took over {FEED_DEADLINE:.0f} s to read")
    except httpx.HTTPError as exc:
        raise Unreachable(f"{what} could not be read: {_reason(exc)}") from exc
    return bytes(out)


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text[:300]


# --- the service ----------------------------------------------------------------------------

class Updates:
    """Check, apply and roll back, one at a time; state lives in ``<data dir>/updates/``."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.folder = self.data_dir / "updates"
        self.backup = self.folder / "backup"
        self._busy = threading.Lock()

    # --- what callers see ------------------------------------------------------------------
    def scrub(self, text: str, *, owner: bool, url: str = "") -> str:
        """``text`` as a caller who is not the owner may see it: the data dir as ``<data>``, the
        install folder as ``<install>`` and the owner-only update_url as ``<update_url>``."""
        if owner or not text:
            return text
        if url:
            text = text.replace(url.rstrip("/"), "<update_url>")
        for path, label in ((self.data_dir.resolve(), "<data>"), (self.data_dir, "<data>"),
                            (install_root(), "<install>")):
            if str(path) not in ("", "."):
                text = text.replace(str(path), label)
        return text

    # --- check -----------------------------------------------------------------------------
    def check(self, config: Any) -> dict[str, Any]:
        settings = Settings.of(config)
        if not settings.url:
            return {"available": False}
        current = current_version(install_root())
        blocked = self._blocked(config, settings) or url_problem(settings)
        if blocked:
            return {"available": True, "current": current, "error": blocked}
        feed = Feed(settings)
        try:
            release = feed.latest()
        except Unreachable as exc:
            return {"available": True, "current": current, "error": str(exc)}
        finally:
            feed.close()
        comparable, newer = compare(current, release.version)
        out: dict[str, Any] = {
            "available": True, "current": current, "latest": release.version, "newer": newer,
            "comparable": comparable, "notes": release.notes, "published_at": release.published_at,
            "asset": release.asset, "signature": release.signature, "klass": release.klass,
            "prerelease": is_prerelease(release.version, release.prerelease)}
        if newer and out["prerelease"] and not settings.allow_prerelease:
            out["newer"] = False
            out["note"] = f"{release.version} is a prerelease, and update_allow_prerelease is off"
        return out

    @staticmethod
    def _blocked(config: Any, settings: Settings) -> str | None:
        """Why net_mode stops the update channel now (kernel/netpolicy.py), or None."""
        from . import netpolicy

        if settings.ignore_net_policy:
            return None
        decision = netpolicy.outbound(config, "the update channel")
        if decision.allowed:
            return None
        return f"{decision.error} (or the owner-only update_ignore_net_policy)"

    # --- one at a time -----------------------------------------------------------------------
    @contextlib.contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        """Hold the update lock (this process's and the data dir's), or 409."""
        if not self._busy.acquire(blocking=False):
            raise LocalmError(409, f"An update or rollback is already running; {what} was not started",
                              code="update_busy")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            lock = filelock.FileLock(str(self.folder / ".lock"), timeout=0)
            try:
                lock.acquire()
            except filelock.Timeout:
                raise LocalmError(409, f"An update or rollback is already running; {what} was not started",
                                  code="update_busy") from None
            try:
                yield
            finally:
                lock.release()
        finally:
            self._busy.release()

    # --- apply -------------------------------------------------------------------------------
    def apply(self, config: Any) -> dict[str, Any]:
        """Apply the latest release (see the module's docstring); the answer POST /api/update/apply gives."""
        settings = Settings.of(config)
        if not settings.url:
            raise LocalmError(400, "No updater is configured: set update_url (owner only) to a release feed",
                              code="update_not_configured")
        problem = url_problem(settings)
        if problem:
            raise LocalmError(400, problem, code="update_not_configured")
        blocked = self._blocked(config, settings)
        if blocked:
            raise LocalmError(502, blocked, code="net_mode_off")
        root = install_root()
        self._check_root(root)
        with self.exclusive("the update"):
            self._sweep()
            feed = Feed(settings)
            try:
                return self._apply(feed, settings, root)
            finally:
                feed.close()
                self._sweep()

    def _check_root(self, root: Path) -> None:
        if not all((root / name).is_dir() for name in FOLDERS):
            raise LocalmError(400, f"{root} holds no localm build (kernel, sdk and plugins folders): nothing to "
                                   "update", code="update_no_build")
        data = self.data_dir.resolve()
        for name in FOLDERS:
            if data == (root / name).resolve() or (root / name).resolve() in data.parents:
                raise LocalmError(400, f"The data dir is inside {root / name}, which an update replaces; move it",
                                  code="update_no_build")

    def _sweep(self) -> None:
        """Remove what an apply leaves while it works (a download, a staging folder)."""
        for path in self.folder.glob("work-*"):
            with contextlib.suppress(OSError):
                _remove(path)

    def _apply(self, feed: Feed, settings: Settings, root: Path) -> dict[str, Any]:
        current = current_version(root)
        try:
            release = feed.latest()
        except Unreachable as exc:
            raise LocalmError(502, f"The update check failed: {exc}", code="update_check_failed") from None
        comparable, newer = compare(current, release.version)
        if not comparable:
            return {"applied": False, "current": current,
                    "reason": f"the versions cannot be compared ({current!r}, {release.version!r})"}
        if not newer:
            return {"applied": False, "reason": "already up to date", "current": current}
        if is_prerelease(release.version, release.prerelease) and not settings.allow_prerelease:
            return {"applied": False, "current": current,
                    "reason": f"the latest release, {release.version}, is a prerelease "
                              "(update_allow_prerelease is off)"}
        if not release.asset:
            raise LocalmError(400, f"Release {release.version} has no downloadable build (the feed names no asset)",
                              code="update_no_asset")
        if release.klass == "deps":
            raise _needs_pip(release.version)
        if not all(os.access(path, os.W_OK) for path in (root, *(root / name for name in FOLDERS))):
            return {"applied": False, "current": current, "code": "update_not_writable",
                    "error": f"This server's user cannot write the build in {root}: update it as the user who "
                             "installed it"}

        work = self.folder / f"work-{os.getpid()}-{time.monotonic_ns()}"
        work.mkdir(parents=True)
        archive = work / "release.tar.gz"
        try:
            feed.download(release.asset, archive)
        except Unreachable as exc:
            raise LocalmError(502, f"The release could not be downloaded: {exc}",
                              code="update_download_failed") from None
        try:
            klass = self._verified(archive, release, work / "staging")
        except Refused as exc:
            log.warning("update %s refused: %s", release.version, exc)
            return {"applied": False, "error": str(exc), "code": exc.code, "current": current}
        if klass == "deps":
            raise _needs_pip(release.version)

        try:
            self._make_backup(root, current)
        except OSError as exc:
            log.error("update %s: the backup failed: %s", release.version, exc)
            return {"applied": False, "error": f"The current build could not be backed up to {self.backup} "
                                               f"({_reason(exc)}); nothing was changed", "current": current}
        try:
            replace_tree(root, work / "staging", [n for n in TREE if os.path.lexists(work / "staging" / n)])
        except Broken as exc:
            restored = self._restore_from_backup(root)
            log.error("update %s failed partway: %s (restored from the backup: %s)", release.version, exc, restored)
            if not restored:
                raise LocalmError(500, f"The update failed partway and the old build could not be put back; "
                                       f"restore it by hand from {self.backup}", code="update_broken") from None
            return {"applied": False, "current": current,
                    "error": f"The update failed partway ({exc}); the old build was restored from {self.backup}"}
        except Exception as exc:
            log.error("update %s failed partway: %s", release.version, exc)
            return {"applied": False, "current": current,
                    "error": f"The update failed partway ({_reason(exc)}); the old files were put back"}
        log.info("update %s (%s) applied to %s; backup of %s in %s", release.version, klass, root, current, self.backup)
        out: dict[str, Any] = {"applied": True, "version": release.version, "klass": klass,
                               "backup": str(self.backup), "restart_needed": True, "available": True}
        if klass != "setup":
            out["restarting"] = True
        return out

    def _verified(self, archive: Path, release: Release, staging: Path) -> str:
        """Verify the asset, check and unpack it into ``staging``; its klass, or Refused."""
        if archive.stat().st_size > ASSET_MAX_BYTES:
            raise Refused("The release's asset is over the size limit; it was not applied", "update_too_large")
        key = verify(archive.read_bytes(), release.signature, trusted_keys(self.data_dir))
        walk_archive(archive)  # every header first: nothing is unpacked from a refused archive
        staging.mkdir()
        walk_archive(archive, staging)
        record = _read_record(staging / RELEASE_FILE) or {}
        version = record.get("version")
        if not isinstance(version, str) or version != release.version:
            raise Refused(f"The signed build says it is version {str(version)[:40]!r}, not {release.version!r} "
                          "as the feed says; it was not applied", "update_version_mismatch")
        klass = record.get("klass", release.klass)
        if klass not in KLASSES or klass != release.klass:
            raise Refused(f"The signed build's klass {str(klass)[:20]!r} differs from the feed's "
                          f"{release.klass!r}; it was not applied", "update_version_mismatch")
        log.info("update %s: signature verified with %s", release.version, key)
        return str(klass)

    def _make_backup(self, root: Path, version: str) -> None:
        """Copy the build's entries to ``updates/backup/`` (replacing the previous backup only once
        the new one is whole), with a record of the version and folder they came from."""
        fresh = self.folder / f"work-backup-{os.getpid()}"
        if os.path.lexists(fresh):
            _remove(fresh)
        fresh.mkdir(parents=True)
        entries = [name for name in TREE if os.path.lexists(root / name)]
        for name in entries:
            _copy(root / name, fresh / name)
        atomic_write_json(fresh / BACKUP_RECORD, {"version": version, "root": str(root), "entries": entries,
                                                  "created": time.time()})
        old = self.folder / "work-old-backup"
        if os.path.lexists(old):
            _remove(old)
        if os.path.lexists(self.backup):
            os.rename(self.backup, old)
        os.rename(fresh, self.backup)
        with contextlib.suppress(OSError):
            _remove(old)

    def _restore_from_backup(self, root: Path) -> bool:
        record = self._backup_record()
        if record is None:
            return False
        try:
            for name in TREE:
                if os.path.lexists(root / name):
                    _remove(root / name)
                if name in record["entries"]:
                    _copy(self.backup / name, root / name)
        except OSError as exc:
            log.error("restoring %s from %s failed: %s", root, self.backup, exc)
            return False
        return True

    # --- rollback ----------------------------------------------------------------------------
    def _backup_record(self) -> dict[str, Any] | None:
        record = _read_record(self.backup / BACKUP_RECORD)
        if record is None:
            return None
        entries = record.get("entries")
        if not isinstance(entries, list) or not all(isinstance(e, str) and e in TREE for e in entries):
            return None
        if not all(os.path.lexists(self.backup / e) for e in entries):
            return None
        version = record.get("version")
        return {"version": version if isinstance(version, str) else None, "entries": entries,
                "root": record.get("root") if isinstance(record.get("root"), str) else None}

    def rollback_info(self) -> dict[str, Any]:
        record = self._backup_record()
        current = current_version(install_root())
        if record is None:
            return {"available": False, "backup": None, "version": None, "current": current}
        return {"available": True, "backup": str(self.backup), "version": record["version"], "current": current}

    def rollback(self) -> dict[str, Any]:
        """Put the backup's files back in place of the build's (see the module's docstring)."""
        root = install_root()
        with self.exclusive("the rollback"):
            record = self._backup_record()
            if record is None:
                raise LocalmError(409, "There is no backup to roll back to (an update makes one)", code="no_backup")
            if record["root"] is not None and Path(record["root"]) != root:
                raise LocalmError(409, f"The backup in {self.backup} was made of {record['root']}, not of the "
                                       f"build here ({root}); nothing was changed", code="backup_elsewhere")
            try:
                replace_tree(root, self.backup, record["entries"])
            except Broken as exc:
                log.error("rollback failed partway: %s", exc)
                raise LocalmError(500, f"The rollback failed partway and the files could not all be put back "
                                       f"({exc}); the backup is kept in {self.backup}",
                                  code="rollback_failed") from None
            except Exception as exc:
                log.error("rollback failed: %s", exc)
                raise LocalmError(500, f"The rollback failed ({_reason(exc)}); the build was left as it was and the "
                                       f"backup is kept in {self.backup}", code="rollback_failed") from None
            log.info("rolled %s back to %s from %s", root, record["version"], self.backup)
            with contextlib.suppress(OSError):
                _remove(self.backup)
        return {"rolled_back": True, "backup": str(self.backup), "version": record["version"], "restarting": True}


def _needs_pip(version: str) -> LocalmError:
    return LocalmError(400, f"Release {version} is a deps-class update: it changes localm's Python dependencies, "
                            "which the server does not install from a route. Install it with pip in the environment "
                            f"localm runs from (pip install --upgrade 'localm=={version}'), then restart",
                       code="update_needs_pip")
