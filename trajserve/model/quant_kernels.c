/* Weight products on GGUF quantized blocks, executed as stored (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4).
 *
 * Why: a batch-1 decode step reads every weight once (inference-optimization
 * 8.2.1, I_weight ~ 2b/s_w), so its time is the weight bytes over the memory
 * bandwidth. Q4_1 is 20 bytes per 32 weights (0.625 bytes a weight) where
 * the float32 path reads 4.
 *
 * How (chosen by measurement, docs/benchmarks.md): each input row is
 * quantized to blocks of 32 int8 values with one float scale (block_q8x:
 * d = amax / 127, the codes' sum, s = d * sum), and every weight block meets
 * every input block in an exact integer dot product. The weights are
 * repacked at load (model/quant.py pack_panels) into panels of 16 rows, as
 * the float path's are: at each step of 4 input values a panel holds the 16
 * rows' 4 codes as one 64-byte vector, so one broadcast of 4 input bytes and
 * one `vpdpbusd` (AVX512-VNNI) or `vpmaddubsw` + `vpmaddwd` pair per 8 rows
 * (AVX2) yields 64 multiply-adds into 16 per-row int32 sums. Each output row
 * is a vector lane, so scales apply once per block to 16 rows. A first
 * version kept the 32 values of one block in the lanes instead (llama.cpp's
 * vec_dot): ~6x the instructions per weight, 25 % slower than the float32
 * kernel from batch 16 on.
 *
 * Per block b of weight row r and input row i, with exact integers
 *     sum_j w_j x_j ~= d_w * d_x * (sum_j u_j q_j - o * sum_j q_j) + m_w * s_x
 * where u are the stored codes: Q8_0 u = q + 128 (o = 128, m_w = 0), Q4_0
 * u = q + 8 (o = 8, m_w = 0), Q4_1 u = q (o = 0, m_w = the block's minimum);
 * Q4_K u = q (o = 0) with d_w = d * sc and m_w = -dmin * m, the super-block's
 * fp16 d and dmin times the block's 6-bit scale and minimum: products exact in
 * float32, so a Q4_K block is a Q4_1 block whose scales are computed.
 * Q5_K is Q4_K with 5-bit codes (u = q, 0-31): the fifth bits are or-ed
 * onto the nibbles before the same integer dot product.
 * Q6_K u = q + 32 (o = 32), 6-bit, with one int8 scale per 16 values: two
 * sums a block (values 0-15 and 16-31, the input's sum_lo and sum - sum_lo),
 * d_w = d * sc of each.
 * MXFP4 (gpt-oss's experts) stores 4-bit e2m1 codes with a power-of-two
 * scale: a code's value, doubled, is one of 0, 1, 2, 3, 4, 6, 8, 12 and
 * their negatives (MXFP4_LUT, a byte shuffle), u = that + 12 (o = 12), d_w
 * = 2^(e - 128) (the doubling taken out), kept as a float32 since no fp16
 * holds every power of two an e8m0 byte names.
 * Both builds compute the same integer (the AVX2 one undoes the +128 of Q8_0
 * codes and uses the sign trick, so no int16 pair saturates) and then the
 * same float operations in the same order, lane by lane: they give
 * bit-identical results, and a row's result never depends on the rows beside
 * it or on the thread count.
 *
 * Panel layout (quant.py pack_panels), per panel of 16 rows and block of 32:
 *   d[16] fp16 | Q4_1: m[16] fp16 | codes
 *   Q4_K: sc[16] u8 | m[16] u8 | codes, and before every 8 blocks (a
 *   super-block of 256) d[16] fp16 | -dmin[16] fp16
 *   Q5_K: Q4_K's, and after the codes 64 bytes of fifth bits: byte 4r + t,
 *   bit g = that of value 4g + t (group g's low nibble), bit 4 + g = that of
 *   value 16 + 4g + t (its high nibble)
 *   MXFP4: d[16] float32 | codes (the raw 4-bit codes, as Q4's)
 *   Q6_K: sc_lo[16] i8 | sc_hi[16] i8 | codes (their low 4 bits, as Q4) |
 *   high bits: 2 x 64 bytes, byte 4r + t of vector p = the high 2 bits of
 *   the low and the high nibble's codes of group 2p (low 4 bits) and 2p + 1;
 *   before every 8 blocks d[16] fp16
 *   codes Q4: 4 groups of 64 bytes, byte 4r + t of group g = u(4g + t) | u(4g + 16 + t) << 4 of row r
 *   codes Q8: 8 groups of 64 bytes, byte 4r + t of group g = u(4g + t) of row r
 * A panel is its k / 32 blocks back to back; rows past n are zero (d = 0).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "formats.h"
#include "simd_math.h"

#define QK 32
#define PANEL 16

/* An input row's block: scale d, the codes' sum and s = d * sum, the sum of
 * the first 16 codes (Q6_K scales each half of a block), the codes. */
typedef struct {
    float d, s;
    int32_t sum, sum_lo;
    int8_t q[QK];
} block_q8x;

/* Bytes of one block of one panel (16 rows); K-quants: on average (their
 * super-block header shared by 8 blocks). */
#define Q4K_BLOCK (32 + 256)
#define Q4K_SUPER (64 + 8 * Q4K_BLOCK)
#define Q5K_BLOCK (32 + 256 + 64)
#define Q5K_SUPER (64 + 8 * Q5K_BLOCK)
#define Q6K_BLOCK (32 + 256 + 128)
#define Q6K_SUPER (32 + 8 * Q6K_BLOCK)
static inline int64_t panel_block_bytes(const int fmt) {
    return fmt == TS_Q8_0 ? 32 + 512 : fmt == TS_Q4_0 ? 32 + 256 : fmt == TS_Q4_K ? Q4K_SUPER / 8
         : fmt == TS_Q5_K ? Q5K_SUPER / 8
         : fmt == TS_Q6_K ? Q6K_SUPER / 8 : 64 + 256;
}

/* Block b of a panel, and where its codes start. */
static inline const uint8_t *panel_block(const uint8_t *panel, int64_t b, const int fmt) {
    if (fmt == TS_Q4_K) return panel + (b >> 3) * Q4K_SUPER + 64 + (b & 7) * Q4K_BLOCK;
    if (fmt == TS_Q5_K) return panel + (b >> 3) * Q5K_SUPER + 64 + (b & 7) * Q5K_BLOCK;
    if (fmt == TS_Q6_K) return panel + (b >> 3) * Q6K_SUPER + 32 + (b & 7) * Q6K_BLOCK;
    return panel + b * panel_block_bytes(fmt);
}

static inline int codes_offset(const int fmt) { return fmt == TS_Q4_1 || fmt == TS_MXFP4 ? 64 : 32; }

/* An MXFP4 code -> its doubled e2m1 value + 12 (0..24), for a byte shuffle in each 16-byte lane. */
#define MXFP4_LUT 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0
#define MXFP4_OFFSET 12

/* A K-quant block's header: the d (Q4_K, Q5_K: and -dmin) of its super-block. */
static inline const uint8_t *q4k_head(const uint8_t *panel, int64_t b, const int fmt) {
    return panel + (b >> 3) * (fmt == TS_Q5_K ? Q5K_SUPER : Q4K_SUPER);
}
static inline int has_min(const int fmt) { return fmt == TS_Q4_1 || fmt == TS_Q4_K || fmt == TS_Q5_K; }
static inline const uint8_t *q6k_head(const uint8_t *panel, int64_t b) { return panel + (b >> 3) * Q6K_SUPER; }

/* Formats with an AMX-INT8 tile path (amx_product). Not Q6_K: its two
 * scales a block would make two tile products of 16 values and two scale
 * steps a block, which measured 0.7-0.8x the VNNI kernel. */
static inline int has_tiles(const int fmt) {
    return fmt == TS_Q8_0 || fmt == TS_Q4_0 || fmt == TS_Q4_1 || fmt == TS_Q4_K || fmt == TS_Q5_K || fmt == TS_MXFP4;
}

/* Which integer dot product this build runs: 1 AVX2, 2 AVX512-VNNI. */
int ts_quant_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return 2;
#else
    return 1;
#endif
}

/* Input rows -> block_q8x rows (k / 32 blocks each): q = round-half-even(x * (127 / amax)). */
static void quantize_row(const float *x, int64_t k, block_q8x *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8), v2 = _mm256_loadu_ps(xb + 16),
               v3 = _mm256_loadu_ps(xb + 24);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 idv = _mm256_set1_ps(id);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, idv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, idv)),
                i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, idv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, idv));
        const __m256i lo = _mm256_add_epi32(i0, i1);
        __m256i sum = _mm256_add_epi32(lo, _mm256_add_epi32(i2, i3));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        __m128i l4 = _mm_add_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
        l4 = _mm_add_epi32(l4, _mm_shuffle_epi32(l4, 0x4E));
        l4 = _mm_add_epi32(l4, _mm_shuffle_epi32(l4, 0xB1));
        // packs work within 128-bit lanes: the permute restores element order.
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        out[b].sum = _mm_cvtsi128_si32(s4);
        out[b].sum_lo = _mm_cvtsi128_si32(l4);
        out[b].d = d;
        out[b].s = d * (float)out[b].sum;
        _mm256_storeu_si256((__m256i *)out[b].q, p);
    }
}

void ts_quantize_rows_q8(const float *x, int64_t m, int64_t k, int64_t ldx, void *out, int nthreads) {
    block_q8x *o = out;
#pragma omp parallel for schedule(static) num_threads(m > 4 ? nthreads : 1)
    for (int64_t i = 0; i < m; i++) quantize_row(x + i * ldx, k, o + i * (k / QK));
}

static inline int32_t dword(const int8_t *q, int g) {
    int32_t v;
    memcpy(&v, q + 4 * g, 4);
    return v;
}

/* A small-batch product is the weights' read (inference-optimization 8.1),
 * and the hardware prefetchers alone did not keep it at the memory's speed:
 * on a 2-core Sapphire Rapids Xeon a batch-1 product read 9-19 GB/s by
 * format where torch's sum reads 20-23. Each tile fetches the weight stream
 * PREFETCH_AHEAD bytes ahead of the block it multiplies (a thread's panels
 * lie back to back, so the stream runs on into its next panel): 17-23
 * GB/s. Only loads of the same bytes move earlier; no result changes. */
#define PREFETCH_AHEAD 4096
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *blk, const int fmt) {
    for (int64_t l = 0; l < panel_block_bytes(fmt); l += 64)
        _mm_prefetch((const char *)blk + PREFETCH_AHEAD + l, _MM_HINT_T0);
}

/* The offset o of a format's stored codes u = q + o (Q6_K's is its own, 32). */
static inline int code_offset(const int fmt) {
    return fmt == TS_Q8_0 ? 128 : fmt == TS_Q4_0 ? 8 : fmt == TS_MXFP4 ? MXFP4_OFFSET : 0;
}

#if defined(__AVX512F__)
/* Block b's scales for its 16 panel rows (every format but Q6_K): d_w, and
 * m_w for the formats with a minimum; a K-quant's d * sc and -dmin * m
 * (exact in float32). The VNNI kernel computes them per block and input
 * tile, the AMX path once a panel: the same operations, the same bits. */
static inline __attribute__((always_inline)) void block_scales(const uint8_t *panel, int64_t b, const uint8_t *blk,
                                                               const int fmt, __m512 *dw, __m512 *mw) {
    *mw = _mm512_setzero_ps();
    if (fmt == TS_Q4_K || fmt == TS_Q5_K) {
        const uint8_t *head = q4k_head(panel, b, fmt);
        *dw = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)head)),
                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)blk))));
        *mw = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(head + 32))),
                            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16)))));
    } else if (fmt == TS_MXFP4) {
        *dw = _mm512_loadu_ps((const float *)blk);
    } else {
        *dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        if (fmt == TS_Q4_1) *mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
    }
}

/* Group g of a 4-bit block's packed codes c as byte codes u: lo for values
 * 4g + t, hi for 16 + 4g + t; MXFP4's through its value table, Q5_K's
 * fifth bits (h5: the block's 64 bytes of them) or-ed on. */
static inline __attribute__((always_inline)) void group_codes(const __m512i c, const __m512i h5, const int g,
                                                              const int fmt, __m512i *lo, __m512i *hi) {
    const __m512i low = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
    *lo = _mm512_and_si512(c, low), *hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
    if (fmt == TS_MXFP4) {
        const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(MXFP4_LUT));
        *lo = _mm512_shuffle_epi8(lut, *lo), *hi = _mm512_shuffle_epi8(lut, *hi);
    }
    if (fmt == TS_Q5_K) {  // bit g -> 4 (the low nibble's value), bit 4 + g -> 4 (the high's)
        *lo = _mm512_or_si512(*lo, _mm512_and_si512(_mm512_slli_epi16(h5, 4 - g), fifth));
        *hi = _mm512_or_si512(*hi, _mm512_and_si512(_mm512_srli_epi16(h5, g), fifth));
    }
}
#endif

/* o[i * 16 + r] = input row i . panel row r, for i < nr. Constant nr and fmt
 * (always inlined from a switch) keep the sums in registers. The integer
 * offset o * sum(q_x) is taken off before the conversion to float. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* 8 input rows a tile (32 vector registers hold their sums): a K-quant
 * block's unpacking (Q6_K's 6-bit codes: ~50 operations a block) is shared
 * by twice the rows as with 4. Alone at 16 rows, Q6_K 1.2-1.3x, Q4_K
 * 1.05-1.1x; Q8_0 / Q4_0 / Q4_1 unchanged. AVX2 (16 registers) keeps 4. */
#define QTILE_ROWS 8
static inline __attribute__((always_inline)) void qtile(const uint8_t *panel, int64_t nb, const block_q8x *x,
                                                        const int nr, const int fmt, float *o) {
    const int offset = code_offset(fmt);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[QTILE_ROWS];
    for (int i = 0; i < nr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = panel_block(panel, b, fmt);
        prefetch_ahead(blk, fmt);
        if (fmt == TS_Q6_K) {  // two sums a block, each with its own scale d * sc (exact in float32)
            const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)q6k_head(panel, b)));
            const __m512 da = _mm512_mul_ps(d16, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)blk))));
            const __m512 db = _mm512_mul_ps(d16, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 16)))));
            const uint8_t *codes = blk + 32, *high = blk + 32 + 256;
            const __m512i two = _mm512_set1_epi8(0x03);
            __m512i sa[QTILE_ROWS], sb[QTILE_ROWS];
            for (int i = 0; i < nr; i++) sa[i] = sb[i] = _mm512_setzero_si512();
            for (int g = 0; g < 4; g++) {
                const __m512i c = _mm512_loadu_si512(codes + 64 * g);
                __m512i h = _mm512_loadu_si512(high + 64 * (g >> 1));
                if (g & 1) h = _mm512_srli_epi16(h, 4);
                const __m512i lo = _mm512_or_si512(_mm512_and_si512(c, low),
                                                   _mm512_slli_epi16(_mm512_and_si512(h, two), 4));
                const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(c, 4), low),
                                                   _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2), two), 4));
                for (int i = 0; i < nr; i++) {
                    sa[i] = _mm512_dpbusd_epi32(sa[i], lo, _mm512_set1_epi32(dword(x[i * nb + b].q, g)));
                    sb[i] = _mm512_dpbusd_epi32(sb[i], hi, _mm512_set1_epi32(dword(x[i * nb + b].q, g + 4)));
                }
            }
            for (int i = 0; i < nr; i++) {
                const block_q8x *xb = x + i * nb + b;
                const __m512 xd = _mm512_set1_ps(xb->d);
                sa[i] = _mm512_sub_epi32(sa[i], _mm512_set1_epi32(32 * xb->sum_lo));
                sb[i] = _mm512_sub_epi32(sb[i], _mm512_set1_epi32(32 * (xb->sum - xb->sum_lo)));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sa[i]), _mm512_mul_ps(da, xd), acc[i]);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sb[i]), _mm512_mul_ps(db, xd), acc[i]);
            }
            continue;
        }
        __m512 dw, mw;
        block_scales(panel, b, blk, fmt, &dw, &mw);
        const uint8_t *codes = blk + codes_offset(fmt);
        __m512i isum[QTILE_ROWS];
        for (int i = 0; i < nr; i++) isum[i] = _mm512_setzero_si512();
        if (fmt == TS_Q8_0) {
            for (int g = 0; g < 8; g++) {
                const __m512i c = _mm512_loadu_si512(codes + 64 * g);
                for (int i = 0; i < nr; i++)
                    isum[i] = _mm512_dpbusd_epi32(isum[i], c, _mm512_set1_epi32(dword(x[i * nb + b].q, g)));
            }
        } else {
            const __m512i h5 = fmt == TS_Q5_K ? _mm512_loadu_si512(codes + 256) : _mm512_setzero_si512();
            for (int g = 0; g < 4; g++) {
                __m512i lo, hi;
                group_codes(_mm512_loadu_si512(codes + 64 * g), h5, g, fmt, &lo, &hi);
                for (int i = 0; i < nr; i++) {
                    isum[i] = _mm512_dpbusd_epi32(isum[i], lo, _mm512_set1_epi32(dword(x[i * nb + b].q, g)));
                    isum[i] = _mm512_dpbusd_epi32(isum[i], hi, _mm512_set1_epi32(dword(x[i * nb + b].q, g + 4)));
                }
            }
        }
        for (int i = 0; i < nr; i++) {
            const block_q8x *xb = x + i * nb + b;
            if (offset) isum[i] = _mm512_sub_epi32(isum[i], _mm512_set1_epi32(offset * xb->sum));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(dw, _mm512_set1_ps(xb->d)), acc[i]);
            if (has_min(fmt)) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xb->s), acc[i]);
        }
    }
    for (int i = 0; i < nr; i++) _mm512_storeu_ps(o + i * PANEL, acc[i]);
}
#else
#define QTILE_ROWS 4
/* 8 int32 sums of 4 byte products each: u unsigned (<= 128), s signed. */
static inline __m256i madd_us(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* One half of the panel (rows 8h .. 8h + 7) over all blocks: 4 rows' sums
 * and accumulators fit the 16 ymm registers (both halves at once spilled
 * at 4 rows, and 2 rows left the product no faster than the float32 one). */
static inline __attribute__((always_inline)) void qtile_half(const uint8_t *panel, int64_t nb, const block_q8x *x,
                                                             const int nr, const int fmt, const int h, float *o) {
    const int offset = fmt == TS_Q4_0 ? 8 : fmt == TS_MXFP4 ? MXFP4_OFFSET : 0;  // Q8_0's +128 is undone on the codes
    const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_setr_epi8(MXFP4_LUT));
    __m256 acc[QTILE_ROWS];
    for (int i = 0; i < nr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = panel_block(panel, b, fmt);
        if (h == 0) prefetch_ahead(blk, fmt);  // the second half reads the panel from the cache
        if (fmt == TS_Q6_K) {  // as the avx512 build: two sums a block, each scaled by its d * sc
            const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(q6k_head(panel, b) + 16 * h)));
            const __m256 da = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 8 * h)))));
            const __m256 db = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 16 + 8 * h)))));
            const uint8_t *codes = blk + 32 + 32 * h, *high = blk + 32 + 256 + 32 * h;
            const __m256i two = _mm256_set1_epi8(0x03), ones = _mm256_set1_epi16(1);
            __m256i sa[QTILE_ROWS], sb[QTILE_ROWS];
            for (int i = 0; i < nr; i++) sa[i] = sb[i] = _mm256_setzero_si256();
            // 6-bit codes: a vpmaddubsw pair sum is at most 2 * 63 * 127 = 16002, so two groups
            // add up in int16 (<= 32004) before vpmaddwd widens them.
            for (int g2 = 0; g2 < 4; g2 += 2) {
                __m256i a16[QTILE_ROWS], b16[QTILE_ROWS];
                for (int i = 0; i < nr; i++) a16[i] = b16[i] = _mm256_setzero_si256();
                for (int g = g2; g < g2 + 2; g++) {
                    const __m256i c = _mm256_loadu_si256((const __m256i *)(codes + 64 * g));
                    __m256i hb = _mm256_loadu_si256((const __m256i *)(high + 64 * (g >> 1)));
                    if (g & 1) hb = _mm256_srli_epi16(hb, 4);
                    const __m256i lo = _mm256_or_si256(_mm256_and_si256(c, low),
                                                       _mm256_slli_epi16(_mm256_and_si256(hb, two), 4));
                    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), low),
                                                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), two), 4));
                    for (int i = 0; i < nr; i++) {
                        a16[i] = _mm256_add_epi16(a16[i], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(dword(x[i * nb + b].q, g))));
                        b16[i] = _mm256_add_epi16(b16[i], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(dword(x[i * nb + b].q, g + 4))));
                    }
                }
                for (int i = 0; i < nr; i++) {
                    sa[i] = _mm256_add_epi32(sa[i], _mm256_madd_epi16(a16[i], ones));
                    sb[i] = _mm256_add_epi32(sb[i], _mm256_madd_epi16(b16[i], ones));
                }
            }
            for (int i = 0; i < nr; i++) {
                const block_q8x *xb = x + i * nb + b;
                const __m256 xd = _mm256_set1_ps(xb->d);
                sa[i] = _mm256_sub_epi32(sa[i], _mm256_set1_epi32(32 * xb->sum_lo));
                sb[i] = _mm256_sub_epi32(sb[i], _mm256_set1_epi32(32 * (xb->sum - xb->sum_lo)));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sa[i]), _mm256_mul_ps(da, xd), acc[i]);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sb[i]), _mm256_mul_ps(db, xd), acc[i]);
            }
            continue;
        }
        const uint8_t *codes = blk + codes_offset(fmt) + 32 * h;
        __m256i isum[QTILE_ROWS];
        for (int i = 0; i < nr; i++) isum[i] = _mm256_setzero_si256();
        if (fmt == TS_Q8_0) {
            for (int g = 0; g < 8; g++) {
                const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(codes + 64 * g)), flip);
                const __m256i a = _mm256_abs_epi8(q);
                for (int i = 0; i < nr; i++) {
                    const __m256i xs = _mm256_set1_epi32(dword(x[i * nb + b].q, g));
                    isum[i] = _mm256_add_epi32(isum[i], madd_us(a, _mm256_sign_epi8(xs, q)));
                }
            }
        } else {
            // 4-bit codes: a vpmaddubsw pair sum is at most 2 * 15 * 127 = 3810, so all 8
            // of a block add up in int16 (<= 30480) before one vpmaddwd widens them; Q5_K's
            // 5-bit ones (2 * 31 * 127 = 7874) and MXFP4's (2 * 24 * 127 = 6096) two groups' four
            // at a time (<= 31496).
            const int span = fmt == TS_Q5_K || fmt == TS_MXFP4 ? 2 : 4;
            const __m256i fifth = _mm256_set1_epi8(0x10);
            __m256i h5 = _mm256_setzero_si256();
            if (fmt == TS_Q5_K) h5 = _mm256_loadu_si256((const __m256i *)(codes + 256));  // this half's 32 bytes
            for (int g0 = 0; g0 < 4; g0 += span) {
                __m256i s16[QTILE_ROWS];
                for (int i = 0; i < nr; i++) s16[i] = _mm256_setzero_si256();
                for (int g = g0; g < g0 + span; g++) {
                    const __m256i c = _mm256_loadu_si256((const __m256i *)(codes + 64 * g));
                    __m256i lo = _mm256_and_si256(c, low), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
                    if (fmt == TS_MXFP4) lo = _mm256_shuffle_epi8(lut, lo), hi = _mm256_shuffle_epi8(lut, hi);
                    if (fmt == TS_Q5_K) {  // as the avx512 build
                        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(h5, 4 - g), fifth));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(h5, g), fifth));
                    }
                    for (int i = 0; i < nr; i++) {
                        const __m256i xl = _mm256_set1_epi32(dword(x[i * nb + b].q, g));
                        const __m256i xh = _mm256_set1_epi32(dword(x[i * nb + b].q, g + 4));
                        s16[i] = _mm256_add_epi16(s16[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl),
                                                                           _mm256_maddubs_epi16(hi, xh)));
                    }
                }
                for (int i = 0; i < nr; i++) {
                    const __m256i w = _mm256_madd_epi16(s16[i], _mm256_set1_epi16(1));
                    isum[i] = g0 ? _mm256_add_epi32(isum[i], w) : w;
                }
            }
        }
        __m256 dw, mw = _mm256_setzero_ps();
        if (fmt == TS_Q4_K || fmt == TS_Q5_K) {  // d * sc and -dmin * m, as the avx512 build computes them
            const uint8_t *head = q4k_head(panel, b, fmt);
            dw = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 16 * h))),
                               _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 8 * h)))));
            mw = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 32 + 16 * h))),
                               _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 16 + 8 * h)))));
        } else if (fmt == TS_MXFP4) {
            dw = _mm256_loadu_ps((const float *)blk + 8 * h);
        } else {
            dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
            if (fmt == TS_Q4_1) mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h)));
        }
        for (int i = 0; i < nr; i++) {
            const block_q8x *xb = x + i * nb + b;
            if (offset) isum[i] = _mm256_sub_epi32(isum[i], _mm256_set1_epi32(offset * xb->sum));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_mul_ps(dw, _mm256_set1_ps(xb->d)), acc[i]);
            if (has_min(fmt)) acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xb->s), acc[i]);
        }
    }
    for (int i = 0; i < nr; i++) _mm256_storeu_ps(o + i * PANEL + 8 * h, acc[i]);
}

static inline __attribute__((always_inline)) void qtile(const uint8_t *panel, int64_t nb, const block_q8x *x,
                                                        const int nr, const int fmt, float *o) {
    qtile_half(panel, nb, x, nr, fmt, 0, o);
    qtile_half(panel, nb, x, nr, fmt, 1, o);
}
#endif

#if QTILE_ROWS == 8
#define QTILE_WIDE(FMT)                                \
    case 4: qtile(panel, nb, x, 4, FMT, o); break;     \
    case 5: qtile(panel, nb, x, 5, FMT, o); break;     \
    case 6: qtile(panel, nb, x, 6, FMT, o); break;     \
    case 7: qtile(panel, nb, x, 7, FMT, o); break;
#else
#define QTILE_WIDE(FMT)
#endif

static void qtile_any(const uint8_t *panel, int64_t nb, const block_q8x *x, int nr, int fmt, float *o) {
#define QTILE_NR(FMT)                                          \
    switch (nr) {                                              \
        case 1: qtile(panel, nb, x, 1, FMT, o); break;         \
        case 2: qtile(panel, nb, x, 2, FMT, o); break;         \
        case 3: qtile(panel, nb, x, 3, FMT, o); break;         \
        QTILE_WIDE(FMT)                                        \
        default: qtile(panel, nb, x, QTILE_ROWS, FMT, o); break; \
    }
    switch (fmt) {
        case TS_Q8_0: QTILE_NR(TS_Q8_0) break;
        case TS_Q4_0: QTILE_NR(TS_Q4_0) break;
        case TS_Q4_K: QTILE_NR(TS_Q4_K) break;
        case TS_Q5_K: QTILE_NR(TS_Q5_K) break;
        case TS_Q6_K: QTILE_NR(TS_Q6_K) break;
        case TS_MXFP4: QTILE_NR(TS_MXFP4) break;
        default: QTILE_NR(TS_Q4_1) break;
    }
#undef QTILE_NR
}

/* Input rows in blocks of QROW_BLOCK stay in L1/L2 while every panel passes over them. */
#define QROW_BLOCK 32
#define AMX_ROWS 16        /* input rows of an AMX tile product (amx_product) */
/* Inputs of fewer rows stay on the VNNI kernel: at 16 rows a panel's unpack
 * serves one tile, and the tiles measured 0.82-1.07x VNNI by format (a 1.7B
 * layer's products, Sapphire Rapids, 2 threads); at 32 rows 0.97-1.12x, at
 * 64 1.13-1.45x (docs/benchmarks.md). */
#define AMX_MIN_ROWS 32
#define AMX_MAX_BLOCKS 256 /* blocks of 32 in an input row the AMX path takes */

typedef struct {
    const uint8_t *w, *up;  /* up: the gate product's second matrix, else NULL */
    int64_t panel_bytes, n; /* n: output columns */
    const float *bias;
    float *y;
    int64_t ldy;
    int acc;
    const float *pre; /* gate: LoRA deltas added to g and u before silu ([m, ldp]: g's at c, u's at n + c), or NULL */
    int64_t ldp;
} QProduct;

static void qfinish(const QProduct *P, int64_t p, int64_t i0, int nr, float *g, float *u);

/* Input rows [i0, i0 + nr) against panel p, then the epilogue. */
static void qpanel(const QProduct *P, const block_q8x *x, int64_t nb, int64_t p, int64_t i0, int nr, int fmt) {
    float g[QTILE_ROWS * PANEL], u[QTILE_ROWS * PANEL];
    const block_q8x *xi = x + i0 * nb;
    qtile_any(P->w + p * P->panel_bytes, nb, xi, nr, fmt, g);
    if (P->up) qtile_any(P->up + p * P->panel_bytes, nb, xi, nr, fmt, u);
    qfinish(P, p, i0, nr, g, P->up ? u : NULL);
}

/* Rows [i0, i0 + nr) of panel p's products g (and u: the gate's up half)
 * into y: silu(g) * u, or g + bias, added into y or stored. */
static void qfinish(const QProduct *P, int64_t p, int64_t i0, int nr, float *g, float *u) {
    const int64_t c0 = p * PANEL, nc = P->n - c0 < PANEL ? P->n - c0 : PANEL;
    if (u) {
        for (int i = 0; i < nr; i++) {
            if (P->pre) {  // adapters' gate and up products (ts_lora_rows), before the activation
                const float *pr = P->pre + (i0 + i) * P->ldp;
                for (int64_t c = 0; c < nc; c++) {
                    g[i * PANEL + c] += pr[c0 + c];
                    u[i * PANEL + c] += pr[P->n + c0 + c];
                }
            }
#if defined(__AVX512F__)  // silu16 does silu8's operations lane for lane: the builds agree
            _mm512_storeu_ps(g + i * PANEL, _mm512_mul_ps(silu16(_mm512_loadu_ps(g + i * PANEL)),
                                                          _mm512_loadu_ps(u + i * PANEL)));
#else
            for (int h = 0; h < PANEL; h += 8)
                _mm256_storeu_ps(g + i * PANEL + h, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i * PANEL + h)),
                                                                  _mm256_loadu_ps(u + i * PANEL + h)));
#endif
        }
    }
    for (int i = 0; i < nr; i++) {
        float *yr = P->y + (i0 + i) * P->ldy + c0;
        const float *gi = g + i * PANEL;
        int64_t c = 0;
        for (; nc == PANEL && c < PANEL; c += 8) {  // the same adds, 8 lanes at a time
            const __m256 v = _mm256_add_ps(_mm256_loadu_ps(gi + c),  // + 0 as below: -0 becomes +0 alike
                                           P->bias ? _mm256_loadu_ps(P->bias + c0 + c) : _mm256_setzero_ps());
            _mm256_storeu_ps(yr + c, P->acc ? _mm256_add_ps(_mm256_loadu_ps(yr + c), v) : v);
        }
        for (; c < nc; c++) {
            const float v = gi[c] + (P->bias ? P->bias[c0 + c] : 0.0f);
            yr[c] = P->acc ? yr[c] + v : v;
        }
    }
}

/* The AMX-INT8 products (below), for inputs of at least AMX_MIN_ROWS rows. */
static int amx_product(const float *x, int64_t m, int64_t k, int64_t ldx, const QProduct *P, int fmt, int nthreads);

static int qproduct(const float *x, int64_t m, int64_t k, int64_t ldx, const QProduct *P, int fmt, int amx,
                    int nthreads) {
    const int64_t nb = k / QK, panels = (P->n + PANEL - 1) / PANEL;
    // Tiles for prefill-sized inputs; rows of up to 8,192 values (a row's blocks are repacked on the stack).
    // K-quants run on the vector kernels (their tile path is not written).
    if (amx && has_tiles(fmt) && m >= AMX_MIN_ROWS && nb <= AMX_MAX_BLOCKS) return amx_product(x, m, k, ldx, P, fmt, nthreads);
    block_q8x *xq = malloc(sizeof(block_q8x) * (m * nb > 0 ? m * nb : 1));
    if (xq == NULL) return 1;
    ts_quantize_rows_q8(x, m, k, ldx, xq, nthreads);
#pragma omp parallel num_threads(nthreads)
    for (int64_t m0 = 0; m0 < m; m0 += QROW_BLOCK) {
        const int64_t m1 = m - m0 < QROW_BLOCK ? m : m0 + QROW_BLOCK;
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++)
            for (int64_t i0 = m0; i0 < m1; i0 += QTILE_ROWS)
                qpanel(P, xq, nb, p, i0, m1 - i0 < QTILE_ROWS ? (int)(m1 - i0) : QTILE_ROWS, fmt);
    }
    free(xq);
    return 0;
}

#if defined(__AVX512F__)
/* ------------------------------------------------------------------ AMX-INT8 products
 *
 * Where the CPU has AMX-INT8 and a product has >= AMX_MIN_ROWS input rows (prefill
 * chunks), the integer dot products run as tile products: TDPBSUD
 * multiplies 16 input rows' codes of one block (A: 16 x 32 signed bytes,
 * the rows quantized straight into contiguous tiles, amx_block) by one panel's codes of that block
 * (B: 8 x 64 unsigned bytes, the panel's code groups as they are for Q8_0,
 * the 4-bit codes unpacked once per panel for Q4), into 16 x 16 exact int32
 * sums: the same integers as vpdpbusd. The float steps after them are the
 * VNNI tile's, block by block in order (convert, scale by d_w * d_x, add;
 * Q4_1's and Q4_K's m_w * s_x), so the results are bit-identical to the other
 * builds. A panel's Q4_K, Q5_K and MXFP4 codes are unpacked once into the
 * same byte codes (Q5_K's fifth bits or-ed on, MXFP4's through its table)
 * and their scales computed once as the vector kernel computes them (d * sc,
 * -dmin * m).
 * The scale step is per block (the formats share no scale across blocks)
 * and the tile products run at the tile unit's latency (8 tile registers:
 * four accumulators, two A/B pairs), so each product is issued between the
 * scale steps of earlier blocks (amx_rows): a 1.7B layer's products at 64
 * rows ran Q4_K 1.31x and Q5_K 1.45x the VNNI kernel (their scales computed
 * once a panel here, once a block per input tile there), Q8_0, Q4_0, Q4_1
 * and MXFP4 1.13-1.27x; at 512 rows 0.98-1.33x (`bench products`). */
#define AMX_GROUP 4

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} QTileConfig;

/* One panel's codes as B tiles (512 bytes a block: 8 groups of 4 codes x 16
 * rows, group g = values 4g .. 4g + 3) and its scales as floats (16 a block:
 * dw, and mw for the formats with a minimum). */
static void unpack_panel(const uint8_t *panel, int64_t nb, int fmt, uint8_t *codes, float *dw, float *mw) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = panel_block(panel, b, fmt);
        uint8_t *cb = codes + b * 512;
        __m512 d, m;
        block_scales(panel, b, blk, fmt, &d, &m);
        _mm512_storeu_ps(dw + b * PANEL, d);
        if (has_min(fmt)) _mm512_storeu_ps(mw + b * PANEL, m);
        const uint8_t *c = blk + codes_offset(fmt);
        if (fmt == TS_Q8_0) {
            memcpy(cb, c, 512);
            continue;
        }
        const __m512i h5 = fmt == TS_Q5_K ? _mm512_loadu_si512(c + 256) : _mm512_setzero_si512();
        for (int g = 0; g < 4; g++) {  // group g's low nibbles are k = 4g + t, its high nibbles k = 16 + 4g + t
            __m512i lo, hi;
            group_codes(_mm512_loadu_si512(c + 64 * g), h5, g, fmt, &lo, &hi);
            _mm512_storeu_si512(cb + 64 * g, lo);
            _mm512_storeu_si512(cb + 64 * (g + 4), hi);
        }
    }
}

/* A tile of 16 input rows, repacked so each tile product reads 512
 * contiguous bytes (the block_q8x rows are 48 * nb bytes apart: loading 16
 * scattered lines from L2 stalled the tile unit): per block, the 16 rows'
 * codes, then their d, s and sums. */
typedef struct {
    int8_t q[AMX_ROWS][QK];
    float d[AMX_ROWS], s[AMX_ROWS];
    int32_t sum[AMX_ROWS];
    int32_t pad[AMX_ROWS];
} amx_block;

/* Row tile t of x quantized straight into its amx_blocks (rows past m: zero blocks). */
static void amx_quantize_tile(const float *x, int64_t m, int64_t k, int64_t ldx, int64_t t, amx_block *out) {
    const int64_t nb = k / QK;
    block_q8x row[AMX_MAX_BLOCKS];
    for (int i = 0; i < AMX_ROWS; i++) {
        const int64_t r = t * AMX_ROWS + i;
        if (r < m) quantize_row(x + r * ldx, k, row);
        for (int64_t b = 0; b < nb; b++) {
            amx_block *o = out + t * nb + b;
            if (r < m) {
                memcpy(o->q[i], row[b].q, QK);
                o->d[i] = row[b].d, o->s[i] = row[b].s, o->sum[i] = row[b].sum;
            } else {
                memset(o->q[i], 0, QK);
                o->d[i] = o->s[i] = 0.0f, o->sum[i] = 0;
            }
        }
    }
}

/* Block b's tile product into tmm t (A and B tiles alternate between two
 * pairs, 4/6 and 5/7; tile numbers must be constants). */
#define AMX_PRODUCT(t, A, B, b)                                                                \
    {                                                                                          \
        _tile_zero(t);                                                                         \
        _tile_loadd(A, x[b].q, QK);                                                            \
        _tile_loadd(B, codes + (b) * 512, 64);                                                 \
        _tile_dpbsud(t, A, B);                                                                 \
    }

/* The scale step of block b from its stored sums c: the vector kernel's
 * float steps, row by row, into the accumulators a0 .. a15. They are 16
 * named variables, not an array: GCC's tile intrinsics are inline asm with
 * a memory clobber, which forced an array through the stack (16 loads and
 * 16 stores) around every tile instruction. Named: 1.18x the array's speed
 * (20.1 vs 23.7 ns a block of a 16 x 16 tile, one thread, Sapphire Rapids).
 * Tried and not kept: the codes as bf16 in TDPBF16PS (exact for these
 * integers, no convert or offset step, but twice the tile bytes: 22.4 ns);
 * products and scale steps issued in pairs (no change). */
#define AMX_ACC(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#define AMX_SCALE_ROW(i)                                                                       \
    {                                                                                          \
        __m512i isum = _mm512_load_si512(c_ + i * PANEL);                                      \
        if (offset_) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(offset_ * xb_->sum[i]));  \
        a##i = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dwv_, _mm512_set1_ps(xb_->d[i])), a##i); \
        if (has_min(fmt)) a##i = _mm512_fmadd_ps(mwv_, _mm512_set1_ps(xb_->s[i]), a##i);      \
    }
#define AMX_SCALE(b, c)                                                                        \
    {                                                                                          \
        const amx_block *xb_ = x + (b);                                                        \
        const int32_t *c_ = (c);                                                               \
        const int offset_ = code_offset(fmt);                                                   \
        const __m512 dwv_ = _mm512_loadu_ps(dw + (b) * PANEL);                                 \
        const __m512 mwv_ = has_min(fmt) ? _mm512_loadu_ps(mw + (b) * PANEL) : _mm512_setzero_ps(); \
        AMX_ACC(AMX_SCALE_ROW)                                                                 \
    }

/* o[i * 16 + c] = input row i of the tile x (nb blocks) . panel column c.
 * Blocks in groups of four, one per C tile (tmm0-3). At group g: its sums
 * are stored, then each of group g + 1's four products is issued between
 * the scale steps of group g - 1's blocks (stored one group earlier, so
 * long in L1): the tile unit multiplies while the vector unit scales. Issued
 * all at once instead, the products' waits on their A/B tiles held up the
 * scale steps behind them, and the two ran one after the other. */
#define AMX_STEP(t, A, B)                                                                      \
    if (next + t < nb) AMX_PRODUCT(t, A, B, next + t)                                          \
    if (g > 0) AMX_SCALE(last + t, sums[(g - 1) & 1] + t * AMX_ROWS * PANEL)
__attribute__((target("amx-tile,amx-int8"))) static void amx_rows(const amx_block *x, int64_t nb,
                                                                 const uint8_t *codes, const float *dw,
                                                                 const float *mw, const int fmt, float *o) {
    int32_t sums[2][AMX_GROUP * AMX_ROWS * PANEL] __attribute__((aligned(64)));
#define AMX_ZERO(i) __m512 a##i = _mm512_setzero_ps();
    AMX_ACC(AMX_ZERO)
    const int64_t groups = (nb + AMX_GROUP - 1) / AMX_GROUP;
    AMX_PRODUCT(0, 4, 6, 0)
    if (nb > 1) AMX_PRODUCT(1, 5, 7, 1)
    if (nb > 2) AMX_PRODUCT(2, 4, 6, 2)
    if (nb > 3) AMX_PRODUCT(3, 5, 7, 3)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t first = g * AMX_GROUP, next = first + AMX_GROUP, last = first - AMX_GROUP;
        int32_t *c = sums[g & 1];
        _tile_stored(0, c, 64);
        if (first + 1 < nb) _tile_stored(1, c + 1 * AMX_ROWS * PANEL, 64);
        if (first + 2 < nb) _tile_stored(2, c + 2 * AMX_ROWS * PANEL, 64);
        if (first + 3 < nb) _tile_stored(3, c + 3 * AMX_ROWS * PANEL, 64);
        AMX_STEP(0, 4, 6) AMX_STEP(1, 5, 7) AMX_STEP(2, 4, 6) AMX_STEP(3, 5, 7)
    }
    const int64_t first = (groups - 1) * AMX_GROUP;  // the last group, stored above
    for (int64_t t = 0; t < AMX_GROUP && first + t < nb; t++) AMX_SCALE(first + t, sums[(groups - 1) & 1] + t * AMX_ROWS * PANEL)
#define AMX_OUT(i) _mm512_storeu_ps(o + i * PANEL, a##i);
    AMX_ACC(AMX_OUT)
}

static void amx_rows_any(const amx_block *x, int64_t nb, const uint8_t *codes, const float *dw, const float *mw,
                         int fmt, float *o) {
    switch (fmt) {  // a constant format inside: the offset and minimum tests fold away
        case TS_Q8_0: amx_rows(x, nb, codes, dw, mw, TS_Q8_0, o); break;
        case TS_Q4_0: amx_rows(x, nb, codes, dw, mw, TS_Q4_0, o); break;
        case TS_Q4_K: amx_rows(x, nb, codes, dw, mw, TS_Q4_K, o); break;
        case TS_Q5_K: amx_rows(x, nb, codes, dw, mw, TS_Q5_K, o); break;
        case TS_MXFP4: amx_rows(x, nb, codes, dw, mw, TS_MXFP4, o); break;
        default: amx_rows(x, nb, codes, dw, mw, TS_Q4_1, o);
    }
}

/* Asks Linux for the AMX tile state (once per process): 1 if granted. */
int ts_quant_amx_init(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return granted;
}

/* Panels split across threads; each unpacks its panel once (and the up
 * panel of a gate), then runs every 16-row tile of the input against it. */
__attribute__((target("amx-tile,amx-int8"))) static int amx_product(const float *x, int64_t m, int64_t k,
                                                                   int64_t ldx, const QProduct *P, int fmt,
                                                                   int nthreads) {
    const int64_t nb = k / QK, panels = (P->n + PANEL - 1) / PANEL, tiles = (m + AMX_ROWS - 1) / AMX_ROWS;
    amx_block *xa = aligned_alloc(64, sizeof(amx_block) * tiles * nb);
    if (xa == NULL) return 1;
    int failed = 0;
    // One parallel region: the input rows quantized into tiles, then the panels (one barrier between).
#pragma omp parallel num_threads(nthreads) reduction(+ : failed)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) amx_quantize_tile(x, m, k, ldx, t, xa);
        const int halves = P->up ? 2 : 1;
        uint8_t *codes = aligned_alloc(64, (size_t)halves * nb * (512 + 2 * PANEL * sizeof(float)));
        failed += codes == NULL;
        {  // every thread meets the worksharing loop; one without memory skips its panels
            float *dw = (float *)(codes + halves * nb * 512), *mw = dw + halves * nb * PANEL;
            QTileConfig cfg;
            memset(&cfg, 0, sizeof cfg);
            cfg.palette = 1;
            for (int t = 0; t < 4; t++) cfg.colsb[t] = 64, cfg.rows[t] = AMX_ROWS;     /* C: 16 x 16 int32 */
            for (int t = 4; t < 6; t++) cfg.colsb[t] = QK, cfg.rows[t] = AMX_ROWS;     /* A: 16 rows x 32 codes */
            for (int t = 6; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = QK / 4;       /* B: 8 x (16 rows x 4) */
            _tile_loadconfig(&cfg);
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                if (codes == NULL) continue;
                for (int h = 0; h < halves; h++)
                    unpack_panel((h ? P->up : P->w) + p * P->panel_bytes, nb, fmt, codes + h * nb * 512,
                                 dw + h * nb * PANEL, mw + h * nb * PANEL);
                float g[AMX_ROWS * PANEL], u[AMX_ROWS * PANEL];
                for (int64_t i0 = 0; i0 < m; i0 += AMX_ROWS) {
                    const amx_block *xt = xa + i0 / AMX_ROWS * nb;
                    amx_rows_any(xt, nb, codes, dw, mw, fmt, g);
                    if (P->up) amx_rows_any(xt, nb, codes + nb * 512, dw + nb * PANEL, mw + nb * PANEL, fmt, u);
                    qfinish(P, p, i0, m - i0 < AMX_ROWS ? (int)(m - i0) : AMX_ROWS, g, P->up ? u : NULL);
                }
            }
            _tile_release();
            free(codes);
        }
    }
    free(xa);
    return failed;
}
#else
int ts_quant_amx_init(void) { return 0; }
static int amx_product(const float *x, int64_t m, int64_t k, int64_t ldx, const QProduct *P, int fmt, int nthreads) {
    return -1;  // not in this build; the caller never asks
}
#endif

/* The fewest input rows with which a product of format fmt runs on AMX-INT8
 * tiles in this build, where the caller allows them; 0: no tile path. */
int ts_quant_tile_rows(int fmt) {
#if defined(__AVX512F__)
    return has_tiles(fmt) ? AMX_MIN_ROWS : 0;
#else
    return 0;
#endif
}

/* y[i, r] = (acc ? y[i, r] : 0) + bias[r] + x[i, :] . w[r, :] for i < m, r < n;
 * w as panels (quant.py pack_panels). Returns nonzero when the input blocks
 * found no memory (nothing is written). */
int ts_qlinear(const float *x, int64_t m, int64_t k, int64_t ldx, const void *w, int fmt, int64_t n,
               const float *bias, float *y, int64_t ldy, int acc, int amx, int nthreads) {
    QProduct P = {w, NULL, (k / QK) * panel_block_bytes(fmt), n, bias, y, ldy, acc, NULL, 0};
    return qproduct(x, m, k, ldx, &P, fmt, amx, nthreads);
}

/* y[i, r] = silu(x[i] . gate[r] + pre[i, r]) * (x[i] . up[r] + pre[i, inter + r]) for r < inter
 * (pre: LoRA deltas, or NULL for none). */
int ts_qgate_up_silu(const float *x, int64_t m, int64_t k, int64_t ldx, const void *gate, const void *up, int fmt,
                     int64_t inter, float *y, int64_t ldy, const float *pre, int64_t ldp, int amx, int nthreads) {
    QProduct P = {gate, up, (k / QK) * panel_block_bytes(fmt), inter, NULL, y, ldy, 0, pre, ldp};
    return qproduct(x, m, k, ldx, &P, fmt, amx, nthreads);
}

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* out[i, :] = the float values of row ids[i] of the panels w (an embedding
 * lookup in a tied LM head): d * (u - o) (+ m for Q4_1 and Q4_K), as gguf dequantizes. */
void ts_dequant_rows(const void *w, int fmt, int64_t k, const int64_t *ids, int64_t m, float *out, int64_t ldo) {
    const int64_t pb = panel_block_bytes(fmt), nb = k / QK;
    for (int64_t i = 0; i < m; i++) {
        const int64_t r = ids[i] % PANEL;
        const uint8_t *panel = (const uint8_t *)w + (ids[i] / PANEL) * nb * pb;
        float *o = out + i * ldo;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = panel_block(panel, b, fmt);
            const int kq = fmt == TS_Q4_K || fmt == TS_Q5_K;
            float d = kq ? f16(q4k_head(panel, b, fmt) + 2 * r) * (float)blk[r] : f16(blk + 2 * r);
            float *ob = o + b * QK;
            if (fmt == TS_MXFP4) {
                static const int8_t value[16] = {MXFP4_LUT};
                const uint8_t *codes = blk + 64;
                memcpy(&d, blk + 4 * r, 4);
                for (int j = 0; j < QK / 2; j++) {
                    const uint8_t byte = codes[64 * (j / 4) + 4 * r + j % 4];
                    ob[j] = d * (float)(value[byte & 0x0F] - MXFP4_OFFSET);
                    ob[j + QK / 2] = d * (float)(value[byte >> 4] - MXFP4_OFFSET);
                }
                continue;
            }
            if (fmt == TS_Q6_K) {
                const float d16 = f16(q6k_head(panel, b) + 2 * r);
                const float da = d16 * (float)(int8_t)blk[r], db = d16 * (float)(int8_t)blk[16 + r];
                const uint8_t *codes = blk + 32, *high = blk + 32 + 256;
                for (int j = 0; j < QK / 2; j++) {
                    const int g = j / 4, lane = 4 * r + j % 4;
                    const uint8_t byte = codes[64 * g + lane], hb = high[64 * (g >> 1) + lane] >> (4 * (g & 1));
                    ob[j] = da * (float)((int)((byte & 0x0F) | (hb & 3) << 4) - 32);
                    ob[j + QK / 2] = db * (float)((int)((byte >> 4) | ((hb >> 2) & 3) << 4) - 32);
                }
                continue;
            }
            if (fmt == TS_Q8_0) {
                const uint8_t *codes = blk + 32;
                for (int j = 0; j < QK; j++) ob[j] = d * (float)((int)codes[64 * (j / 4) + 4 * r + j % 4] - 128);
            } else {
                const uint8_t *codes = blk + codes_offset(fmt);
                const float mn = fmt == TS_Q4_1   ? f16(blk + 32 + 2 * r)
                                 : kq ? f16(q4k_head(panel, b, fmt) + 32 + 2 * r) * (float)blk[16 + r]
                                      : 0.0f;
                const int o4 = has_min(fmt) ? 0 : 8;
                for (int j = 0; j < QK / 2; j++) {
                    const int g = j / 4, lane = 4 * r + j % 4;
                    const uint8_t byte = codes[64 * g + lane], h5 = fmt == TS_Q5_K ? codes[256 + lane] : 0;
                    ob[j] = d * (float)((byte & 0x0F) + ((h5 >> g) & 1) * 16 - o4) + mn;
                    ob[j + QK / 2] = d * (float)((byte >> 4) + ((h5 >> (4 + g)) & 1) * 16 - o4) + mn;
                }
            }
        }
    }
}
