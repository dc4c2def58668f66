"""LoRA adapters on a llama.cpp model: the registry entry's ``adapters`` (``localm pull MODEL
--lora ADAPTER[:SCALE]``, or an Ollama Modelfile's ADAPTER line), each ``{"name", "path",
"scale"}``, applied for as long as the model is loaded.

llama.cpp keeps an adapter beside the model's weights (``llama_adapter_lora_init``: its
tensors are read into memory of their own; the weights are not changed, so the model file
stays memory-mapped) and adds ``scale * alpha / rank * B(A x)`` to the output of each matrix
it adapts in every graph a context builds (``llama_set_adapters_lora``). An adapter belongs
to one model and is set on each context: the engine opens new contexts as its window grows
and for probes (``_new_context``), so each gets them as it opens (``apply``). A scale of 0
leaves the adapter out of the graph altogether (llama.cpp drops it): the model's own numbers.

The adapters are fixed for the engine's life. A per-request choice is not offered: the
engine decodes the requests of its slots in one batch on one context, and an adapter is the
context's, so one request's adapter would change what the others compute; a model with
other adapters is another registry entry, loaded beside it (its own weights and context).

Freeing: ``close`` frees them (``llama_adapter_lora_free``) after the contexts that use them
are closed and before their model is; an adapter not freed by hand is freed with its model
(llama.h), so a load that fails part-way leaks nothing.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
from pathlib import Path
from typing import Any, Sequence

from localm.sdk import engines as spec
from localm.sdk.gguf import GGUFError, metadata

log = logging.getLogger("localm.plugin.llamacpp")


def _check(name: str, path: Path, scale: Any, architecture: str) -> float:
    """The adapter file's header, as llama.cpp will read it, checked with a clear reason (its own
    loader only logs one); the scale as a float."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise spec.EngineError(f"The LoRA adapter {name}'s scale must be a finite number, got {scale!r}",
                               code="bad_adapter")
    if not path.is_file():
        raise spec.EngineError(f"The LoRA adapter {name}'s file {path.name} does not exist", code="bad_adapter")
    try:
        meta = metadata(path)
    except (OSError, GGUFError, ValueError) as exc:
        raise spec.EngineError(f"The LoRA adapter {name} ({path.name}) cannot be read: {exc}",
                               code="bad_adapter") from exc
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise spec.EngineError(f"{path.name} (the adapter {name}) is not a LoRA adapter", code="bad_adapter")
    if "adapter.alora.invocation_tokens" in meta:
        raise spec.EngineError(f"{path.name} (the adapter {name}) is an activated LoRA (aLoRA): localm applies "
                               "plain LoRA adapters only", code="bad_adapter")
    if meta.get("general.architecture") != architecture:
        raise spec.EngineError(f"The LoRA adapter {name} is for {meta.get('general.architecture') or 'unnamed'} "
                               f"models; this model's architecture is {architecture}", code="bad_adapter")
    return float(scale)


class Adapters:
    """The LoRA adapters of one llama.cpp model (a ``llama_model`` pointer), opened from
    ``wanted`` (the entry's ``{"name", "path", "scale"}`` dicts) in order. Empty: nothing to do."""

    def __init__(self, model: Any, wanted: Sequence[dict[str, Any]], architecture: str) -> None:
        import llama_cpp
        self._llama = llama_cpp
        self._model = model
        self.applied: list[dict[str, Any]] = []  # {"name", "path", "scale"} each, as opened
        self._handles: list[Any] = []
        self._identity: list[dict[str, Any]] = []
        for item in wanted:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item.get("path"):
                raise spec.EngineError(f"A LoRA adapter must have a name and a path, got {item!r}",
                                       code="bad_adapter")
            name, path = item["name"], Path(str(item["path"]))
            scale = _check(name, path, item.get("scale", 1.0), architecture)
            handle = llama_cpp.llama_adapter_lora_init(model, str(path).encode("utf-8"))
            if not handle:
                raise spec.EngineError(f"llama.cpp could not apply the LoRA adapter {name} ({path.name}) to this "
                                       "model: its tensors do not match the model's (an adapter for another "
                                       "model of the same architecture?)", code="bad_adapter")
            self._handles.append(handle)
            self.applied.append({"name": name, "path": str(path), "scale": scale})
            stat = os.stat(path)
            self._identity.append({"name": name, "file": path.name, "size": stat.st_size,
                                   "mtime": stat.st_mtime_ns, "scale": scale})
        self._array = (llama_cpp.llama_adapter_lora_p_ctypes * len(self._handles))(*self._handles)
        self._scales = (ctypes.c_float * len(self._handles))(*(a["scale"] for a in self.applied))

    def __bool__(self) -> bool:
        return bool(self._handles)

    @property
    def identity(self) -> list[dict[str, Any]]:
        """What a persisted prompt-cache state computed with these adapters was computed with."""
        return [dict(item) for item in self._identity]

    @property
    def public(self) -> list[dict[str, Any]]:
        """The adapters as a load reports them: name, scale and the file's name (no directory)."""
        return [{"name": a["name"], "scale": a["scale"], "path": Path(a["path"]).name} for a in self.applied]

    def apply(self, ctx: Any) -> None:
        """Set the adapters on the context ``ctx`` (a ``llama_context`` pointer) of this model."""
        if not self._handles:
            return
        status = self._llama.llama_set_adapters_lora(ctx, self._array, len(self._handles), self._scales)
        if status != 0:
            raise RuntimeError(f"llama.cpp could not set the LoRA adapters (status {status})")

    def clear(self, ctx: Any) -> None:
        """Take the adapters off ``ctx`` (before they are freed while it stays open)."""
        if self._handles:
            self._llama.llama_set_adapters_lora(ctx, None, 0, None)

    def close(self) -> None:
        """Free the adapters: after the contexts that use them are closed (or cleared) and before
        the model is (an adapter outliving its model was freed with it)."""
        handles, self._handles = self._handles, []
        for handle in handles:
            self._llama.llama_adapter_lora_free(handle)


def attach(llm: Any, wanted: Sequence[dict[str, Any]]) -> Adapters:
    """Open ``wanted`` on a ``llama_cpp.Llama`` and set them on its context (the engine's
    second, embedding context); they are freed with its model."""
    adapters = Adapters(llm._model.model, wanted, llm.metadata.get("general.architecture", ""))
    adapters.apply(llm._ctx.ctx)
    return adapters
