/* W8A8 int8 linears (quant/int8.py Int8DynamicLinear): the two passes around oneDNN's int8 GEMM.
 *
 * Activations are quantized per row (per token): scale[m] = max_k |x[m, k]| / 127, q[m, k] = round(x[m, k] *
 * (127 / max)) in [-127, 127], stored as uint8 with 128 added (oneDNN's fast int8 GEMM takes unsigned activations
 * with a zero point; 128 makes that exact). A row holding a NaN or an infinity gets a NaN scale, so that its output
 * is NaN, as a float GEMM's would be, never a silently finite number. The GEMM runs with activation scale 1 and the
 * weights' per-channel scales; its float32 output is then multiplied by each row's scale and the bias added, in
 * place. Torch operations did the quantization in 5 passes and 4 temporaries: at 2 threads on 64 x 896 they took
 * 3.7 ms against 0.09 ms at 1 thread (docs/performance.md); here one pass reads the row for its maximum and one
 * writes the bytes. 8 lanes wide in every variant (the same bits everywhere), but for the fused SiLU, 16 lanes where
 * the variant has them (element by element: the same bits at either width).
 *
 * The fused producers (batchgen_add_rms_norm_u8, batchgen_silu_mul_u8) write a W8A8 linear's input directly: the
 * residual add and RMSNorm, or SiLU-and-multiply, then the quantization, one row at a time through a float row in
 * the caller's scratch (one per thread), instead of a float32 tensor written by one kernel and read again by the
 * next. They also take the previous GEMM's row scales (NULL: none), applied as batchgen_scale_rows would (y * s,
 * one rounding), so that the scaling pass over a W8A8 GEMM's output is folded into the kernel that reads it. The
 * bytes and scales are those of the unfused passes, bit for bit (tests/engines/test_w8a8.py).
 */
#include "kernels_simd.h"
#include <omp.h>

static inline float f32x8_hmax(f32x8 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* One row: its scale, and its bytes. */
void batchgen_quantize_row(const float *x, long K, uint8_t *q, float *scale) {
    const long K8 = K & ~7L;
    f32x8 amax = f32x8_zero(), bad = f32x8_zero();
    const f32x8 inf = f32x8_set1(INFINITY);
    for (long k = 0; k < K8; k += 8) {
        const f32x8 a = f32x8_abs(f32x8_load(x + k));
        amax = f32x8_max(amax, a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ)); /* NaN or infinite: not (a < inf) */
    }
    float peak = f32x8_hmax(amax);
    int nonfinite = _mm256_movemask_ps(bad) != 0;
    for (long k = K8; k < K; k++) {
        const float a = fabsf(x[k]);
        nonfinite |= !(a < INFINITY);
        peak = a > peak ? a : peak;
    }
    if (nonfinite) {
        *scale = NAN;
        memset(q, 128, (size_t)K);
        return;
    }
    const float inv = peak > 0.0f ? 127.0f / peak : 0.0f;
    *scale = peak / 127.0f;
    const f32x8 vinv = f32x8_set1(inv);
    const __m256i offset = _mm256_set1_epi32(128);
    for (long k = 0; k < K8; k += 8) {
        const __m256i v = _mm256_add_epi32(_mm256_cvtps_epi32(f32x8_round(f32x8_mul(f32x8_load(x + k), vinv))),
                                           offset); /* in [1, 255] */
        const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i *)(q + k), _mm_packus_epi16(w16, w16));
    }
    for (long k = K8; k < K; k++)
        q[k] = (uint8_t)((int)nearbyintf(x[k] * inv) + 128);
}

void batchgen_quantize_rows(const float *x, long M, long K, uint8_t *q, float *scale, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M * K >= 32768)
    for (long m = 0; m < M; m++)
        batchgen_quantize_row(x + m * K, K, q + m * K, scale + m);
}

/* y[m, n] = y[m, n] * scale[m] (+ bias[n]), in place. */
/* Row m of y [M, N] in place: y * scale[m] (+ bias), one rounding each (fmaf with a bias). */
static void scale_row(float *ym, long N, float scale, const float *bias) {
    const long N8 = N & ~7L;
    const f32x8 s = f32x8_set1(scale);
    long n = 0;
    if (bias)
        for (; n < N8; n += 8)
            f32x8_store(ym + n, f32x8_fma(f32x8_load(ym + n), s, f32x8_load(bias + n)));
    else
        for (; n < N8; n += 8)
            f32x8_store(ym + n, f32x8_mul(f32x8_load(ym + n), s));
    for (; n < N; n++)
        ym[n] = bias ? fmaf(ym[n], scale, bias[n]) : ym[n] * scale;
}

void batchgen_scale_rows(float *y, long M, long N, const float *scale, const float *bias, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M * N >= 32768)
    for (long m = 0; m < M; m++)
        scale_row(y + m * N, N, scale[m], bias);
}

/* Rows at least this many are split over threads, as in kernels_norms.c (a decode step's rows stay on one). */
#define PARALLEL_ROWS 128

/* x += delta * delta_scale[r] (delta NULL: no add; delta_scale NULL: no scaling), in place, then RMSNorm(x) * weight
 * quantized per row into q [n, hidden] and qscale [n]. scratch: threads x hidden floats. */
void batchgen_add_rms_norm_u8(float *x, const float *delta, const float *delta_scale, const float *weight, uint8_t *q,
                              float *qscale, float *scratch, long n, long hidden, float eps, int threads) {
    const long H8 = hidden & ~7L;
#pragma omp parallel num_threads(threads) if (n >= PARALLEL_ROWS)
    {
        float *row = scratch + (long)omp_get_thread_num() * hidden;
#pragma omp for schedule(static)
        for (long r = 0; r < n; r++) {
            float *xr = x + r * hidden;
            if (delta) {
                const float *dr = delta + r * hidden;
                const float s = delta_scale ? delta_scale[r] : 1.0f;
                const f32x8 vs = f32x8_set1(s);
                long c = 0;
                if (delta_scale) {
                    for (; c < H8; c += 8)
                        f32x8_store(xr + c, f32x8_add(f32x8_load(xr + c), f32x8_mul(f32x8_load(dr + c), vs)));
                    for (; c < hidden; c++)
                        xr[c] += dr[c] * s;
                } else {
                    for (; c < H8; c += 8)
                        f32x8_store(xr + c, f32x8_add(f32x8_load(xr + c), f32x8_load(dr + c)));
                    for (; c < hidden; c++)
                        xr[c] += dr[c];
                }
            }
            batchgen_rms_row(xr, weight, row, 0, hidden, eps, 0);
            batchgen_quantize_row(row, hidden, q + r * hidden, qscale + r);
        }
    }
}

/* silu(gate * s) * (up * s) for the fused gate/up projection's float32 output gu [n, 2 inter] (s = in_scale[r], or
 * no scaling where in_scale is NULL), quantized per row into q [n, inter] and qscale [n]. scratch: threads x inter
 * floats. */
void batchgen_silu_mul_u8(const float *gu, const float *in_scale, uint8_t *q, float *qscale, float *scratch, long n,
                          long inter, int threads) {
    const long I8 = inter & ~7L;
#pragma omp parallel num_threads(threads) if (n * inter >= PARALLEL_SILU)
    {
        float *row = scratch + (long)omp_get_thread_num() * inter;
#pragma omp for schedule(static)
        for (long r = 0; r < n; r++) {
            const float *g = gu + r * 2 * inter, *u = g + inter;
            const float s = in_scale ? in_scale[r] : 1.0f;
            const f32x8 vs = f32x8_set1(s);
            long c = 0;
#ifdef BATCHGEN_AVX512
            const f32x16 ws = f32x16_set1(s);
            for (; c + 16 <= inter; c += 16) {
                f32x16 a = f32x16_load(g + c), b = f32x16_load(u + c);
                if (in_scale)
                    a = f32x16_mul(a, ws), b = f32x16_mul(b, ws);
                f32x16_store(row + c, f32x16_silu_times(a, b));
            }
#endif
            for (; c < I8; c += 8) {
                f32x8 a = f32x8_load(g + c), b = f32x8_load(u + c);
                if (in_scale)
                    a = f32x8_mul(a, vs), b = f32x8_mul(b, vs);
                f32x8_store(row + c, f32x8_silu_times(a, b));
            }
            for (; c < inter; c++) {
                const float a = in_scale ? g[c] * s : g[c], b = in_scale ? u[c] * s : u[c];
                row[c] = a / (1.0f + expf(-a)) * b;
            }
            batchgen_quantize_row(row, inter, q + r * inter, qscale + r);
        }
    }
}

/* out[m] = the index of the first largest value of row m of x [M, N] (a NaN counts as largest: the first NaN's
 * index), as torch's max(dim=-1).indices gives it: greedy decoding's pick over a large vocabulary, one read of the
 * logits on every thread (torch's reduction ran at a third of this speed at 64 x 151936). Each of 8 lanes keeps the
 * first index of its own maximum; the row's answer is the smallest index among the lanes holding the largest. */
static long argmax_row(const float *x, long N) {
    const long N8 = N & ~7L;
    long best = 0;
    if (N8 >= 8) {
        f32x8 vmax = f32x8_load(x), nan = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
        __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cur = vidx;
        const __m256i step = _mm256_set1_epi32(8);
        for (long k = 8; k < N8; k += 8) {
            const f32x8 v = f32x8_load(x + k);
            cur = _mm256_add_epi32(cur, step);
            const f32x8 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            vmax = _mm256_blendv_ps(vmax, v, gt);
            vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
        }
        if (_mm256_movemask_ps(nan)) { /* rare: the first NaN wins */
            for (long k = 0; k < N; k++)
                if (x[k] != x[k])
                    return k;
        }
        float lanes[8];
        int32_t idx[8];
        f32x8_store(lanes, vmax);
        _mm256_storeu_si256((__m256i *)idx, vidx);
        best = idx[0];
        for (int j = 1; j < 8; j++)
            if (lanes[j] > x[best] || (lanes[j] == x[best] && idx[j] < best))
                best = idx[j];
    }
    for (long k = N8; k < N; k++) {
        if (x[k] != x[k]) /* a NaN in the tail: the body had none (checked above) */
            return k;
        if (k == 0 || x[k] > x[best])
            best = k;
    }
    return best;
}

void batchgen_argmax_rows(const float *x, long M, long N, int64_t *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M * N >= 65536)
    for (long m = 0; m < M; m++)
        out[m] = argmax_row(x + m * N, N);
}

/* batchgen_scale_rows then batchgen_argmax_rows, a row at a time: a W8A8 LM head's output [M, vocabulary] is scaled
 * in place and each row's greedy pick taken while the row is still in the core's cache (a row of 151,936 logits is
 * 0.6 MB), instead of a second pass over the whole [M, vocabulary] from memory. The same values and indices as the
 * two kernels (tests/engines/test_w8a8.py). */
void batchgen_scale_rows_argmax(float *y, long M, long N, const float *scale, const float *bias, int64_t *out,
                                int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M * N >= 32768)
    for (long m = 0; m < M; m++) {
        scale_row(y + m * N, N, scale[m], bias);
        out[m] = argmax_row(y + m * N, N);
    }
}

/* The draw's signed halves (engines/hf/sampling/draw.py halves), a row at a time: token n of row m hashes to the
 * 32-bit x = mix(mix(n * GOLDEN ^ key1[m]) ^ key2[m]) (murmur3's finaliser, as draw.mix32 computes it in int64),
 * then min(u, 1 - u) = ((x below 2^31 ? x : ~x) + 1/2) / 2^32 in float32, negative where u >= 1/2. The integers are
 * exact and the float steps are single correctly rounded operations, so the values are draw.py's bit for bit, in
 * one pass instead of torch's twenty over [M, N] int64. */
static inline uint32_t draw_mix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h ^ (h >> 16);
}

void batchgen_draw_halves(const int64_t *key1, const int64_t *key2, long M, long N, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M * N >= 65536)
    for (long m = 0; m < M; m++) {
        const uint32_t k1 = (uint32_t)key1[m], k2 = (uint32_t)key2[m];
        float *row = out + m * N;
        for (long n = 0; n < N; n++) {
            const uint32_t x = draw_mix32(draw_mix32((uint32_t)n * 0x9E3779B9u ^ k1) ^ k2);
            const float small = ((float)(x < 0x80000000u ? x : ~x) + 0.5f) * 0x1p-32f;
            row[n] = x < 0x80000000u ? small : -small;
        }
    }
}

/* Each row of x sorted in descending order, stably (equal values keep their index order; -0 equals +0; a NaN counts
 * as the largest): torch.sort(x, descending=True, stable=True)'s values and indices, which are one permutation, as
 * the draw's top-k/top-p/min-p filter takes them. An LSD radix sort on an order-preserving 32-bit key, 8 bits a pass
 * (a pass whose byte every value shares is skipped): O(N) a row instead of a comparison sort's O(N log N). */
static inline uint32_t sort_desc_key(float v) {
    uint32_t u;
    if (v != v)
        return 0u;  /* a NaN: first */
    if (v == 0.0f)
        v = 0.0f;  /* -0 as +0 */
    memcpy(&u, &v, 4);
    return (u & 0x80000000u) ? u : ~u & 0x7FFFFFFFu;  /* larger value, smaller key; keys of numbers >= 1 */
}

static void sort_desc_row(const float *x, long N, float *values, int64_t *order, uint32_t *buf) {
    uint32_t *key = buf, *idx = buf + N, *key2 = buf + 2 * N, *idx2 = buf + 3 * N;
    long count[4][256] = {{0}};
    for (long n = 0; n < N; n++) {
        const uint32_t k = sort_desc_key(x[n]);
        key[n] = k;
        idx[n] = (uint32_t)n;
        for (int b = 0; b < 4; b++)
            count[b][(k >> (8 * b)) & 255u]++;
    }
    for (int b = 0; b < 4; b++) {
        const int shift = 8 * b;
        if (count[b][(key[0] >> shift) & 255u] == N)
            continue;  /* every key has this byte: the pass would not move anything */
        long start = 0;
        for (int d = 0; d < 256; d++) {
            const long c = count[b][d];
            count[b][d] = start;
            start += c;
        }
        for (long n = 0; n < N; n++) {
            const long at = count[b][(key[n] >> shift) & 255u]++;
            key2[at] = key[n];
            idx2[at] = idx[n];
        }
        uint32_t *t = key; key = key2; key2 = t;
        t = idx; idx = idx2; idx2 = t;
    }
    for (long n = 0; n < N; n++) {
        order[n] = idx[n];
        values[n] = x[idx[n]];
    }
}

/* Returns 0, or -1 where the scratch could not be allocated (nothing written then). */
int batchgen_sort_desc_rows(const float *x, long M, long N, float *values, int64_t *order, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (M > 1 && M * N >= 65536)
    {
        uint32_t *buf = malloc((size_t)N * 4 * sizeof(uint32_t));
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (long m = 0; m < M; m++)
                sort_desc_row(x + m * N, N, values + m * N, order + m * N, buf);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
