"""Choosing the backend once, by device kind (`for_device`), and the backend of a device no other knows."""

from __future__ import annotations

from typing import Any

import torch

from batchgen.engines.hf.backends.base import Backend, Prepared
from batchgen.engines.hf.config import HFConfig
from batchgen.engines.hf.sampling.draw import TORCH_OPS, DrawOps
from batchgen.engines.hf.step import LlamaStepper


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

    def draw_ops(self) -> DrawOps:
        return TORCH_OPS


def for_device(device: torch.device) -> Backend:
    """The backend of `device`'s kind."""
    if device.type == "cpu":
        from batchgen.engines.hf.backends.cpu.backend import CpuBackend

        return CpuBackend()
    if device.type == "cuda":
        from batchgen.engines.hf.backends.cuda.backend import CudaBackend

        return CudaBackend()
    return TorchBackend()
