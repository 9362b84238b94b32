/* Latent attention (DeepSeek V2 / V3's MLA, absorbed: model/mla.py) over the
 * paged pool, one query row at a time.
 *
 * Every head of a row attends over the same cached rows [c, k_pe] (dk values
 * a token: the latent and the RoPE key), and the value is the row's first dv
 * values (the latent), so the pool is read once per row and block for all of
 * the row's heads in a chunk, never per head. The rows are 576 values wide at
 * DeepSeek's size, past the other attention kernels' 256.
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
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define KB 64       /* keys scored at once (a block of more is taken in parts) */
#define HEADS 4     /* heads a task takes: its outputs stay in the L1 cache */
#define DK_MAX 1152 /* row width a task's scaled queries hold */
#define DV_MAX 1024 /* value width its accumulators hold */

static inline float bf16_value(uint16_t u) {
    uint32_t b = (uint32_t)u << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline float row_dot(const float *q, const void *row, int64_t dk, int bf16) {
    float acc = 0.0f;
    if (bf16) {
        const uint16_t *k = (const uint16_t *)row;
#pragma omp simd reduction(+ : acc)
        for (int64_t e = 0; e < dk; e++) acc += q[e] * bf16_value(k[e]);
    } else {
        const float *k = (const float *)row;
#pragma omp simd reduction(+ : acc)
        for (int64_t e = 0; e < dk; e++) acc += q[e] * k[e];
    }
    return acc;
}

static inline void add_scaled_row(float *o, float p, const void *row, int64_t dv, int bf16) {
    if (bf16) {
        const uint16_t *v = (const uint16_t *)row;
#pragma omp simd
        for (int64_t e = 0; e < dv; e++) o[e] += p * bf16_value(v[e]);
    } else {
        const float *v = (const float *)row;
#pragma omp simd
        for (int64_t e = 0; e < dv; e++) o[e] += p * v[e];
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
            float qs[HEADS][DK_MAX], o[HEADS][DV_MAX], m[HEADS], l[HEADS], s[HEADS][KB];
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
                const char *blk = base + (size_t)table[t0 / bs] * bs * row_bytes;
                const int64_t nk = t1 - t0;
                for (int64_t j = 0; j < nk; j++) {
                    const void *row = blk + (size_t)(in_block + j) * row_bytes;
                    for (int64_t h = 0; h < nh; h++) s[h][j] = row_dot(qs[h], row, dk, (int)bf16);
                }
                for (int64_t h = 0; h < nh; h++) {
                    float mx = m[h];
                    for (int64_t j = 0; j < nk; j++) mx = s[h][j] > mx ? s[h][j] : mx;
                    const float keep = expf(m[h] - mx);  /* 0 on the first part (m = -inf) */
                    l[h] *= keep;
#pragma omp simd
                    for (int64_t e = 0; e < dv; e++) o[h][e] *= keep;
                    for (int64_t j = 0; j < nk; j++) {
                        const float p = expf(s[h][j] - mx);
                        l[h] += p;
                        add_scaled_row(o[h], p, blk + (size_t)(in_block + j) * row_bytes, dv, (int)bf16);
                    }
                    m[h] = mx;
                }
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
