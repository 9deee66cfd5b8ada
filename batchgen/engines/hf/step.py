"""Prefill and decode steps for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) on a SlotKVCache.

The model's own modules (embeddings, norms, projections, rotary embedding, MLP, LM head) are called
as they are; only attention and the cache are ours: decode attention reads the pre-allocated cache,
each row over its own length, through batchgen's CPU kernel (float32 on CPU, `cpu_kernels`) or
through views with a mask and torch's batched matmuls (AttentionPlan). `fusion.fuse_projections` can merge
each layer's q/k/v and gate/up projections into one GEMM each, which the stepper then calls instead.
With fused projections in a float32 model on CPU, a decode step runs batchgen's kernels between the
GEMMs as well (RMSNorm; rotary embedding, cache write and attention in one call; SiLU-and-multiply):
`_decode_native`, the same arithmetic in a few calls per layer instead of ~50 torch operations.
Around W8A8 linears (engine.quantization=int8) those kernels write the quantized rows the int8 GEMM reads and
apply the row scales of the one before (`_linear_unscaled`). Other architectures take the generic path (generic.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from batchgen.engines.hf.backends.cpu import kernels as cpu_kernels
from batchgen.engines.hf.backends.cpu import onednn
from batchgen.engines.hf.kvcache import AttentionPlan, SlotKVCache
from batchgen.engines.hf.quant.w8a8 import Int8DynamicLinear, QuantizedRows

Activations = torch.Tensor | QuantizedRows  # a GEMM's input: float32, bfloat16, or quantized rows for a W8A8 GEMM

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def supports(model: Any, max_len: int) -> bool:
    """True when the fast path computes exactly what the model's own forward does."""
    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED:
        return False
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and window < max_len:
        return False
    return all(hasattr(model.model, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb"))


@dataclass(frozen=True)
class _PrefillBatch:
    """What every layer of one prefill shares: where the prompts go in the cache, their padded shape ([n, T], with
    `valid` marking real tokens, None when none is padded, and `pad` making [N, C] into [n, T, C]), the attention
    over a cached prefix (None: plain causal attention), and the rotary embedding's cos and sin."""

    cache: SlotKVCache
    first_slot: int
    n: int
    width: int
    lengths: list[int]  # each row's tokens computed here
    valid: Optional[torch.Tensor]
    pad: Callable[[torch.Tensor], torch.Tensor]
    attend: Optional[Callable[..., torch.Tensor]]
    cos_sin: Any


class LlamaStepper:
    def __init__(self, model: Any, dtype: Optional[torch.dtype] = None, kv_dtype: Optional[torch.dtype] = None):
        """dtype: the activations' (float32 around bf16 GEMMs, onednn.mixed_bf16); default the model's parameters'.
        kv_dtype: the KV cache's where the native step runs (bf16 around bf16 GEMMs: half the bytes each decode step
        streams); elsewhere the cache is in `dtype`."""
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.kv_heads = model.config.num_key_value_heads
        self.heads = model.config.num_attention_heads
        self.scaling = attn.scaling
        self.qkv_split = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        self.dtype = dtype or next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        # batchgen's decode attention kernel (cpu_kernels) where it is built; torch's batched matmuls otherwise
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
        if self.row_exact:  # torch's CPU attention summed its first call of a process differently on two threads
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
        kernel = "batchgen's CPU decode attention kernel" if self.native is not None else "torch's batched attention"
        return f"{kernel}, the model's own norms, rotary embedding and MLP"

    def new_cache(self, slots: int, max_len: int) -> SlotKVCache:
        return SlotKVCache(layers=len(self.layers), slots=slots, kv_heads=self.kv_heads, max_len=max_len,
                           head_dim=self.head_dim, dtype=self.kv_dtype, device=self.device)

    def prefill(self, cache: SlotKVCache, first_slot: int, prompts: list[list[int]],
                starts: Optional[list[int]] = None, every: bool = False) -> torch.Tensor:
        """Run prompts into slots [first_slot, first_slot + n); logits of each last token: [n, V]. every=True: every
        token's final hidden state instead, packed [N, hidden] (task=loglik applies the LM head where it scores).

        The GEMMs, norms and MLP run over the prompts' tokens only, packed one after another ([N, hidden]); only
        attention sees them right-padded to the longest ([n, T]): padding cost GEMM work (11% of the benchmark
        workload's prefill tokens) and nothing else needs it. The attention runs in float32 around bf16 GEMMs too
        (torch's bf16 flash attention on CPU measured slower: 0.89 s against 0.75 s over the benchmark workload).
        `starts[i]`: positions [0, starts[i]) of row i's slot already hold its prompt's prefix (prefix.py); only the
        rest is computed, at positions from starts[i], attending over the cached prefix too."""
        full = [len(p) for p in prompts]
        starts = starts if starts and any(starts) else None
        if starts is not None:
            prompts = [p[s:] for p, s in zip(prompts, starts)]
        lengths = [len(p) for p in prompts]
        n, width = len(prompts), max(lengths)
        ids = torch.tensor([token for p in prompts for token in p], dtype=torch.long, device=self.device)
        x = self.inner.embed_tokens(ids)  # [N, hidden]
        valid = None if min(lengths) == width else (  # [n, T]: which padded positions hold a token
            torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).to(self.device)

        def pad(t: torch.Tensor) -> torch.Tensor:  # [N, C] -> [n, T, C]
            if valid is None:
                return t.view(n, width, t.shape[-1])
            padded = t.new_zeros((n, width, t.shape[-1]))
            padded[valid] = t
            return padded

        positions = torch.arange(width, device=self.device).expand(n, width)
        attend = None
        if starts is not None:
            positions = positions + torch.tensor(starts, device=self.device)[:, None]
            attend = self._after_prefix(cache, first_slot, starts, lengths, positions)
        batch = _PrefillBatch(cache, first_slot, n, width, lengths, valid, pad, attend,
                              self.inner.rotary_emb(x, positions))
        h = None
        if self.native_step:  # batchgen's RMSNorm (fused with the residual adds) and SiLU, over every prompt token
            x = x.contiguous()
            h = self._norm(self.layers[0].input_layernorm, x, self.gemm_inputs[0][0])
        for i, layer in enumerate(self.layers):
            x, h = self._prefill_layer(i, layer, x, h, batch)
        cache.set_lengths(first_slot, full)
        if every:
            return self._norm(self.inner.norm, x.contiguous()) if self.native_step else self.inner.norm(x)
        ends = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        if self.native_step:  # the final norm and LM head as a decode step runs them (each row alone)
            h = self._norm(self.inner.norm, x[ends].contiguous(), self.head_input)
            return _linear(self.model.lm_head, h).float()
        return self.model.lm_head(self.inner.norm(x[ends])).float()  # [n, hidden] -> [n, V]

    def _prefill_layer(self, i: int, layer: nn.Module, x: torch.Tensor, h: Optional[torch.Tensor],
                       batch: _PrefillBatch) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Decoder layer i over the packed prompt tokens: x is the residual stream [N, hidden]; on the native step h
        is x normed for this layer (its GEMM input dtype). Returns both for the next layer (the native step adds
        into x in place and norms for the next layer here)."""
        if not self.native_step:
            h = layer.input_layernorm(x)
        q, k, v = (t.to(self.dtype) for t in self._qkv(layer.self_attn, h, batch.cos_sin, batch.pad))
        if batch.attend is None:
            batch.cache.write_prefill(i, batch.first_slot, k, v)  # [n, kv_heads, T, d], in the cache's dtype
            if self.row_exact and batch.valid is not None:  # each row over its own length only
                out = self._per_row(q, k, v, [(length, length, None) for length in batch.lengths])
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=True)
        else:
            out = batch.attend(i, q, k, v)
        out = out.transpose(1, 2).reshape(batch.n, batch.width, -1)  # [n, T, heads * d]
        attended = layer.self_attn.o_proj(out.view(-1, out.shape[-1]) if batch.valid is None else out[batch.valid])
        if not self.native_step:
            x = x + attended
            return x + _mlp(layer.mlp, layer.post_attention_layernorm(x)), None
        _, _, gate_up_in, down_in = self.gemm_inputs[i]
        h = self._add_norm(x, attended, None, layer.post_attention_layernorm, gate_up_in)
        down, down_scale = self._mlp_native(layer.mlp, h, down_in)
        if i + 1 < len(self.layers):  # the next layer's input norm (its GEMM input dtype)
            return x, self._add_norm(x, down, down_scale, self.layers[i + 1].input_layernorm,
                                     self.gemm_inputs[i + 1][0])
        return x.add_(_scaled(layer.mlp.down_proj, down, down_scale)), None  # after the last layer, the add alone

    def _after_prefix(self, cache: SlotKVCache, first_slot: int, starts: list[int], counts: list[int],
                      positions: torch.Tensor) -> Callable[..., torch.Tensor]:
        """Prefill attention for rows whose slots hold a prefix: each layer writes the new keys and values after it,
        then the queries attend over the slot's positions [0, start + t] (their own and the cached prefix's)."""
        n, width = positions.shape
        span = max(s + c for s, c in zip(starts, counts))
        keys = torch.arange(span, device=self.device)
        real = torch.arange(width, device=self.device)[None, :] < torch.tensor(counts, device=self.device)[:, None]
        # [n, 1, T, span]: causal over the slot's positions; padded queries see position 0 (their output is dropped)
        mask = ((keys[None, None, :] <= positions[:, :, None]) & real[:, :, None]) | (keys == 0)[None, None, :]
        mask = mask[:, None]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.write_after(layer, first_slot, starts, k, v, counts)
            keys_, values = (t[layer, first_slot:first_slot + n, :, :span].to(self.dtype) for t in (cache.k, cache.v))
            if self.row_exact:  # each row over its own prefix and tokens only
                return self._per_row(q, keys_, values, [(c, s + c, mask[r:r + 1, :, :c, :s + c])
                                                        for r, (s, c) in enumerate(zip(starts, counts))])
            return F.scaled_dot_product_attention(q, keys_, values, attn_mask=mask, scale=self.scaling,
                                                  enable_gqa=True)
        return attend

    def _per_row(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rows: list[tuple[int, int, Optional[torch.Tensor]]]) -> torch.Tensor:
        """Prefill attention a row at a time, each sliced to rows[r] = (queries, keys, mask): its sums are those of the
        row alone (a padded batch's width changes torch's blocking). Padded query positions come out zero."""
        out = q.new_zeros(q.shape)
        for r, (queries, keys, mask) in enumerate(rows):
            out[r:r + 1, :, :queries] = F.scaled_dot_product_attention(
                q[r:r + 1, :, :queries], k[r:r + 1, :, :keys], v[r:r + 1, :, :keys], attn_mask=mask,
                is_causal=mask is None, scale=self.scaling, enable_gqa=True)
        return out

    def decode(self, cache: SlotKVCache, tokens: torch.Tensor) -> torch.Tensor:
        return self.decode_picks(cache, tokens)[0]  # one token for each live slot [0, n): tokens [n] -> logits [n, V]

    def decode_picks(self, cache: SlotKVCache, tokens: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """decode()'s logits, and each row's greedy pick ([n] int64, the first largest logit) where the LM head's own
        pass gave it (a W8A8 LM head: its row scales and the picks in one pass, a row at a time); else None."""
        if self.native_step and self.native is not None:
            return self._decode_native(cache, tokens)
        n = tokens.shape[0]
        positions = cache.lengths[:n]
        attend = self._native_attention(cache, n) if self.native is not None else self._torch_attention(cache, n)
        x = self.inner.embed_tokens(tokens[:, None])  # [n, 1, hidden]
        cos_sin = self.inner.rotary_emb(x, positions[:, None])
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            q, k, v = self._qkv(layer.self_attn, h, cos_sin)
            cache.append(i, k, v)
            out = attend(i, q)  # [n, heads * d]
            x = x + layer.self_attn.o_proj(out[:, None, :])
            x = x + _mlp(layer.mlp, layer.post_attention_layernorm(x))
        cache.advance(n)
        return self.model.lm_head(self.inner.norm(x[:, 0])), None

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
            out = cpu_kernels.decode_layer_attention(self.native, qkv, cos, sin, cache.k[i], cache.v[i], positions,
                                                     self.heads, self.scaling, _float_kind(o_in))
            if o_in == torch.uint8:
                out = QuantizedRows(*cpu_kernels.quantize_rows(self.native, out))
            h = self._add_norm(x, *_linear_unscaled(attn.o_proj, out), layer.post_attention_layernorm, gate_up_in)
            down, down_scale = self._mlp_native(mlp, h, down_in)
            last = i + 1 == len(self.layers)  # then the final norm, for the LM head
            h = self._add_norm(x, down, down_scale, self.inner.norm if last else self.layers[i + 1].input_layernorm,
                               self.head_input if last else self.gemm_inputs[i + 1][0])
        cache.advance(n)
        logits, scale = _linear_unscaled(self.model.lm_head, h)
        if scale is None:
            return logits.float(), None
        return logits, cpu_kernels.scale_rows_argmax(self.native, logits, scale, None)

    def _mlp_native(self, mlp: Any, h: Activations,
                    down_in: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The MLP on batchgen's kernels: gate/up GEMM, SiLU-and-multiply (writing down's input kind), down GEMM.
        Returns down's output and, for a W8A8 down projection, the row scales still to apply (else None)."""
        gate_up, scale = _linear_unscaled(mlp.gate_up_proj, h)
        if down_in == torch.uint8:
            act: Activations = QuantizedRows(*cpu_kernels.silu_mul_u8(self.native, gate_up.contiguous(), scale))
        else:
            act = cpu_kernels.silu_mul(self.native, _scaled(mlp.gate_up_proj, gate_up, scale).contiguous(), down_in)
        return _linear_unscaled(mlp.down_proj, act)

    def _norm(self, norm: Any, x: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> Activations:
        if out_dtype == torch.uint8:
            return QuantizedRows(*cpu_kernels.add_rms_norm_u8(self.native, x, None, None, norm.weight,
                                                              norm.variance_epsilon))
        return cpu_kernels.rms_norm(self.native, x, norm.weight, norm.variance_epsilon, out_dtype)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor, delta_scale: Optional[torch.Tensor], norm: Any,
                  out_dtype: torch.dtype) -> Activations:
        """x += delta (times delta_scale per row where given: a W8A8 GEMM's output), the residual stream, in place;
        then norm(x) in out_dtype (uint8: quantized rows for a W8A8 GEMM): one kernel pass."""
        if out_dtype == torch.uint8 and delta.dtype == torch.float32:
            return QuantizedRows(*cpu_kernels.add_rms_norm_u8(self.native, x, delta.contiguous(), delta_scale,
                                                              norm.weight, norm.variance_epsilon))
        if delta_scale is not None:
            delta = cpu_kernels.scale_rows(self.native, delta.contiguous(), delta_scale, None)
        h = cpu_kernels.add_rms_norm(self.native, x, delta.contiguous(), norm.weight, norm.variance_epsilon,
                                     _float_kind(out_dtype))
        return QuantizedRows(*cpu_kernels.quantize_rows(self.native, h)) if out_dtype == torch.uint8 else h

    def _native_attention(self, cache: SlotKVCache, n: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
        lengths = cache.lengths[:n] + 1  # with the token appended this step

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:  # q: [n, heads, 1, d]
            out = cpu_kernels.decode_attention(self.native, q.reshape(n, self.heads, self.head_dim).contiguous(),
                                               cache.k[layer], cache.v[layer], lengths, self.scaling)
            return out.view(n, self.heads * self.head_dim)

        return attend

    def _torch_attention(self, cache: SlotKVCache, n: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
        positions = cache.lengths[:n]
        plan = AttentionPlan.for_lengths([length + 1 for length in cache.host_lengths[:n]])
        valid = torch.arange(plan.width, device=self.device)[None, :] <= positions[:, None]  # [n, width]
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=self.device).masked_fill_(~valid, float("-inf"))

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            keys, values = cache.view(layer, n, plan.width)  # [n, kv_heads, width, d]
            out = self._decode_attention(q, keys, values, bias)  # [n, heads * d]
            for row, length in plan.long_rows:  # rows past the common width: each over its own length
                keys, values = cache.view_row(layer, row, length)
                out[row] = self._decode_attention(q[row:row + 1], keys, values, None)[0]
            return out

        return attend

    def _qkv(self, attn: Any, h: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
             pad: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        """q [n, heads, T, d], k and v [n, kv_heads, T, d], rotated, from h [n, T, hidden], or from packed tokens
        h [N, hidden] and `pad` laying them out as [n, T, ...]."""
        fused = getattr(attn, "qkv_proj", None)
        if fused is not None:
            qkv = _linear(fused, h)
            q, k, v = (pad(qkv) if pad is not None else qkv).split(self.qkv_split, dim=-1)
        else:
            q, k, v = (pad(t) if pad is not None else t for t in (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)))
        shape = (*q.shape[:2], -1, self.head_dim)  # [n, T, heads, d]
        q, k = q.view(shape), k.view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        v = v.view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *cos_sin)
        return q, k, v

    def _decode_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          bias: Optional[torch.Tensor]) -> torch.Tensor:
        """q: [n, heads, 1, d]; keys, values: [n, kv_heads, L, d]; bias: [n, L] (0 or -inf), None = all valid."""
        n = q.shape[0]
        group = self.heads // self.kv_heads
        q = q.reshape(n, self.kv_heads, group, self.head_dim)  # query head j*group+g reads KV head j
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * self.scaling  # [n, kv_heads, group, L]
        if bias is not None:
            scores = scores + bias[:, None, None, :]
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).reshape(n, self.heads * self.head_dim)


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


RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")  # weight * x / sqrt(mean(x^2) + eps), in float32


def _mlp(mlp: Any, h: torch.Tensor) -> torch.Tensor:
    fused = getattr(mlp, "gate_up_proj", None)
    if fused is None:
        return mlp(h)
    gate, up = fused(h).chunk(2, dim=-1)
    return mlp.down_proj(mlp.act_fn(gate) * up)
