"""batchgen's W8A8 GEMM on the AMX tile unit (kernels_amx.c, the avx512_amx variant): who runs it, its weight layout,
and the call. quant/w8a8.py picks it over oneDNN's int8 matmul where it fits. Knows tensors and pointers."""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from typing import Optional

import torch

from batchgen.engines.hf.cpu import kernels

log = logging.getLogger(__name__)


def fits(lib: Optional[ctypes.CDLL], n: int, k: int) -> bool:
    """True where batchgen's AMX int8 GEMM runs an [n, k] weight: the avx512_amx variant, the kernel granted the tile
    registers, k a multiple of 64 and n of 32."""
    return (lib is not None and hasattr(lib, "batchgen_amx_int8_gemm") and k % 64 == 0 and n % 32 == 0
            and _amx_granted(lib))


@cache
def _amx_granted(lib: ctypes.CDLL) -> bool:
    granted = lib.batchgen_amx_init() == 0
    if not granted:
        log.info("Linux refused this process the AMX tile registers (before 5.16?): oneDNN's int8 GEMM runs")
    return granted


def pack(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] int8 -> the AMX GEMM's weight layout [N/16, K/4, 16, 4] (kernels_amx.c) and its zero-point share
    [N] int32 (128 times each channel's sum)."""
    n, k = qweight.shape
    packed = qweight.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    return packed, (qweight.sum(dim=1, dtype=torch.int32) * 128).to(torch.int32)


def int8_gemm(lib: ctypes.CDLL, q: torch.Tensor, packed: torch.Tensor, comp: torch.Tensor,
              scale: torch.Tensor) -> torch.Tensor:
    """(q - 128) W^T times scale per channel, float32 [M, N]: q [M, K] uint8 contiguous (copied into a 16-row padded
    buffer where its storage ends before that), W from pack()."""
    m, k = q.shape
    n = packed.shape[0] * 16
    kernels._require(q.dtype == torch.uint8 and q.is_contiguous() and packed.shape[1] * 4 == k,
                     "amx.int8_gemm: q [M, K] uint8 contiguous")
    if q.untyped_storage().nbytes() - q.storage_offset() < -(-m // 16) * 16 * k:
        q = kernels.u8_rows(m, k).copy_(q)
    y = torch.empty((m, n), dtype=torch.float32)
    lib.batchgen_amx_int8_gemm(q.data_ptr(), m, k, packed.data_ptr(), n, comp.data_ptr(), scale.data_ptr(),
                               y.data_ptr(), torch.get_num_threads())
    return y
