"""What the quantization schemes share: the row thresholds that route an input to a kernel, the group
sizes, and the install hints of the optional libraries behind them."""

from __future__ import annotations

import importlib
from typing import Any

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


def import_or_hint(module: str, hint: str, needed_by: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError([f"{needed_by} needs {module.split('.')[0]}: {hint}"]) from exc
