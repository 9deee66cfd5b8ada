/* The W8A8 GEMM on AMX (Sapphire Rapids and later Xeons): u8 activations x s8 weights, int32 sums in the tile unit,
 * each output times its channel's scale as float32. Built only in the avx512_amx variant (BATCHGEN_AMX; kernels.py);
 * elsewhere this file is empty and oneDNN's int8 matmul runs.
 *
 * Why batchgen's own: at a decode step's 64 rows oneDNN's AMX int8 kernel streamed a 0.5B model's weights at
 * 10.5-14.4 GB/s where its bf16 kernel reached 15-19 (docs/performance.md), so int8 gained 1.4x, not 2x. This one
 * walks each panel of 32 output channels once from memory: the tile unit multiplies up to 32 rows (two 16-row A
 * tiles) by both 16-channel weight tiles per 64 K-values, then the panel's next 32 rows read the weights again from
 * the core's cache. Layout of the weights (cpu/int8_gemm.py pack): [N/16][K/4][16][4], the 16-channel block's four
 * consecutive K-values per channel side by side (the tile unit's "VNNI" layout), so a weight tile is 1 KiB in a row.
 *
 * The result is exact integer arithmetic then one float multiply: (float)(sum (a - 128) w) * scale[n], where the
 * zero point's share 128 * sum(w) comes precomputed (comp). oneDNN's matmul computes the same bits (tested). */
#include "kernels_simd.h"

#ifdef BATCHGEN_AMX
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands a process the tile registers' state only on request (5.16 and later): 0 once granted, else -1. */
int batchgen_amx_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0-3: int32 sums of (rows 16 i, channels 16 j), tiles 4-5: activations, 6-7: weights; all 16 x 64 bytes. */
static void configure_tiles(void) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++)
        c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* 16 x 16 int32 sums -> Y rows [m0, min(m0 + 16, M)), channels [n0, n0 + 16). */
static void store_scaled(const int32_t *sums, float *Y, long M, long N, long m0, long n0, const int32_t *comp,
                         const float *scale) {
    const __m512i zero_point = _mm512_loadu_si512(comp + n0);
    const __m512 s = _mm512_loadu_ps(scale + n0);
    for (long r = 0; r < 16 && m0 + r < M; r++) {
        const __m512i v = _mm512_sub_epi32(_mm512_loadu_si512(sums + r * 16), zero_point);
        _mm512_storeu_ps(Y + (m0 + r) * N + n0, _mm512_mul_ps(_mm512_cvtepi32_ps(v), s));
    }
}

/* Y [M, N] float32 = ((A - 128) W^T) * scale[n]: A [M, K] uint8 whose storage holds M rounded up to 16 rows (the
 * rows past M are read, their sums dropped), W packed as above, comp[n] = 128 * sum_k W[n, k]. K a multiple of 64,
 * N of 32. Threads split the 32-channel panels. */
void batchgen_amx_int8_gemm(const uint8_t *A, long M, long K, const int8_t *W, long N, const int32_t *comp,
                            const float *scale, float *Y, int threads) {
    const long mblocks = (M + 15) / 16, kblocks = K / 64, panels = N / 32, block = (K / 4) * 64;
    /* Up to 64 rows each panel's rows run before the next panel (its weights read from memory once, the rows' tiles
     * from the core's cache); more rows (a prefill) go a pair of tiles at a time over 4 panels, whose weights stay in
     * the core's cache while the pair's activations stay in L1. Measured on the AMX Xeon, 0.5B shapes (gate/up,
     * down, q/k/v; microseconds, oneDNN / this order / the other): 64 rows 631/512/513, 419/223/277, 97/72/75;
     * 1024 rows 3881/3893/5542, 2000/1705/2428, 474/481/444. */
    const long group = mblocks <= 4 ? 1 : 4, groups = (panels + group - 1) / group;
#pragma omp parallel num_threads(threads) if (panels > 1)
    {
        configure_tiles();
        int32_t sums[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (long g = 0; g < groups; g++) {
            const long p_end = (g + 1) * group < panels ? (g + 1) * group : panels;
            for (long mb = 0; mb < mblocks; mb += 2) {
                const int pair = mb + 1 < mblocks;
                const uint8_t *a0 = A + mb * 16 * K, *a1 = a0 + 16 * K;
                for (long p = g * group; p < p_end; p++) {
                    const int8_t *w0 = W + 2 * p * block, *w1 = w0 + block;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (long kb = 0; kb < kblocks; kb++) {
                        _tile_loadd(6, w0 + kb * 1024, 64);
                        _tile_loadd(7, w1 + kb * 1024, 64);
                        _tile_loadd(4, a0 + kb * 64, K);
                        _tile_dpbusd(0, 4, 6);
                        _tile_dpbusd(1, 4, 7);
                        if (pair) {
                            _tile_loadd(5, a1 + kb * 64, K);
                            _tile_dpbusd(2, 5, 6);
                            _tile_dpbusd(3, 5, 7);
                        }
                    }
                    _tile_stored(0, sums[0], 64);
                    _tile_stored(1, sums[1], 64);
                    store_scaled(sums[0], Y, M, N, mb * 16, 2 * p * 16, comp, scale);
                    store_scaled(sums[1], Y, M, N, mb * 16, 2 * p * 16 + 16, comp, scale);
                    if (pair) {
                        _tile_stored(2, sums[2], 64);
                        _tile_stored(3, sums[3], 64);
                        store_scaled(sums[2], Y, M, N, mb * 16 + 16, 2 * p * 16, comp, scale);
                        store_scaled(sums[3], Y, M, N, mb * 16 + 16, 2 * p * 16 + 16, comp, scale);
                    }
                }
            }
        }
        _tile_release();
    }
}
#endif
