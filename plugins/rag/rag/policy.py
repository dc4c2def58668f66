"""What a caller may index: the denied-outright rules, the allowed folders, a key's rag_roots.

- Refused outright, for everyone: a dotfile or anything under a dot folder (``.ssh``,
  ``.gnupg``, ``.env``...), key material (private keys, keystores, credential files), the
  localm data directory itself, and the ``denied_roots`` setting.
- A key minted with ``rag_roots`` may add only inside those folders (403 elsewhere), and may
  only read or change collections whose documents all lie inside them.
- Otherwise the owner may add inside ``allowed_roots`` (the home folder when unset); outside
  them ``indexing_mode`` decides: ``ask`` (409 ``needs_consent``, re-POST with
  ``"consent": true``), ``strict`` (403), ``open`` (allowed). Any other key gets a 403
  outside the allowed folders.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import Any, Iterable

from localm import sdk

#: File names that hold secrets, whatever folder they are in.
KEY_MATERIAL = ("*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore", "*.kdbx", "*.gpg", "*.asc",
                "*.ppk", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "*.ovpn", "credentials",
                "credentials.json", "secrets.json", "secrets.yaml", "secrets.yml", "*.secret", "owner_key.json",
                "keys.json", "known_hosts", "authorized_keys", "htpasswd", "*.htpasswd", "shadow", "gshadow")


def real(path: str | os.PathLike[str]) -> Path:
    """The path resolved (links followed); a 400 for text no file can be named by (a NUL)."""
    text = str(path)
    if "\0" in text:
        raise sdk.LocalmError(400, "A path cannot hold a NUL character", code="invalid_path")
    return Path(os.path.realpath(os.path.expanduser(text)))


def inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def denied(path: Path, *, data_dir: Path, denied_roots: Iterable[str]) -> str | None:
    """Why ``path`` (resolved) may never be indexed, or None."""
    if any(part.startswith(".") and part not in (".", "..") for part in path.parts):
        return "dotfiles and dot folders are never indexed"
    if any(fnmatch.fnmatch(path.name.lower(), pattern) for pattern in KEY_MATERIAL):
        return "key material is never indexed"
    data = real(data_dir)
    if inside(path, data) or inside(data, path):
        return "the localm data directory is never indexed"
    for root in denied_roots:
        if root and inside(path, real(root)):
            return "the folder is in denied_roots"
    return None


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
    """Refuse what this caller may not add (400, 403 or the owner's 409 needs_consent)."""
    for path in paths:
        why = denied(path, data_dir=data_dir, denied_roots=settings.get("denied_roots") or [])
        if why is not None:
            raise sdk.LocalmError(400, f"{path.name or path}: {why}", code="path_denied")
    confined = key_roots(caller)
    if confined is not None:
        outside = [p for p in paths if not any(inside(p, r) for r in confined)]
        if outside:
            raise sdk.LocalmError(403, f"{outside[0]} is outside this key's rag_roots", code="outside_rag_roots")
        return
    allowed = allowed_roots(settings)
    outside = [p for p in paths if not any(inside(p, r) for r in allowed)]
    if not outside:
        return
    mode = settings.get("indexing_mode", "ask")
    if not is_owner(caller):
        raise sdk.LocalmError(403, f"{outside[0]} is outside the folders this server allows indexing",
                              code="outside_allowed")
    if mode == "open" or (mode == "ask" and consent):
        return
    if mode == "strict":
        raise sdk.LocalmError(403, f"{outside[0]} is outside allowed_roots, and indexing_mode is strict",
                              code="outside_allowed")
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
