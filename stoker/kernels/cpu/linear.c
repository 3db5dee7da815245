/*
 * y = x @ W^T + bias for CPU, float32: the projections of the CPU model runner.
 *
 * Why a kernel of our own: MKL's sgemm reaches ~330 GFLOP/s on this project's 2-core CI
 * machine for prefill-sized M, but only 160-250 GFLOP/s for M = 8..64, the batch sizes of
 * decode steps, which made decode GEMMs the largest cost of the issue-2 benchmark
 * (docs/benchmarks.md). This kernel keeps a register tile of MR rows x NR columns of y for
 * the whole K loop (no packing of x, no K blocking), so it runs near the FMA units' rate for
 * decode shapes, and at MKL's rate for prefill shapes (benchmarks/cpu_kernels.py).
 *
 * Weight layout: packed panels (kernels/cpu/linear.py, pack_linear_weight): panel p holds
 * columns [p*NR, (p+1)*NR) of W^T, K rows of NR floats, contiguous; the last one zero-padded.
 * Threads split the panels, so each weight is read once per row chunk; while a panel's tiles
 * run, the next panel is prefetched.
 *
 * Every y[m, n] is one accumulator summed over k = 0..K-1 in order, then + bias[n]: the
 * result of a row does not depend on M or on the other rows (batch invariance), nor on the
 * number of threads (tests/kernels/test_cpu_linear.py checks both bit for bit). Each step
 * is an explicit fused multiply-add where the ISA has FMA (madd, madd_scalar), and this file
 * is built with -ffp-contract=off -fno-associative-math (build.py), so the compiler cannot
 * fuse some chains and not others: gcc's znver2/znver3 tuning did exactly that, per tile
 * size (issue 12). The vector tile and the scalar tail columns then compute the same sum, so
 * every FMA build (AVX2, AVX-512) gives the same bits (tests/kernels/test_cpu_isa.py).
 *
 * silu_and_mul: an MLP's [gate; up] projection packed with gate and up columns side by side
 * in each panel writes silu(gate) * up directly (half as wide), so the pre-activation never
 * goes to memory and the separate SiLU-and-mul pass disappears.
 *
 * Quantized weights (stoker_linear_q8): panels of one byte per weight, int8 or FP8 E4M3, and a
 * float scale per column and group of group_k rows of K (per output channel: group_k = K;
 * 128 x 128 blocks: group_k = 128, the block's scale repeated over its columns). Each weight is
 * widened in registers and multiplied by its scale, w = q * s, exactly the dequantized weight,
 * then used as above: a quantized projection computes F.linear(x, dequantized W) in the same
 * order as the float one, and is batch-invariant by the same argument. Decode reads a quarter
 * of float32's bytes. FP8 is widened as value / 256 (fp8.h says why); the packing folds the
 * 256 into the scale.
 * At larger M the panel is dequantized once into a per-thread float buffer and the float tiles
 * run on it: the same w values, so the same results, without widening once per row tile.
 *
 * 4-bit weights (stoker_linear_q4): linear_q4.h, included at the end of this file; with int8
 * activations (stoker_linear_q4_a8, W4A8): linear_q4_a8.h, after it; GGUF's Q6_K with int8
 * activations (stoker_linear_q6_a8, W6A8): linear_q6_a8.h; GGUF's Q4_K in its own bytes with
 * int8 activations (stoker_linear_q4k_a8): linear_q4k_a8.h, last.
 *
 * Tiles: NR = NV vectors of VL floats (GCC vector extensions, lowered to AVX-512, AVX2 or
 * SSE by -march=native). MR * NV accumulators + NV weight vectors must fit the register file:
 * 6 x 4 (+4) of 32 zmm with AVX-512; 3 x 4 (+4) of 16 ymm otherwise.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp8.h"

#if defined(__AVX512F__)
#define VL 16
#define MR 6
#else
#define VL 8
#define MR 3
#endif
#define NV 4
#define NR (NV * VL)
/* Bytes of x one task keeps in L2 (half of a 2 MB L2) while the weight panels stream past:
 * rows per chunk = X_CHUNK_BYTES / (4 K), a multiple of MR. 384 KB was ~3% slower at M = 512
 * and 2048 (fewer rows per pass over the weights). */
#define X_CHUNK_BYTES (1024 * 1024)
/* Weight rows ahead to prefetch within a panel (2 KB at NR = 64): a panel's first tile reads
 * it from memory, and at small M nothing else hides that latency (M = 8-16 over 8 layers'
 * weights: ~15% faster with it; no change at prefill sizes). */
#define PREFETCH_ROWS 8
/* Row tiles of a task from which one-byte panels prefetch the next panel meanwhile (panel_rows
 * says why). */
#define NEXT_PANEL_MIN_TILES_Q8 2

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4), may_alias));

static inline vf load(const float *p) { return *(const vfu *)p; }
static inline void store(float *p, vf v) { *(vfu *)p = v; }

/* Weight formats: 0 float32, 1 int8, 2 FP8 E4M3 read as value / 256 (see the header). */
enum { W_F32 = 0, W_I8 = 1, W_FP8 = 2 };

/* VL weights at p, widened to floats (not yet scaled). The plain-C versions (builds without
 * AVX2) stay out of line: inlined into every tile specialization they made that build 4x slower
 * to compile, for a path that exists to be tested. */
#if defined(__AVX2__)
#define WIDEN_INLINE inline
#else
#define WIDEN_INLINE __attribute__((noinline))
#endif
static WIDEN_INLINE vf load_i8(const int8_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    float f[VL];
    for (int l = 0; l < VL; l++) f[l] = (float)p[l];
    return load(f);
#endif
}

static WIDEN_INLINE vf load_fp8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vf)fp8x16_div256(p);
#elif defined(__AVX2__) && defined(__F16C__)
    return (vf)fp8x8_div256(p);
#else
    float f[VL];
    for (int l = 0; l < VL; l++) f[l] = fp8_div256_table[p[l]];
    return load(f);
#endif
}

/* Weight vector at element index i of a panel of format fmt (a constant at every call site). */
static inline vf load_w(const int fmt, const void *w, int64_t i) {
    if (fmt == W_I8) return load_i8((const int8_t *)w + i);
    if (fmt == W_FP8) return load_fp8((const uint8_t *)w + i);
    return load((const float *)w + i);
}


/* acc + b * a: one rounding where the ISA has FMA, two (mul, then add) where it has not. */
static inline vf madd(vf acc, vf b, float a) {
#if defined(__AVX512F__)
    return _mm512_fmadd_ps(b, _mm512_set1_ps(a), acc);
#elif defined(__FMA__)
    return _mm256_fmadd_ps(b, _mm256_set1_ps(a), acc);
#else
    return acc + b * a;
#endif
}

static inline float madd_scalar(float acc, float b, float a) {
#if defined(__FMA__) || defined(__AVX512F__)
    return fmaf(b, a, acc);
#else
    return acc + b * a;
#endif
}

/* y[0:mr, 0:nv*VL] = acc + bias, or with silu (the columns are [gate | up] halves)
 * y[0:mr, 0:nv*VL/2] = silu(gate) * up: the end of every tile. */
static inline __attribute__((always_inline)) void store_tile(const int mr, const int nv, const int silu, vf acc[MR][NV],
                                                             const float *restrict bias, float *restrict y, int64_t ldy) {
    if (bias != NULL)
        for (int m = 0; m < mr; m++)
            for (int j = 0; j < nv; j++) acc[m][j] += load(bias + j * VL);
    if (!silu) {
        for (int m = 0; m < mr; m++)
            for (int j = 0; j < nv; j++) store(y + m * ldy + j * VL, acc[m][j]);
        return;
    }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nv / 2; j++) {
            float g[VL], u[VL], o[VL];
            store(g, acc[m][j]);
            store(u, acc[m][j + nv / 2]);
            /* as stoker_silu_and_mul_f32 (elementwise.c), exp's argument capped */
#pragma omp simd
            for (int l = 0; l < VL; l++) o[l] = g[l] / (1.0f + expf(fminf(-g[l], 88.0f))) * u[l];
            store(y + m * ldy + j * VL, load(o));
        }
}


/* y[0:mr, 0:nv*VL] = x[0:mr, :] @ wt[:, 0:nv*VL] (+ bias); mr, nv, silu and fmt are
 * constants at each call site, so gcc unrolls the loops and keeps acc in registers.
 * fmt != W_F32: wt holds bytes, and weight (k, n) is q * sc[(k / group_k) * ldsc + n]; the
 * K loop runs group by group with that group's NV scale vectors in hand (float: one group).
 * ldw and the prefetch pointer `ahead` (num_ahead cache lines) count elements of the format.
 * silu: the panel's columns are [gate | up] halves, and y[0:mr, 0:nv*VL/2] gets
 * silu(gate) * up (SiLU-and-mul fused into the gate/up projection: the 2x wider
 * pre-activation never goes to memory; store_tile). */
static inline __attribute__((always_inline)) void tile(const int mr, const int nv, const int silu, const int fmt,
                                                       const float *restrict x, int64_t ldx,
                                                       const void *restrict wt, int64_t ldw,
                                                       const float *restrict sc,
                                                       int64_t ldsc, int64_t group_k,
                                                       const float *restrict bias, float *restrict y, int64_t ldy,
                                                       int64_t K, const char *ahead, int64_t num_ahead) {
    const int esize = fmt == W_F32 ? 4 : 1;
    const int64_t row_bytes = (int64_t)nv * VL * esize;
    vf acc[MR][NV];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nv; j++) acc[m][j] = (vf){0};
    const int64_t G = fmt == W_F32 ? K : group_k;
    for (int64_t k0 = 0; k0 < K; k0 += G) {
        const int64_t k1 = k0 + G < K ? k0 + G : K;
        vf s[NV];
        if (fmt != W_F32)
            for (int j = 0; j < nv; j++) s[j] = load(sc + (k0 / G) * ldsc + j * VL);
        for (int64_t k = k0; k < k1; k++) {
            const char *w = (const char *)wt + k * ldw * esize;
            for (int64_t ofs = 0; ofs < row_bytes; ofs += 64) __builtin_prefetch(w + PREFETCH_ROWS * ldw * esize + ofs, 0, 3);
            if (k < num_ahead) __builtin_prefetch(ahead + 64 * k, 0, 3);
            vf b[NV];
            for (int j = 0; j < nv; j++) b[j] = fmt == W_F32 ? load_w(fmt, w, j * VL) : load_w(fmt, w, j * VL) * s[j];
            for (int m = 0; m < mr; m++) {
                const float a = x[m * ldx + k];
                for (int j = 0; j < nv; j++) acc[m][j] = madd(acc[m][j], b[j], a);
            }
        }
    }
    store_tile(mr, nv, silu, acc, bias, y, ldy);
}

#define TILE_ARGS x, ldx, wt, ldw, sc, ldsc, group_k, bias, y, ldy, K, ahead, num_ahead
#define TILE_CASES(NVC, SILU, FMT)                                                 \
    switch (mr) {                                                                  \
    case 1: tile(1, NVC, SILU, FMT, TILE_ARGS); break;                             \
    case 2: tile(2, NVC, SILU, FMT, TILE_ARGS); break;                             \
    case 3: tile(3, NVC, SILU, FMT, TILE_ARGS); break;                             \
    case 4: tile(MR >= 4 ? 4 : 1, NVC, SILU, FMT, TILE_ARGS); break;               \
    case 5: tile(MR >= 5 ? 5 : 1, NVC, SILU, FMT, TILE_ARGS); break;               \
    default: tile(MR >= 6 ? 6 : 1, NVC, SILU, FMT, TILE_ARGS); break;              \
    }
#define TILE_NV(FMT)                          \
    if (silu) {                               \
        TILE_CASES(NV, 1, FMT);               \
        return;                               \
    }                                         \
    switch (nv) {                             \
    case 1: TILE_CASES(1, 0, FMT); break;     \
    case 2: TILE_CASES(2, 0, FMT); break;     \
    case 3: TILE_CASES(3, 0, FMT); break;     \
    default: TILE_CASES(NV, 0, FMT); break;   \
    }

/* One tile of mr <= MR rows and nv <= NV vectors of columns (silu: always NV). */
static void tile_dispatch(int mr, int nv, int silu, int fmt, const float *x, int64_t ldx, const void *wt, int64_t ldw,
                          const float *sc, int64_t ldsc, int64_t group_k, const float *bias, float *y,
                          int64_t ldy,
                          int64_t K, const char *ahead, int64_t num_ahead) {
    if (fmt == W_F32) {
        TILE_NV(W_F32);
        return;
    }
    /* quantized tiles: whole panels only (linear() dequantizes a partial one first) */
    if (fmt == W_I8) {
        if (silu) TILE_CASES(NV, 1, W_I8) else TILE_CASES(NV, 0, W_I8)
    } else {
        if (silu) TILE_CASES(NV, 1, W_FP8) else TILE_CASES(NV, 0, W_FP8)
    }
}

/* Columns [0, cols) with cols < VL of the float panel at w: plain scalar code, same
 * summation order (quantized panels with such columns are dequantized first). */
static void columns_scalar(const float *x, int64_t ldx, const float *w, int64_t ldw, const float *bias, float *y,
                           int64_t ldy, int64_t mr, int64_t cols, int64_t K) {
    for (int64_t m = 0; m < mr; m++)
        for (int64_t n = 0; n < cols; n++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc = madd_scalar(acc, w[k * ldw + n], x[m * ldx + k]);
            y[m * ldy + n] = bias != NULL ? acc + bias[n] : acc;
        }
}

/* At least this many row tiles in a (chunk, panel): a quantized panel is dequantized once into
 * a float buffer, rather than widened in registers once per tile. The last, partial panel is
 * always dequantized first, so quantized tiles exist only for whole panels (fewer
 * specializations to compile). */
#define DEQUANT_MIN_TILES 3

/* A per-thread float buffer of at least n floats, kept across calls (OpenMP's threads live as
 * long as the process): decode calls this kernel a few times per layer and step, and a fresh
 * multi-MB malloc each time would map fresh pages. NULL if memory runs out. */
static float *thread_buffer(size_t n) {
    static __thread float *buf = NULL;
    static __thread size_t cap = 0;
    if (n > cap) {
        free(buf);
        buf = (float *)malloc(sizeof(float) * n);
        cap = buf != NULL ? n : 0;
    }
    return buf;
}

/* Rows [m_begin, m_end) of x against panel p of num_panels (one task of `linear`, and of
 * moe.c's grouped GEMMs): the panel's tiles, prefetching panel p + 1 meanwhile. Returns 1 when
 * a quantized panel's dequantization buffer could not be allocated, else 0. */
static int panel_rows(int fmt, const float *x, int64_t ldx, const void *wt, int64_t ldw, int64_t panel_stride,
                      int64_t num_panels, int64_t p, const float *scale, int64_t ldsc,
                      int64_t group_k,
                      const float *bias, float *y, int64_t ldy, int64_t m_begin, int64_t m_end, int64_t N, int64_t K,
                      int silu_and_mul) {
    const int64_t esize = fmt == W_F32 ? 4 : 1;
    const int64_t n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR;
    const int nv = (int)(cols / VL);
    const int64_t vec_cols = (int64_t)nv * VL;
    const void *w = (const char *)wt + p * panel_stride * esize;
    const float *sc = scale != NULL ? scale + n0 : NULL;
    /* While this panel's tiles run (from L2 after the first), the next panel is prefetched, a
     * share per tile, one cache line per k step, so the next panel's first tile does not wait on
     * memory. Not for one-byte panels below NEXT_PANEL_MIN_TILES_Q8 row tiles: at batch-1 decode
     * the whole next panel (K lines: all of it) pulled into L1 while this one streams through it
     * evicts the lines being read. Measured on the 4-bit benchmark's ~0.4B Llama (1 thread,
     * steps/s, medians of 4 interleaved runs): int8 batch 1 38.3 with it, 40.7 without; batch 8
     * (2 tiles) 25.2 with, 24.5 without; a 512-token int8 prefill 1.76 s with, 1.79 without.
     * Float32 panels always prefetch (K lines: a quarter of the next panel): without it that
     * model's float32 batch-1 decode was faster (15.5 -> 17.0 steps/s) but the cost model's
     * small Llama (benchmarks/predict_cpu.py, hidden 512) was ~8% slower at batch 1 on 2 threads
     * (4.09 -> 4.42 ms a step, medians of 5 alternating runs), and moe.c's float32 experts at
     * 512 tokens 88 -> 93 ms of CPU. */
    const int64_t num_tiles = (m_end - m_begin + MR - 1) / MR;
    const int64_t min_tiles = fmt == W_F32 ? 1 : NEXT_PANEL_MIN_TILES_Q8;
    const char *next = num_tiles >= min_tiles && p + 1 < num_panels
                           ? (const char *)wt + (p + 1) * panel_stride * esize : NULL;
    const int64_t next_lines = next != NULL ? K * ldw * esize / 64 : 0;
    int tile_fmt = fmt;
    const void *tile_w = w;
    int64_t tile_ldw = ldw;
    if (fmt != W_F32 && (num_tiles >= DEQUANT_MIN_TILES || nv != NV)) {
        /* dequantize the panel once: buf (K, NR) = q * s, the values the tiles would make */
        float *buf = thread_buffer((size_t)(K * NR));
        if (buf == NULL) return 1;
        for (int64_t k = 0; k < K; k++) {
            const float *s_row = sc + (k / group_k) * ldsc;
            for (int j = 0; j < NV; j++) store(buf + k * NR + j * VL, load_w(fmt, w, k * ldw + j * VL) * load(s_row + j * VL));
        }
        tile_fmt = W_F32;
        tile_w = buf;
        tile_ldw = NR;
    }
    for (int64_t m0 = m_begin; m0 < m_end; m0 += MR) {
        const int mr = (int)(m_end - m0 < MR ? m_end - m0 : MR);
        const int64_t t = (m0 - m_begin) / MR;
        const int64_t first = next_lines * t / num_tiles, last = next_lines * (t + 1) / num_tiles;
        const int64_t num_ahead = last - first < K ? last - first : K;
        if (nv > 0)
            tile_dispatch(mr, nv, silu_and_mul, tile_fmt, x + m0 * ldx, ldx, tile_w, tile_ldw, sc, ldsc, group_k,
                          bias != NULL ? bias + n0 : NULL, y + m0 * ldy + (silu_and_mul ? n0 / 2 : n0), ldy, K,
                          next + 64 * first, num_ahead);
        if (vec_cols < cols) /* tile_w is float here (see above) */
            columns_scalar(x + m0 * ldx, ldx, (const float *)tile_w + vec_cols, tile_ldw,
                           bias != NULL ? bias + n0 + vec_cols : NULL, y + m0 * ldy + n0 + vec_cols, ldy, mr,
                           cols - vec_cols, K);
    }
    return 0;
}

/* Rows per task of x (K floats each) kept in L2 while the panels stream past it: a multiple of MR. */
static int64_t chunk_max_rows(int64_t K) {
    const int64_t rows = (X_CHUNK_BYTES / (4 * K)) / MR * MR;
    return rows > MR ? rows : MR;
}

/* Row chunks of at most chunk_max_rows, so a chunk of x stays in L2 while every panel streams
 * past it; below that, threads split the panels (each weight read once), and the rows only
 * when there are fewer panels than threads. */
static void plan_chunks(int64_t M, int64_t K, int64_t num_panels, int num_threads, int64_t *chunk_rows_out,
                        int64_t *num_chunks_out) {
    const int64_t chunk_max = chunk_max_rows(K);
    int64_t num_chunks = (M + chunk_max - 1) / chunk_max;
    if (num_chunks * num_panels < num_threads) num_chunks = (num_threads + num_panels - 1) / num_panels;
    int64_t chunk_rows = (M + num_chunks - 1) / num_chunks;
    chunk_rows = (chunk_rows + MR - 1) / MR * MR;
    *chunk_rows_out = chunk_rows;
    *num_chunks_out = (M + chunk_rows - 1) / chunk_rows;
}

/* The shared body of stoker_linear_f32 and stoker_linear_q8 (see those). */
static int linear(int fmt, const float *x, int64_t ldx, const void *wt, int64_t ldw, int64_t panel_stride,
                  const float *scale, int64_t ldsc, int64_t group_k, const float *bias, float *y, int64_t ldy, int64_t M,
                  int64_t N, int64_t K, int silu_and_mul, int num_threads) {
    const int64_t num_panels = (N + NR - 1) / NR;
    int64_t chunk_rows, num_chunks;
    plan_chunks(M, K, num_panels, num_threads, &chunk_rows, &num_chunks);
    int failed = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(2) reduction(| : failed)
    for (int64_t chunk = 0; chunk < num_chunks; chunk++)
        for (int64_t p = 0; p < num_panels; p++) {
            const int64_t m_begin = chunk * chunk_rows;
            const int64_t m_end = (chunk + 1) * chunk_rows < M ? (chunk + 1) * chunk_rows : M;
            failed |= panel_rows(fmt, x, ldx, wt, ldw, panel_stride, num_panels, p, scale, ldsc, group_k, bias, y, ldy,
                                 m_begin, m_end, N, K, silu_and_mul);
        }
    return failed;
}

/* x (M, K) row stride ldx; wt: W^T in panels of NR columns, panel p at wt + p * panel_stride,
 * its rows ldw floats apart; bias (N,) or NULL; y (M, N) row stride ldy.
 * silu_and_mul: N is a multiple of NR, each panel holds NR/2 gate then NR/2 up columns (and
 * bias is in that order), and y is (M, N/2): panel p's silu(gate) * up at columns p*NR/2... */
void stoker_linear_f32(const float *x, int64_t ldx, const float *wt, int64_t ldw, int64_t panel_stride,
                       const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int silu_and_mul,
                       int num_threads) {
    linear(W_F32, x, ldx, wt, ldw, panel_stride, NULL, 0, K, bias, y, ldy, M, N, K, silu_and_mul, num_threads);
}

/* As stoker_linear_f32, with one-byte weights: fmt 1 int8, 2 FP8 E4M3 (bits); ldw and
 * panel_stride in bytes (= elements). scale (ceil(K / group_k), ldsc) holds each column's scale
 * per group of group_k rows of K, columns in panel order (ldsc >= the panels' columns); for FP8
 * it is the true scale x 256 (the header says why). Returns 0, or 1 when the dequantization
 * buffer could not be allocated (then y is incomplete). */
int stoker_linear_q8(const float *x, int64_t ldx, const void *wt, int64_t ldw, int64_t panel_stride, int fmt,
                     const float *scale, int64_t ldsc, int64_t group_k, const float *bias, float *y, int64_t ldy,
                     int64_t M, int64_t N, int64_t K, int silu_and_mul, int num_threads) {
    if (fmt != W_I8 && fmt != W_FP8) return 2;
    return linear(fmt, x, ldx, wt, ldw, panel_stride, scale, ldsc, group_k, bias, y, ldy, M, N, K, silu_and_mul,
                  num_threads);
}

#include "linear_q4.h"
#include "linear_q4_a8.h"
#include "linear_q6_a8.h"
#include "linear_q4k_a8.h"

int stoker_linear_nr(void) { return NR; }

/* One task of stoker_linear_f32, on the calling thread, for kernels that schedule the tasks of
 * several GEMMs in one parallel region (moe.c: every expert's rows against its panels): rows
 * [m_begin, m_end) of x against float panel p of num_panels, arguments as stoker_linear_f32.
 * Each output is the same in-order sum as there, so the same bits whatever the task split. */
void stoker_linear_panel_rows_f32(const float *x, int64_t ldx, const float *wt, int64_t ldw, int64_t panel_stride,
                                  int64_t num_panels, int64_t p, const float *bias, float *y, int64_t ldy,
                                  int64_t m_begin, int64_t m_end, int64_t N, int64_t K, int silu_and_mul) {
    panel_rows(W_F32, x, ldx, wt, ldw, panel_stride, num_panels, p, NULL, 0, K, bias, y, ldy, m_begin, m_end, N, K,
               silu_and_mul);
}

/* The rows of x (K floats each) one task of stoker_linear_f32 takes at most. */
int64_t stoker_linear_chunk_rows(int64_t K) { return chunk_max_rows(K); }

/* For the other kernels of this library (prefill_attention.c): one tile without bias,
 * y[0:mr, 0:nv*VL] = x[0:mr, 0:K] @ wt[0:K, 0:nv*VL], wt rows ldw floats apart. */
int stoker_linear_mr(void) { return MR; }
int stoker_linear_vl(void) { return VL; }
void stoker_linear_tile_f32(int mr, int nv, const float *x, int64_t ldx, const float *wt, int64_t ldw, float *y,
                            int64_t ldy, int64_t K) {
    tile_dispatch(mr, nv, 0, W_F32, x, ldx, wt, ldw, NULL, 0, K, NULL, y, ldy, K, NULL, 0);
}

/* What this build was compiled for (build.py's STOKER_CPU_ISA): "avx512", "avx2" (with FMA)
 * or "sse2"; tests check that a narrower build really took its narrower path. */
const char *stoker_cpu_target(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "sse2";
#endif
}
