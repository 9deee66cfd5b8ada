"""batchgen's own W8A8 GEMMs: who runs them, their weight layout, and the call. On the AMX tile unit
(kernels_amx.c, the avx512_amx variant) and with AVX-512 VNNI `vpdpbusd` (kernels_vnni.c, every AVX-512 variant, run
where the CPU reports avx512_vnni); quant/w8a8.py picks one over oneDNN's int8 matmul where it fits. The same
weight layout and the same bits for both (and oneDNN's). Knows tensors and pointers."""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from typing import Literal, Optional

import torch

from batchgen.engines.hf.backends.cpu import ops as cpu_ops
from batchgen.engines.hf.backends.cpu.runtime import cpu_flags

log = logging.getLogger(__name__)
Kernel = Literal["amx", "vnni"]
MAX_K = 65536  # int32 sums of 255 x 127 products stay exact up to 66,311 of them


def kernel(lib: Optional[ctypes.CDLL], n: int, k: int) -> Optional[Kernel]:
    """Which of batchgen's int8 GEMMs runs an [n, k] weight here: "amx" (the avx512_amx variant, the tile registers
    granted, k a multiple of 64 and n of 32), else "vnni" (a variant with the kernel, a CPU with avx512_vnni, k a
    multiple of 4 and n of 16), else None (oneDNN's matmul runs; so too past MAX_K inputs)."""
    if lib is None or k > MAX_K:
        return None
    if hasattr(lib, "batchgen_amx_int8_gemm") and k % 64 == 0 and n % 32 == 0 and _amx_granted(lib):
        return "amx"
    if k % 4 == 0 and n % 16 == 0 and has_vnni(lib):
        return "vnni"
    return None


def has_vnni(lib: Optional[ctypes.CDLL]) -> bool:
    """True where batchgen's VNNI GEMMs run: a kernel variant that has them (AVX-512) and a CPU with avx512_vnni."""
    return lib is not None and hasattr(lib, "batchgen_vnni_int8_gemm") and "avx512_vnni" in cpu_flags()


@cache
def _amx_granted(lib: ctypes.CDLL) -> bool:
    granted = lib.batchgen_amx_init() == 0
    if not granted:
        log.info("Linux refused this process the AMX tile registers (before 5.16?): the VNNI or oneDNN int8 GEMM runs")
    return granted


def pack(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] int8 -> both kernels' weight layout [N/16, K/4, 16, 4] (a 16-channel block's four consecutive K-values
    per channel side by side) and its zero-point share [N] int32 (128 times each channel's sum)."""
    n, k = qweight.shape
    packed = qweight.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    return packed, (qweight.sum(dim=1, dtype=torch.int32) * 128).to(torch.int32)


def gemm(lib: ctypes.CDLL, which: Kernel, q: torch.Tensor, packed: torch.Tensor, comp: torch.Tensor,
         scale: torch.Tensor) -> torch.Tensor:
    """(q - 128) W^T times scale per channel, float32 [M, N]: q [M, K] uint8 contiguous, W from pack(). The AMX
    kernel reads whole 16-row tiles: q is copied into a padded buffer where its storage ends before that."""
    m, k = q.shape
    n = packed.shape[0] * 16
    cpu_ops.require(q.dtype == torch.uint8 and q.is_contiguous() and packed.shape[1] * 4 == k,
                     "int8_gemm.gemm: q [M, K] uint8 contiguous")
    y = torch.empty((m, n), dtype=torch.float32)
    if which == "vnni":
        lib.batchgen_vnni_int8_gemm(q.data_ptr(), m, k, packed.data_ptr(), n, comp.data_ptr(), scale.data_ptr(),
                                    y.data_ptr(), torch.get_num_threads())
        return y
    if q.untyped_storage().nbytes() - q.storage_offset() < -(-m // 16) * 16 * k:
        q = cpu_ops.u8_rows(m, k).copy_(q)
    lib.batchgen_amx_int8_gemm(q.data_ptr(), m, k, packed.data_ptr(), n, comp.data_ptr(), scale.data_ptr(),
                               y.data_ptr(), torch.get_num_threads())
    return y
