"""Prefill attention without padding: a Triton flash-attention kernel over packed prompts and the slot KV cache.

The reference prefill (step.py) runs its GEMMs over the packed tokens but pads them for attention ([n, T], T the
longest prompt of the group), and attends over a cached prefix through a dense mask. Here the new tokens stay packed
([N, heads, d], row r's tokens at offsets [q_start[r], q_start[r] + count[r])), their keys and values are written
into each row's slot first, and each query attends causally over its slot's positions [0, start[r] + t]: the cached
prefix (engine.prefix_cache), the earlier chunks of a chunked prompt and its own chunk alike. One program per (block
of BLOCK_M queries of a row, row, query head) runs an online softmax (float32) over the key blocks up to the block's
last query, so no work is spent on padding or on keys past the causal edge; grouped-query heads read their KV head.

Prefill is not graph-captured: the launch grid is sized from the rows' counts on the host. Triton is optional (the
base install has none): without it, or on CPU tensors outside the interpreter, `prefill_attention` computes
`prefill_attention_reference` (plain torch, row by row). Knows tensors, not models.
"""

from __future__ import annotations

import torch

from batchgen.engines.hf.backends.cuda.attention import LOG2E, MAX_HEAD_DIM, _jit, _runs_kernel, interpreted

try:
    import triton
    import triton.language as tl
except ImportError:  # the base install: prefill_attention computes the reference
    triton = tl = None

BLOCK_M = 32  # queries per program
BLOCK_N = 32  # cache positions per inner iteration


@_jit
def _causal_block(q, k_base, v_base, pos, end, positions, offs_d, d_mask, m_i, l_i, acc, stride_kt, stride_kd,
                  stride_vt, stride_vd, qk_scale, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """The block of BLOCK_N slot positions from `pos` (those from `end` on never loaded) folded into the queries'
    running max `m_i`, sum `l_i` and weighted value sum `acc`, each query over the positions up to its own."""
    offs_n = pos + tl.arange(0, BLOCK_N)
    kv_mask = (offs_n < end)[:, None] & d_mask[None, :]
    k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    # causal over the slot: a query sees positions up to its own (position 0 always: m_new stays finite)
    s = tl.where(offs_n[None, :] <= positions[:, None], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@_jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, qstart_ptr, count_ptr, start_ptr, slot_ptr,
                    stride_qn, stride_qh, stride_qd, stride_kn, stride_kh, stride_kt, stride_kd,
                    stride_vn, stride_vh, stride_vt, stride_vd, stride_on, stride_oh, stride_od,
                    qk_scale, group, head_dim, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    DOT_F32: tl.constexpr):
    block, row, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(count_ptr + row)
    q_first = tl.load(qstart_ptr + row)
    start = tl.load(start_ptr + row)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)  # the queries' indices among the row's new tokens
    offs_d = tl.arange(0, BLOCK_D)
    io_mask = (offs_m < count)[:, None] & (offs_d < head_dim)[None, :]
    q = tl.load(q_ptr + (q_first + offs_m)[:, None] * stride_qn + head * stride_qh + offs_d[None, :] * stride_qd,
                mask=io_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    # keys [0, end): up to the block's last real query (none where the block is past the row's tokens)
    end = tl.where(block * BLOCK_M < count, start + tl.minimum(count, (block + 1) * BLOCK_M), 0)
    slot, kv_head = tl.load(slot_ptr + row), head // group
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for pos in range(0, end, BLOCK_N):
        m_i, l_i, acc = _causal_block(q, k_ptr + slot * stride_kn + kv_head * stride_kh,
                                      v_ptr + slot * stride_vn + kv_head * stride_vh, pos, end, start + offs_m,
                                      offs_d, offs_d < head_dim, m_i, l_i, acc, stride_kt, stride_kd, stride_vt,
                                      stride_vd, qk_scale, BLOCK_N, DOT_F32)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_first + offs_m)[:, None] * stride_on + head * stride_oh + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, counts: list[int],
                      starts: list[int], slots: list[int], scale: float) -> torch.Tensor:
    """Causal attention of packed new tokens over their slots' cached positions.

    q: [N, heads, d], rows one after another (row r: counts[r] tokens at positions [starts[r], starts[r] +
    counts[r]) of slot slots[r], whose keys and values are in the caches already, every earlier position too);
    k_cache, v_cache: one layer's [slots, kv_heads, max_len, d]. Returns [N, heads, d] in q's dtype."""
    _check(q, k_cache, v_cache, counts, starts, slots)
    if not _runs_kernel(q):
        return prefill_attention_reference(q, k_cache, v_cache, counts, starts, slots, scale)
    heads, d = q.shape[1], q.shape[2]
    out = torch.empty_like(q)
    if not counts or max(counts) == 0:
        return out
    first = [0]
    for count in counts[:-1]:
        first.append(first[-1] + count)
    meta = torch.tensor([first, counts, starts, slots], dtype=torch.int32).to(q.device, non_blocking=True)
    block_d = max(16, triton.next_power_of_2(d))
    grid = (triton.cdiv(max(counts), BLOCK_M), len(counts), heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, meta[0], meta[1], meta[2], meta[3], *q.stride(), *k_cache.stride(),
        *v_cache.stride(), *out.stride(), scale * LOG2E, heads // k_cache.shape[1], d, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        DOT_F32=k_cache.dtype == torch.float32 or (interpreted() and k_cache.dtype == torch.bfloat16))
    return out


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, counts: list[int],
                                starts: list[int], slots: list[int], scale: float) -> torch.Tensor:
    """The same in plain torch, float32, row by row: row r's queries over its slot's positions [0, starts[r] +
    counts[r]), causally."""
    heads = q.shape[1]
    group = heads // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    first = 0
    for count, start, slot in zip(counts, starts, slots):
        end = start + count
        k = k_cache[slot, :, :end].float().repeat_interleave(group, dim=0)  # [heads, end, d]
        v = v_cache[slot, :, :end].float().repeat_interleave(group, dim=0)
        queries = q[first:first + count].float().transpose(0, 1)  # [heads, count, d]
        scores = torch.matmul(queries, k.transpose(-1, -2)) * scale  # [heads, count, end]
        causal = torch.arange(end, device=q.device)[None, :] <= torch.arange(start, end, device=q.device)[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[first:first + count] = torch.matmul(scores.softmax(dim=-1), v).transpose(0, 1)
        first += count
    return out.to(q.dtype)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, counts: list[int], starts: list[int],
           slots: list[int]) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q [N, heads, d] and equal caches [slots, kv_heads, max_len, d] expected: q "
                         f"{tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    if not len(counts) == len(starts) == len(slots) or sum(counts) != q.shape[0]:
        raise ValueError(f"{len(counts)} counts, {len(starts)} starts and {len(slots)} slots for {q.shape[0]} "
                         f"packed tokens")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[1] or q.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if any(s + c > k_cache.shape[2] for s, c in zip(starts, counts)):
        raise ValueError(f"a row runs past the cache's {k_cache.shape[2]} positions")


__all__ = ["prefill_attention", "prefill_attention_reference"]
