/*
 * Multi-LoRA update of one projection on CPU, float32 (stoker/lora/layers.py):
 *
 *   for each segment (slot s, tokens t0..t1) of the step, for each token t in it:
 *     xa[w]        = x[t, :K] . A[s, w, :K]                    w < W   (shrink)
 *     out[t, n]   += sum_w xa[w] * BT[s, w, n]                  n < N   (expand)
 *
 * A: (S, W, K), one slot's shards stacked along W (W = num_shards * R); BT: (S, W, N), each
 * shard's expand transposed into its rank rows and its output columns, zero elsewhere. The
 * (E, 4) `blocks` name the nonzero part of BT, one per shard: its R rank rows [w0, w1) reach
 * only columns [n0, n1) (a q/k/v projection: each shard's own columns; a fused [gate; up]
 * layer in panel order: all of them, as gate and up columns interleave), and `ranks[s]` <= R
 * says how many of each block's rows the adapter in slot s fills: the rest are skipped.
 *
 * Why a kernel: the same update as torch ops is two GEMMs per segment per projection, each
 * ~10 us of dispatch for a few microseconds of arithmetic at decode sizes: 0.71-0.74 of the
 * base model's throughput with 4 adapters (docs/benchmarks.md). Here it is one call per
 * projection.
 *
 * Tiles: TB tokens of one segment share each row of A and BT read (TB x WB dot products in
 * registers for the shrink; TB accumulators per column vector for the expand). Each token's
 * sums run in a fixed order (k ascending, then the lanes; w ascending) whatever the tile it
 * lands in, so a token's update does not depend on the tokens beside it. Built with
 * -ffp-contract=off -fno-associative-math (build.py) so the compiler keeps that order.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#define VL 16
#define WB 4
#else
#define VL 8
#define WB 2
#endif
#define TB 4

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4), may_alias));

static inline vf load(const float *p) { return *(const vfu *)p; }
static inline void store(float *p, vf v) { *(vfu *)p = v; }

static inline vf madd(vf acc, vf a, vf b) {
#if defined(__AVX512F__)
    return _mm512_fmadd_ps(a, b, acc);
#elif defined(__FMA__)
    return _mm256_fmadd_ps(a, b, acc);
#else
    return acc + a * b;
#endif
}

static inline float madd_scalar(float acc, float a, float b) {
#if defined(__FMA__) || defined(__AVX512F__)
    return fmaf(a, b, acc);
#else
    return acc + a * b;
#endif
}

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int l = 0; l < VL; l++) s += v[l];
    return s;
}

/* xa[t * W + w] = x[t] . a[w] for t < nt tokens, w in [w_lo, w_hi). */
static void shrink(int nt, const float *x, int64_t ldx, const float *a, int64_t K, int64_t W, int64_t w_lo,
                   int64_t w_hi, float *xa) {
    const int64_t kv = K - K % VL;
    for (int64_t w0 = w_lo; w0 < w_hi; w0 += WB) {
        const int nw = (int)(w_hi - w0 < WB ? w_hi - w0 : WB);
        vf acc[TB][WB];
        for (int t = 0; t < TB; t++)
            for (int j = 0; j < WB; j++) acc[t][j] = (vf){0};
        for (int64_t k = 0; k < kv; k += VL) {
            vf xv[TB];
            for (int t = 0; t < nt; t++) xv[t] = load(x + t * ldx + k);
            for (int j = 0; j < nw; j++) {
                const vf av = load(a + (w0 + j) * K + k);
                for (int t = 0; t < nt; t++) acc[t][j] = madd(acc[t][j], xv[t], av);
            }
        }
        for (int t = 0; t < nt; t++)
            for (int j = 0; j < nw; j++) {
                float s = hsum(acc[t][j]);
                for (int64_t k = kv; k < K; k++) s = madd_scalar(s, x[t * ldx + k], a[(w0 + j) * K + k]);
                xa[t * W + w0 + j] = s;
            }
    }
}

/* out[t, n0:n1] += sum over w in [w0, w1) of xa[t, w] * bt[w, n0:n1], for t < nt. */
static void expand(int nt, const float *xa, int64_t W, const float *bt, int64_t N, int64_t w0, int64_t w1,
                   int64_t n0, int64_t n1, float *out, int64_t ldo) {
    int64_t n = n0;
    for (; n + VL <= n1; n += VL) {
        vf acc[TB];
        for (int t = 0; t < nt; t++) acc[t] = load(out + t * ldo + n);
        for (int64_t w = w0; w < w1; w++) {
            const vf b = load(bt + w * N + n);
            for (int t = 0; t < nt; t++) acc[t] = madd(acc[t], b, (vf){0} + xa[t * W + w]);
        }
        for (int t = 0; t < nt; t++) store(out + t * ldo + n, acc[t]);
    }
    for (; n < n1; n++)
        for (int t = 0; t < nt; t++) {
            float s = out[t * ldo + n];
            for (int64_t w = w0; w < w1; w++) s = madd_scalar(s, bt[w * N + n], xa[t * W + w]);
            out[t * ldo + n] = s;
        }
}

/*
 * x (T, K) rows ldx apart; A (S, W, K); BT (S, W, N); segments (num_segments, 3): slot, first
 * token, end token; blocks (num_blocks, 4): w0, w1, n0, n1; ranks (S,); out (T, >= N) rows ldo
 * apart, updated in place. Returns 0, or 1 when the scratch buffer cannot be allocated.
 */
int stoker_lora_f32(const float *x, int64_t ldx, int64_t K, const float *A, const float *BT, int64_t W, int64_t N,
                    const int64_t *segments, int64_t num_segments, const int64_t *blocks, int64_t num_blocks,
                    const int64_t *ranks, float *out, int64_t ldo, int num_threads) {
    /* Work items: (segment, block of TB tokens); item_start[g] = the first item of segment g. */
    int64_t *item_start = malloc((size_t)(num_segments + 1) * sizeof(int64_t));
    if (item_start == NULL) return 1;
    item_start[0] = 0;
    for (int64_t g = 0; g < num_segments; g++)
        item_start[g + 1] = item_start[g] + (segments[3 * g + 2] - segments[3 * g + 1] + TB - 1) / TB;
    const int64_t num_items = item_start[num_segments];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_items > 1) reduction(| : failed)
    {
        float *xa = malloc((size_t)(TB * W) * sizeof(float));
        if (xa == NULL) {
            failed = 1;
        } else {
            int64_t g = 0;
#pragma omp for schedule(static)
            for (int64_t item = 0; item < num_items; item++) {
                while (item >= item_start[g + 1]) g++;
                while (item < item_start[g]) g--;
                const int64_t slot = segments[3 * g], t = segments[3 * g + 1] + (item - item_start[g]) * TB;
                const int64_t end = segments[3 * g + 2];
                const int nt = (int)(end - t < TB ? end - t : TB);
                const int64_t rank = ranks[slot];
                const float *a = A + slot * W * K, *bt = BT + slot * W * N;
                for (int64_t e = 0; e < num_blocks; e++) {
                    const int64_t *b = blocks + 4 * e;
                    const int64_t w_end = b[0] + rank < b[1] ? b[0] + rank : b[1];
                    shrink(nt, x + t * ldx, ldx, a, K, W, b[0], w_end, xa);
                    expand(nt, xa, W, bt, N, b[0], w_end, b[2], b[3], out + t * ldo, ldo);
                }
            }
            free(xa);
        }
    }
    free(item_start);
    return failed;
}
