"""batchgen's CPU kernels called on tensors: each checks its tensors' shapes, dtypes and layout, allocates its
outputs and passes pointers to the loaded library (kernels.load()). The kernels themselves, the instruction-set
variants and how they are built and loaded: kernels.py. Knows tensors and pointers, not models."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch


def int8_gemm(lib: ctypes.CDLL, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x: [M, K] float32 contiguous; qweight: [N, K] int8 contiguous; scale, bias: [N] float32 -> [M, N] float32."""
    (m, k), n = x.shape, qweight.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    lib.batchgen_int8_gemm(x.data_ptr(), m, k, qweight.data_ptr(), scale.data_ptr(),
                           None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads())
    return y


def u8_rows(m: int, k: int) -> torch.Tensor:
    """An uninitialized [m, k] uint8 tensor (quantized rows) whose storage holds m rounded up to 16 rows: the AMX GEMM
    reads whole 16-row tiles (and drops the sums of the rows past m)."""
    return torch.empty((-(-m // 16) * 16, k), dtype=torch.uint8)[:m]


def quantize_rows(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 (kernels_w8a8.c): x [M, K] float32 contiguous -> (q [M, K] uint8, the int8 value plus
    128; scale [M] float32, max |x| / 127 per row, NaN for a row holding a NaN or an infinity)."""
    require(x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous(), "quantize_rows: x [M, K] float32")
    m, k = x.shape
    q = u8_rows(m, k)
    scale = torch.empty(m, dtype=torch.float32)
    lib.batchgen_quantize_rows(x.data_ptr(), m, k, q.data_ptr(), scale.data_ptr(), torch.get_num_threads())
    return q, scale


def scale_rows(lib: ctypes.CDLL, y: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y [M, N] float32 contiguous, in place: y * scale[:, None] (+ bias); scale [M], bias [N] float32. Returns y."""
    bias_ok = bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == y.shape[1])
    require(y.dtype == torch.float32 and y.dim() == 2 and y.is_contiguous() and scale.dtype == torch.float32
             and scale.is_contiguous() and scale.numel() == y.shape[0] and bias_ok,
             "scale_rows: y [M, N] float32, scale [M] and bias [N] float32")
    m, n = y.shape
    lib.batchgen_scale_rows(y.data_ptr(), m, n, scale.data_ptr(), None if bias is None else bias.data_ptr(),
                            torch.get_num_threads())
    return y


def add_rms_norm_u8(lib: ctypes.CDLL, x: torch.Tensor, delta: Optional[torch.Tensor],
                    delta_scale: Optional[torch.Tensor], weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x += delta * delta_scale[:, None] in place (x: [M, hidden] float32 contiguous, the residual stream; delta: x's
    shape, float32 contiguous, or None: no add; delta_scale: [M] float32, or None: no scaling), then RMSNorm(x) *
    weight quantized per row as quantize_rows returns it: (q [M, hidden] uint8, scale [M] float32)."""
    m, hidden = x.shape[0], x.shape[-1]
    delta_ok = delta is None or (delta.dtype == torch.float32 and delta.shape == x.shape and delta.is_contiguous())
    require(x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and weight.dtype == torch.float32
             and weight.numel() == hidden and delta_ok
             and _row_scales(delta_scale, m), "add_rms_norm_u8: x [M, hidden] float32, delta x's shape float32, "
             "delta_scale [M] float32, weight [hidden] float32, all contiguous")
    threads = torch.get_num_threads()
    q, scale = u8_rows(m, hidden), torch.empty(m, dtype=torch.float32)
    scratch = torch.empty((threads, hidden), dtype=torch.float32)
    lib.batchgen_add_rms_norm_u8(x.data_ptr(), None if delta is None else delta.data_ptr(),
                                 None if delta_scale is None else delta_scale.data_ptr(), weight.data_ptr(),
                                 q.data_ptr(), scale.data_ptr(), scratch.data_ptr(), m, hidden, eps, threads)
    return q, scale


def silu_mul_u8(lib: ctypes.CDLL, gate_up: torch.Tensor,
                in_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up: [M, 2 inter] float32 contiguous, a W8A8 GEMM's output before its row scales in_scale [M] (None:
    already scaled) -> silu(gate) * up quantized per row as quantize_rows returns it: (q [M, inter], scale [M])."""
    require(gate_up.dtype == torch.float32 and gate_up.dim() == 2 and gate_up.is_contiguous()
             and gate_up.shape[1] % 2 == 0 and _row_scales(in_scale, gate_up.shape[0]),
             "silu_mul_u8: gate_up [M, 2 inter] float32 contiguous, in_scale [M] float32")
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    threads = torch.get_num_threads()
    q, scale = u8_rows(m, inter), torch.empty(m, dtype=torch.float32)
    scratch = torch.empty((threads, inter), dtype=torch.float32)
    lib.batchgen_silu_mul_u8(gate_up.data_ptr(), None if in_scale is None else in_scale.data_ptr(), q.data_ptr(),
                             scale.data_ptr(), scratch.data_ptr(), m, inter, threads)
    return q, scale


def argmax_rows(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """x [M, N] float32 contiguous -> [M] int64: each row's first largest value's index (a NaN counts as largest),
    as x.max(dim=-1).indices."""
    require(x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and x.shape[1] > 0,
             "argmax_rows: x [M, N > 0] float32 contiguous")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.batchgen_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def draw_halves(lib: ctypes.CDLL, key1: torch.Tensor, key2: torch.Tensor, vocab: int) -> torch.Tensor:
    """[M, vocab] float32: the draw's signed halves (sampling/draw.py halves) from each row's two keys ([M] int64,
    draw.row_keys), in one pass."""
    require(key1.dtype == key2.dtype == torch.int64 and key1.is_contiguous() and key2.is_contiguous(),
            "draw_halves: keys [M] int64 contiguous")
    out = torch.empty(key1.shape[0], vocab, dtype=torch.float32)
    lib.batchgen_draw_halves(key1.data_ptr(), key2.data_ptr(), key1.shape[0], vocab, out.data_ptr(),
                             torch.get_num_threads())
    return out


def sort_desc_rows(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, N] float32 -> (values [M, N] float32, indices [M, N] int64): torch.sort(x, dim=-1, descending=True,
    stable=True)'s, bit for bit (a radix sort a row; sampling/draw.py's filter), torch's where the scratch is not
    allocated."""
    require(x.dtype == torch.float32 and x.dim() == 2, "sort_desc_rows: x [M, N] float32")
    x = x.contiguous()
    values, order = torch.empty_like(x), torch.empty(x.shape, dtype=torch.int64)
    if x.numel() and lib.batchgen_sort_desc_rows(x.data_ptr(), x.shape[0], x.shape[1], values.data_ptr(),
                                                 order.data_ptr(), torch.get_num_threads()):
        return torch.sort(x, dim=-1, descending=True, stable=True)
    return values, order


def scale_rows_argmax(lib: ctypes.CDLL, y: torch.Tensor, scale: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    """scale_rows(y, scale, bias) in place, then argmax_rows(y), in one pass a row at a time (a W8A8 LM head's output
    and its greedy picks): returns the [M] int64 picks; y holds the scaled values."""
    bias_ok = bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == y.shape[1])
    require(y.dtype == torch.float32 and y.dim() == 2 and y.is_contiguous() and y.shape[1] > 0
             and _row_scales(scale, y.shape[0]) and scale is not None and bias_ok,
             "scale_rows_argmax: y [M, N > 0] float32 contiguous, scale [M] and bias [N] float32")
    out = torch.empty(y.shape[0], dtype=torch.int64)
    lib.batchgen_scale_rows_argmax(y.data_ptr(), y.shape[0], y.shape[1], scale.data_ptr(),
                                   None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def _row_scales(scale: Optional[torch.Tensor], rows: int) -> bool:
    return scale is None or (scale.dtype == torch.float32 and scale.is_contiguous() and scale.numel() == rows)


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One new token per row, grouped-query heads, each row over its own cache length (no padding, no mask).

    q: [n, heads, d] float32 contiguous; k, v: one layer of the slot cache, [slots, kv_heads, max_len, d] with
    positions contiguous; lengths: [n] int64 on the CPU, valid positions per row -> [n, heads, d] float32."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    require(k.stride() == v.stride() and k.stride(3) == 1 and k.stride(2) == d and q.is_contiguous(),
             "decode_attention: q contiguous, k and v one cache layout with positions contiguous")
    out = torch.empty_like(q)
    lib.batchgen_decode_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), lengths.data_ptr(), out.data_ptr(), n,
                                  heads, kv_heads, d, k.stride(0), k.stride(1), scale, torch.get_num_threads())
    return out


def int4_gemm(lib: ctypes.CDLL, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor,
              group: int, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x: [M, K] float32 contiguous; qweight: [N, K / 2] uint8 in the kernel's nibble layout (quant.pack_int4);
    scale, mins: [N, K / group] bfloat16; bias: [N] float32 -> [M, N] float32."""
    (m, k), n = x.shape, qweight.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    lib.batchgen_int4_gemm(x.data_ptr(), m, k, qweight.data_ptr(), scale.data_ptr(), mins.data_ptr(), group,
                           None if bias is None else bias.data_ptr(), y.data_ptr(), n, torch.get_num_threads())
    return y


def int4_dequantize(lib: ctypes.CDLL, qweight: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor,
                    group: int) -> torch.Tensor:
    """The [N, K] float32 weights of an int4 layer (arguments as int4_gemm's)."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    out = torch.empty((n, k), dtype=torch.float32)
    lib.batchgen_int4_dequantize(qweight.data_ptr(), scale.data_ptr(), mins.data_ptr(), group, out.data_ptr(), n, k,
                                 torch.get_num_threads())
    return out


def decode_layer_attention(lib: ctypes.CDLL, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, positions: torch.Tensor, heads: int, scale: float,
                           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rotary embedding, cache write and attention of one decode step for one layer, in one call.

    qkv: [n, (heads + 2 kv_heads) d] contiguous, the fused projection's output: float32 (rotated in place) or
    bfloat16 (a bf16 GEMM's, read as is);
    cos, sin: [n, d] contiguous; k, v: one layer of the slot cache, as decode_attention's, float32 or bfloat16 (the
    new keys and values are rounded to it as they are written); positions: [n] int64,
    each row's cache length before this token (its key and value go there) -> [n, heads * d] in out_dtype (float32,
    or bfloat16 for a bf16 GEMM to read)."""
    n = qkv.shape[0]
    kv_heads, d = k.shape[1], k.shape[3]
    require(qkv.is_contiguous() and qkv.shape[1] == (heads + 2 * kv_heads) * d and cos.is_contiguous()
             and sin.is_contiguous() and positions.is_contiguous() and positions.shape[0] == n,
             "decode_layer_attention: qkv [n, (heads + 2 kv_heads) d], cos, sin, positions contiguous")
    require(k.stride() == v.stride() and k.stride(3) == 1 and k.stride(2) == d and k.dtype == v.dtype
             and k.shape[0] >= n, "decode_layer_attention: k and v one cache layout, a slot per row")
    _out(k.dtype), _out(qkv.dtype)
    out = torch.empty((n, heads * d), dtype=_out(out_dtype))
    lib.batchgen_decode_layer_attention(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k.data_ptr(), v.data_ptr(),
                                        positions.data_ptr(), out.data_ptr(), n, heads, kv_heads, d, k.stride(0),
                                        k.stride(1), scale, qkv.dtype == torch.bfloat16, k.dtype == torch.bfloat16,
                                        out.dtype == torch.bfloat16, torch.get_num_threads())
    return out


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x: [..., hidden] float32 contiguous; weight: [hidden] float32 -> RMSNorm(x) * weight, x's shape, in out_dtype
    (float32, or bfloat16 for a bf16 GEMM to read)."""
    require(x.dtype == torch.float32 and x.is_contiguous() and weight.dtype == torch.float32
             and weight.numel() == x.shape[-1], "rms_norm: x float32 contiguous, weight float32 [hidden]")
    out = torch.empty(x.shape, dtype=_out(out_dtype))
    hidden = x.shape[-1]
    lib.batchgen_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // hidden, hidden, eps,
                          out.dtype == torch.bfloat16, torch.get_num_threads())
    return out


def add_rms_norm(lib: ctypes.CDLL, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x += delta in place (x: [..., hidden] float32 contiguous, the residual stream; delta: x's shape, float32 or
    bfloat16 contiguous), then RMSNorm(x) * weight as rms_norm returns it: the residual add and the next norm in
    one pass."""
    require(x.dtype == torch.float32 and x.is_contiguous() and delta.is_contiguous() and delta.shape == x.shape,
             "add_rms_norm: x float32 contiguous, delta contiguous of x's shape")
    out = torch.empty(x.shape, dtype=_out(out_dtype))
    hidden = x.shape[-1]
    lib.batchgen_add_rms_norm(x.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // hidden,
                              hidden, eps, _out(delta.dtype) == torch.bfloat16, out.dtype == torch.bfloat16,
                              torch.get_num_threads())
    return out


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """gate_up: [..., 2 inter] float32 or bfloat16 contiguous -> silu(gate) * up, [..., inter], in out_dtype
    (default: gate_up's)."""
    require(gate_up.dtype in (torch.float32, torch.bfloat16) and gate_up.is_contiguous(),
             "silu_mul: gate_up float32 or bfloat16, contiguous")
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=_out(out_dtype or gate_up.dtype))
    lib.batchgen_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter,
                          gate_up.dtype == torch.bfloat16, out.dtype == torch.bfloat16, torch.get_num_threads())
    return out


def require(ok: bool, what: str) -> None:
    """The kernels write through raw pointers without bounds checks: a layout they do not expect is refused here
    (an explicit check, not an assert, which `python -O` would drop)."""
    if not ok:
        raise ValueError(f"batchgen's CPU kernels: {what}")


def _out(dtype: torch.dtype) -> torch.dtype:
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"batchgen's CPU kernels write float32 or bfloat16, not {dtype}")
    return dtype
