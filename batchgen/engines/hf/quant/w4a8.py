"""int4 that computes in int8 on CPU (`engine.quantization=int4` where batchgen's VNNI GEMM runs): W4A8 linears.

Weights: int4 as the weight-only scheme quantizes them (quant/int4.py quantize_int4: group-wise asymmetric, a bf16
scale and min per 64 input weights, the same weights bit for bit). Activations: quantized per row (per token) as
W8A8's are (quant/w8a8.py; the decode step's kernels write them directly). The product: batchgen's AVX-512 VNNI
kernel (cpu/kernels_vnni.c batchgen_vnni_int4_gemm) takes the 4-bit weights as `vpdpbusd` operands, with int32 sums
per group folded into float32 with the group's scale and min; so a decode step of one row reads half a byte per
weight, and a batch multiplies in int8. Where that kernel does not run (no avx512_vnni, no kernels built) int4 stays
weight-only (quant/int4.py).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from batchgen.engines.hf.cpu import int8_gemm
from batchgen.engines.hf.cpu import kernels as cpu_kernels
from batchgen.engines.hf.cpu.onednn import replace_linears
from batchgen.engines.hf.quant import int4, int8, w8a8
from batchgen.engines.hf.quant.common import INT4_CPU_GROUP
from batchgen.engines.hf.quant.int4 import quantize_int4
from batchgen.engines.hf.quant.w8a8 import Int8DynamicLinear, QuantizedRows

log = logging.getLogger(__name__)


def runs_here(lib) -> bool:
    """True where batchgen's W4A8 GEMM runs: its kernels built with the VNNI GEMMs, a CPU with avx512_vnni."""
    return int8_gemm.has_vnni(lib) and hasattr(lib, "batchgen_vnni_int4_gemm")


def pack_w4(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, group: int):
    """q [N, K] uint8 in [0, 15], scale and mins [N, K / group] bfloat16 -> the kernel's operands: the weights
    [N/16, K/8, 16, 4] bytes (low nibble q[c, 8 t + b], high nibble q[c, 8 t + 4 + b]), scales and mins [N/16,
    K/group, 16] float32, and comp [N] float32 = sum_g scale 128 sum(q of the group)."""
    n, k = q.shape
    nibbles = q.view(n // 16, 16, k // 8, 2, 4).permute(0, 2, 1, 4, 3)  # [block, t, channel, byte, low/high]
    packed = (nibbles[..., 0] | (nibbles[..., 1] << 4)).contiguous()

    def by_block(values: torch.Tensor) -> torch.Tensor:
        return values.float().view(n // 16, 16, -1).permute(0, 2, 1).contiguous()

    sums = q.view(n, k // group, group).sum(dim=-1, dtype=torch.int32).float()
    comp = (scale.float() * sums * 128).sum(dim=1)
    return packed, by_block(scale), by_block(mins), comp


class Int4DynamicLinear(Int8DynamicLinear):
    """`nn.Linear` as W4A8: int4 weights (quantize_int4), activations quantized per token on each call (as W8A8's),
    int8 products with int32 sums per group. The step (step.py) feeds it quantized rows as it feeds the W8A8
    linears; matmul() and finish() are theirs. The plain int4 copy is packed on the first call and dropped."""

    def __init__(self, linear: nn.Linear, group: int = INT4_CPU_GROUP):
        nn.Module.__init__(self)
        q, scale, mins = quantize_int4(linear.weight, group)
        self._hold4(q, scale, mins, None if linear.bias is None else linear.bias.detach().float().clone(), group)

    def _hold4(self, q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, bias: Optional[torch.Tensor],
               group: int) -> None:
        self._hold(q, scale.contiguous(), bias)  # qweight: the int4 values one to a byte until pack()
        self.register_buffer("mins", mins.contiguous())
        self.group = group
        self.kernel = None
        self.packed_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @classmethod
    def concatenate(cls, parts: list[nn.Module]) -> Optional[Int4DynamicLinear]:
        """One module whose output is the parts' outputs side by side: groups run along the input, so exactly the
        int4 version of the concatenated weights. None once a part has been packed."""
        if not all(type(p) is cls and p.packed is None and p.group == parts[0].group for p in parts):
            return None
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
                         ) if any(p.bias is not None for p in parts) else None
        fused._hold4(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]),
                     torch.cat([p.mins for p in parts]), bias, parts[0].group)
        return fused

    def pack(self) -> torch.Tensor:
        if self.packed is None:
            self.packed, scales, mins, self.comp = pack_w4(self.qweight, self.scale, self.mins, self.group)
            self.packed_scales = (scales, mins)
            self.qweight = torch.empty(0, dtype=torch.uint8)
            self.scale = self.mins = torch.empty(0, dtype=torch.bfloat16)
        return self.packed

    def matmul(self, rows: QuantizedRows) -> torch.Tensor:
        """The W4A8 product of quantized rows before their own scales and the bias: [M, N] float32."""
        packed = self.pack()
        scales, mins = self.packed_scales
        q = rows.q
        m = q.shape[0]
        y = torch.empty((m, self.out_features), dtype=torch.float32)
        self.lib.batchgen_vnni_int4_gemm(q.data_ptr(), m, self.in_features, packed.data_ptr(), self.out_features,
                                         scales.data_ptr(), mins.data_ptr(), self.group, self.comp.data_ptr(),
                                         y.data_ptr(), torch.get_num_threads())
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, "
                f"bias={self.bias is not None}")


def takes(linear: nn.Module) -> bool:
    """A plain float CPU linear the W4A8 kernel takes: whole groups along the input, outputs a multiple of 16."""
    return (type(linear) is nn.Linear and linear.weight.device.type == "cpu" and linear.weight.is_floating_point()
            and linear.in_features % INT4_CPU_GROUP == 0 and linear.out_features % 16 == 0)


def int4_cpu(model: nn.Module, device: torch.device) -> nn.Module:
    """`engine.quantization=int4` on CPU: W4A8 linears where batchgen's VNNI kernel runs (the LM head W8A8: int4
    there costs the most fidelity), else weight-only int4 (quant/int4.py, logged why); int8 embedding rows either
    way."""
    lib = cpu_kernels.load()
    if not runs_here(lib) or w8a8.probe() is not None:
        log.info("int4 computes in int8 only with batchgen's AVX-512 VNNI kernel (a CPU with avx512_vnni): int4 "
                 "runs weight-only here")
        return int4.int4_cpu(model, device)
    head = model.get_output_embeddings()

    def convert(linear: nn.Linear) -> Optional[nn.Module]:
        if linear is head:
            return w8a8.Int8DynamicLinear(linear) if w8a8.takes(linear) else None
        return Int4DynamicLinear(linear) if takes(linear) else None

    converted, kept = replace_linears(model, convert)
    log.info("int4 (W4A8): %d linears with int4 weights (group %d; the LM head int8) and per-token int8 activations "
             "(batchgen's VNNI kernel), %d left in float (input size not a multiple of %d)", converted,
             INT4_CPU_GROUP, kept, INT4_CPU_GROUP)
    int8.quantize_embeddings_int8(model)
    return model
