"""The reference prefill and decode steps for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) on a SlotKVCache.

Plain torch on any device: the model's own modules (embeddings, norms, projections, rotary embedding, MLP, LM head)
are called as they are; only attention and the cache are ours. Prefill packs the prompts' tokens and pads them only
for attention (torch's SDPA); decode attention reads the pre-allocated cache, each row over its own length, through
views with a mask and torch's batched matmuls (kvcache.AttentionPlan). `fusion.fuse_projections` can merge each
layer's q/k/v and gate/up projections into one GEMM each, which the stepper then calls instead.

Each device's backend (backends/) builds its stepper on this one, overriding the hooks below (`_project`, the decode
attention, the decode step itself); the tests compare every backend's steps against this class. Other architectures
take the generic path (generic.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from batchgen.engines.hf.kvcache import AttentionPlan, SlotKVCache

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
Attend = Callable[[int, torch.Tensor], torch.Tensor]  # (layer, q [n, heads, 1, d]) -> [n, heads * d]


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
class PrefillBatch:
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
        """dtype: the activations' (default the model's parameters'); the KV cache is in `dtype` (a backend may keep
        it in `kv_dtype`, see backends/cpu/step.py)."""
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
        self.kv_dtype = self.dtype
        # prefill attention a row at a time (its sums those of the row alone), where a backend's GEMMs make a row's
        # tokens independent of its neighbours (backends/cpu/step.py: exact int32 W8A8 GEMMs)
        self.row_exact = False
        self.kv_budget_bytes: Optional[int] = None  # the KV cache's bound (a backend sizes it from device memory)
        self.packed_prefill = False  # prefill attention over packed tokens (no padding): the scheduler then groups
        # prompts by the token budget alone (backends/cuda/step.py)

    def describe(self) -> str:
        """Which decode step runs, for the engine's log."""
        return "torch's batched attention, the model's own norms, rotary embedding and MLP"

    def new_cache(self, slots: int, max_len: int) -> SlotKVCache:
        return SlotKVCache(layers=len(self.layers), slots=slots, kv_heads=self.kv_heads, max_len=max_len,
                           head_dim=self.head_dim, dtype=self.kv_dtype, device=self.device)

    def cache_bytes(self, slots: int, max_len: int) -> int:
        """The keys and values new_cache(slots, max_len) holds, every layer."""
        size = torch.empty(0, dtype=self.kv_dtype).element_size()
        return 2 * len(self.layers) * slots * self.kv_heads * max_len * self.head_dim * size

    def prefill(self, cache: SlotKVCache, first_slot: int, prompts: list[list[int]],
                starts: Optional[list[int]] = None) -> torch.Tensor:
        """Run prompts into slots [first_slot, first_slot + n); the logits of each prompt's last token: [n, V].

        The GEMMs, norms and MLP run over the prompts' tokens only, packed one after another ([N, hidden]); only
        attention sees them right-padded to the longest ([n, T]): padding cost GEMM work (11% of the benchmark
        workload's prefill tokens) and nothing else needs it. `starts[i]`: positions [0, starts[i]) of row i's slot
        already hold its prompt's prefix (prefix.py); only the rest is computed, at positions from starts[i],
        attending over the cached prefix too."""
        x, lengths = self._prefill_layers(cache, first_slot, prompts, starts)
        ends = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        return self._head(x[ends].contiguous())  # [n, hidden] -> [n, V]

    def prefill_hidden(self, cache: SlotKVCache, first_slot: int, prompts: list[list[int]],
                       starts: Optional[list[int]] = None) -> torch.Tensor:
        """prefill(), but every computed token's final hidden state (after the model's last norm), packed [N, hidden]
        (task=loglik and task=embed apply the LM head or pool where they score)."""
        return self._final_hidden(self._prefill_layers(cache, first_slot, prompts, starts)[0])

    def _prefill_layers(self, cache: SlotKVCache, first_slot: int, prompts: list[list[int]],
                        starts: Optional[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """Every layer over the prompts' tokens (after each row's cached prefix): the residual stream [N, hidden]
        and the tokens computed per row; the slots' lengths set to the whole prompts."""
        full = [len(p) for p in prompts]
        starts = starts if starts and any(starts) else None
        if starts is not None:
            prompts = [p[s:] for p, s in zip(prompts, starts)]
        lengths = [len(p) for p in prompts]
        ids = torch.tensor([token for p in prompts for token in p], dtype=torch.long, device=self.device)
        x = self.inner.embed_tokens(ids)  # [N, hidden]
        batch = self._prefill_batch(cache, first_slot, lengths, starts, x)
        x, h = self._prefill_begin(x)
        for i, layer in enumerate(self.layers):
            x, h = self._prefill_layer(i, layer, x, h, batch)
        cache.set_lengths(first_slot, full)
        return x, lengths

    def _prefill_batch(self, cache: SlotKVCache, first_slot: int, lengths: list[int], starts: Optional[list[int]],
                       x: torch.Tensor) -> PrefillBatch:
        """The shared layout of one prefill: padding for attention, positions, the prefix attention, rotary."""
        n, width = len(lengths), max(lengths)
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
        return PrefillBatch(cache, first_slot, n, width, lengths, valid, pad, attend,
                            self.inner.rotary_emb(x, positions))

    def _prefill_begin(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The residual stream the layers add into, and what the first layer gets as `h` beside it (a backend's
        normed input; None here)."""
        return x, None

    def _final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.norm(x)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head over the rows' last tokens [n, hidden]: float logits [n, V]."""
        return self.model.lm_head(self.inner.norm(x)).float()

    def _prefill_layer(self, i: int, layer: nn.Module, x: torch.Tensor, h: Any,
                       batch: PrefillBatch) -> tuple[torch.Tensor, Any]:
        """Decoder layer i over the packed prompt tokens; x is the residual stream [N, hidden]."""
        out = self._prefill_attention(i, layer, layer.input_layernorm(x), batch)
        x = x + layer.self_attn.o_proj(out)
        return x + _mlp(layer.mlp, layer.post_attention_layernorm(x)), None

    def _prefill_attention(self, i: int, layer: nn.Module, h: Any, batch: PrefillBatch) -> torch.Tensor:
        """Layer i's q/k/v from h, keys and values written to the cache, attention: [N, heads * d] packed again."""
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
        return out.view(-1, out.shape[-1]) if batch.valid is None else out[batch.valid]

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
        """decode()'s logits, and each row's greedy pick ([n] int64) where the step computed it (a backend's own
        step may); here None."""
        n = tokens.shape[0]
        positions = cache.lengths[:n]
        attend = self._decode_attend(cache, n)
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

    def _decode_attend(self, cache: SlotKVCache, n: int) -> Attend:
        """Decode attention for this step's n rows, each over its own length (this step's token included): views of
        the cache up to a common width, the few longer rows each over their own (kvcache.AttentionPlan)."""
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

    def _project(self, module: Any, h: Any) -> torch.Tensor:
        """module(h): a backend whose activations are not plain tensors (quantized rows) says how."""
        return module(h)

    def _qkv(self, attn: Any, h: Any, cos_sin: tuple[torch.Tensor, torch.Tensor],
             pad: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        """q [n, heads, T, d], k and v [n, kv_heads, T, d], rotated, from h [n, T, hidden], or from packed tokens
        h [N, hidden] and `pad` laying them out as [n, T, ...]."""
        fused = getattr(attn, "qkv_proj", None)
        if fused is not None:
            qkv = self._project(fused, h)
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


def _mlp(mlp: Any, h: torch.Tensor) -> torch.Tensor:
    fused = getattr(mlp, "gate_up_proj", None)
    if fused is None:
        return mlp(h)
    gate, up = fused(h).chunk(2, dim=-1)
    return mlp.down_proj(mlp.act_fn(gate) * up)
