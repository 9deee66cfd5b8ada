"""The hf engine's device seam: one backend per device kind, chosen once when the engine loads (`for_device`).

A backend says what dtype the model is loaded in for its device, prepares the loaded model (prepack, fuse,
quantized-weight packing, memory given back), and builds the stepper that prefills and decodes on the slot KV cache.
The scheduler, the cache's contract (kvcache.SlotKVCache) and the sampler's policy stay device-free;
step.LlamaStepper is the plain torch reference every backend's stepper is tested against, and what runs on a device
no backend knows (`TorchBackend`).

Nothing is imported here: the CPU runtime's settings (cpu/runtime.py) must be made before torch loads, and the
command line imports them on every call; `for_device` and the backend classes load with the engine.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Backend", "Prepared", "TorchBackend", "for_device"]


def __getattr__(name: str) -> Any:  # lazy: importing backends.cpu.runtime must not load torch
    if name in ("TorchBackend", "for_device"):
        from batchgen.engines.hf.backends import choose

        return getattr(choose, name)
    if name in ("Backend", "Prepared"):
        from batchgen.engines.hf.backends import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
