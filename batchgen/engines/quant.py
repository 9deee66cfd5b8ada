"""Weight quantization for the hf engine: one handler per `engine.quantization` scheme.

A scheme says which devices and compute dtypes it runs on, what `from_pretrained` needs to load it
(bitsandbytes quantizes while loading) and how to convert an already loaded model (torch's and
torchao's kernels convert after loading). The engine calls `check` while validating the config and
`load_model` instead of `from_pretrained`. Optional libraries (torchao, bitsandbytes) are imported
only by the scheme that needs them, behind an install hint. Knows modules and tensors; nothing about
requests, batching or the scheduler.

What runs where (measured on an AVX2-only CPU without fast bf16; see README "Quantization"):
- int8, CPU: weight-only, `Int8WeightOnlyLinear`: int8 weights with one symmetric bf16-rounded scale per
  output channel; activations stay unquantized. Inputs under NATIVE_ROWS rows (decode steps of small
  batches) run batchgen's own AVX2 kernel (`cpu_kernels`, float32 activations) where it is built; otherwise
  inputs under DEQUANT_ROWS rows run torch's `aten._weight_int8pack_mm` with bfloat16 activations; larger
  inputs (prefill, large batches) dequantize the layer's weights for one float32 GEMM. The model (norms,
  attention) computes in float32. Without batchgen's kernel, linears whose input size aten's kernel cannot
  take stay float. Without either kernel (older torch) the fallback, with a warning, is
  `torch.ao.quantization.quantize_dynamic` (activations quantized too: lower fidelity).
- int8, CUDA: torchao `Int8WeightOnlyConfig`.
- int4, CPU: weight-only, `Int4WeightOnlyLinear`: group-wise asymmetric int4 (a bf16 scale and min per 64
  input weights), two weights to a byte in the layout of batchgen's AVX2 kernel (`cpu_kernels`), which runs
  inputs under INT4_NATIVE_ROWS rows in float32; larger inputs dequantize the layer's weights for a float GEMM.
  The LM head is stored as int8 (Int8WeightOnlyLinear). Where batchgen's kernels are not built: torchao
  `PrototypeInt4WeightOnlyConfig` (group 128), its kernel in bfloat16; in a float32 model each quantized linear
  is then a bf16 island (`cpu_linear.CastLinear`) and the rest of the model computes in float32.
- int4, CUDA: torchao `Int4WeightOnlyConfig` with the tinygemm tile-packed layout, bfloat16 compute.
- bnb-int8, bnb-nf4: bitsandbytes through `BitsAndBytesConfig`, CUDA only.
With int8, and with batchgen's int4, the input embedding table is stored as int8 rows with one scale per row
(`Int8Embedding`).
A scheme measured slower than the unquantized model at the CPU working batch, on the CPU kind it is built on, logs a
warning when it is built (CPU_WORKING_BATCH_VS_UNQUANTIZED).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engines import cpu_kernels
from batchgen.engines.cpu_linear import CastLinear, replace_linears
from batchgen.errors import ConfigError, ModelLoadError

log = logging.getLogger(__name__)

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
# Output tokens/s at the CPU working batch (64 rows) over the unquantized model's at engine.dtype=auto, per CPU kind
# (cpu_kind), measured with benchmarks/quantization.py (README "Quantization"): on the AVX2 EPYC against float32, on
# the Zen 4 EPYC (AVX-512 BF16) against bf16 GEMMs with float32 kernels between them. A scheme under 0.9 on the CPU
# kind it is built on logs a warning with the figure: the engine does not switch schemes on its own, it says so.
# A kind without figures (not measured) logs nothing. torchao: the fallback's figure, where batchgen's kernels are
# not built.
CPU_WORKING_BATCH_VS_UNQUANTIZED: dict[str, dict[str, float]] = {
    "avx2": {"int8": 0.90, "int4": 0.81, "int4-torchao": 0.56},  # median of 3 repeats
    "avx512_bf16": {"int8": 0.70, "int4": 0.65},  # one repeat; torchao's int4 not measured there
}
TORCHAO_HINT = "pip install 'batchgen[quant]' (torchao)"
BNB_HINT = "pip install 'batchgen[bnb]' (bitsandbytes, CUDA only)"


@dataclass(frozen=True, slots=True)
class Scheme:
    """One value of `engine.quantization` for the hf engine."""

    name: str
    dtypes: dict[str, tuple[str, ...]]  # device type -> compute dtypes it runs in, preferred first
    requires: str  # the optional package it imports (torchao, bitsandbytes) or "" for none
    load_kwargs: Optional[Callable[[torch.dtype], dict[str, Any]]] = None  # extra from_pretrained kwargs
    why_not: dict[str, str] = field(default_factory=dict)  # device type -> why it does not run there

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self.dtypes)


# -- int8 -------------------------------------------------------------------------------------------

class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows, each with its own scale; looks up, then dequantizes."""

    def __init__(self, weight: torch.Tensor):  # weight: [V, H] float
        super().__init__()
        scale = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127  # [V, 1]
        self.register_buffer("qweight", torch.round(weight.float() / scale).to(torch.int8))
        self.register_buffer("scale", scale.to(weight.dtype))
        self.embedding_dim = weight.shape[1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [...] -> [..., H]
        return self.qweight[ids].to(self.scale.dtype) * self.scale[ids]


def quantize_embeddings_int8(model: nn.Module) -> None:
    embed = model.get_input_embeddings()
    if isinstance(embed, nn.Embedding) and embed.weight is not getattr(model.get_output_embeddings(), "weight", None):
        model.set_input_embeddings(Int8Embedding(embed.weight.data))


class Int8WeightOnlyLinear(nn.Module):
    """`nn.Linear` with int8 weights and one symmetric bf16 scale per output channel (weight-only: activations
    are not quantized). Inputs of fewer than NATIVE_ROWS rows go through batchgen's AVX2 kernel (float32) where
    it is built; else inputs of fewer than DEQUANT_ROWS rows go through torch's CPU kernel
    `aten._weight_int8pack_mm` in bfloat16 (its fast dtype; the result comes back in the input's dtype);
    larger inputs dequantize the weights, transiently, and run a GEMM in the input's dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()  # [N, K]
        # the scale is rounded to bf16 first and the weights quantized against the rounded scale, so that
        # qweight * scale is the nearest int8 grid point to each weight under the scale the kernel multiplies by
        scale = (weight.abs().amax(dim=1).clamp(min=1e-8) / 127).to(torch.bfloat16)  # [N]
        qweight = torch.round(weight / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        self._hold(qweight, scale, None if linear.bias is None else linear.bias.detach().clone())

    def _hold(self, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale)
        self.register_buffer("scale_f32", scale.float(), persistent=False)  # what the native kernel multiplies by
        self.native = cpu_kernels.load()  # batchgen's AVX2 kernel for few rows; None where it does not run
        self.native_rows = NATIVE_ROWS if self.native is not None else 0  # see route_rows
        self.dequant_rows = DEQUANT_ROWS
        self.gemm_dtype: Optional[torch.dtype] = None  # the dequantized GEMM's (None: the input's); set_gemm_dtype
        self.register_buffer("bias", bias)

    @classmethod
    def concatenate(cls, parts: list[nn.Module]) -> Optional[Int8WeightOnlyLinear]:
        """One module whose output is the parts' outputs side by side: `fuse` for llama_step.fuse_projections.
        Scales are per output channel, so this is exactly the int8 version of the concatenated float weights."""
        if not all(type(p) is cls for p in parts):
            return None
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        biased = any(p.bias is not None for p in parts)
        bias = torch.cat([p.bias if p.bias is not None else p.scale.new_zeros(p.out_features, dtype=torch.float32)
                          for p in parts]) if biased else None
        fused._hold(torch.cat([p.qweight for p in parts]), torch.cat([p.scale for p in parts]), bias)
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if 0 < rows < self.native_rows:
            y = cpu_kernels.int8_gemm(self.native, x2.float().contiguous(), self.qweight, self.scale_f32,
                                   None if self.bias is None else self.bias.float())
            return y.to(x.dtype).view(*lead, self.out_features)
        if rows >= self.dequant_rows or rows == 0 or self.in_features % INT8_K_MULTIPLE:
            dtype = self.gemm_dtype or x.dtype
            weight = self.qweight.to(dtype).mul_(self.scale.to(dtype)[:, None])  # [N, K], freed on return
            bias = None if self.bias is None else self.bias.to(dtype)
            return F.linear(x.to(dtype), weight, bias).to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        a = x2.to(torch.bfloat16).contiguous()
        if a.data_ptr() % 64:  # the kernel's vector loads of the input rows need aligned memory
            a = a.clone()
        y = torch.ops.aten._weight_int8pack_mm(a, self.qweight, self.scale)
        y = y.to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def route_rows(model: nn.Module, native_rows: Optional[int] = None, dequant_rows: Optional[int] = None) -> int:
    """Set which kernel each int8/int4 weight-only linear of `model` runs, by the number of input rows: under
    `native_rows`, batchgen's AVX2 kernel (int8: only where it is built); int8 then under `dequant_rows`, aten's
    kernel; otherwise dequantized weights and a float GEMM. None means the engine's default (NATIVE_ROWS,
    DEQUANT_ROWS; INT4_NATIVE_ROWS for int4). Tests and the benchmark use it to send every input through one
    path. Returns how many modules were set."""
    count = 0
    for module in model.modules():
        if isinstance(module, Int8WeightOnlyLinear):
            wanted = NATIVE_ROWS if native_rows is None else native_rows
            module.native_rows = wanted if module.native is not None else 0
            module.dequant_rows = DEQUANT_ROWS if dequant_rows is None else dequant_rows
        elif isinstance(module, Int4WeightOnlyLinear):
            module.native_rows = INT4_NATIVE_ROWS if native_rows is None else native_rows
        else:
            continue
        count += 1
    return count


def set_gemm_dtype(model: nn.Module, dtype: Optional[torch.dtype]) -> int:
    """The dtype the int8/int4 weight-only linears of `model` run their dequantized GEMMs in (inputs of many rows:
    prefill). bf16 on a CPU with native bf16 (where its GEMMs ran ~2.7x float32's on the benchmark's shapes); the
    kernels for few rows and the rest of the model stay float32. None: the input's dtype. Returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, (Int8WeightOnlyLinear, Int4WeightOnlyLinear)):
            module.gemm_dtype = dtype
            count += 1
    return count


def int8_weight_only_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def _int8_kernel_takes(linear: nn.Module) -> bool:
    """A plain float CPU nn.Linear whose input size the kernels handle. `aten._weight_int8pack_mm` reads the input
    dimension in blocks of 8 (16 with AVX-512) with aligned vector loads and no remainder loop: other input sizes
    give wrong results or crash (seen here with 12 and 100), and the op does not check, so they are not probed.
    batchgen's own kernel takes any size; where it is built, such linears never reach aten's kernel."""
    return (type(linear) is nn.Linear and linear.weight.device.type == "cpu" and linear.weight.is_floating_point()
            and (linear.in_features % INT8_K_MULTIPLE == 0 or cpu_kernels.load() is not None))


def int8_weight_only_linears(model: nn.Module) -> tuple[int, int]:
    """Replace every plain nn.Linear the kernel takes by an Int8WeightOnlyLinear, in place, one layer at
    a time (the float weight is dropped as soon as its int8 copy exists); returns (converted, skipped)."""
    return replace_linears(model, lambda linear: Int8WeightOnlyLinear(linear) if _int8_kernel_takes(linear) else None)


def int8_cpu(model: nn.Module, device: torch.device) -> nn.Module:
    """int8 weight-only linears (per-output-channel scales, `aten._weight_int8pack_mm`), int8 embedding rows."""
    if not int8_weight_only_kernel():
        log.warning("this torch build has no aten._weight_int8pack_mm: int8 on cpu falls back to torch's dynamic "
                    "int8 linears (activations quantized per tensor: lower fidelity)")
        return int8_cpu_dynamic(model, device)
    converted, skipped = int8_weight_only_linears(model)
    small = (f"batchgen's AVX2 kernel under {NATIVE_ROWS} rows" if cpu_kernels.load() is not None
             else f"aten._weight_int8pack_mm in bfloat16 under {DEQUANT_ROWS} rows")
    log.info("int8 weight-only: %d linears converted, %d left in float (input size not a multiple of %d); small "
             "inputs run %s, larger ones dequantize the layer's weights for a float32 GEMM", converted, skipped,
             INT8_K_MULTIPLE, small)
    quantize_embeddings_int8(model)
    return model


def int8_cpu_dynamic(model: nn.Module, device: torch.device) -> nn.Module:
    """fbgemm dynamic int8 linears: int8 weights per output channel, activations quantized on the fly."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.ao.quantization is deprecated, still shipped
        warnings.simplefilter("ignore", UserWarning)  # ... and says so for each quantized tensor it creates
        torch.backends.quantized.engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "fbgemm"
        model = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
    quantize_embeddings_int8(model)
    return model


def int8_cuda(model: nn.Module, device: torch.device) -> nn.Module:
    torchao = import_or_hint("torchao.quantization", TORCHAO_HINT, "engine.quantization=int8 on cuda")
    torchao.quantize_(model, torchao.Int8WeightOnlyConfig())
    quantize_embeddings_int8(model)
    return model


# -- int4 -------------------------------------------------------------------------------------------

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
    """q: [N, K] uint8 in [0, 15], K a multiple of 64 -> [N, K / 2] uint8 in the kernel's layout (cpu_kernels.c):
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
        """One module whose output is the parts' outputs side by side (`fuse` for llama_step.fuse_projections);
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
        return cpu_kernels.int4_dequantize(self.native, self.qweight, self.scale, self.mins, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if 0 < x2.shape[0] < self.native_rows:
            y = cpu_kernels.int4_gemm(self.native, x2.float().contiguous(), self.qweight, self.scale, self.mins,
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


def concatenate(parts: list[nn.Module]) -> Optional[nn.Module]:
    """`fuse` for llama_step.fuse_projections: one int8 or int4 module for parts quantized alike; else None."""
    kind = type(parts[0])
    if kind in (Int8WeightOnlyLinear, Int4WeightOnlyLinear):
        return kind.concatenate(parts)
    return None


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


# -- bitsandbytes (quantized while loading) ---------------------------------------------------------

def bnb_kwargs(kind: str) -> Callable[[torch.dtype], dict[str, Any]]:
    def kwargs(dtype: torch.dtype) -> dict[str, Any]:
        import_or_hint("bitsandbytes", BNB_HINT, f"engine.quantization=bnb-{kind}")
        from transformers import BitsAndBytesConfig

        if kind == "int8":
            return {"quantization_config": BitsAndBytesConfig(load_in_8bit=True)}
        return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                          bnb_4bit_compute_dtype=dtype)}
    return kwargs


CUDA_ONLY = "bitsandbytes' kernels need CUDA"
SCHEMES: dict[str, Scheme] = {
    "int8": Scheme("int8", {"cpu": ("float32", "bfloat16"), "cuda": ("bfloat16", "float16")}, requires=""),
    "int4": Scheme("int4", {"cpu": ("bfloat16", "float32"), "cuda": ("bfloat16",)}, requires="torchao"),
    "bnb-int8": Scheme("bnb-int8", {"cuda": ("bfloat16", "float16", "float32")}, requires="bitsandbytes",
                       load_kwargs=bnb_kwargs("int8"), why_not={"cpu": CUDA_ONLY}),
    "bnb-nf4": Scheme("bnb-nf4", {"cuda": ("bfloat16", "float16", "float32")}, requires="bitsandbytes",
                      load_kwargs=bnb_kwargs("nf4"), why_not={"cpu": CUDA_ONLY}),
}
CONVERTERS = {("int8", "cpu"): int8_cpu, ("int8", "cuda"): int8_cuda,
              ("int4", "cpu"): int4_cpu, ("int4", "cuda"): int4_cuda}


# -- what the config and the engine call ------------------------------------------------------------

def check(scheme_name: Optional[str], device: str, dtype: str) -> list[str]:
    """Config problems of `engine.quantization` with `engine.device` and `engine.dtype`, before any load."""
    if scheme_name is None:
        return []
    scheme = SCHEMES[scheme_name]
    kind = device_type(device)
    if kind not in scheme.dtypes:
        reason = scheme.why_not.get(kind, f"no {scheme_name} kernels for {kind}")
        where = f"engine.device={device}" + (f" (resolves to {kind}: no CUDA device)" if device == "auto" else "")
        return [f"engine.quantization={scheme_name} does not run with {where}: {reason}; "
                f"supported devices: {', '.join(scheme.devices)}"]
    problems = []
    allowed = scheme.dtypes[kind]
    if dtype != "auto" and dtype not in allowed:
        problems.append(f"engine.quantization={scheme_name} on {kind} computes in {' or '.join(allowed)}; "
                        f"engine.dtype={dtype} is not supported; choices: auto, {', '.join(allowed)}")
    package = "torchao" if (scheme_name, kind) == ("int8", "cuda") else scheme.requires
    if (scheme_name, kind) == ("int4", "cpu") and cpu_kernels.load() is not None:
        package = ""  # batchgen's own int4 kernel (built here, about 1 s the first time); else torchao (int4_cpu)
    if package and importlib.util.find_spec(package) is None:
        hint = BNB_HINT if package == "bitsandbytes" else TORCHAO_HINT
        problems.append(f"engine.quantization={scheme_name} on {kind} needs {package}, not installed: {hint}")
    return problems


def compute_dtype(scheme_name: Optional[str], device: torch.device, resolved: torch.dtype) -> torch.dtype:
    """The dtype to load in: the engine's own choice unless the scheme's kernels need another."""
    if scheme_name is None:
        return resolved
    allowed = [getattr(torch, name) for name in SCHEMES[scheme_name].dtypes[device.type]]
    if resolved in allowed:
        return resolved
    log.info("quantization %s on %s computes in %s (engine.dtype=auto would pick %s without it)",
             scheme_name, device.type, allowed[0], resolved)
    return allowed[0]


def load_model(path: str, *, scheme_name: Optional[str], device: torch.device, dtype: torch.dtype,
               trust_remote_code: bool) -> nn.Module:
    """from_pretrained, placement on the device, then the scheme's conversion; eval mode."""
    from transformers import AutoModelForCausalLM

    scheme = SCHEMES[scheme_name] if scheme_name else None
    kwargs = scheme.load_kwargs(dtype) if scheme and scheme.load_kwargs else {}
    if kwargs:
        kwargs["device_map"] = {"": device}  # bitsandbytes places while loading; .to() is refused afterwards
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
    except (ImportError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(explain_load_failure(path, device, exc)) from exc
    if not kwargs:
        model = model.to(device)
    if scheme is not None and scheme.load_kwargs is None:
        model = CONVERTERS[(scheme.name, device.type)](model, device)
        log.info("quantized %s to %s on %s: %.1f MB of weights", path, scheme.name, device.type,
                 weight_bytes(model) / 1e6)
        if device.type == "cpu":
            warn_if_slow_at_working_batch(scheme.name, model)
    return model.eval()


def cpu_kind() -> str:
    """The CPU kind the working-batch figures are kept for: avx512_bf16 (native bf16 dot products), avx512, avx2,
    or other."""
    from batchgen.engines.cpu_runtime import cpu_flags, has_native_bf16

    flags = cpu_flags()
    if has_native_bf16():
        return "avx512_bf16"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "other"


def warn_if_slow_at_working_batch(scheme_name: str, model: Optional[nn.Module] = None) -> None:
    """Say so when the scheme decoded large batches slower than the unquantized model on a CPU of this kind."""
    if scheme_name == "int4" and model is not None and not any(
            isinstance(m, Int4WeightOnlyLinear) for m in model.modules()):
        scheme_name = "int4-torchao"  # batchgen's kernels are not built here: torchao's int4 runs
    kind = cpu_kind()
    ratio = CPU_WORKING_BATCH_VS_UNQUANTIZED.get(kind, {}).get(scheme_name)
    if ratio is None or ratio >= 0.9:
        return
    if scheme_name == "int8" and model is not None and not any(
            isinstance(m, Int8WeightOnlyLinear) for m in model.modules()):
        return  # the dynamic-int8 fallback: the figure is not its own
    log.warning("%s on this CPU decodes large batches slower than the unquantized model: %.2fx its output tokens/s "
                "at batch 64 with engine.dtype=auto, measured on a CPU of this kind (%s; README \"Quantization\"); "
                "use it when the model does not fit in memory unquantized, or for batch-1 jobs, where it measured "
                "faster", scheme_name, ratio, kind)


def explain_load_failure(path: str, device: torch.device, exc: Exception) -> str:
    """Name a pre-quantized checkpoint's method when loading it fails (GPTQ/AWQ kernels are mostly CUDA-only)."""
    method = checkpoint_quant_method(path)
    if method is None:
        return f"loading {path} failed: {exc}"
    return (f"loading {path} failed: it is a pre-quantized {method} checkpoint and its kernels could not run on "
            f"{device.type} (many GPTQ/AWQ kernels need CUDA, and an extra package such as gptqmodel, autoawq "
            f"or compressed-tensors); leave engine.quantization null for such checkpoints. Cause: {exc}")


def checkpoint_quant_method(path: str) -> Optional[str]:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return None
    qcfg = getattr(config, "quantization_config", None)
    if isinstance(qcfg, dict):
        return qcfg.get("quant_method")
    return getattr(qcfg, "quant_method", None)


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's weights as stored: parameters, buffers and quantized packed weights."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor_bytes(tensor)
    for module in model.modules():
        packed = getattr(module, "_packed_params", None)  # torch.ao dynamic quantized Linear
        if packed is not None and hasattr(packed, "_weight_bias"):
            weight, bias = packed._weight_bias()
            total += tensor_bytes(weight) + (tensor_bytes(bias) if bias is not None else 0)
    return total


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage of a tensor; tensor subclasses (torchao) are counted by their inner tensors."""
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name)) for name in names)
    if t.is_quantized:
        extra = 0
        if t.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            extra = t.q_per_channel_scales().nbytes + t.q_per_channel_zero_points().nbytes
        return t.numel() * t.element_size() + extra
    return t.numel() * t.element_size()


def device_type(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def import_or_hint(module: str, hint: str, needed_by: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError([f"{needed_by} needs {module.split('.')[0]}: {hint}"]) from exc
