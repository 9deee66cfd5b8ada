/* int8 weight-only GEMM for few rows, AVX2 + FMA: y[m, n] = scale[n] * dot(w[n, :], x[m, :]) (+ bias[n]).
 *
 * x: [M, K] float32, w: [N, K] int8 (one symmetric scale per output channel), y: [M, N] float32.
 * Built and loaded by batchgen/engines/cpu_kernels.py. A decode step of a small batch is bound by reading
 * the weights; torch's own int8 kernel has no AVX2 path and ran at half the read rate of bf16 on such a
 * CPU. Here each thread takes blocks of 4 output channels; their int8 rows (at most a few KiB each) stay
 * in L1 while every input row is dotted against them, so the weights are read from memory once; input rows
 * go in pairs, so each weight vector is converted once per two rows. Measured on the benchmark model's 85
 * linears (2 cores, AVX2): 15 ms for one row against 14-19 ms for bf16 weights and 26-39 ms for float32.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The variant this library was built as (cpu_kernels.ISAS): the AVX-512 code below is under BATCHGEN_AVX512. */
#if defined(BATCHGEN_AVX512_BF16)
#define BATCHGEN_ISA "avx512_bf16"
#elif defined(BATCHGEN_AVX512)
#define BATCHGEN_ISA "avx512"
#else
#define BATCHGEN_ISA "avx2"
#endif
const char *batchgen_isa(void) { return BATCHGEN_ISA; }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* bfloat16 <-> float32, 8 at a time. Widening is exact (a shift); narrowing rounds to nearest even, by the
 * AVX-512 BF16 instruction where the variant has it, else by integer arithmetic (finite inputs: activations). */
static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline void store8_bf16(uint16_t *p, __m256 v) {
#ifdef BATCHGEN_AVX512_BF16
    _mm_storeu_si128((__m128i *)p, (__m128i)_mm256_cvtneps_pbh(v));
#else
    __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128((__m128i *)p, packed);
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

/* 8 (16) cache values from position idx of a float32 or, where bf16 is set, bfloat16 KV cache (the branch is the
 * same on every call of a kernel: predicted). */
static inline __m256 load8_kv(const void *base, long idx, int bf16) {
    return bf16 ? load8_bf16((const uint16_t *)base + idx) : _mm256_loadu_ps((const float *)base + idx);
}

#ifdef BATCHGEN_AVX512
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 load16_kv(const void *base, long idx, int bf16) {
    return bf16 ? load16_bf16((const uint16_t *)base + idx) : _mm512_loadu_ps((const float *)base + idx);
}
#endif

/* Store n floats (n a multiple of 8) as float32 or, where bf16 is set, as bfloat16. */
static inline void store_row(void *dst, const float *src, long n, int bf16) {
    if (!bf16) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    for (long c = 0; c < n; c += 8)
        store8_bf16((uint16_t *)dst + c, _mm256_loadu_ps(src + c));
}

static inline __m256 load8(const int8_t *p) {  /* 8 int8 -> 8 float */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* One output channel n for input rows [0, M): the remainder when N is not a multiple of 4. */
static void channel(const float *x, long M, long K, const int8_t *w, const float *scale, const float *bias,
                    float *y, long N, long n) {
    const long K8 = K & ~7L;
    const int8_t *wn = w + n * K;
    for (long m = 0; m < M; m++) {
        const float *xm = x + m * K;
        __m256 acc = _mm256_setzero_ps();
        for (long k = 0; k < K8; k += 8)
            acc = _mm256_fmadd_ps(load8(wn + k), _mm256_loadu_ps(xm + k), acc);
        float sum = hsum(acc);
        for (long k = K8; k < K; k++)
            sum += (float)wn[k] * xm[k];
        y[m * N + n] = sum * scale[n] + (bias ? bias[n] : 0.0f);
    }
}

/* Output channels [n0, n0 + 4) for input rows [0, M). Eight named accumulators (4 channels x 2 halves of a
 * 16-wide step) keep two FMAs per cycle in flight and stay in registers (an indexed array would not). */
static void finish4(const float *xm, long K, const int8_t *const rows[4], float s[4], const float *scale,
                    const float *bias, float *ym, long n0) {
    for (int r = 0; r < 4; r++) {
        for (long j = K & ~7L; j < K; j++)
            s[r] += (float)rows[r][j] * xm[j];
        ym[n0 + r] = s[r] * scale[n0 + r] + (bias ? bias[n0 + r] : 0.0f);
    }
}

static void block4(const float *x, long M, long K, const int8_t *w, const float *scale, const float *bias,
                   float *y, long N, long n0) {
    const long K16 = K & ~15L, K8 = K & ~7L;
    const int8_t *w0 = w + n0 * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    const int8_t *const rows[4] = {w0, w1, w2, w3};
    long m = 0;
    for (; m + 1 < M; m += 2) {  /* two input rows share each converted weight vector */
        const float *xa = x + m * K, *xb = xa + K;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
               a3 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(),
               b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
        for (long k = 0; k < K8; k += 8) {
            __m256 va = _mm256_loadu_ps(xa + k), vb = _mm256_loadu_ps(xb + k);
            __m256 c0 = load8(w0 + k), c1 = load8(w1 + k), c2 = load8(w2 + k), c3 = load8(w3 + k);
            a0 = _mm256_fmadd_ps(c0, va, a0);
            a1 = _mm256_fmadd_ps(c1, va, a1);
            a2 = _mm256_fmadd_ps(c2, va, a2);
            a3 = _mm256_fmadd_ps(c3, va, a3);
            b0 = _mm256_fmadd_ps(c0, vb, b0);
            b1 = _mm256_fmadd_ps(c1, vb, b1);
            b2 = _mm256_fmadd_ps(c2, vb, b2);
            b3 = _mm256_fmadd_ps(c3, vb, b3);
        }
        float sa[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)}, sb[4] = {hsum(b0), hsum(b1), hsum(b2), hsum(b3)};
        finish4(xa, K, rows, sa, scale, bias, y + m * N, n0);
        finish4(xb, K, rows, sb, scale, bias, y + (m + 1) * N, n0);
    }
    for (; m < M; m++) {
        const float *xm = x + m * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
               a3 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(),
               b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
        long k = 0;
        for (; k < K16; k += 16) {
            __m256 xa = _mm256_loadu_ps(xm + k), xb = _mm256_loadu_ps(xm + k + 8);
            a0 = _mm256_fmadd_ps(load8(w0 + k), xa, a0);
            a1 = _mm256_fmadd_ps(load8(w1 + k), xa, a1);
            a2 = _mm256_fmadd_ps(load8(w2 + k), xa, a2);
            a3 = _mm256_fmadd_ps(load8(w3 + k), xa, a3);
            b0 = _mm256_fmadd_ps(load8(w0 + k + 8), xb, b0);
            b1 = _mm256_fmadd_ps(load8(w1 + k + 8), xb, b1);
            b2 = _mm256_fmadd_ps(load8(w2 + k + 8), xb, b2);
            b3 = _mm256_fmadd_ps(load8(w3 + k + 8), xb, b3);
        }
        for (; k < K8; k += 8) {
            __m256 xa = _mm256_loadu_ps(xm + k);
            a0 = _mm256_fmadd_ps(load8(w0 + k), xa, a0);
            a1 = _mm256_fmadd_ps(load8(w1 + k), xa, a1);
            a2 = _mm256_fmadd_ps(load8(w2 + k), xa, a2);
            a3 = _mm256_fmadd_ps(load8(w3 + k), xa, a3);
        }
        float s[4] = {hsum(_mm256_add_ps(a0, b0)), hsum(_mm256_add_ps(a1, b1)), hsum(_mm256_add_ps(a2, b2)),
                      hsum(_mm256_add_ps(a3, b3))};
        finish4(xm, K, rows, s, scale, bias, y + m * N, n0);
    }
}

void batchgen_int8_gemm(const float *x, long M, long K, const int8_t *w, const float *scale, const float *bias,
                        float *y, long N, int threads) {
    const long blocks = N / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long b = 0; b < blocks; b++)
        block4(x, M, K, w, scale, bias, y, N, b * 4);
    for (long n = blocks * 4; n < N; n++)
        channel(x, M, K, w, scale, bias, y, N, n);
}

/* e^x for x <= 0 (softmax after subtracting the maximum), 8 at a time: x = n ln2 + r, |r| <= ln2 / 2,
 * e^r by its degree-7 Taylor-like polynomial (Cephes expf coefficients), 2^n through the exponent bits.
 * Relative error about 1e-7; inputs under -87 give ~0 (as expf underflows). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Softmax of s[0, L) in place. */
static void softmax(float *s, long L) {
    float mx = s[0];
    for (long l = 1; l < L; l++)
        mx = s[l] > mx ? s[l] : mx;
    __m256 vmx = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
    long l = 0;
    for (; l + 8 <= L; l += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + l), vmx));
        _mm256_storeu_ps(s + l, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    for (; l < L; l++) {
        s[l] = expf(s[l] - mx);
        sum += s[l];
    }
    const float inv = 1.0f / sum;
    for (l = 0; l < L; l++)
        s[l] *= inv;
}

#ifdef BATCHGEN_AVX512
/* e^x for x <= 0, 16 at a time: exp256's polynomial and constants, 16 lanes wide. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* How far ahead the 16-wide attention prefetches its key and value streams. Each (row, KV head) reads its keys
 * and values from the slot cache, a few KiB to a few hundred KiB apart from the next task's, and the hardware
 * prefetcher stops at every 4 KiB page: measured side by side on the Zen 4 EPYC (64 rows, 12 layers of bf16 cache,
 * 190 and 600 positions), the prefetching kernel took 0.87x and 0.88x the time, with the same output. 512 to
 * 8192 bytes measured alike within the noise. */
#define PREFETCH_BYTES 2048

static inline void prefetch_lines(const char *p, long bytes) {
    for (long o = 0; o < bytes; o += 64)
        _mm_prefetch(p + o, _MM_HINT_T0);
}

/* [sum(a0), sum(a1), sum(a2), sum(a3)]: four horizontal sums in 13 instructions (four reduce_add_ps take ~32). */
static inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 s = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* The scores scale * q[t] . K[l] of the group's query heads (qg [group, d]) against keys kh [L, d] into
 * s[t * stride + l]: 4 keys at a time, each key chunk loaded (and widened from bf16) once for up to 4 heads, and
 * each (head, 4 keys) reduced together (reduce4), where one reduce_add per (head, key) cost more than its FMAs. */
static void scores16(const float *qg, const void *kh, long L, long d, long group, float scale, int kv_bf16,
                     float *s, long stride) {
    const __m512 zero = _mm512_setzero_ps();
    const __m128 vscale = _mm_set1_ps(scale);
    const long item = kv_bf16 ? 2 : 4, ahead = PREFETCH_BYTES / (d * item);  /* keys ahead of the one read */
    for (long l0 = 0; l0 < L; l0 += 4) {
        const long nk = L - l0 < 4 ? L - l0 : 4;
        if (l0 + ahead < L)  /* the keys `ahead` positions on */
            prefetch_lines((const char *)kh + (l0 + ahead) * d * item,
                           (L - l0 - ahead < 4 ? L - l0 - ahead : 4) * d * item);
        for (long t0 = 0; t0 < group; t0 += 4) {
            const long nt = group - t0 < 4 ? group - t0 : 4;
            __m512 acc[4][4];
            for (int t = 0; t < 4; t++)
                for (int j = 0; j < 4; j++)
                    acc[t][j] = zero;
            for (long c = 0; c < d; c += 16) {
                __m512 key[4];
                for (int j = 0; j < 4; j++)  /* keys past L read as zero (the cache may end there) */
                    key[j] = j < nk ? load16_kv(kh, (l0 + j) * d + c, kv_bf16) : zero;
                for (int t = 0; t < 4; t++) {
                    if (t >= nt)
                        break;
                    const __m512 q = _mm512_loadu_ps(qg + (t0 + t) * d + c);
                    for (int j = 0; j < 4; j++)
                        acc[t][j] = _mm512_fmadd_ps(q, key[j], acc[t][j]);
                }
            }
            for (int t = 0; t < nt; t++) {
                const __m128 sums = _mm_mul_ps(reduce4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]), vscale);
                float *dst = s + (t0 + t) * stride + l0;
                if (nk == 4) {
                    _mm_storeu_ps(dst, sums);
                } else {
                    float tmp[4];
                    _mm_storeu_ps(tmp, sums);
                    for (long j = 0; j < nk; j++)
                        dst[j] = tmp[j];
                }
            }
        }
    }
}

/* attend_group with 16-wide vectors, for d a multiple of 16: scores of 16 keys at a time stay in one register
 * (each key's dot product reduced once), the softmax and the weighted sum of values run 16 lanes wide. Measured
 * against the 8-wide code on the benchmark model's decode steps (docs/engines.md "The hf engine"). */
static void attend_group16(const float *qg, const void *kh, const void *vh, long L, long d, long group,
                           float scale, int kv_bf16, float *og) {
    const long stride = L + 16;
    float *s = malloc(sizeof(float) * group * stride), inv[group];
    scores16(qg, kh, L, d, group, scale, kv_bf16, s, stride);
    for (long t = 0; t < group; t++) {  /* softmax of each head's scores, unnormalized; 1 / sum kept apart */
        float *st = s + t * stride;
        __m512 vmx = _mm512_set1_ps(-INFINITY);
        long l = 0;
        for (; l + 16 <= L; l += 16)
            vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(st + l));
        float mx = _mm512_reduce_max_ps(vmx);
        for (; l < L; l++)
            mx = st[l] > mx ? st[l] : mx;
        __m512 vsum = _mm512_setzero_ps();
        const __m512 bmx = _mm512_set1_ps(mx);
        for (l = 0; l < L; l += 16) {  /* the tail lanes are masked off */
            const __mmask16 live = L - l >= 16 ? 0xffff : (__mmask16)((1u << (L - l)) - 1);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, st + l), bmx));
            const __m512 kept = _mm512_maskz_mov_ps(live, e);
            _mm512_mask_storeu_ps(st + l, live, kept);
            vsum = _mm512_add_ps(vsum, kept);
        }
        inv[t] = 1.0f / _mm512_reduce_add_ps(vsum);
    }
    const long vitem = kv_bf16 ? 2 : 4, vahead = PREFETCH_BYTES / (d * vitem);
    /* The weighted sum of values, 64 output dims and up to 3 heads at a time: each value chunk is loaded (and
     * widened from bf16) once for the heads of the block; 3 heads x 4 accumulators + 4 values fit the registers. */
    for (long c0 = 0; c0 < d; c0 += 64) {
        const long width = d - c0 < 64 ? d - c0 : 64, chunks = width / 16;
        for (long t0 = 0; t0 < group; t0 += 3) {
            const long nt = group - t0 < 3 ? group - t0 : 3;
            __m512 acc[3][4];
            for (int t = 0; t < 3; t++)
                for (int c = 0; c < 4; c++)
                    acc[t][c] = _mm512_setzero_ps();
            for (long m = 0; m < L; m++) {
                if (m + vahead < L && c0 == 0 && t0 == 0)
                    prefetch_lines((const char *)vh + (m + vahead) * d * vitem, d * vitem);
                __m512 val[4];
                for (int c = 0; c < 4; c++)
                    val[c] = c < chunks ? load16_kv(vh, m * d + c0 + 16 * c, kv_bf16) : _mm512_setzero_ps();
                for (int t = 0; t < 3; t++) {
                    if (t >= nt)
                        break;
                    const __m512 p = _mm512_set1_ps(s[(t0 + t) * stride + m]);
                    for (int c = 0; c < 4; c++)
                        acc[t][c] = _mm512_fmadd_ps(p, val[c], acc[t][c]);
                }
            }
            for (long t = 0; t < nt; t++) {
                const __m512 vinv = _mm512_set1_ps(inv[t0 + t]);
                for (long c = 0; c < chunks; c++)
                    _mm512_storeu_ps(og + (t0 + t) * d + c0 + 16 * c, _mm512_mul_ps(acc[t][c], vinv));
            }
        }
    }
    free(s);
}
#endif

static void attend_group8(const float *qg, const void *kh, const void *vh, long L, long d, long group,
                          float scale, int kv_bf16, float *og);

/* One (row, KV head) task: the group's attention over L positions (16 lanes wide where built and d allows); the
 * keys and values kh, vh [L, d] float32 or, where kv_bf16 is set, bfloat16 (half the bytes to read: a decode
 * step's attention streams the whole cache, and measured bound by memory bandwidth at the working batch). */
static void attend_group(const float *qg, const void *kh, const void *vh, long L, long d, long group,
                         float scale, int kv_bf16, float *og) {
#ifdef BATCHGEN_AVX512
    if (d % 16 == 0) {
        attend_group16(qg, kh, vh, L, d, group, scale, kv_bf16, og);
        return;
    }
#endif
    attend_group8(qg, kh, vh, L, d, group, scale, kv_bf16, og);
}

static void attend_group8(const float *qg, const void *kh, const void *vh, long L, long d, long group,
                          float scale, int kv_bf16, float *og) {
    float *s = malloc(sizeof(float) * group * L);
    for (long l = 0; l < L; l++) {
        const long key = l * d;
        for (long t = 0; t < group; t++) {
            __m256 acc = _mm256_setzero_ps();
            for (long c = 0; c < d; c += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + t * d + c), load8_kv(kh, key + c, kv_bf16), acc);
            s[t * L + l] = hsum(acc) * scale;
        }
    }
    for (long t = 0; t < group; t++) {
        float *st = s + t * L;
        softmax(st, L);
        for (long c0 = 0; c0 < d; c0 += 64) {  /* 8 accumulators of 8 floats: 64 output dims at a time */
            const long width = d - c0 < 64 ? d - c0 : 64;
            __m256 acc[8];
            for (int a = 0; a < 8; a++)
                acc[a] = _mm256_setzero_ps();
            if (width == 64) {  /* constant trip count: the accumulators stay in registers */
                for (long l = 0; l < L; l++) {
                    const __m256 p = _mm256_set1_ps(st[l]);
                    const long val = l * d + c0;
                    for (int a = 0; a < 8; a++)
                        acc[a] = _mm256_fmadd_ps(p, load8_kv(vh, val + 8 * a, kv_bf16), acc[a]);
                }
            } else {
                for (long l = 0; l < L; l++) {
                    const __m256 p = _mm256_set1_ps(st[l]);
                    const long val = l * d + c0;
                    for (long c = 0; c < width; c += 8)
                        acc[c / 8] = _mm256_fmadd_ps(p, load8_kv(vh, val + c, kv_bf16), acc[c / 8]);
                }
            }
            for (long c = 0; c < width; c += 8)
                _mm256_storeu_ps(og + t * d + c0 + c, acc[c / 8]);
        }
    }
    free(s);
}

/* Decode attention, one new token per row, grouped-query heads: for row r and query head h (KV head
 * j = h / group), out[r, h] = softmax(scale * q[r, h] . K[r, j, l] for l < lengths[r]) . V[r, j, :lengths[r]].
 *
 * q, out: [n, heads, d] contiguous; k, v: one layer of the slot cache, row r / KV head j at
 * r * slot_stride + j * head_stride, positions of d floats each; d a multiple of 8. Each (row, KV head)
 * is one task: its keys and values are read once, each row over its own length only (no padding). */
void batchgen_decode_attention(const float *q, const float *k, const float *v, const int64_t *lengths, float *out,
                               long n, long heads, long kv_heads, long d, long slot_stride, long head_stride,
                               float scale, int threads) {
    const long group = heads / kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long task = 0; task < n * kv_heads; task++) {
        const long r = task / kv_heads, j = task % kv_heads;
        attend_group(q + (r * heads + j * group) * d, k + r * slot_stride + j * head_stride,
                     v + r * slot_stride + j * head_stride, lengths[r], d, group, scale, 0,
                     out + (r * heads + j * group) * d);
    }
}

/* Rotary embedding of one head in place, the rotate-half convention of Llama-family models in transformers:
 * x[i] * cos[i] - x[i + d/2] * sin[i] and x[i + d/2] * cos[i + d/2] + x[i] * sin[i + d/2], i < d/2. Products
 * and sums are rounded separately, as torch does (the library is built with -ffp-contract=off): the result
 * is bit for bit transformers' apply_rotary_pos_emb. */
static void rope_head(float *x, const float *cos, const float *sin, long d) {
    const long h = d / 2;
    for (long i = 0; i < h; i += 8) {
        const __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + h + i);
        _mm256_storeu_ps(x + i, _mm256_sub_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + i)),
                                              _mm256_mul_ps(hi, _mm256_loadu_ps(sin + i))));
        _mm256_storeu_ps(x + h + i, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + h + i)),
                                                  _mm256_mul_ps(lo, _mm256_loadu_ps(sin + h + i))));
    }
}

/* The attention half of a decode step for one layer, from the fused q/k/v projection's output:
 * qkv: [n, (heads + 2 kv_heads) d] (q heads, then k heads, then v heads, per row); cos, sin: [n, d].
 * For each row r and KV head j: rotate the group's query heads and key head j in place, write key and value
 * head j into the cache at position lengths[r], then attend over lengths[r] + 1 positions into
 * out[r, heads of group j]. One call instead of the ~25 torch operations of rotary embedding, cache
 * writes and attention (each a few microseconds at batch 1). d a multiple of 16. qkv float32 (rotated in place) or,
 * where qkv_bf16 is set, bfloat16 (a bf16 GEMM's output, read as is: widened into a per-thread buffer, so no
 * conversion pass runs before the call). The cache k, v float32 or, where kv_bf16 is set, bfloat16 (keys and values
 * rounded once, when written); out float32, or bfloat16 where out_bf16 is set (the input of a bf16 o_proj GEMM). */
void batchgen_decode_layer_attention(void *qkv, const float *cos, const float *sin, void *k, void *v,
                                     const int64_t *lengths, void *out, long n, long heads, long kv_heads, long d,
                                     long slot_stride, long head_stride, float scale, int qkv_bf16, int kv_bf16,
                                     int out_bf16, int threads) {
    const long group = heads / kv_heads, row = (heads + 2 * kv_heads) * d;
    const size_t item = kv_bf16 ? sizeof(uint16_t) : sizeof(float);  /* strides are in elements */
#pragma omp parallel num_threads(threads)
    {
        float *og = out_bf16 ? malloc(sizeof(float) * group * d) : NULL;  /* bf16 output: attend, then narrow */
        float *wide = qkv_bf16 ? malloc(sizeof(float) * (group + 2) * d) : NULL;  /* bf16 input: widened here */
#pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < n * kv_heads; task++) {
            const long r = task / kv_heads, j = task % kv_heads, pos = lengths[r];
            float *qg, *key, *value;
            if (qkv_bf16) {
                const uint16_t *src = (const uint16_t *)qkv + r * row;
                qg = wide, key = wide + group * d, value = wide + (group + 1) * d;
                for (long c = 0; c < group * d; c += 8)
                    _mm256_storeu_ps(qg + c, load8_bf16(src + j * group * d + c));
                for (long c = 0; c < d; c += 8) {
                    _mm256_storeu_ps(key + c, load8_bf16(src + (heads + j) * d + c));
                    _mm256_storeu_ps(value + c, load8_bf16(src + (heads + kv_heads + j) * d + c));
                }
            } else {
                qg = (float *)qkv + r * row + j * group * d, key = (float *)qkv + r * row + (heads + j) * d;
                value = (float *)qkv + r * row + (heads + kv_heads + j) * d;
            }
            for (long t = 0; t < group; t++)
                rope_head(qg + t * d, cos + r * d, sin + r * d, d);
            rope_head(key, cos + r * d, sin + r * d, d);
            char *kh = (char *)k + (r * slot_stride + j * head_stride) * item;
            char *vh = (char *)v + (r * slot_stride + j * head_stride) * item;
            store_row(kh + pos * d * item, key, d, kv_bf16);
            store_row(vh + pos * d * item, value, d, kv_bf16);
            const long at = (r * heads + j * group) * d;
            attend_group(qg, kh, vh, pos + 1, d, group, scale, kv_bf16, out_bf16 ? og : (float *)out + at);
            if (out_bf16)
                store_row((uint16_t *)out + at, og, group * d, 1);
        }
        free(og);
        free(wide);
    }
}

/* Rows at least this many are split over threads (a prefill's norms and activations); a decode step's rows stay
 * on one thread, where waking the others costs more than the work. Measured on the Zen 4 EPYC, a 64-row bf16
 * decode step of the benchmark model side by side: 0.955x and 0.959x the time with the norms and SiLU on one
 * thread (this value) than split (64, the value before); at 128 and 192 rows, 256 measured alike. */
#define PARALLEL_ROWS 128

/* RMSNorm of rows [0, n) of x [n, hidden]: out = x / sqrt(mean(x^2) + eps) * weight, as transformers'
 * LlamaRMSNorm computes it in float32 (up to the order of the sum); out float32, or bfloat16 where out_bf16 is set
 * (the input of a bf16 GEMM). hidden a multiple of 8 where out_bf16 is set. */
static void rms_row(const float *xr, const float *weight, void *out, long r, long hidden, float eps, int out_bf16) {
    __m256 acc = _mm256_setzero_ps();
    long c = 0;
    for (; c + 8 <= hidden; c += 8) {
        const __m256 a = _mm256_loadu_ps(xr + c);
        acc = _mm256_fmadd_ps(a, a, acc);
    }
    float sum = hsum(acc);
    for (; c < hidden; c++)
        sum += xr[c] * xr[c];
    const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    if (out_bf16) {
        uint16_t *o = (uint16_t *)out + r * hidden;
        for (c = 0; c + 8 <= hidden; c += 8)
            store8_bf16(o + c, _mm256_mul_ps(_mm256_loadu_ps(weight + c), _mm256_mul_ps(_mm256_loadu_ps(xr + c), vinv)));
        for (; c < hidden; c++)
            o[c] = float_to_bf16(weight[c] * (xr[c] * inv));
        return;
    }
    float *o = (float *)out + r * hidden;
    for (c = 0; c + 8 <= hidden; c += 8)
        _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(weight + c), _mm256_mul_ps(_mm256_loadu_ps(xr + c), vinv)));
    for (; c < hidden; c++)
        o[c] = weight[c] * (xr[c] * inv);
}

void batchgen_rms_norm(const float *x, const float *weight, void *out, long n, long hidden, float eps, int out_bf16,
                       int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= PARALLEL_ROWS)
    for (long r = 0; r < n; r++)
        rms_row(x + r * hidden, weight, out, r, hidden, eps, out_bf16);
}

/* The residual add and the next RMSNorm in one pass over each row (vLLM's fused_add_rms_norm): x += delta in place
 * (x float32, delta float32 or, where delta_bf16 is set, bfloat16: a bf16 GEMM's output), then out = RMSNorm(x) as
 * batchgen_rms_norm writes it. The same sums as torch's x + delta followed by the norm, without the add's own pass
 * over memory, its widening copy of a bf16 delta, or its parallel region. */
void batchgen_add_rms_norm(float *x, const void *delta, const float *weight, void *out, long n, long hidden, float eps,
                           int delta_bf16, int out_bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= PARALLEL_ROWS)
    for (long r = 0; r < n; r++) {
        float *xr = x + r * hidden;
        long c = 0;
        if (delta_bf16) {
            const uint16_t *dr = (const uint16_t *)delta + r * hidden;
            for (; c + 8 <= hidden; c += 8)
                _mm256_storeu_ps(xr + c, _mm256_add_ps(_mm256_loadu_ps(xr + c), load8_bf16(dr + c)));
            for (; c < hidden; c++)
                xr[c] += bf16_to_float(dr[c]);
        } else {
            const float *dr = (const float *)delta + r * hidden;
            for (; c + 8 <= hidden; c += 8)
                _mm256_storeu_ps(xr + c, _mm256_add_ps(_mm256_loadu_ps(xr + c), _mm256_loadu_ps(dr + c)));
            for (; c < hidden; c++)
                xr[c] += dr[c];
        }
        rms_row(xr, weight, out, r, hidden, eps, out_bf16);
    }
}

/* out[r, c] = silu(gu[r, c]) * gu[r, inter + c] for the fused gate/up projection's output gu [n, 2 inter]; gu and
 * out each float32 or, where in_bf16 / out_bf16 is set, bfloat16 (around bf16 GEMMs). */
void batchgen_silu_mul(const void *gu, void *out, long n, long inter, int in_bf16, int out_bf16, int threads) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= PARALLEL_ROWS)
    for (long r = 0; r < n; r++) {
        const long base = r * 2 * inter;
        long c = 0;
        for (; c + 8 <= inter; c += 8) {
            const __m256 a = in_bf16 ? load8_bf16((const uint16_t *)gu + base + c)
                                     : _mm256_loadu_ps((const float *)gu + base + c);
            const __m256 u = in_bf16 ? load8_bf16((const uint16_t *)gu + base + inter + c)
                                     : _mm256_loadu_ps((const float *)gu + base + inter + c);
            /* silu(a) = a / (1 + e^-a); e^-a through exp256, which takes x <= 0: for a < 0 use a e^a / (1 + e^a) */
            const __m256 e = exp256(_mm256_sub_ps(zero, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a)));  /* e^-|a| */
            const __m256 pos = _mm256_div_ps(a, _mm256_add_ps(one, e));
            const __m256 neg = _mm256_div_ps(_mm256_mul_ps(a, e), _mm256_add_ps(one, e));
            const __m256 silu = _mm256_blendv_ps(pos, neg, _mm256_cmp_ps(a, zero, _CMP_LT_OQ));
            if (out_bf16)
                store8_bf16((uint16_t *)out + r * inter + c, _mm256_mul_ps(silu, u));
            else
                _mm256_storeu_ps((float *)out + r * inter + c, _mm256_mul_ps(silu, u));
        }
        for (; c < inter; c++) {
            const float g = in_bf16 ? bf16_to_float(((const uint16_t *)gu)[base + c]) : ((const float *)gu)[base + c];
            const float u = in_bf16 ? bf16_to_float(((const uint16_t *)gu)[base + inter + c])
                                    : ((const float *)gu)[base + inter + c];
            const float y = g / (1.0f + expf(-g)) * u;
            if (out_bf16)
                ((uint16_t *)out)[r * inter + c] = float_to_bf16(y);
            else
                ((float *)out)[r * inter + c] = y;
        }
    }
}

/* int4 weight-only GEMM for few rows, AVX2 + FMA, group-wise asymmetric weights:
 * w[n, k] = scale[n, g] * q[n, k] + min[n, g] for g = k / G, q in [0, 15]; y[m, n] = w[n, :] . x[m, :] (+ bias[n]).
 *
 * x: [M, K] float32; scale, min: [N, K / G] bfloat16 bits; G and K multiples of 64. Weights: [N, K / 2] bytes,
 * each channel's 64-weight blocks 32 bytes long, read as 8 uint32 lanes: lane j holds q[64 b + 8 i + j] in bits
 * 4 i .. 4 i + 3. Nibble plane i of a block is then one shift and one mask away from 8 int32 lanes that line up
 * with x[64 b + 8 i, + 8): no byte shuffles. Per group, dot(q, x) is accumulated in float, then scaled; the min
 * term is min[n, g] * sum(x[group g]), the sums computed once per call. Each thread takes blocks of 4 output
 * channels. One input row reads the packed weights directly (int4_block); more rows first dequantize the block's
 * weights into a small float buffer and dot every row against it (int4_block_rows). */

#define NIBBLES(v, i) _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32((v), 4 * (i)), mask))

/* Channels [n0, n0 + count), count 1 or 4 (the rest of the block is ignored), one input row at a time straight
 * from the packed weights (decode steps of one row). */
static void int4_block(const float *x, long M, long K, const uint8_t *w, const uint16_t *scale, const uint16_t *mins,
                       long G, const float *xsum, const float *bias, float *y, long N, long n0, int count) {
    const long groups = K / G;
    const __m256i mask = _mm256_set1_epi32(15);
    const uint8_t *w0 = w + n0 * (K / 2);
    const uint8_t *w1 = count == 4 ? w0 + K / 2 : w0, *w2 = count == 4 ? w1 + K / 2 : w0,
                  *w3 = count == 4 ? w2 + K / 2 : w0;
    for (long m = 0; m < M; m++) {
        const float *xm = x + m * K;
        __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
        for (long g = 0; g < groups; g++) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (long k = g * G; k < (g + 1) * G; k += 64) {
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)(w0 + k / 2)),
                              v1 = _mm256_loadu_si256((const __m256i *)(w1 + k / 2)),
                              v2 = _mm256_loadu_si256((const __m256i *)(w2 + k / 2)),
                              v3 = _mm256_loadu_si256((const __m256i *)(w3 + k / 2));
#define ROW_PLANE(i)                                              \
    {                                                             \
        const __m256 p = _mm256_loadu_ps(xm + k + 8 * (i));       \
        a0 = _mm256_fmadd_ps(NIBBLES(v0, i), p, a0);              \
        a1 = _mm256_fmadd_ps(NIBBLES(v1, i), p, a1);              \
        a2 = _mm256_fmadd_ps(NIBBLES(v2, i), p, a2);              \
        a3 = _mm256_fmadd_ps(NIBBLES(v3, i), p, a3);              \
    }
                ROW_PLANE(0) ROW_PLANE(1) ROW_PLANE(2) ROW_PLANE(3)
                ROW_PLANE(4) ROW_PLANE(5) ROW_PLANE(6) ROW_PLANE(7)
#undef ROW_PLANE
            }
            const long r = n0 * groups + g;
            t0 = _mm256_fmadd_ps(a0, _mm256_set1_ps(bf16_to_float(scale[r])), t0);
            if (count == 4) {
                t1 = _mm256_fmadd_ps(a1, _mm256_set1_ps(bf16_to_float(scale[r + groups])), t1);
                t2 = _mm256_fmadd_ps(a2, _mm256_set1_ps(bf16_to_float(scale[r + 2 * groups])), t2);
                t3 = _mm256_fmadd_ps(a3, _mm256_set1_ps(bf16_to_float(scale[r + 3 * groups])), t3);
            }
        }
        const __m256 t[4] = {t0, t1, t2, t3};
        for (int c = 0; c < count; c++) {
            const long n = n0 + c;
            float z = 0.0f;
            for (long g = 0; g < groups; g++)
                z += bf16_to_float(mins[n * groups + g]) * xsum[m * groups + g];
            y[m * N + n] = hsum(t[c]) + z + (bias ? bias[n] : 0.0f);
        }
    }
}

/* Channel n's float32 weights, scale * q + min, into out [K]. */
static void int4_dequantize_channel(const uint8_t *w, const uint16_t *scale, const uint16_t *mins, long G, long K,
                                    long n, float *out) {
    const long groups = K / G;
    const __m256i mask = _mm256_set1_epi32(15);
    for (long g = 0; g < groups; g++) {
        const __m256 s = _mm256_set1_ps(bf16_to_float(scale[n * groups + g])),
                     mn = _mm256_set1_ps(bf16_to_float(mins[n * groups + g]));
        for (long k = g * G; k < (g + 1) * G; k += 64) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + n * (K / 2) + k / 2));
            float *o = out + k;
#define STORE_PLANE(i) _mm256_storeu_ps(o + 8 * (i), _mm256_fmadd_ps(NIBBLES(v, i), s, mn));
            STORE_PLANE(0) STORE_PLANE(1) STORE_PLANE(2) STORE_PLANE(3)
            STORE_PLANE(4) STORE_PLANE(5) STORE_PLANE(6) STORE_PLANE(7)
#undef STORE_PLANE
        }
    }
}

/* Channels [n0, n0 + count), count 1 or 4, for M >= 2 input rows: the block's weights are dequantized once into
 * scratch [4, K] (it stays in L1/L2), then the rows are dotted against them two at a time. Converting each weight
 * once per call instead of once per row pair made 32 rows ~30% faster over the benchmark model's linears. */
static void int4_block_rows(const float *x, long M, long K, const uint8_t *w, const uint16_t *scale,
                            const uint16_t *mins, long G, const float *bias, float *y, long N, long n0, int count,
                            float *scratch) {
    for (int c = 0; c < 4; c++)
        int4_dequantize_channel(w, scale, mins, G, K, n0 + (c < count ? c : 0), scratch + c * K);
    const float *f0 = scratch, *f1 = f0 + K, *f2 = f1 + K, *f3 = f2 + K;
    for (long m = 0; m < M; m += 2) {
        const float *xa = x + m * K, *xb = m + 1 < M ? xa + K : xa;  /* an odd last row is computed twice */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (long k = 0; k < K; k += 8) {
            const __m256 va = _mm256_loadu_ps(xa + k), vb = _mm256_loadu_ps(xb + k);
            const __m256 c0 = _mm256_loadu_ps(f0 + k), c1 = _mm256_loadu_ps(f1 + k), c2 = _mm256_loadu_ps(f2 + k),
                         c3 = _mm256_loadu_ps(f3 + k);
            a0 = _mm256_fmadd_ps(c0, va, a0);
            a1 = _mm256_fmadd_ps(c1, va, a1);
            a2 = _mm256_fmadd_ps(c2, va, a2);
            a3 = _mm256_fmadd_ps(c3, va, a3);
            b0 = _mm256_fmadd_ps(c0, vb, b0);
            b1 = _mm256_fmadd_ps(c1, vb, b1);
            b2 = _mm256_fmadd_ps(c2, vb, b2);
            b3 = _mm256_fmadd_ps(c3, vb, b3);
        }
        const __m256 a[4] = {a0, a1, a2, a3}, b[4] = {b0, b1, b2, b3};
        for (int c = 0; c < count; c++) {
            const float bn = bias ? bias[n0 + c] : 0.0f;
            y[m * N + n0 + c] = hsum(a[c]) + bn;
            if (m + 1 < M)
                y[(m + 1) * N + n0 + c] = hsum(b[c]) + bn;
        }
    }
}

void batchgen_int4_gemm(const float *x, long M, long K, const uint8_t *w, const uint16_t *scale,
                        const uint16_t *mins, long G, const float *bias, float *y, long N, int threads) {
    const long groups = K / G, blocks = N / 4;
    if (M <= 0)
        return;
    if (M > 1) {
#pragma omp parallel num_threads(threads)
        {
            float *scratch = malloc(sizeof(float) * 4 * K);
#pragma omp for schedule(static)
            for (long b = 0; b < blocks; b++)
                int4_block_rows(x, M, K, w, scale, mins, G, bias, y, N, b * 4, 4, scratch);
            free(scratch);
        }
        float *scratch = malloc(sizeof(float) * 4 * K);
        for (long n = blocks * 4; n < N; n++)
            int4_block_rows(x, M, K, w, scale, mins, G, bias, y, N, n, 1, scratch);
        free(scratch);
        return;
    }
    float *xsum = malloc(sizeof(float) * groups);  /* one row: the min term needs the sum of each input group */
    for (long g = 0; g < groups; g++) {
        __m256 acc = _mm256_setzero_ps();
        for (long k = g * G; k < (g + 1) * G; k += 8)
            acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + k));
        xsum[g] = hsum(acc);
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long b = 0; b < blocks; b++)
        int4_block(x, 1, K, w, scale, mins, G, xsum, bias, y, N, b * 4, 4);
    for (long n = blocks * 4; n < N; n++)
        int4_block(x, 1, K, w, scale, mins, G, xsum, bias, y, N, n, 1);
    free(xsum);
}

/* The float32 weights [N, K] of an int4 layer (layout above), for a GEMM over many rows. */
void batchgen_int4_dequantize(const uint8_t *w, const uint16_t *scale, const uint16_t *mins, long G, float *out,
                              long N, long K, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n++)
        int4_dequantize_channel(w, scale, mins, G, K, n, out + n * K);
}
