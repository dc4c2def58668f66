"""The engine hook spec, for plugins that provide or use inference engines: the kernel's
protocols and events, and what engines share beside them (constrained output and log
probabilities from :mod:`.constrain`, the request queues from :mod:`.scheduling`)."""

import os

from localm.kernel.engines import (
    ActivationRead,
    Capabilities,
    ChatEngine,
    ChatInput,
    Constraint,
    EmbeddingEngine,
    Engine,
    EngineError,
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Intervention,
    LoadedModel,
    Media,
    MediaEngine,
    MediaSpan,
    Placement,
    Queued,
    Ranked,
    RerankEngine,
    Sampling,
    SpeechToTextEngine,
    Started,
    Status,
    Stop,
    TextToSpeechEngine,
    Token,
    placement_of,
    steering_of,
    vram_of,
)

from .constrain import LOGPROB_FLOOR, Constrainer, TokenMasker, logprob_entry, safe_logprob
from .scheduling import Batched, Job, Serial, Turns

__all__ = ["LOGPROB_FLOOR", "ActivationRead", "Batched", "Capabilities", "ChatEngine", "ChatInput", "Constrainer",
           "Constraint", "EmbeddingEngine", "Engine", "EngineError", "LoadedModel", "Media", "MediaEngine", "MediaSpan",
           "Placement", "RerankEngine",
           "SpeechToTextEngine", "TextToSpeechEngine", "Event", "Finished", "FinishReason", "GenerateRequest", "Intervention", "Job", "Queued", "Ranked", "Sampling",
           "Serial", "Started", "Status", "Stop", "Token", "TokenMasker", "Turns", "logprob_entry", "placement_of", "safe_logprob",
           "steering_of", "usable_cores", "vram_of"]


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: what ``taskset``, a cpuset or a
    container's CPU pinning leaves it), the default an engine sizes its thread pool by. More
    threads than that wait on each other (a spinning thread pool loses whole scheduler slices)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
