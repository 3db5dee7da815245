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
 *
 * FP8 KV cache (stoker_paged_decode_attention_fp8): the caches hold E4M3 bits, widened to
 * float as each row is read (fp8.h, which reads value / 256);
 * the k scale (x 256) is folded into the softmax scale and the v scale (x 256) into the
 * output, so the loops are the float ones.
 *
 * Attention sinks (gpt-oss; sinks non-NULL, (num_heads,) float32): head h's sink is one more
 * logit in its softmax's denominator, with no value: the row's max and sum start from it.
 *
 * Logit soft-capping (Gemma 2; soft_cap > 0): each score s (q . k x scale) becomes
 * soft_cap x tanh(s / soft_cap) before the softmax, row by row, so a sequence's result still
 * depends on its own context only (the batch-invariance the other loops keep).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp8.h"

/* n elements of a cache row at p (float, or fp8 bits when fp8) as floats in dst. */
static inline void widen_row(float *restrict dst, const void *p, int64_t n, int fp8) {
    if (!fp8) {
        memcpy(dst, p, sizeof(float) * (size_t)n);
        return;
    }
    const uint8_t *b = (const uint8_t *)p;
    for (int64_t i = 0; i < n; i++) dst[i] = fp8_div256_table[b[i]];
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* scores[h - h0, pos - start] = q_h . k_pos * scale for the positions [pos, end) of one block
 * (k_block, elements of esize bytes), one dot product each; rowbuf: head_dim floats of scratch
 * for an FP8 row, widened once per KV head and position. */
static inline void score_positions(const float *restrict q, const char *restrict k_block, float *restrict scores,
                                   int64_t pos, int64_t end, int64_t start, int64_t n, int64_t h0, int64_t h1,
                                   int64_t group, int64_t head_dim, int64_t block_size, int64_t token_stride,
                                   float scale, int fp8, float *restrict rowbuf) {
    const int64_t esize = fp8 ? 1 : 4;
    for (; pos < end; pos++) {
        const char *k_row = k_block + (pos % block_size) * token_stride * esize;
        for (int64_t h = h0; h < h1; h++) {
            const char *kh = k_row + (h / group) * head_dim * esize;
            const float *k = (const float *)kh;
            if (fp8) {
                if (h == h0 || h % group == 0) widen_row(rowbuf, kh, head_dim, 1);
                k = rowbuf;
            }
            scores[(h - h0) * n + (pos - start)] = dot(q + h * head_dim, k, head_dim) * scale;
        }
    }
}

/* In place, each of the nh rows of scores (nh, n) becomes its softmax; with sinks (nh,), row
 * h's denominator has exp(sinks[h]) too; with soft_cap > 0 the scores are capped first. */
static void softmax_rows(float *scores, int64_t nh, int64_t n, const float *sinks, float soft_cap) {
    for (int64_t h = 0; h < nh; h++) {
        float *row = scores + h * n;
        if (soft_cap > 0.0f) {
            const float inv_cap = 1.0f / soft_cap;
            for (int64_t i = 0; i < n; i++) row[i] = soft_cap * tanhf(row[i] * inv_cap);
        }
        float m = row[0];
        for (int64_t i = 1; i < n; i++) m = row[i] > m ? row[i] : m;
        if (sinks != NULL && sinks[h] > m) m = sinks[h];
        float sum = sinks != NULL ? expf(sinks[h] - m) : 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) {
            row[i] = expf(row[i] - m);
            sum += row[i];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) row[i] *= inv;
    }
}

/* One sequence's query heads [h0, h1) against positions [start, ctx). Heads are taken in
 * whole GQA groups. Positions are walked one block, then one token row (all KV heads,
 * contiguous) at a time, so each row is read from memory once for all the heads it serves.
 * work: (h1 - h0) * ((ctx - start) + head_dim) + head_dim floats of scratch. */
static void attend(const float *restrict q, const void *restrict k_cache, const void *restrict v_cache,
                   const int32_t *restrict table, float *restrict out, float *restrict work, int64_t start,
                   int64_t ctx, int64_t h0, int64_t h1, int64_t group, int64_t head_dim, int64_t block_size,
                   int64_t token_stride, float scale, int fp8, float v_mul, const float *sinks, float soft_cap) {
    const int64_t n = ctx - start, nh = h1 - h0, esize = fp8 ? 1 : 4;
    float *scores = work;          /* (nh, n) */
    float *acc = work + nh * n;    /* (nh, head_dim) */
    float *rowbuf = acc + nh * head_dim; /* (head_dim,) */

    /* scores[h, i] = q_h . k_{start + i} */
    for (int64_t pos = start; pos < ctx;) {
        const int64_t block_end = pos - pos % block_size + block_size;
        const int64_t end = block_end < ctx ? block_end : ctx;
        const char *k_block = (const char *)k_cache + (int64_t)table[pos / block_size] * block_size * token_stride * esize;
        score_positions(q, k_block, scores, pos, end, start, n, h0, h1, group, head_dim, block_size, token_stride, scale,
                        fp8, rowbuf);
        pos = end;
    }

    softmax_rows(scores, nh, n, sinks != NULL ? sinks + h0 : NULL, soft_cap);

    /* out[h, :] = sum_i p[h, i] * v_{start + i} */
    memset(acc, 0, sizeof(float) * nh * head_dim);
    for (int64_t pos = start; pos < ctx;) {
        const int64_t block_end = pos - pos % block_size + block_size;
        const int64_t end = block_end < ctx ? block_end : ctx;
        const char *v_block = (const char *)v_cache + (int64_t)table[pos / block_size] * block_size * token_stride * esize;
        for (; pos < end; pos++) {
            const char *v_row = v_block + (pos % block_size) * token_stride * esize;
            for (int64_t h = h0; h < h1; h++) {
                const float p = scores[(h - h0) * n + (pos - start)];
                const char *vh = v_row + (h / group) * head_dim * esize;
                const float *v = (const float *)vh;
                if (fp8) {
                    if (h == h0 || h % group == 0) widen_row(rowbuf, vh, head_dim, 1);
                    v = rowbuf;
                }
                float *a = acc + (h - h0) * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * v[d];
            }
        }
    }
    for (int64_t i = 0; i < nh * head_dim; i++) out[h0 * head_dim + i] = acc[i] * v_mul;
}

#if defined(__GNUC__) && !defined(__clang__)
/* ---- Fast path: head_dim a multiple of 16 (up to 128), 16 positions at a time. ----
 * The generic code above spends most of its time on horizontal sums: one 16-lane to scalar
 * reduction per (position, head). Here 16 positions' dot products are reduced together by
 * a transpose-and-add tree (15 two-source shuffles + adds for 16 sums), and the output
 * accumulators stay in registers across the 16 positions' V rows. Same math, other order
 * of additions (well within float32 tolerance of the torch twin; tests compare them). */
#define FAST_PATH 1
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 ld16(const float *p) { return *(const v16u *)p; }
static inline void st16(float *p, v16 v) { *(v16u *)p = v; }

/* 16 FP8 E4M3 values at p -> floats / 256 (fp8.h) */
static inline v16 ld16_fp8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (v16)fp8x16_div256(p);
#elif defined(__AVX2__) && defined(__F16C__)
    float f[16];
    _mm256_storeu_ps(f, fp8x8_div256(p));
    _mm256_storeu_ps(f + 8, fp8x8_div256(p + 8));
    return ld16(f);
#else
    float f[16];
    for (int l = 0; l < 16; l++) f[l] = fp8_div256_table[p[l]];
    return ld16(f);
#endif
}

/* 16 cache elements at element index i of base (float, or FP8 bits when fp8: a constant). */
static inline v16 ldkv16(const int fp8, const void *base, int64_t i) {
    return fp8 ? ld16_fp8((const uint8_t *)base + i) : ld16((const float *)base + i);
}

/* Lane i of the result is the sum of the 16 lanes of v[i]. */
static inline v16 sum16x16(const v16 v[16]) {
    const i16 l1a = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i16 l1b = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const i16 l2a = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const i16 l2b = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const i16 l3a = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const i16 l3b = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const i16 l4a = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const i16 l4b = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16 a[8], b[4], c[2];
    /* a[i]: 8 partial sums of v[2i], then 8 of v[2i+1] */
    for (int i = 0; i < 8; i++) a[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], l1a) + __builtin_shuffle(v[2 * i], v[2 * i + 1], l1b);
    /* b[i]: 4 partials each of v[4i .. 4i+3] */
    for (int i = 0; i < 4; i++) b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], l2a) + __builtin_shuffle(a[2 * i], a[2 * i + 1], l2b);
    /* c[i]: 2 partials each of v[8i .. 8i+7] */
    for (int i = 0; i < 2; i++) c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], l3a) + __builtin_shuffle(b[2 * i], b[2 * i + 1], l3b);
    return __builtin_shuffle(c[0], c[1], l4a) + __builtin_shuffle(c[0], c[1], l4b);
}

/* As attend(), for head_dim = 16 * nd; nd and fp8 are constants at each call site. */
static inline __attribute__((always_inline)) void attend16(const int nd, const int fp8, const float *restrict q,
                                                           const void *restrict k_cache, const void *restrict v_cache,
                                                           const int32_t *restrict table, float *restrict out,
                                                           float *restrict work, int64_t start, int64_t ctx, int64_t h0,
                                                           int64_t h1, int64_t group, int64_t block_size,
                                                           int64_t token_stride, float scale, float v_mul,
                                                           const float *sinks, float soft_cap) {
    const int64_t head_dim = 16 * nd, n = ctx - start, nh = h1 - h0, esize = fp8 ? 1 : 4;
    float *scores = work;       /* (nh, n) */
    float *acc = work + nh * n; /* (nh, head_dim) */
    float *rowbuf = acc + nh * head_dim;
    const char *kc = (const char *)k_cache, *vc = (const char *)v_cache;
    /* element offset of a block's first row; prefetches step 64 bytes = 64 / esize elements */
    const int64_t block_elems = block_size * token_stride, line = 64 / esize;

    /* scores[h, i] = q_h . k_{start + i}: 16 positions of one block at a time */
    for (int64_t pos = start; pos < ctx;) {
        const int64_t block_end = pos - pos % block_size + block_size;
        const int64_t end = block_end < ctx ? block_end : ctx;
        const int64_t k_block = (int64_t)table[pos / block_size] * block_elems;
        for (; pos + 16 <= end; pos += 16) {
            const int64_t k_rows = k_block + (pos % block_size) * token_stride;
            /* the next 16 positions' rows: prefetched, one KV head at a time, while these run */
            const int64_t k_next = pos + 32 <= end ? k_rows + 16 * token_stride
                                   : end < ctx     ? (int64_t)table[end / block_size] * block_elems
                                                   : -1;
            for (int64_t h = h0; h < h1; h++) {
                if (k_next >= 0 && (h - h0) % group == 0)
                    for (int t = 0; t < 16; t++)
                        for (int64_t j = 0; j < head_dim; j += line)
                            __builtin_prefetch(kc + (k_next + t * token_stride + (h / group) * head_dim + j) * esize, 0, 3);
                v16 qv[8], d[16];
                for (int j = 0; j < nd; j++) qv[j] = ld16(q + h * head_dim + 16 * j);
                const int64_t kh = k_rows + (h / group) * head_dim;
                for (int t = 0; t < 16; t++) {
                    v16 s = qv[0] * ldkv16(fp8, kc, kh + t * token_stride);
                    for (int j = 1; j < nd; j++) s += qv[j] * ldkv16(fp8, kc, kh + t * token_stride + 16 * j);
                    d[t] = s;
                }
                st16(scores + (h - h0) * n + (pos - start), sum16x16(d) * scale);
            }
        }
        score_positions(q, kc + k_block * esize, scores, pos, end, start, n, h0, h1, group, head_dim, block_size,
                        token_stride, scale, fp8, rowbuf);
        pos = end;
    }

    softmax_rows(scores, nh, n, sinks != NULL ? sinks + h0 : NULL, soft_cap);

    /* out[h, :] = sum_i p[h, i] * v_{start + i}, accumulated in registers over 16 positions */
    memset(acc, 0, sizeof(float) * nh * head_dim);
    for (int64_t pos = start; pos < ctx;) {
        const int64_t block_end = pos - pos % block_size + block_size;
        const int64_t end = block_end < ctx ? block_end : ctx;
        const int64_t len = end - pos;
        const int64_t v_rows = (int64_t)table[pos / block_size] * block_elems + (pos % block_size) * token_stride;
        const int64_t v_next = end < ctx ? (int64_t)table[end / block_size] * block_elems : -1;
        const int64_t next_len = ctx - end < block_size ? ctx - end : block_size;
        for (int64_t h = h0; h < h1; h++) {
            if (v_next >= 0 && (h - h0) % group == 0)
                for (int64_t t = 0; t < next_len; t++)
                    for (int64_t j = 0; j < head_dim; j += line)
                        __builtin_prefetch(vc + (v_next + t * token_stride + (h / group) * head_dim + j) * esize, 0, 3);
            const float *p = scores + (h - h0) * n + (pos - start);
            const int64_t vh = v_rows + (h / group) * head_dim;
            float *a = acc + (h - h0) * head_dim;
            v16 av[8];
            for (int j = 0; j < nd; j++) av[j] = ld16(a + 16 * j);
            for (int64_t t = 0; t < len; t++)
                for (int j = 0; j < nd; j++) av[j] += p[t] * ldkv16(fp8, vc, vh + t * token_stride + 16 * j);
            for (int j = 0; j < nd; j++) st16(a + 16 * j, av[j]);
        }
        pos = end;
    }
    for (int64_t i = 0; i < nh * head_dim; i++) out[h0 * head_dim + i] = acc[i] * v_mul;
}
#endif

/* The body of both entry points below; fp8: the caches hold E4M3 bits. k_mul scales every
 * score (with the softmax scale), v_mul the output. */
static int paged_decode(const float *query, const void *k_cache, const void *v_cache, int64_t num_blocks,
                        const int32_t *block_tables, int64_t max_blocks, const int32_t *context_lens, float *out,
                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, float scale, int64_t sliding_window, int num_threads, int fp8,
                        float v_mul, const float *sinks, float soft_cap) {
    int64_t max_context_len = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t ctx = context_lens[s];
        if (ctx < 0 || ctx > max_blocks * block_size) return 2;
        for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; b++) {
            const int32_t id = block_tables[s * max_blocks + b];
            if (id < 0 || id >= num_blocks) return 3;
        }
        if (ctx > max_context_len) max_context_len = ctx;
    }
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    /* A task is one sequence's heads, or, when there are too few sequences to keep every
     * thread busy, one KV head's group of one sequence. */
    const int64_t splits = num_seqs >= 4 * (int64_t)num_threads ? 1 : num_kv_heads;
    const int64_t heads_per_task = num_heads / splits;
    const int64_t work_floats = heads_per_task * (max_context_len + head_dim) + head_dim;
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
            const float *qs = query + s * num_heads * head_dim;
            const int32_t *table = block_tables + s * max_blocks;
#ifdef FAST_PATH
#define ATTEND16(ND)                                                                                                   \
    (fp8 ? attend16(ND, 1, qs, k_cache, v_cache, table, o, work, start, ctx, h0, h1, group, block_size, token_stride, \
                    scale, v_mul, sinks, soft_cap)                                                                     \
         : attend16(ND, 0, qs, k_cache, v_cache, table, o, work, start, ctx, h0, h1, group, block_size, token_stride, \
                    scale, v_mul, sinks, soft_cap))
            if (head_dim == 64)
                ATTEND16(4);
            else if (head_dim == 128)
                ATTEND16(8);
            else if (head_dim == 32)
                ATTEND16(2);
            else if (head_dim == 96)
                ATTEND16(6);
            else
#endif
                attend(qs, k_cache, v_cache, table, o, work, start, ctx, h0, h1, group, head_dim, block_size, token_stride,
                       scale, fp8, v_mul, sinks, soft_cap);
        }
        free(work);
    }
    return failed;
}

/* Returns 0 on success, 1 if scratch memory could not be allocated, 2 if a context length
 * is negative or needs more blocks than a table row holds, 3 if a block id that would be
 * read is outside [0, num_blocks). Checked here, before any read, rather than in Python:
 * the min/max there cost three host round trips per layer and step. */
int stoker_paged_decode_attention_f32(const float *query, const float *k_cache, const float *v_cache,
                                      int64_t num_blocks, const int32_t *block_tables, int64_t max_blocks,
                                      const int32_t *context_lens, float *out, int64_t num_seqs,
                                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                      int64_t block_size, float scale, int64_t sliding_window, int num_threads,
                                      const float *sinks, float soft_cap) {
    return paged_decode(query, k_cache, v_cache, num_blocks, block_tables, max_blocks, context_lens, out, num_seqs,
                        num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window, num_threads, 0, 1.0f,
                        sinks, soft_cap);
}

/* As above with FP8 E4M3 caches dequantized by k_scale and v_scale (per layer). */
int stoker_paged_decode_attention_fp8(const float *query, const uint8_t *k_cache, const uint8_t *v_cache,
                                      int64_t num_blocks, const int32_t *block_tables, int64_t max_blocks,
                                      const int32_t *context_lens, float *out, int64_t num_seqs,
                                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                      int64_t block_size, float scale, int64_t sliding_window, float k_scale,
                                      float v_scale, int num_threads, const float *sinks, float soft_cap) {
    /* rows widen to value / 256: the 256 goes into both multipliers */
    return paged_decode(query, k_cache, v_cache, num_blocks, block_tables, max_blocks, context_lens, out, num_seqs,
                        num_heads, num_kv_heads, head_dim, block_size, scale * k_scale * 256.0f, sliding_window,
                        num_threads, 1, v_scale * 256.0f, sinks, soft_cap);
}
