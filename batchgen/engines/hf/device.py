"""Device and dtype for the hf engine, and the defaults that follow from the device.

`engine.device=auto` is CUDA where torch sees one, else CPU. `engine.dtype=auto` is bf16 (else fp16) on
CUDA and, on CPU, the dtype measured faster for the model's linears on this CPU (cpu/calibration.py:
once per CPU kind and shape, cached). An explicit dtype always wins. Knows torch devices and model
configs, not requests.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from batchgen.engines.base import EngineConfig, model_max_len  # noqa: F401 - device.model_max_len for engine.py
from batchgen.engines.hf.backends.cpu import calibration

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULTS = {  # (max_batch_tokens, max_batch_size) per device type; rows per part: engines.ENGINES
    "cpu": (8192, 64),
    "cuda": (65536, 1024),  # slots bounded by the GPU's memory (engine.gpu_memory_utilization)
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, model_config: Any = None) -> torch.dtype:
    """An explicit engine.dtype as given; auto: bf16 (else fp16) on CUDA, and on CPU the dtype measured faster for
    the model's linears (cpu/calibration.py: once per CPU kind and shape, cached)."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return calibration.fastest_dtype(calibration.model_features(model_config))


def model_config(cfg: EngineConfig) -> Any:
    """The checkpoint's config where engine.dtype=auto needs its sizes on CPU; None where it does not load."""
    if cfg.dtype != "auto":
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError):
        return None


def batch_defaults(device: torch.device, max_batch_tokens: Optional[int], max_batch_size: Optional[int]
                   ) -> tuple[int, int]:
    """engine.max_batch_tokens and engine.max_batch_size, each the device type's default where unset."""
    budget, size = DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    return max_batch_tokens or budget, max_batch_size or size
