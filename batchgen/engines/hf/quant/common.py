"""What the quantization schemes share: the row thresholds that route an input to a kernel, the group
sizes, and the install hints of the optional libraries behind them."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from batchgen.errors import ConfigError

# int8 weight-only on CPU: inputs of at least this many rows (prefill, large decode batches) dequantize the layer's
# weights to the input dtype and run a float GEMM; fewer rows go through aten._weight_int8pack_mm. On the
# development CPU (AVX2, no fast bf16), end to end in the engine on the benchmark model, the kernel was faster for
# decode batches of 16 and 32 rows and no faster at 64, and the float GEMM clearly faster for prefill (1024 rows).
DEQUANT_ROWS = 64
# Inputs under NATIVE_ROWS rows run batchgen's AVX2 kernel (cpu_kernels) where it is built: over the benchmark
# model's linears it was faster than dequantizing for a float32 GEMM up to 128 rows (64 rows: 152 vs 182 ms).
NATIVE_ROWS = 128
INT8_K_MULTIPLE = 16  # input sizes aten._weight_int8pack_mm takes (see _int8_kernel_takes)
INT4_GROUP = 128  # weights per int4 scale/zero pair in torchao's kernels (CUDA; CPU without batchgen's kernels)
INT4_CPU_GROUP = 64  # weights per int4 scale/min pair in batchgen's CPU kernel (a multiple of 64)
# int4 on CPU: inputs under this many rows run batchgen's kernel, larger ones dequantize for a float32 GEMM. Over the
# benchmark model's linears the kernel was faster up to 96 rows (64: 142 ms against 170 ms) and slower at 128.
INT4_NATIVE_ROWS = 112
TORCHAO_HINT = "pip install 'batchgen[quant]' (torchao)"
BNB_HINT = "pip install 'batchgen[bnb]' (bitsandbytes, CUDA only)"


QUANTIZE_ROWS = 4096  # rows of a weight quantized at a time (quantize_by_rows)


def quantize_by_rows(weight: torch.Tensor, quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                     rows: int = QUANTIZE_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize(block) -> (q, scale)` over blocks of `rows` rows of `weight` [N, K], into one (q [N, K], scale [N,
    ...]). Each row's result is its own, so the blocks change no bit; what they change is the float temporaries:
    quantizing a 151,936-row LM head or embedding table at once held several float32 copies of it (545 MB each at
    the Qwen2.5-0.5B shape), the largest part of a quantized model's peak memory while loading. The results lie on
    `quantize`'s device, the weight's: int8 on CUDA quantizes the embedding table after the model is placed, and a
    table left on the CPU failed its first lookup with ids on the GPU."""
    n = weight.shape[0]
    q_first, scale_first = quantize(weight[:rows])
    q = torch.empty((n, *q_first.shape[1:]), dtype=q_first.dtype, device=q_first.device)
    scale = torch.empty((n, *scale_first.shape[1:]), dtype=scale_first.dtype, device=scale_first.device)
    q[:rows], scale[:rows] = q_first, scale_first
    for start in range(rows, n, rows):
        q[start:start + rows], scale[start:start + rows] = quantize(weight[start:start + rows])
    return q, scale


def import_or_hint(module: str, hint: str, needed_by: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError([f"{needed_by} needs {module.split('.')[0]}: {hint}"]) from exc
