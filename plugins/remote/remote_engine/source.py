"""The ``openai+http`` and ``openai+https`` pull sources: a model another server answers,
registered by ``localm pull`` (``register_model_providers``).

The source is ``openai+http://host:port/v1#model`` (or ``https``): an OpenAI-compatible
server (vLLM, SGLang, llama.cpp's llama-server, llama-cpp-python's server) and the model id it
serves. An API key, when the upstream wants one, goes in the URL's password
(``openai+http://:KEY@host:port/v1#model``); it is stored apart from the registry, in the remote
plugin's data folder (``plugin-data/remote/keys.json``, readable by the owner only), and never
appears in the registry, the model's source or an error message.

Pulling asks the upstream's ``/v1/models`` for the model and records what it reports: its context
window (vLLM's and SGLang's ``max_model_len``, llama-server's ``/props`` window or
``meta.n_ctx_train``), and which kind of server it is. The ``remote`` engine (this plugin's
``__init__``) serves the model. ``?tokenizer=NAME`` in the URL (a registered GGUF model, a .gguf file or a
tokenizer.json) names a tokenizer on this machine that counts the model's tokens where the
upstream has no tokenize endpoint.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable

from localm import sdk
from localm.sdk import LocalmError

#: The keys, by source, in this plugin's data folder (readable by the owner only).
KEYS_FILE = "keys.json"


def parse_source(source: str) -> tuple[str, str, str | None]:
    """(base URL without the key, upstream model id, key or None) of a remote source."""
    raw = source.split("+", 1)[1]
    url, _, model = raw.partition("#")
    model = urllib.parse.unquote(model).strip()
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LocalmError(400, "A remote model is openai+http://host:port/v1#model (the upstream's OpenAI base URL "
                               "and its model id)")
    if not model:
        raise LocalmError(400, "A remote model needs the upstream's model id after '#': "
                               "openai+http://host:port/v1#model")
    key = urllib.parse.unquote(parts.password) if parts.password else None
    if key is None and parts.username and not parts.password:
        key = urllib.parse.unquote(parts.username)  # openai+http://KEY@host/v1
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    base = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
    return base, model, key


def tokenizer_of(source: str) -> str | None:
    """The local tokenizer a remote source names in its URL's query (``?tokenizer=NAME``: a
    registered GGUF model, a .gguf file or a tokenizer.json), or None."""
    url = source.split("+", 1)[1].partition("#")[0]
    found = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query).get("tokenizer")
    return found[0].strip() or None if found else None


def _tokenizer_path(registry: Any, name: str) -> str:
    """The file a ``?tokenizer=`` names: a registered GGUF model's, or a .gguf file or a
    tokenizer.json (or a folder holding one) on this machine."""
    entry = registry.find(name)
    if entry is not None and entry.type == "gguf" and Path(entry.path).is_file():
        return str(Path(entry.path).resolve())
    path = Path(name).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if path.is_file() and (path.suffix == ".gguf" or path.name.endswith("tokenizer.json")):
        return str(path.resolve())
    raise LocalmError(400, f"tokenizer={name}: not a registered GGUF model, a .gguf file or a tokenizer.json",
                      code="invalid_tokenizer")


def store_key(data_dir: Path, model: str, key: str | None) -> None:
    """Keep (or, with None, forget) the key of a remote source (``openai+URL#model``, without the
    key), in a file only the owner reads. ``data_dir`` is this plugin's data folder."""
    path = Path(data_dir) / KEYS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        keys = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        keys = {}
    if not isinstance(keys, dict):
        keys = {}
    if key is None:
        if model not in keys:
            return
        keys.pop(model)
    else:
        keys[model] = key
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(keys, fh)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _window_of(item: dict[str, Any]) -> int | None:
    for key in ("max_model_len", "context_length", "context_window", "max_context_length"):
        value = item.get(key)
        if isinstance(value, int) and value > 0:
            return value
    meta = item.get("meta")
    if isinstance(meta, dict) and isinstance(meta.get("n_ctx_train"), int):
        return meta["n_ctx_train"]
    return None


def _kind_of(listing: dict[str, Any], item: dict[str, Any]) -> str:
    owner = str(item.get("owned_by", "")).lower()
    if "meta" in item or owner == "llamacpp" or "models" in listing:
        return "llama-server"
    if owner == "vllm" or "max_model_len" in item:
        return "vllm"
    if owner == "sglang":
        return "sglang"
    if owner == "me" and "permissions" in item:
        return "llama-cpp-python"
    return "openai"


def probe(base: str, model: str, key: str | None, *, timeout: float = 10.0) -> dict[str, Any]:
    """What the upstream reports of ``model``: {"upstream_kind", "context_window"?, "n_ctx_train"?}.
    Raises LocalmError: 502 unreachable (named without its key), 504 no answer in time, the upstream's
    own status when it refuses, 404 when it serves no such model."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(timeout=timeout, headers=headers) as client:
            answer = client.get(f"{base}/models")
            if answer.status_code >= 400:
                raise LocalmError(502 if answer.status_code >= 500 else answer.status_code,
                                  f"The upstream {base} answered {answer.status_code} to GET /models: "
                                  f"{answer.text[:200]}", code="upstream_error")
            listing = answer.json()
            items = listing.get("data") if isinstance(listing, dict) else None
            if not isinstance(items, list):
                raise LocalmError(502, f"The upstream {base} did not answer GET /models with a model list",
                                  code="upstream_error")
            item = next((i for i in items if isinstance(i, dict) and i.get("id") == model), None)
            if item is None:
                names = ", ".join(str(i.get("id")) for i in items if isinstance(i, dict))[:300]
                if len(items) == 1 and isinstance(items[0], dict) and items[0].get("id"):
                    item = items[0]  # a one-model server: the name is the registry's, the id the upstream's
                else:
                    raise LocalmError(404, f"The upstream {base} serves no model {model} (it serves: {names})",
                                      code="model_not_found")
            out: dict[str, Any] = {"upstream_kind": _kind_of(listing, item), "upstream_model": str(item["id"])}
            window = _window_of(item)
            meta = item.get("meta")
            if isinstance(meta, dict) and isinstance(meta.get("n_ctx"), int) and meta["n_ctx"] > 0:
                window = meta["n_ctx"]  # llama-server: the window each slot serves
            if isinstance(item.get("meta"), dict) and isinstance(item["meta"].get("n_ctx_train"), int):
                out["n_ctx_train"] = item["meta"]["n_ctx_train"]
            if out["upstream_kind"] == "llama-server" and not (isinstance(meta, dict) and meta.get("n_ctx")):
                root = base[:-3] if base.endswith("/v1") else base
                try:
                    props = client.get(f"{root}/props").json()
                    n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
                    if isinstance(n_ctx, int) and n_ctx > 0:
                        window = n_ctx
                except (httpx.HTTPError, ValueError, AttributeError):
                    pass
            if window:
                out["context_window"] = window
            return out
    except httpx.ConnectError:
        raise LocalmError(502, f"Cannot reach the upstream {base}: the connection was refused",
                          code="upstream_unreachable") from None
    except httpx.TimeoutException:
        raise LocalmError(504, f"The upstream {base} did not answer in {timeout:g} s", code="upstream_timeout") from None
    except httpx.HTTPError as exc:
        raise LocalmError(502, f"The upstream {base} failed: {type(exc).__name__}", code="upstream_error") from None
    except ValueError:
        raise LocalmError(502, f"The upstream {base} did not answer GET /models with JSON",
                          code="upstream_error") from None


def pull_remote(registry: Any, source: str, data_dir: Path, *, name: str | None = None,
                log: Callable[[str], None] = lambda s: None) -> Any:
    """Register a remote model; its key (if any) is kept apart, owner-only, in ``data_dir``."""
    base, model, key = parse_source(source)
    named = tokenizer_of(source)
    tokenizer = _tokenizer_path(registry, named) if named else None  # refused before the upstream is asked
    log(f"Asking {base} about {model}")
    found = probe(base, model, key)
    new_id = sdk.model_id(name, named=True) if name else sdk.model_id(model.rsplit("/", 1)[-1])
    caps = {"upstream": base, **found, **({"tokenizer": tokenizer} if tokenizer else {})}
    entry = sdk.ModelEntry(id=new_id, path=base, source=f"openai+{base}#{model}", type="remote", role="chat",
                       capabilities=caps, created=time.time(), engine="remote")
    existing = registry.find(entry.id)
    replace = existing is not None and existing.type == "remote"
    added = registry.add(entry, replace=replace)
    store_key(data_dir, added.source, key)  # by source: a copy or a rename keeps it
    return added


#: base URL → (checked at, reachable): GET /v1/models asks each upstream at most once a few seconds.
_REACHABLE: dict[str, tuple[float, bool]] = {}


async def reachable(bases: list[str], *, timeout: float = 1.0, fresh_for: float = 2.0) -> dict[str, bool]:
    """Whether each upstream answers HTTP now (any status: a 401 is an upstream that answers),
    asked at once, each within ``timeout`` seconds; a recent answer is reused."""
    import asyncio

    import httpx

    now = time.monotonic()
    out = {b: _REACHABLE[b][1] for b in bases if b in _REACHABLE and now - _REACHABLE[b][0] < fresh_for}
    ask = sorted(set(bases) - set(out))
    if ask:
        async with httpx.AsyncClient(timeout=timeout) as client:
            async def one(base: str) -> bool:
                try:
                    await client.get(f"{base}/models")
                    return True
                except httpx.HTTPError:
                    return False
            answers = await asyncio.gather(*(one(b) for b in ask))
        for base, ok in zip(ask, answers):
            _REACHABLE[base] = (time.monotonic(), ok)
            out[base] = ok
    return out


async def describe(entries: list[Any]) -> dict[str, dict[str, Any]]:
    """GET /v1/models: each remote model's upstream, and whether it answers now."""
    answers = await reachable([e.path for e in entries])
    return {e.id: {"remote": {"upstream": e.path, "reachable": answers[e.path]}} for e in entries}
