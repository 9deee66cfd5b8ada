"""int4 weight-only quantization: group-wise asymmetric 4-bit weights in the layout of batchgen's CPU kernel (the
LM head and the embeddings in int8), torchao's int4 where those kernels are not built and on CUDA.
quant/__init__.py says what runs where."""

from __future__ import annotations

import copy
import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engines.hf.backends.cpu import kernels as cpu_kernels
from batchgen.engines.hf.backends.cpu import ops as cpu_ops
from batchgen.engines.hf.backends.cpu.onednn import CastLinear, replace_linears
from batchgen.engines.hf.quant.common import INT4_CPU_GROUP, INT4_GROUP, INT4_NATIVE_ROWS, TORCHAO_HINT, import_or_hint
from batchgen.engines.hf.quant.int8 import Int8WeightOnlyLinear, quantize_embeddings_int8

log = logging.getLogger(__name__)


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric int4: weight[n, k] ~ scale[n, g] * q[n, k] + mins[n, g], g = k // group, q in [0, 15].
    weight: [N, K] float, K a multiple of group -> (q [N, K] uint8, scale and mins [N, K / group] bfloat16).
    The min is rounded down to bfloat16 and the scale up, so the group's smallest and largest weights still map
    into [0, 15] under the stored, rounded values; every weight is then within half a step of its grid point."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group, group)
    lowest = w.amin(dim=-1)
    mins = lowest.to(torch.bfloat16)
    bits = mins.view(torch.int16)  # one bf16 step toward -inf: +1 on a negative, -1 on a positive, +0 -> -tiny
    down = torch.where(bits > 0, bits - 1, torch.where(bits == 0, torch.full_like(bits, -32767), bits + 1))
    mins = torch.where(mins.float() > lowest, down, bits).view(torch.bfloat16)
    exact = ((w.amax(dim=-1) - mins.float()) / 15).clamp(min=1e-8)
    scale = exact.to(torch.bfloat16)
    scale = (scale.view(torch.int16) + (scale.float() < exact).to(torch.int16)).view(torch.bfloat16)  # round up
    q = torch.round((w - mins.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, mins


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] uint8 in [0, 15], K a multiple of 64 -> [N, K / 2] uint8 in the kernel's layout (cpu/kernels_int4.c):
    each 64-weight block is 8 little-endian uint32 lanes, lane j holding q[8 i + j] in bits 4 i .. 4 i + 3."""
    n, k = q.shape
    planes = q.reshape(n, k // 64, 4, 2, 8)  # [n, block, byte b of a lane, low/high nibble, lane j]: plane 2 b + h
    packed = planes[:, :, :, 0, :] | (planes[:, :, :, 1, :] << 4)  # [n, block, b, j]
    return packed.permute(0, 1, 3, 2).contiguous().reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4."""
    n, half = packed.shape
    lanes = packed.reshape(n, half // 32, 8, 4)  # [n, block, lane j, byte b]
    nibbles = torch.stack([lanes & 15, lanes >> 4], dim=-1)  # [n, block, j, b, h]
    return nibbles.permute(0, 1, 3, 4, 2).reshape(n, half * 2)


class Int4WeightOnlyLinear(nn.Module):
    """`nn.Linear` with group-wise asymmetric int4 weights (quantize_int4; bfloat16 scale and min per group of
    `group` input weights), two to a byte in the layout of batchgen's AVX2 kernel; activations are not quantized.
    Inputs under INT4_NATIVE_ROWS rows (decode steps) run the kernel in float32; larger inputs (prefill, large
    decode batches) dequantize the layer's weights, transiently, for one GEMM in the input's dtype. Built only
    where cpu_kernels.load() works (int4_cpu uses torchao elsewhere)."""

    def __init__(self, linear: nn.Linear, group: int = INT4_CPU_GROUP):
        super().__init__()
        q, scale, mins = quantize_int4(linear.weight, group)
        self._hold(pack_int4(q), scale, mins, None if linear.bias is None else linear.bias.detach().float(), group)

    def _hold(self, qweight: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, bias: Optional[torch.Tensor],
              group: int) -> None:
        self.native = cpu_kernels.load()
        if self.native is None:
            raise RuntimeError("Int4WeightOnlyLinear needs batchgen's CPU kernels (cpu_kernels.load())")
        if group % 64 or qweight.shape[1] * 2 % group or scale.dtype != torch.bfloat16 or mins.dtype != torch.bfloat16:
            raise ValueError(f"int4 layout: group {group} must be a multiple of 64 dividing the input size "
                             f"{qweight.shape[1] * 2}, scales and mins bfloat16")
        self.group = group
        self.native_rows = INT4_NATIVE_ROWS  # see route_rows
        self.gemm_dtype: Optional[torch.dtype] = None  # the dequantized GEMM's (None: the input's); set_gemm_dtype
        self.out_features, self.in_features = qweight.shape[0], qweight.shape[1] * 2
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.contiguous())
        self.register_buffer("mins", mins.contiguous())
        self.register_buffer("bias", bias)

    @classmethod
    def concatenate(cls, parts: list[nn.Module]) -> Optional[Int4WeightOnlyLinear]:
        """One module whose output is the parts' outputs side by side (`fuse` for fusion.fuse_projections);
        groups run along the input, so this is exactly the int4 version of the concatenated weights."""
        if not all(type(p) is cls and p.group == parts[0].group for p in parts):
            return None
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        bias = torch.cat([p.bias if p.bias is not None else p.scale.new_zeros(p.out_features, dtype=torch.float32)
                          for p in parts]) if any(p.bias is not None for p in parts) else None
        fused._hold(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]),
                    torch.cat([p.mins for p in parts]), bias, parts[0].group)
        return fused

    def dequantize(self) -> torch.Tensor:
        """The layer's weights as float32, [N, K]."""
        return cpu_ops.int4_dequantize(self.native, self.qweight, self.scale, self.mins, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if 0 < x2.shape[0] < self.native_rows:
            y = cpu_ops.int4_gemm(self.native, x2.float().contiguous(), self.qweight, self.scale, self.mins,
                                      self.group, self.bias)
            return y.to(x.dtype).view(*lead, self.out_features)
        dtype = self.gemm_dtype or x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), self.dequantize().to(dtype), bias).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, "
                f"bias={self.bias is not None}")


def int4_cpu(model: nn.Module, device: torch.device) -> nn.Module:
    """int4 weight-only linears: batchgen's own (Int4WeightOnlyLinear, group INT4_CPU_GROUP) where its CPU kernels
    are built, else torchao's (int4_cpu_torchao). Either way the LM head and the input embeddings are stored as
    int8 (int4 there costs the most fidelity, and in a large vocabulary they are a large share of the bytes)."""
    if cpu_kernels.load() is None:
        return int4_cpu_torchao(model, device)
    head = model.get_output_embeddings()

    def convert(linear: nn.Linear) -> Optional[nn.Module]:
        if type(linear) is not nn.Linear or linear.weight.device.type != "cpu":
            return None
        if linear is head:
            return Int8WeightOnlyLinear(linear)
        return Int4WeightOnlyLinear(linear) if linear.in_features % INT4_CPU_GROUP == 0 else None

    converted, skipped = replace_linears(model, convert)
    log.info("int4 weight-only: %d linears converted (group %d; the LM head in int8), %d left in float (input size "
             "not a multiple of %d); inputs under %d rows run batchgen's AVX2 kernel, larger ones dequantize the "
             "layer's weights", converted, INT4_CPU_GROUP, skipped, INT4_CPU_GROUP, INT4_NATIVE_ROWS)
    quantize_embeddings_int8(model)
    return model


def int4_cpu_torchao(model: nn.Module, device: torch.device) -> nn.Module:
    """torchao int4 weight-only (group 128). A bfloat16 model is quantized in place; in a float32 model each
    quantized linear becomes a CastLinear island (bf16) and everything else stays float32."""
    import_or_hint("torchao.quantization", TORCHAO_HINT, "engine.quantization=int4 without batchgen's CPU kernels")
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import quantize_

    config = PrototypeInt4WeightOnlyConfig(group_size=INT4_GROUP)
    if next(model.parameters()).dtype == torch.bfloat16:
        quantize_(model, config, filter_fn=_groupable)
        return model

    def island(linear: nn.Linear) -> Optional[CastLinear]:
        if not _groupable(linear, ""):
            return None
        bf16 = copy.deepcopy(linear).to(torch.bfloat16)  # a copy: replace_linears drops the original's weight
        quantize_(bf16, config)
        return CastLinear(bf16, torch.bfloat16)

    replace_linears(model, island)
    return model


def int4_cuda(model: nn.Module, device: torch.device) -> nn.Module:
    torchao = import_or_hint("torchao.quantization", TORCHAO_HINT, "engine.quantization=int4")
    from torchao.quantization.quantize_.workflows import Int4PackingFormat

    config = torchao.Int4WeightOnlyConfig(group_size=INT4_GROUP,
                                          int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D)
    torchao.quantize_(model, config, filter_fn=_groupable)
    return model


def _groupable(module: nn.Module, fqn: str) -> bool:
    """Linears the int4 kernels take: whole groups along the input, outputs a multiple of 16 (CPU packing)."""
    return isinstance(module, nn.Linear) and module.in_features % INT4_GROUP == 0 and module.out_features % 16 == 0
