"""The hf engine's device seam: one backend per device kind, chosen once when the engine loads (`for_device`).

A backend says what dtype the model is loaded in for its device, prepares the loaded model (prepack, fuse,
quantized-weight packing, memory given back), and builds the stepper that prefills and decodes on the slot KV cache.
The scheduler, the cache's contract (kvcache.SlotKVCache) and the sampler's policy stay device-free;
step.LlamaStepper is the plain torch reference every backend's stepper is tested against, and what runs on a device
no backend knows (`TorchBackend`).
"""

from __future__ import annotations

from typing import Any

import torch

from batchgen.engines.hf.backends.base import Backend, Prepared
from batchgen.engines.hf.config import HFConfig
from batchgen.engines.hf.step import LlamaStepper

__all__ = ["Backend", "Prepared", "TorchBackend", "for_device"]


class TorchBackend:
    """A device no backend knows (MPS, XPU, ...): the model as loaded, the reference stepper."""

    name = "torch"

    def load_dtype(self, cfg: HFConfig, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def prepare(self, model: Any, cfg: HFConfig, dtype: torch.dtype, loaded: torch.dtype,
                serves_all: bool) -> Prepared:
        return Prepared(activation_dtype=loaded)

    def stepper(self, model: Any, prepared: Prepared, dtype: torch.dtype, cfg: HFConfig) -> LlamaStepper:
        return LlamaStepper(model, prepared.activation_dtype)


def for_device(device: torch.device) -> Backend:
    """The backend of `device`'s kind."""
    if device.type == "cpu":
        from batchgen.engines.hf.backends.cpu.backend import CpuBackend

        return CpuBackend()
    if device.type == "cuda":
        from batchgen.engines.hf.backends.cuda.backend import CudaBackend

        return CudaBackend()
    return TorchBackend()
