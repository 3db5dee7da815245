/*
 * Paged decode attention for CPU, float32: one query token per sequence attends to its whole
 * cached context, reading K/V in place through the block table.
 *
 * Why a C kernel: stock torch has no paged attention for CPU, so the torch twin
 * (kernels/reference.py) first copies every sequence's K/V out of the cache into a dense
 * buffer (index_select) and then runs SDPA over it. On the issue-2 benchmark that copy was
 * 24% of the run and the attention itself 17%; here K/V are read once, where they lie.
 *
 * Built at first use by stoker/kernels/cpu/build.py (cc -O3 -march=native -fopenmp -ffast-math) and
 * called through ctypes with raw pointers; the .so links the same libgomp.so.1 that torch
 * already loaded, so it shares torch's OpenMP thread pool instead of starting a second one.
 *
 * Shapes (all contiguous):
 *   query         (num_seqs, num_heads, head_dim)
 *   k_cache/v_cache (num_blocks, block_size, num_kv_heads, head_dim)
 *   block_tables  (num_seqs, max_blocks) int32
 *   context_lens  (num_seqs,) int32: the query token sits at position context_len - 1
 *   out           (num_seqs, num_heads, head_dim)
 * Query head h reads KV head h / (num_heads / num_kv_heads) (GQA/MQA). With sliding_window
 * > 0 only the last sliding_window positions (the query's own included) are attended.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* One sequence's query heads [h0, h1) against positions [start, ctx). Heads are taken in
 * whole GQA groups. Positions are walked one block, then one token row (all KV heads,
 * contiguous) at a time, so each row is read from memory once for all the heads it serves.
 * work: (h1 - h0) * ((ctx - start) + head_dim) floats of scratch. */
static void attend(const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
                   const int32_t *restrict table, float *restrict out, float *restrict work, int64_t start,
                   int64_t ctx, int64_t h0, int64_t h1, int64_t group, int64_t head_dim, int64_t block_size,
                   int64_t token_stride, float scale) {
    const int64_t n = ctx - start, nh = h1 - h0;
    float *scores = work;          /* (nh, n) */
    float *acc = work + nh * n;    /* (nh, head_dim) */

    /* scores[h, i] = q_h . k_{start + i} */
    for (int64_t pos = start; pos < ctx;) {
        const int64_t block_end = pos - pos % block_size + block_size;
        const int64_t end = block_end < ctx ? block_end : ctx;
        const float *k_block = k_cache + (int64_t)table[pos / block_size] * block_size * token_stride;
        for (; pos < end; pos++) {
            const float *k_row = k_block + (pos % block_size) * token_stride;
            for (int64_t h = h0; h < h1; h++)
                scores[(h - h0) * n + (pos - start)] = dot(q + h * head_dim, k_row + (h / group) * head_dim, head_dim) * scale;
        }
    }

    /* softmax over each head's row; its 1 / sum is applied to the output at the end */
    for (int64_t h = 0; h < nh; h++) {
        float *row = scores + h * n;
        float m = row[0];
        for (int64_t i = 1; i < n; i++) m = row[i] > m ? row[i] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) {
            row[i] = expf(row[i] - m);
            sum += row[i];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) row[i] *= inv;
    }

    /* out[h, :] = sum_i p[h, i] * v_{start + i} */
    memset(acc, 0, sizeof(float) * nh * head_dim);
    for (int64_t pos = start; pos < ctx;) {
        const int64_t block_end = pos - pos % block_size + block_size;
        const int64_t end = block_end < ctx ? block_end : ctx;
        const float *v_block = v_cache + (int64_t)table[pos / block_size] * block_size * token_stride;
        for (; pos < end; pos++) {
            const float *v_row = v_block + (pos % block_size) * token_stride;
            for (int64_t h = h0; h < h1; h++) {
                const float p = scores[(h - h0) * n + (pos - start)];
                const float *v = v_row + (h / group) * head_dim;
                float *a = acc + (h - h0) * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * v[d];
            }
        }
    }
    memcpy(out + h0 * head_dim, acc, sizeof(float) * nh * head_dim);
}

/* Returns 0 on success, 1 if scratch memory could not be allocated. */
int stoker_paged_decode_attention_f32(const float *query, const float *k_cache, const float *v_cache,
                                      const int32_t *block_tables, int64_t max_blocks,
                                      const int32_t *context_lens, float *out, int64_t num_seqs,
                                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                      int64_t block_size, int64_t max_context_len, float scale,
                                      int64_t sliding_window, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    /* A task is one sequence's heads, or, when there are too few sequences to keep every
     * thread busy, one KV head's group of one sequence. */
    const int64_t splits = num_seqs >= 4 * (int64_t)num_threads ? 1 : num_kv_heads;
    const int64_t heads_per_task = num_heads / splits;
    const int64_t work_floats = heads_per_task * (max_context_len + head_dim);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *work = (float *)malloc(sizeof(float) * (size_t)(work_floats > 0 ? work_floats : 1));
        if (work == NULL) failed = 1;
        /* dynamic: context lengths differ, so tasks differ in cost */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_seqs * splits; task++) {
            const int64_t s = task / splits, h0 = (task % splits) * heads_per_task, h1 = h0 + heads_per_task;
            const int64_t ctx = context_lens[s];
            float *o = out + s * num_heads * head_dim;
            if (work == NULL || ctx <= 0) {
                memset(o + h0 * head_dim, 0, sizeof(float) * heads_per_task * head_dim);
                continue;
            }
            const int64_t start = sliding_window > 0 && ctx > sliding_window ? ctx - sliding_window : 0;
            attend(query + s * num_heads * head_dim, k_cache, v_cache, block_tables + s * max_blocks, o, work,
                   start, ctx, h0, h1, group, head_dim, block_size, token_stride, scale);
        }
        free(work);
    }
    return failed;
}
