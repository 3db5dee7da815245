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
#include <stdint.h>
#include <string.h>

int64_t stoker_store_kvcache_f32(const float *key, int64_t key_stride, const float *value, int64_t value_stride,
                                 float *k_cache, float *v_cache, const int64_t *slots, int64_t num_tokens,
                                 int64_t row, int64_t num_slots, int num_threads) {
    int64_t bad = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(+ : bad)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        if (s >= num_slots) {
            bad++;
            continue;
        }
        memcpy(k_cache + s * row, key + t * key_stride, sizeof(float) * (size_t)row);
        memcpy(v_cache + s * row, value + t * value_stride, sizeof(float) * (size_t)row);
    }
    return bad;
}
