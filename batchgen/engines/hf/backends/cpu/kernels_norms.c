/* Norms and activations of a decode step (kernels.py rms_norm, add_rms_norm, silu_mul): RMSNorm, the residual add
 * fused with the next RMSNorm, and SiLU-and-multiply, float32 arithmetic with float32 or bfloat16 inputs and
 * outputs, 8 lanes wide in every variant. Also batchgen_isa(), the variant this library was built as.
 */
#include "kernels_simd.h"

const char *batchgen_isa(void) { return BATCHGEN_ISA; }

/* Rows at least this many are split over threads (a prefill's norms and activations); a decode step's rows stay
 * on one thread, where waking the others costs more than the work. Measured on the Zen 4 EPYC, a 64-row bf16
 * decode step of the benchmark model side by side: 0.955x and 0.959x the time with the norms and SiLU on one
 * thread (this value) than split (64, the value before); at 128 and 192 rows, 256 measured alike. */
#define PARALLEL_ROWS 128

/* RMSNorm of rows [0, n) of x [n, hidden]: out = x / sqrt(mean(x^2) + eps) * weight, as transformers'
 * LlamaRMSNorm computes it in float32 (up to the order of the sum); out float32, or bfloat16 where out_bf16 is set
 * (the input of a bf16 GEMM). Shared with kernels_w8a8.c (declared in kernels_simd.h). */
void batchgen_rms_row(const float *xr, const float *weight, void *out, long r, long hidden, float eps, int out_bf16) {
    f32x8 acc = f32x8_zero();
    long c = 0;
    for (; c + 8 <= hidden; c += 8) {
        const f32x8 a = f32x8_load(xr + c);
        acc = f32x8_fma(a, a, acc);
    }
    float sum = f32x8_hsum(acc);
    for (; c < hidden; c++)
        sum += xr[c] * xr[c];
    const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
    const f32x8 vinv = f32x8_set1(inv);
    if (out_bf16) {
        uint16_t *o = (uint16_t *)out + r * hidden;
        for (c = 0; c + 8 <= hidden; c += 8)
            f32x8_store_bf16(o + c, f32x8_mul(f32x8_load(weight + c), f32x8_mul(f32x8_load(xr + c), vinv)));
        for (; c < hidden; c++)
            o[c] = float_to_bf16(weight[c] * (xr[c] * inv));
        return;
    }
    float *o = (float *)out + r * hidden;
    for (c = 0; c + 8 <= hidden; c += 8)
        f32x8_store(o + c, f32x8_mul(f32x8_load(weight + c), f32x8_mul(f32x8_load(xr + c), vinv)));
    for (; c < hidden; c++)
        o[c] = weight[c] * (xr[c] * inv);
}

void batchgen_rms_norm(const float *x, const float *weight, void *out, long n, long hidden, float eps, int out_bf16,
                       int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= PARALLEL_ROWS)
    for (long r = 0; r < n; r++)
        batchgen_rms_row(x + r * hidden, weight, out, r, hidden, eps, out_bf16);
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
                f32x8_store(xr + c, f32x8_add(f32x8_load(xr + c), f32x8_load_bf16(dr + c)));
            for (; c < hidden; c++)
                xr[c] += bf16_to_float(dr[c]);
        } else {
            const float *dr = (const float *)delta + r * hidden;
            for (; c + 8 <= hidden; c += 8)
                f32x8_store(xr + c, f32x8_add(f32x8_load(xr + c), f32x8_load(dr + c)));
            for (; c < hidden; c++)
                xr[c] += dr[c];
        }
        batchgen_rms_row(xr, weight, out, r, hidden, eps, out_bf16);
    }
}

/* out[r, c] = silu(gu[r, c]) * gu[r, inter + c] for the fused gate/up projection's output gu [n, 2 inter]; gu and
 * out each float32 or, where in_bf16 / out_bf16 is set, bfloat16 (around bf16 GEMMs). Split over threads by output
 * elements (PARALLEL_SILU), 16 lanes where the variant has them: element by element, the same bits at either width
 * and any split. */
void batchgen_silu_mul(const void *gu, void *out, long n, long inter, int in_bf16, int out_bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n * inter >= PARALLEL_SILU)
    for (long r = 0; r < n; r++) {
        const long base = r * 2 * inter;
        long c = 0;
#ifdef BATCHGEN_AVX512
        for (; c + 16 <= inter; c += 16) {
            const f32x16 y = f32x16_silu_times(f32x16_load_maybe_bf16(gu, base + c, in_bf16),
                                               f32x16_load_maybe_bf16(gu, base + inter + c, in_bf16));
            if (out_bf16) {  /* two halves through the 8-lane store: its rounding */
                f32x8_store_bf16((uint16_t *)out + r * inter + c, _mm512_castps512_ps256(y));
                f32x8_store_bf16((uint16_t *)out + r * inter + c + 8, _mm512_extractf32x8_ps(y, 1));
            } else {
                f32x16_store((float *)out + r * inter + c, y);
            }
        }
#endif
        for (; c + 8 <= inter; c += 8) {
            const f32x8 y = f32x8_silu_times(f32x8_load_maybe_bf16(gu, base + c, in_bf16),
                                                f32x8_load_maybe_bf16(gu, base + inter + c, in_bf16));
            if (out_bf16)
                f32x8_store_bf16((uint16_t *)out + r * inter + c, y);
            else
                f32x8_store((float *)out + r * inter + c, y);
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
