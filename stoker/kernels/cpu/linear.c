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
 * Weight layout: packed panels (kernels/cpu/native.py, pack_linear_weight): panel p holds
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
 * Tiles: NR = NV vectors of VL floats (GCC vector extensions, lowered to AVX-512, AVX2 or
 * SSE by -march=native). MR * NV accumulators + NV weight vectors must fit the register file:
 * 6 x 4 (+4) of 32 zmm with AVX-512; 3 x 4 (+4) of 16 ymm otherwise.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

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

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4), may_alias));

static inline vf load(const float *p) { return *(const vfu *)p; }
static inline void store(float *p, vf v) { *(vfu *)p = v; }

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

/* y[0:mr, 0:nv*VL] = x[0:mr, :] @ wt[:, 0:nv*VL] (+ bias); mr, nv and silu are constants
 * at each call site, so gcc unrolls the loops and keeps acc in registers.
 * silu: the panel's columns are [gate | up] halves, and y[0:mr, 0:nv*VL/2] gets
 * silu(gate) * up (SiLU-and-mul fused into the gate/up projection: the 2x wider
 * pre-activation never goes to memory). */
static inline __attribute__((always_inline)) void tile(const int mr, const int nv, const int silu,
                                                       const float *restrict x, int64_t ldx,
                                                       const float *restrict wt, int64_t ldw,
                                                       const float *restrict bias, float *restrict y, int64_t ldy,
                                                       int64_t K, const float *ahead, int64_t num_ahead) {
    vf acc[MR][NV];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nv; j++) acc[m][j] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        const float *w = wt + k * ldw;
        for (int j = 0; j < nv; j += 64 / (VL * 4) > 0 ? 64 / (VL * 4) : 1)
            __builtin_prefetch(w + PREFETCH_ROWS * ldw + j * VL, 0, 3);
        if (k < num_ahead) __builtin_prefetch(ahead + 16 * k, 0, 3);
        vf b[NV];
        for (int j = 0; j < nv; j++) b[j] = load(w + j * VL);
        for (int m = 0; m < mr; m++) {
            const float a = x[m * ldx + k];
            for (int j = 0; j < nv; j++) acc[m][j] = madd(acc[m][j], b[j], a);
        }
    }
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

#define TILE_CASES(NVC, SILU)                                                           \
    switch (mr) {                                                                       \
    case 1: tile(1, NVC, SILU, x, ldx, wt, ldw, bias, y, ldy, K, ahead, num_ahead); break;                 \
    case 2: tile(2, NVC, SILU, x, ldx, wt, ldw, bias, y, ldy, K, ahead, num_ahead); break;                 \
    case 3: tile(3, NVC, SILU, x, ldx, wt, ldw, bias, y, ldy, K, ahead, num_ahead); break;                 \
    case 4: tile(MR >= 4 ? 4 : 1, NVC, SILU, x, ldx, wt, ldw, bias, y, ldy, K, ahead, num_ahead); break;   \
    case 5: tile(MR >= 5 ? 5 : 1, NVC, SILU, x, ldx, wt, ldw, bias, y, ldy, K, ahead, num_ahead); break;   \
    default: tile(MR >= 6 ? 6 : 1, NVC, SILU, x, ldx, wt, ldw, bias, y, ldy, K, ahead, num_ahead); break; \
    }

/* One tile of mr <= MR rows and nv <= NV vectors of columns (silu: always NV). */
static void tile_dispatch(int mr, int nv, int silu, const float *x, int64_t ldx, const float *wt, int64_t ldw,
                          const float *bias, float *y, int64_t ldy, int64_t K, const float *ahead,
                          int64_t num_ahead) {
    if (silu) {
        TILE_CASES(NV, 1);
        return;
    }
    switch (nv) {
    case 1: TILE_CASES(1, 0); break;
    case 2: TILE_CASES(2, 0); break;
    case 3: TILE_CASES(3, 0); break;
    default: TILE_CASES(NV, 0); break;
    }
}

/* Columns [0, cols) with cols < VL of the panel at w: plain scalar code, same summation order. */
static void columns_scalar(const float *x, int64_t ldx, const float *w, int64_t ldw, const float *bias, float *y,
                           int64_t ldy, int64_t mr, int64_t cols, int64_t K) {
    for (int64_t m = 0; m < mr; m++)
        for (int64_t n = 0; n < cols; n++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc = madd_scalar(acc, w[k * ldw + n], x[m * ldx + k]);
            y[m * ldy + n] = bias != NULL ? acc + bias[n] : acc;
        }
}

/* x (M, K) row stride ldx; wt: W^T in panels of NR columns, panel p at wt + p * panel_stride,
 * its rows ldw floats apart; bias (N,) or NULL; y (M, N) row stride ldy.
 * silu_and_mul: N is a multiple of NR, each panel holds NR/2 gate then NR/2 up columns (and
 * bias is in that order), and y is (M, N/2): panel p's silu(gate) * up at columns p*NR/2... */
void stoker_linear_f32(const float *x, int64_t ldx, const float *wt, int64_t ldw, int64_t panel_stride,
                       const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int silu_and_mul,
                       int num_threads) {
    const int64_t num_panels = (N + NR - 1) / NR;
    /* Row chunks of at most chunk_max rows, so a chunk of x stays in L2 while every panel
     * streams past it; below that, threads split the panels (each weight read once), and the
     * rows only when there are fewer panels than threads. */
    const int64_t chunk_max = (X_CHUNK_BYTES / (4 * K)) / MR * MR > MR ? (X_CHUNK_BYTES / (4 * K)) / MR * MR : MR;
    int64_t num_chunks = (M + chunk_max - 1) / chunk_max;
    if (num_chunks * num_panels < num_threads) num_chunks = (num_threads + num_panels - 1) / num_panels;
    int64_t chunk_rows = (M + num_chunks - 1) / num_chunks;
    chunk_rows = (chunk_rows + MR - 1) / MR * MR;
    num_chunks = (M + chunk_rows - 1) / chunk_rows;
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(2)
    for (int64_t chunk = 0; chunk < num_chunks; chunk++)
        for (int64_t p = 0; p < num_panels; p++) {
            const int64_t n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR;
            const int64_t m_end = (chunk + 1) * chunk_rows < M ? (chunk + 1) * chunk_rows : M;
            const int nv = (int)(cols / VL);
            const int64_t vec_cols = (int64_t)nv * VL;
            const float *w = wt + p * panel_stride;
            /* While this panel's tiles run (from L2 after the first), the next panel is
             * prefetched, a share per tile, one cache line per k step: without it each panel's
             * first tile waits on memory (the weights do not stay in L3 between decode steps,
             * the KV cache streams through it). */
            const int64_t m_begin = chunk * chunk_rows, num_tiles = (m_end - m_begin + MR - 1) / MR;
            const float *next = p + 1 < num_panels ? wt + (p + 1) * panel_stride : NULL;
            const int64_t next_lines = next != NULL ? K * ldw / 16 : 0;
            for (int64_t m0 = m_begin; m0 < m_end; m0 += MR) {
                const int mr = (int)(m_end - m0 < MR ? m_end - m0 : MR);
                const int64_t t = (m0 - m_begin) / MR;
                const int64_t first = next_lines * t / num_tiles, last = next_lines * (t + 1) / num_tiles;
                const int64_t num_ahead = last - first < K ? last - first : K;
                if (nv > 0)
                    tile_dispatch(mr, nv, silu_and_mul, x + m0 * ldx, ldx, w, ldw, bias != NULL ? bias + n0 : NULL,
                                  y + m0 * ldy + (silu_and_mul ? n0 / 2 : n0), ldy, K, next + 16 * first, num_ahead);
                if (vec_cols < cols)
                    columns_scalar(x + m0 * ldx, ldx, w + vec_cols, ldw, bias != NULL ? bias + n0 + vec_cols : NULL,
                                   y + m0 * ldy + n0 + vec_cols, ldy, mr, cols - vec_cols, K);
            }
        }
}

int stoker_linear_nr(void) { return NR; }

/* For the other kernels of this library (prefill_attention.c): one tile without bias,
 * y[0:mr, 0:nv*VL] = x[0:mr, 0:K] @ wt[0:K, 0:nv*VL], wt rows ldw floats apart. */
int stoker_linear_mr(void) { return MR; }
int stoker_linear_vl(void) { return VL; }
void stoker_linear_tile_f32(int mr, int nv, const float *x, int64_t ldx, const float *wt, int64_t ldw, float *y,
                            int64_t ldy, int64_t K) {
    tile_dispatch(mr, nv, 0, x, ldx, wt, ldw, NULL, y, ldy, K, NULL, 0);
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
