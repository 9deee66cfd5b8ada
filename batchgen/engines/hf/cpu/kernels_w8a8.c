/* W8A8 int8 linears (quant/int8.py Int8DynamicLinear): the two passes around oneDNN's int8 GEMM.
 *
 * Activations are quantized per row (per token): scale[m] = max_k |x[m, k]| / 127, q[m, k] = round(x[m, k] *
 * (127 / max)) in [-127, 127], stored as uint8 with 128 added (oneDNN's fast int8 GEMM takes unsigned activations
 * with a zero point; 128 makes that exact). A row holding a NaN or an infinity gets a NaN scale, so that its output
 * is NaN, as a float GEMM's would be, never a silently finite number. The GEMM runs with activation scale 1 and the
 * weights' per-channel scales; its float32 output is then multiplied by each row's scale and the bias added, in
 * place. Torch operations did the quantization in 5 passes and 4 temporaries: at 2 threads on 64 x 896 they took
 * 3.7 ms against 0.09 ms at 1 thread (docs/performance.md); here one pass reads the row for its maximum and one
 * writes the bytes. 8 lanes wide in every variant (the same bits everywhere).
 */
#include "kernels_simd.h"

static inline float f32x8_hmax(f32x8 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* One row: its scale, and its bytes. */
static void quantize_row(const float *x, long K, uint8_t *q, float *scale) {
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
        quantize_row(x + m * K, K, q + m * K, scale + m);
}

/* y[m, n] = y[m, n] * scale[m] (+ bias[n]), in place. */
void batchgen_scale_rows(float *y, long M, long N, const float *scale, const float *bias, int threads) {
    const long N8 = N & ~7L;
#pragma omp parallel for schedule(static) num_threads(threads) if (M * N >= 32768)
    for (long m = 0; m < M; m++) {
        float *ym = y + m * N;
        const f32x8 s = f32x8_set1(scale[m]);
        long n = 0;
        if (bias)
            for (; n < N8; n += 8)
                f32x8_store(ym + n, f32x8_fma(f32x8_load(ym + n), s, f32x8_load(bias + n)));
        else
            for (; n < N8; n += 8)
                f32x8_store(ym + n, f32x8_mul(f32x8_load(ym + n), s));
        for (; n < N; n++)
            ym[n] = bias ? fmaf(ym[n], scale[m], bias[n]) : ym[n] * scale[m];
    }
}
