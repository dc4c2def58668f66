"""Spoken questions in any chat: the ``chat_inlet`` hook.

An ``input_audio`` content part (``{"type": "input_audio", "input_audio": {"data":
"<base64>", "format": "wav"}}``, on /v1/chat/completions and on the Responses route, which
translates its own) sent to a model that cannot hear is transcribed by Whisper, and the
transcript takes the part's place as text: the model answers what was said. The response
says so in ``X-Localm-Transcribed-Audio``; a streamed one also gets a ``transcribing``
status. A model that hears audio (``audio_input`` in the registry) gets the clip as sent.
Each clip must be 0.1 seconds to 10 minutes long, as for a model that hears, and the clips
of one request 30 minutes in all: a clip's length is checked by its header before it is
decoded and while it is (audio.py), so a small clip that would decode to hours is refused
(400) without being decoded.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from localm import sdk

from .engine import Options

#: An encoded clip in a chat may be this large (base64 decoded), as for models that hear.
MAX_CHAT_AUDIO = 50 * 1024 * 1024
#: And this long, in seconds, as for models that hear (the spec's 0.1 seconds to 10 minutes):
#: checked by its header before it is decoded, and while it is.
MIN_CHAT_SECONDS = 0.1
MAX_CHAT_SECONDS = 600.0
#: The clips of one request together: a conversation resends its earlier clips with every
#: turn, but one request is never more than this much transcription.
MAX_CHAT_TOTAL_SECONDS = 1800.0


def audio_parts(messages: Any) -> list[tuple[int, int]]:
    """(message index, part index) of every input_audio part."""
    if not isinstance(messages, list):
        return []
    return [(i, j) for i, m in enumerate(messages) if isinstance(m, dict) and isinstance(m.get("content"), list)
            for j, p in enumerate(m["content"]) if isinstance(p, dict) and p.get("type") == "input_audio"]


def hears(host: Any, model: Any, pin_model: Any = None) -> bool:
    """Whether a model that takes audio itself will answer: the one the request names (an
    unknown one is left to chat), or, for a request the chat service may route (no model
    named, or ``pin_model: false``), any installed chat model that hears."""
    try:
        entry = host.models.resolve(model if isinstance(model, str) else None)
    except sdk.LocalmError:
        return True  # chat refuses the unknown model as it would without audio
    if entry.capabilities.get("audio_input"):
        return True
    named = isinstance(model, str) and model not in ("", "localm")
    pinned = pin_model if isinstance(pin_model, bool) else named
    return not pinned and any(e.role == "chat" and e.capabilities.get("audio_input") for e in host.models.entries())


def clip(part: dict[str, Any], where: str) -> bytes:
    audio = part.get("input_audio")
    data = audio.get("data") if isinstance(audio, dict) else None
    if not isinstance(data, str) or not data:
        raise sdk.LocalmError(400, f"{where}.input_audio must be an object with data (base64) and format",
                              code="invalid_audio")
    if data.startswith("data:"):
        data = data.partition(",")[2]
    if len(data) * 3 // 4 > MAX_CHAT_AUDIO:
        raise sdk.LocalmError(400, f"{where}: the clip is larger than the {MAX_CHAT_AUDIO // (1024 * 1024)} MB "
                                   "a chat's audio may be", code="invalid_audio")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise sdk.LocalmError(400, f"{where}.input_audio.data is not valid base64", code="invalid_audio") from None


async def transcribe(voice: Any, data: bytes, entry: Any, where: str, left: float) -> Any:
    """Transcribe one clip of a chat, 0.1 seconds to 10 minutes long and no longer than the
    ``left`` seconds of the request's 30 minutes (else a 400 saying why)."""
    from .audio import TooLong, TooShort, span

    allowed = f"audio in a chat must be {span(MIN_CHAT_SECONDS)} to {span(MAX_CHAT_SECONDS)} long"
    limit = max(0.0, min(MAX_CHAT_SECONDS, left))
    try:
        _, transcript = await voice.hear(data, Options(max_seconds=limit, min_seconds=MIN_CHAT_SECONDS), entry=entry)
    except TooLong as exc:
        if limit < MAX_CHAT_SECONDS and (exc.seconds is None or exc.seconds <= MAX_CHAT_SECONDS):
            raise sdk.LocalmError(400, f"{where}: the audio of this request passes {span(MAX_CHAT_TOTAL_SECONDS)} "
                                       "in all, the most one chat request may carry (send the transcript of earlier "
                                       "clips instead)", code="audio_too_long", param=where) from None
        raise sdk.LocalmError(400, f"{where}: the audio is {exc.length()}; {allowed}", code="audio_too_long",
                              param=where) from None
    except TooShort as exc:
        raise sdk.LocalmError(400, f"{where}: the audio is {span(exc.seconds)} long; {allowed}",
                              code="audio_too_short", param=where) from None
    return transcript


async def inlet(voice: Any, request: dict[str, Any], context: Any) -> dict[str, Any] | None:
    found = audio_parts(request.get("messages"))
    if not found or not voice.settings.get("chat_audio", True) or hears(context.host, request.get("model"), request.get("pin_model")):
        return None
    caller = context.caller
    # transcription is inference: open to open mode's callers, a web page's included, as the
    # transcription route is; a key needs the voice scope
    if caller is not None and caller.kind not in ("open", "web") and not caller.has("voice"):
        raise sdk.LocalmError(403, "Audio in a chat is transcribed by the voice plugin, which needs the voice scope",
                              code="missing_scope")
    entry = await voice.resolve(None)
    context.status("transcribing", f"Transcribing {len(found)} audio clip{'s' * (len(found) > 1)}")
    messages = [dict(m) if isinstance(m, dict) else m for m in request["messages"]]
    # every clip's base64 is read before any is transcribed
    clips = {(i, j): clip(messages[i]["content"][j], f"messages[{i}].content[{j}]") for i, j in found}
    seconds = 0.0
    for i, j in found:
        where = f"messages[{i}].content[{j}]"
        content = messages[i]["content"] = list(messages[i]["content"])
        transcript = await transcribe(voice, clips.pop((i, j)), entry, where, MAX_CHAT_TOTAL_SECONDS - seconds)
        seconds += transcript.duration
        content[j] = {"type": "text", "text": transcript.text}
    context.header("X-Localm-Transcribed-Audio", f'parts={len(found)}; seconds={seconds:.1f}; model="{entry.id}"')
    return {**request, "messages": messages}
