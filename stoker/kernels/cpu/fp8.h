/*
 * FP8 E4M3 (e4m3fn) -> float for the CPU kernels, as value / 256.
 *
 * Why / 256: the vector paths move an E4M3 byte's exponent and mantissa into an fp16's bits
 * and let vcvtph2ps (F16C / AVX-512) widen it: sign-extend the byte to 16 bits and shift left
 * by 7, which puts exponent and mantissa in place and the sign at bit 15 (a copy of it lands
 * at bit 14 and is masked off). The exponent bias differs by 15 - 7, so the fp16 reads the
 * value / 2^8; E4M3 subnormals land on fp16 subnormals, which vcvtph2ps widens exactly.
 * Callers fold the 256 into a scale they multiply by anyway. The scalar form and the table
 * (builds without F16C, tails) compute the same value.
 */
#ifndef STOKER_FP8_H
#define STOKER_FP8_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline float fp8_div256(uint8_t b) {
    const int e = (b >> 3) & 0xF, m = b & 7;
    const float mag = e == 0 ? (float)m * 0x1p-17f : ldexpf(1.0f + (float)m * 0.125f, e - 15);
    return (b & 0x80) ? -mag : mag;
}

/* The 256 values / 256, filled when the library loads. */
static float fp8_div256_table[256];
__attribute__((constructor)) static void fill_fp8_div256_table(void) {
    for (int b = 0; b < 256; b++) fp8_div256_table[b] = fp8_div256((uint8_t)b);
}

#if defined(__AVX512F__)
/* 16 bytes at p -> 16 floats / 256 */
static inline __m512 fp8x16_div256(const uint8_t *p) {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7),
                                       _mm256_set1_epi16((short)0xBFFF));
    return _mm512_cvtph_ps(h);
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
/* 8 bytes at p -> 8 floats / 256 */
static inline __m256 fp8x8_div256(const uint8_t *p) {
    const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7),
                                    _mm_set1_epi16((short)0xBFFF));
    return _mm256_cvtph_ps(h);
}
#endif

#endif
