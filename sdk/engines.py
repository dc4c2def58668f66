"""The engine hook spec, for plugins that provide or use inference engines."""

from localm.kernel.constrain import (
    LOGPROB_FLOOR,
    Constrainer,
    TokenMasker,
    logprob_entry,
    safe_logprob,
)
from localm.kernel.engines import (
    ActivationRead,
    Capabilities,
    Constraint,
    Engine,
    EngineError,
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Intervention,
    Queued,
    Ranked,
    Sampling,
    Serial,
    Started,
    Token,
)

__all__ = ["LOGPROB_FLOOR", "ActivationRead", "Capabilities", "Constrainer", "Constraint", "Engine", "EngineError",
           "Event", "Finished", "FinishReason", "GenerateRequest", "Intervention", "Queued", "Ranked", "Sampling",
           "Serial", "Started", "Token", "TokenMasker", "logprob_entry", "safe_logprob"]
