"""int8 that computes in int8 on CPU (`engine.quantization=int8`): W8A8 linears.

Weights: int8, one symmetric scale per output channel, reordered once for the GEMM that runs them. Activations:
quantized per row (per token) on the fly, symmetric, 8 bits, by batchgen's kernel (cpu/kernels_w8a8.c; torch
operations where the kernels are not built). The product: u8 x s8 with int32 accumulation, by batchgen's GEMMs
(cpu/int8_gemm.py: weights packed once in their layout): the AMX tile GEMM (cpu/kernels_amx.c) on AMX CPUs, the
AVX-512 VNNI `vpdpbusd` GEMM (cpu/kernels_vnni.c) on other CPUs with avx512_vnni; elsewhere (AVX-VNNI only, a shape
they do not take, no kernels built) by oneDNN's matmul reached through torch's `onednn::qlinear_pointwise`; the same
bits every way. The float32 output is scaled per row and the bias added in one pass.

Where the GEMM is exact only with VNNI: on CPUs without it (AVX2, AVX-512 without VNNI) oneDNN multiplies u8 by s8
with `vpmaddubsw`, whose 16-bit pair sums saturate (255 * 127 * 2 > 32767): wrong results without an error. Before
converting anything, `probe()` runs such a product and compares it with the exact one; where it differs (or the op
is missing) the engine falls back to int8 weight-only (quant/int8.py), logged with the reason. The probe tests the
kernel oneDNN actually picks, so it also catches `ONEDNN_MAX_CPU_ISA` caps.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import NamedTuple, Optional

import torch
from torch import nn

from batchgen.engines.hf.backends.cpu import int8_gemm
from batchgen.engines.hf.backends.cpu import kernels as cpu_kernels
from batchgen.engines.hf.backends.cpu import ops as cpu_ops
from batchgen.engines.hf.backends.cpu.onednn import replace_linears
from batchgen.engines.hf.quant.common import quantize_by_rows

log = logging.getLogger(__name__)
ZERO_POINT = 128  # activations go to oneDNN as uint8 = int8 + 128 (its fast kernels take unsigned activations)


class QuantizedRows(NamedTuple):
    """A W8A8 linear's input, quantized per row: q [M, K] uint8 (int8 + 128) and scale [M] float32. The native decode
    step (step.py) has its kernels write these directly (cpu/kernels.py add_rms_norm_u8, silu_mul_u8)."""

    q: torch.Tensor
    scale: torch.Tensor


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K] in [-127, 127], float32 scales [N]): symmetric, per output channel."""
    def rows(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = block.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale

    return quantize_by_rows(weight.detach(), rows)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 contiguous -> (uint8 [M, K] = int8 + 128, float32 scales [M]): batchgen's kernel where it is
    built, else torch operations with the same arithmetic (x times 127 / max, rounded half to even)."""
    lib = cpu_kernels.load()
    if lib is not None:
        return cpu_ops.quantize_rows(lib, x)
    peak = x.abs().amax(dim=1) if x.shape[1] else x.new_zeros(x.shape[0])
    finite = torch.isfinite(x).all(dim=1)
    inv = torch.where(peak > 0, 127.0 / peak, torch.zeros_like(peak))
    inv = torch.where(finite, inv, torch.zeros_like(inv))
    q = torch.round(torch.nan_to_num(x * inv[:, None], nan=0.0)).add_(ZERO_POINT).to(torch.uint8)
    scale = torch.where(finite, peak / 127.0, torch.full_like(peak, float("nan")))
    return q, scale


def scale_rows(y: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    lib = cpu_kernels.load()
    if lib is not None:
        return cpu_ops.scale_rows(lib, y, scale, bias)
    y.mul_(scale[:, None])
    return y if bias is None else y.add_(bias)


def _gemm(q: torch.Tensor, packed: torch.Tensor, wscale: torch.Tensor, wzero: torch.Tensor) -> torch.Tensor:
    """int8 x int8 -> int32, times the weights' scales, as float32 [M, N] (activation scale 1: applied after)."""
    return torch.ops.onednn.qlinear_pointwise(q, 1.0, ZERO_POINT, packed, wscale, wzero, None, 1.0, 0, torch.float32,
                                              "none", [], "")


@cache
def probe() -> Optional[str]:
    """None where oneDNN's int8 GEMM runs here and is exact at the extremes of the ranges; else why not."""
    if not hasattr(torch.ops.onednn, "qlinear_prepack") or not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN int8 linear (torch.ops.onednn.qlinear_pointwise)"
    k, n = 256, 32
    weight = torch.full((n, k), 127, dtype=torch.int8)
    weight[1::2] = -127
    weight[2::4, ::3] = 5
    # a decode step's few rows and a prefill's many: oneDNN picks its kernel by shape, so both are checked
    q = torch.full((64, k), 255, dtype=torch.uint8)  # int8 127: pair sums 2 * 255 * 127 overflow 16 bits
    q[1], q[2, ::2], q[5::7] = 1, 200, 60
    try:
        packed = torch.ops.onednn.qlinear_prepack(weight, None)
        ys = [_gemm(q[:rows].contiguous(), packed, torch.ones(n), torch.zeros(n, dtype=torch.int64))
              for rows in (4, 64)]
    except (RuntimeError, NotImplementedError) as exc:
        return f"oneDNN's int8 linear failed here ({exc})"
    exact = (q.double() - ZERO_POINT) @ weight.double().t()
    if not all(torch.equal(y.double(), exact[:y.shape[0]]) for y in ys):
        return ("oneDNN's int8 GEMM on this CPU saturates 16-bit sums (no VNNI: avx512_vnni, avx_vnni or amx_int8; "
                "or ONEDNN_MAX_CPU_ISA set below them), which would give wrong results")
    return None


class Int8DynamicLinear(nn.Module):
    """`nn.Linear` as W8A8: int8 weights per output channel, activations quantized per token on each call, int8
    products with int32 accumulation (oneDNN). The int8 weight is reordered for oneDNN on the first call and the
    plain copy dropped, so fusing projections (concatenate) happens before that and the model holds one copy."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        qweight, scale = quantize_weight(linear.weight)
        self._hold(qweight, scale, None if linear.bias is None else linear.bias.detach().float().clone())

    def _hold(self, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.contiguous())
        self.register_buffer("zero", torch.zeros(self.out_features, dtype=torch.int64), persistent=False)
        self.register_buffer("bias", bias)
        self.register_buffer("packed", None, persistent=False)  # qweight reordered for the GEMM (pack)
        self.register_buffer("comp", None, persistent=False)  # batchgen's GEMM's zero-point share (None: oneDNN's)
        self.kernel: Optional[int8_gemm.Kernel] = None  # batchgen's GEMM that runs it (pack()); None: oneDNN's
        self.lib = cpu_kernels.load()  # batchgen's kernels (quantize, scale rows); None: torch operations

    @classmethod
    def concatenate(cls, parts: list[nn.Module]) -> Optional[Int8DynamicLinear]:
        """One module whose output is the parts' outputs side by side (fusion.fuse_projections): per-channel scales,
        so exactly the int8 version of the concatenated float weights. None once a part has been packed."""
        if not all(type(p) is cls and p.packed is None for p in parts):
            return None
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        biased = any(p.bias is not None for p in parts)
        bias = torch.cat([p.bias if p.bias is not None else p.scale.new_zeros(p.out_features) for p in parts]
                         ) if biased else None
        fused._hold(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]), bias)
        return fused

    def pack(self) -> torch.Tensor:
        """The weight reordered once: for batchgen's AMX or VNNI GEMM where one runs (cpu/int8_gemm.py), else for
        oneDNN."""
        if self.packed is None:
            self.kernel = int8_gemm.kernel(self.lib, self.out_features, self.in_features)
            if self.kernel is not None:
                self.packed, self.comp = int8_gemm.pack(self.qweight)
            else:
                self.packed = torch.ops.onednn.qlinear_prepack(self.qweight, None)
            self.qweight = self.qweight.new_empty(0)  # the packed copy is the weight from now on
        return self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        if x2.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        lib = self.lib
        if lib is None:
            rows = QuantizedRows(*quantize_rows(x2))
        else:
            # batchgen's kernel called directly: a decode step of a 0.5B model makes ~100 of these calls per token,
            # and the checked wrappers (cpu/kernels.py) cost ~10 us each; x2 is contiguous float32, q and the scales
            # are allocated here.
            rows = QuantizedRows(cpu_ops.u8_rows(x2.shape[0], self.in_features),
                                 torch.empty(x2.shape[0], dtype=torch.float32))
            lib.batchgen_quantize_rows(x2.data_ptr(), x2.shape[0], self.in_features, rows.q.data_ptr(),
                                       rows.scale.data_ptr(), torch.get_num_threads())
        return self.finish(self.matmul(rows), rows.scale).view(*lead, self.out_features).to(x.dtype)

    def matmul(self, rows: QuantizedRows) -> torch.Tensor:
        """The int8 GEMM of quantized rows, times the weights' scales, before the rows' own scales and the bias:
        [M, N] float32 (finish() applies them, or the kernel that reads the output does)."""
        packed = self.pack()
        if self.comp is not None:
            return int8_gemm.gemm(self.lib, self.kernel, rows.q, packed, self.comp, self.scale)
        return _gemm(rows.q, packed, self.scale, self.zero)

    def finish(self, y: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
        """matmul()'s output times each row's scale, plus the bias, in place: the linear's output."""
        lib = self.lib
        if lib is None:
            return scale_rows(y, row_scale, self.bias)
        # y is oneDNN's plain row-major float32 output; scale and bias [N] float32 buffers
        lib.batchgen_scale_rows(y.data_ptr(), y.shape[0], self.out_features, row_scale.data_ptr(),
                                None if self.bias is None else self.bias.data_ptr(), torch.get_num_threads())
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def takes(linear: nn.Module) -> bool:
    return type(linear) is nn.Linear and linear.weight.device.type == "cpu" and linear.weight.is_floating_point()


def w8a8_linears(model: nn.Module) -> tuple[int, int]:
    """Replace every plain float CPU nn.Linear by an Int8DynamicLinear, in place, one at a time; (converted, kept)."""
    return replace_linears(model, lambda linear: Int8DynamicLinear(linear) if takes(linear) else None)


def pack_all(model: nn.Module) -> int:
    """Reorder every Int8DynamicLinear's weight for oneDNN now (after fusing), dropping the plain copies."""
    modules = [m for m in model.modules() if isinstance(m, Int8DynamicLinear)]
    for module in modules:
        module.pack()
    return len(modules)
