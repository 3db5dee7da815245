/*
 * Writes a step's new K/V rows into the paged cache through slot_mapping (float32, CPU).
 *
 * Why C: the torch twin (kernels/reference.py) runs index_copy_ twice after a host sync on
 * `slot_mapping >= 0`; per layer and step that overhead was larger than the copy itself on
 * the issue-2 benchmark (decode steps move a few KB per layer). Here: one pass, bounds
 * checked per slot, no sync.
 *
 * key/value (num_tokens, num_kv_heads * head_dim) rows with strides key_stride/value_stride
 * (views of the fused qkv projection are fine); k_cache/v_cache (num_slots, row) contiguous,
 * num_slots = num_blocks * block_size; slots (num_tokens,) int64, -1 = do not store.
 * Returns how many slots were out of range (skipped): the caller raises if any.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static int64_t store(int fp8, const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                     void *k_cache, void *v_cache, const int64_t *slots, int64_t num_tokens, int64_t row,
                     int64_t num_slots, float k_inv_scale, float v_inv_scale, int num_threads);

int64_t stoker_store_kvcache_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                                 float *k_cache, float *v_cache, const int64_t *slots, int64_t num_tokens,
                                 int64_t row, int64_t num_slots, int num_threads) {
    return store(0, key, key_stride, value, value_stride, k_cache, v_cache, slots, num_tokens, row, num_slots, 1.0f, 1.0f,
                 num_threads);
}

/* float -> FP8 E4M3 (e4m3fn) bits, rounding to nearest even, for |x| <= 448 (the caller
 * clamps: e4m3fn has no infinity, and torch's cast does not saturate). Bit-exact with
 * torch's x.to(torch.float8_e4m3fn) on that range (tests/kernels/test_kv_fp8.py). */
static inline uint8_t e4m3_from_float(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
    bits &= 0x7FFFFFFFu;
    float a;
    memcpy(&a, &bits, 4);
    if (a < 0x1p-6f) /* subnormal range: multiples of 2^-9; 8 * 2^-9 rounds up to the smallest normal, bits 0x08 */
        return sign | (uint8_t)lrintf(a * 512.0f);
    /* normal: keep 3 mantissa bits, round half to even on the 20 dropped */
    bits += 0x7FFFFu + ((bits >> 20) & 1u);
    const int e = (int)(bits >> 23) - 127 + 7;
    return sign | (uint8_t)((e << 3) | ((bits >> 20) & 7u));
}

/* As stoker_store_kvcache_f32, into an FP8 E4M3 cache: each element x is stored as
 * e4m3(clamp(x * inv_scale, -448, 448)), k and v with their own inverse scales. */
int64_t stoker_store_kvcache_fp8(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                                 uint8_t *k_cache, uint8_t *v_cache, const int64_t *slots, int64_t num_tokens,
                                 int64_t row, int64_t num_slots, float k_inv_scale, float v_inv_scale,
                                 int num_threads) {
    return store(1, key, key_stride, value, value_stride, k_cache, v_cache, slots, num_tokens, row, num_slots,
                 k_inv_scale, v_inv_scale, num_threads);
}

static int64_t store(int fp8, const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                     void *k_cache, void *v_cache, const int64_t *slots, int64_t num_tokens, int64_t row,
                     int64_t num_slots, float k_inv_scale, float v_inv_scale, int num_threads) {
    int64_t bad = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(+ : bad)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        if (s >= num_slots) {
            bad++;
            continue;
        }
        if (!fp8) {
            memcpy((float *)k_cache + s * row, key + t * key_stride, sizeof(float) * (size_t)row);
            memcpy((float *)v_cache + s * row, value + t * value_stride, sizeof(float) * (size_t)row);
            continue;
        }
        uint8_t *k_dst = (uint8_t *)k_cache + s * row, *v_dst = (uint8_t *)v_cache + s * row;
        for (int64_t i = 0; i < row; i++) {
            const float k = fminf(fmaxf(key[t * key_stride + i] * k_inv_scale, -448.0f), 448.0f);
            const float v = fminf(fmaxf(value[t * value_stride + i] * v_inv_scale, -448.0f), 448.0f);
            k_dst[i] = e4m3_from_float(k);
            v_dst[i] = e4m3_from_float(v);
        }
    }
    return bad;
}
