"""The CUDA backend: the model as loaded on the GPU (quantized through torchao where asked, quant/), each layer's
q/k/v and gate/up projections fused into one GEMM each where the stepper serves every request (one launch instead
of three, the input read once), and the graph-captured stepper (step.py beside this file)."""

from __future__ import annotations

from typing import Any

import torch

from batchgen.engines.hf.backends.base import Prepared
from batchgen.engines.hf.backends.cuda.step import CudaStepper
from batchgen.engines.hf.config import HFConfig
from batchgen.engines.hf.fusion import concatenate_linears, fuse_projections


class CudaBackend:
    name = "cuda"

    def load_dtype(self, cfg: HFConfig, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def prepare(self, model: Any, cfg: HFConfig, dtype: torch.dtype, loaded: torch.dtype,
                serves_all: bool) -> Prepared:
        fused = fuse_projections(model, concatenate_linears) if serves_all and not cfg.quantization else 0
        if fused:
            torch.cuda.empty_cache()  # the parts' memory, freed layer by layer, back for the KV cache
        return Prepared(activation_dtype=loaded, fused=fused)

    def stepper(self, model: Any, prepared: Prepared, dtype: torch.dtype, cfg: HFConfig) -> CudaStepper:
        return CudaStepper(model, prepared.activation_dtype, graphs=cfg.cuda_graphs)
