"""POST /v1/audio/transcriptions: OpenAI's transcription route, answered by Whisper."""

from __future__ import annotations

import attrs
from localm import sdk

from . import formats
from .engine import Options
from .upload import MAX_BODY, read_form

#: Fields that change the output and are not implemented: sending them is a 400.
REFUSED = ("stream", "include[]", "include", "chunking_strategy", "known_speaker_names[]",
           "known_speaker_references[]", "known_speaker_names", "known_speaker_references")
GRANULARITIES = ("segment", "word")


def bad(message: str, field: str) -> sdk.LocalmError:
    return sdk.LocalmError(400, message, code="invalid_request", param=field)


def one(fields: dict[str, list[str]], key: str) -> str | None:
    values = fields.get(key)
    if not values:
        return None
    if len(values) > 1:
        raise bad(f"{key} is sent {len(values)} times; send it once", key)
    return values[0]


def read_options(fields: dict[str, list[str]]) -> tuple[str, set[str], Options, str | None]:
    """(response_format, timestamp granularities, options without language, model)."""
    for key in REFUSED:
        if key in fields:
            if key == "stream" and fields[key] == ["false"]:
                continue
            name = key.removesuffix("[]")
            raise bad(f"{name} is not implemented here (it would change the output): leave it out", name)
    fmt = one(fields, "response_format") or "json"
    if fmt not in formats.FORMATS:
        raise bad(f"response_format {fmt!r} is not one of {', '.join(formats.FORMATS)}", "response_format")
    temperature = None
    raw = one(fields, "temperature")
    if raw not in (None, ""):
        try:
            temperature = float(raw)
        except ValueError:
            raise bad(f"temperature must be a number from 0 to 1, got {raw!r}", "temperature") from None
        if not 0.0 <= temperature <= 1.0:
            raise bad(f"temperature must be from 0 to 1, got {raw}", "temperature")
    wanted = set(fields.get("timestamp_granularities[]", []) + fields.get("timestamp_granularities", []))
    unknown = sorted(wanted - set(GRANULARITIES))
    if unknown:
        raise bad(f"timestamp_granularities holds {unknown[0]!r}: use segment and/or word", "timestamp_granularities")
    if wanted and fmt != "verbose_json":
        raise bad("timestamp_granularities needs response_format verbose_json", "timestamp_granularities")
    options = Options(prompt=one(fields, "prompt") or None, temperature=temperature, words="word" in wanted)
    return fmt, wanted, options, one(fields, "model") or None


@sdk.post("/v1/audio/transcriptions", scope="voice", access="inference", error_family="openai",
          request_max_body_size=2 * MAX_BODY, summary="OpenAI transcriptions: speech to text with Whisper")
async def transcriptions(request: sdk.Request) -> sdk.Response:
    voice = sdk.service_of(request)
    form = await read_form(request)
    fmt, granularities, options, model = read_options(form.fields)
    if form.file is None:
        raise bad("file is required: the audio, as a multipart file field", "file")
    entry = await voice.resolve(model)
    options = attrs.evolve(options, language=voice.check_language(entry, one(form.fields, "language")))
    # a client that leaves cancels this handler (the kernel does, on an inference route): the
    # transcription leaves the engine's queue, or stops at its next segment
    entry, transcript = await voice.transcribe(form.file, options, entry=entry)
    headers = {"X-Localm-Transcription-Model": entry.id}
    if fmt == "json":
        return sdk.Response({"text": transcript.text, "usage": formats.usage(transcript)}, headers=headers)
    if fmt == "verbose_json":
        return sdk.Response(formats.verbose(transcript, granularities), headers=headers)
    text = {"text": transcript.text, "srt": formats.srt(transcript),
            "vtt": formats.vtt(transcript)}[fmt]
    return sdk.Response(text, media_type="text/plain; charset=utf-8", headers=headers)


HANDLERS = [transcriptions]
