/*
 * 4-bit weights times 8-bit activations, W4A8 (stoker_linear_q4_a8), included by linear.c after
 * linear_q4.h (its panels, scales, offsets and load_scale; linear.c's tiles and plan_chunks).
 *
 * Why: batch-1 decode through stoker_linear_q4 (W4A16) is bound by the float work per weight
 * (a shift, a permute and an FMA for every 16 weights), not by the 0.56 bytes a weight it
 * reads. llama.cpp's Q4_0 path instead quantizes the activations to int8 in blocks of 32
 * (its Q8_0) and multiplies 4-bit by 8-bit integers, 64 products to an instruction; this is
 * that method on Stoker's own panels (the same bytes as W4A16: no second copy of the weights).
 *
 * Activations (q8_quantize_rows, once per call, before the tiles): per row m and block b of 32
 * columns of K, d = amax|x| * (1 / 127), a = rint(x / d) as x * (1 / d) in [-127, 127] (0 when
 * amax is 0), S = sum of a. Stored per block of 8 as [a0 a2 a4 a6 a1 a3 a5 a7]: a lane of the
 * panel holds rows 8i..8i+7 of its column as nibbles 0..7 (linear_q4.h), so its even and odd
 * nibbles, masked to bytes, meet the activations as two 4-byte dot products.
 *
 * Per column n, with q in [0, 15] the weight codes (the panel's q ^ 8, xor 8 again):
 *
 *     I[b] = sum_{k in b} q[k] a[k] - 8 S[b]   (= sum (q - 8) a, exact in int32)
 *     A[g] = sum_{b in g} float(I[b]) * d[b]   (mul, then add, b in order)
 *     y    = sum_g A[g] * s[g] + o'[g] * X[g]  (g in order; X[g] = sum_{b in g} d[b] * S[b])
 *     y   += bias
 *
 * The integer sums are exact whichever instructions form them: vpdpbusd (AVX-512 VNNI),
 * vpmaddubsw + vpmaddwd (AVX-512BW, AVX2: pairs 2 * 15 * 127 < 2^15, no saturation), plain
 * int32 lanes (SSE2). Every float operation is a separately rounded mul or add in the fixed
 * order above (linear.c is built with -ffp-contract=off, no FMA here), so every ISA build,
 * SSE2 included, gives the same bits, and so does the torch twin (reference.linear_packed_q4_a8);
 * a row's result does not depend on M, the other rows or the thread count. group_k must be a
 * multiple of 32 (an activation block never straddles two weight groups).
 */

#define Q8_BLOCK 32
/* Rows per W4A8 tile: tot, A and the int32 sums of each row stay in registers (3 NV vectors a
 * row of the 32 zmm; AVX2 has 16 ymm: one row). */
#if defined(__AVX512F__)
#define A8_MR 2
#else
#define A8_MR 1
#endif

/* acc + the 4-byte dot products of unsigned bytes w (each < 16) and signed bytes a, per lane. */
static inline vi dot4_u8s8(vi acc, vi w, vi a) {
#if defined(__AVX512VNNI__)
    return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)a);
#elif defined(__AVX512BW__)
    const __m512i pairs = _mm512_maddubs_epi16((__m512i)w, (__m512i)a);
    return acc + (vi)_mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
#elif defined(__AVX2__) && !defined(__AVX512F__)
    const __m256i pairs = _mm256_maddubs_epi16((__m256i)w, (__m256i)a);
    return acc + (vi)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#else
    for (int t = 0; t < 4; t++) acc += ((w >> (8 * t)) & 0xFF) * ((a << (24 - 8 * t)) >> 24); /* a: sign-extended */
    return acc;
#endif
}

/* VL bytes at p widened to int32 lanes: sign-extended (is_signed, a constant at each call) or
 * zero-extended; one vpmovsxbd / vpmovzxbd (gcc's generic conversion of a byte vector went
 * through scalar registers). The W6A8 and Q4_K kernels' per-column sub-scales. */
static inline vi byte_lanes(const void *p, const int is_signed) {
#if defined(__AVX512F__)
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return (vi)(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return (vi)(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
    vi out;
    for (int l = 0; l < VL; l++) out[l] = is_signed ? ((const int8_t *)p)[l] : ((const uint8_t *)p)[l];
    return out;
#endif
}

/* isum[m][j] += the int8 rows xq[m] (ldq apart) . the 4-bit codes q of 8 rows of K from kb (one
 * block of a panel at w: NR int32 lanes of nibbles, q ^ 8), per column lane: two 4-byte dot
 * products per vector, the even rows' nibbles against the even activations, then the odd. */
static inline __attribute__((always_inline)) void q4_a8_rows8(const int mr, vi isum[A8_MR][NV],
                                                               const int8_t *restrict xq, int64_t ldq,
                                                               const int32_t *restrict w, int64_t kb) {
    const vi low_nibbles = (vi){0} + 0x0F0F0F0F, flip = (vi){0} + (int32_t)0x88888888;
    vi even[A8_MR], odd[A8_MR];
    for (int m = 0; m < mr; m++) {
        int32_t e, o;
        memcpy(&e, xq + m * ldq + kb, 4);
        memcpy(&o, xq + m * ldq + kb + 4, 4);
        even[m] = (vi){0} + e;
        odd[m] = (vi){0} + o;
    }
    for (int j = 0; j < NV; j++) {
        const vi u = *(const viu *)(w + j * VL) ^ flip; /* nibbles q in [0, 15] */
        const vi lo = u & low_nibbles, hi = (vi)((vu)u >> 4) & low_nibbles;
        for (int m = 0; m < mr; m++) isum[m][j] = dot4_u8s8(dot4_u8s8(isum[m][j], lo, even[m]), hi, odd[m]);
    }
}

/* Rows x[0:M] -> xq (M, K) int8 in the per-8 interleaved order above, d (M, K / 32) and
 * S (M, K / 32). One fixed sequence of IEEE operations per value (no sums of floats): the
 * block's amax (exact in any order), scale = amax * (1 / 127), inv = 1 / scale, and per value
 * rint(x * inv) clamped to [-127, 127]. The AVX-512 path does the same operations 16 lanes at a
 * time (roundscale to nearest-even is rintf's default rounding), so every build gives the same
 * bytes; it matters for batch-1 decode, where this runs once per projection (112 times a step of
 * the 4-bit benchmark's model) and the scalar loop was ~1.5 us per 1024 columns. */
static void q8_quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *xq, float *d, int32_t *s) {
    const int64_t B = K / Q8_BLOCK;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < B; b++) {
            const float *xb = x + m * ldx + b * Q8_BLOCK;
            int8_t *qb = xq + m * K + b * Q8_BLOCK;
#if defined(__AVX512F__)
            const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
#else
            float amax = 0.0f;
            for (int i = 0; i < Q8_BLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
#endif
            const float scale = amax * (1.0f / 127.0f);
            const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
#if defined(__AVX512F__)
            const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
            const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            const __m512i i0 = _mm512_cvtps_epi32(
                _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(v0, vinv), round), lo), hi));
            const __m512i i1 = _mm512_cvtps_epi32(
                _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(v1, vinv), round), lo), hi));
            /* each group of 8 as [a0 a2 a4 a6 a1 a3 a5 a7] */
            const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
            _mm_storeu_si128((__m128i *)qb, _mm_shuffle_epi8(_mm512_cvtepi32_epi8(i0), order));
            _mm_storeu_si128((__m128i *)(qb + 16), _mm_shuffle_epi8(_mm512_cvtepi32_epi8(i1), order));
            const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#else
            int32_t sum = 0;
            for (int i = 0; i < Q8_BLOCK; i++) {
                const float r = fminf(fmaxf(rintf(xb[i] * inv), -127.0f), 127.0f);
                const int8_t a = (int8_t)r;
                qb[(i & ~7) + ((i & 1) ? 4 : 0) + ((i & 7) >> 1)] = a;
                sum += a;
            }
#endif
            d[m * B + b] = scale;
            s[m * B + b] = sum;
        }
}

/* y[0:mr, 0:NR] (or NR / 2 with silu) for quantized rows xq[0:mr] (ldq bytes apart; d and s
 * ldd apart; xg: X[g] per row, ldxg apart, or NULL without offsets) against one whole 4-bit
 * panel wt; sc / off / ldsc as in tile_q4.
 * No software prefetch: the panel is read front to back, which the hardware prefetchers follow.
 * Prefetching the next panel into L1 while this one streams, 4 lines per 8 rows (a 32 KB panel
 * at K = 1024, L1's size), evicted the lines being read: batch-1 decode of the 4-bit benchmark's
 * Q4_0 file, W4A8, one call a step, went from 71.2 to 82.2 tokens/s at 1 thread without it, and
 * from 103.7 to 112.8 at 2 (medians of 5 interleaved runs, 2-vCPU Zen 4 VM; docs/benchmarks.md,
 * "4-bit weights beside llama.cpp"). Nor within the panel: tile_q4's 12 prefetches per 8 rows
 * cost a quarter of this kernel's time. */
static inline __attribute__((always_inline)) void tile_q4_a8(const int mr, const int silu, const int8_t *restrict xq,
                                                             int64_t ldq, const float *restrict d,
                                                             const int32_t *restrict s, int64_t ldd,
                                                             const float *restrict xg, int64_t ldxg,
                                                             const void *restrict wt, const void *restrict sc,
                                                             int sc_f16, const float *restrict off, int64_t ldsc,
                                                             int64_t group_k, const float *restrict bias,
                                                             float *restrict y, int64_t ldy, int64_t K) {
    vf tot[A8_MR][NV];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < NV; j++) tot[m][j] = (vf){0};
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += group_k, g++) {
        vf acc[A8_MR][NV];
        for (int m = 0; m < mr; m++)
            for (int j = 0; j < NV; j++) acc[m][j] = (vf){0};
        for (int64_t k1 = k0; k1 < k0 + group_k; k1 += Q8_BLOCK) {
            vi isum[A8_MR][NV];
            for (int m = 0; m < mr; m++)
                for (int j = 0; j < NV; j++) isum[m][j] = (vi){0};
            for (int64_t kb = k1; kb < k1 + Q8_BLOCK; kb += 8)
                q4_a8_rows8(mr, isum, xq, ldq, (const int32_t *)wt + kb / 8 * NR, kb);
            const int64_t b = k1 / Q8_BLOCK;
            for (int m = 0; m < mr; m++) {
                const int32_t corr = 8 * s[m * ldd + b];
                const float db = d[m * ldd + b];
                for (int j = 0; j < NV; j++) acc[m][j] = acc[m][j] + __builtin_convertvector(isum[m][j] - corr, vf) * db;
            }
        }
        for (int j = 0; j < NV; j++) {
            const vf sv = load_scale(sc, sc_f16, g * ldsc + j * VL);
            for (int m = 0; m < mr; m++) tot[m][j] = tot[m][j] + acc[m][j] * sv;
        }
        if (off != NULL)
            for (int j = 0; j < NV; j++) {
                const vf o = load(off + g * ldsc + j * VL);
                for (int m = 0; m < mr; m++) tot[m][j] = tot[m][j] + o * xg[m * ldxg + g];
            }
    }
    vf out[MR][NV]; /* store_tile's shape */
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < NV; j++) out[m][j] = tot[m][j];
    store_tile(mr, NV, silu, out, bias, y, ldy);
}

#define Q4A8_TILE_ARGS xq, ldq, d, s, ldd, xg, ldxg, wt, sc, sc_f16, off, ldsc, group_k, bias, y, ldy, K
static void tile_q4_a8_dispatch(int mr, int silu, const int8_t *xq, int64_t ldq, const float *d, const int32_t *s,
                                int64_t ldd, const float *xg, int64_t ldxg, const void *wt, const void *sc, int sc_f16,
                                const float *off, int64_t ldsc, int64_t group_k, const float *bias, float *y,
                                int64_t ldy, int64_t K) {
    if (mr == 1) {
        if (silu) tile_q4_a8(1, 1, Q4A8_TILE_ARGS); else tile_q4_a8(1, 0, Q4A8_TILE_ARGS);
    } else {
        if (silu) tile_q4_a8(A8_MR, 1, Q4A8_TILE_ARGS); else tile_q4_a8(A8_MR, 0, Q4A8_TILE_ARGS);
    }
}

/* Quantized rows [m_begin, m_end) against 4-bit panel p (one task of stoker_linear_q4_a8). */
static void panel_rows_q4_a8(const int8_t *xq, const float *d, const int32_t *s, const float *xg, int64_t G,
                             const void *wt, int64_t panel_bytes, int64_t p, const void *scale,
                             int sc_f16, const float *offset, int64_t ldsc, int64_t group_k, const float *bias,
                             float *y, int64_t ldy, int64_t m_begin, int64_t m_end, int64_t N, int64_t K, int silu) {
    const int64_t n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR, B = K / Q8_BLOCK;
    const char *w = (const char *)wt + p * panel_bytes;
    const void *sc = (const char *)scale + n0 * (sc_f16 ? 2 : 4);
    const float *off = offset != NULL ? offset + n0 : NULL;
    const float *bs = bias != NULL ? bias + n0 : NULL;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += A8_MR) {
        const int mr = (int)(m_end - m0 < A8_MR ? m_end - m0 : A8_MR);
        const float *xgm = xg != NULL ? xg + m0 * G : NULL;
        if (cols == NR) {
            tile_q4_a8_dispatch(mr, silu, xq + m0 * K, K, d + m0 * B, s + m0 * B, B, xgm, G, w, sc, sc_f16, off, ldsc,
                                group_k, bs, y + m0 * ldy + (silu ? n0 / 2 : n0), ldy, K);
            continue;
        }
        /* the last, partial panel (never with silu): computed whole (zero-padded columns), the
         * first `cols` copied out, as in panel_rows_q4 */
        float part[A8_MR * NR];
        tile_q4_a8_dispatch(mr, 0, xq + m0 * K, K, d + m0 * B, s + m0 * B, B, xgm, G, w, sc, sc_f16, off, ldsc,
                            group_k, bs, part, NR, K);
        for (int m = 0; m < mr; m++) memcpy(y + (m0 + m) * ldy + n0, part + m * NR, sizeof(float) * cols);
    }
}

/* As stoker_linear_q4 (the same panels, scales, offsets, bias and y), with the activations
 * quantized to int8 per block of 32 (see the header). group_k: a multiple of 32 dividing K.
 * Returns 0; 1 when a buffer could not be allocated (y is then untouched); 2 for a bad group. */
int stoker_linear_q4_a8(const float *x, int64_t ldx, const void *wt, int64_t panel_bytes, const void *scale,
                        int scale_f16, const float *offset, int64_t ldsc, int64_t group_k, const float *bias, float *y,
                        int64_t ldy, int64_t M, int64_t N, int64_t K, int silu_and_mul, int num_threads) {
    if (group_k <= 0 || group_k % Q8_BLOCK || K % group_k) return 2;
    const int64_t num_panels = (N + NR - 1) / NR, G = K / group_k, B = K / Q8_BLOCK;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *d = (float *)malloc(sizeof(float) * (size_t)(M * B));
    int32_t *s = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * B));
    float *xg = offset != NULL ? (float *)malloc(sizeof(float) * (size_t)(M * G)) : NULL;
    if (xq == NULL || d == NULL || s == NULL || (offset != NULL && xg == NULL)) {
        free(xq), free(d), free(s), free(xg);
        return 1;
    }
    q8_quantize_rows(x, ldx, M, K, xq, d, s);
    if (xg != NULL) /* X[m, g] = sum over the group's blocks of d * S, in order (mul, then add) */
        for (int64_t m = 0; m < M; m++)
            for (int64_t g = 0; g < G; g++) {
                float acc = 0.0f;
                for (int64_t b = g * group_k / Q8_BLOCK; b < (g + 1) * group_k / Q8_BLOCK; b++)
                    acc = acc + d[m * B + b] * (float)s[m * B + b];
                xg[m * G + g] = acc;
            }
    int64_t chunk_rows, num_chunks;
    plan_chunks(M, K, num_panels, num_threads, &chunk_rows, &num_chunks);
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(2)
    for (int64_t chunk = 0; chunk < num_chunks; chunk++)
        for (int64_t p = 0; p < num_panels; p++) {
            const int64_t m_begin = chunk * chunk_rows;
            const int64_t m_end = (chunk + 1) * chunk_rows < M ? (chunk + 1) * chunk_rows : M;
            if (m_begin < m_end)
                panel_rows_q4_a8(xq, d, s, xg, G, wt, panel_bytes, p, scale, scale_f16, offset, ldsc,
                                 group_k, bias, y, ldy, m_begin, m_end, N, K, silu_and_mul);
        }
    free(xq), free(d), free(s), free(xg);
    return 0;
}
