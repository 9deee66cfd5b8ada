"""Decode attention over the slot KV cache as a Triton split-K ("flash-decoding") kernel: one query token per live
row, each row attending over its own cached length, grouped-query heads sharing their KV head's reads.

A decode step has few query rows, so one program per (row, head) leaves most of a GPU idle while a long row streams
its cache. Here each row's positions are cut into `num_splits` ranges: program (row, KV head, split) runs an online
softmax (running max, sum of exponentials, weighted value sum; float32) over its range for every query head of the
group at once, and writes a normalised partial output and its log-sum-exp to a float32 workspace; a second small
kernel combines a row's splits with their log-sum-exps into the output, in q's dtype.

CUDA-graph capture: `lengths` is read on the device only. The number of splits is a Python int from shapes (and the
device's SM count), so the grid and the workspace are fixed per batch bucket; each row's split length is worked out
in the kernel from its own length (an even share, rounded up to whole blocks), so a short row's work is not spread
over empty splits sized for `max_len`. Splits that start at or past a row's length run no iteration and leave a
log-sum-exp of -inf, which the combine weighs as zero; positions at or past a row's length are never loaded.

Triton is optional (the base install has none): without it, or on CPU tensors outside the interpreter,
`decode_attention` computes `decode_attention_reference` (plain torch, which reads the lengths on the host, so not
capturable). The kernels are decorated when this module is imported, and triton 3.9 decides in `triton.jit` itself
whether a kernel is compiled or interpreted (`knobs.runtime.interpret`, from TRITON_INTERPRET): to run them on CPU
tensors, set TRITON_INTERPRET=1 before importing this module. Knows tensors, not models.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the base install: decode_attention computes the reference
    triton = tl = None

BLOCK_N = 64  # cache positions per inner iteration (32 where the padded head dim exceeds 128)
MAX_HEAD_DIM = 256
MAX_SPLITS = 32  # the combine holds [splits, head_dim] float32 values in one program
WAVES = 2  # programs aimed at per SM when picking the number of splits
LOG2E = 1.4426950408889634  # the kernels work in base 2: exp2 is the hardware's exponential


def _jit(fn):
    """triton.jit where triton is importable; the plain function otherwise (never launched then)."""
    return triton.jit(fn) if triton is not None else fn


@_jit
def _block_step(q, k_base, v_base, pos, end, offs_d, d_mask, m_i, l_i, acc, stride_kt, stride_kd, stride_vt,
                stride_vd, qk_scale, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    """One block of BLOCK_N positions from `pos` (those from `end` on masked, never loaded) folded into the running
    max `m_i`, sum `l_i` and weighted value sum `acc` of the group's heads (base-2 online softmax)."""
    offs_n = pos + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    if DOT_F32:  # float32 products, not TF32 (see _launch_split)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the block's first position is below `end`
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@_jit
def _split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, part_ptr, lse_ptr, stride_qn, stride_qh, stride_qd, stride_kn,
                  stride_kh, stride_kt, stride_kd, stride_vn, stride_vh, stride_vt, stride_vd, stride_pn, stride_ph,
                  stride_ps, stride_ln, stride_lh, qk_scale, max_len, group, head_dim,
                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr):
    """Program (row, KV head, split): the group's normalised partial outputs over the split's share of the row's
    positions, and their base-2 log-sum-exps (-inf for an empty split), into the workspace."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < group
    heads = kv_head * group + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + row * stride_qn + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32) if DOT_F32 else q.to(k_ptr.dtype.element_ty)
    length = tl.minimum(tl.load(len_ptr + row), max_len)
    split_len = tl.cdiv(tl.cdiv(length, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, length)
    k_base = k_ptr + row * stride_kn + kv_head * stride_kh
    v_base = v_ptr + row * stride_vn + kv_head * stride_vh
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for pos in range(start, end, BLOCK_N):  # no iteration where the split starts at or past the length
        m_i, l_i, acc = _block_step(q, k_base, v_base, pos, end, offs_d, d_mask, m_i, l_i, acc, stride_kt, stride_kd,
                                    stride_vt, stride_vd, qk_scale, BLOCK_N, DOT_F32)
    live = l_i > 0.0
    safe_l = tl.where(live, l_i, 1.0)
    lse = tl.where(live, m_i + tl.log2(safe_l), float("-inf"))
    part = acc / safe_l[:, None]
    tl.store(part_ptr + row * stride_pn + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :], part,
             mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + row * stride_ln + heads * stride_lh + split, lse, mask=g_mask)


@_jit
def _combine_kernel(part_ptr, lse_ptr, out_ptr, stride_pn, stride_ph, stride_ps, stride_ln, stride_lh, stride_on,
                    stride_oh, stride_od, num_splits, head_dim, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (row, head): the splits' partial outputs weighed by their share of the softmax's denominator
    (2^(lse - max lse)); zero where every split is empty (a row of length 0)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    lse = tl.load(lse_ptr + row * stride_ln + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # empty splits: 2^-inf = 0
    parts = tl.load(part_ptr + row * stride_pn + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + row * stride_on + head * stride_oh + offs_d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def interpreted() -> bool:
    """Whether this module's kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import): they then
    run on CPU tensors, slowly."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_split_kernel, InterpretedFunction)


def available() -> bool:
    """Triton importable, and a CUDA device or the interpreter to run its kernels on."""
    return triton is not None and (interpreted() or torch.cuda.is_available())


def _runs_kernel(q: torch.Tensor) -> bool:
    """The kernels run on q's device: CUDA tensors with compiled kernels, CPU tensors under the interpreter."""
    if triton is None:
        return False
    return q.device.type == "cpu" if interpreted() else q.device.type == "cuda"


@cache
def _sm_count(index: Optional[int]) -> int:
    """Streaming multiprocessors of CUDA device `index` (queried once); 8 elsewhere (the interpreter)."""
    if index is None or not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits_for(n: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Splits per row, from shapes only: about WAVES programs per SM over the n * kv_heads (row, KV head) pairs,
    at most one per block of max_len and at most MAX_SPLITS."""
    index = (device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else None
    wanted = math.ceil(WAVES * _sm_count(index) / max(1, n * kv_heads))
    return max(1, min(wanted, MAX_SPLITS, math.ceil(max_len / BLOCK_N)))


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
           out: Optional[torch.Tensor]) -> None:
    """Shapes and dtypes only (no value is read: the call stays capturable)."""
    if out is not None and out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} is not q's shape {tuple(q.shape)}")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"q [n, heads, d] and equal caches [slots, kv_heads, max_len, d] expected: q "
                         f"{tuple(q.shape)}, k {tuple(k_cache.shape)} {k_cache.dtype}, v {tuple(v_cache.shape)} "
                         f"{v_cache.dtype}")
    n, heads, d = q.shape
    slots, kv_heads, _, cache_d = k_cache.shape
    if cache_d != d or heads % kv_heads or n > slots or lengths.dim() != 1 or lengths.numel() < n:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)} with lengths "
                         f"{tuple(lengths.shape)}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} > {MAX_HEAD_DIM}")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float, out: Optional[torch.Tensor] = None,
                     num_splits: Optional[int] = None) -> torch.Tensor:
    """softmax(q k^T * scale) v for each live row r (slot r) over cache positions [0, lengths[r]).

    q: [n, heads, d]; k_cache, v_cache: [slots, kv_heads, max_len, d] (one layer; slots >= n; query head h reads KV
    head h // (heads // kv_heads)); lengths: [>= n] integer tensor on q's device. Returns [n, heads, d] in q's
    dtype, written into `out` (and `out` returned) when given. The float32 split partials ([n, heads, splits, d]
    and [n, heads, splits]) are a workspace allocated here from shapes (from the graph's pool under capture).
    num_splits: default num_splits_for(); capped at MAX_SPLITS. Without a kernel for q's device, the reference.
    """
    _check(q, k_cache, v_cache, lengths, out)
    if not _runs_kernel(q):
        result = decode_attention_reference(q, k_cache, v_cache, lengths, scale)
        return result if out is None else out.copy_(result)
    n, heads, d = q.shape
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    splits = min(num_splits or num_splits_for(n, kv_heads, max_len, q.device), MAX_SPLITS)
    out = torch.empty_like(q) if out is None else out
    if n == 0:
        return out
    part = torch.empty(n, heads, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(n, heads, splits, dtype=torch.float32, device=q.device)
    _launch_split(q, k_cache, v_cache, lengths, part, lse, scale, splits)
    block_d = max(16, triton.next_power_of_2(d))
    _combine_kernel[(n, heads)](part, lse, out, *part.stride()[:3], *lse.stride()[:2], *out.stride(), splits, d,
                                BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d)
    return out


def _launch_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                  part: torch.Tensor, lse: torch.Tensor, scale: float, splits: int) -> None:
    """The split kernel over a (row, KV head, split) grid. tl.dot needs 16 rows at least, so a group of query
    heads is padded to 16 (the padding's queries are zero and never stored). 16-bit caches multiply 16-bit operands
    on the tensor cores (float32 sums); float32 caches multiply float32 ones (IEEE, not TF32), and so do bfloat16
    caches under the interpreter, whose tl.dot multiplies bfloat16 bit patterns as integers (triton 3.9; upstream
    issue triton-lang/triton#11584, declined)."""
    n, heads, d = q.shape
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    block_d = max(16, triton.next_power_of_2(d))
    _split_kernel[(n, kv_heads, splits)](
        q, k_cache, v_cache, lengths, part, lse, *q.stride(), *k_cache.stride(), *v_cache.stride(),
        *part.stride()[:3], *lse.stride()[:2], scale * LOG2E, max_len, group, d,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N if block_d <= 128 else BLOCK_N // 2,
        BLOCK_D=block_d, DOT_F32=k_cache.dtype == torch.float32 or (interpreted() and k_cache.dtype == torch.bfloat16))


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """The same in plain torch, float32, row by row over each row's own length (read on the host: syncs). Positions
    past a row's length are never touched, so whatever they hold (NaN included) cannot leak in."""
    n, heads, d = q.shape
    group = heads // k_cache.shape[1]
    out = torch.zeros(n, heads, d, dtype=torch.float32, device=q.device)
    for row, length in enumerate(lengths[:n].tolist()):
        length = min(int(length), k_cache.shape[2])
        k = k_cache[row, :, :length].float().repeat_interleave(group, dim=0)  # [heads, length, d]
        v = v_cache[row, :, :length].float().repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hld->hl", q[row].float(), k) * scale
        out[row] = torch.einsum("hl,hld->hd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)


__all__ = ["available", "decode_attention", "decode_attention_reference", "interpreted", "num_splits_for"]
