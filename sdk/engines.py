"""The engine hook spec, for plugins that provide or use inference engines."""

from localm.kernel.engines import (
    Capabilities,
    Engine,
    EngineError,
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Queued,
    Sampling,
    Serial,
    Started,
    Token,
)

__all__ = ["Capabilities", "Engine", "EngineError", "Event", "Finished", "FinishReason", "GenerateRequest",
           "Queued", "Sampling", "Serial", "Started", "Token"]
