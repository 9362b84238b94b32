/* Quantized K/V pool rows (q8_0 / q4_0), shared by cpu_kernels.c and
 * attention_bf16.c: a row's bytes, the rotation of its
 * groups, and a row read back as float32.
 *
 * A q8_0 / q4_0 pool row (model/kv_quant.py has the layout and the torch
 * twins of these): the codes of the d / 32 groups, then their float16
 * scales; a dequantized value, code x float16 scale, is exact in float32. */
#ifndef TRAJSERVE_KV_ROWS_H
#define TRAJSERVE_KV_ROWS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "formats.h"


static inline int64_t kv_row_bytes(int fmt, int64_t d) {
    return fmt == TS_Q8_0 ? d + d / 16 : fmt == TS_Q4_0 ? d / 2 + d / 16 : fmt == TS_BF16 ? 2 * d : 4 * d;
}

/* H x for each group of 32 values of x[0 .. d) in place (d % 32 == 0): the
 * unnormalized Walsh-Hadamard transform, H H = 32 I, whose butterfly
 * kv_quant.py's rotate runs in the same order. A quantized row holds the
 * codes of the rotated groups (kv_quant.py says why); attention rotates the
 * query and its output instead of the keys and values it reads. */
static inline void rotate32(float *x, int64_t d) {
    // Four vectors of 8 values a group, the stages in the scalar butterfly's
    // order: h = 1, 2, 4 pair lanes inside a vector, h = 8 and 16 whole
    // vectors (i, i + 1) and (i, i + 2); each output is a + b or a - b of the
    // same a = x[j], b = x[j + h], so the bits are the scalar loop's.
    for (int64_t g = 0; g < d; g += 32) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + g + 8 * i);
            __m256 a = _mm256_permute_ps(v[i], 0xA0), b = _mm256_permute_ps(v[i], 0xF5);
            v[i] = _mm256_blend_ps(_mm256_add_ps(a, b), _mm256_sub_ps(a, b), 0xAA);  // h = 1
            a = _mm256_permute_ps(v[i], 0x44), b = _mm256_permute_ps(v[i], 0xEE);
            v[i] = _mm256_blend_ps(_mm256_add_ps(a, b), _mm256_sub_ps(a, b), 0xCC);  // h = 2
            a = _mm256_permute2f128_ps(v[i], v[i], 0x00), b = _mm256_permute2f128_ps(v[i], v[i], 0x11);
            v[i] = _mm256_permute2f128_ps(_mm256_add_ps(a, b), _mm256_sub_ps(a, b), 0x20);  // h = 4
        }
        for (int h = 1; h <= 2; h *= 2)  // h = 8 (vectors i, i + 1), then 16 (i, i + 2)
            for (int i = 0; i < 4; i++)
                if (!(i & h)) {
                    const __m256 a = v[i], b = v[i + h];
                    v[i] = _mm256_add_ps(a, b);
                    v[i + h] = _mm256_sub_ps(a, b);
                }
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(x + g + 8 * i, v[i]);
    }
}

/* An attention output row of a quantized pool back from the rotated space:
 * H o / 32 per group (exact division). */
static inline void unrotate32(float *x, int64_t d) {
    rotate32(x, d);
    for (int64_t e = 0; e < d; e += 8) _mm256_storeu_ps(x + e, _mm256_mul_ps(_mm256_loadu_ps(x + e), _mm256_set1_ps(0.03125f)));
}

/* One pool row's d values as float32 (exact). */
static inline void dequantize_kv_row(const uint8_t *row, int64_t d, int fmt, float *out) {
    const uint16_t *scales = (const uint16_t *)(row + (fmt == TS_Q8_0 ? d : d / 2));
    for (int64_t g = 0; g < d / 32; g++) {
        uint16_t h;
        memcpy(&h, scales + g, 2);
        const __m256 sc = _mm256_set1_ps(_cvtsh_ss(h));
        float *o = out + 32 * g;
        if (fmt == TS_Q8_0) {
            for (int j = 0; j < 32; j += 8)
                _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                          _mm_loadl_epi64((const __m128i *)(row + 32 * g + j)))), sc));
        } else {
            const __m128i c = _mm_loadu_si128((const __m128i *)(row + 16 * g)), nib = _mm_set1_epi8(0x0F);
            // low nibbles: values 0 .. 15 of the group, high nibbles: 16 .. 31
            const __m128i half[2] = {_mm_and_si128(c, nib), _mm_and_si128(_mm_srli_epi16(c, 4), nib)};
            for (int hh = 0; hh < 2; hh++)
                for (int j = 0; j < 16; j += 8) {
                    const __m128i part = j ? _mm_srli_si128(half[hh], 8) : half[hh];
                    const __m256 q = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part)), _mm256_set1_ps(8.0f));
                    _mm256_storeu_ps(o + 16 * hh + j, _mm256_mul_ps(q, sc));
                }
        }
    }
}

#endif
