/* int4 weight-only GEMM for few rows (kernels.py int4_gemm) and the dequantization of an int4 layer for a GEMM over
 * many rows (int4_dequantize). Group-wise asymmetric weights:
 * w[n, k] = scale[n, g] * q[n, k] + min[n, g] for g = k / G, q in [0, 15]; y[m, n] = w[n, :] . x[m, :] (+ bias[n]).
 *
 * x: [M, K] float32; scale, min: [N, K / G] bfloat16 bits; G and K multiples of 64. Weights: [N, K / 2] bytes,
 * each channel's 64-weight blocks 32 bytes long, read as 8 uint32 lanes: lane j holds q[64 b + 8 i + j] in bits
 * 4 i .. 4 i + 3 (quant.pack_int4). Nibble plane i of a block is then one shift and one mask away from 8 int32
 * lanes that line up with x[64 b + 8 i, + 8): no byte shuffles. Per group, dot(q, x) is accumulated in float, then
 * scaled; the min term is min[n, g] * sum(x[group g]), the sums computed once per call. Each thread takes blocks
 * of 4 output channels. One input row reads the packed weights directly (int4_block); more rows first dequantize
 * the block's weights into a small float buffer and dot every row against it (int4_block_rows). 8 lanes wide in
 * every variant.
 */
#include "kernels_simd.h"

#define NIBBLES(v, i) f32x8_from_i32(i32x8_and(i32x8_srli((v), 4 * (i)), mask))

/* Channels [n0, n0 + count), count 1 or 4 (the rest of the block is ignored), one input row at a time straight
 * from the packed weights (decode steps of one row). */
static void int4_block(const float *x, long M, long K, const uint8_t *w, const uint16_t *scale, const uint16_t *mins,
                       long G, const float *xsum, const float *bias, float *y, long N, long n0, int count) {
    const long groups = K / G;
    const i32x8 mask = i32x8_set1(15);
    const uint8_t *w0 = w + n0 * (K / 2);
    const uint8_t *w1 = count == 4 ? w0 + K / 2 : w0, *w2 = count == 4 ? w1 + K / 2 : w0,
                  *w3 = count == 4 ? w2 + K / 2 : w0;
    for (long m = 0; m < M; m++) {
        const float *xm = x + m * K;
        f32x8 t0 = f32x8_zero(), t1 = t0, t2 = t0, t3 = t0;
        for (long g = 0; g < groups; g++) {
            f32x8 a0 = f32x8_zero(), a1 = a0, a2 = a0, a3 = a0;
            for (long k = g * G; k < (g + 1) * G; k += 64) {
                const i32x8 v0 = i32x8_load(w0 + k / 2), v1 = i32x8_load(w1 + k / 2), v2 = i32x8_load(w2 + k / 2),
                            v3 = i32x8_load(w3 + k / 2);
#define ROW_PLANE(i)                                       \
    {                                                      \
        const f32x8 p = f32x8_load(xm + k + 8 * (i));      \
        a0 = f32x8_fma(NIBBLES(v0, i), p, a0);             \
        a1 = f32x8_fma(NIBBLES(v1, i), p, a1);             \
        a2 = f32x8_fma(NIBBLES(v2, i), p, a2);             \
        a3 = f32x8_fma(NIBBLES(v3, i), p, a3);             \
    }
                ROW_PLANE(0) ROW_PLANE(1) ROW_PLANE(2) ROW_PLANE(3)
                ROW_PLANE(4) ROW_PLANE(5) ROW_PLANE(6) ROW_PLANE(7)
#undef ROW_PLANE
            }
            const long r = n0 * groups + g;
            t0 = f32x8_fma(a0, f32x8_set1(bf16_to_float(scale[r])), t0);
            if (count == 4) {
                t1 = f32x8_fma(a1, f32x8_set1(bf16_to_float(scale[r + groups])), t1);
                t2 = f32x8_fma(a2, f32x8_set1(bf16_to_float(scale[r + 2 * groups])), t2);
                t3 = f32x8_fma(a3, f32x8_set1(bf16_to_float(scale[r + 3 * groups])), t3);
            }
        }
        const f32x8 t[4] = {t0, t1, t2, t3};
        for (int c = 0; c < count; c++) {
            const long n = n0 + c;
            float z = 0.0f;
            for (long g = 0; g < groups; g++)
                z += bf16_to_float(mins[n * groups + g]) * xsum[m * groups + g];
            y[m * N + n] = f32x8_hsum(t[c]) + z + (bias ? bias[n] : 0.0f);
        }
    }
}

/* Channel n's float32 weights, scale * q + min, into out [K]. */
static void int4_dequantize_channel(const uint8_t *w, const uint16_t *scale, const uint16_t *mins, long G, long K,
                                    long n, float *out) {
    const long groups = K / G;
    const i32x8 mask = i32x8_set1(15);
    for (long g = 0; g < groups; g++) {
        const f32x8 s = f32x8_set1(bf16_to_float(scale[n * groups + g])),
                    mn = f32x8_set1(bf16_to_float(mins[n * groups + g]));
        for (long k = g * G; k < (g + 1) * G; k += 64) {
            const i32x8 v = i32x8_load(w + n * (K / 2) + k / 2);
            float *o = out + k;
#define STORE_PLANE(i) f32x8_store(o + 8 * (i), f32x8_fma(NIBBLES(v, i), s, mn));
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
        f32x8 a0 = f32x8_zero(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (long k = 0; k < K; k += 8) {
            const f32x8 va = f32x8_load(xa + k), vb = f32x8_load(xb + k);
            const f32x8 c0 = f32x8_load(f0 + k), c1 = f32x8_load(f1 + k), c2 = f32x8_load(f2 + k),
                        c3 = f32x8_load(f3 + k);
            a0 = f32x8_fma(c0, va, a0);
            a1 = f32x8_fma(c1, va, a1);
            a2 = f32x8_fma(c2, va, a2);
            a3 = f32x8_fma(c3, va, a3);
            b0 = f32x8_fma(c0, vb, b0);
            b1 = f32x8_fma(c1, vb, b1);
            b2 = f32x8_fma(c2, vb, b2);
            b3 = f32x8_fma(c3, vb, b3);
        }
        const f32x8 a[4] = {a0, a1, a2, a3}, b[4] = {b0, b1, b2, b3};
        for (int c = 0; c < count; c++) {
            const float bn = bias ? bias[n0 + c] : 0.0f;
            y[m * N + n0 + c] = f32x8_hsum(a[c]) + bn;
            if (m + 1 < M)
                y[(m + 1) * N + n0 + c] = f32x8_hsum(b[c]) + bn;
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
        f32x8 acc = f32x8_zero();
        for (long k = g * G; k < (g + 1) * G; k += 8)
            acc = f32x8_add(acc, f32x8_load(x + k));
        xsum[g] = f32x8_hsum(acc);
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
