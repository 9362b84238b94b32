/* Vector helpers shared by cpu_kernels.c and quant_kernels.c (AVX2 + FMA). */
#ifndef TRAJSERVE_SIMD_MATH_H
#define TRAJSERVE_SIMD_MATH_H
#include <immintrin.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for x <= 88 (softmax after the max is subtracted: x <= 0; SiLU):
 * Cody-Waite range reduction x = n ln2 + r, |r| <= ln2/2, and Cephes'
 * degree-6 polynomial; ~1 ulp. Inputs below -87.3 give ~1e-38 instead of 0
 * (irrelevant to a sum that holds at least one exp(0) = 1, and to SiLU). */
/* One definition for every vector width W (256, 512): the AVX-512 build's
 * prefill attention must give the AVX2 one's and decode's bits lane for lane. */
#define ROUND_256(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ROUND_512(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define DEFINE_EXP(NAME, W)                                                                                  \
    static inline __m##W NAME(__m##W x) {                                                                    \
        x = _mm##W##_max_ps(x, _mm##W##_set1_ps(-87.3f));                                                    \
        __m##W n = ROUND_##W(_mm##W##_mul_ps(x, _mm##W##_set1_ps(1.44269504088896341f)));                    \
        __m##W r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(0.693359375f), x);                                 \
        r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(-2.12194440e-4f), r);                                     \
        __m##W p = _mm##W##_set1_ps(1.9875691500e-4f);                                                       \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.3981999507e-3f));                                     \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(8.3334519073e-3f));                                     \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(4.1665795894e-2f));                                     \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.6666665459e-1f));                                     \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(5.0000001201e-1f));                                     \
        __m##W y = _mm##W##_fmadd_ps(p, _mm##W##_mul_ps(r, r), _mm##W##_add_ps(r, _mm##W##_set1_ps(1.0f)));  \
        __m##W##i e = _mm##W##_slli_epi32(_mm##W##_add_epi32(_mm##W##_cvtps_epi32(n), _mm##W##_set1_epi32(127)), 23); \
        return _mm##W##_mul_ps(y, _mm##W##_castsi##W##_ps(e));                                               \
    }
DEFINE_EXP(exp8, 256)
#if defined(__AVX512F__)
DEFINE_EXP(exp16, 512)
#endif

/* silu(g) = g / (1 + exp(-g)) on 8 lanes. exp8 holds up to 88 (2^127 is the
 * largest power of two a float holds), so -g is capped there: for g < -88
 * the result is g / (1 + 1.7e38), under 1e-35 in size where the exact one is
 * under 1e-36. The scalar expf this replaces cost the gate/up product ~15 %
 * of its speed (docs/benchmarks.md). */
static inline __m256 silu8(__m256 g) {
    __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(88.0f)));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}


#endif
