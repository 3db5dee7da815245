/*
 * The routed experts of a Mixture-of-Experts layer in one call, CPU float32 (issue 33):
 *
 *     out[t] = sum over t's k choices, in ascending expert order, of
 *              w[t, j] * (act(x[t] @ gate_e^T + b13_e[:I], x[t] @ up_e^T + b13_e[I:]) @ down_e^T + b2_e)
 *
 * act is SiLU-and-mul (silu(gate) * up), or gpt-oss's clamped SwiGLU (vLLM's "swigluoai"):
 * (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit). The
 * biases (gpt-oss's) are optional: NULL for the families without them.
 *
 * Before this kernel, layers/moe.py looped over the experts in Python and called the linear
 * kernel twice per expert with tokens: at decode (one token, k experts) that is 2k ctypes
 * calls, 2k OpenMP team wake-ups and 2k small parallel regions per layer, each too small to
 * keep both cores busy. Here the (token, choice) pairs are sorted by expert with a counting
 * sort, and every expert's grouped GEMM runs as tasks of ONE parallel region: all the w13
 * tasks, a barrier, all the w2 tasks, a barrier, then each token's weighted sum.
 *
 * Weights: linear.c's packed panels, one set per expert (kernels/cpu/linear.py,
 * pack_linear_weight): w13 (E, P13, H, NR) packed gate_up when silu_fused (SiLU-and-mul in the
 * GEMM's tile), else plain (E, P13, H, NR) with N = 2I; w2 (E, P2, I, NR). The GEMM tasks are
 * linear.c's own (stoker_linear_panel_rows_f32): the same tiles and the same in-order sums, so
 * a row's expert output is the bits the linear kernel gives it, whatever rows share its tiles.
 *
 * Batch invariance: a token's choices are put in ascending expert order, its expert outputs
 * do not depend on the other rows (above), each is scaled by its weight (one rounding) and
 * they are added in that order (y0 w0 + y1 w1 + ...: the per-expert path's `ys * w`, then
 * `out += ...` slot by slot). This file is built with -ffp-contract=off -fno-associative-math
 * (build.py) so the compiler cannot fuse the scale into the sum for some builds only.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* linear.c */
void stoker_linear_panel_rows_f32(const float *x, int64_t ldx, const float *wt, int64_t ldw, int64_t panel_stride,
                                  int64_t num_panels, int64_t p, const float *bias, float *y, int64_t ldy,
                                  int64_t m_begin, int64_t m_end, int64_t N, int64_t K, int silu_and_mul);
int64_t stoker_linear_chunk_rows(int64_t K);
int stoker_linear_nr(void);
int stoker_linear_mr(void);
/* elementwise.c: the unfused SiLU-and-mul a model's per-expert path and dense MLPs run */
void stoker_silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t num_rows, int64_t d,
                             int num_threads);

enum { ACT_SILU = 0, ACT_CLAMPED_SWIGLU = 1 };

/* x (num_rows, 2 * d) = [gate | up] -> out (num_rows, d), gpt-oss's clamped SwiGLU (the twin:
 * layers/activation.clamped_swiglu). exp's argument is capped as in elementwise.c's SiLU. */
static void clamped_swiglu_rows(const float *x, int64_t x_stride, float *out, int64_t num_rows, int64_t d,
                                float alpha, float limit) {
    for (int64_t r = 0; r < num_rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + d;
        float *o = out + r * d;
        for (int64_t i = 0; i < d; i++) {
            const float g = fminf(gate[i], limit);
            const float u = fminf(fmaxf(up[i], -limit), limit);
            const float glu = g / (1.0f + expf(fminf(-alpha * g, 88.0f)));
            o[i] = (u + 1.0f) * glu;
        }
    }
}

/* The calling thread's scratch, kept across calls (decode calls this once per layer and step;
 * a fresh multi-MB malloc each time would map fresh pages). Per calling thread, not global: two
 * Python threads may run two models at once. NULL if memory runs out. */
static void *caller_buffer(size_t bytes) {
    static __thread void *buf = NULL;
    static __thread size_t cap = 0;
    if (bytes > cap) {
        free(buf);
        buf = malloc(bytes);
        cap = buf != NULL ? bytes : 0;
    }
    return buf;
}

/* One GEMM task: rows [m0, m1) of expert e's rows against panel p. */
typedef struct {
    int64_t e, m0, m1, p;
} task_t;

/* One projection of every expert (w13 or w2, N output columns, K inputs): float panels, or
 * MXFP4 blocks (gpt-oss's checkpoints, layers/moe_mxfp4.py) or coded groups (int4 or int8 codes
 * with a scale and an offset per group: layers/moe_int4.py, layers/moe_mixed.py) dequantized a
 * panel at a time. */
typedef struct {
    const float *w;                      /* (E, P, K, NR) float panels, or NULL for MXFP4 / coded */
    int64_t panel_stride, expert_stride; /* floats between panels, between experts */
    const uint8_t *blocks, *scales;      /* MXFP4: (E, N, K / 32, 16) and (E, N, K / 32), or NULL */
    const float *bias;                   /* (E, P * NR) each expert's padded to its panels, or NULL */
    const uint8_t *codes;                /* coded: (E, P, K / 2, NR) int4 panels, rows 2kk and 2kk + 1 in byte kk,
                                            or (E, P, K, NR) int8 panels, one code a byte; or NULL */
    const float *q_scale, *q_offset;     /* coded: (E, P, K / group, NR) each; w = q * scale + offset */
    int64_t group;                       /* coded: rows of K per scale, even, dividing K */
    int bits;                            /* coded: 4 (codes 0..15, two a byte) or 8 (int8 codes) */
} expert_weights_t;

/* E2M1 (FP4) values by code: the sign in bit 3 (OCP Microscaling v1.0; formats.E2M1_VALUES) */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* The calling OpenMP thread's buffer for one dequantized panel (K, NR), kept across calls. */
static float *panel_buffer(size_t floats) {
    static __thread float *buf = NULL;
    static __thread size_t cap = 0;
    if (floats > cap) {
        free(buf);
        buf = (float *)malloc(sizeof(float) * floats);
        cap = buf != NULL ? floats : 0;
    }
    return buf;
}

/* Task t of one grouped GEMM: y[m0:m1, panel p's columns] = x[m0:m1] @ W_e^T (+ bias). For coded
 * weights the panel is dequantized from its codes (q * scale + offset per group, below); for MXFP4
 * the panel's columns are dequantized first, value = E2M1[nibble] * 2^(scale - 127) (exact: a
 * power of two), into the (K, NR) layout of a float panel, and the linear kernel's own task runs
 * on it: the same bits as float experts holding the dequantized weights. Returns 1 when the
 * buffer could not be allocated. */
static int gemm_task(const expert_weights_t *W, task_t t, const float *x, int64_t K, float *y, int64_t ldy,
                     int64_t N, int64_t P, int64_t nr, int silu) {
    const float *bias = W->bias != NULL ? W->bias + t.e * P * nr : NULL;
    if (W->blocks == NULL && W->codes == NULL) {
        stoker_linear_panel_rows_f32(x, K, W->w + t.e * W->expert_stride, nr, W->panel_stride, P, t.p, bias, y, ldy,
                                     t.m0, t.m1, N, K, silu);
        return 0;
    }
    const int64_t n0 = t.p * nr, cols = N - n0 < nr ? N - n0 : nr, G = K / 32;
    float *buf = panel_buffer((size_t)(K * nr));
    if (buf == NULL) return 1;
    if (W->codes != NULL && W->bits == 8) {
        /* int8 panels: codes (K, NR), one signed code a byte; scales and offsets (K / group, NR).
         * q * s, rounded, + o, rounded, a vector loop along NR (the same arithmetic as int4's). */
        const int64_t Gq = K / W->group, panel = t.e * P + t.p;
        const int8_t *codes = (const int8_t *)W->codes + panel * K * nr;
        const float *scale = W->q_scale + panel * Gq * nr, *offset = W->q_offset + panel * Gq * nr;
        for (int64_t g = 0; g < Gq; g++) {
            const float *s = scale + g * nr, *o = offset + g * nr;
            for (int64_t kk = g * W->group; kk < (g + 1) * W->group; kk++) {
                const int8_t *c = codes + kk * nr;
                float *row = buf + kk * nr;
                for (int64_t j = 0; j < nr; j++) {
                    const float p = (float)c[j] * s[j];
                    row[j] = p + o[j];
                }
            }
        }
    } else if (W->codes != NULL) {
        /* int4 panels: codes (K / 2, NR), byte kk holding rows 2kk (low nibble) and 2kk + 1 of the
         * panel's NR columns; scales and offsets (K / group, NR). Contiguous along NR, so each row
         * is a vector loop: q * s, rounded, + o, rounded (int4.dequantize; no FMA contraction). */
        const int64_t Gq = K / W->group, half = W->group / 2, panel = t.e * P + t.p;
        const uint8_t *codes = W->codes + panel * (K / 2) * nr;
        const float *scale = W->q_scale + panel * Gq * nr, *offset = W->q_offset + panel * Gq * nr;
        for (int64_t g = 0; g < Gq; g++) {
            const float *s = scale + g * nr, *o = offset + g * nr;
            for (int64_t kk = g * half; kk < (g + 1) * half; kk++) {
                const uint8_t *b = codes + kk * nr;
                float *lo = buf + 2 * kk * nr, *hi = lo + nr;
                for (int64_t j = 0; j < nr; j++) {
                    const float pl = (float)(b[j] & 0x0F) * s[j], ph = (float)(b[j] >> 4) * s[j];
                    lo[j] = pl + o[j];
                    hi[j] = ph + o[j];
                }
            }
        }
    }
    if (W->codes != NULL) {
        stoker_linear_panel_rows_f32(x, K, buf, nr, K * nr, 1, 0, bias != NULL ? bias + n0 : NULL, y + n0, ldy, t.m0,
                                     t.m1, N - n0, K, 0);
        return 0;
    }
    /* MXFP4: one block of 32 inputs at a time: each of the panel's rows (output columns) dequantized
     * into a small contiguous tile (cols, 32) in L1, then written to the panel's (32, NR) slice
     * row by row, contiguous along NR (not 32 scattered stores per value). */
    float tile[nr * 32];
    for (int64_t g = 0; g < G; g++) {
        for (int64_t j = 0; j < cols; j++) {
            const int64_t row = t.e * N + n0 + j;
            const uint8_t *blk = W->blocks + (row * G + g) * 16;
            const float s = ldexpf(1.0f, (int)W->scales[row * G + g] - 127);
            float lut[16];
            for (int c = 0; c < 16; c++) lut[c] = E2M1[c] * s;
            float *tj = tile + j * 32;
            for (int b = 0; b < 16; b++) {
                tj[2 * b] = lut[blk[b] & 0x0F];
                tj[2 * b + 1] = lut[blk[b] >> 4];
            }
        }
        float *dst = buf + g * 32 * nr;
        for (int i = 0; i < 32; i++) {
            for (int64_t j = 0; j < cols; j++) dst[i * nr + j] = tile[j * 32 + i];
            for (int64_t j = cols; j < nr; j++) dst[i * nr + j] = 0.0f; /* the panel's padding, as pack_linear_weight pads */
        }
    }
    stoker_linear_panel_rows_f32(x, K, buf, nr, K * nr, 1, 0, bias != NULL ? bias + n0 : NULL, y + n0, ldy, t.m0, t.m1,
                                 N - n0, K, 0);
    return 0;
}

/* The tasks of one grouped GEMM (expert by expert, row chunk by chunk, panel by panel, the
 * order linear.c walks one GEMM) and their cumulative cost; returns how many. Cost: the row
 * tiles plus two for streaming the panel, so each thread's contiguous share is about as long
 * as the others' when the experts have unequal rows. */
static int64_t make_tasks(const int64_t *first, int64_t E, int64_t num_panels, int64_t chunk_max, int64_t mr,
                          task_t *tasks, int64_t *cost_end) {
    int64_t n = 0, cost = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t rows = first[e + 1] - first[e];
        for (int64_t c0 = 0; c0 < rows; c0 += chunk_max) {
            const int64_t c1 = c0 + chunk_max < rows ? c0 + chunk_max : rows;
            for (int64_t p = 0; p < num_panels; p++) {
                tasks[n] = (task_t){e, first[e] + c0, first[e] + c1, p};
                cost += (c1 - c0 + mr - 1) / mr + 2;
                cost_end[n++] = cost;
            }
        }
    }
    return n;
}

/* This thread's share [*begin, *end) of n tasks: those whose cost ends in its slice of the total. */
static void my_share(const int64_t *cost_end, int64_t n, int tid, int nt, int64_t *begin, int64_t *end) {
    const int64_t total = n ? cost_end[n - 1] : 0;
    const int64_t lo = total * tid / nt, hi = total * (tid + 1) / nt;
    int64_t b = 0, e = 0;
    while (b < n && cost_end[b] <= lo) b++;
    e = b;
    while (e < n && cost_end[e] <= hi) e++;
    if (tid == nt - 1) e = n;
    *begin = b;
    *end = e;
}

/*
 * x (T, H) row stride ldx; topk_ids (T, k) int64 in [0, E), topk_weights (T, k) float32, both
 * contiguous; w13 expert e at w13 + e * w13_expert_stride, its panels w13_panel_stride floats
 * apart (rows of NR floats); w2 likewise; out (T, H) contiguous.
 * silu_fused: w13 is gate_up-packed (I a multiple of NR / 2), else plain with N = 2I and
 * the activation `act` (ACT_SILU, or ACT_CLAMPED_SWIGLU with alpha and limit) runs after the GEMM.
 * b13 (E, P13 * NR) and b2 (E, P2 * NR), each expert's bias padded to its panels, or NULL
 * (a bias needs silu_fused = 0: the gate_up-packed panels interleave the columns).
 * Returns 0; 1 when the scratch could not be allocated; 2 when an expert id is out of range
 * (then out is untouched); 3 when silu_fused is asked with another activation or a bias.
 */
static int fused_moe(const float *x, int64_t ldx, const int64_t *topk_ids, const float *topk_weights, int64_t T,
                     int64_t k, int64_t E, const expert_weights_t *W13, const expert_weights_t *W2, int64_t H,
                     int64_t I, int silu_fused, int act, float alpha, float limit, float *out, int num_threads) {
    const int64_t nr = stoker_linear_nr(), mr = stoker_linear_mr();
    const int64_t pairs = T * k, n13 = 2 * I;
    const int64_t p13 = (n13 + nr - 1) / nr, p2 = (H + nr - 1) / nr;
    const int64_t c13 = stoker_linear_chunk_rows(H), c2 = stoker_linear_chunk_rows(I);
    /* at most this many tasks of each GEMM: every expert's chunks times the panels */
    const int64_t max_tasks = ((pairs + c13 - 1) / c13 + E) * p13 + ((pairs + c2 - 1) / c2 + E) * p2;
    const int64_t pre_width = silu_fused ? 0 : n13; /* the unfused (rows, 2I) pre-activation */
    /* scratch: xs (pairs, H), reused for the expert outputs ys once the w13 GEMMs are done;
     * hs (pairs, I); pre (pairs, 2I) unfused; then the integer tables. */
    const size_t floats = ((size_t)(pairs * H + pairs * I + pairs * pre_width) + 15) / 16 * 16; /* the tables 64-byte aligned */
    const size_t ints = (size_t)(2 * (E + 1) + 2 * pairs + max_tasks);
    const size_t tasks_bytes = sizeof(task_t) * (size_t)max_tasks;
    char *scratch = (char *)caller_buffer(sizeof(float) * floats + sizeof(int64_t) * ints + tasks_bytes + 64);
    if (scratch == NULL) return 1;
    float *xs = (float *)scratch, *hs = xs + pairs * H, *pre = hs + pairs * I;
    int64_t *first = (int64_t *)(scratch + sizeof(float) * floats); /* (E + 1) each expert's first sorted row */
    int64_t *fill = first + E + 1;                                  /* (E + 1) counting-sort cursors */
    int64_t *row_of = fill + E + 1;     /* (pairs) the sorted row of token t's j-th choice in expert order */
    int64_t *token_of = row_of + pairs; /* (pairs) the token of each sorted row */
    int64_t *cost_end = token_of + pairs;
    task_t *tasks = (task_t *)(cost_end + max_tasks);
    for (int64_t i = 0; i < pairs; i++)
        if (topk_ids[i] < 0 || topk_ids[i] >= E) return 2;
    if (silu_fused && (act != ACT_SILU || W13->bias != NULL || W13->blocks != NULL || W13->codes != NULL)) return 3;
    int failed = 0;

    /* Counting sort by expert: tokens in order within an expert, as a stable argsort. A
     * token's choices are first put in ascending expert order (insertion sort: k is small;
     * stable, so a repeated id keeps its slot order). */
    memset(first, 0, sizeof(int64_t) * (E + 1));
    for (int64_t i = 0; i < pairs; i++) first[topk_ids[i] + 1]++;
    for (int64_t e = 0; e < E; e++) first[e + 1] += first[e];
    memcpy(fill, first, sizeof(int64_t) * (E + 1));
    for (int64_t t = 0; t < T; t++) {
        int64_t ids[k];
        for (int64_t j = 0; j < k; j++) {
            const int64_t id = topk_ids[t * k + j];
            int64_t s = j;
            while (s > 0 && ids[s - 1] > id) {
                ids[s] = ids[s - 1];
                row_of[t * k + s] = row_of[t * k + s - 1];
                s--;
            }
            ids[s] = id;
            row_of[t * k + s] = j; /* for now: the slot; below, the sorted row */
        }
        for (int64_t j = 0; j < k; j++) {
            const int64_t r = fill[ids[j]]++;
            token_of[r] = t;
            /* the weight travels with the row: stored in the slot's place */
            row_of[t * k + j] = r | (row_of[t * k + j] << 40);
        }
    }
    /* row_of packs (slot << 40 | row): slots and rows stay far below 2^40 */
    const int64_t n13_tasks = make_tasks(first, E, p13, c13, mr, tasks, cost_end);
    int64_t n2_tasks = 0;
    task_t *tasks2 = tasks + n13_tasks;
    int64_t *cost2 = cost_end + n13_tasks;

#pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t b, e;
        /* gather: xs[r] = x[token_of[r]] */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < pairs; r++) memcpy(xs + r * H, x + token_of[r] * ldx, sizeof(float) * H);
        /* w13: hs (silu fused) or pre (unfused) */
        my_share(cost_end, n13_tasks, tid, nt, &b, &e);
        for (int64_t i = b; i < e; i++) {
            const task_t t = tasks[i];
            const int f = silu_fused ? gemm_task(W13, t, xs, H, hs, I, n13, p13, nr, 1)
                                     : gemm_task(W13, t, xs, H, pre, n13, n13, p13, nr, 0);
            if (f) {
#pragma omp atomic write
                failed = 1;
            }
        }
#pragma omp single
        n2_tasks = make_tasks(first, E, p2, c2, mr, tasks2, cost2); /* (its implicit barrier ends the w13 GEMMs) */
        if (!silu_fused) { /* this thread's share of the rows, in one call (one thread: no nested team) */
            const int64_t r0 = pairs * tid / nt, r1 = pairs * (tid + 1) / nt;
            if (r1 > r0 && act == ACT_SILU) stoker_silu_and_mul_f32(pre + r0 * n13, n13, hs + r0 * I, r1 - r0, I, 1);
            if (r1 > r0 && act == ACT_CLAMPED_SWIGLU)
                clamped_swiglu_rows(pre + r0 * n13, n13, hs + r0 * I, r1 - r0, I, alpha, limit);
#pragma omp barrier
        }
        /* w2: ys (pairs, H) into xs, which the w13 GEMMs no longer read */
        my_share(cost2, n2_tasks, tid, nt, &b, &e);
        for (int64_t i = b; i < e; i++) {
            const task_t t = tasks2[i];
            if (gemm_task(W2, t, hs, I, xs, H, H, p2, nr, 0)) {
#pragma omp atomic write
                failed = 1;
            }
        }
#pragma omp barrier
        /* each token: its k expert outputs, scaled, summed in ascending expert order */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *o = out + t * H;
            for (int64_t j = 0; j < k; j++) {
                const int64_t packed = row_of[t * k + j];
                const int64_t r = packed & (((int64_t)1 << 40) - 1), slot = packed >> 40;
                const float w = topk_weights[t * k + slot];
                const float *y = xs + r * H;
                if (j == 0)
                    for (int64_t h = 0; h < H; h++) o[h] = y[h] * w;
                else
                    for (int64_t h = 0; h < H; h++) o[h] = o[h] + y[h] * w;
            }
        }
    }
    return failed;
}

/* Float experts: w13 (E, P13, H, NR) panels, w13_panel_stride floats between panels and
 * w13_expert_stride between experts; w2 likewise (E, P2, I, NR). */
int stoker_fused_moe_f32(const float *x, int64_t ldx, const int64_t *topk_ids, const float *topk_weights, int64_t T,
                         int64_t k, int64_t E, const float *w13, int64_t w13_panel_stride, int64_t w13_expert_stride,
                         const float *w2, int64_t w2_panel_stride, int64_t w2_expert_stride, int64_t H, int64_t I,
                         int silu_fused, const float *b13, const float *b2, int act, float alpha, float limit,
                         float *out, int num_threads) {
    const expert_weights_t W13 = {w13, w13_panel_stride, w13_expert_stride, NULL, NULL, b13, NULL, NULL, NULL, 0, 0};
    const expert_weights_t W2 = {w2, w2_panel_stride, w2_expert_stride, NULL, NULL, b2, NULL, NULL, NULL, 0, 0};
    return fused_moe(x, ldx, topk_ids, topk_weights, T, k, E, &W13, &W2, H, I, silu_fused, act, alpha, limit, out,
                     num_threads);
}

/* MXFP4 experts (gpt-oss): w13 blocks (E, 2I, H / 32, 16) and scales (E, 2I, H / 32) uint8 with
 * rows [gate; up]; w2 blocks (E, H, I / 32, 16) and scales (E, H, I / 32); H and I multiples of
 * 32. Each GEMM task dequantizes its panel (gemm_task); SiLU is never fused here. */
int stoker_fused_moe_mxfp4_f32(const float *x, int64_t ldx, const int64_t *topk_ids, const float *topk_weights,
                               int64_t T, int64_t k, int64_t E, const uint8_t *w13_blocks, const uint8_t *w13_scales,
                               const uint8_t *w2_blocks, const uint8_t *w2_scales, int64_t H, int64_t I,
                               const float *b13, const float *b2, int act, float alpha, float limit, float *out,
                               int num_threads) {
    if (H % 32 || I % 32) return 3;
    const expert_weights_t W13 = {NULL, 0, 0, w13_blocks, w13_scales, b13, NULL, NULL, NULL, 0, 0};
    const expert_weights_t W2 = {NULL, 0, 0, w2_blocks, w2_scales, b2, NULL, NULL, NULL, 0, 0};
    return fused_moe(x, ldx, topk_ids, topk_weights, T, k, E, &W13, &W2, H, I, 0, act, alpha, limit, out, num_threads);
}


/* Coded experts, in panels (moe.py's pack_coded_experts): per projection, int4 (bits 4: the int4
 * MoE method, layers/moe_int4.py; and layers/moe_mixed.py) or int8 codes (bits 8: layers/moe_mixed.py,
 * a GGUF file's 5-, 6- and 8-bit experts) with a scale and an offset per group. w13 codes
 * (E, P13, H / 2, NR) uint8, byte kk of a panel row holding rows 2kk (low nibble) and 2kk + 1 of
 * K, or (E, P13, H, NR) int8; [gate; up] columns; scales and offsets (E, P13, H / group13, NR)
 * float32; w2 codes (E, P2, I / 2, NR) or (E, P2, I, NR), scales and offsets (E, P2, I / group2, NR);
 * w = q * scale + offset, padded columns zero. Groups even, dividing their K. Each GEMM task
 * dequantizes its panel (gemm_task); SiLU is never fused here. */
int stoker_fused_moe_coded_f32(const float *x, int64_t ldx, const int64_t *topk_ids, const float *topk_weights,
                               int64_t T, int64_t k, int64_t E, const uint8_t *w13_codes, int w13_bits,
                               const float *w13_scale, const float *w13_offset, int64_t group13,
                               const uint8_t *w2_codes, int w2_bits, const float *w2_scale, const float *w2_offset,
                               int64_t group2, int64_t H, int64_t I, const float *b13, const float *b2, int act,
                               float alpha, float limit, float *out, int num_threads) {
    if (group13 <= 0 || group2 <= 0 || group13 % 2 || group2 % 2 || H % group13 || I % group2) return 3;
    if ((w13_bits != 4 && w13_bits != 8) || (w2_bits != 4 && w2_bits != 8)) return 3;
    const expert_weights_t W13 = {NULL, 0, 0, NULL, NULL, b13, w13_codes, w13_scale, w13_offset, group13, w13_bits};
    const expert_weights_t W2 = {NULL, 0, 0, NULL, NULL, b2, w2_codes, w2_scale, w2_offset, group2, w2_bits};
    return fused_moe(x, ldx, topk_ids, topk_weights, T, k, E, &W13, &W2, H, I, 0, act, alpha, limit, out, num_threads);
}
