"""What every backend of the hf engine is (`Backend`) and what it makes of a loaded model (`Prepared`)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from batchgen.engines.hf.config import HFConfig
from batchgen.engines.hf.sampling.draw import DrawOps
from batchgen.engines.hf.step import LlamaStepper


@dataclass(frozen=True)
class Prepared:
    """What a backend made of the loaded model: the activations' dtype between the GEMMs (and the KV cache's where
    the backend keeps it so), linears prepacked, projections fused, and the context entered around every step (on
    CPU the thread governor that times them; None: none)."""

    activation_dtype: torch.dtype
    prepacked: int = 0
    fused: int = 0
    governor: Optional[AbstractContextManager[Any]] = None


class Backend(Protocol):
    name: str

    def load_dtype(self, cfg: HFConfig, dtype: torch.dtype) -> torch.dtype:
        """The dtype the model is loaded in, given the engine's resolved dtype."""
        ...

    def prepare(self, model: Any, cfg: HFConfig, dtype: torch.dtype, loaded: torch.dtype,
                serves_all: bool) -> Prepared:
        """Ready the loaded model for this device, in place. serves_all: the stepper serves every request the model
        allows (so fused projections pay)."""
        ...

    def stepper(self, model: Any, prepared: Prepared, dtype: torch.dtype, cfg: HFConfig) -> LlamaStepper:
        """The prefill and decode steps on this device (built once per engine)."""
        ...

    def draw_ops(self) -> DrawOps:
        """What the sampler may run this device's way without changing a token (sampling/draw.py)."""
        ...
