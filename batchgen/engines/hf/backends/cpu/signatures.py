"""The C signatures of batchgen's CPU kernels (kernels_*.c), set on a loaded library: ctypes then converts each
call's arguments without a cast per argument. Knows ctypes only (kernels.py loads and calls)."""

from __future__ import annotations

import ctypes


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the argument and result types of the exported kernels on `lib` (the tests also declare a build of an
    older source this way); returns lib."""
    fn = lib.batchgen_int8_gemm
    fn.restype = None
    ptr = ctypes.c_void_p  # tensors go in as data_ptr() integers (a ctypes.cast per argument cost microseconds)
    fn.argtypes = [ptr, ctypes.c_long, ctypes.c_long, ptr, ptr, ptr, ptr, ctypes.c_long, ctypes.c_int]
    attention = lib.batchgen_decode_attention
    attention.restype = None
    attention.argtypes = [ptr, ptr, ptr, ptr, ptr, *[ctypes.c_long] * 6, ctypes.c_float, ctypes.c_int]
    int4 = lib.batchgen_int4_gemm
    int4.restype = None
    int4.argtypes = [ptr, ctypes.c_long, ctypes.c_long, ptr, ptr, ptr, ctypes.c_long, ptr, ptr, ctypes.c_long,
                     ctypes.c_int]
    dequantize = lib.batchgen_int4_dequantize
    dequantize.restype = None
    dequantize.argtypes = [ptr, ptr, ptr, ctypes.c_long, ptr, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    layer = lib.batchgen_decode_layer_attention
    layer.restype = None
    layer.argtypes = [ptr] * 7 + [ctypes.c_long] * 6 + [ctypes.c_float] + [ctypes.c_int] * 4
    lib.batchgen_rms_norm.restype = None
    lib.batchgen_rms_norm.argtypes = [ptr, ptr, ptr, ctypes.c_long, ctypes.c_long, ctypes.c_float, ctypes.c_int,
                                      ctypes.c_int]
    lib.batchgen_add_rms_norm.restype = None
    lib.batchgen_add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_long, ctypes.c_long, ctypes.c_float,
                                          ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.batchgen_silu_mul.restype = None
    lib.batchgen_silu_mul.argtypes = [ptr, ptr, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_int]
    _declare_w8a8(lib, ptr)
    lib.batchgen_isa.restype = ctypes.c_char_p
    lib.batchgen_isa.argtypes = []
    return lib


def _declare_w8a8(lib: ctypes.CDLL, ptr: type) -> None:
    """kernels_w8a8.c's, kernels_amx.c's and kernels_vnni.c's, where the build has them (an older one has none)."""
    if hasattr(lib, "batchgen_quantize_rows"):  # kernels_w8a8.c (a build of an older source has none)
        lib.batchgen_quantize_rows.restype = None
        lib.batchgen_quantize_rows.argtypes = [ptr, ctypes.c_long, ctypes.c_long, ptr, ptr, ctypes.c_int]
        lib.batchgen_scale_rows.restype = None
        lib.batchgen_scale_rows.argtypes = [ptr, ctypes.c_long, ctypes.c_long, ptr, ptr, ctypes.c_int]
        lib.batchgen_add_rms_norm_u8.restype = None
        lib.batchgen_add_rms_norm_u8.argtypes = [ptr] * 7 + [ctypes.c_long, ctypes.c_long, ctypes.c_float,
                                                             ctypes.c_int]
        lib.batchgen_silu_mul_u8.restype = None
        lib.batchgen_silu_mul_u8.argtypes = [ptr] * 5 + [ctypes.c_long, ctypes.c_long, ctypes.c_int]
        lib.batchgen_argmax_rows.restype = None
        lib.batchgen_argmax_rows.argtypes = [ptr, ctypes.c_long, ctypes.c_long, ptr, ctypes.c_int]
    if hasattr(lib, "batchgen_draw_halves"):
        lib.batchgen_draw_halves.restype = None
        lib.batchgen_draw_halves.argtypes = [ptr, ptr, ctypes.c_long, ctypes.c_long, ptr, ctypes.c_int]
    if hasattr(lib, "batchgen_sort_desc_rows"):
        lib.batchgen_sort_desc_rows.restype = ctypes.c_int
        lib.batchgen_sort_desc_rows.argtypes = [ptr, ctypes.c_long, ctypes.c_long, ptr, ptr, ctypes.c_int]
    if hasattr(lib, "batchgen_scale_rows_argmax"):
        lib.batchgen_scale_rows_argmax.restype = None
        lib.batchgen_scale_rows_argmax.argtypes = [ptr, ctypes.c_long, ctypes.c_long, ptr, ptr, ptr, ctypes.c_int]
    if hasattr(lib, "batchgen_vnni_int8_gemm"):  # the AVX-512 variants
        lib.batchgen_vnni_int8_gemm.restype = None
        lib.batchgen_vnni_int8_gemm.argtypes = [ptr, ctypes.c_long, ctypes.c_long, ptr, ctypes.c_long, ptr, ptr, ptr,
                                                ctypes.c_int]
        lib.batchgen_vnni_int4_gemm.restype = ctypes.c_int
        lib.batchgen_vnni_int4_gemm.argtypes = [ptr, ctypes.c_long, ctypes.c_long, ptr, ctypes.c_long, ptr, ptr,
                                                ctypes.c_long, ptr, ptr, ctypes.c_int]
    if hasattr(lib, "batchgen_amx_int8_gemm"):  # the avx512_amx variant only
        lib.batchgen_amx_init.restype = ctypes.c_int
        lib.batchgen_amx_init.argtypes = []
        lib.batchgen_amx_int8_gemm.restype = None
        lib.batchgen_amx_int8_gemm.argtypes = [ptr, ctypes.c_long, ctypes.c_long, ptr, ctypes.c_long, ptr, ptr, ptr,
                                               ctypes.c_int]
