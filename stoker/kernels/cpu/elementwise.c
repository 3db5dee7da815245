/*
 * Row-wise float32 kernels for CPU, each one pass over its data where torch takes several:
 * RMSNorm (with the residual add fused), SiLU-and-mul, and rotary embedding.
 *
 * Why: on the issue-2 benchmark these element-wise ops took ~14% of a run through torch,
 * which on CPU runs each of them as 3-6 separate passes (pow, mean, rsqrt, mul, ...) over
 * tensors that do not fit in L2 during prefill. Twins: kernels/reference.py.
 *
 * Rows: a tensor's first dimension (tokens). Row strides are in floats and let the caller
 * pass views (q and k are column slices of the fused qkv projection). Every function
 * parallelises over rows with `num_threads` (1 for small inputs: a parallel region costs
 * more than it saves on a few KB).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * weight; with residual != NULL first
 * residual_out[r] = x[r] + residual[r] and normalise that (vLLM's fused_add_rms_norm). */
void stoker_rms_norm_f32(const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
                         const float *weight, float *out, float *residual_out, int64_t num_rows, int64_t hidden,
                         float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *xr = x + r * x_stride;
        const float *src = xr;
        if (residual != NULL) {
            const float *rr = residual + r * residual_stride;
            float *ro = residual_out + r * hidden;
#pragma omp simd
            for (int64_t i = 0; i < hidden; i++) ro[i] = xr[i] + rr[i];
            src = ro;
        }
        float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = 0; i < hidden; i++) sum_sq += src[i] * src[i];
        const float inv_rms = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
        float *o = out + r * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) o[i] = src[i] * inv_rms * weight[i];
    }
}

/* x (num_rows, 2 * d) = [gate | up] -> out (num_rows, d) = silu(gate) * up */
void stoker_silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t num_rows, int64_t d,
                             int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + d;
        float *o = out + r * d;
        /* exp's argument is capped: under -ffast-math an infinite exp is not handled (silu is
         * ~0 there anyway: -88 / (1 + e^88) ~ -1e-36) */
#pragma omp simd
        for (int64_t i = 0; i < d; i++) o[i] = gate[i] / (1.0f + expf(fminf(-gate[i], 88.0f))) * up[i];
    }
}

/* GPT-NeoX-style rotary on the first rot_dim dims of each head, [x1 | x2] halves:
 * [x1 cos - x2 sin, x2 cos + x1 sin]; dims past rot_dim are copied.
 * x (num_rows, num_heads, head_dim) with row stride x_stride (heads contiguous),
 * out (num_rows, num_heads, head_dim) contiguous, cos_sin (max_position, rot_dim) = [cos | sin]. */
static void rotate_rows(const float *x, int64_t x_stride, float *out, const int64_t *positions,
                        const float *cos_sin, int64_t num_rows, int64_t num_heads, int64_t head_dim,
                        int64_t rot_dim, int num_threads) {
    const int64_t half = rot_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *cos = cos_sin + positions[r] * rot_dim, *sin = cos + half;
        for (int64_t h = 0; h < num_heads; h++) {
            const float *xh = x + r * x_stride + h * head_dim;
            float *oh = out + (r * num_heads + h) * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = xh[i], x2 = xh[i + half];
                oh[i] = x1 * cos[i] - x2 * sin[i];
                oh[i + half] = x2 * cos[i] + x1 * sin[i];
            }
            if (rot_dim < head_dim) memcpy(oh + rot_dim, xh + rot_dim, sizeof(float) * (head_dim - rot_dim));
        }
    }
}

/* Returns 1, writing nothing, if a position is outside [0, max_position) (checked here: a
 * min/max in Python cost two torch reductions per layer and step). */
int stoker_rotary_f32(const int64_t *positions, const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                      const float *cos_sin, int64_t max_position, float *q_out, float *k_out, int64_t num_rows,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rot_dim, int num_threads) {
    for (int64_t r = 0; r < num_rows; r++)
        if (positions[r] < 0 || positions[r] >= max_position) return 1;
    rotate_rows(q, q_stride, q_out, positions, cos_sin, num_rows, num_heads, head_dim, rot_dim, num_threads);
    rotate_rows(k, k_stride, k_out, positions, cos_sin, num_rows, num_kv_heads, head_dim, rot_dim, num_threads);
    return 0;
}
