"""engine=hf's settings: the shared engine keys plus the device, the CPU threads and layout, and the prefix cache.
Light on purpose (no torch): the job reads it before anything loads."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from batchgen.engines.base import EngineConfig, at_least_one

DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
PREFIX_CACHE = ("auto", "on", "off")
GPU_MEMORY_UTILIZATION = 0.9  # engine.gpu_memory_utilization's default
CUDA_GRAPHS = ("auto", "on", "off")


@dataclass
class HFConfig(EngineConfig):
    name: str = "hf"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: Optional[int] = None  # on CPU: torch threads; null = all cores
    prepack: bool = True  # on CPU: reorder linear weights once into oneDNN's layout (faster small-batch GEMMs)
    prefix_cache: str = "auto"  # shared prompt prefixes computed once: auto | on (from 32 shared tokens) | off
    prefix_cache_mb: int = 1024  # the prefix cache's keys and values are kept within this many MiB
    cuda_graphs: str = "auto"  # on CUDA: the decode step captured per batch bucket: auto | on | off
    # on CUDA: the share of the GPU's memory the job may hold (KV cache sizing); null = 0.9, as vLLM's key
    gpu_memory_utilization: Optional[float] = None

    def problems(self) -> list[str]:
        out = super().problems() + at_least_one(self, "threads")
        if not DEVICE.match(self.device):
            out.append(f"engine.device must be auto, cpu, cuda or cuda:N (got {self.device!r})")
        if self.prefix_cache not in PREFIX_CACHE:
            out.append(f"engine.prefix_cache must be one of {', '.join(PREFIX_CACHE)} (got {self.prefix_cache!r})")
        if self.cuda_graphs not in CUDA_GRAPHS:
            out.append(f"engine.cuda_graphs must be one of {', '.join(CUDA_GRAPHS)} (got {self.cuda_graphs!r})")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            out.append(f"engine.gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        if self.prefix_cache_mb < 1:
            out.append(f"engine.prefix_cache_mb must be >= 1 (got {self.prefix_cache_mb})")
        return out
