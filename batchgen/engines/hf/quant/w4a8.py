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

from batchgen.engines.hf.backends.cpu import int8_gemm
from batchgen.engines.hf.backends.cpu import kernels as cpu_kernels
from batchgen.engines.hf.backends.cpu import ops as cpu_ops
from batchgen.engines.hf.backends.cpu.onednn import replace_linears
from batchgen.engines.hf.quant import int4, int8, w8a8
from batchgen.engines.hf.quant.common import INT4_CPU_GROUP
from batchgen.engines.hf.quant.int4 import quantize_int4
from batchgen.engines.hf.quant.w8a8 import Int8DynamicLinear, QuantizedRows

log = logging.getLogger(__name__)


def runs_here(lib) -> bool:
    """True where batchgen's W4A8 GEMM runs: its kernels built with the VNNI GEMMs, a CPU with avx512_vnni."""
    return int8_gemm.has_vnni(lib) and hasattr(lib, "batchgen_vnni_int4_gemm")


def pack_w4(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """q [N, K] uint8 in [0, 15], scale and mins [N, K / group] bfloat16 -> the kernel's operands, each [N/16, ...]
    (so that fused projections concatenate them along dim 0): the weights [N/16, K/8, 16, 4] bytes (low nibble
    q[c, 8 t + b], high nibble q[c, 8 t + 4 + b]); scales and mins [N/16, K/group, 16] float32; q128 [N/16, K/group,
    16] int32, 128 times each group's sum of q (the activations' zero point, taken off in int32)."""
    n, k = q.shape
    nibbles = q.view(n // 16, 16, k // 8, 2, 4).permute(0, 2, 1, 4, 3)  # [block, t, channel, byte, low/high]
    packed = (nibbles[..., 0] | (nibbles[..., 1] << 4)).contiguous()

    def by_block(values: torch.Tensor) -> torch.Tensor:
        return values.view(n // 16, 16, -1).permute(0, 2, 1).contiguous()

    q128 = q.view(n, k // group, group).sum(dim=-1, dtype=torch.int32) * 128
    return packed, by_block(scale.float()), by_block(mins.float()), by_block(q128)


OPERANDS = ("packed", "wscales", "wmins", "q128")  # pack_w4's, in order: the module's buffers


class Int4DynamicLinear(Int8DynamicLinear):
    """`nn.Linear` as W4A8: int4 weights (quantize_int4, packed at once for the kernel: half a byte a weight from
    the start), activations quantized per token on each call (as W8A8's), int8 products with int32 sums per group.
    The step (step.py) feeds it quantized rows as it feeds the W8A8 linears; finish() and forward() are theirs."""

    def __init__(self, linear: nn.Linear, group: int = INT4_CPU_GROUP):
        nn.Module.__init__(self)
        n, k = linear.out_features, linear.in_features
        if group % 64 or k % group or n % 16:
            raise ValueError(f"W4A8 layout: the group ({group}) a multiple of 64 dividing the input size ({k}), the "
                             f"output size ({n}) a multiple of 16")
        q, scale, mins = quantize_int4(linear.weight, group)
        self._hold4(pack_w4(q, scale, mins, group), None if linear.bias is None else linear.bias.detach().float(),
                    group, n, k)

    def _hold4(self, operands: tuple[torch.Tensor, ...], bias: Optional[torch.Tensor], group: int, n: int,
               k: int) -> None:
        self.out_features, self.in_features, self.group = n, k, group
        for name, tensor in zip(OPERANDS, operands):
            self.register_buffer(name, tensor)
        self.register_buffer("bias", None if bias is None else bias.clone())
        self.lib = cpu_kernels.load()
        # Int8DynamicLinear's GEMM choice and zero-point share: unused, matmul() is this class's own (a buffer, as
        # every tensor a quantized module holds, so that model.to() would move it)
        self.kernel = None
        self.register_buffer("comp", None, persistent=False)

    @classmethod
    def concatenate(cls, parts: list[nn.Module]) -> Optional[Int4DynamicLinear]:
        """One module whose output is the parts' outputs side by side: groups run along the input and every operand
        is laid out by 16-channel blocks, so exactly the int4 version of the concatenated weights."""
        if not all(type(p) is cls and p.group == parts[0].group and p.in_features == parts[0].in_features
                   for p in parts):
            return None
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        bias = torch.cat([p.bias if p.bias is not None else p.wscales.new_zeros(p.out_features) for p in parts]
                         ) if any(p.bias is not None for p in parts) else None
        operands = tuple(torch.cat([getattr(p, name) for p in parts]) for name in OPERANDS)
        fused._hold4(operands, bias, parts[0].group, sum(p.out_features for p in parts), parts[0].in_features)
        return fused

    def pack(self) -> torch.Tensor:
        return self.packed  # packed at construction

    def matmul(self, rows: QuantizedRows) -> torch.Tensor:
        """The W4A8 product of quantized rows before their own scales and the bias: [M, N] float32."""
        q = rows.q
        cpu_ops.require(q.dtype == torch.uint8 and q.dim() == 2 and q.is_contiguous()
                             and q.shape[1] == self.in_features, "Int4DynamicLinear.matmul: q [M, K] uint8 contiguous")
        y = torch.empty((q.shape[0], self.out_features), dtype=torch.float32)
        if self.lib.batchgen_vnni_int4_gemm(q.data_ptr(), q.shape[0], self.in_features, self.packed.data_ptr(),
                                            self.out_features, self.wscales.data_ptr(), self.wmins.data_ptr(),
                                            self.group, self.q128.data_ptr(), y.data_ptr(), torch.get_num_threads()):
            raise MemoryError(f"W4A8 GEMM: the heap refused {q.shape[0]} x {self.in_features // self.group} floats")
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
