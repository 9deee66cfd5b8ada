/* int8 weight-only GEMM for few rows (kernels.py int8_gemm): y[m, n] = scale[n] * dot(w[n, :], x[m, :]) (+ bias[n]).
 *
 * x: [M, K] float32, w: [N, K] int8 (one symmetric scale per output channel), y: [M, N] float32. A decode step of a
 * small batch is bound by reading the weights; torch's own int8 kernel has no AVX2 path and ran at half the read
 * rate of bf16 on such a CPU. Here each thread takes blocks of 4 output channels; their int8 rows (at most a few
 * KiB each) stay in L1 while every input row is dotted against them, so the weights are read from memory once;
 * input rows go in pairs, so each weight vector is converted once per two rows. 8 lanes wide in every variant.
 * Measured on the benchmark model's 85 linears (2 cores, AVX2): 15 ms for one row against 14-19 ms for bf16
 * weights and 26-39 ms for float32.
 */
#include "kernels_simd.h"

/* One output channel n for input rows [0, M): the remainder when N is not a multiple of 4. */
static void channel(const float *x, long M, long K, const int8_t *w, const float *scale, const float *bias,
                    float *y, long N, long n) {
    const long K8 = K & ~7L;
    const int8_t *wn = w + n * K;
    for (long m = 0; m < M; m++) {
        const float *xm = x + m * K;
        f32x8 acc = f32x8_zero();
        for (long k = 0; k < K8; k += 8)
            acc = f32x8_fma(f32x8_load_i8(wn + k), f32x8_load(xm + k), acc);
        float sum = f32x8_hsum(acc);
        for (long k = K8; k < K; k++)
            sum += (float)wn[k] * xm[k];
        y[m * N + n] = sum * scale[n] + (bias ? bias[n] : 0.0f);
    }
}

/* The scalar tail of K and the scale and bias of channels [n0, n0 + 4) for one input row. */
static void finish4(const float *xm, long K, const int8_t *const rows[4], float s[4], const float *scale,
                    const float *bias, float *ym, long n0) {
    for (int r = 0; r < 4; r++) {
        for (long j = K & ~7L; j < K; j++)
            s[r] += (float)rows[r][j] * xm[j];
        ym[n0 + r] = s[r] * scale[n0 + r] + (bias ? bias[n0 + r] : 0.0f);
    }
}

/* Output channels [n0, n0 + 4) for input rows [0, M). Eight named accumulators (4 channels x 2 rows, or x 2 halves
 * of a 16-wide step for a last odd row) keep two FMAs per cycle in flight and stay in registers (an indexed array
 * would not). */
static void block4(const float *x, long M, long K, const int8_t *w, const float *scale, const float *bias,
                   float *y, long N, long n0) {
    const long K16 = K & ~15L, K8 = K & ~7L;
    const int8_t *w0 = w + n0 * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    const int8_t *const rows[4] = {w0, w1, w2, w3};
    long m = 0;
    for (; m + 1 < M; m += 2) {  /* two input rows share each converted weight vector */
        const float *xa = x + m * K, *xb = xa + K;
        f32x8 a0 = f32x8_zero(), a1 = f32x8_zero(), a2 = f32x8_zero(), a3 = f32x8_zero(), b0 = f32x8_zero(),
              b1 = f32x8_zero(), b2 = f32x8_zero(), b3 = f32x8_zero();
        for (long k = 0; k < K8; k += 8) {
            const f32x8 va = f32x8_load(xa + k), vb = f32x8_load(xb + k);
            const f32x8 c0 = f32x8_load_i8(w0 + k), c1 = f32x8_load_i8(w1 + k), c2 = f32x8_load_i8(w2 + k),
                        c3 = f32x8_load_i8(w3 + k);
            a0 = f32x8_fma(c0, va, a0);
            a1 = f32x8_fma(c1, va, a1);
            a2 = f32x8_fma(c2, va, a2);
            a3 = f32x8_fma(c3, va, a3);
            b0 = f32x8_fma(c0, vb, b0);
            b1 = f32x8_fma(c1, vb, b1);
            b2 = f32x8_fma(c2, vb, b2);
            b3 = f32x8_fma(c3, vb, b3);
        }
        float sa[4] = {f32x8_hsum(a0), f32x8_hsum(a1), f32x8_hsum(a2), f32x8_hsum(a3)},
              sb[4] = {f32x8_hsum(b0), f32x8_hsum(b1), f32x8_hsum(b2), f32x8_hsum(b3)};
        finish4(xa, K, rows, sa, scale, bias, y + m * N, n0);
        finish4(xb, K, rows, sb, scale, bias, y + (m + 1) * N, n0);
    }
    for (; m < M; m++) {
        const float *xm = x + m * K;
        f32x8 a0 = f32x8_zero(), a1 = f32x8_zero(), a2 = f32x8_zero(), a3 = f32x8_zero(), b0 = f32x8_zero(),
              b1 = f32x8_zero(), b2 = f32x8_zero(), b3 = f32x8_zero();
        long k = 0;
        for (; k < K16; k += 16) {
            const f32x8 xa = f32x8_load(xm + k), xb = f32x8_load(xm + k + 8);
            a0 = f32x8_fma(f32x8_load_i8(w0 + k), xa, a0);
            a1 = f32x8_fma(f32x8_load_i8(w1 + k), xa, a1);
            a2 = f32x8_fma(f32x8_load_i8(w2 + k), xa, a2);
            a3 = f32x8_fma(f32x8_load_i8(w3 + k), xa, a3);
            b0 = f32x8_fma(f32x8_load_i8(w0 + k + 8), xb, b0);
            b1 = f32x8_fma(f32x8_load_i8(w1 + k + 8), xb, b1);
            b2 = f32x8_fma(f32x8_load_i8(w2 + k + 8), xb, b2);
            b3 = f32x8_fma(f32x8_load_i8(w3 + k + 8), xb, b3);
        }
        for (; k < K8; k += 8) {
            const f32x8 xa = f32x8_load(xm + k);
            a0 = f32x8_fma(f32x8_load_i8(w0 + k), xa, a0);
            a1 = f32x8_fma(f32x8_load_i8(w1 + k), xa, a1);
            a2 = f32x8_fma(f32x8_load_i8(w2 + k), xa, a2);
            a3 = f32x8_fma(f32x8_load_i8(w3 + k), xa, a3);
        }
        float s[4] = {f32x8_hsum(f32x8_add(a0, b0)), f32x8_hsum(f32x8_add(a1, b1)), f32x8_hsum(f32x8_add(a2, b2)),
                      f32x8_hsum(f32x8_add(a3, b3))};
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
