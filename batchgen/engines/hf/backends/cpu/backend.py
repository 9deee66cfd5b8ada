"""The CPU backend: how a loaded model is readied for the CPU, and its stepper (step.py beside this file).

The plan, in the order it runs: int8/int4 in bf16 compute in float32 between batchgen's kernels (each quantized
linear runs its dequantized prefill GEMM in bf16); a bf16 model on a CPU with native bf16 becomes bf16 GEMMs with
float32 kernels between them (onednn.mixed_bf16); otherwise plain linears are prepacked for oneDNN, and quantized
ones fused where the stepper serves every request; W8A8 weights are reordered for the GEMM that runs; memory freed
while loading goes back to the OS; and a thread governor times every step (threads.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from batchgen.engines.hf import quant
from batchgen.engines.hf.backends.base import Prepared
from batchgen.engines.hf.backends.cpu import kernels, onednn, ops, runtime, threads
from batchgen.engines.hf.backends.cpu.step import CpuStepper
from batchgen.engines.hf.config import HFConfig
from batchgen.engines.hf.fusion import fuse_projections
from batchgen.engines.hf.sampling.draw import DrawOps, first_largest

cpu_has_fast_bf16 = runtime.has_native_bf16  # the flag; engine.dtype=auto measures instead (calibration.py)


class CpuBackend:
    name = "cpu"

    def load_dtype(self, cfg: HFConfig, dtype: torch.dtype) -> torch.dtype:
        """float32 for int8/int4 in bf16 (batchgen's kernels take float32 between the quantized GEMMs)."""
        return torch.float32 if quantized_bf16_gemms(cfg, dtype) else dtype

    def prepare(self, model: Any, cfg: HFConfig, dtype: torch.dtype, loaded: torch.dtype,
                serves_all: bool) -> Prepared:
        activations, prepacked, fused = loaded, 0, 0
        if mixed_bf16_pays(cfg, dtype):
            prepacked, fused = onednn.mixed_bf16(model, fuse_projections if serves_all else None)
            activations = torch.float32
        elif cfg.prepack and not cfg.quantization and onednn.available(dtype):
            if serves_all:
                fused = fuse_projections(model, onednn.pack_concatenated)
            prepacked = fused + onednn.pack_linears(model)
        elif cfg.quantization in quant.CPU_KERNEL_SCHEMES and serves_all:
            fused = fuse_projections(model, quant.concatenate)
        prepacked += quant.pack_w8a8(model)  # after fusing: W8A8 weights reordered for oneDNN
        if quantized_bf16_gemms(cfg, dtype):  # after fusing: the fused modules are new
            quant.set_gemm_dtype(model, torch.bfloat16)
        runtime.return_freed_memory()  # after loading: memory freed while loading or quantizing goes back to the OS
        runtime.keep_freed_memory()
        # fewer threads while other work holds the cores (threads.py); kept across windows
        governor = threads.for_engine(torch.get_num_threads(), torch.set_num_threads)
        return Prepared(activation_dtype=activations, prepacked=prepacked, fused=fused, governor=governor)

    def stepper(self, model: Any, prepared: Prepared, dtype: torch.dtype, cfg: HFConfig) -> CpuStepper:
        # around bf16 GEMMs the cache is bf16, as a bf16 model's would be
        return CpuStepper(model, prepared.activation_dtype, dtype)

    def draw_ops(self) -> DrawOps:
        lib = kernels.load()
        halves = None if lib is None or not hasattr(lib, "batchgen_draw_halves") else partial(ops.draw_halves, lib)
        sort = None if lib is None or not hasattr(lib, "batchgen_sort_desc_rows") else partial(ops.sort_desc_rows, lib)
        return DrawOps(argmax=argmax_rows, halves=halves, sort=sort)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[n] int64: each row's first index of its largest value, NaN counting as largest (draw.first_largest's
    answer): batchgen's kernel on float32 logits, one read on every thread; torch's where it is not built."""
    lib = kernels.load() if logits.dtype == torch.float32 and logits.is_contiguous() and logits.shape[-1] else None
    if lib is not None and hasattr(lib, "batchgen_argmax_rows"):
        return ops.argmax_rows(lib, logits)
    return first_largest(logits)


def mixed_bf16_pays(cfg: HFConfig, dtype: torch.dtype) -> bool:
    """bf16 GEMMs with batchgen's float32 kernels between them (onednn.mixed_bf16): a bf16 model on a CPU with
    native bf16 (the flag: on an emulating CPU the pure bf16 path stays as it was measured), where the kernels are
    built and oneDNN can prepack bf16 weights."""
    return (dtype == torch.bfloat16 and cfg.prepack and not cfg.quantization and cpu_has_fast_bf16()
            and kernels.load() is not None and onednn.available(torch.bfloat16))


def quantized_bf16_gemms(cfg: HFConfig, dtype: torch.dtype) -> bool:
    """int8/int4 in bf16 through batchgen's kernels: the model computes in float32 (the kernels for few rows take
    float32), and each quantized linear runs its dequantized GEMM (prefill) in bf16."""
    return cfg.quantization in quant.CPU_KERNEL_SCHEMES and dtype == torch.bfloat16 and kernels.load() is not None
