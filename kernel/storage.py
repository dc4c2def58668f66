"""Atomic files in the data directory.

Every write goes to a temporary file beside the target, is flushed to disk and then
renamed over it, so a reader sees the old bytes or the new ones and a failed write
leaves the old file intact. A temporary file is named after its writer's process
(``.<name>.<pid>.<random>.tmp``), so the one a killed process left behind is recognised
and removed when the server next starts (:func:`sweep_temporary`). A file that exists
but cannot be parsed raises :class:`~localm.kernel.errors.Unreadable` and is never
overwritten.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import filelock

from .errors import SaveTimeout, Unreadable

LOCK_TIMEOUT = float(os.environ.get("LOCALM_LOCK_TIMEOUT", "10"))
TMP_SUFFIX = ".tmp"
#: ``.<name>.<pid>.<mkstemp's 8 characters>.tmp``
_TMP_NAME = re.compile(r"^\..+\.(\d+)\.[a-z0-9_]{8}\.tmp$")


def atomic_write_bytes(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically; on any failure the old file stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True


def sweep_temporary(root: Path) -> list[Path]:
    """Remove the temporary files of atomic writes whose process is gone (killed mid-write);
    the files removed. Another live process's writes in progress are left alone."""
    removed: list[Path] = []
    for folder, dirs, files in os.walk(root):
        for name in files:
            m = _TMP_NAME.match(name)
            if m is None or _alive(int(m.group(1))):
                continue
            path = Path(folder, name)
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
    return removed


def atomic_write_json(path: Path, value: Any, *, mode: int = 0o644) -> None:
    data = (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()
    atomic_write_bytes(path, data, mode=mode)


def read_json(path: Path, default: Any, *, what: str, expect: type | None = None) -> Any:
    """Parse ``path``; return ``default`` when it does not exist.

    Raises Unreadable when the file exists but is not valid JSON of the expected type.
    """
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return default
    except OSError as exc:
        raise Unreadable(what) from exc
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise Unreadable(what) from exc
    if expect is not None and not isinstance(value, expect):
        raise Unreadable(what)
    return value


class JsonFile:
    """A JSON document on disk, read fresh and updated under a cross-process lock."""

    def __init__(self, path: Path, *, what: str, default: Callable[[], Any] = dict, expect: type = dict,
                 mode: int = 0o644, lock_timeout: float | None = None) -> None:
        self.path = Path(path)
        self.what = what
        self._default = default
        self._expect = expect
        self._mode = mode
        self._cache: tuple[tuple[int, ...], Any] | None = None
        self._lock = filelock.FileLock(str(self.path) + ".lock",
                                       timeout=LOCK_TIMEOUT if lock_timeout is None else lock_timeout)

    def read(self) -> Any:
        return read_json(self.path, self._default(), what=self.what, expect=self._expect)

    def cached(self) -> Any:
        """The parsed file, re-read only when its stat changes (cheap enough per request).

        Callers must not mutate the returned value.
        """
        try:
            st = os.stat(self.path)
            stamp: tuple[int, ...] = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = ()
        except OSError as exc:
            raise Unreadable(self.what) from exc
        if self._cache is not None and self._cache[0] == stamp:
            return self._cache[1]
        value = self.read()
        self._cache = (stamp, value)
        return value

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        try:
            self._lock.acquire()
        except filelock.Timeout as exc:
            raise SaveTimeout(self.what) from exc
        try:
            yield
        finally:
            self._lock.release()

    def update(self, mutate: Callable[[Any], Any]) -> Any:
        """Read, let ``mutate`` change a copy (or return a new value), write atomically.

        ``mutate`` may raise to refuse the change; then nothing is written.
        """
        with self.locked():
            current = self.read()
            result = mutate(current)
            new = current if result is None else result
            atomic_write_json(self.path, new, mode=self._mode)
            return new

    def write(self, value: Any) -> None:
        with self.locked():
            self.read()  # an unreadable file is reported, never replaced
            atomic_write_json(self.path, value, mode=self._mode)
