/*
 * 4-bit weights (stoker_linear_q4), included by linear.c (its tile sizes, vector types, madd,
 * store_tile, thread_buffer and plan_chunks).
 *
 * Representation (quantization/int4.py): w = q * s + o per column and group of group_k rows of
 * K, q in [0, 15]. The kernel computes the same product regrouped,
 *
 *     y[n] = sum_g ( s[g, n] * A[g, n] + o'[g, n] * X[g] ),
 *     A[g, n] = sum_{k in g} x[k] * (q[k, n] - 8),   X[g] = sum_{k in g} x[k],   o' = o + 8 s,
 *
 * so the weights are never dequantized: each code is converted to a float in [-8, 7] (exact)
 * and multiply-added straight into A, and the scale and offset enter once per group. Why:
 * batch-1 decode of a ~0.4B Llama was bound by the per-weight work of w = q * s + o (widen,
 * mask, convert, multiply, add, then the FMA: ~22 instructions per 64 weights), not by memory
 * (docs/benchmarks.md, the 4-bit section); here it is one shift, one permute (AVX-512; shift,
 * shift, convert elsewhere) and the FMA. For symmetric weights o' = 0 (o = -8 s exactly) and
 * the offsets are not stored at all (offset NULL); scales that are exact in float16 (GGUF's,
 * most checkpoints') are stored as float16 (scale_f16): 4.5 bits a weight in all, Q4_0's size.
 *
 * Panel layout (kernels/cpu/linear.py, pack_q4_weight): panel p holds columns [p NR, (p+1) NR);
 * its K rows come in blocks of 8, and block b is NR int32s, lane n holding rows 8b..8b+7 of
 * column n in nibbles 0..7, each as (q ^ 8) = the 4-bit two's complement of q - 8. One vector
 * load gives 8 rows of VL columns; nibble i is (lane >> 4i) sign-extended from 4 bits.
 *
 * Every sum runs in one fixed order: A over k in order with one FMA per weight, then
 * tot = fma(A, s, tot), tot = fma(o', X, tot) group by group, then + bias; X[g] is summed in
 * order by scalar adds before the tiles run (q4_group_sums). Neither depends on M, the other
 * rows, the thread count, or the ISA's vector width (a column is the same lane arithmetic in
 * a whole panel or in the zero-padded last one), so every FMA build (AVX2, AVX-512) gives the
 * same bits, and the SSE2 build (mul + add) agrees within float rounding
 * (tests/kernels/test_cpu_linear_q4.py, test_cpu_isa.py). At larger M the codes of a panel are
 * converted once into a per-thread float buffer and the tiles read them from there: the same
 * values, so the same results.
 */

typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef int32_t viu __attribute__((vector_size(VL * 4), aligned(4), may_alias));

/* Blocks of 8 rows ahead to prefetch within a panel (4 NR bytes each). */
#define Q4_PREFETCH_BLOCKS 2

/* Nibble i of each lane of v, a 4-bit two's complement code, as floats in [-8, 7]. */
static inline vf q4_nibble(vi v, const int i) {
#if defined(__AVX512F__)
    /* vpermps reads the low 4 bits of each index: one shift (none for i = 0) and one permute */
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    const vi idx = i ? (vi)((vu)v >> (4 * i)) : v;
    return (vf)_mm512_permutexvar_ps((__m512i)idx, table);
#else
    const vi sext = i == 7 ? v >> 28 : (v << (28 - 4 * i)) >> 28; /* arithmetic: sign-extends */
    return __builtin_convertvector(sext, vf);
#endif
}

/* acc + b * c, vectors: one rounding where the ISA has FMA, two where it has not. */
static inline vf vmadd(vf acc, vf b, vf c) {
#if defined(__AVX512F__)
    return _mm512_fmadd_ps(b, c, acc);
#elif defined(__FMA__)
    return _mm256_fmadd_ps(b, c, acc);
#else
    return acc + b * c;
#endif
}

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__F16C__))
/* float16 bits -> float (exact), for builds without F16C. */
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    float v;
    if (exp == 0)
        v = ldexpf((float)man, -24); /* zero and subnormals */
    else if (exp == 31)
        v = man ? NAN : INFINITY;
    else
        v = ldexpf((float)(man | 0x400), (int)exp - 25);
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits |= sign;
    memcpy(&v, &bits, 4);
    return v;
}
#endif

/* VL scales at element i of sc: float16 (f16) or float32. */
static inline vf load_scale(const void *sc, int f16, int64_t i) {
    if (!f16) return load((const float *)sc + i);
    const uint16_t *h = (const uint16_t *)sc + i;
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#elif defined(__AVX2__) && defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#else
    float f[VL];
    for (int l = 0; l < VL; l++) f[l] = half_to_float(h[l]);
    return load(f);
#endif
}

/* y[0:mr, 0:NR] (or NR / 2 with silu) for rows x[0:mr] against one whole 4-bit panel: codes at
 * wt (panel layout above), or, codes_f32, already converted to floats at wt, (K, NR) row-major.
 * sc / off: the panel's scale and offset rows (ldsc apart; off NULL: all zero); xsum: X[g] of
 * each row, ldxs apart. Rows Q4_PREFETCH_BLOCKS ahead within the panel are prefetched; the next
 * panel is not (as tile_q4_a8, which says why): batch-1 decode of the 4-bit benchmark's Q4_0
 * file, W4A16, 52.9 -> 58.2 tokens/s at 1 thread and 83.4 -> 95.9 at 2 without it; at batch 8
 * it made no difference (25.0 / 25.2 steps/s). */
static inline __attribute__((always_inline)) void tile_q4(const int mr, const int silu, const int codes_f32,
                                                          const float *restrict x, int64_t ldx, const void *restrict wt,
                                                          const void *restrict sc, int sc_f16,
                                                          const float *restrict off, int64_t ldsc, int64_t group_k,
                                                          const float *restrict xsum, int64_t ldxs,
                                                          const float *restrict bias, float *restrict y, int64_t ldy,
                                                          int64_t K) {
    vf tot[MR][NV];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < NV; j++) tot[m][j] = (vf){0};
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += group_k, g++) {
        vf acc[MR][NV];
        for (int m = 0; m < mr; m++)
            for (int j = 0; j < NV; j++) acc[m][j] = (vf){0};
        for (int64_t kb = k0; kb < k0 + group_k; kb += 8) {
            if (codes_f32) {
                const float *w = (const float *)wt + kb * NR;
                for (int i = 0; i < 8; i++)
                    for (int j = 0; j < NV; j++) {
                        const vf b = load(w + i * NR + j * VL);
                        for (int m = 0; m < mr; m++) acc[m][j] = madd(acc[m][j], b, x[m * ldx + kb + i]);
                    }
                continue;
            }
            const int32_t *w = (const int32_t *)wt + kb / 8 * NR;
            for (int ofs = 0; ofs < NR * 4; ofs += 64)
                __builtin_prefetch((const char *)(w + Q4_PREFETCH_BLOCKS * NR) + ofs, 0, 3);
            vi v[NV];
            for (int j = 0; j < NV; j++) v[j] = *(const viu *)(w + j * VL);
            for (int i = 0; i < 8; i++)
                for (int j = 0; j < NV; j++) {
                    const vf b = q4_nibble(v[j], i);
                    for (int m = 0; m < mr; m++) acc[m][j] = madd(acc[m][j], b, x[m * ldx + kb + i]);
                }
        }
        for (int j = 0; j < NV; j++) {
            const vf s = load_scale(sc, sc_f16, g * ldsc + j * VL);
            for (int m = 0; m < mr; m++) tot[m][j] = vmadd(tot[m][j], acc[m][j], s);
        }
        if (off != NULL)
            for (int j = 0; j < NV; j++) {
                const vf o = load(off + g * ldsc + j * VL);
                for (int m = 0; m < mr; m++) tot[m][j] = madd(tot[m][j], o, xsum[m * ldxs + g]);
            }
    }
    store_tile(mr, NV, silu, tot, bias, y, ldy);
}

#define Q4_TILE_ARGS x, ldx, wt, sc, sc_f16, off, ldsc, group_k, xsum, ldxs, bias, y, ldy, K
#define Q4_TILE_CASES(SILU, F32)                                             \
    switch (mr) {                                                            \
    case 1: tile_q4(1, SILU, F32, Q4_TILE_ARGS); break;                      \
    case 2: tile_q4(2, SILU, F32, Q4_TILE_ARGS); break;                      \
    case 3: tile_q4(3, SILU, F32, Q4_TILE_ARGS); break;                      \
    case 4: tile_q4(MR >= 4 ? 4 : 1, SILU, F32, Q4_TILE_ARGS); break;        \
    case 5: tile_q4(MR >= 5 ? 5 : 1, SILU, F32, Q4_TILE_ARGS); break;        \
    default: tile_q4(MR >= 6 ? 6 : 1, SILU, F32, Q4_TILE_ARGS); break;       \
    }

static void tile_q4_dispatch(int mr, int silu, int codes_f32, const float *x, int64_t ldx, const void *wt,
                             const void *sc, int sc_f16, const float *off, int64_t ldsc, int64_t group_k,
                             const float *xsum, int64_t ldxs, const float *bias, float *y, int64_t ldy, int64_t K) {
    if (codes_f32) {
        if (silu) Q4_TILE_CASES(1, 1) else Q4_TILE_CASES(0, 1)
    } else {
        if (silu) Q4_TILE_CASES(1, 0) else Q4_TILE_CASES(0, 0)
    }
}

/* Rows [m_begin, m_end) of x against 4-bit panel p (one task of stoker_linear_q4). Returns 1
 * when the per-thread buffer could not be allocated, else 0. */
static int panel_rows_q4(const float *x, int64_t ldx, const void *wt, int64_t panel_bytes, int64_t p,
                         const void *scale, int sc_f16, const float *offset, int64_t ldsc, int64_t group_k,
                         const float *xsum, int64_t ldxs, const float *bias, float *y, int64_t ldy, int64_t m_begin,
                         int64_t m_end, int64_t N, int64_t K, int silu) {
    const int64_t n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR;
    const char *w = (const char *)wt + p * panel_bytes;
    const void *sc = (const char *)scale + n0 * (sc_f16 ? 2 : 4);
    const float *off = offset != NULL ? offset + n0 : NULL;
    const float *b = bias != NULL ? bias + n0 : NULL;
    const int64_t num_tiles = (m_end - m_begin + MR - 1) / MR;
    const void *tile_w = w;
    const int codes_f32 = num_tiles >= DEQUANT_MIN_TILES;
    if (codes_f32) { /* convert the codes once: buf (K, NR) floats in [-8, 7], the values the tiles make */
        float *buf = thread_buffer((size_t)(K * NR));
        if (buf == NULL) return 1;
        for (int64_t kb = 0; kb < K; kb += 8)
            for (int j = 0; j < NV; j++) {
                const vi v = *(const viu *)((const int32_t *)w + kb / 8 * NR + j * VL);
                for (int i = 0; i < 8; i++) store(buf + (kb + i) * NR + j * VL, q4_nibble(v, i));
            }
        tile_w = buf;
    }
    for (int64_t m0 = m_begin; m0 < m_end; m0 += MR) {
        const int mr = (int)(m_end - m0 < MR ? m_end - m0 : MR);
        const float *xs = xsum != NULL ? xsum + m0 * ldxs : NULL;
        if (cols == NR) {
            tile_q4_dispatch(mr, silu, codes_f32, x + m0 * ldx, ldx, tile_w, sc, sc_f16, off, ldsc, group_k, xs, ldxs, b,
                             y + m0 * ldy + (silu ? n0 / 2 : n0), ldy, K);
            continue;
        }
        /* the last, partial panel (never with silu): zero-padded columns, computed whole into
         * a scratch tile, the first `cols` copied out: each column's arithmetic is the same */
        float part[MR * NR];
        tile_q4_dispatch(mr, 0, codes_f32, x + m0 * ldx, ldx, tile_w, sc, sc_f16, off, ldsc, group_k, xs, ldxs, b, part,
                         NR, K);
        for (int m = 0; m < mr; m++) memcpy(y + (m0 + m) * ldy + n0, part + m * NR, sizeof(float) * cols);
    }
    return 0;
}

/* X[m, g] = sum of x[m, k] over group g, in order (scalar adds: the same on every build). */
static void q4_group_sums(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t group_k, float *xsum) {
    const int64_t G = K / group_k;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float s = 0.0f;
            for (int64_t k = g * group_k; k < (g + 1) * group_k; k++) s += x[m * ldx + k];
            xsum[m * G + g] = s;
        }
}

/* x (M, K) row stride ldx; wt: the 4-bit panels (layout above), panel_bytes = K * NR / 2 apart;
 * scale (K / group_k, ldsc) float16 (scale_f16) or float32, offset the same in float32 holding
 * o' = o + 8 s, or NULL when all zero; bias (P * NR,) in panel order or NULL; y (M, N) row
 * stride ldy (silu_and_mul: as stoker_linear_f32). group_k a multiple of 8 dividing K.
 * Returns 0; 1 when a buffer could not be allocated (y is then incomplete); 2 for a bad group. */
int stoker_linear_q4(const float *x, int64_t ldx, const void *wt, int64_t panel_bytes, const void *scale, int scale_f16,
                     const float *offset, int64_t ldsc, int64_t group_k, const float *bias, float *y, int64_t ldy,
                     int64_t M, int64_t N, int64_t K, int silu_and_mul, int num_threads) {
    if (group_k <= 0 || group_k % 8 || K % group_k) return 2;
    const int64_t num_panels = (N + NR - 1) / NR, G = K / group_k;
    float *xsum = NULL;
    if (offset != NULL) {
        xsum = (float *)malloc(sizeof(float) * (size_t)(M * G));
        if (xsum == NULL) return 1;
        q4_group_sums(x, ldx, M, K, group_k, xsum);
    }
    int64_t chunk_rows, num_chunks;
    plan_chunks(M, K, num_panels, num_threads, &chunk_rows, &num_chunks);
    int failed = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(2) reduction(| : failed)
    for (int64_t chunk = 0; chunk < num_chunks; chunk++)
        for (int64_t p = 0; p < num_panels; p++) {
            const int64_t m_begin = chunk * chunk_rows;
            const int64_t m_end = (chunk + 1) * chunk_rows < M ? (chunk + 1) * chunk_rows : M;
            failed |= panel_rows_q4(x, ldx, wt, panel_bytes, p, scale, scale_f16, offset, ldsc, group_k,
                                    xsum, G, bias, y, ldy, m_begin, m_end, N, K, silu_and_mul);
        }
    free(xsum);
    return failed;
}
