/* Absorbed multi-head latent attention decode over a paged latent cache (DeepSeek-V2/V3 MLA).
 *
 * Each sequence's one query token has, per head, a query of `width` = kv_lora_rank + rope
 * values (the nope part already folded into latent space by W_UK, then q_pe). Every cached
 * row is [latent (rank) | rotated rope key] and is both the key (all `width` values) and the
 * value (its first `rank` values), shared by the heads:
 *     out[b, h, :rank] = softmax_l(scale * q[b, h] . row_l) @ row_l[:rank]
 * Work is split into tasks of (sequence, HEADS_PER_TASK heads) whatever the batch, and each
 * task computes its heads alone in one fixed order: a sequence's result does not depend on the
 * sequences beside it (batch-invariant). float32 query and output; the cache float32, or FP8
 * E4M3 bits (stoker_mla_decode_attention_fp8: a row element is value x k_scale), widened to
 * float once per task and position (fp8.h reads value / 256, so k_scale x 256 joins the score
 * scale and the output's multiplier).
 * The twin is kernels/reference.py `mla_decode_attention`. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp8.h"

#define HEADS_PER_TASK 4

/* n FP8 E4M3 bytes at p -> floats / 256 in dst */
static inline void widen_fp8(float *restrict dst, const uint8_t *restrict p, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, fp8x16_div256(p + i));
#elif defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, fp8x8_div256(p + i));
#endif
    for (; i < n; i++) dst[i] = fp8_div256_table[p[i]];
}

static inline float dot_f32(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Row `pos` of a sequence's context (rows of `width` elements) as floats: the cache's own
 * memory when float32, else its first n FP8 values widened into rowbuf (value / 256). */
static inline const float *cache_row(const void *cache, int fp8, float *restrict rowbuf, const int32_t *table,
                                     int64_t pos, int64_t block_size, int64_t width, int64_t n) {
    const int64_t slot = (int64_t)table[pos / block_size] * block_size + pos % block_size;
    if (!fp8) return (const float *)cache + slot * width;
    widen_fp8(rowbuf, (const uint8_t *)cache + slot * width, n);
    return rowbuf;
}

/* Returns 0 on success, 1 if scratch memory could not be allocated, 2 if a context length is
 * negative or needs more blocks than a table row holds, 3 if a block id that would be read is
 * outside [0, num_blocks). Checked before any read. */
static int mla_decode(const float *query, const void *cache, int fp8, float k_scale, int64_t num_blocks,
                      const int32_t *block_tables, int64_t max_blocks, const int32_t *context_lens, float *out,
                      int64_t num_seqs, int64_t num_heads, int64_t width, int64_t rank, int64_t block_size, float scale,
                      int num_threads) {
    const float vmul = fp8 ? k_scale * 256.0f : 1.0f; /* an FP8 row widens to value / 256 */
    const float score_scale = scale * vmul;
    int64_t max_len = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t len = context_lens[b];
        if (len < 0 || len > max_blocks * block_size) return 2;
        const int64_t used = (len + block_size - 1) / block_size;
        for (int64_t i = 0; i < used; i++) {
            const int32_t id = block_tables[b * max_blocks + i];
            if (id < 0 || id >= num_blocks) return 3;
        }
        if (len > max_len) max_len = len;
    }
    const int64_t chunks = (num_heads + HEADS_PER_TASK - 1) / HEADS_PER_TASK;
    const int64_t tasks = num_seqs * chunks;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(HEADS_PER_TASK * (max_len > 0 ? max_len : 1)));
        float *rowbuf = fp8 ? malloc(sizeof(float) * (size_t)width) : NULL; /* one widened row */
        if (!scores || (fp8 && !rowbuf)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < tasks; t++) {
            if (!scores || (fp8 && !rowbuf)) continue;
            const int64_t b = t / chunks, h0 = (t % chunks) * HEADS_PER_TASK;
            const int64_t h1 = h0 + HEADS_PER_TASK < num_heads ? h0 + HEADS_PER_TASK : num_heads;
            const int64_t len = context_lens[b];
            const int32_t *table = block_tables + b * max_blocks;
            for (int64_t h = h0; h < h1; h++) memset(out + (b * num_heads + h) * rank, 0, sizeof(float) * (size_t)rank);
            if (len == 0) continue;
            for (int64_t pos = 0; pos < len; pos++) { /* scores */
                const float *row = cache_row(cache, fp8, rowbuf, table, pos, block_size, width, width);
                for (int64_t h = h0; h < h1; h++)
                    scores[(h - h0) * len + pos] = score_scale * dot_f32(query + (b * num_heads + h) * width, row, width);
            }
            float inv[HEADS_PER_TASK];
            for (int64_t h = h0; h < h1; h++) { /* softmax, per head */
                float *s = scores + (h - h0) * len, m = s[0], sum = 0.0f;
                for (int64_t pos = 1; pos < len; pos++) m = s[pos] > m ? s[pos] : m;
                for (int64_t pos = 0; pos < len; pos++) {
                    s[pos] = expf(s[pos] - m);
                    sum += s[pos];
                }
                inv[h - h0] = vmul / sum;
            }
            for (int64_t pos = 0; pos < len; pos++) { /* values: the rows' latent part */
                const float *row = cache_row(cache, fp8, rowbuf, table, pos, block_size, width, rank);
                for (int64_t h = h0; h < h1; h++) {
                    const float p = scores[(h - h0) * len + pos] * inv[h - h0];
                    float *restrict o = out + (b * num_heads + h) * rank;
                    for (int64_t i = 0; i < rank; i++) o[i] += p * row[i];
                }
            }
        }
        free(scores);
        free(rowbuf);
    }
    return failed;
}

int stoker_mla_decode_attention_f32(const float *query, const float *cache, int64_t num_blocks,
                                    const int32_t *block_tables, int64_t max_blocks, const int32_t *context_lens,
                                    float *out, int64_t num_seqs, int64_t num_heads, int64_t width, int64_t rank,
                                    int64_t block_size, float scale, int num_threads) {
    return mla_decode(query, cache, 0, 1.0f, num_blocks, block_tables, max_blocks, context_lens, out, num_seqs,
                      num_heads, width, rank, block_size, scale, num_threads);
}

/* As stoker_mla_decode_attention_f32 over an FP8 E4M3 cache of dequantization scale k_scale. */
int stoker_mla_decode_attention_fp8(const float *query, const uint8_t *cache, int64_t num_blocks,
                                    const int32_t *block_tables, int64_t max_blocks, const int32_t *context_lens,
                                    float *out, int64_t num_seqs, int64_t num_heads, int64_t width, int64_t rank,
                                    int64_t block_size, float scale, float k_scale, int num_threads) {
    return mla_decode(query, cache, 1, k_scale, num_blocks, block_tables, max_blocks, context_lens, out, num_seqs,
                      num_heads, width, rank, block_size, scale, num_threads);
}
