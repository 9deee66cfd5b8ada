/* The W8A8 GEMM with AVX-512 VNNI (`vpdpbusd`: Cascade Lake and later Xeons, Zen 4, Zen 5): u8 activations x s8
 * weights, int32 sums, each output times its channel's scale as float32: the arithmetic of kernels_amx.c and its
 * weight layout (cpu/int8_gemm.py pack: [N/16][K/4][16][4], a 16-channel block's four consecutive K-values per channel
 * side by side, so one 64-byte load is what one `vpdpbusd` multiplies by a row's four bytes broadcast). Built in
 * the AVX-512 variants (BATCHGEN_AVX512) with the instruction allowed per function; cpu/int8_gemm.py runs it only
 * where the CPU reports avx512_vnni. Elsewhere this file is empty and oneDNN's int8 matmul runs.
 *
 * Why batchgen's own: oneDNN's int8 matmul costs about 20 us a call at a decode step's few rows, whatever the
 * weight's size, and a 0.5B model's decode step makes ~100 such calls; this loop starts at once and reads each
 * weight byte once. A tile of up to 6 rows by 4 blocks (64 channels) holds 24 sums in registers; its weights (64 x K
 * bytes, 56 KiB at K = 896) stay in the core's cache while the next 6 rows read them. Threads split the 64-channel
 * tiles. Measured against oneDNN on a Zen 5 EPYC, 2 threads, Qwen2.5-0.5B shapes (benchmarks/int8_gemm.py): 3.5x
 * at one row on q/k/v, 1.3x on the LM head, 0.96-1.41x at 64 rows, 0.95-1.69x at 1024.
 *
 * The result is exact integer arithmetic then one float multiply: (float)(sum (a - 128) w) * scale[n], the zero
 * point's share 128 * sum(w) precomputed (comp); the bits of the AMX kernel and of oneDNN's matmul (tested). */
#include "kernels_simd.h"

#ifdef BATCHGEN_AVX512
#include <omp.h>

/* no-tree-pre: with GCC 12's partial-redundancy pass on, every sum was copied to the stack on each step (half the
 * speed at 64 rows) */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni"), optimize("no-tree-pre")))
#define MR 6 /* rows a tile */
#define NB 4 /* 16-channel blocks a tile */

static inline int32_t four_bytes(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* rows x blocks sums over all K, then scaled into Y. Inlined with constant rows and blocks, each sum its own
 * variable (an array of vectors made GCC 12 copy every sum through the stack on each step). */
#define ACC_ROW(r) __m512i c##r##0 = _mm512_setzero_si512(), c##r##1 = c##r##0, c##r##2 = c##r##0, c##r##3 = c##r##0;
#define DOT_ROW(r)                                                                                                 \
    if (rows > r) {                                                                                                \
        const __m512i a = _mm512_set1_epi32(four_bytes(A + r * K + k));                                           \
        c##r##0 = _mm512_dpbusd_epi32(c##r##0, a, w0);                                                             \
        if (blocks > 1) c##r##1 = _mm512_dpbusd_epi32(c##r##1, a, w1);                                             \
        if (blocks > 2) c##r##2 = _mm512_dpbusd_epi32(c##r##2, a, w2);                                             \
        if (blocks > 3) c##r##3 = _mm512_dpbusd_epi32(c##r##3, a, w3);                                             \
    }
#define STORE(r, b)                                                                                                \
    if (rows > r && blocks > b)                                                                                    \
        _mm512_storeu_ps(Y + r * N + n0 + 16 * b,                                                                  \
                         _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(c##r##b, zp##b)), s##b));
#define STORE_ROW(r) STORE(r, 0) STORE(r, 1) STORE(r, 2) STORE(r, 3)

static inline VNNI __attribute__((always_inline)) void tile(const uint8_t *A, long K, const int8_t *W, long N,
                                                              const int32_t *comp, const float *scale, float *Y,
                                                              long n0, const int rows, const int blocks) {
    ACC_ROW(0) ACC_ROW(1) ACC_ROW(2) ACC_ROW(3) ACC_ROW(4) ACC_ROW(5)
    const long block = K * 16; /* bytes of one 16-channel block */
    const int8_t *w = W + (n0 / 16) * block;
    __m512i w0, w1 = _mm512_setzero_si512(), w2 = w1, w3 = w1;
    for (long k = 0; k < K; k += 4) {
        w0 = _mm512_loadu_si512(w + k * 16);
        if (blocks > 1) w1 = _mm512_loadu_si512(w + block + k * 16);
        if (blocks > 2) w2 = _mm512_loadu_si512(w + 2 * block + k * 16);
        if (blocks > 3) w3 = _mm512_loadu_si512(w + 3 * block + k * 16);
        DOT_ROW(0) DOT_ROW(1) DOT_ROW(2) DOT_ROW(3) DOT_ROW(4) DOT_ROW(5)
    }
    __m512i zp0 = _mm512_loadu_si512(comp + n0), zp1 = zp0, zp2 = zp0, zp3 = zp0;
    __m512 s0 = _mm512_loadu_ps(scale + n0), s1 = s0, s2 = s0, s3 = s0;
    if (blocks > 1) zp1 = _mm512_loadu_si512(comp + n0 + 16), s1 = _mm512_loadu_ps(scale + n0 + 16);
    if (blocks > 2) zp2 = _mm512_loadu_si512(comp + n0 + 32), s2 = _mm512_loadu_ps(scale + n0 + 32);
    if (blocks > 3) zp3 = _mm512_loadu_si512(comp + n0 + 48), s3 = _mm512_loadu_ps(scale + n0 + 48);
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5)
}

/* One function per tile shape (rows 1-6, blocks 1-4), each with its own register allocation. */
typedef void (*tile_fn)(const uint8_t *, long, const int8_t *, long, const int32_t *, const float *, float *, long);
#define TILE_FN(R, B)                                                                                              \
    static VNNI __attribute__((noinline)) void tile_##R##_##B(const uint8_t *A, long K, const int8_t *W, long N,    \
                                                              const int32_t *comp, const float *scale, float *Y,  \
                                                              long n0) {                                          \
        tile(A, K, W, N, comp, scale, Y, n0, R, B);                                                                \
    }
#define TILE_FNS(R) TILE_FN(R, 1) TILE_FN(R, 2) TILE_FN(R, 3) TILE_FN(R, 4)
TILE_FNS(1) TILE_FNS(2) TILE_FNS(3) TILE_FNS(4) TILE_FNS(5) TILE_FNS(6)
#define TILE_ROW(R) {tile_##R##_1, tile_##R##_2, tile_##R##_3, tile_##R##_4}
static const tile_fn TILES[MR][NB] = {TILE_ROW(1), TILE_ROW(2), TILE_ROW(3), TILE_ROW(4), TILE_ROW(5), TILE_ROW(6)};

/* Runs CALL for every tile of 6 rows (rows: 1-6, from m0) by 4 blocks (blocks: 1-4, from channel n0): threads split
 * the 64-channel tiles, a thread per tile group only where the work pays for waking it (a few microseconds). */
#define FOR_EACH_TILE(CALL)                                                                                        \
    {                                                                                                              \
        const long tiles = (N / 16 + NB - 1) / NB;                                                                 \
        const int team = (double)M * (double)K * (double)N < 65536.0 ? 1 : threads;                                \
        _Pragma("omp parallel for num_threads(team) schedule(static) if (team > 1 && tiles > 1)")                  \
        for (long t = 0; t < tiles; t++) {                                                                         \
            const long n0 = t * NB * 16;                                                                           \
            const int blocks = (int)((N - n0) / 16 < NB ? (N - n0) / 16 : NB);                                     \
            for (long m0 = 0; m0 < M; m0 += MR) {                                                                  \
                const int rows = (int)(M - m0 < MR ? M - m0 : MR);                                                 \
                CALL;                                                                                              \
            }                                                                                                      \
        }                                                                                                          \
    }

/* Y [M, N] float32 = ((A - 128) W^T) * scale[n]: A [M, K] uint8 (row-major, no padding needed), W packed as above,
 * comp[n] = 128 * sum_k W[n, k]. K a multiple of 4, N of 16. */
VNNI void batchgen_vnni_int8_gemm(const uint8_t *A, long M, long K, const int8_t *W, long N, const int32_t *comp,
                                  const float *scale, float *Y, int threads) {
    FOR_EACH_TILE(TILES[rows - 1][blocks - 1](A + m0 * K, K, W, N, comp, scale, Y + m0 * N, n0))
}

/* ---- W4A8: int4 weights (quant/w4a8.py), group-wise asymmetric, in the same dot products ----
 *
 * w[n, k] = scale[n, g] * q[n, k] + min[n, g], q in [0, 15] (quant/int4.py quantize_int4, groups of G along K). With
 * a = u - 128 the row's int8 values: sum_k w a = sum_g scale[n, g] (sum_k q u - 128 Q[n, g]) + min[n, g] S[m, g],
 * Q the group's sum of q, S the row's sum of a over the group. q in [0, 15] is a valid s8 operand: the same
 * `vpdpbusd` as int8. Per group the int32 sum less 128 Q (exact, in int32: q128 = 128 Q precomputed) goes to float
 * times the scale, plus min times S. Layout: [N/16][K/8][16][4] bytes, a byte's low nibble q[c, 8 t + b] and its
 * high nibble q[c, 8 t + 4 + b]: one 64-byte load, a mask and a shift give two steps' weights. Scales and mins as
 * float32, q128 as int32, each [N/16][K/G][16]. Output: Y[m, n] before the row's scale (as the int8 GEMM). */
#define DOT4_ROW(r, half)                                                                                          \
    if (rows > r) {                                                                                                \
        const __m512i a = _mm512_set1_epi32(four_bytes(A + r * K + k + 4 * (half)));                               \
        c##r##0 = _mm512_dpbusd_epi32(c##r##0, a, w0);                                                             \
        if (blocks > 1) c##r##1 = _mm512_dpbusd_epi32(c##r##1, a, w1);                                             \
        if (blocks > 2) c##r##2 = _mm512_dpbusd_epi32(c##r##2, a, w2);                                             \
        if (blocks > 3) c##r##3 = _mm512_dpbusd_epi32(c##r##3, a, w3);                                             \
    }
#define NIBBLES4(half)                                                                                             \
    w0 = _mm512_and_si512(half ? _mm512_srli_epi16(_mm512_loadu_si512(w + k * 8), 4)                              \
                               : _mm512_loadu_si512(w + k * 8), low);                                              \
    if (blocks > 1) w1 = _mm512_and_si512(half ? _mm512_srli_epi16(_mm512_loadu_si512(w + block + k * 8), 4)       \
                                               : _mm512_loadu_si512(w + block + k * 8), low);                      \
    if (blocks > 2) w2 = _mm512_and_si512(half ? _mm512_srli_epi16(_mm512_loadu_si512(w + 2 * block + k * 8), 4)   \
                                               : _mm512_loadu_si512(w + 2 * block + k * 8), low);                  \
    if (blocks > 3) w3 = _mm512_and_si512(half ? _mm512_srli_epi16(_mm512_loadu_si512(w + 3 * block + k * 8), 4)   \
                                               : _mm512_loadu_si512(w + 3 * block + k * 8), low);
#define FOLD(r, b)                                                                                                 \
    if (rows > r && blocks > b) {                                                                                  \
        float *f = acc + (r * NB + b) * 16;                                                                        \
        const __m512i exact = _mm512_sub_epi32(c##r##b, _mm512_loadu_si512(zq + b * groups * 16));              \
        const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_loadu_ps(sc + b * groups * 16),         \
                                         _mm512_load_ps(f));                                                       \
        _mm512_store_ps(f, _mm512_fmadd_ps(_mm512_loadu_ps(mn + b * groups * 16), _mm512_set1_ps(S_g[r * groups]),   \
                                           t));                                                                    \
        c##r##b = _mm512_setzero_si512();                                                                          \
    }
#define FOLD_ROW(r) FOLD(r, 0) FOLD(r, 1) FOLD(r, 2) FOLD(r, 3)
#define STORE4(r, b)                                                                                               \
    if (rows > r && blocks > b)                                                                                    \
        _mm512_storeu_ps(Y + r * N + n0 + 16 * b, _mm512_load_ps(acc + (r * NB + b) * 16));
#define STORE4_ROW(r) STORE4(r, 0) STORE4(r, 1) STORE4(r, 2) STORE4(r, 3)

static inline VNNI __attribute__((always_inline)) void tile4(const uint8_t *A, long K, const uint8_t *W, long N,
                                                               const float *scales, const float *mins, long G,
                                                               const float *S, const int32_t *q128, float *Y, long n0,
                                                               const int rows, const int blocks) {
    ACC_ROW(0) ACC_ROW(1) ACC_ROW(2) ACC_ROW(3) ACC_ROW(4) ACC_ROW(5)
    float acc[MR * NB * 16] __attribute__((aligned(64)));
    memset(acc, 0, sizeof acc);
    const long block = K * 8, groups = K / G; /* bytes of one 16-channel block */
    const uint8_t *w = W + (n0 / 16) * block;
    const __m512i low = _mm512_set1_epi8(15);
    __m512i w0, w1 = _mm512_setzero_si512(), w2 = w1, w3 = w1;
    for (long g = 0; g < groups; g++) {
        for (long k = g * G; k < (g + 1) * G; k += 8) {
            NIBBLES4(0)
            DOT4_ROW(0, 0) DOT4_ROW(1, 0) DOT4_ROW(2, 0) DOT4_ROW(3, 0) DOT4_ROW(4, 0) DOT4_ROW(5, 0)
            NIBBLES4(1)
            DOT4_ROW(0, 1) DOT4_ROW(1, 1) DOT4_ROW(2, 1) DOT4_ROW(3, 1) DOT4_ROW(4, 1) DOT4_ROW(5, 1)
        }
        const float *sc = scales + ((n0 / 16) * groups + g) * 16, *mn = mins + ((n0 / 16) * groups + g) * 16;
        const int32_t *zq = q128 + ((n0 / 16) * groups + g) * 16;
        const float *S_g = S + g; /* S_g[r * groups]: row r's sum over group g */
        FOLD_ROW(0) FOLD_ROW(1) FOLD_ROW(2) FOLD_ROW(3) FOLD_ROW(4) FOLD_ROW(5)
    }
    STORE4_ROW(0) STORE4_ROW(1) STORE4_ROW(2) STORE4_ROW(3) STORE4_ROW(4) STORE4_ROW(5)
}

typedef void (*tile4_fn)(const uint8_t *, long, const uint8_t *, long, const float *, const float *, long,
                         const float *, const int32_t *, float *, long);
#define TILE4_FN(R, B)                                                                                             \
    static VNNI __attribute__((noinline)) void tile4_##R##_##B(const uint8_t *A, long K, const uint8_t *W, long N,  \
                                                               const float *scales, const float *mins, long G,     \
                                                               const float *S, const int32_t *q128, float *Y,     \
                                                               long n0) {                                          \
        tile4(A, K, W, N, scales, mins, G, S, q128, Y, n0, R, B);                                                  \
    }
#define TILE4_FNS(R) TILE4_FN(R, 1) TILE4_FN(R, 2) TILE4_FN(R, 3) TILE4_FN(R, 4)
TILE4_FNS(1) TILE4_FNS(2) TILE4_FNS(3) TILE4_FNS(4) TILE4_FNS(5) TILE4_FNS(6)
#define TILE4_ROW(R) {tile4_##R##_1, tile4_##R##_2, tile4_##R##_3, tile4_##R##_4}
static const tile4_fn TILES4[MR][NB] = {TILE4_ROW(1), TILE4_ROW(2), TILE4_ROW(3), TILE4_ROW(4), TILE4_ROW(5),
                                        TILE4_ROW(6)};

/* Y [M, N] float32 = the int4 weights times (A - 128), per row before its scale: A [M, K] uint8, W packed as above,
 * scales, mins (float32) and q128 (int32) [N/16][K/G][16]. G a multiple of 64 dividing K, N a multiple of 16. S, the
 * rows' group sums, is computed here first ([M, K/G] floats from the heap). Returns 0, or -1 where the heap refused
 * them (nothing written). Threads split the 64-channel tiles. */
VNNI int batchgen_vnni_int4_gemm(const uint8_t *A, long M, long K, const uint8_t *W, long N, const float *scales,
                                 const float *mins, long G, const int32_t *q128, float *Y, int threads) {
    const long groups = K / G;
    float *S = malloc(sizeof(float) * (size_t)(M * groups));
    if (S == NULL)
        return -1;
    for (long m = 0; m < M; m++)
        for (long g = 0; g < groups; g++) {
            __m512i sum = _mm512_setzero_si512();
            for (long k = g * G; k < (g + 1) * G; k += 64)
                sum = _mm512_add_epi64(sum, _mm512_sad_epu8(_mm512_loadu_si512(A + m * K + k),
                                                            _mm512_setzero_si512()));
            S[m * groups + g] = (float)(_mm512_reduce_add_epi64(sum) - 128 * G);
        }
    FOR_EACH_TILE(TILES4[rows - 1][blocks - 1](A + m0 * K, K, W, N, scales, mins, G, S + m0 * groups, q128,
                                               Y + m0 * N, n0))
    free(S);
    return 0;
}
#endif /* BATCHGEN_AVX512 */
