/* Vector helpers shared by cpu_kernels.c and quant_kernels.c (AVX2 + FMA). */
#ifndef TRAJSERVE_SIMD_MATH_H
#define TRAJSERVE_SIMD_MATH_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

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
/* exp8's operations on 16 lanes, but y * 2^n in one VSCALEFPS where exp8
 * builds 2^n from n's bits (convert, add, shift) and multiplies: the same
 * exact scaling (x >= -87.3 keeps 2^n a normal float), three fewer
 * operations in the softmax's and SiLU's inner loops. test_cpu_kernels
 * checks exp16 == exp8 bit for bit over the whole input range. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = ROUND_512(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)));
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}
#endif

/* silu(g) = g / (1 + exp(-g)) on 8 (or 16) lanes, one definition for both. exp8 holds up to 88 (2^127 is the
 * largest power of two a float holds), so -g is capped there: for g < -88
 * the result is g / (1 + 1.7e38), under 1e-35 in size where the exact one is
 * under 1e-36. The scalar expf this replaces cost the gate/up product ~15 %
 * of its speed (docs/benchmarks.md). */
#define DEFINE_SILU(NAME, W, EXP)                                                                      \
    static inline __m##W NAME(__m##W g) {                                                              \
        __m##W e = EXP(_mm##W##_min_ps(_mm##W##_sub_ps(_mm##W##_setzero_ps(), g), _mm##W##_set1_ps(88.0f))); \
        return _mm##W##_div_ps(g, _mm##W##_add_ps(_mm##W##_set1_ps(1.0f), e));                       \
    }
DEFINE_SILU(silu8, 256, exp8)
#if defined(__AVX512F__)
DEFINE_SILU(silu16, 512, exp16)
#endif

/* Keys per block of the online softmax in every attention kernel (cpu_kernels.c,
 * attention_bf16.c): blocks are aligned at key 0, so a query's arithmetic does
 * not depend on which kernel or chunk computes it. */
#define KB 64

/* The 8 x 8 transpose: c[e] = element e of rows r[0..8). */
static inline void transpose8(const __m256 *r, __m256 *c) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    c[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    c[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    c[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    c[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    c[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    c[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    c[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    c[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* float -> bfloat16 bits in the low half of each 32-bit lane: round to
 * nearest even, and a denormal to a signed zero (AMX reads bf16 denormals as
 * zero). One definition for every kernel that rounds to bf16, so K/V stored,
 * queries and probabilities round the same everywhere. NaN is not handled
 * (attention inputs are finite). */
static inline __m256i bf16_bits8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i tiny = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7F800000)), _mm256_setzero_si256());
    return _mm256_blendv_epi8(r, _mm256_srli_epi32(_mm256_and_si256(u, _mm256_set1_epi32((int)0x80000000)), 16), tiny);
}

/* bf16 bits (low halves) -> float, and 8 stored bf16 values -> float. */
static inline __m256 bf16_float8(__m256i bits) { return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16)); }
static inline __m256 bf16_load8(const uint16_t *p) {
    return bf16_float8(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* 8 floats rounded to bf16 and stored as 8 uint16. */
static inline void bf16_store8(uint16_t *p, __m256 x) {
    const __m256i b = bf16_bits8(x);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

/* A softmax's denominator l (its running maximum m), with head j's sink
 * where the model has them (gpt-oss): one more logit, weighing no value.
 * Every attention kernel adds it this way, once a query's keys are done. */
static inline float sink_sum(float l, float m, const float *sinks, int64_t j) {
    return sinks ? l + expf(sinks[j] - m) : l;
}

/* The first key a query at position pos sees under a sliding window of
 * `window` keys (0: no window, keys from 0): transformers' kv > pos - window. */
static inline int64_t window_start(int64_t pos, int64_t window) {
    return window > 0 && pos >= window ? pos - window + 1 : 0;
}

/* One decode query's softmax step over a key block's scores sj[0..nk), in
 * place, for the decode kernels of cpu_kernels.c and attention_bf16.c: the
 * running max m and sum l updated (l = fma(l, a, sum of p), the sum with key
 * i in lane i % 8, then hsum8's tree), the o row rescaled by a = exp8(m_old
 * - m) (d floats), p_i = exp8(s_i - m) (lanes past nk, and the first hid:
 * keys before a sliding window, exactly 0 and out of the max; rounded to bf16
 * with round_bf16). The prefill kernels do these operations lane by lane. */
static inline __attribute__((always_inline)) void decode_softmax_block(float *sj, int64_t nk, float *m, float *l,
                                                                      float *o, int64_t d, const int round_bf16,
                                                                      int64_t hid) {
    float mx = *m;
    for (int64_t i = hid; i < nk; i++) mx = sj[i] > mx ? sj[i] : mx;
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < nk; t += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sj + t), mxv));
        if (nk - t < 8 || hid > t) {  // lanes past the context or before the window: exactly 0
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256i past = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(nk - t)), lane);
            const __m256i before = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(hid - t)), lane);
            p = _mm256_and_ps(p, _mm256_castsi256_ps(_mm256_andnot_si256(before, past)));
        }
        if (round_bf16) p = bf16_float8(bf16_bits8(p));
        _mm256_storeu_ps(sj + t, p);
        sum = _mm256_add_ps(sum, p);
    }
    float a8[8];
    _mm256_storeu_ps(a8, exp8(_mm256_set1_ps(*m - mx)));
    const float a = a8[0];
    *m = mx;
    *l = fmaf(*l, a, hsum8(sum));
    const __m256 av = _mm256_set1_ps(a);
    for (int64_t e = 0; e < d; e += 8) _mm256_storeu_ps(o + e, _mm256_mul_ps(av, _mm256_loadu_ps(o + e)));
}

#endif
