/*
 * Paged prefill attention for CPU, float32: each sequence's new query tokens attend causally
 * to its whole context (prompt chunks, prefix-cache hits), reading K/V through the block
 * table. The twin (kernels/reference.py, paged_attention) gathers each sequence's K/V and
 * runs torch SDPA, one call per sequence and layer: ~100 GFLOP/s at issue 2's prompt
 * lengths, and a masked, slower path for chunks with cached context.
 *
 * Here both products run on linear.c's register tile (~300 GFLOP/s): per task (a sequence,
 * a KV head, a chunk of query rows) the keys the chunk can see are packed into panels of NR
 * keys (S = Q K^T, the tile's "weight" is K^T) and the values into panels of NR dims
 * (O = P V), then for each query head of the group and each MR rows: S, softmax with the
 * causal (and sliding-window) mask, O. The q heads of a GQA group share the packed K/V.
 *
 * Shapes: query/out (T, H, D) packed over sequences, rows H*D floats apart;
 * k_cache/v_cache (num_blocks, block_size, Hkv, D); block_tables (B, max_blocks) int32;
 * cu_seqlens (B + 1,) int64 offsets of each sequence's rows in query; context_lens (B,) int64.
 * Query row i of sequence s sits at position context_lens[s] - q_len + i.
 * D must be a multiple of VL (the caller checks; others take the twin).
 *
 * Not causal (stoker_prefill_attention_bidirectional_f32, an encoder's attention): every query
 * row of a sequence sees all its context_lens[s] keys. A pooling model's packed K/V are such a
 * "cache" with block_size 1 and block table row s = the sequence's own token rows (no padding
 * to the longest sequence, no mask). stoker_encoder_attention_f32 reads q, k and v in place from
 * an encoder's fused projection (rows of 3*H*D floats): the body takes the row strides.
 *
 * Short sequences (a 12-token query against 64-key panels): only the score vectors that hold
 * keys are computed, and the softmax runs over whole masked vectors, not key by key (a batch
 * of 9 queries, MiniLM's 12 heads: 237-246 -> 77-79 us a layer on one AVX-512 core, with the
 * copies of q, k and v gone too; benchmarks/bert_layer_cpu.py, docs/benchmarks.md).
 *
 * FP8 KV cache (stoker_paged_prefill_attention_fp8): K and V hold E4M3 bits; they are
 * dequantized (value x k_scale, value x v_scale) as they are packed into the float panels,
 * so the products are the float ones on the dequantized K/V, as in the twin.
 *
 * Attention sinks (gpt-oss; sinks non-NULL, (num_heads,) float32): head h's sink is one more
 * logit in each of its rows' softmax denominators, with no value.
 *
 * Logit soft-capping (Gemma 2; soft_cap > 0): each score s (q . k x scale) becomes
 * soft_cap x tanh(s / soft_cap) before the mask and the softmax, row by row.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp8.h"

int stoker_linear_nr(void);
int stoker_linear_mr(void);
int stoker_linear_vl(void);
void stoker_linear_tile_f32(int mr, int nv, const float *x, int64_t ldx, const float *wt, int64_t ldw, float *y,
                            int64_t ldy, int64_t K);

/* Query rows per task: a long prompt still gives every thread work. */
#define Q_CHUNK 64

/* Element index of (position pos, KV head g)'s row in a cache. */
static inline int64_t kv_row(const int32_t *table, int64_t pos, int64_t block_size, int64_t token_stride, int64_t g,
                             int64_t head_dim) {
    return ((int64_t)table[pos / block_size] * block_size + pos % block_size) * token_stride + g * head_dim;
}

/* dst[d * dst_stride] = cache row element d, dequantized (fp8: value x mul), d < n */
static inline void read_row(float *dst, int64_t dst_stride, const void *cache, int64_t at, int64_t n, int fp8, float mul) {
    if (fp8) {
        const uint8_t *src = (const uint8_t *)cache + at;
        const float mul256 = mul * 256.0f; /* (value / 256) * (mul * 256): value * mul, one rounding */
        for (int64_t d = 0; d < n; d++) dst[d * dst_stride] = fp8_div256_table[src[d]] * mul256;
    } else {
        const float *src = (const float *)cache + at;
        for (int64_t d = 0; d < n; d++) dst[d * dst_stride] = src[d];
    }
}

/* The body of both entry points below; fp8: caches of E4M3 bits, dequantized by k_mul / v_mul. */
static int paged_prefill(const float *query, const void *k_cache, const void *v_cache, int64_t num_blocks,
                         const int32_t *block_tables, int64_t max_blocks, const int64_t *cu_seqlens,
                         const int64_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                         int64_t sliding_window, int num_threads, int fp8, float k_mul, float v_mul, int causal,
                         int64_t ldq, int64_t ldo, int64_t token_stride, const float *sinks, float soft_cap) {
    const int64_t nr = stoker_linear_nr(), mr_max = stoker_linear_mr(), vl = stoker_linear_vl();
    const int64_t group = num_heads / num_kv_heads;
    int64_t max_ctx = 0, num_tasks = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t q_len = cu_seqlens[s + 1] - cu_seqlens[s], ctx = context_lens[s];
        if (q_len < 0 || ctx < q_len || ctx > max_blocks * block_size) return 2;
        for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; b++) {
            const int32_t id = block_tables[s * max_blocks + b];
            if (id < 0 || id >= num_blocks) return 3;
        }
        if (ctx > max_ctx) max_ctx = ctx;
        num_tasks += (q_len + Q_CHUNK - 1) / Q_CHUNK * num_kv_heads;
    }
    const int64_t keys_pad = (max_ctx + nr - 1) / nr * nr;
    const int64_t d_panels = (head_dim + nr - 1) / nr;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* kp: keys_pad / nr panels of (head_dim, nr); vp: d_panels panels of (keys_pad, nr);
         * scores: (mr_max, keys_pad) */
        /* calloc: columns past a task's keys are never written, so they hold zeros or an earlier
         * task's finite keys; their scores are computed (a whole vector) but never read */
        float *kp = calloc((size_t)(keys_pad * head_dim + 1), sizeof(float));
        float *vp = malloc(sizeof(float) * (size_t)(d_panels * keys_pad * nr + 1));
        float *scores = malloc(sizeof(float) * (size_t)(mr_max * keys_pad + 1));
        if (kp == NULL || vp == NULL || scores == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; task++) {
            if (failed) continue;
            /* task -> (sequence, chunk, kv head): walk the sequences (cheap next to the work) */
            int64_t s = 0, rest = task, chunks = 0;
            for (;; s++) {
                chunks = (cu_seqlens[s + 1] - cu_seqlens[s] + Q_CHUNK - 1) / Q_CHUNK;
                if (rest < chunks * num_kv_heads) break;
                rest -= chunks * num_kv_heads;
            }
            const int64_t chunk = rest / num_kv_heads, g = rest % num_kv_heads;
            const int64_t q_len = cu_seqlens[s + 1] - cu_seqlens[s], first_pos = context_lens[s] - q_len;
            const int64_t c0 = chunk * Q_CHUNK, c1 = c0 + Q_CHUNK < q_len ? c0 + Q_CHUNK : q_len;
            const int32_t *table = block_tables + s * max_blocks;
            /* keys this chunk can see: [lo, hi) */
            int64_t lo = 0;
            if (sliding_window > 0 && first_pos + c0 - sliding_window + 1 > 0) lo = first_pos + c0 - sliding_window + 1;
            const int64_t hi = causal ? first_pos + c1 : context_lens[s], n_keys = hi - lo;
            /* pack K^T: panel p holds keys lo + p*nr .. as columns, one row per dim (a short
             * sequence's last panel is mostly padding: left as it is, see kp) */
            for (int64_t key = 0; key < n_keys; key++)
                read_row(kp + key / nr * head_dim * nr + key % nr, nr, k_cache,
                         kv_row(table, lo + key, block_size, token_stride, g, head_dim), head_dim, fp8, k_mul);
            /* pack V: panel q holds dims q*nr .. of every key, one row per key */
            for (int64_t key = 0; key < n_keys; key++) {
                const int64_t at = kv_row(table, lo + key, block_size, token_stride, g, head_dim);
                for (int64_t q = 0; q < d_panels; q++) {
                    const int64_t width = head_dim - q * nr < nr ? head_dim - q * nr : nr;
                    read_row(vp + (q * keys_pad + key) * nr, 1, v_cache, at + q * nr, width, fp8, v_mul);
                }
            }
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                for (int64_t r0 = c0; r0 < c1; r0 += mr_max) {
                    const int mr = (int)(c1 - r0 < mr_max ? c1 - r0 : mr_max);
                    const float *x = query + (cu_seqlens[s] + r0) * ldq + h * head_dim;
                    /* keys the last row of this tile sees, relative to lo */
                    const int64_t used = causal ? first_pos + r0 + mr - lo : n_keys;
                    const int64_t used_panels = (used + nr - 1) / nr;
                    for (int64_t p = 0; p < used_panels; p++) {
                        /* only the vectors holding keys this tile uses: 1 of 4 for a 12-token query */
                        const int64_t cols = used - p * nr < nr ? used - p * nr : nr;
                        stoker_linear_tile_f32(mr, (int)((cols + vl - 1) / vl), x, ldq, kp + p * head_dim * nr, nr,
                                               scores + p * nr, keys_pad, head_dim);
                    }
                    for (int m = 0; m < mr; m++) {
                        float *row = scores + m * keys_pad;
                        const int64_t pos = first_pos + r0 + m;
                        int64_t first = 0;
                        if (sliding_window > 0 && pos - sliding_window + 1 > lo) first = pos - sliding_window + 1 - lo;
                        const int64_t last = causal ? pos - lo : n_keys - 1; /* inclusive */
                        /* over whole vectors [0, span), the keys outside [first, last] masked: a
                         * short row (a 12-token query) is then one vector, not 12 scalar expf */
                        const int64_t span = (last + vl) / vl * vl; /* <= keys_pad, a multiple of vl */
                        /* soft-capped: the row holds the capped scores, scaled already */
                        float row_scale = scale;
                        if (soft_cap > 0.0f) {
                            const float s_cap = scale / soft_cap;
                            for (int64_t j = 0; j < span; j++) row[j] = soft_cap * tanhf(row[j] * s_cap);
                            row_scale = 1.0f;
                        }
                        float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
                        for (int64_t j = 0; j < span; j++) {
                            const float v = j >= first && j <= last ? row[j] * row_scale : -INFINITY;
                            mx = v > mx ? v : mx;
                        }
                        if (sinks != NULL && sinks[h] > mx) mx = sinks[h];
                        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                        for (int64_t j = 0; j < span; j++) {
                            const float e = expf(row[j] * row_scale - mx);
                            row[j] = j >= first && j <= last ? e : 0.0f;
                            sum += row[j];
                        }
                        if (sinks != NULL) sum += expf(sinks[h] - mx);
                        const float inv = 1.0f / sum;
#pragma omp simd
                        for (int64_t j = 0; j < span; j++) row[j] *= inv;
                        for (int64_t j = span; j < used; j++) row[j] = 0.0f;
                    }
                    float *o = out + (cu_seqlens[s] + r0) * ldo + h * head_dim;
                    for (int64_t q = 0; q < d_panels; q++) {
                        const int64_t width = head_dim - q * nr < nr ? head_dim - q * nr : nr;
                        stoker_linear_tile_f32(mr, (int)(width / vl), scores, keys_pad, vp + q * keys_pad * nr, nr,
                                               o + q * nr, ldo, used);
                    }
                }
            }
        }
        free(kp);
        free(vp);
        free(scores);
    }
    return failed;
}

/* Returns 0, 1 (no memory), 2 (a length is inconsistent), 3 (a block id outside the cache). */
int stoker_paged_prefill_attention_f32(const float *query, const float *k_cache, const float *v_cache,
                                       int64_t num_blocks, const int32_t *block_tables, int64_t max_blocks,
                                       const int64_t *cu_seqlens, const int64_t *context_lens, float *out,
                                       int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, float scale, int64_t sliding_window, int num_threads,
                                       const float *sinks, float soft_cap) {
    return paged_prefill(query, k_cache, v_cache, num_blocks, block_tables, max_blocks, cu_seqlens, context_lens, out,
                         num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window, num_threads, 0,
                         1.0f, 1.0f, 1, num_heads * head_dim, num_heads * head_dim, num_kv_heads * head_dim, sinks,
                         soft_cap);
}

/* As stoker_paged_prefill_attention_f32 without the causal mask (and no sliding window). */
int stoker_prefill_attention_bidirectional_f32(const float *query, const float *k_cache, const float *v_cache,
                                               int64_t num_blocks, const int32_t *block_tables, int64_t max_blocks,
                                               const int64_t *cu_seqlens, const int64_t *context_lens, float *out,
                                               int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                               int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    return paged_prefill(query, k_cache, v_cache, num_blocks, block_tables, max_blocks, cu_seqlens, context_lens, out,
                         num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, 0, num_threads, 0, 1.0f, 1.0f,
                         0, num_heads * head_dim, num_heads * head_dim, num_kv_heads * head_dim, NULL, 0.0f);
}

/* As above with FP8 E4M3 caches dequantized by k_scale and v_scale (per layer). */
int stoker_paged_prefill_attention_fp8(const float *query, const uint8_t *k_cache, const uint8_t *v_cache,
                                       int64_t num_blocks, const int32_t *block_tables, int64_t max_blocks,
                                       const int64_t *cu_seqlens, const int64_t *context_lens, float *out,
                                       int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                       int64_t block_size, float scale, int64_t sliding_window, float k_scale,
                                       float v_scale, int num_threads, const float *sinks, float soft_cap) {
    return paged_prefill(query, k_cache, v_cache, num_blocks, block_tables, max_blocks, cu_seqlens, context_lens, out,
                         num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window, num_threads, 1,
                         k_scale, v_scale, 1, num_heads * head_dim, num_heads * head_dim, num_kv_heads * head_dim, sinks,
                         soft_cap);
}

/* An encoder's attention straight from its fused projection: qkv (T, 3, H, D) packed over
 * sequences (q, k, v side by side in each token's row of 3*H*D floats) -> out (T, H, D); every
 * query of a sequence sees all of that sequence's keys. The K/V "cache" is qkv itself, block_size
 * 1, token rows 3*H*D floats apart, token_table row s = sequence s's rows (as above): no copy
 * of q, k or v. */
int stoker_encoder_attention_f32(const float *qkv, int64_t num_tokens, const int32_t *token_table, int64_t max_len,
                                 const int64_t *cu_seqlens, const int64_t *lengths, float *out, int64_t num_seqs,
                                 int64_t num_heads, int64_t head_dim, float scale, int num_threads) {
    const int64_t hd = num_heads * head_dim;
    return paged_prefill(qkv, qkv + hd, qkv + 2 * hd, num_tokens, token_table, max_len, cu_seqlens, lengths, out,
                         num_seqs, num_heads, num_heads, head_dim, 1, scale, 0, num_threads, 0, 1.0f, 1.0f, 0, 3 * hd,
                         hd, 3 * hd, NULL, 0.0f);
}
