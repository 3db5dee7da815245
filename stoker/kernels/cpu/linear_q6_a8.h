/*
 * 6-bit weights times 8-bit activations, W6A8 (stoker_linear_q6_a8), included by linear.c after
 * linear_q4_a8.h (its activation quantization q8_quantize_rows and dot4_u8s8; linear.c's tiles
 * and plan_chunks).
 *
 * Why: a GGUF file's LM head (and a Q4_K_M file's "more bits" v and down) is Q6_K: 6.56 bits a
 * weight. Held as int8 codes with a float32 scale per 16 columns (the one-byte panels of
 * stoker_linear_q8) it is 10 bits a weight, and at batch-1 decode of the 4-bit benchmark's model
 * that head was 16.5% of a W4A8 step, streaming 41 MB where llama.cpp streams Q6_K's 27 MB
 * (docs/benchmarks.md, "4-bit weights beside llama.cpp"). These panels hold Q6_K's own bits.
 *
 * Representation: w[k, n] = (q - 32) * sc[k / 16, n] * D[k / 256, n], q in [0, 63] (6 bits),
 * sc int8 per 16 rows of K, D float32 per 256 (Q6_K: q, its sub-scales, its d). Exact for Q6_K.
 *
 * Panel layout (kernels/cpu/linear_q6.py, pack_q6_weight): panel p holds columns [p NR, (p+1) NR);
 * its K rows come in chunks of 16, each 13 NR bytes:
 *   lanes0  NR int32: lane n holds the low 4 bits of rows 16c..16c+7 of column n, nibble i = row i
 *   lanes1  NR int32: rows 16c+8..16c+15, the same way
 *   high    NR int32: lane n's byte i holds the top 2 bits of rows 2i, 2i+1, 8+2i, 8+2i+1 of the
 *           chunk in bits 0-1, 2-3, 4-5, 6-7
 *   sc      NR int8: each column's sub-scale of the chunk
 * so masking a lane's even and odd nibbles to bytes (as linear_q4_a8.h does) and or-ing in the
 * matching 2-bit field at bits 4-5 gives the rows' codes as unsigned bytes, in the order the
 * activations are stored in ([a0 a2 a4 a6 a1 a3 a5 a7] per 8: q8_quantize_rows).
 *
 * Per column n, with a the int8 activations, d[b] their scale per block b of 32 and S16[c] their
 * sum per chunk c of 16:
 *
 *     T[c] = sum_{k in c} q[k] a[k] - 32 S16[c]       (= sum (q - 32) a, exact in int32)
 *     I[b] = T[2b] sc[2b] + T[2b+1] sc[2b+1]          (|I| < 2^25: exact in int32)
 *     A[s] = sum_{b in s} float(I[b]) * d[b]          (mul, then add, b in order)
 *     y    = sum_s A[s] * D[s]                        (s the super-blocks of 256, in order)
 *     y   += bias
 *
 * As in linear_q4_a8.h: the integer sums are exact whichever instructions form them (vpdpbusd,
 * vpmaddubsw + vpmaddwd: pairs 2 * 63 * 127 < 2^15, plain int32 lanes), every float operation
 * is one rounded mul or add in the fixed order above (no FMA: linear.c is built with
 * -ffp-contract=off), so every ISA build gives the same bits, as does the torch twin
 * (reference.linear_packed_q6_a8); a row's result does not depend on M, the other rows or the
 * thread count. K must be a multiple of 256.
 */

#define Q6_CHUNK 16   /* rows of K per sub-scale */
#define Q6_SUPER 256  /* rows of K per super-scale D */
#define Q6_CHUNK_BYTES (13 * NR)


/* S16: the activations' sums per chunk of 16 (M, K / 16), exact, from xq (a chunk is two whole
 * groups of 8, so the interleaved order within them does not change the sum). */
static void q8_chunk_sums(const int8_t *xq, int64_t M, int64_t K, int32_t *s16) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < K / Q6_CHUNK; c++) {
            int32_t sum = 0;
            for (int i = 0; i < Q6_CHUNK; i++) sum += xq[m * K + c * Q6_CHUNK + i];
            s16[m * (K / Q6_CHUNK) + c] = sum;
        }
}

/* y[0:mr, 0:NR] (or NR / 2 with silu) for quantized rows xq[0:mr] (ldq bytes apart; d ldd, s16
 * lds apart) against one whole 6-bit panel wt; D: the panel's super-scales, ldsc apart. No
 * software prefetch, as tile_q4_a8 (it says why): the 4-bit benchmark's Q6_K head took 1.83 ms
 * a step with the next panel prefetched, 1.56 without (1 thread; 0.88 and 0.78 at 2; measured with
 * its panels in huge pages). */
static inline __attribute__((always_inline)) void tile_q6_a8(const int mr, const int silu, const int8_t *restrict xq,
                                                             int64_t ldq, const float *restrict d, int64_t ldd,
                                                             const int32_t *restrict s16, int64_t lds,
                                                             const char *restrict wt, const float *restrict D,
                                                             int64_t ldsc, const float *restrict bias,
                                                             float *restrict y, int64_t ldy, int64_t K) {
    const vi low_nibbles = (vi){0} + 0x0F0F0F0F, top_bits = (vi){0} + 0x30303030;
    vf tot[A8_MR][NV];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < NV; j++) tot[m][j] = (vf){0};
    for (int64_t k0 = 0; k0 < K; k0 += Q6_SUPER) {
        vf acc[A8_MR][NV];
        for (int m = 0; m < mr; m++)
            for (int j = 0; j < NV; j++) acc[m][j] = (vf){0};
        for (int64_t kb = k0; kb < k0 + Q6_SUPER; kb += Q8_BLOCK) {
            vi iacc[A8_MR][NV];
            for (int m = 0; m < mr; m++)
                for (int j = 0; j < NV; j++) iacc[m][j] = (vi){0};
            for (int64_t kc = kb; kc < kb + Q8_BLOCK; kc += Q6_CHUNK) {
                const int64_t c = kc / Q6_CHUNK;
                const char *chunk = wt + c * Q6_CHUNK_BYTES;
                vi e0[A8_MR], o0[A8_MR], e1[A8_MR], o1[A8_MR], init[A8_MR];
                for (int m = 0; m < mr; m++) {
                    int32_t a[4];
                    memcpy(a, xq + m * ldq + kc, 16);
                    e0[m] = (vi){0} + a[0], o0[m] = (vi){0} + a[1], e1[m] = (vi){0} + a[2], o1[m] = (vi){0} + a[3];
                    init[m] = (vi){0} - 32 * s16[m * lds + c];
                }
                for (int j = 0; j < NV; j++) {
                    const vi u0 = *(const viu *)(chunk + 4 * j * VL), u1 = *(const viu *)(chunk + 4 * (NR + j * VL));
                    const vi h = *(const viu *)(chunk + 4 * (2 * NR + j * VL));
                    const vi sc = byte_lanes(chunk + 12 * NR + j * VL, 1); /* signed sub-scales */
                    const vi q_e0 = (u0 & low_nibbles) | ((vi)((vu)h << 4) & top_bits);
                    const vi q_o0 = ((vi)((vu)u0 >> 4) & low_nibbles) | ((vi)((vu)h << 2) & top_bits);
                    const vi q_e1 = (u1 & low_nibbles) | (h & top_bits);
                    const vi q_o1 = ((vi)((vu)u1 >> 4) & low_nibbles) | ((vi)((vu)h >> 2) & top_bits);
                    for (int m = 0; m < mr; m++) {
                        vi t = dot4_u8s8(dot4_u8s8(init[m], q_e0, e0[m]), q_o0, o0[m]);
                        t = dot4_u8s8(dot4_u8s8(t, q_e1, e1[m]), q_o1, o1[m]);
                        iacc[m][j] += t * sc;
                    }
                }
            }
            const int64_t b = kb / Q8_BLOCK;
            for (int m = 0; m < mr; m++) {
                const float db = d[m * ldd + b];
                for (int j = 0; j < NV; j++) acc[m][j] = acc[m][j] + __builtin_convertvector(iacc[m][j], vf) * db;
            }
        }
        for (int j = 0; j < NV; j++) {
            const vf sv = load(D + (k0 / Q6_SUPER) * ldsc + j * VL);
            for (int m = 0; m < mr; m++) tot[m][j] = tot[m][j] + acc[m][j] * sv;
        }
    }
    vf out[MR][NV]; /* store_tile's shape */
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < NV; j++) out[m][j] = tot[m][j];
    store_tile(mr, NV, silu, out, bias, y, ldy);
}

#define Q6A8_TILE_ARGS xq, ldq, d, ldd, s16, lds, wt, D, ldsc, bias, y, ldy, K
static void tile_q6_a8_dispatch(int mr, int silu, const int8_t *xq, int64_t ldq, const float *d, int64_t ldd,
                                const int32_t *s16, int64_t lds, const char *wt, const float *D, int64_t ldsc,
                                const float *bias, float *y, int64_t ldy, int64_t K) {
    if (mr == 1) {
        if (silu) tile_q6_a8(1, 1, Q6A8_TILE_ARGS); else tile_q6_a8(1, 0, Q6A8_TILE_ARGS);
    } else {
        if (silu) tile_q6_a8(A8_MR, 1, Q6A8_TILE_ARGS); else tile_q6_a8(A8_MR, 0, Q6A8_TILE_ARGS);
    }
}

/* Quantized rows [m_begin, m_end) against 6-bit panel p (one task of stoker_linear_q6_a8). */
static void panel_rows_q6_a8(const int8_t *xq, const float *d, const int32_t *s16, const void *wt,
                             int64_t panel_bytes, int64_t p, const float *super_scale,
                             int64_t ldsc, const float *bias, float *y, int64_t ldy, int64_t m_begin, int64_t m_end,
                             int64_t N, int64_t K, int silu) {
    const int64_t n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR, B = K / Q8_BLOCK, C = K / Q6_CHUNK;
    const char *w = (const char *)wt + p * panel_bytes;
    const float *D = super_scale + n0;
    const float *bs = bias != NULL ? bias + n0 : NULL;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += A8_MR) {
        const int mr = (int)(m_end - m0 < A8_MR ? m_end - m0 : A8_MR);
        if (cols == NR) {
            tile_q6_a8_dispatch(mr, silu, xq + m0 * K, K, d + m0 * B, B, s16 + m0 * C, C, w, D, ldsc, bs,
                                y + m0 * ldy + (silu ? n0 / 2 : n0), ldy, K);
            continue;
        }
        /* the last, partial panel (never with silu): computed whole (zero-padded columns), the
         * first `cols` copied out, as in panel_rows_q4_a8 */
        float part[A8_MR * NR];
        tile_q6_a8_dispatch(mr, 0, xq + m0 * K, K, d + m0 * B, B, s16 + m0 * C, C, w, D, ldsc, bs, part, NR, K);
        for (int m = 0; m < mr; m++) memcpy(y + (m0 + m) * ldy + n0, part + m * NR, sizeof(float) * cols);
    }
}

/* y (M, N) = x (M, K) @ W^T (+ bias) for W in 6-bit panels (panel_bytes = K / 16 * 13 NR each)
 * with super_scale (K / 256, ldsc) float32 in panel column order; silu_and_mul as
 * stoker_linear_f32. Returns 0; 1 when a buffer could not be allocated (y is then untouched); 2
 * when K is not a multiple of 256 or panel_bytes does not match it. */
int stoker_linear_q6_a8(const float *x, int64_t ldx, const void *wt, int64_t panel_bytes, const float *super_scale,
                        int64_t ldsc, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                        int silu_and_mul, int num_threads) {
    if (K <= 0 || K % Q6_SUPER || panel_bytes != K / Q6_CHUNK * Q6_CHUNK_BYTES) return 2;
    const int64_t num_panels = (N + NR - 1) / NR, B = K / Q8_BLOCK, C = K / Q6_CHUNK;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *d = (float *)malloc(sizeof(float) * (size_t)(M * B));
    int32_t *s = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * B));
    int32_t *s16 = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * C));
    if (xq == NULL || d == NULL || s == NULL || s16 == NULL) {
        free(xq), free(d), free(s), free(s16);
        return 1;
    }
    q8_quantize_rows(x, ldx, M, K, xq, d, s);
    q8_chunk_sums(xq, M, K, s16);
    int64_t chunk_rows, num_chunks;
    plan_chunks(M, K, num_panels, num_threads, &chunk_rows, &num_chunks);
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(2)
    for (int64_t chunk = 0; chunk < num_chunks; chunk++)
        for (int64_t p = 0; p < num_panels; p++) {
            const int64_t m_begin = chunk * chunk_rows;
            const int64_t m_end = (chunk + 1) * chunk_rows < M ? (chunk + 1) * chunk_rows : M;
            if (m_begin < m_end)
                panel_rows_q6_a8(xq, d, s16, wt, panel_bytes, p, super_scale, ldsc, bias, y, ldy, m_begin,
                                 m_end, N, K, silu_and_mul);
        }
    free(xq), free(d), free(s), free(s16);
    return 0;
}
