/* Latent attention (DeepSeek V2 / V3's MLA, absorbed: model/mla.py) over the
 * paged pool, one query row at a time.
 *
 * Every head of a row attends over the same cached rows [c, k_pe] (dk values
 * a token: the latent and the RoPE key), and the value is the row's first dv
 * values (the latent). A task takes HEADS of a row's heads: a scoring pass
 * reads two keys once for all of them, the weights come from the kernels'
 * vector exp, and the weighted latents are summed with 8 outputs of every
 * head in registers while a part's keys go by. The rows are 576 values wide
 * at DeepSeek's size, past the other attention kernels' 256.
 *
 * A row's arithmetic depends only on its own query, its context length and
 * the pool's block size: its bits do not depend on the batch around it. The
 * engine runs its decode rows here (model/mla.py; a prefill chunk's rows run
 * faster in torch's SDPA than one row at a time). The softmax is exact (its
 * running max rescales once per part of at most KB keys of one block).
 *
 * Pool: [num_blocks, 1, bs, dk], float32 or bf16 (bf16 != 0). q: row r's H
 * queries of dk floats at q + r * q_stride (scaled here); out: row r's H x dv
 * floats at out + r * out_stride. Row i of the n to compute is rows[i]; its
 * block table starts at tables[table_start[i]] and it sees ctx[i] keys.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd_math.h"

#define KB 64       /* keys scored at once (a block of more is taken in parts) */
#define HEADS 4     /* heads a task takes: its outputs stay in the L1 cache */
#define DK_MAX 1152 /* row width a task's scaled queries hold */
#define DV_MAX 1024 /* value width its accumulators hold */

/* 8 values of a row from e (a multiple of 8; rows are read 8 at a time, the
 * widths' tails one value at a time). */
static inline __m256 load8(const void *row, int64_t e, int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + e))), 16));
    return _mm256_loadu_ps((const float *)row + e);
}

static inline float load1(const void *row, int64_t e, int bf16) {
    if (bf16) {
        uint32_t b = (uint32_t)((const uint16_t *)row)[e] << 16;
        float f;
        memcpy(&f, &b, sizeof f);
        return f;
    }
    return ((const float *)row)[e];
}

/* s[h][j] = q_h . k_j for the task's nh heads and keys j of `keys` (nk of
 * them, row_bytes apart). Two keys a pass: each key vector is loaded once
 * for all heads, each query vector once for both keys. A (key, head) score is
 * its own accumulator's, so it does not depend on the keys or heads beside it. */
static void score(const float (*qs)[DK_MAX], int64_t nh, const char *keys, size_t row_bytes, int64_t nk,
                  int64_t dk, int bf16, float (*s)[KB]) {
    const int64_t d8 = dk & ~(int64_t)7;
    int64_t j = 0;
    for (; j + 2 <= nk; j += 2) {
        const void *k0 = keys + (size_t)j * row_bytes, *k1 = keys + (size_t)(j + 1) * row_bytes;
        __m256 a0[HEADS], a1[HEADS];
        for (int64_t h = 0; h < HEADS; h++) a0[h] = a1[h] = _mm256_setzero_ps();
        for (int64_t e = 0; e < d8; e += 8) {
            const __m256 x0 = load8(k0, e, bf16), x1 = load8(k1, e, bf16);
            for (int64_t h = 0; h < nh; h++) {
                const __m256 q = _mm256_loadu_ps(qs[h] + e);
                a0[h] = _mm256_fmadd_ps(q, x0, a0[h]);
                a1[h] = _mm256_fmadd_ps(q, x1, a1[h]);
            }
        }
        for (int64_t h = 0; h < nh; h++) {
            float t0 = hsum8(a0[h]), t1 = hsum8(a1[h]);
            for (int64_t e = d8; e < dk; e++) {
                t0 = fmaf(qs[h][e], load1(k0, e, bf16), t0);
                t1 = fmaf(qs[h][e], load1(k1, e, bf16), t1);
            }
            s[h][j] = t0, s[h][j + 1] = t1;
        }
    }
    for (; j < nk; j++) {  /* the part's last key when it has an odd number: alone, the same arithmetic */
        const void *k0 = keys + (size_t)j * row_bytes;
        __m256 a0[HEADS];
        for (int64_t h = 0; h < HEADS; h++) a0[h] = _mm256_setzero_ps();
        for (int64_t e = 0; e < d8; e += 8) {
            const __m256 x0 = load8(k0, e, bf16);
            for (int64_t h = 0; h < nh; h++) a0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[h] + e), x0, a0[h]);
        }
        for (int64_t h = 0; h < nh; h++) {
            float t0 = hsum8(a0[h]);
            for (int64_t e = d8; e < dk; e++) t0 = fmaf(qs[h][e], load1(k0, e, bf16), t0);
            s[h][j] = t0;
        }
    }
}

/* o[h] = o[h] * keep[h] + sum_j p[h][j] v_j (v_j: key j's first dv values),
 * 8 outputs of every head in registers while the part's keys go by, so each
 * value vector is loaded once for all heads and the outputs once a part. */
static void weigh(float (*o)[DV_MAX], const float *keep, const float (*p)[KB], int64_t nh, const char *keys,
                  size_t row_bytes, int64_t nk, int64_t dv, int bf16) {
    const int64_t d8 = dv & ~(int64_t)7;
    for (int64_t e = 0; e < d8; e += 8) {
        __m256 acc[HEADS];
        for (int64_t h = 0; h < nh; h++) acc[h] = _mm256_mul_ps(_mm256_loadu_ps(o[h] + e), _mm256_set1_ps(keep[h]));
        for (int64_t j = 0; j < nk; j++) {
            const __m256 v = load8(keys + (size_t)j * row_bytes, e, bf16);
            for (int64_t h = 0; h < nh; h++) acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(p[h][j]), v, acc[h]);
        }
        for (int64_t h = 0; h < nh; h++) _mm256_storeu_ps(o[h] + e, acc[h]);
    }
    for (int64_t e = d8; e < dv; e++)
        for (int64_t h = 0; h < nh; h++) {
            float t = o[h][e] * keep[h];
            for (int64_t j = 0; j < nk; j++) t = fmaf(p[h][j], load1(keys + (size_t)j * row_bytes, e, bf16), t);
            o[h][e] = t;
        }
}

/* Returns 0, or -1 when the widths are past DK_MAX / DV_MAX or dv > dk (nothing written). */
int ts_latent_attention(const float *q, int64_t q_stride, int64_t n, int64_t H, int64_t dk, int64_t dv,
                        const void *pool, int64_t bf16, int64_t bs, const int64_t *tables,
                        const int64_t *table_start, const int64_t *ctx, const int64_t *rows, float scale,
                        float *out, int64_t out_stride, int threads) {
    if (dk > DK_MAX || dv > DV_MAX || dv > dk) return -1;
    const int64_t chunks = (H + HEADS - 1) / HEADS;
    const size_t row_bytes = (size_t)dk * (bf16 ? 2 : 4);
    const char *base = (const char *)pool;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < n; i++) {
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t r = rows[i], h0 = c * HEADS, nh = H - h0 < HEADS ? H - h0 : HEADS, len = ctx[i];
            const int64_t *table = tables + table_start[i];
            float qs[HEADS][DK_MAX], o[HEADS][DV_MAX], m[HEADS], l[HEADS], keep[HEADS], s[HEADS][KB];
            for (int64_t h = 0; h < nh; h++) {
                const float *qh = q + r * q_stride + (h0 + h) * dk;
                for (int64_t e = 0; e < dk; e++) qs[h][e] = qh[e] * scale;
                memset(o[h], 0, sizeof(float) * dv);
                m[h] = -INFINITY, l[h] = 0.0f;
            }
            for (int64_t t0 = 0, t1; t0 < len; t0 = t1) {
                /* keys t0 .. t1 - 1: at most KB, inside one block */
                const int64_t in_block = t0 % bs, block_end = t0 - in_block + bs;
                t1 = t0 + KB < len ? t0 + KB : len;
                if (t1 > block_end) t1 = block_end;
                const char *keys = base + ((size_t)table[t0 / bs] * bs + in_block) * row_bytes;
                const int64_t nk = t1 - t0;
                score(qs, nh, keys, row_bytes, nk, dk, (int)bf16, s);
                for (int64_t h = 0; h < nh; h++) {
                    float mx = m[h];
                    for (int64_t j = 0; j < nk; j++) mx = s[h][j] > mx ? s[h][j] : mx;
                    keep[h] = expf(m[h] - mx);  /* 0 on the first part (m = -inf) */
                    l[h] *= keep[h];
                    /* each score becomes its weight, 8 at a time (past nk: -inf, a weight nobody reads) */
                    for (int64_t j = nk; j < ((nk + 7) & ~(int64_t)7); j++) s[h][j] = -INFINITY;
                    for (int64_t j = 0; j < nk; j += 8)
                        _mm256_storeu_ps(s[h] + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(s[h] + j), _mm256_set1_ps(mx))));
                    for (int64_t j = 0; j < nk; j++) l[h] += s[h][j];
                    m[h] = mx;
                }
                weigh(o, keep, (const float (*)[KB])s, nh, keys, row_bytes, nk, dv, (int)bf16);
            }
            for (int64_t h = 0; h < nh; h++) {
                float *oh = out + r * out_stride + (h0 + h) * dv;
                const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
                for (int64_t e = 0; e < dv; e++) oh[e] = o[h][e] * inv;
            }
        }
    }
    return 0;
}
