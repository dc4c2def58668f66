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
    Batched,
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
    Job,
    Queued,
    Ranked,
    Sampling,
    Serial,
    Started,
    Status,
    Token,
    Turns,
    steering_of,
)

__all__ = ["LOGPROB_FLOOR", "ActivationRead", "Batched", "Capabilities", "ChatInput", "Constrainer", "Constraint",
           "Engine", "EngineError", "Event", "Finished", "FinishReason", "GenerateRequest", "Intervention", "Job", "Queued", "Ranked", "Sampling",
           "Serial", "Started", "Status", "Token", "TokenMasker", "Turns", "logprob_entry", "safe_logprob",
           "steering_of"]
