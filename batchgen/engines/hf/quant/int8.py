"""int8 on CPU: W8A8 (quant/w8a8.py) where it is exact, else weight-only; int8 weight-only (`int8_wo`): one
symmetric bf16-rounded scale per output channel, activations not quantized (on CPU batchgen's kernel or aten's for
few rows, a dequantized GEMM for many; torchao on CUDA); int8 embedding rows. quant/__init__.py says what runs
where."""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engines.hf.backends.cpu import kernels as cpu_kernels
from batchgen.engines.hf.backends.cpu import ops as cpu_ops
from batchgen.engines.hf.backends.cpu.onednn import replace_linears
from batchgen.engines.hf.backends.cpu.runtime import CheckpointPages
from batchgen.engines.hf.quant import w8a8
from batchgen.engines.hf.quant.common import (
    DEQUANT_ROWS,
    INT8_K_MULTIPLE,
    NATIVE_ROWS,
    TORCHAO_HINT,
    import_or_hint,
    quantize_by_rows,
)

log = logging.getLogger(__name__)


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows, each with its own scale; looks up, then dequantizes."""

    def __init__(self, weight: torch.Tensor):  # weight: [V, H] float
        super().__init__()
        def rows(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            scale = block.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127  # [r, 1]
            return torch.round(block.float() / scale).to(torch.int8), scale.to(weight.dtype)

        qweight, scale = quantize_by_rows(weight.detach(), rows)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.embedding_dim = weight.shape[1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [...] -> [..., H]
        return self.qweight[ids].to(self.scale.dtype) * self.scale[ids]


def quantize_embeddings_int8(model: nn.Module) -> None:
    """The input embedding table as int8 rows (unless the LM head shares it); its checkpoint pages given back."""
    embed = model.get_input_embeddings()
    if isinstance(embed, nn.Embedding) and embed.weight is not getattr(model.get_output_embeddings(), "weight", None):
        model.set_input_embeddings(Int8Embedding(embed.weight.data))
        CheckpointPages().release(embed.weight)


class Int8WeightOnlyLinear(nn.Module):
    """`nn.Linear` with int8 weights and one symmetric bf16 scale per output channel (weight-only: activations
    are not quantized). Inputs of fewer than NATIVE_ROWS rows go through batchgen's AVX2 kernel (float32) where
    it is built; else inputs of fewer than DEQUANT_ROWS rows go through torch's CPU kernel
    `aten._weight_int8pack_mm` in bfloat16 (its fast dtype; the result comes back in the input's dtype);
    larger inputs dequantize the weights, transiently, and run a GEMM in the input's dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        def rows(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            block = block.float()
            # the scale is rounded to bf16 first and the weights quantized against the rounded scale, so that
            # qweight * scale is the nearest int8 grid point to each weight under the scale the kernel multiplies by
            scale = (block.abs().amax(dim=1).clamp(min=1e-8) / 127).to(torch.bfloat16)  # [r]
            return torch.round(block / scale.float()[:, None]).clamp(-127, 127).to(torch.int8), scale

        qweight, scale = quantize_by_rows(linear.weight.detach(), rows)  # [N, K], [N]
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
        """One module whose output is the parts' outputs side by side: `fuse` for fusion.fuse_projections.
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
            y = cpu_ops.int8_gemm(self.native, x2.float().contiguous(), self.qweight, self.scale_f32,
                                   None if self.bias is None else self.bias.float())
            return y.to(x.dtype).view(*lead, self.out_features)
        if rows >= self.dequant_rows or rows == 0 or self.in_features % INT8_K_MULTIPLE:
            dtype = self.gemm_dtype or x.dtype
            weight = self.qweight.to(dtype).mul_(self.scale.to(dtype)[:, None])  # [N, K], freed on return
            bias = None if self.bias is None else self.bias.to(dtype)
            if self.native is None and x.dtype != torch.bfloat16:
                # without batchgen's kernel, fewer rows go through aten's int8 GEMM, which takes bf16 inputs and
                # gives bf16 outputs: round the same here, so that a row reads the same whatever its batch's size
                # (a prefill cut by the prefix cache, a shrinking decode batch)
                y = F.linear(x.to(torch.bfloat16).to(dtype), weight, None).to(torch.bfloat16).to(x.dtype)
                return y if bias is None else y + bias.to(x.dtype)
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
    """`engine.quantization=int8` on CPU: W8A8 linears (quant/w8a8.py) where oneDNN's int8 GEMM is exact here, else
    int8 weight-only (logged with the reason); int8 embedding rows either way."""
    why_not = w8a8.probe()
    if why_not is not None:
        log.warning("engine.quantization=int8 computes in int8 only where oneDNN's int8 GEMM is exact: %s. Running "
                    "int8 weight-only instead (engine.quantization=int8_wo asks for it explicitly)", why_not)
        return int8_wo_cpu(model, device)
    converted, kept = w8a8.w8a8_linears(model)
    log.info("int8 (W8A8): %d linears with int8 weights and per-token int8 activations (oneDNN), %d left in float",
             converted, kept)
    quantize_embeddings_int8(model)
    return model


def int8_wo_cpu(model: nn.Module, device: torch.device) -> nn.Module:
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
