"""batchgen's own CPU kernels (`kernels_*.c`), compiled on first use, for x86-64 CPUs with AVX2 and FMA
(AVX-512 ones included): the decode step between the GEMMs (attention over the slot KV cache, rotary
embedding and cache write, RMSNorm, SiLU-and-multiply; float32 arithmetic, inputs, outputs and cache in
float32 or bf16), and int8 and int4 weight-only GEMMs for few rows.

Decode attention: torch's batched matmuls read the cache of a grouped-query head through small GEMMs
(3 query rows each) and pad every row to a common width; the kernel reads each row's keys and values
once, over its own length only, with the softmax in between (step.py uses it for float32 models
on CPU). At batch 1 the torch operations between the GEMMs (norms, rotary embedding, cache writes,
activation) cost a few microseconds each, ~50 per layer; the decode-step kernels take four calls.

torch's `aten._weight_int8pack_mm` is vectorized for AVX-512 and ARM only; on an AVX2 CPU its generic
loop made an int8 decode step of one row no faster than bfloat16, although it reads half the bytes
(docs/engines.md "Quantization"). This kernel converts 8 int8 weights at a time to float and FMAs them with
float32 inputs, so a small batch runs at the rate the weights stream from memory. The int4 kernel does
the same from group-wise 4-bit weights laid out so that a shift and a mask unpack 8 of them.

Sources (SOURCES), one per family: `kernels_attention.c` (decode attention, rotary embedding and cache write),
`kernels_norms.c` (RMSNorm, SiLU-and-multiply), `kernels_int8.c`, `kernels_int4.c`, each written once against the
vector vocabulary of `kernels_simd.h` (8 and 16 float lanes). They are built together into one library per
instruction-set variant (ISAS): `avx2` (8-wide float vectors), `avx512` (AVX-512 F/BW/VL/DQ: 16-wide vectors in the
kernels where they paid), `avx512_bf16` (the same, built with AVX-512 BF16 allowed) and `avx512_amx` (the same, plus
the W8A8 GEMM on the AMX tile unit, `kernels_amx.c`; empty in the other variants). The variant is picked at
load time from the CPU's flags, the widest the CPU runs; `BATCHGEN_CPU_ISA=avx2` (or any narrower variant the CPU
supports) forces one, so that an AVX-512 machine also runs and tests the AVX2 kernels. Each variant is compiled
once per version of the sources, compiler flags and CPU model with the system C compiler (`$CC`, else `cc`) into a
cache directory (`$BATCHGEN_CACHE_DIR`, else `~/.cache/batchgen`), the ISA in its file name, written under a
temporary name and renamed, so concurrent jobs sharing the cache never load a half-written library. Where there is
no compiler, no AVX2/FMA (ARM, older x86), or `BATCHGEN_NATIVE_KERNELS=0`, `load()` returns None and the engine
uses torch's operations and int8 kernels, and torchao's int4 (logged once). Knows tensors and pointers, not models.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Optional

import torch

from batchgen.engines.hf.backends.cpu.runtime import cpu_flags, cpu_model
from batchgen.engines.hf.backends.cpu.signatures import declare  # noqa: F401 (the tests declare older builds through here)
from batchgen.fsutil import cache_home

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
# Compiled together into one library; the header is in the cache key as well (a change to either rebuilds).
SOURCES = tuple(HERE / f"kernels_{name}.c" for name in ("attention", "norms", "int8", "int4", "w8a8", "amx",
                                                             "vnni"))
HEADER = HERE / "kernels_simd.h"
# -ffp-contract=off: a * b + c stays two roundings unless a kernel asks for an FMA (rotary embedding matches torch)
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)
# Variants, narrowest first: the /proc/cpuinfo flags each needs, and its compiler flags. The same sources for each:
# the 16-lane vocabulary and the code that uses it are under #ifdef BATCHGEN_AVX512 (kernels_simd.h).
ISAS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "avx2": (frozenset({"avx2", "fma"}), ("-mavx2", "-mfma")),
    "avx512": (frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
               ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-DBATCHGEN_AVX512")),
    "avx512_bf16": (frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}),
                    ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                     "-DBATCHGEN_AVX512", "-DBATCHGEN_AVX512_BF16")),
    # the W8A8 GEMM on the tile unit (kernels_amx.c); its intrinsics need GCC 11 or Clang 12 (else avx512_bf16 loads)
    "avx512_amx": (frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile",
                              "amx_int8"}),
                   ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                    "-mamx-tile", "-mamx-int8", "-DBATCHGEN_AVX512", "-DBATCHGEN_AVX512_BF16", "-DBATCHGEN_AMX")),
}
ISA_ENV = "BATCHGEN_CPU_ISA"


def cache_dir() -> Path:
    return cache_home()


def supported_isas() -> list[str]:
    """The kernel variants this CPU runs, narrowest first; empty off x86-64 or without AVX2 and FMA."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags()
    return [name for name, (needs, _) in ISAS.items() if needs <= flags]


def selected_isa() -> Optional[str]:
    """The variant to load: `$BATCHGEN_CPU_ISA` where this CPU supports it, else the widest it supports; None
    where none runs or the kernels are switched off (`BATCHGEN_NATIVE_KERNELS=0`)."""
    if os.environ.get("BATCHGEN_NATIVE_KERNELS", "1") == "0":
        return None
    return _select(os.environ.get(ISA_ENV, ""), tuple(supported_isas()))


@cache
def _select(forced: str, supported: tuple[str, ...]) -> Optional[str]:  # cached: a bad setting is logged once
    if forced and forced not in supported:
        known = ", ".join(ISAS)
        log.warning("%s=%s: %s; using %s", ISA_ENV, forced,
                    f"not supported by this CPU (it runs: {', '.join(supported) or 'none'})" if forced in ISAS
                    else f"unknown variant (known: {known})", supported[-1] if supported else "torch's kernels")
        forced = ""
    return forced or (supported[-1] if supported else None)


def wanted() -> bool:
    """An x86-64 CPU with AVX2 and FMA (AVX-512 ones included), and the kernels not switched off."""
    return selected_isa() is not None


def load(isa: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """The compiled kernels of `isa` (default: selected_isa()), building them on first use; None where they cannot
    run here (logged)."""
    isa = isa or selected_isa()
    if isa is None or isa not in supported_isas():
        return None
    lib = _load(isa)
    if lib is None and isa == "avx512_amx":  # a compiler without the tile intrinsics: the variant below it
        return _load("avx512_bf16")
    return lib


def reset() -> None:
    """Forget the loaded libraries (tests: the cache directory or the environment changed)."""
    _load.cache_clear()
    _select.cache_clear()


def describe_cpu() -> str:
    """The CPU model, the flags that steer batchgen's kernels and dtypes, and the kernel variant loaded (benchmarks
    print it beside every figure)."""
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    flags = " ".join(f for f in wanted if f in cpu_flags()) or "none of avx2/avx512/amx"
    lib = load()
    isa = lib.batchgen_isa().decode() if lib is not None else "none (torch's kernels)"
    return f"cpu: {cpu_model() or 'unknown'}, {os.cpu_count()} CPUs; flags: {flags}; batchgen kernels: {isa}"


@cache
def _load(isa: str) -> Optional[ctypes.CDLL]:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler (cc or $CC) found: torch's decode attention and int8 kernels run (slower here)")
        return None
    try:
        target = cache_dir() / f"cpu_kernels-{isa}-{source_digest(ISAS[isa][1])}.so"
        if not target.exists():
            _compile(compiler, target, ISAS[isa][1])
        lib = declare(ctypes.CDLL(str(target)))
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.warning("building batchgen's CPU kernels failed (%s): torch's decode attention and int8 kernels run "
                    "(slower here)", detail)
        return None
    log.info("batchgen's CPU kernels loaded (%s, %s variant): float32 decode steps (attention, rotary embedding, "
             "RMSNorm, SiLU), int8 and int4 GEMMs for small batches", target.name, lib.batchgen_isa().decode())
    return lib


def source_digest(isa_flags: tuple[str, ...]) -> str:
    """The cache key of a build: every source and the header (names and bytes), the compiler flags, the CPU model."""
    sha = hashlib.sha256()
    for path in (*SOURCES, HEADER):
        sha.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    sha.update(" ".join(CFLAGS + isa_flags + LIBS).encode() + cpu_model().encode() + platform.machine().encode())
    return sha.hexdigest()[:16]


def _compile(compiler: str, target: Path, isa_flags: tuple[str, ...], sources: tuple[Path, ...] = SOURCES) -> None:
    """Build `sources` (default: SOURCES) with `isa_flags` into the library `target`, atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *CFLAGS, *isa_flags, *map(str, sources), *LIBS, "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)  # atomic: another process sees the old state or the whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
    _require(x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous(), "quantize_rows: x [M, K] float32")
    m, k = x.shape
    q = u8_rows(m, k)
    scale = torch.empty(m, dtype=torch.float32)
    lib.batchgen_quantize_rows(x.data_ptr(), m, k, q.data_ptr(), scale.data_ptr(), torch.get_num_threads())
    return q, scale


def scale_rows(lib: ctypes.CDLL, y: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y [M, N] float32 contiguous, in place: y * scale[:, None] (+ bias); scale [M], bias [N] float32. Returns y."""
    bias_ok = bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == y.shape[1])
    _require(y.dtype == torch.float32 and y.dim() == 2 and y.is_contiguous() and scale.dtype == torch.float32
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
    _require(x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and weight.dtype == torch.float32
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
    _require(gate_up.dtype == torch.float32 and gate_up.dim() == 2 and gate_up.is_contiguous()
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
    _require(x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and x.shape[1] > 0,
             "argmax_rows: x [M, N > 0] float32 contiguous")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.batchgen_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def scale_rows_argmax(lib: ctypes.CDLL, y: torch.Tensor, scale: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    """scale_rows(y, scale, bias) in place, then argmax_rows(y), in one pass a row at a time (a W8A8 LM head's output
    and its greedy picks): returns the [M] int64 picks; y holds the scaled values."""
    bias_ok = bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == y.shape[1])
    _require(y.dtype == torch.float32 and y.dim() == 2 and y.is_contiguous() and y.shape[1] > 0
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
    _require(k.stride() == v.stride() and k.stride(3) == 1 and k.stride(2) == d and q.is_contiguous(),
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
    _require(qkv.is_contiguous() and qkv.shape[1] == (heads + 2 * kv_heads) * d and cos.is_contiguous()
             and sin.is_contiguous() and positions.is_contiguous() and positions.shape[0] == n,
             "decode_layer_attention: qkv [n, (heads + 2 kv_heads) d], cos, sin, positions contiguous")
    _require(k.stride() == v.stride() and k.stride(3) == 1 and k.stride(2) == d and k.dtype == v.dtype
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
    _require(x.dtype == torch.float32 and x.is_contiguous() and weight.dtype == torch.float32
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
    _require(x.dtype == torch.float32 and x.is_contiguous() and delta.is_contiguous() and delta.shape == x.shape,
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
    _require(gate_up.dtype in (torch.float32, torch.bfloat16) and gate_up.is_contiguous(),
             "silu_mul: gate_up float32 or bfloat16, contiguous")
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=_out(out_dtype or gate_up.dtype))
    lib.batchgen_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter,
                          gate_up.dtype == torch.bfloat16, out.dtype == torch.bfloat16, torch.get_num_threads())
    return out


def _require(ok: bool, what: str) -> None:
    """The kernels write through raw pointers without bounds checks: a layout they do not expect is refused here
    (an explicit check, not an assert, which `python -O` would drop)."""
    if not ok:
        raise ValueError(f"batchgen's CPU kernels: {what}")


def _out(dtype: torch.dtype) -> torch.dtype:
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"batchgen's CPU kernels write float32 or bfloat16, not {dtype}")
    return dtype
