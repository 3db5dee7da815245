/*
 * A decode step's Llama-family decoder layers for CPU float32, in one call (stoker_decoder_decode_f32):
 * every sequence has one new token, and for each layer
 *
 *   h        = RMSNorm(x + res), res = x + res      (T, hidden)  elementwise.c (layer 0: no add)
 *   qkv      = h Wqkv^T (+ bias)                    (T, (H + 2 Hkv) D)
 *   q, k     = RMSNorm per head (Qwen3's q_norm / k_norm, when given), then rotary
 *   cache    <- k, v at slot_mapping                                  store_kvcache.c
 *   a        = paged decode attention over each sequence's context    paged_decode_attention.c
 *   x        = a Wo^T (+ bias)
 *   h        = RMSNorm(x + res), res = x + res
 *   x        = (silu(h Wg^T) * (h Wu^T)) Wd^T       the [gate; up] panels' fused epilogue, or
 *                                                   stoker_silu_and_mul_f32 after an unfused one
 *
 * leaving x and res for the model's final norm (x + res, normalised, in Python).
 *
 * Why one call: through Python a decode layer of the ~0.4B Llama of the 4-bit benchmark is
 * 4 projections and ~8 small kernels, each a ctypes call, tensor objects and a few checks:
 * ~2 ms of a ~20 ms batch-1 step (docs/benchmarks.md, "4-bit weights beside llama.cpp"), and
 * between the calls the weight streams lose their prefetch. Here the layers run back to back
 * with the GIL released.
 *
 * The same bits as the module path (models/llama.py through kernels/cpu's Python entry points):
 * every stage is the same C function with the same arguments and the same thread count (the row
 * kernels' single-thread threshold is rows.h's, as common.py's _PARALLEL_MIN_ELEMENTS).
 * tests/model/test_cpu_fused_decode.py compares logprobs bit for bit.
 *
 * Each run of a projection is described by LINEAR_SLOTS int64s (decoder_layer.py builds them from
 * the layer's weight method): kind (0 float32 panels, 1 one-byte panels, 2 4-bit W4A16, 3 4-bit
 * W4A8, 4 6-bit W6A8: its scales are the super-scales, 5 Q4_K W4A8: its scales the sub-scales, its
 * offsets the super-scales), the panels, their ldw (float32 / one-byte: NR; 4-bit: bytes a panel), the panel stride
 * (float32 / one-byte), fmt (one-byte: 1 int8, 2 FP8; 4-bit: scales are float16), scales, 4-bit
 * offsets, ldsc, group_k, bias, N, K, whether the kernel writes silu(gate) * up itself, and
 * where its columns go in the projection's output (first column, row stride). A layer is
 * LAYER_SLOTS int64s: the two norms' weights, q_norm and k_norm (0: none), the K and V caches,
 * the sliding window (0: none), then qkv, o, gate_up and down, MAX_PARTS runs each.
 */
#include <stdint.h>

#include "rows.h"
#include <stdlib.h>

void stoker_rms_norm_f32(const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
                         const float *weight, float *out, float *residual_out, int64_t num_rows, int64_t hidden,
                         float eps, int num_threads);
void stoker_silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t num_rows, int64_t d,
                             int num_threads);
int stoker_rotary_f32(const int64_t *positions, const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                      const float *cos_sin, int64_t max_position, float *q_out, float *k_out, int64_t num_rows,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rot_dim, int num_threads);
int64_t stoker_store_kvcache_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                                 float *k_cache, float *v_cache, const int64_t *slots, int64_t num_tokens,
                                 int64_t row, int64_t num_slots, int num_threads);
int stoker_paged_decode_attention_f32(const float *query, const float *k_cache, const float *v_cache,
                                      int64_t num_blocks, const int32_t *block_tables, int64_t max_blocks,
                                      const int32_t *context_lens, float *out, int64_t num_seqs,
                                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                      int64_t block_size, float scale, int64_t sliding_window, int num_threads,
                                      const float *sinks, float soft_cap);
void stoker_linear_f32(const float *x, int64_t ldx, const float *wt, int64_t ldw, int64_t panel_stride,
                       const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int silu_and_mul,
                       int num_threads);
int stoker_linear_q8(const float *x, int64_t ldx, const void *wt, int64_t ldw, int64_t panel_stride, int fmt,
                     const float *scale, int64_t ldsc, int64_t group_k, const float *bias, float *y, int64_t ldy,
                     int64_t M, int64_t N, int64_t K, int silu_and_mul, int num_threads);
int stoker_linear_q4(const float *x, int64_t ldx, const void *wt, int64_t panel_bytes, const void *scale,
                     int scale_f16, const float *offset, int64_t ldsc, int64_t group_k, const float *bias, float *y,
                     int64_t ldy, int64_t M, int64_t N, int64_t K, int silu_and_mul, int num_threads);
int stoker_linear_q4_a8(const float *x, int64_t ldx, const void *wt, int64_t panel_bytes, const void *scale,
                        int scale_f16, const float *offset, int64_t ldsc, int64_t group_k, const float *bias, float *y,
                        int64_t ldy, int64_t M, int64_t N, int64_t K, int silu_and_mul, int num_threads);
int stoker_linear_q6_a8(const float *x, int64_t ldx, const void *wt, int64_t panel_bytes, const float *super_scale,
                        int64_t ldsc, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                        int silu_and_mul, int num_threads);
int stoker_linear_q4k_a8(const float *x, int64_t ldx, const void *wt, int64_t panel_bytes, const uint8_t *sub,
                         const float *sup, int64_t ldsc, const float *bias, float *y, int64_t ldy, int64_t M, int64_t N,
                         int64_t K, int silu_and_mul, int num_threads);

enum { LIN_KIND, LIN_W, LIN_LDW, LIN_PANEL_STRIDE, LIN_FMT, LIN_SCALE, LIN_OFFSET, LIN_LDSC, LIN_GROUP_K, LIN_BIAS,
       LIN_N, LIN_K, LIN_SILU, LIN_Y_OFFSET, LIN_LDY, LINEAR_SLOTS };
enum { KIND_NONE = -1, KIND_F32, KIND_Q8, KIND_Q4, KIND_Q4_A8, KIND_Q6_A8, KIND_Q4K_A8 };
/* A projection is up to MAX_PARTS runs side by side (a GGUF k-quant mix's q/k beside a wider v:
 * layers/composite_method.py), each writing its columns of the output at LIN_Y_OFFSET; unused
 * runs are KIND_NONE. */
#define MAX_PARTS 3
#define PROJECTION_SLOTS (MAX_PARTS * LINEAR_SLOTS)
enum { L_INPUT_NORM, L_POST_NORM, L_Q_NORM, L_K_NORM, L_K_CACHE, L_V_CACHE, L_WINDOW, L_QKV,
       L_O = L_QKV + PROJECTION_SLOTS, L_GATE_UP = L_O + PROJECTION_SLOTS, L_DOWN = L_GATE_UP + PROJECTION_SLOTS,
       LAYER_SLOTS = L_DOWN + PROJECTION_SLOTS };

/* Status codes, each a stage that refused (decoder_layer.py names them). */
enum { OK = 0, E_ALLOC = 1, E_POSITION = 2, E_SLOT = 3, E_CONTEXT = 4, E_BLOCK = 5, E_LINEAR = 6 };

int stoker_decoder_layer_slots(void) { return LAYER_SLOTS; }
int stoker_decoder_linear_slots(void) { return LINEAR_SLOTS; }
int stoker_decoder_max_parts(void) { return MAX_PARTS; }


#define PTR(type, v) ((type)(intptr_t)(v))

/* y[:, off:off + N] (N / 2 columns when the kernel applies silu-and-mul; rows LIN_LDY apart) = x
 * (M, K, rows ldx apart) through one run described by d[0:LINEAR_SLOTS]. Returns 0, or E_LINEAR
 * when the kernel refused. */
static int run_part(const int64_t *d, const float *x, int64_t ldx, float *y, int64_t M, int num_threads) {
    const int64_t N = d[LIN_N], K = d[LIN_K], ldy = d[LIN_LDY];
    const int silu = (int)d[LIN_SILU];
    const float *bias = PTR(const float *, d[LIN_BIAS]);
    float *out = y + d[LIN_Y_OFFSET];
    int status = 0;
    switch (d[LIN_KIND]) {
    case KIND_F32:
        stoker_linear_f32(x, ldx, PTR(const float *, d[LIN_W]), d[LIN_LDW], d[LIN_PANEL_STRIDE], bias, out, ldy, M, N, K,
                          silu, num_threads);
        break;
    case KIND_Q8:
        status = stoker_linear_q8(x, ldx, PTR(const void *, d[LIN_W]), d[LIN_LDW], d[LIN_PANEL_STRIDE], (int)d[LIN_FMT],
                                  PTR(const float *, d[LIN_SCALE]), d[LIN_LDSC], d[LIN_GROUP_K], bias, out, ldy, M, N, K,
                                  silu, num_threads);
        break;
    case KIND_Q4:
    case KIND_Q4_A8:
        status = (d[LIN_KIND] == KIND_Q4 ? stoker_linear_q4 : stoker_linear_q4_a8)(
            x, ldx, PTR(const void *, d[LIN_W]), d[LIN_LDW], PTR(const void *, d[LIN_SCALE]), (int)d[LIN_FMT],
            PTR(const float *, d[LIN_OFFSET]), d[LIN_LDSC], d[LIN_GROUP_K], bias, out, ldy, M, N, K, silu, num_threads);
        break;
    case KIND_Q6_A8:
        status = stoker_linear_q6_a8(x, ldx, PTR(const void *, d[LIN_W]), d[LIN_LDW], PTR(const float *, d[LIN_SCALE]),
                                     d[LIN_LDSC], bias, out, ldy, M, N, K, silu, num_threads);
        break;
    case KIND_Q4K_A8:
        status = stoker_linear_q4k_a8(x, ldx, PTR(const void *, d[LIN_W]), d[LIN_LDW], PTR(const uint8_t *, d[LIN_SCALE]),
                                      PTR(const float *, d[LIN_OFFSET]), d[LIN_LDSC], bias, out, ldy, M, N, K, silu,
                                      num_threads);
        break;
    default:
        status = 1;
    }
    return status ? E_LINEAR : OK;
}

/* A whole projection: its runs in order (the first KIND_NONE ends them). */
static int run_linear(const int64_t *d, const float *x, int64_t ldx, float *y, int64_t M, int num_threads) {
    int status = OK;
    for (int i = 0; i < MAX_PARTS && status == OK && d[i * LINEAR_SLOTS + LIN_KIND] != KIND_NONE; i++)
        status = run_part(d + i * LINEAR_SLOTS, x, ldx, y, M, num_threads);
    return status;
}

/* x (T, hidden): in, the embeddings; out, the last layer's MLP output. res (T, hidden): out, the
 * residual stream beside it (the model's final norm takes both). layers: num_layers x LAYER_SLOTS.
 * positions and slot_mapping (T,) int64; block_tables (T, max_blocks) and context_lens (T,) int32
 * (context lengths count the new token); cos_sin (max_position, rot_dim) = [cos | sin].
 * Returns 0, or the first stage that refused (the enum above): nothing past it ran. */
int stoker_decoder_decode_f32(float *x, float *res, int64_t T, int64_t hidden, int64_t num_layers,
                              const int64_t *layers, const int64_t *positions, const float *cos_sin,
                              int64_t max_position, int64_t rot_dim, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, float eps, float qk_eps, float scale, const int64_t *slot_mapping,
                              const int32_t *block_tables, int64_t max_blocks, const int32_t *context_lens,
                              int64_t num_blocks, int64_t block_size, int num_threads) {
    if (T <= 0 || num_layers <= 0) return OK;
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int64_t qkv_width = q_size + 2 * kv_size;
    int64_t inter = 0; /* the widest gate_up output, for the workspace */
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *gu = layers + l * LAYER_SLOTS + L_GATE_UP;
        const int64_t n = gu[LIN_SILU] ? 2 * gu[LIN_LDY] : gu[LIN_LDY]; /* [gate; up]'s whole width */
        if (n > inter) inter = n;
    }
    /* qkv, q and k after their norms, q and k rotated, the attention's output, h, the MLP's
     * middle, and its activation after an unfused [gate; up] */
    const int64_t floats = T * (qkv_width + 2 * (q_size + kv_size) + q_size + hidden + inter + inter / 2);
    float *ws = (float *)malloc(sizeof(float) * (size_t)floats);
    if (ws == NULL) return E_ALLOC;
    float *qkv = ws, *qn = qkv + T * qkv_width, *kn = qn + T * q_size, *qr = kn + T * kv_size;
    float *kr = qr + T * q_size, *attn = kr + T * kv_size, *h = attn + T * q_size, *mid = h + T * hidden;
    float *act = mid + T * inter;
    int status = OK;
    for (int64_t l = 0; l < num_layers && status == OK; l++) {
        const int64_t *p = layers + l * LAYER_SLOTS;
        /* input norm; from layer 1 on fused with the residual add (res = x + res) */
        stoker_rms_norm_f32(x, hidden, l ? res : NULL, hidden, PTR(const float *, p[L_INPUT_NORM]), h, l ? res : NULL, T,
                            hidden, eps, row_threads(T * hidden, num_threads));
        if (l == 0)
            for (int64_t i = 0; i < T * hidden; i++) res[i] = x[i];
        if ((status = run_linear(p + L_QKV, h, hidden, qkv, T, num_threads)) != OK) break;
        const float *q = qkv, *k = qkv + q_size, *v = qkv + q_size + kv_size;
        int64_t q_stride = qkv_width, k_stride = qkv_width;
        if (p[L_Q_NORM]) { /* per head over head_dim, token by token (a token's heads are rows D apart) */
            for (int64_t t = 0; t < T; t++) {
                stoker_rms_norm_f32(q + t * qkv_width, head_dim, NULL, 0, PTR(const float *, p[L_Q_NORM]),
                                    qn + t * q_size, NULL, num_heads, head_dim, qk_eps, 1);
                stoker_rms_norm_f32(k + t * qkv_width, head_dim, NULL, 0, PTR(const float *, p[L_K_NORM]),
                                    kn + t * kv_size, NULL, num_kv_heads, head_dim, qk_eps, 1);
            }
            q = qn, k = kn, q_stride = q_size, k_stride = kv_size;
        }
        if (stoker_rotary_f32(positions, q, q_stride, k, k_stride, cos_sin, max_position, qr, kr, T, num_heads,
                              num_kv_heads, head_dim, rot_dim, row_threads(T * q_size, num_threads))) {
            status = E_POSITION;
            break;
        }
        float *k_cache = PTR(float *, p[L_K_CACHE]), *v_cache = PTR(float *, p[L_V_CACHE]);
        if (stoker_store_kvcache_f32(kr, kv_size, v, qkv_width, k_cache, v_cache, slot_mapping, T, kv_size,
                                     num_blocks * block_size, row_threads(T * kv_size, num_threads))) {
            status = E_SLOT;
            break;
        }
        const int bad = stoker_paged_decode_attention_f32(qr, k_cache, v_cache, num_blocks, block_tables, max_blocks,
                                                          context_lens, attn, T, num_heads, num_kv_heads, head_dim,
                                                          block_size, scale, p[L_WINDOW], num_threads, NULL, 0.0f);
        if (bad) {
            status = bad == 1 ? E_ALLOC : bad == 2 ? E_CONTEXT : E_BLOCK;
            break;
        }
        if ((status = run_linear(p + L_O, attn, q_size, x, T, num_threads)) != OK) break;
        stoker_rms_norm_f32(x, hidden, res, hidden, PTR(const float *, p[L_POST_NORM]), h, res, T, hidden, eps,
                            row_threads(T * hidden, num_threads));
        const int64_t *gu = p + L_GATE_UP;
        if ((status = run_linear(gu, h, hidden, mid, T, num_threads)) != OK) break;
        const int64_t width = gu[LIN_LDY] / (gu[LIN_SILU] ? 1 : 2); /* the intermediate size */
        const float *down_in = mid;
        if (!gu[LIN_SILU]) { /* [gate | up] -> silu(gate) * up, as GateUpLinear's epilogue does it */
            stoker_silu_and_mul_f32(mid, 2 * width, act, T, width, row_threads(T * 2 * width, num_threads));
            down_in = act;
        }
        if ((status = run_linear(p + L_DOWN, down_in, width, x, T, num_threads)) != OK) break;
    }
    free(ws);
    return status;
}
