/*
 * One BERT encoder layer (post-LayerNorm, Devlin et al. 2019) for CPU float32, in one call:
 *
 *   qkv = x Wqkv^T + bqkv                      (T, 3*H*D)   linear.c
 *   a   = attention(qkv), each sequence alone  (T, H*D)     prefill_attention.c
 *   h   = LN1(a Wo^T + bo + x)                 (T, hidden)
 *   x'  = LN2(act(h W1^T + b1) W2^T + b2 + h)  (T, hidden)  act: GELU (erf or tanh) or ReLU
 *
 * Why one call: through Python the layer is ~35 torch and ctypes calls, and each gives the GIL
 * back and must take it again. An embedding server's instances share the GIL with its event
 * loop, so every one of those re-takes can wait behind the loop's Python (issue 18: the
 * instances' batches took 1.57x their CPU time at c = 32, docs/benchmarks.md). Here the whole
 * layer runs with the GIL released (ctypes), and the add + LayerNorm and the activation are
 * one pass each instead of torch's two or three.
 *
 * The twin is the module path, pooling/bert.py's BertLayer.forward (tests compare the two).
 *
 * Weights are linear.c's packed panels ((ceil(N / NR), K, NR), bias padded to whole panels):
 * params[12] = Wqkv, bqkv, Wo, bo, LN1 weight, LN1 bias, W1, b1, W2, b2, LN2 weight, LN2 bias.
 * workspace: at least T * (5 * hidden + intermediate) floats (qkv, the attention's output, h,
 * the intermediate). x (T, hidden) contiguous is read and overwritten with x'.
 */
#include <math.h>
#include <stdint.h>

#include "rows.h"

int stoker_linear_nr(void);
void stoker_linear_f32(const float *x, int64_t ldx, const float *wt, int64_t ldw, int64_t panel_stride,
                       const float *bias, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int silu_and_mul,
                       int num_threads);
int stoker_encoder_attention_f32(const float *qkv, int64_t num_tokens, const int32_t *token_table, int64_t max_len,
                                 const int64_t *cu_seqlens, const int64_t *lengths, float *out, int64_t num_seqs,
                                 int64_t num_heads, int64_t head_dim, float scale, int num_threads);

enum { ACT_GELU = 0, ACT_GELU_TANH = 1, ACT_RELU = 2 };


/* y (M, N) = x (M, K) W^T + bias with W as packed panels (dense rows). */
static void linear(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                   int num_threads) {
    const int64_t nr = stoker_linear_nr();
    stoker_linear_f32(x, K, w, nr, K * nr, bias, y, N, M, N, K, 0, num_threads);
}

/* x[r] = LayerNorm(x[r] + residual[r]) * weight + bias, rows of n floats. */
static void add_layer_norm(float *x, const float *residual, const float *weight, const float *bias, int64_t num_rows,
                           int64_t n, float eps, int num_threads) {
#pragma omp parallel for num_threads(row_threads(num_rows * n, num_threads)) schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        float *xr = x + r * n;
        const float *rr = residual + r * n;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) {
            xr[i] += rr[i];
            sum += xr[i];
        }
        const float mean = sum / (float)n;
        float sum_sq = 0.0f; /* the centred second pass: no cancellation when |mean| >> the spread */
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = 0; i < n; i++) sum_sq += (xr[i] - mean) * (xr[i] - mean);
        const float inv_std = 1.0f / sqrtf(sum_sq / (float)n + eps);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) xr[i] = (xr[i] - mean) * inv_std * weight[i] + bias[i];
    }
}

/* x = act(x) in place, num elements (erff and tanhf vectorise through glibc's libmvec). */
static void activate(float *x, int64_t num, int act, int num_threads) {
    const int threads = row_threads(num, num_threads);
    const int64_t chunk = (num + threads - 1) / threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++) {
        float *p = x + t * chunk;
        const int64_t n = num - t * chunk < chunk ? num - t * chunk : chunk;
        if (act == ACT_GELU) {
#pragma omp simd
            for (int64_t i = 0; i < n; i++) p[i] = 0.5f * p[i] * (1.0f + erff(p[i] * 0.70710678118654752f));
        } else if (act == ACT_GELU_TANH) {
#pragma omp simd
            for (int64_t i = 0; i < n; i++) {
                const float v = p[i];
                p[i] = 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
            }
        } else {
#pragma omp simd
            for (int64_t i = 0; i < n; i++) p[i] = p[i] > 0.0f ? p[i] : 0.0f;
        }
    }
}

/* Returns 0, 1 (no memory in the attention), 2 (a sequence's length does not fit token_table), 4 (unknown act). */
static int bert_layer(float *x, int64_t num_tokens, int64_t hidden, int64_t num_heads, int64_t intermediate,
                      const float *const *params, float eps, int act, const int32_t *token_table, int64_t max_len,
                      const int64_t *cu_seqlens, const int64_t *lengths, int64_t num_seqs, float scale,
                      float *workspace, int num_threads) {
    if (act != ACT_GELU && act != ACT_GELU_TANH && act != ACT_RELU) return 4;
    const int64_t T = num_tokens;
    float *qkv = workspace, *attn = qkv + T * 3 * hidden, *h = attn + T * hidden, *inter = h + T * hidden;
    linear(x, params[0], params[1], qkv, T, 3 * hidden, hidden, num_threads);
    const int status = stoker_encoder_attention_f32(qkv, T, token_table, max_len, cu_seqlens, lengths, attn, num_seqs,
                                                    num_heads, hidden / num_heads, scale, num_threads);
    if (status) return status;
    linear(attn, params[2], params[3], h, T, hidden, hidden, num_threads);
    add_layer_norm(h, x, params[4], params[5], T, hidden, eps, num_threads);
    linear(h, params[6], params[7], inter, T, intermediate, hidden, num_threads);
    activate(inter, T * intermediate, act, num_threads);
    linear(inter, params[8], params[9], x, T, hidden, intermediate, num_threads);
    add_layer_norm(x, h, params[10], params[11], T, hidden, eps, num_threads);
    return 0;
}

/* Every layer of an encoder in one call: params holds num_layers runs of the 12 pointers above,
 * layer after layer. One call, not one per layer, because each return to Python must take the
 * GIL back, and in a server the event loop often holds it: at c = 32 on 2 cores a batch of
 * queries waited ~0.5 ms for each of its 6 layer calls' returns (docs/benchmarks.md). */
int stoker_bert_encoder_f32(float *x, int64_t num_tokens, int64_t hidden, int64_t num_heads, int64_t intermediate,
                            int64_t num_layers, const float *const *params, float eps, int act,
                            const int32_t *token_table, int64_t max_len, const int64_t *cu_seqlens,
                            const int64_t *lengths, int64_t num_seqs, float scale, float *workspace, int num_threads) {
    for (int64_t l = 0; l < num_layers; l++) {
        const int status = bert_layer(x, num_tokens, hidden, num_heads, intermediate, params + 12 * l, eps, act,
                                      token_table, max_len, cu_seqlens, lengths, num_seqs, scale, workspace,
                                      num_threads);
        if (status) return status;
    }
    return 0;
}
