"""The CUDA backend's stepper: a decode step with no host work inside, captured once per batch bucket as a CUDA graph.

The reference step (step.LlamaStepper) plans attention on the host every step (the common width, the long rows),
builds its inputs from Python lists and reads its picks back: on a GPU that host work, not the chip, sets the pace.
Here a decode step runs at a static shape, the bucket (1, 2, 4, ... rows up to the cache's slots; the live rows
first, the rest padding that writes only into free slots and whose outputs are dropped): its inputs sit in
preallocated buffers (the tokens, the cache and its lengths), attention reads each slot's own length from the device
(the Triton split-K kernel, attention.py), the greedy picks are made on the device, and nothing in the step calls
`.item()`, `.tolist()` or branches on a tensor's value. So the step is captured once per bucket
(`torch.cuda.CUDAGraph`, one memory pool for all buckets) and replayed; `engine.cuda_graphs=off` runs the same body
eagerly, `auto` falls back to eager with one warning where capture fails. A new cache (grown) invalidates the graphs.
Prefill keeps the prompts packed through attention too (prefill.py's varlen kernel over the slot cache, a cached
prefix or a chunked prompt's earlier chunks included): no padding anywhere, so the scheduler groups prompts by the
token budget alone (`packed_prefill`). Without the kernel, the reference's prefill (SDPA per padded group).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from batchgen.engines.hf.backends.cuda import attention, prefill
from batchgen.engines.hf.kvcache import SlotKVCache
from batchgen.engines.hf.step import LlamaStepper, _mlp

log = logging.getLogger(__name__)
GRAPH_MODES = ("auto", "on", "off")


@dataclass
class Bucket:
    """One static decode shape: `rows` rows, its input and output buffers, and its graph once captured."""

    rows: int
    tokens: torch.Tensor  # [rows] int64, the step's input tokens (live rows first)
    logits: torch.Tensor  # [rows, V] float32
    picks: torch.Tensor  # [rows] int64: each row's greedy pick (first index of the largest logit)
    graph: Any = None  # torch.cuda.CUDAGraph, or None (eager)


@dataclass(frozen=True)
class Packed:
    """One prefill's layout with the tokens packed throughout: row r's counts[r] new tokens at positions
    [starts[r], starts[r] + counts[r]) of slot slots[r]; each token's slot and position ([N] each) for the cache
    writes, the rotary embedding's cos and sin at those positions, and `pad` viewing [N, C] as [1, N, C]."""

    cache: SlotKVCache
    counts: list[int]
    starts: list[int]
    slots: list[int]
    slot_index: torch.Tensor
    positions: torch.Tensor
    cos_sin: Any

    @staticmethod
    def pad(t: torch.Tensor) -> torch.Tensor:
        return t[None]


class CudaStepper(LlamaStepper):
    def __init__(self, model: Any, dtype: Optional[torch.dtype] = None, graphs: str = "auto"):
        super().__init__(model, dtype)
        if graphs not in GRAPH_MODES:
            raise ValueError(f"engine.cuda_graphs must be one of {', '.join(GRAPH_MODES)}, not {graphs!r}")
        self.graphs = graphs if self.device.type == "cuda" else "off"  # graphs need CUDA; the body runs anywhere
        self.kernel = attention.available() and attention._runs_kernel(torch.empty(0, device=self.device))
        self.packed_prefill = self.kernel  # prefill attention without padding (the scheduler groups by tokens only)
        self.buckets: dict[int, Bucket] = {}
        self.cache: Optional[SlotKVCache] = None  # the cache the buckets' graphs read
        self.pool: Any = None  # the graphs' shared memory pool
        self.vocab = model.get_output_embeddings().weight.shape[0]

    def describe(self) -> str:
        attend = ("batchgen's Triton split-K decode attention" if self.kernel
                  else "masked torch attention over the cache")
        run = f"CUDA graphs {self.graphs}" if self.graphs != "off" else "eager"
        packed = ", prefill packed (Triton varlen attention)" if self.packed_prefill else ""
        return f"static-shape decode per batch bucket ({run}), {attend}, greedy picks on the device{packed}"

    def _prefill_batch(self, cache: SlotKVCache, first_slot: int, lengths: list[int], starts: Optional[list[int]],
                       x: torch.Tensor) -> Any:
        """The packed layout (Packed) where the varlen kernel runs; else the reference's padded one."""
        if not self.packed_prefill:
            return super()._prefill_batch(cache, first_slot, lengths, starts, x)
        starts = starts or [0] * len(lengths)
        slots = list(range(first_slot, first_slot + len(lengths)))
        counts = torch.tensor(lengths)  # each token's slot and position from per-row tensors, not a Python loop
        first = torch.cumsum(counts, 0) - counts  # each row's first token among the packed ones
        offsets = torch.arange(int(counts.sum())) - first.repeat_interleave(counts)
        slot_index = torch.tensor(slots).repeat_interleave(counts).to(self.device)
        positions = (torch.tensor(starts).repeat_interleave(counts) + offsets).to(self.device)
        return Packed(cache, lengths, starts, slots, slot_index, positions,
                      self.inner.rotary_emb(x, positions[None]))

    def _prefill_attention(self, i: int, layer: Any, h: Any, batch: Any) -> torch.Tensor:
        """Layer i's keys and values written at each token's slot and position, then each token's attention over its
        slot (prefill.py): [N, heads * d], packed as the tokens came."""
        if not isinstance(batch, Packed):
            return super()._prefill_attention(i, layer, h, batch)
        q, k, v = (t.to(self.dtype)[0].transpose(0, 1) for t in self._qkv(layer.self_attn, h, batch.cos_sin,
                                                                             batch.pad))  # [N, heads, d]
        cache = batch.cache
        cache.k[i, batch.slot_index, :, batch.positions] = k.to(cache.k.dtype)
        cache.v[i, batch.slot_index, :, batch.positions] = v.to(cache.v.dtype)
        out = prefill.prefill_attention(q, cache.k[i], cache.v[i], batch.counts, batch.starts, batch.slots,
                                        self.scaling)
        return out.reshape(q.shape[0], -1)

    def decode_picks(self, cache: SlotKVCache, tokens: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Logits [n, V] and the greedy picks [n] of one decode step for the live slots [0, n): the step of the
        smallest bucket holding n rows, replayed from its graph where captured."""
        n = tokens.shape[0]
        if max(cache.host_lengths[:n]) >= cache.max_len:
            raise IndexError(f"a decode step past the KV cache's {cache.max_len} positions")
        bucket = self._bucket(cache, n)
        bucket.tokens[:n].copy_(tokens, non_blocking=True)
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            self.step(cache, bucket)
        cache.advance(n)
        return bucket.logits[:n], bucket.picks[:n]

    def step(self, cache: SlotKVCache, bucket: Bucket) -> None:
        """The decode step's body at the bucket's shape: reads bucket.tokens and the cache (its lengths included),
        writes this step's keys and values at each row's length and bucket.logits / bucket.picks. Graph-safe: fixed
        shapes, no host read, no branch on a value. Padded rows (past the live ones) sit in free slots: what they
        write there is overwritten when a row is admitted, and their outputs are never read."""
        rows = bucket.rows
        positions = cache.lengths[:rows].clamp(max=cache.max_len - 1)  # a free slot's stale length stays in range
        x = self.inner.embed_tokens(bucket.tokens[:, None])  # [rows, 1, hidden]
        cos_sin = self.inner.rotary_emb(x, positions[:, None])
        index = torch.arange(rows, device=self.device)
        lengths = positions + 1  # this step's token included
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer.self_attn, layer.input_layernorm(x), cos_sin)
            cache.k[i, index, :, positions] = k[:, :, 0].to(cache.k.dtype)
            cache.v[i, index, :, positions] = v[:, :, 0].to(cache.v.dtype)
            out = self._attend(q[:, :, 0], cache.k[i], cache.v[i], lengths)  # [rows, heads, d]
            x = x + layer.self_attn.o_proj(out.reshape(rows, 1, -1).to(x.dtype))
            x = x + _mlp(layer.mlp, layer.post_attention_layernorm(x))
        logits = self.model.lm_head(self.inner.norm(x[:, 0]))
        bucket.logits.copy_(logits)
        torch.argmax(bucket.logits, dim=-1, out=bucket.picks)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor:
        """Each row over its own length, read on the device: the Triton kernel where it runs, else masked torch."""
        if self.kernel:
            return attention.decode_attention(q, k_cache, v_cache, lengths, self.scaling)
        return masked_attention(q, k_cache, v_cache, lengths, self.scaling)

    def _bucket(self, cache: SlotKVCache, n: int) -> Bucket:
        """The smallest bucket (a power of two, at most the cache's slots) holding n rows, made and captured on first
        use; every bucket is dropped when the cache is another (grown)."""
        if cache is not self.cache:
            self.buckets, self.cache, self.pool = {}, cache, None
        rows = min(1 << (n - 1).bit_length(), cache.slots)
        bucket = self.buckets.get(rows)
        if bucket is None:
            bucket = self.buckets[rows] = Bucket(
                rows, torch.zeros(rows, dtype=torch.long, device=self.device),
                torch.zeros(rows, self.vocab, dtype=torch.float32, device=self.device),
                torch.zeros(rows, dtype=torch.long, device=self.device))
            if self.graphs != "off":
                self._capture(cache, bucket)
        return bucket

    def _capture(self, cache: SlotKVCache, bucket: Bucket) -> None:
        """Record the bucket's step as a CUDA graph (after a warm-up run on a side stream, as capture requires).
        The warm-up and capture write into the cache at each slot's length: the live rows' writes are redone by the
        real step, the free slots' are garbage no one reads; the step never advances lengths. Under `auto` a failed
        capture leaves the bucket eager, with one warning."""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.step(cache, bucket)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                self.step(cache, bucket)
            bucket.graph = graph
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager under auto, raised under on
            if self.graphs == "on":
                raise
            log.warning("CUDA graph capture of the %d-row decode step failed (%s: %s); running it eagerly "
                        "(engine.cuda_graphs=auto)", bucket.rows, type(exc).__name__, exc)
            self.graphs = "off"


def masked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v for row r (slot r) over positions [0, lengths[r]), in float32, by masking the whole
    cache width: no host read (graph-safe), every position read (the kernel's job is not to). q: [n, heads, d];
    caches [slots, kv_heads, max_len, d]; returns [n, heads, d] in q's dtype."""
    n, heads, d = q.shape
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    keys, values = k_cache[:n].float(), v_cache[:n].float()  # [n, kv_heads, L, d]
    queries = q.float().reshape(n, kv_heads, group, d)
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale  # [n, kv_heads, group, L]
    valid = torch.arange(max_len, device=q.device)[None, :] < lengths[:n, None]  # [n, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [n, kv_heads, group, d]
    return out.reshape(n, heads, d).to(q.dtype)
