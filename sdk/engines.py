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
    ChatInput,
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
    Status,
    Token,
)

__all__ = ["LOGPROB_FLOOR", "ActivationRead", "Capabilities", "ChatInput", "Constrainer", "Constraint", "Engine", "EngineError",
           "Event", "Finished", "FinishReason", "GenerateRequest", "Intervention", "Queued", "Ranked", "Sampling",
           "Serial", "Started", "Status", "Token", "TokenMasker", "logprob_entry", "safe_logprob"]
