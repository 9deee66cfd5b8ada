"""The CUDA backend: the model as loaded on the GPU (quantized through torchao where asked, quant/), each layer's
q/k/v and gate/up projections fused into one GEMM each where the stepper serves every request (one launch instead
of three, the input read once), and the graph-captured stepper (step.py beside this file)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from batchgen.engines.hf.backends.base import Prepared
from batchgen.engines.hf.backends.cuda.step import CudaStepper
from batchgen.engines.hf.config import GPU_MEMORY_UTILIZATION, HFConfig
from batchgen.engines.hf.fusion import concatenate_linears, fuse_projections
from batchgen.engines.hf.sampling.draw import TORCH_OPS, DrawOps

log = logging.getLogger(__name__)


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
        stepper = CudaStepper(model, prepared.activation_dtype, graphs=cfg.cuda_graphs)
        free, total = torch.cuda.mem_get_info(stepper.device)
        reserve = activation_reserve(model.config, cfg.max_batch_tokens or 65536, cfg.max_batch_size or 1024,
                                     torch.empty(0, dtype=prepared.activation_dtype).element_size())
        utilization = cfg.gpu_memory_utilization or GPU_MEMORY_UTILIZATION
        stepper.kv_budget_bytes = kv_budget(total, free, utilization, reserve)
        log.info("KV cache budget on %s: %.2f GB (engine.gpu_memory_utilization=%.2f of %.1f GB, %.1f GB in use, "
                 "%.1f GB kept for activations)", stepper.device, stepper.kv_budget_bytes / 1e9,
                 utilization, total / 1e9, (total - free) / 1e9, reserve / 1e9)
        return stepper

    def draw_ops(self) -> DrawOps:
        return TORCH_OPS  # torch's: the draw as it is, on the device (no host sync)


def kv_budget(total: int, free: int, utilization: float, reserve: int) -> int:
    """Bytes the KV cache may take: the job's share of the GPU (utilization x total) less what is in use already
    (the weights, another process's memory) and the activation reserve; never negative."""
    return max(int(total * utilization) - (total - free) - reserve, 0)


def activation_reserve(config: Any, max_batch_tokens: int, max_slots: int, element: int) -> int:
    """Bytes a step's activations may peak at beside the KV cache: a prefill of max_batch_tokens tokens (the
    residual stream, q/k/v and the MLP's gate/up and product, about 6 hidden + 3 intermediate values a token) and
    the decode logits of every slot in float32 (the step's buffer, the sampler's copy and one temporary)."""
    hidden = getattr(config, "hidden_size", 0)
    intermediate = getattr(config, "intermediate_size", 4 * hidden)
    vocab = getattr(config, "vocab_size", 0)
    return max_batch_tokens * (6 * hidden + 3 * intermediate) * element + 3 * max_slots * vocab * 4
