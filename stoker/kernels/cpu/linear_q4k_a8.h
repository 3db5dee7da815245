/*
 * GGUF's Q4_K against 8-bit activations, in Q4_K's own bytes (stoker_linear_q4k_a8), included by
 * linear.c after linear_q4_a8.h (its activation quantization q8_quantize_rows, dot4_u8s8 and the
 * 4-bit panels of linear_q4.h).
 *
 * Why: Q4_K is w = d sc q - dmin m per group of 32 (q in [0, 15]; sc, m 6-bit integers per 32;
 * d, dmin fp16 per 256). The 4-bit method holds it as q with a float32 scale d sc and offset
 * -dmin m per 32: 6 bits a weight, where Q4_K has 4.5. At batch-1 decode of a Q4_K_M file that
 * was 399 MB held against Q4_0's 336, and 0.72x llama.cpp's Q4_K_M (docs/benchmarks.md, "4-bit
 * weights beside llama.cpp"). Here the same nibble panels (linear_q4.h's layout, q ^ 8) come with
 * sc and m as one byte each per column and group of 32, and d and dmin as float32 per 256.
 *
 * Per column n and row, with a the int8 activations, d[b] their scale and S[b] their sum per
 * block b of 32 (one group: b = g), X[b] = d[b] * float(S[b]) (one mul):
 *
 *     I[g] = sum_{k in g} q[k] a[k]                    (q unsigned: exact in int32)
 *     A[s] = sum_{g in s} float(I[g] sc[g]) * d[g]     (|I sc| < 2^22: the conversion is exact)
 *     B[s] = sum_{g in s} float(m[g]) * X[g]
 *     y    = sum_s (A[s] * D[s] - B[s] * Dmin[s])      (s the super-blocks of 256, in order:
 *                                                        y = y + A D, then y = y - B Dmin)
 *     y   += bias
 *
 * Every float operation is one rounded mul or add in that order (no FMA: linear.c's flags), so
 * every ISA build and the torch twin (reference.linear_packed_q4k_a8) give the same bits, and a
 * row's result does not depend on M, the other rows or the thread count. K a multiple of 256.
 */

#define Q4K_SUPER 256

/* y[0:mr, 0:NR] (or NR / 2 with silu) for quantized rows xq[0:mr] (ldq bytes apart; d and X ldd
 * apart) against one whole 4-bit panel wt; sub: the panel's sc bytes, sub + G * ldsc its m bytes
 * (G = K / 32 rows each, ldsc apart); sup: its D, sup + (K / 256) * ldsc its Dmin. */
static inline __attribute__((always_inline)) void tile_q4k_a8(const int mr, const int silu, const int8_t *restrict xq,
                                                              int64_t ldq, const float *restrict d,
                                                              const float *restrict X, int64_t ldd,
                                                              const void *restrict wt, const uint8_t *restrict sub,
                                                              const float *restrict sup, int64_t ldsc,
                                                              const float *restrict bias, float *restrict y,
                                                              int64_t ldy, int64_t K) {
    const int64_t G = K / Q8_BLOCK, S = K / Q4K_SUPER;
    vf tot[A8_MR][NV];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < NV; j++) tot[m][j] = (vf){0};
    for (int64_t s = 0; s < S; s++) {
        vf acc_a[A8_MR][NV], acc_b[A8_MR][NV];
        for (int m = 0; m < mr; m++)
            for (int j = 0; j < NV; j++) acc_a[m][j] = acc_b[m][j] = (vf){0};
        for (int64_t g = s * (Q4K_SUPER / Q8_BLOCK); g < (s + 1) * (Q4K_SUPER / Q8_BLOCK); g++) {
            vi isum[A8_MR][NV];
            for (int m = 0; m < mr; m++)
                for (int j = 0; j < NV; j++) isum[m][j] = (vi){0};
            for (int64_t kb = g * Q8_BLOCK; kb < (g + 1) * Q8_BLOCK; kb += 8)
                q4_a8_rows8(mr, isum, xq, ldq, (const int32_t *)wt + kb / 8 * NR, kb);
            for (int j = 0; j < NV; j++) {
                const vi sc = byte_lanes(sub + g * ldsc + j * VL, 0);
                const vf mn = __builtin_convertvector(byte_lanes(sub + (G + g) * ldsc + j * VL, 0), vf);
                for (int m = 0; m < mr; m++) {
                    acc_a[m][j] = acc_a[m][j] + __builtin_convertvector(isum[m][j] * sc, vf) * d[m * ldd + g];
                    acc_b[m][j] = acc_b[m][j] + mn * X[m * ldd + g];
                }
            }
        }
        for (int j = 0; j < NV; j++) {
            const vf dv = load(sup + s * ldsc + j * VL), dminv = load(sup + (S + s) * ldsc + j * VL);
            for (int m = 0; m < mr; m++) {
                tot[m][j] = tot[m][j] + acc_a[m][j] * dv;
                tot[m][j] = tot[m][j] - acc_b[m][j] * dminv;
            }
        }
    }
    vf out[MR][NV]; /* store_tile's shape */
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < NV; j++) out[m][j] = tot[m][j];
    store_tile(mr, NV, silu, out, bias, y, ldy);
}

#define Q4KA8_TILE_ARGS xq, ldq, d, X, ldd, wt, sub, sup, ldsc, bias, y, ldy, K
static void tile_q4k_a8_dispatch(int mr, int silu, const int8_t *xq, int64_t ldq, const float *d, const float *X,
                                 int64_t ldd, const void *wt, const uint8_t *sub, const float *sup, int64_t ldsc,
                                 const float *bias, float *y, int64_t ldy, int64_t K) {
    if (mr == 1) {
        if (silu) tile_q4k_a8(1, 1, Q4KA8_TILE_ARGS); else tile_q4k_a8(1, 0, Q4KA8_TILE_ARGS);
    } else {
        if (silu) tile_q4k_a8(A8_MR, 1, Q4KA8_TILE_ARGS); else tile_q4k_a8(A8_MR, 0, Q4KA8_TILE_ARGS);
    }
}

/* Quantized rows [m_begin, m_end) against 4-bit panel p (one task of stoker_linear_q4k_a8). */
static void panel_rows_q4k_a8(const int8_t *xq, const float *d, const float *X, const void *wt, int64_t panel_bytes,
                              int64_t p, const uint8_t *sub, const float *sup, int64_t ldsc, const float *bias,
                              float *y, int64_t ldy, int64_t m_begin, int64_t m_end, int64_t N, int64_t K, int silu) {
    const int64_t n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR, B = K / Q8_BLOCK;
    const char *w = (const char *)wt + p * panel_bytes;
    const float *bs = bias != NULL ? bias + n0 : NULL;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += A8_MR) {
        const int mr = (int)(m_end - m0 < A8_MR ? m_end - m0 : A8_MR);
        if (cols == NR) {
            tile_q4k_a8_dispatch(mr, silu, xq + m0 * K, K, d + m0 * B, X + m0 * B, B, w, sub + n0, sup + n0, ldsc, bs,
                                 y + m0 * ldy + (silu ? n0 / 2 : n0), ldy, K);
            continue;
        }
        /* the last, partial panel (never with silu): computed whole (zero-padded columns), the
         * first `cols` copied out, as in panel_rows_q4_a8 */
        float part[A8_MR * NR];
        tile_q4k_a8_dispatch(mr, 0, xq + m0 * K, K, d + m0 * B, X + m0 * B, B, w, sub + n0, sup + n0, ldsc, bs, part,
                             NR, K);
        for (int m = 0; m < mr; m++) memcpy(y + (m0 + m) * ldy + n0, part + m * NR, sizeof(float) * cols);
    }
}

/* y (M, N) = x (M, K) @ W^T (+ bias) for W in linear_q4.h's 4-bit panels (panel_bytes = K NR / 2
 * each) with Q4_K's sub-scales: sub (2, K / 32, ldsc) uint8 [sc; m], sup (2, K / 256, ldsc)
 * float32 [D; Dmin], columns in panel order; silu_and_mul as stoker_linear_f32. Returns 0; 1 when
 * a buffer could not be allocated (y is then untouched); 2 when K is not a multiple of 256. */
int stoker_linear_q4k_a8(const float *x, int64_t ldx, const void *wt, int64_t panel_bytes, const uint8_t *sub,
                         const float *sup, int64_t ldsc, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N,
                         int64_t K, int silu_and_mul, int num_threads) {
    if (K <= 0 || K % Q4K_SUPER || panel_bytes != K * NR / 2) return 2;
    const int64_t num_panels = (N + NR - 1) / NR, B = K / Q8_BLOCK;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *d = (float *)malloc(sizeof(float) * (size_t)(M * B));
    int32_t *s = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * B));
    float *X = (float *)malloc(sizeof(float) * (size_t)(M * B));
    if (xq == NULL || d == NULL || s == NULL || X == NULL) {
        free(xq), free(d), free(s), free(X);
        return 1;
    }
    q8_quantize_rows(x, ldx, M, K, xq, d, s);
    for (int64_t i = 0; i < M * B; i++) X[i] = d[i] * (float)s[i];
    int64_t chunk_rows, num_chunks;
    plan_chunks(M, K, num_panels, num_threads, &chunk_rows, &num_chunks);
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(2)
    for (int64_t chunk = 0; chunk < num_chunks; chunk++)
        for (int64_t p = 0; p < num_panels; p++) {
            const int64_t m_begin = chunk * chunk_rows;
            const int64_t m_end = (chunk + 1) * chunk_rows < M ? (chunk + 1) * chunk_rows : M;
            if (m_begin < m_end)
                panel_rows_q4k_a8(xq, d, X, wt, panel_bytes, p, sub, sup, ldsc, bias, y, ldy, m_begin, m_end, N, K,
                                  silu_and_mul);
        }
    free(xq), free(d), free(s), free(X);
    return 0;
}
