/* The vector vocabulary of batchgen's CPU kernels (kernels_*.c, built by kernels.py): load, store, set1, add, sub,
 * mul, div, fma, max, exp, horizontal sums, bfloat16 and int8 widening, named by lane count so that a kernel reads
 * the same at either width:
 *
 *   f32x8_*   8 float32 lanes (AVX2 + FMA), in every variant;
 *   f32x16_*  16 float32 lanes (AVX-512 F/BW/VL/DQ), in the avx512 and avx512_bf16 variants (BATCHGEN_AVX512);
 *   i32x8_*   8 int32 lanes (the int4 GEMM's nibble planes); f32x4_* the 128-bit tail of a 4-way reduction.
 *
 * Helpers built from the vocabulary (exp, a KV-cache load in float32 or bf16) are written once below, as a macro
 * over the lane prefix, and defined for each width the variant has. The kernels that run 8 lanes wide in every
 * variant (GEMMs, norms, activations, rotary embedding) do so on purpose: the same code in each variant gives the
 * same bits. There is no scalar variant: without AVX2 and FMA kernels.py builds nothing and torch's operations run.
 */
#ifndef BATCHGEN_KERNELS_SIMD_H
#define BATCHGEN_KERNELS_SIMD_H

#if !defined(__AVX2__) || !defined(__FMA__)
#error "batchgen's CPU kernels need AVX2 and FMA (kernels.py passes -mavx2 -mfma)"
#endif

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The variant being built (kernels.ISAS), as batchgen_isa() reports it. */
#if defined(BATCHGEN_AMX)
#define BATCHGEN_ISA "avx512_amx"
#elif defined(BATCHGEN_AVX512_BF16)
#define BATCHGEN_ISA "avx512_bf16"
#elif defined(BATCHGEN_AVX512)
#define BATCHGEN_ISA "avx512"
#else
#define BATCHGEN_ISA "avx2"
#endif

/* ---- 8 lanes: AVX2 + FMA ---- */
typedef __m256 f32x8;
typedef __m256i i32x8;
#define f32x8_zero _mm256_setzero_ps
#define f32x8_set1 _mm256_set1_ps
#define f32x8_load _mm256_loadu_ps
#define f32x8_store _mm256_storeu_ps
#define f32x8_add _mm256_add_ps
#define f32x8_sub _mm256_sub_ps
#define f32x8_mul _mm256_mul_ps
#define f32x8_div _mm256_div_ps
#define f32x8_max _mm256_max_ps
#define f32x8_fma _mm256_fmadd_ps   /* fma(a, b, c) = a * b + c, one rounding */
#define f32x8_fnma _mm256_fnmadd_ps /* fnma(a, b, c) = c - a * b, one rounding */
#define f32x8_round(v) _mm256_round_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define f32x8_from_i32 _mm256_cvtepi32_ps
#define f32x8_abs(v) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), (v))
/* Lanes of `neg` where a < 0, else of `pos`. */
#define f32x8_select_negative(a, neg, pos) \
    _mm256_blendv_ps((pos), (neg), _mm256_cmp_ps((a), _mm256_setzero_ps(), _CMP_LT_OQ))
#define i32x8_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define i32x8_set1 _mm256_set1_epi32
#define i32x8_and _mm256_and_si256
#define i32x8_srli _mm256_srli_epi32

/* 2^n for whole-numbered float lanes n (exponent bits; n within float's normal range). */
static inline f32x8 f32x8_pow2i(f32x8 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

/* Sum of the 8 lanes: halves added, then pairs (the order every 8-wide kernel's results depend on). */
static inline float f32x8_hsum(f32x8 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 int8 -> 8 float. */
static inline f32x8 f32x8_load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* bfloat16 <-> float32. Widening is exact (a shift); narrowing rounds to nearest even, by the AVX-512 BF16
 * instruction where the variant has it, else by integer arithmetic (finite inputs: activations). */
static inline f32x8 f32x8_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline void f32x8_store_bf16(uint16_t *p, f32x8 v) {
#ifdef BATCHGEN_AVX512_BF16
    _mm_storeu_si128((__m128i *)p, (__m128i)_mm256_cvtneps_pbh(v));
#else
    __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
#endif
}

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* ---- 16 lanes: AVX-512 F/BW/VL/DQ ---- */
#ifdef BATCHGEN_AVX512
typedef __m512 f32x16;
typedef __mmask16 mask16;
#define f32x16_zero _mm512_setzero_ps
#define f32x16_set1 _mm512_set1_ps
#define f32x16_load _mm512_loadu_ps
#define f32x16_store _mm512_storeu_ps
#define f32x16_add _mm512_add_ps
#define f32x16_sub _mm512_sub_ps
#define f32x16_mul _mm512_mul_ps
#define f32x16_max _mm512_max_ps
#define f32x16_div _mm512_div_ps
#define f32x16_abs _mm512_abs_ps
#define f32x16_select_negative(a, neg, pos) \
    _mm512_mask_blend_ps(_mm512_cmp_ps_mask((a), _mm512_setzero_ps(), _CMP_LT_OQ), (pos), (neg))
#define f32x16_fma _mm512_fmadd_ps
#define f32x16_fnma _mm512_fnmadd_ps
#define f32x16_round(v) _mm512_roundscale_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define f32x16_hsum _mm512_reduce_add_ps
#define f32x16_hmax _mm512_reduce_max_ps
/* The first n lanes of 16 (n >= 16: all), and loads, stores and copies that touch only them. */
#define mask16_first(n) ((n) >= 16 ? (mask16)0xffff : (mask16)((1u << (n)) - 1))
#define f32x16_load_masked _mm512_maskz_loadu_ps
#define f32x16_store_masked _mm512_mask_storeu_ps
#define f32x16_keep _mm512_maskz_mov_ps
#define f32x4_set1 _mm_set1_ps
#define f32x4_mul _mm_mul_ps
#define f32x4_store _mm_storeu_ps

static inline f32x16 f32x16_pow2i(f32x16 n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}

static inline f32x16 f32x16_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* [sum(a0), sum(a1), sum(a2), sum(a3)]: four horizontal sums in 13 instructions (four reduce_add_ps take ~32). */
static inline __m128 f32x16_hsum4(f32x16 a0, f32x16 a1, f32x16 a2, f32x16 a3) {
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 s = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

#define simd_prefetch(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)

/* ---- Written once over the lane prefix V (f32x8, f32x16), defined below for each width the variant has ---- */

/* e^x for x <= 0 (softmax after subtracting the maximum): x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-7
 * Taylor-like polynomial (Cephes expf coefficients), 2^n through the exponent bits. Relative error about 1e-7;
 * inputs under -87 give ~0 (as expf underflows). */
#define SIMD_DEFINE_EXP(V)                                                  \
    static inline V V##_exp(V x) {                                          \
        x = V##_max(x, V##_set1(-87.0f));                                   \
        const V n = V##_round(V##_mul(x, V##_set1(1.44269504088896341f)));  \
        V r = V##_fnma(n, V##_set1(0.693359375f), x);                       \
        r = V##_fnma(n, V##_set1(-2.12194440e-4f), r);                      \
        V p = V##_set1(1.9875691500e-4f);                                   \
        p = V##_fma(p, r, V##_set1(1.3981999507e-3f));                      \
        p = V##_fma(p, r, V##_set1(8.3334519073e-3f));                      \
        p = V##_fma(p, r, V##_set1(4.1665795894e-2f));                      \
        p = V##_fma(p, r, V##_set1(1.6666665459e-1f));                      \
        p = V##_fma(p, r, V##_set1(5.0000001201e-1f));                      \
        p = V##_fma(p, V##_mul(r, r), V##_add(r, V##_set1(1.0f)));          \
        return V##_mul(p, V##_pow2i(n));                                    \
    }

/* A vector from element idx of a float32 or, where bf16 is set, bfloat16 array (a KV cache, an activation; the
 * branch is the same on every call of a kernel: predicted). */
#define SIMD_DEFINE_LOAD_MAYBE_BF16(V)                                                                   \
    static inline V V##_load_maybe_bf16(const void *base, long idx, int bf16) {                          \
        return bf16 ? V##_load_bf16((const uint16_t *)base + idx) : V##_load((const float *)base + idx); \
    }

SIMD_DEFINE_EXP(f32x8)
SIMD_DEFINE_LOAD_MAYBE_BF16(f32x8)
#ifdef BATCHGEN_AVX512
SIMD_DEFINE_EXP(f32x16)
SIMD_DEFINE_LOAD_MAYBE_BF16(f32x16)
#endif


/* silu(a) * u: silu(a) = a / (1 + e^-a); e^-a through V##_exp, which takes x <= 0, so for a < 0 it is
 * a e^a / (1 + e^a). Element by element, so 8 and 16 lanes give the same bits. (kernels_norms.c's SiLU-and-multiply,
 * 8 lanes; kernels_w8a8.c's fused version, 16 where the variant has them.) */
#define SIMD_DEFINE_SILU_TIMES(V)                                             \
    static inline V V##_silu_times(V a, V u) {                                \
        const V one = V##_set1(1.0f);                                         \
        const V e = V##_exp(V##_sub(V##_zero(), V##_abs(a))); /* e^-|a| */    \
        /* a / (1 + e) where a >= 0, a e / (1 + e) where a < 0: one division */ \
        const V num = V##_select_negative(a, V##_mul(a, e), a);               \
        return V##_mul(V##_div(num, V##_add(one, e)), u);                     \
    }
SIMD_DEFINE_SILU_TIMES(f32x8)
#ifdef BATCHGEN_AVX512
SIMD_DEFINE_SILU_TIMES(f32x16)
#endif

/* SiLU-and-multiply (an exp and a division an element) is split over threads from this many output elements on,
 * whatever the rows: a decode step's 64 rows of an MLP's width are. */
#define PARALLEL_SILU 65536

/* Shared between the kernel files, compiled into one library: one row of RMSNorm (kernels_norms.c), written to row r
 * of out; one row quantized to uint8 = int8 + 128 with its scale (kernels_w8a8.c). */
void batchgen_rms_row(const float *xr, const float *weight, void *out, long r, long hidden, float eps, int out_bf16);
void batchgen_quantize_row(const float *x, long K, uint8_t *q, float *scale);

#endif
