"""Where a GGUF model's layers go: the GPUs llama.cpp can offload to, how many layers fit,
and the memory reading a load and an unload report.

llama.cpp counts a model's layers as its blocks plus the output layer (its "offloaded 31/31
layers to GPU"), and so does localm: ``gpu_layers_total`` is ``block_count + 1``. With
``n_gpu_layers`` -1 (the default) every layer goes to the GPU when the free memory holds the
model and its context, else as many as the estimate says fit; a load that fails anyway is
tried again with fewer layers (down to none), and says so (``degraded``). A build of
llama.cpp without GPU support, or a machine without a GPU, runs on the CPU and says only that.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

import attrs

log = logging.getLogger("localm.plugin.llamacpp")

#: ggml's device types (ggml-backend.h): memory of its own (GPU) or the host's (IGPU)
_GPU, _IGPU = 1, 2
#: what a load keeps on the GPU beside the layers and the KV cache (compute buffers, scratch)
OVERHEAD_BYTES = 512 * 2**20


@attrs.frozen
class Device:
    index: int
    name: str
    free: int
    total: int


class _Devices:
    """The ggml backend devices llama-cpp-python's libggml reports."""

    def __init__(self) -> None:
        from llama_cpp import _ggml
        lib = _ggml.libggml
        self.count = lib.ggml_backend_dev_count
        self.count.argtypes, self.count.restype = [], ctypes.c_size_t
        self.get = lib.ggml_backend_dev_get
        self.get.argtypes, self.get.restype = [ctypes.c_size_t], ctypes.c_void_p
        self.type = lib.ggml_backend_dev_type
        self.type.argtypes, self.type.restype = [ctypes.c_void_p], ctypes.c_int
        self.name = lib.ggml_backend_dev_name
        self.name.argtypes, self.name.restype = [ctypes.c_void_p], ctypes.c_char_p
        self.memory = lib.ggml_backend_dev_memory
        self.memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
        self.memory.restype = None

    def gpus(self) -> list[Device]:
        out = []
        for i in range(int(self.count())):
            dev = self.get(i)
            if not dev or self.type(dev) not in (_GPU, _IGPU):
                continue
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            self.memory(dev, ctypes.byref(free), ctypes.byref(total))
            out.append(Device(len(out), (self.name(dev) or b"gpu").decode(errors="replace"),
                              int(free.value), int(total.value)))
        return out


_devices: _Devices | None = None


def gpus() -> list[Device]:
    """The GPUs llama.cpp can offload to now, with their free memory (none when the build has
    no GPU backend or the machine no GPU)."""
    global _devices
    try:
        import llama_cpp
        if not llama_cpp.llama_supports_gpu_offload():
            return []
        if _devices is None:
            _devices = _Devices()
        return _devices.gpus()
    except Exception as exc:  # an old libggml without the device API: no reading, CPU placement
        log.debug("no GPU device reading: %s", exc)
        return []


def vram(devices: list[int] | None = None) -> tuple[int, int] | None:
    """(free, total) bytes over the GPUs (those of ``devices``' indexes, when given), or None."""
    found = [d for d in gpus() if devices is None or d.index in devices]
    if not found or not any(d.total for d in found):
        return None
    return sum(d.free for d in found), sum(d.total for d in found)


def tensor_split(text: str) -> list[float] | None:
    """The ``tensor_split`` setting ("3,1": three quarters on GPU 0) as llama.cpp takes it."""
    if not text.strip():
        return None
    try:
        parts = [float(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(f"tensor_split must be numbers separated by commas, not {text!r}") from None
    if any(p < 0 for p in parts) or not any(parts):
        raise ValueError(f"tensor_split must hold non-negative proportions, not all zero: {text!r}")
    return parts


@attrs.frozen
class Plan:
    """The layer counts a load tries, in order, and the total it is measured against."""

    tries: tuple[int, ...]
    total: int
    devices: tuple[Device, ...] = ()
    note: str | None = None


def plan(setting: int, *, path: str, blocks: int | None, kv_bytes: int, split: list[float] | None,
         main_gpu: int, found: list[Device] | None = None) -> Plan:
    """The GPU layer counts to try for a model of ``blocks`` blocks at ``path`` whose context
    takes ``kv_bytes``: ``setting`` layers (-1: all that fit), then fewer when a load fails.
    ``found``: the GPUs and their free memory (what ``gpus()`` reads now, when not given)."""
    total = (blocks or 0) + 1
    found = gpus() if found is None else found
    if not found or setting == 0:
        return Plan((0,), total, tuple(found))
    if split is not None:
        used = [d for d in found if d.index < len(split) and split[d.index] > 0]
    else:
        used = [d for d in found if d.index == main_gpu] or found[:1]
    note = None
    if setting > 0:
        first = min(setting, total)
    else:
        free = sum(d.free for d in used)
        size = os.path.getsize(path)
        per_layer = max(1, size // total)
        fit = (free - kv_bytes - OVERHEAD_BYTES) // per_layer
        first = max(0, min(total, int(fit)))
        if first < total:
            note = (f"{first} of {total} layers fit the {free // 2**20} MiB free on "
                    f"{', '.join(d.name for d in used)} beside a {kv_bytes // 2**20} MiB context")
    tries, n = [first], first
    while n > 0:  # a load that does not fit after all: three quarters of the layers, then fewer
        n = n * 3 // 4 if n > 4 else 0
        tries.append(n)
    return Plan(tuple(tries), total, tuple(used), note)


def llama_options(layers: int, split: list[float] | None, main_gpu: int) -> dict[str, Any]:
    """The Llama(...) keyword arguments for a load of ``layers`` GPU layers."""
    out: dict[str, Any] = {"n_gpu_layers": layers}
    if layers:
        out["main_gpu"] = main_gpu
        if split is not None:
            out["tensor_split"] = split
    return out
