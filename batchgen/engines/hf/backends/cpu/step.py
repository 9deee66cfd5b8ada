"""The CPU backend's stepper: step.LlamaStepper with batchgen's C kernels where they run.

In a float32 model on CPU, decode attention reads the cache through batchgen's kernel (each row over its own
length, `cpu_ops.decode_attention`). With fused projections (fusion.fuse_projections), a decode step runs batchgen's
kernels between the GEMMs as well (RMSNorm; rotary embedding, cache write and attention in one call;
SiLU-and-multiply): `_decode_native`, the same arithmetic in a few calls per layer instead of ~50 torch operations,
and the prefill normalises and activates with the same kernels. Around W8A8 (W4A8) linears (engine.quantization=
int8/int4) those kernels write the quantized rows the int8 GEMM reads and apply the row scales of the one before
(`_linear_unscaled`); the GEMMs then sum in exact int32 and the step is per row, so prefill attention runs per row
too (`row_exact`): a row's tokens do not depend on the rows beside it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engines.hf.backends.cpu import kernels as cpu_kernels
from batchgen.engines.hf.backends.cpu import onednn
from batchgen.engines.hf.backends.cpu import ops as cpu_ops
from batchgen.engines.hf.kvcache import SlotKVCache
from batchgen.engines.hf.quant.w8a8 import Int8DynamicLinear, QuantizedRows
from batchgen.engines.hf.step import Attend, LlamaStepper, PrefillBatch

Activations = torch.Tensor | QuantizedRows  # a GEMM's input: float32, bfloat16, or quantized rows for a W8A8 GEMM
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")  # weight * x / sqrt(mean(x^2) + eps), in float32


class CpuStepper(LlamaStepper):
    def __init__(self, model: Any, dtype: Optional[torch.dtype] = None, kv_dtype: Optional[torch.dtype] = None):
        """dtype: the activations' (float32 around bf16 GEMMs, onednn.mixed_bf16); default the model's parameters'.
        kv_dtype: the KV cache's where the native step runs (bf16 around bf16 GEMMs: half the bytes each decode step
        streams); elsewhere the cache is in `dtype`."""
        super().__init__(model, dtype)
        # batchgen's decode attention kernel where it is built; torch's batched matmuls otherwise
        self.native = (cpu_kernels.load() if self.device.type == "cpu" and self.dtype == torch.float32
                       and self.head_dim % 8 == 0 else None)
        # a decode step of batchgen's kernels between the GEMMs (see _decode_native) where the model allows it
        self.native_step = (self.native is not None and self.head_dim % 16 == 0
                            and all(map(_native_layer, self.layers)) and type(self.inner.norm).__name__ in RMS_NORMS)
        # what each GEMM of the native step reads: bf16 for a bf16 PackedLinear (onednn.mixed_bf16), so the
        # kernel before it writes bf16 and no conversion pass runs; float32 otherwise
        self.gemm_inputs = [tuple(_input_dtype(m) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                           layer.mlp.gate_up_proj, layer.mlp.down_proj))
                            for layer in self.layers] if self.native_step else []
        self.head_input = _input_dtype(model.lm_head)
        # W8A8 GEMMs sum in exact int32 and the rest of a step is per row, so with prefill attention per row as well a
        # row's tokens do not depend on which rows share its batches (a resumed job writes what an uninterrupted one
        # did); float GEMMs block their sums by batch shape, so there the padded batch's one call stays
        self.row_exact = bool(self.gemm_inputs) and all(torch.uint8 in kinds for kinds in self.gemm_inputs)
        # torch's CPU attention summed its first call of a process differently on two threads: one call here, so a
        # resumed job's first rows (a fresh process) are summed as an uninterrupted job's later ones
        if self.device.type == "cpu":
            z = torch.zeros(1, 2, 4, self.head_dim)
            F.scaled_dot_product_attention(z, z, z, is_causal=True)
        self.kv_dtype = kv_dtype if self.native_step and kv_dtype is not None else self.dtype

    def describe(self) -> str:
        """Which decode step runs, for the engine's log."""
        if self.native_step:
            kinds = self.gemm_inputs[0]
            gemms = ("W8A8/W4A8 int8 GEMMs (quantization fused into the kernels)" if torch.uint8 in kinds
                     else "bf16 GEMMs" if torch.bfloat16 in kinds else "GEMMs")
            return (f"batchgen's CPU kernels ({self.native.batchgen_isa().decode()}) between the {gemms} (RMSNorm, "
                    f"rotary embedding + attention, SiLU), KV cache in {str(self.kv_dtype).removeprefix('torch.')}")
        if self.native is not None:
            return "batchgen's CPU decode attention kernel, the model's own norms, rotary embedding and MLP"
        return super().describe()

    # -- prefill: batchgen's RMSNorm (fused with the residual adds) and SiLU over every prompt token ----------------

    def _prefill_begin(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if not self.native_step:
            return x, None
        x = x.contiguous()  # added into in place
        return x, self._norm(self.layers[0].input_layernorm, x, self.gemm_inputs[0][0])

    def _final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(self.inner.norm, x.contiguous()) if self.native_step else super()._final_hidden(x)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        if not self.native_step:
            return super()._head(x)
        # the final norm and LM head as a decode step runs them (each row alone)
        return _linear(self.model.lm_head, self._norm(self.inner.norm, x, self.head_input)).float()

    def _prefill_layer(self, i: int, layer: nn.Module, x: torch.Tensor, h: Any,
                       batch: PrefillBatch) -> tuple[torch.Tensor, Any]:
        """Decoder layer i over the packed prompt tokens: x is the residual stream [N, hidden]; on the native step h
        is x normed for this layer (its GEMM input dtype). Returns both for the next layer (the native step adds
        into x in place and norms for the next layer here)."""
        if not self.native_step:
            return super()._prefill_layer(i, layer, x, h, batch)
        attended = layer.self_attn.o_proj(self._prefill_attention(i, layer, h, batch))
        _, _, gate_up_in, down_in = self.gemm_inputs[i]
        h = self._add_norm(x, attended, None, layer.post_attention_layernorm, gate_up_in)
        down, down_scale = self._mlp_native(layer.mlp, h, down_in)
        if i + 1 < len(self.layers):  # the next layer's input norm (its GEMM input dtype)
            return x, self._add_norm(x, down, down_scale, self.layers[i + 1].input_layernorm,
                                     self.gemm_inputs[i + 1][0])
        return x.add_(_scaled(layer.mlp.down_proj, down, down_scale)), None  # after the last layer, the add alone

    def _project(self, module: Any, h: Activations) -> torch.Tensor:
        return _linear(module, h)

    # -- decode ----------------------------------------------------------------------------------------------------

    def decode_picks(self, cache: SlotKVCache, tokens: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """decode()'s logits, and each row's greedy pick ([n] int64, the first largest logit) where the LM head's own
        pass gave it (a W8A8 LM head: its row scales and the picks in one pass, a row at a time); else None."""
        if self.native_step:
            return self._decode_native(cache, tokens)
        return super().decode_picks(cache, tokens)

    def _decode_attend(self, cache: SlotKVCache, n: int) -> Attend:
        if self.native is None:
            return super()._decode_attend(cache, n)
        lengths = cache.lengths[:n] + 1  # with the token appended this step

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:  # q: [n, heads, 1, d]
            out = cpu_ops.decode_attention(self.native, q.reshape(n, self.heads, self.head_dim).contiguous(),
                                               cache.k[layer], cache.v[layer], lengths, self.scaling)
            return out.view(n, self.heads * self.head_dim)

        return attend

    def _decode_native(self, cache: SlotKVCache, tokens: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """decode_picks() with batchgen's CPU kernels between the GEMMs (RMSNorm, SiLU-and-multiply; rotary embedding,
        cache write and attention in one call a layer) instead of ~50 torch operations a layer. decode()'s arithmetic
        up to rounding: RMSNorm's and attention's sum order, the polynomial exp (relative error ~1e-7)."""
        n = tokens.shape[0]
        if max(cache.host_lengths[:n]) >= cache.max_len:  # the kernel writes without bounds checks
            raise IndexError(f"a decode step past the KV cache's {cache.max_len} positions")
        positions = cache.lengths[:n]  # where each row's new key and value go
        x = self.inner.embed_tokens(tokens).contiguous()  # [n, hidden] float32: the residual stream, added to in place
        cos, sin = (t.reshape(n, self.head_dim).contiguous() for t in self.inner.rotary_emb(x, positions[:, None]))
        h = self._norm(self.layers[0].input_layernorm, x, self.gemm_inputs[0][0])
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            _, o_in, gate_up_in, down_in = self.gemm_inputs[i]  # bf16 GEMMs get bf16 inputs (no conversion)
            qkv = _linear(attn.qkv_proj, h).contiguous()  # bf16 out of a bf16 GEMM: the kernel widens it as it reads
            out = cpu_ops.decode_layer_attention(self.native, qkv, cos, sin, cache.k[i], cache.v[i], positions,
                                                     self.heads, self.scaling, _float_kind(o_in))
            if o_in == torch.uint8:
                out = QuantizedRows(*cpu_ops.quantize_rows(self.native, out))
            h = self._add_norm(x, *_linear_unscaled(attn.o_proj, out), layer.post_attention_layernorm, gate_up_in)
            down, down_scale = self._mlp_native(mlp, h, down_in)
            last = i + 1 == len(self.layers)  # then the final norm, for the LM head
            h = self._add_norm(x, down, down_scale, self.inner.norm if last else self.layers[i + 1].input_layernorm,
                               self.head_input if last else self.gemm_inputs[i + 1][0])
        cache.advance(n)
        logits, scale = _linear_unscaled(self.model.lm_head, h)
        if scale is None:
            return logits.float(), None
        return logits, cpu_ops.scale_rows_argmax(self.native, logits, scale, None)

    def _mlp_native(self, mlp: Any, h: Activations,
                    down_in: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The MLP on batchgen's kernels: gate/up GEMM, SiLU-and-multiply (writing down's input kind), down GEMM.
        Returns down's output and, for a W8A8 down projection, the row scales still to apply (else None)."""
        gate_up, scale = _linear_unscaled(mlp.gate_up_proj, h)
        if down_in == torch.uint8:
            act: Activations = QuantizedRows(*cpu_ops.silu_mul_u8(self.native, gate_up.contiguous(), scale))
        else:
            act = cpu_ops.silu_mul(self.native, _scaled(mlp.gate_up_proj, gate_up, scale).contiguous(), down_in)
        return _linear_unscaled(mlp.down_proj, act)

    def _norm(self, norm: Any, x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> Activations:
        if out_dtype == torch.uint8:
            return QuantizedRows(*cpu_ops.add_rms_norm_u8(self.native, x, None, None, norm.weight,
                                                              norm.variance_epsilon))
        return cpu_ops.rms_norm(self.native, x, norm.weight, norm.variance_epsilon, out_dtype)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor, delta_scale: Optional[torch.Tensor], norm: Any,
                  out_dtype: torch.dtype) -> Activations:
        """x += delta (times delta_scale per row where given: a W8A8 GEMM's output), the residual stream, in place;
        then norm(x) in out_dtype (uint8: quantized rows for a W8A8 GEMM): one kernel pass."""
        if out_dtype == torch.uint8 and delta.dtype == torch.float32:
            return QuantizedRows(*cpu_ops.add_rms_norm_u8(self.native, x, delta.contiguous(), delta_scale,
                                                              norm.weight, norm.variance_epsilon))
        if delta_scale is not None:
            delta = cpu_ops.scale_rows(self.native, delta.contiguous(), delta_scale, None)
        h = cpu_ops.add_rms_norm(self.native, x, delta.contiguous(), norm.weight, norm.variance_epsilon,
                                     _float_kind(out_dtype))
        return QuantizedRows(*cpu_ops.quantize_rows(self.native, h)) if out_dtype == torch.uint8 else h


def _native_layer(layer: Any) -> bool:
    """A layer _decode_native computes as the model does: fused q/k/v (no per-head q/k norm) and gate/up, SiLU,
    and RMSNorms that scale by their weight (Llama's, Mistral's, Qwen2's)."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (hasattr(attn, "qkv_proj") and not hasattr(attn, "q_norm") and hasattr(mlp, "gate_up_proj")
            and type(getattr(mlp, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
            and all(type(norm).__name__ in RMS_NORMS and norm.weight.dtype == torch.float32 for norm in norms))


def _input_dtype(module: Any) -> torch.dtype:
    """bf16 for a bf16 oneDNN GEMM (it would convert a float32 input itself), uint8 (quantized rows) for a W8A8 one
    with batchgen's kernels, else float32."""
    if isinstance(module, Int8DynamicLinear) and module.lib is not None:
        return torch.uint8
    bf16 = isinstance(module, onednn.PackedLinear) and module.packed.dtype == torch.bfloat16
    return torch.bfloat16 if bf16 else torch.float32


def _float_kind(dtype: torch.dtype) -> torch.dtype:
    """What a kernel writes for a GEMM input of `dtype`: float32 for quantized rows (quantized from it)."""
    return torch.float32 if dtype == torch.uint8 else dtype


def _linear(module: Any, h: Activations) -> torch.Tensor:
    """module(h), for float inputs and quantized rows alike."""
    y, scale = _linear_unscaled(module, h)
    return _scaled(module, y, scale)


def _linear_unscaled(module: Any, h: Activations) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """module(h) as (y, None), or, for quantized rows into a W8A8 GEMM without a bias, (y before its row scales, the
    row scales): the next kernel applies them as it reads y."""
    if not isinstance(h, QuantizedRows):
        return module(h), None
    y = module.matmul(h)
    return (y, h.scale) if module.bias is None else (module.finish(y, h.scale), None)


def _scaled(module: Any, y: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    return y if scale is None else module.finish(y, scale)
