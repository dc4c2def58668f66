"""What a caller may index and read: the denied-outright rules, the allowed folders, a key's rag_roots.

- Refused outright, for everyone: a dotfile or anything under a dot folder (``.ssh``,
  ``.gnupg``, ``.env``...), key material (private keys, keystores, credential files), the
  localm data directory itself, and the ``denied_roots`` setting.
- A key minted with ``rag_roots`` may add only inside those folders (403 elsewhere), and may
  only read or change collections whose documents all lie inside them.
- Otherwise the owner may add inside ``allowed_roots`` (the home folder when unset); outside
  them ``indexing_mode`` decides: ``ask`` (409 ``needs_consent``, re-POST with
  ``"consent": true``), ``strict`` (403), ``open`` (allowed). Any other key gets a 403
  outside the allowed folders.

Every rule is applied to a path *after* it is resolved (links followed, ``..`` gone), and again
to the file actually opened (:meth:`Rules.open`): a link inside a folder being added, or a file
swapped for a link after it was checked, is held to the same rules as a path named directly.
A folder walk (:meth:`Rules.inspect` with ``within``) follows a link to a file when its target
lies inside the folders this caller may read without consent, or inside the folder being added
(the owner only: the consent given for a folder covers what lies in it, not what its links
lead to); any other link is skipped with the reason. Links to folders are never followed.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import stat as stat_mod
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator

import attrs

from localm import sdk

#: File names that hold secrets, whatever folder they are in.
KEY_MATERIAL = ("*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore", "*.kdbx", "*.gpg", "*.asc",
                "*.ppk", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "*.ovpn", "credentials",
                "credentials.json", "secrets.json", "secrets.yaml", "secrets.yml", "*.secret", "owner_key.json",
                "keys.json", "known_hosts", "authorized_keys", "htpasswd", "*.htpasswd", "shadow", "gshadow")
#: The longest path a caller may name (Linux's PATH_MAX).
MAX_PATH_CHARS = 4096


def real(path: str | os.PathLike[str]) -> Path:
    """The path resolved (links followed); a 400 for text no file can be named by (a NUL, or
    longer than any path can be)."""
    text = str(path)
    if "\0" in text:
        raise sdk.LocalmError(400, "A path cannot hold a NUL character", code="invalid_path")
    if len(text) > MAX_PATH_CHARS:
        raise sdk.LocalmError(400, f"A path is at most {MAX_PATH_CHARS} characters", code="invalid_path")
    return Path(os.path.realpath(os.path.expanduser(text)))


def inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _name(path: Path | str) -> str:
    """What a message may say about a path: its base name only."""
    return Path(path).name or str(path)


def denied_by_name(path: Path) -> str | None:
    """Why a path's own spelling may never be indexed (a dot entry, key material), or None."""
    if any(part.startswith(".") and part not in (".", "..") for part in path.parts):
        return "dotfiles and dot folders are never indexed"
    if any(fnmatch.fnmatch(path.name.lower(), pattern) for pattern in KEY_MATERIAL):
        return "key material is never indexed"
    return None


def _denied(path: Path, data: Path, denied_roots: Iterable[Path]) -> str | None:
    why = denied_by_name(path)
    if why is not None:
        return why
    if inside(path, data) or inside(data, path):
        return "the localm data directory is never indexed"
    if any(inside(path, root) for root in denied_roots):
        return "the folder is in denied_roots"
    return None


def denied(path: Path, *, data_dir: Path, denied_roots: Iterable[str]) -> str | None:
    """Why ``path`` (resolved) may never be indexed, or None."""
    return _denied(path, real(data_dir), [real(r) for r in denied_roots if r])


def allowed_roots(settings: dict[str, Any]) -> list[Path]:
    roots = [real(r) for r in settings.get("allowed_roots") or [] if r]
    return roots or [real(Path.home())]


def is_owner(caller: Any) -> bool:
    """The owner: the owner key, an admin key, the attach token, or open mode."""
    return caller is None or caller.is_owner or caller.kind == "open"


def key_roots(caller: Any) -> list[Path] | None:
    """The folders a key's rag_roots confine it to, or None when it is not confined."""
    roots = getattr(caller, "rag_roots", ()) if caller is not None else ()
    return [real(r) for r in roots] if roots else None


def check_paths(paths: list[Path], caller: Any, settings: dict[str, Any], *, data_dir: Path,
                consent: bool) -> None:
    """Refuse what this caller may not add (400, 403 or the owner's 409 needs_consent); ``paths``
    are resolved. A refusal names base names only."""
    for path in paths:
        why = denied(path, data_dir=data_dir, denied_roots=settings.get("denied_roots") or [])
        if why is not None:
            raise sdk.LocalmError(400, f"{_name(path)}: {why}", code="path_denied")
    confined = key_roots(caller)
    if confined is not None:
        outside = [p for p in paths if not any(inside(p, r) for r in confined)]
        if outside:
            raise sdk.LocalmError(403, f"{_name(outside[0])} is outside this key's rag_roots",
                                  code="outside_rag_roots")
        return
    allowed = allowed_roots(settings)
    outside = [p for p in paths if not any(inside(p, r) for r in allowed)]
    if not outside:
        return
    mode = settings.get("indexing_mode", "ask")
    if not is_owner(caller):
        raise sdk.LocalmError(403, f"{_name(outside[0])} is outside the folders this server allows indexing",
                              code="outside_allowed")
    if mode == "open" or (mode == "ask" and consent):
        return
    if mode == "strict":
        raise sdk.LocalmError(403, f"{_name(outside[0])} is outside allowed_roots, and indexing_mode is strict",
                              code="outside_allowed")
    # the owner's own answer: the owner may see the folders of the owner's own filesystem
    addable = [str(p) for p in paths if p not in outside]
    raise sdk.LocalmError(409, f"{len(outside)} path(s) lie outside the folders allowed for indexing "
                               f"({', '.join(str(r) for r in allowed)}): re-send with \"consent\": true to index "
                               "them anyway, or add their folder to the rag plugin's allowed_roots",
                          code="needs_consent", needs_consent=True, reason="outside_allowed", addable=addable,
                          outside=[str(p) for p in outside])


def readable(docs: list[dict[str, Any]], caller: Any) -> bool:
    """A key confined by rag_roots may read a collection only when every file in it lies inside them."""
    confined = key_roots(caller)
    if confined is None:
        return True
    return all(d["kind"] != "file" or any(inside(Path(d["path"]), r) for r in confined) for d in docs)


@attrs.frozen
class Checked:
    """A file that passed the rules: the path as named, where it resolved to, and which file
    that was (device and inode), so that the file later opened can be held to be the same."""

    path: Path
    real: Path
    dev: int
    ino: int
    size: int
    mtime: float


@attrs.frozen
class Rules:
    """What one caller may read from the server's filesystem, applied to resolved paths."""

    data_dir: Path
    denied_roots: tuple[Path, ...]
    allowed: tuple[Path, ...]
    confined: tuple[Path, ...] | None
    owner: bool
    anywhere: bool  # the owner, with indexing_mode open

    @classmethod
    def of(cls, caller: Any, settings: dict[str, Any], data_dir: Path) -> "Rules":
        confined = key_roots(caller)
        owner = is_owner(caller)
        return cls(data_dir=real(data_dir),
                   denied_roots=tuple(real(r) for r in settings.get("denied_roots") or [] if r),
                   allowed=tuple(allowed_roots(settings)),
                   confined=None if confined is None else tuple(confined), owner=owner,
                   anywhere=owner and confined is None and settings.get("indexing_mode", "ask") == "open")

    def why_not(self, resolved: Path, within: Path | str | None = None) -> str | None:
        """Why this caller may not read the file at ``resolved`` (a resolved path), or None.
        ``within``: the folder the file was added under, whose consent the owner gave."""
        why = _denied(resolved, self.data_dir, self.denied_roots)
        if why is not None:
            return why
        if self.confined is not None:
            if any(inside(resolved, r) for r in self.confined):
                return None
            return "it lies outside this key's rag_roots"
        if any(inside(resolved, r) for r in self.allowed) or (self.owner and self.anywhere):
            return None
        if self.owner and within is not None and inside(resolved, Path(within)):
            return None
        return "it lies outside the folders allowed for indexing"

    def inspect(self, path: Path | str, within: Path | str | None = None) -> tuple[Checked | None, str | None]:
        """(the file, None) when this caller may read ``path``, else (None, why not): the rules
        applied to the path as named and to where it resolves, and it must be a regular file."""
        named = Path(path)
        why = denied_by_name(named)
        if why is not None:
            return None, why
        try:
            resolved = real(named)
        except sdk.LocalmError as exc:
            return None, exc.detail
        why = self.why_not(resolved, within)
        if why is not None:
            return None, (f"a link whose target is refused: {why}" if resolved != Path(os.path.abspath(named))
                          else why)
        try:
            st = os.stat(resolved)
        except OSError as exc:
            return None, f"cannot be read ({exc.strerror})"
        if not stat_mod.S_ISREG(st.st_mode):
            return None, "not a regular file"
        return Checked(named, resolved, st.st_dev, st.st_ino, st.st_size, st.st_mtime), None

    def check(self, path: Path | str, within: Path | str | None = None) -> Checked:
        """The file at ``path``, or a 403 ``path_denied`` (400 ``unreadable``) naming its base name."""
        checked, why = self.inspect(path, within)
        if checked is None:
            code, status = ("unreadable", 400) if why and (why.startswith("cannot be read")
                                                           or why == "not a regular file") else ("path_denied", 403)
            raise sdk.LocalmError(status, f"{_name(path)}: {why}", code=code)
        return checked

    def present(self, path: str, within: str | None = None) -> bool:
        """Whether a stored document is still a file this caller may read (else it counts as missing)."""
        return self.inspect(path, within)[0] is not None

    @contextlib.contextmanager
    def open(self, checked: Checked, within: Path | str | None = None) -> Iterator[tuple[BinaryIO, os.stat_result]]:
        """Open the file ``checked`` resolved to and make sure it is that file: the last component
        is not followed if it became a link, the file opened must have the device and inode seen
        at the check, and (on Linux) the path the kernel says it has must pass the rules too, so a
        folder swapped for a link in between is caught. A 409 ``file_changed`` otherwise."""
        name = _name(checked.path)
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(checked.real, flags)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise sdk.LocalmError(409, f"{name} became a link after it was checked", code="file_changed") from None
            raise sdk.LocalmError(400, f"{name} cannot be read ({exc.strerror})", code="unreadable") from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (checked.dev, checked.ino) or not stat_mod.S_ISREG(st.st_mode):
                raise sdk.LocalmError(409, f"{name} changed after it was checked", code="file_changed")
            now = opened_path(fd)
            if now is not None:
                why = self.why_not(now, within)
                if why is not None:
                    raise sdk.LocalmError(409, f"{name} changed after it was checked: {why}", code="file_changed")
            fh = os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise
        with fh:
            yield fh, st


def opened_path(fd: int) -> Path | None:
    """The path the kernel holds for an open file (Linux's /proc/self/fd), or None where it cannot tell."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    if not target.startswith("/"):
        return None
    return Path(target.removesuffix(" (deleted)"))


def read_bounded(fh: BinaryIO, limit: int) -> bytes:
    """At most ``limit + 1`` bytes (one more than the limit tells that the file is over it)."""
    return fh.read(limit + 1)
