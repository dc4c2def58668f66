"""POST /v1/audio/speech, GET /v1/audio/voices and GET/POST /v1/tts/config."""

from __future__ import annotations

import asyncio
import typing
from typing import Any, AsyncIterator

import attrs
from localm import sdk

from .encode import FORMATS, Encoder
from .engine import Cancelled, Speech

MAX_INPUT = 4096
MAX_SEED = 4294967294
LANGUAGE_NAMES = {"english": "en", "german": "de", "french": "fr", "spanish": "es", "italian": "it",
                  "portuguese": "pt", "dutch": "nl", "polish": "pl", "russian": "ru", "ukrainian": "uk",
                  "chinese": "zh", "japanese": "ja", "korean": "ko", "arabic": "ar", "turkish": "tr"}
#: The end of a job's output.
_END = object()


def bad(message: str, field: str, status: int = 400) -> sdk.LocalmError:
    return sdk.LocalmError(status, message, code="invalid_request", param=field)


@attrs.frozen
class Asked:
    text: str
    model: str | None
    voice: str
    fmt: str
    speed: float
    seed: int | None
    stream: bool
    language: str | None


def read_body(body: Any) -> Asked:
    if not isinstance(body, dict):
        raise bad("The body must be a JSON object", "body")
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise bad("input is required: the text to speak (1 to 4096 characters)", "input")
    if len(text) > MAX_INPUT:
        raise bad(f"input is {len(text)} characters; at most {MAX_INPUT} are spoken in one request", "input")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    voice = body.get("voice", "default")
    if voice is None:
        voice = "default"
    if isinstance(voice, dict):  # OpenAI's {"id": "..."} form
        voice = voice.get("id")
    if not isinstance(voice, str) or not voice:
        raise bad("voice must be a voice name (default, or one GET /v1/audio/voices lists)", "voice")
    fmt = body.get("response_format") or "wav"
    if fmt not in FORMATS:
        raise bad(f"response_format {fmt!r} is not served: use one of {', '.join(FORMATS)}", "response_format")
    speed = body.get("speed", 1.0)
    if speed is None:
        speed = 1.0
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.25 <= speed <= 4.0:
        raise bad(f"speed must be a number from 0.25 to 4.0, got {speed!r}", "speed")
    instructions = body.get("instructions")
    if instructions not in (None, ""):
        raise bad("instructions are not followed by Piper voices (they would change the output): leave them out",
                  "instructions")
    stream_format = body.get("stream_format")
    if stream_format not in (None, "audio"):
        raise bad(f"stream_format {stream_format!r} is not served: send audio (audio streamed as it is spoken) "
                  "or leave it out (the whole file)", "stream_format")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise bad(f"seed must be an integer from 0 to {MAX_SEED}", "seed")
    language = body.get("language")
    if language is not None and not isinstance(language, str):
        raise bad("language must be a string such as en or english", "language")
    return Asked(text=text, model=model or None, voice=voice, fmt=fmt, speed=float(speed), seed=seed,
                 stream=stream_format == "audio", language=language or None)


def check_language(entry: Any, language: str | None) -> None:
    if language is None:
        return
    spoken = entry.capabilities.get("language") or entry.capabilities.get("voice") or ""
    code = LANGUAGE_NAMES.get(language.strip().lower(), language.strip().lower()).replace("_", "-")
    if not spoken or spoken.lower().replace("_", "-").split("-")[0] != code.split("-")[0]:
        raise bad(f"{entry.id} speaks {spoken or 'one language'}: language {language!r} is not spoken by it",
                  "language")


@sdk.post("/v1/audio/speech", scope="tts", access="inference", error_family="openai",
          summary="OpenAI speech: text to speech with Piper")
async def speech(request: sdk.Request) -> Any:
    speaker = sdk.service_of(request)
    plugin = sdk.plugin_of(request)
    host = sdk.host_of(request)
    if "json" not in request.headers.get("content-type", "application/json"):
        raise sdk.LocalmError(415, "The body must be JSON (Content-Type: application/json)",
                              code="unsupported_media_type")
    body = await sdk.json_body(request, require_object=False, missing="The body is not valid JSON",
                               refuse=lambda reason, message: bad(message, "body"))
    asked = read_body(body)
    entry = await speaker.resolve(asked.model)
    check_language(entry, asked.language)
    speaker_id, voice_file = speaker.voice(entry, asked.voice)
    speech_ = Speech(text=asked.text, speaker=speaker_id, voice_file=voice_file, speed=asked.speed, seed=asked.seed)
    queue: asyncio.Queue[Any] = asyncio.Queue()
    rate: list[int] = []

    async def work(job: sdk.JobContext) -> dict[str, Any]:
        seconds = [0.0]

        def emit(index: int, total: int, samples: Any) -> None:
            seconds[0] += len(samples) / rate[0]
            queue.put_nowait(samples)
            job.progress((index + 1) / max(total, 1), f"Spoke sentence {index + 1} of {total}",
                         sentences_done=index + 1, sentences=total)

        try:
            async with host.models.use(entry.id) as resident:
                engine = resident.engine
                rate.append(engine.rate_of(voice_file))
                queue.put_nowait(("rate", rate[0]))
                sentences = await engine.speak(speech_, emit)
        except BaseException as exc:
            queue.put_nowait(exc if isinstance(exc, Exception) else Cancelled())
            raise
        queue.put_nowait(_END)
        return {"model": entry.id, "sentences": sentences, "seconds": round(seconds[0], 3), "format": asked.fmt}

    job = plugin.start_job(work, kind="speak", title=f"Speak {len(asked.text)} characters with {entry.id}",
                           owner=sdk.caller(request).owner_tag)

    async def next_item() -> Any:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise _failure(item, entry)
        return item

    try:
        first = await next_item()
        encoder = Encoder(asked.fmt, first[1], streamed=asked.stream)
        headers = {"X-Localm-TTS-Model": entry.id, "X-Localm-Job": job.id,
                   "X-Localm-Sample-Rate": str(encoder.out_rate)}
        if asked.seed is not None:
            headers["X-Localm-Seed"] = f'{asked.seed};scope="request"'

        if asked.stream:
            async def chunks() -> AsyncIterator[bytes]:
                try:
                    while (item := await next_item()) is not _END:
                        if data := encoder.feed(item):
                            yield data
                    if data := encoder.finish():
                        yield data
                finally:
                    host.jobs.cancel(job)  # a no-op once the job has ended

            return sdk.Stream(chunks(), media_type=encoder.media_type, headers=headers)

        while (item := await next_item()) is not _END:
            encoder.feed(item)
    except asyncio.CancelledError:  # the client left: the kernel cancels an inference route's handler
        host.jobs.cancel(job)
        raise
    return sdk.Response(encoder.finish(), media_type=encoder.media_type, headers=headers)


def _failure(exc: BaseException, entry: Any) -> sdk.LocalmError:
    if isinstance(exc, sdk.LocalmError):
        if exc.code == "engine_missing":
            return sdk.LocalmError(501, exc.detail, code="speech_engine_missing")
        if exc.code in ("model_load_failed", "model_files_missing"):
            return sdk.LocalmError(503, exc.detail, code="speech_engine_unavailable")
        return exc
    if isinstance(exc, (Cancelled, asyncio.CancelledError)):
        return sdk.LocalmError(409, "The speech job was cancelled", code="cancelled")
    return sdk.LocalmError(502, f"{entry.id} failed to speak: {type(exc).__name__}", code="speech_failed")


@sdk.get("/v1/audio/voices", scope="tts", access="inference", expensive=False, error_family="openai",
         summary="The voices /v1/audio/speech speaks with")
async def voices(request: sdk.Request) -> dict[str, Any]:
    speaker = sdk.service_of(request)
    return {"object": "list", "data": [v for e in speaker.tts_models() for v in speaker.voices(e)]}


def _fields(plugin: Any, caller: Any) -> list[dict[str, Any]]:
    from . import Settings

    values = plugin.settings
    types = typing.get_type_hints(Settings)
    out = []
    for f in attrs.fields(Settings):
        meta = f.metadata.get("localm", {})
        if meta.get("owner_only") and not caller.is_owner:
            continue
        spec = sdk.FieldSpec(key=f.name, type=types[f.name], default=f.default, description=meta.get("description", ""),
                             label=meta.get("label"), owner_only=meta.get("owner_only", False),
                             choices=tuple(meta["choices"]) if meta.get("choices") else None,
                             min=meta.get("min"), max=meta.get("max"))
        out.append(spec.schema() | {"value": values.get(f.name)})
    return out


@sdk.get("/v1/tts/config", scope="config:read", summary="The tts plugin's settings with their values")
async def read_config(request: sdk.Request) -> dict[str, Any]:
    plugin = sdk.plugin_of(request)
    return {"plugin": plugin.name, "active": True, "fields": _fields(plugin, sdk.caller(request))}


@sdk.post("/v1/tts/config", scope="config:write", summary="Merge the tts plugin's settings (blank clears one)")
async def write_config(request: sdk.Request) -> dict[str, Any]:
    from . import Settings

    plugin = sdk.plugin_of(request)
    caller = sdk.caller(request)
    body = await sdk.json_body(request, empty={}, not_object="The body must be a JSON object of settings")
    known = {f.name: f for f in attrs.fields(Settings)}
    updates: dict[str, Any] = {}
    for key, value in body.items():
        if key not in known:
            raise sdk.LocalmError(400, f"Unknown setting for tts: {key} (one of {', '.join(known)})")
        if known[key].metadata.get("localm", {}).get("owner_only") and not caller.is_owner:
            raise sdk.LocalmError(403, f"{key} is owner-only: it needs an admin key")
        updates[key] = None if value is None or value == "" else value
    plugin.save_settings(updates)
    return {"plugin": plugin.name, "active": True, "fields": _fields(plugin, caller)}


HANDLERS = [speech, voices, read_config, write_config]
