/* Decode attention over the slot KV cache (kernels.py decode_attention) and the attention half of a decode step in
 * one call (decode_layer_attention: rotary embedding, cache write, attention), one new token per row, grouped-query
 * heads, each row over its own cache length; float32 arithmetic, the cache float32 or bfloat16.
 *
 * Two algorithms for one (row, KV head) task, not one written twice: attend_blocked (16 lanes, AVX-512 variants,
 * head size a multiple of 16) scores 4 keys x up to 4 heads per pass, keeps the softmax unnormalized and prefetches
 * the cache; attend_rowwise (8 lanes, every variant) scores key by key and normalizes before the weighted sum. They
 * round differently, so each variant keeps the one it had and its outputs bit for bit.
 */
#include "kernels_simd.h"

/* Softmax of s[0, L) in place (8 lanes; the tail through expf). */
static void softmax(float *s, long L) {
    float mx = s[0];
    for (long l = 1; l < L; l++)
        mx = s[l] > mx ? s[l] : mx;
    const f32x8 vmx = f32x8_set1(mx);
    f32x8 vsum = f32x8_zero();
    long l = 0;
    for (; l + 8 <= L; l += 8) {
        const f32x8 e = f32x8_exp(f32x8_sub(f32x8_load(s + l), vmx));
        f32x8_store(s + l, e);
        vsum = f32x8_add(vsum, e);
    }
    float sum = f32x8_hsum(vsum);
    for (; l < L; l++) {
        s[l] = expf(s[l] - mx);
        sum += s[l];
    }
    const float inv = 1.0f / sum;
    for (l = 0; l < L; l++)
        s[l] *= inv;
}

/* The group's attention, 8 lanes wide, d a multiple of 8: each (head, key) score reduced on its own, the softmax
 * normalized in place, then the weighted sum of values 64 output dims at a time. */
static void attend_rowwise(const float *qg, const void *kh, const void *vh, long L, long d, long group, float scale,
                           int kv_bf16, float *og) {
    float *s = malloc(sizeof(float) * group * L);
    for (long l = 0; l < L; l++) {
        const long key = l * d;
        for (long t = 0; t < group; t++) {
            f32x8 acc = f32x8_zero();
            for (long c = 0; c < d; c += 8)
                acc = f32x8_fma(f32x8_load(qg + t * d + c), f32x8_load_maybe_bf16(kh, key + c, kv_bf16), acc);
            s[t * L + l] = f32x8_hsum(acc) * scale;
        }
    }
    for (long t = 0; t < group; t++) {
        float *st = s + t * L;
        softmax(st, L);
        for (long c0 = 0; c0 < d; c0 += 64) {  /* 8 accumulators of 8 floats: 64 output dims at a time */
            const long width = d - c0 < 64 ? d - c0 : 64;
            f32x8 acc[8];
            for (int a = 0; a < 8; a++)
                acc[a] = f32x8_zero();
            if (width == 64) {  /* constant trip count: the accumulators stay in registers */
                for (long l = 0; l < L; l++) {
                    const f32x8 p = f32x8_set1(st[l]);
                    const long val = l * d + c0;
                    for (int a = 0; a < 8; a++)
                        acc[a] = f32x8_fma(p, f32x8_load_maybe_bf16(vh, val + 8 * a, kv_bf16), acc[a]);
                }
            } else {
                for (long l = 0; l < L; l++) {
                    const f32x8 p = f32x8_set1(st[l]);
                    const long val = l * d + c0;
                    for (long c = 0; c < width; c += 8)
                        acc[c / 8] = f32x8_fma(p, f32x8_load_maybe_bf16(vh, val + c, kv_bf16), acc[c / 8]);
                }
            }
            for (long c = 0; c < width; c += 8)
                f32x8_store(og + t * d + c0 + c, acc[c / 8]);
        }
    }
    free(s);
}

#ifdef BATCHGEN_AVX512
/* How far ahead attend_blocked prefetches its key and value streams. Each (row, KV head) reads its keys and values
 * from the slot cache, a few KiB to a few hundred KiB apart from the next task's, and the hardware prefetcher stops
 * at every 4 KiB page: measured side by side on the Zen 4 EPYC (64 rows, 12 layers of bf16 cache, 190 and 600
 * positions), the prefetching kernel took 0.87x and 0.88x the time, with the same output. 512 to 8192 bytes
 * measured alike within the noise. */
#define PREFETCH_BYTES 2048

static inline void prefetch_lines(const char *p, long bytes) {
    for (long o = 0; o < bytes; o += 64)
        simd_prefetch(p + o);
}

/* The scores scale * q[t] . K[l] of the group's query heads (qg [group, d]) against keys kh [L, d] into
 * s[t * stride + l]: 4 keys at a time, each key chunk loaded (and widened from bf16) once for up to 4 heads, and
 * each (head, 4 keys) reduced together (f32x16_hsum4), where one reduction per (head, key) cost more than its FMAs. */
static void scores_blocked(const float *qg, const void *kh, long L, long d, long group, float scale, int kv_bf16,
                           float *s, long stride) {
    const f32x16 zero = f32x16_zero();
    const __m128 vscale = f32x4_set1(scale);
    const long item = kv_bf16 ? 2 : 4, ahead = PREFETCH_BYTES / (d * item);  /* keys ahead of the one read */
    for (long l0 = 0; l0 < L; l0 += 4) {
        const long nk = L - l0 < 4 ? L - l0 : 4;
        if (l0 + ahead < L)  /* the keys `ahead` positions on */
            prefetch_lines((const char *)kh + (l0 + ahead) * d * item,
                           (L - l0 - ahead < 4 ? L - l0 - ahead : 4) * d * item);
        for (long t0 = 0; t0 < group; t0 += 4) {
            const long nt = group - t0 < 4 ? group - t0 : 4;
            f32x16 acc[4][4];
            for (int t = 0; t < 4; t++)
                for (int j = 0; j < 4; j++)
                    acc[t][j] = zero;
            for (long c = 0; c < d; c += 16) {
                f32x16 key[4];
                for (int j = 0; j < 4; j++)  /* keys past L read as zero (the cache may end there) */
                    key[j] = j < nk ? f32x16_load_maybe_bf16(kh, (l0 + j) * d + c, kv_bf16) : zero;
                for (int t = 0; t < 4; t++) {
                    if (t >= nt)
                        break;
                    const f32x16 q = f32x16_load(qg + (t0 + t) * d + c);
                    for (int j = 0; j < 4; j++)
                        acc[t][j] = f32x16_fma(q, key[j], acc[t][j]);
                }
            }
            for (int t = 0; t < nt; t++) {
                const __m128 sums = f32x4_mul(f32x16_hsum4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]), vscale);
                float *dst = s + (t0 + t) * stride + l0;
                if (nk == 4) {
                    f32x4_store(dst, sums);
                } else {
                    float tmp[4];
                    f32x4_store(tmp, sums);
                    for (long j = 0; j < nk; j++)
                        dst[j] = tmp[j];
                }
            }
        }
    }
}

/* The group's attention, 16 lanes wide, d a multiple of 16: scores of 16 keys at a time stay in one register
 * (each key's dot product reduced once), the softmax (unnormalized; 1 / sum applied to the output) and the weighted
 * sum of values run 16 lanes wide. Measured against attend_rowwise on the benchmark model's decode steps
 * (docs/engines.md "The hf engine"). */
static void attend_blocked(const float *qg, const void *kh, const void *vh, long L, long d, long group, float scale,
                           int kv_bf16, float *og) {
    const long stride = L + 16;
    float *s = malloc(sizeof(float) * group * stride), inv[group];
    scores_blocked(qg, kh, L, d, group, scale, kv_bf16, s, stride);
    for (long t = 0; t < group; t++) {  /* softmax of each head's scores, unnormalized; 1 / sum kept apart */
        float *st = s + t * stride;
        f32x16 vmx = f32x16_set1(-INFINITY);
        long l = 0;
        for (; l + 16 <= L; l += 16)
            vmx = f32x16_max(vmx, f32x16_load(st + l));
        float mx = f32x16_hmax(vmx);
        for (; l < L; l++)
            mx = st[l] > mx ? st[l] : mx;
        f32x16 vsum = f32x16_zero();
        const f32x16 bmx = f32x16_set1(mx);
        for (l = 0; l < L; l += 16) {  /* the tail lanes are masked off */
            const mask16 live = mask16_first(L - l);
            const f32x16 e = f32x16_exp(f32x16_sub(f32x16_load_masked(live, st + l), bmx));
            const f32x16 kept = f32x16_keep(live, e);
            f32x16_store_masked(st + l, live, kept);
            vsum = f32x16_add(vsum, kept);
        }
        inv[t] = 1.0f / f32x16_hsum(vsum);
    }
    const long vitem = kv_bf16 ? 2 : 4, vahead = PREFETCH_BYTES / (d * vitem);
    /* The weighted sum of values, 64 output dims and up to 3 heads at a time: each value chunk is loaded (and
     * widened from bf16) once for the heads of the block; 3 heads x 4 accumulators + 4 values fit the registers. */
    for (long c0 = 0; c0 < d; c0 += 64) {
        const long width = d - c0 < 64 ? d - c0 : 64, chunks = width / 16;
        for (long t0 = 0; t0 < group; t0 += 3) {
            const long nt = group - t0 < 3 ? group - t0 : 3;
            f32x16 acc[3][4];
            for (int t = 0; t < 3; t++)
                for (int c = 0; c < 4; c++)
                    acc[t][c] = f32x16_zero();
            for (long m = 0; m < L; m++) {
                if (m + vahead < L && c0 == 0 && t0 == 0)
                    prefetch_lines((const char *)vh + (m + vahead) * d * vitem, d * vitem);
                f32x16 val[4];
                for (int c = 0; c < 4; c++)
                    val[c] = c < chunks ? f32x16_load_maybe_bf16(vh, m * d + c0 + 16 * c, kv_bf16) : f32x16_zero();
                for (int t = 0; t < 3; t++) {
                    if (t >= nt)
                        break;
                    const f32x16 p = f32x16_set1(s[(t0 + t) * stride + m]);
                    for (int c = 0; c < 4; c++)
                        acc[t][c] = f32x16_fma(p, val[c], acc[t][c]);
                }
            }
            for (long t = 0; t < nt; t++) {
                const f32x16 vinv = f32x16_set1(inv[t0 + t]);
                for (long c = 0; c < chunks; c++)
                    f32x16_store(og + (t0 + t) * d + c0 + 16 * c, f32x16_mul(acc[t][c], vinv));
            }
        }
    }
    free(s);
}
#endif

/* One (row, KV head) task: the group's attention over L positions; keys and values kh, vh [L, d] float32 or, where
 * kv_bf16 is set, bfloat16 (half the bytes to read: a decode step's attention streams the whole cache, and measured
 * bound by memory bandwidth at the working batch). */
static void attend_group(const float *qg, const void *kh, const void *vh, long L, long d, long group, float scale,
                         int kv_bf16, float *og) {
#ifdef BATCHGEN_AVX512
    if (d % 16 == 0) {
        attend_blocked(qg, kh, vh, L, d, group, scale, kv_bf16, og);
        return;
    }
#endif
    attend_rowwise(qg, kh, vh, L, d, group, scale, kv_bf16, og);
}

/* Decode attention: for row r and query head h (KV head j = h / group),
 * out[r, h] = softmax(scale * q[r, h] . K[r, j, l] for l < lengths[r]) . V[r, j, :lengths[r]].
 * q, out: [n, heads, d] contiguous; k, v: one layer of the float32 slot cache, row r / KV head j at
 * r * slot_stride + j * head_stride, positions of d floats each; d a multiple of 8. Each (row, KV head) is one
 * task: its keys and values are read once, each row over its own length only (no padding). */
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
 * and sums are rounded separately, as torch does (no FMA; the library is built with -ffp-contract=off): the result
 * is bit for bit transformers' apply_rotary_pos_emb. */
static void rope_head(float *x, const float *cos, const float *sin, long d) {
    const long h = d / 2;
    for (long i = 0; i < h; i += 8) {
        const f32x8 lo = f32x8_load(x + i), hi = f32x8_load(x + h + i);
        f32x8_store(x + i, f32x8_sub(f32x8_mul(lo, f32x8_load(cos + i)), f32x8_mul(hi, f32x8_load(sin + i))));
        f32x8_store(x + h + i,
                    f32x8_add(f32x8_mul(hi, f32x8_load(cos + h + i)), f32x8_mul(lo, f32x8_load(sin + h + i))));
    }
}

/* Store n floats (n a multiple of 8) as float32 or, where bf16 is set, as bfloat16. */
static inline void store_row(void *dst, const float *src, long n, int bf16) {
    if (!bf16) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    for (long c = 0; c < n; c += 8)
        f32x8_store_bf16((uint16_t *)dst + c, f32x8_load(src + c));
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
                    f32x8_store(qg + c, f32x8_load_bf16(src + j * group * d + c));
                for (long c = 0; c < d; c += 8) {
                    f32x8_store(key + c, f32x8_load_bf16(src + (heads + j) * d + c));
                    f32x8_store(value + c, f32x8_load_bf16(src + (heads + kv_heads + j) * d + c));
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
