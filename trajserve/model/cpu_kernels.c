/* Float32 CPU kernels for the model's layers (AVX2 + FMA, OpenMP).
 *
 * Why: a batch-1 decode step reads every weight once, so it is bound by
 * memory bandwidth, yet torch's CPU matmuls stream weights at a matrix-vector
 * product at ~14-20 GB/s on the 2-core AVX2 EPYC where a plain reduction
 * streams at ~27-37, and the ~35 small torch ops per layer cost 10-20 us of
 * dispatch each. Here the weight products run on packed panels with a
 * register-tiled micro-kernel (every batch size, prefill chunks included)
 * and the small ops are fused: RMSNorm, RoPE + K/V store, paged decode and
 * prefill attention, SiLU gate, residual add.
 * Loaded with ctypes (trajserve/model/cpu_kernels.py), linked against the
 * OpenMP runtime torch already loaded (same soname), so both share one
 * thread pool.
 *
 * All tensors are float32, row-major; `ld*` are row strides in floats.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_math.h"

/* dot(a, b) over k floats, four accumulators (RMSNorm, attention scores). */
static inline float dot(const float *a, const float *b, int64_t k) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= k; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (; i < k; i++) s += a[i] * b[i];
    return s;
}

/* Weight products on packed weights. A weight [n, k] is stored as panels
 * of 16 rows, [ceil(n/16)][k][16] (cpu_kernels.pack): at step kk a panel
 * gives the 16 rows' kk-th weights as two contiguous vectors. A tile
 * multiplies up to 6 input rows by one panel: per kk, 2 weight loads and 6
 * broadcasts feed 12 FMAs into 12 accumulators held in registers (the
 * classic 6x16 AVX2 micro-kernel, ~70 GFLOP/s per core here where torch's
 * oneDNN reaches ~25 at 16 rows). The same tile serves a decode batch of 1
 * (bound by memory: each weight is read once) and a 512-token prefill
 * chunk (bound by FMAs). Every output is one accumulator summed over k in
 * order, whatever the number of rows: a row's result never depends on the
 * other rows of the batch. */
#define TILE_ROW(i)                                                  \
    if (mr > i) {                                                    \
        __m256 b = _mm256_broadcast_ss(x##i + kk);                   \
        a##i##0 = _mm256_fmadd_ps(w0, b, a##i##0);                   \
        a##i##1 = _mm256_fmadd_ps(w1, b, a##i##1);                   \
    }
#define TILE_STORE(i)                                                \
    if (mr > i) {                                                    \
        _mm256_storeu_ps(o + i * 16, a##i##0);                       \
        _mm256_storeu_ps(o + i * 16 + 8, a##i##1);                   \
    }

static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const float *panel,
                                                       int64_t k, const int mr, float *o) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx,
                *x5 = x + 5 * ldx;
    for (int64_t kk = 0; kk < k; kk++) {
        __m256 w0 = _mm256_loadu_ps(panel + kk * 16), w1 = _mm256_loadu_ps(panel + kk * 16 + 8);
        TILE_ROW(0) TILE_ROW(1) TILE_ROW(2) TILE_ROW(3) TILE_ROW(4) TILE_ROW(5)
    }
    TILE_STORE(0) TILE_STORE(1) TILE_STORE(2) TILE_STORE(3) TILE_STORE(4) TILE_STORE(5)
}

/* o[r][c] = x_{i0 + r} . panel column c for r < min(6, m - i0): a constant
 * row count per call keeps the accumulators in registers. */
static inline void tile_rows(const float *x, int64_t m, int64_t ldx, const float *panel, int64_t k,
                             int64_t i0, float *o) {
    const float *xi = x + i0 * ldx;
    switch (m - i0 < 6 ? m - i0 : 6) {
        case 1: tile(xi, ldx, panel, k, 1, o); break;
        case 2: tile(xi, ldx, panel, k, 2, o); break;
        case 3: tile(xi, ldx, panel, k, 3, o); break;
        case 4: tile(xi, ldx, panel, k, 4, o); break;
        case 5: tile(xi, ldx, panel, k, 5, o); break;
        default: tile(xi, ldx, panel, k, 6, o);
    }
}

/* What a finished tile's outputs become: a plain product (+ bias, or added
 * into y in place: the residual stream), or the MLP gate silu(g) * u. */
typedef struct {
    const float *bias;
    float *y;
    int64_t ldy, n;  /* n: output columns */
    int acc, gate;
} Epilogue;

static void finish_tile(const Epilogue *e, int64_t p, int64_t i0, int64_t rows, const float *o) {
    if (e->gate) {  /* panel p: gate rows then up rows of outputs [8p, 8p + 8) */
        const int64_t c0 = p * 8, nc = e->n - c0 < 8 ? e->n - c0 : 8;
        for (int64_t r = 0; r < rows; r++) {
            __m256 v = _mm256_mul_ps(silu8(_mm256_loadu_ps(o + r * 16)), _mm256_loadu_ps(o + r * 16 + 8));
            float *yr = e->y + (i0 + r) * e->ldy + c0;
            if (nc == 8) {
                _mm256_storeu_ps(yr, v);
            } else {  // the last panel of an intermediate size that is not a multiple of 8
                float t[8];
                _mm256_storeu_ps(t, v);
                memcpy(yr, t, nc * sizeof(float));
            }
        }
        return;
    }
    const int64_t c0 = p * 16, nc = e->n - c0 < 16 ? e->n - c0 : 16;
    for (int64_t r = 0; r < rows; r++) {
        float *yr = e->y + (i0 + r) * e->ldy + c0;
        for (int64_t c = 0; c < nc; c++) {
            float v = o[r * 16 + c] + (e->bias ? e->bias[c0 + c] : 0.0f);
            yr[c] = e->acc ? yr[c] + v : v;
        }
    }
}

/* Input rows in blocks of ROW_BLOCK (a block of 1,536-wide rows stays in a
 * 512 KB L2 while every panel passes over it); panels split across threads.
 * A 512-token prefill chunk read its inputs from L3 without the blocking
 * and ran at ~80 GFLOP/s instead of ~105. */
#define ROW_BLOCK 60

static void packed_product(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed,
                           int64_t panels, const Epilogue *e, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    for (int64_t m0 = 0; m0 < m; m0 += ROW_BLOCK) {
        const int64_t m1 = m - m0 < ROW_BLOCK ? m : m0 + ROW_BLOCK;
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++) {
            float o[6 * 16];
            for (int64_t i0 = m0; i0 < m1; i0 += 6) {
                tile_rows(x, m1, ldx, packed + p * k * 16, k, i0, o);
                finish_tile(e, p, i0, m1 - i0 < 6 ? m1 - i0 : 6, o);
            }
        }
    }
}

/* y[i, r] = (acc ? y[i, r] : 0) + bias[r] + x[i, :] . w[r, :] for i < m,
 * r < n; w packed. With acc, y is the residual stream and the projection
 * is added in place. */
void ts_linear(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n,
               const float *bias, float *y, int64_t ldy, int acc, int nthreads) {
    Epilogue e = {bias, y, ldy, n, acc, 0};
    packed_product(x, m, k, ldx, packed, (n + 15) / 16, &e, nthreads);
}

/* The MLP's first half on gate and up packed together (cpu_kernels.
 * pack_gate_up): panel p holds gate rows [8p, 8p + 8) then up rows
 * [8p, 8p + 8), so y[i, 8p + c] = silu(gate) * up comes out of one tile. */
void ts_gate_up_silu(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed,
                     int64_t inter, float *y, int64_t ldy, int nthreads) {
    Epilogue e = {NULL, y, ldy, inter, 0, 1};
    packed_product(x, m, k, ldx, packed, (inter + 7) / 8, &e, nthreads);
}

/* y = x / sqrt(mean(x^2) + eps) * w, row by row (HF Llama's order). */
void ts_rms_norm(const float *x, int64_t m, int64_t d, int64_t ldx, const float *w, float eps,
                 float *y, int64_t ldy, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(m > 16 ? nthreads : 1)
    for (int64_t i = 0; i < m; i++) {
        const float *xi = x + i * ldx;
        float inv = 1.0f / sqrtf(dot(xi, xi, d) / (float)d + eps);
        float *yi = y + i * ldy;
        for (int64_t j = 0; j < d; j++) yi[j] = (xi[j] * inv) * w[j];
    }
}

/* RoPE (rotate-half layout) in place on the q and k heads of each token's
 * fused q|k|v row, then the token's k and v into its cache slot.
 * qkv: [t, ldq] with hq q heads, hkv k heads, hkv v heads of d floats;
 * cos/sin: [max_len, d] tables; caches: [num_blocks, hkv, bs, d]. */
void ts_rope_store(float *qkv, int64_t t, int64_t ldq, int64_t hq, int64_t hkv, int64_t d,
                   const float *cos_t, const float *sin_t, const int64_t *pos, float *k_cache,
                   float *v_cache, const int64_t *slot_block, const int64_t *slot_offset, int64_t bs,
                   int nthreads) {
    const int64_t half = d / 2;
#pragma omp parallel for schedule(static) num_threads(t > 16 ? nthreads : 1)
    for (int64_t i = 0; i < t; i++) {
        float *row = qkv + i * ldq;
        const float *c = cos_t + pos[i] * d, *s = sin_t + pos[i] * d;
        for (int64_t h = 0; h < hq + hkv; h++) {
            float *x = row + h * d;
            for (int64_t j = 0; j < half; j++) {
                float a = x[j], b = x[j + half];
                x[j] = a * c[j] - b * s[j];
                x[j + half] = b * c[j + half] + a * s[j + half];
            }
        }
        int64_t base = slot_block[i] * hkv * bs + slot_offset[i];
        for (int64_t h = 0; h < hkv; h++) {
            memcpy(k_cache + (base + h * bs) * d, row + (hq + h) * d, d * sizeof(float));
            memcpy(v_cache + (base + h * bs) * d, row + (hq + hkv + h) * d, d * sizeof(float));
        }
    }
}

/* Decode attention for n sequences of one query token each, through block
 * tables, split by keys ("flash-decoding"). Task (sequence, kv head, segment
 * of DSEG keys): the head's `group` query heads score the segment's keys,
 * exact softmax over them (max, exp, sum), weighted sum of V; then per
 * (sequence, kv head) the segments merge in order, each rescaled by
 * exp(m_seg - m). Why split: one task per (sequence, kv head) gave a batch
 * of one sequence 3 tasks (SmolLM2's kv heads) for 2 threads, and a long
 * context makes that the step's critical path. The segments sit at fixed key
 * positions, so a sequence's result depends neither on the batch nor on
 * the thread count, and a context of up to DSEG keys (one segment, rescaled
 * by exp(0) = 1) gives exactly the one-pass result.
 * tables: the block ids of all sequences back to back, sequence s's from
 * table_start[s]; ctx[s]: tokens in its cache (incl. this one); q row and
 * out row of s: rows[s]. Requires d % 8 == 0 and d <= 256. Returns the
 * number of sequences that found no memory (their outputs are not
 * written; the caller raises). */
#define DSEG 256

/* One segment, keys [k0, k1): m[j], l[j] and the unnormalized acc[j][d]
 * into out = m | l | acc. Everything is summed in locals and copied out at
 * the end: accumulating into `out` itself (memory the compiler must assume
 * may alias the pool) made the kernel 1.2-1.6x slower. */
static void decode_segment(const float *qs, int64_t group, int64_t d, const float *k_cache,
                           const float *v_cache, int64_t bs, int64_t hkv, int64_t h, const int64_t *table,
                           int64_t k0, int64_t k1, float *out) {
    const int64_t len = k1 - k0;
    float sc[group * DSEG], m[group], l[group], acc[group * d];  // sc: scores, then probabilities
    for (int64_t j = 0; j < group; j++) m[j] = -INFINITY;
    for (int64_t p = 0; p < len; p++) {
        const int64_t key = k0 + p;
        const float *kp = k_cache + ((table[key / bs] * hkv + h) * bs + key % bs) * d;
        for (int64_t j = 0; j < group; j++) {
            float s = dot(qs + j * d, kp, d);
            sc[j * DSEG + p] = s;
            if (s > m[j]) m[j] = s;
        }
    }
    for (int64_t j = 0; j < group; j++) {
        float *sj = sc + j * DSEG;
        __m256 m8 = _mm256_set1_ps(m[j]), t8 = _mm256_setzero_ps();
        int64_t p = 0;
        for (; p + 8 <= len; p += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sj + p), m8));
            _mm256_storeu_ps(sj + p, e);
            t8 = _mm256_add_ps(t8, e);
        }
        float tot = hsum8(t8);
        if (p < len) {  // tail through the same exp, padded with -inf (exp -> ~0)
            float buf[8];
            for (int64_t e = 0; e < 8; e++) buf[e] = p + e < len ? sj[p + e] - m[j] : -INFINITY;
            _mm256_storeu_ps(buf, exp8(_mm256_loadu_ps(buf)));
            for (int64_t e = 0; p + e < len; e++) { sj[p + e] = buf[e]; tot += buf[e]; }
        }
        l[j] = tot;
    }
    memset(acc, 0, sizeof(acc));
    for (int64_t p = 0; p < len; p++) {
        const int64_t key = k0 + p;
        const float *vp = v_cache + ((table[key / bs] * hkv + h) * bs + key % bs) * d;
        for (int64_t j = 0; j < group; j++) {
            __m256 pj = _mm256_set1_ps(sc[j * DSEG + p]);
            float *aj = acc + j * d;
            for (int64_t e = 0; e < d; e += 8)
                _mm256_storeu_ps(aj + e, _mm256_fmadd_ps(pj, _mm256_loadu_ps(vp + e), _mm256_loadu_ps(aj + e)));
        }
    }
    memcpy(out, m, sizeof(m));
    memcpy(out + group, l, sizeof(l));
    memcpy(out + 2 * group, acc, sizeof(acc));
}

int ts_decode_attention(const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv,
                        int64_t d, const float *k_cache, const float *v_cache, int64_t bs,
                        const int64_t *tables, const int64_t *table_start, const int64_t *ctx,
                        const int64_t *rows, float scale, float *out, int64_t ldo, int nthreads) {
    const int64_t group = hq / hkv, stride = group * (d + 2);  // one segment's m, l, acc
    if (n <= 0) return 0;
    int64_t *first = malloc(sizeof(int64_t) * (n + 1));  // sequence s's segments: [first[s], first[s + 1])
    if (first == NULL) return (int)n;
    first[0] = 0;
    for (int64_t si = 0; si < n; si++) first[si + 1] = first[si] + (ctx[si] + DSEG - 1) / DSEG;
    const int64_t nseg = first[n];
    int64_t *seq_of = malloc(sizeof(int64_t) * nseg);
    float *part = malloc(sizeof(float) * nseg * hkv * stride);
    if (seq_of == NULL || part == NULL) {
        free(first);
        free(seq_of);
        free(part);
        return (int)n;
    }
    for (int64_t si = 0; si < n; si++)
        for (int64_t g = first[si]; g < first[si + 1]; g++) seq_of[g] = si;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t g = 0; g < nseg; g++) {
            for (int64_t h = 0; h < hkv; h++) {
                const int64_t si = seq_of[g], k0 = (g - first[si]) * DSEG;
                const int64_t k1 = ctx[si] - k0 < DSEG ? ctx[si] : k0 + DSEG;
                float qs[group * d], *pm = part + (g * hkv + h) * stride;
                for (int64_t j = 0; j < group; j++) {
                    const float *qj = q + rows[si] * ldq + (h * group + j) * d;
                    for (int64_t e = 0; e < d; e++) qs[j * d + e] = qj[e] * scale;
                }
                decode_segment(qs, group, d, k_cache, v_cache, bs, hkv, h, tables + table_start[si], k0, k1, pm);
            }
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t si = 0; si < n; si++) {
            for (int64_t h = 0; h < hkv; h++) {
                for (int64_t j = 0; j < group; j++) {
                    float mx = -INFINITY, tot = 0.0f, o[d];
                    for (int64_t g = first[si]; g < first[si + 1]; g++)
                        mx = fmaxf(mx, part[(g * hkv + h) * stride + j]);
                    memset(o, 0, sizeof(o));
                    for (int64_t g = first[si]; g < first[si + 1]; g++) {
                        const float *pm = part + (g * hkv + h) * stride;
                        const float a = expf(pm[j] - mx), *acc = pm + 2 * group + j * d;  // 1 for the max's segment
                        tot += a * pm[group + j];
                        for (int64_t e = 0; e < d; e++) o[e] += a * acc[e];
                    }
                    float *orow = out + rows[si] * ldo + (h * group + j) * d, inv = 1.0f / tot;
                    for (int64_t e = 0; e < d; e++) orow[e] = o[e] * inv;
                }
            }
        }
    }
    free(first);
    free(seq_of);
    free(part);
    return 0;
}

/* Paged prefill attention for one sequence's chunk of n query tokens over
 * its whole context (cached prefix + the chunk, ctx tokens, K/V already
 * stored): query i sits at position ctx - n + i and sees keys <= it.
 *
 * Why not SDPA: it needs the context gathered out of the pool into
 * contiguous K/V and an explicit mask for a chunk that sits after a cached
 * prefix (computing every masked score): a 475-token chunk over 2,430
 * cached tokens took 37 ms per layer that way and 24 ms here (same
 * process, docs/benchmarks.md). Here keys are read in place through the
 * block table, the causal limit is applied per key block (fully hidden
 * blocks are never touched), and a kv head's `group` query heads share each
 * key block while it is in cache.
 *
 * Task (kv head, block of QB query positions); keys in blocks of KB with an
 * online (flash) softmax: running max m, running sum l, output o rescaled
 * by exp(m_old - m_new). Scores are kept transposed, s[key][query], so the
 * 24 queries of a block are three vectors: the score tile (4 keys x 24
 * queries, 12 accumulators) broadcasts K elements against the transposed,
 * pre-scaled queries, and max / sum over keys are vertical. The output tile
 * (6 queries x 16 dims) broadcasts probabilities against V rows, which the
 * pool already stores contiguously. A chunk's last, short block computes
 * only the vectors and output tiles its queries fill: a cached request that
 * adds 8 tokens pays for 8 queries, not 24 (1.6x faster at 8 new tokens
 * over 2,300 cached, 1.08x at 150, docs/benchmarks.md). Hidden scores are
 * -inf for the max and exactly 0 after exp, and key blocks are aligned at
 * 0, so a query's result does not depend on which chunk or query block it
 * was computed in (a real score of -inf, impossible with finite q and k,
 * would be treated as hidden).
 * Requires d % 8 == 0. Returns the number of tasks that found no memory
 * (their outputs are not written; the caller raises). */
#define QB 24
#define KB 64

/* s[i][0..8 nv) = qt^T k_i for keys i < nk (nk a multiple of 4; kp padded):
 * the block's first 8 nv queries, nv = 1..3 vectors (a short last block
 * skips the vectors it does not fill). Each query's score is its own lane
 * over the same steps whatever nv is, so results do not depend on it. */
#define SCORE_KEY(j)                                                               \
    b = _mm256_broadcast_ss(k##j + e);                                             \
    a##j##0 = _mm256_fmadd_ps(q0, b, a##j##0);                                     \
    if (nv > 1) a##j##1 = _mm256_fmadd_ps(q1, b, a##j##1);                         \
    if (nv > 2) a##j##2 = _mm256_fmadd_ps(q2, b, a##j##2);
#define SCORE_STORE(j)                                                             \
    _mm256_storeu_ps(si + j * QB, a##j##0);                                        \
    if (nv > 1) _mm256_storeu_ps(si + j * QB + 8, a##j##1);                        \
    if (nv > 2) _mm256_storeu_ps(si + j * QB + 16, a##j##2);
static inline __attribute__((always_inline)) void score_tile(const float *qt, const float *const *kp,
                                                             int64_t nk, int64_t d, float *s, const int nv) {
    for (int64_t i = 0; i < nk; i += 4) {
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
        __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
        const float *k0 = kp[i], *k1 = kp[i + 1], *k2 = kp[i + 2], *k3 = kp[i + 3];
        for (int64_t e = 0; e < d; e++) {
            __m256 q0 = _mm256_loadu_ps(qt + e * QB), q1 = q0, q2 = q0, b;
            if (nv > 1) q1 = _mm256_loadu_ps(qt + e * QB + 8);
            if (nv > 2) q2 = _mm256_loadu_ps(qt + e * QB + 16);
            SCORE_KEY(0) SCORE_KEY(1) SCORE_KEY(2) SCORE_KEY(3)
        }
        float *si = s + i * QB;
        SCORE_STORE(0) SCORE_STORE(1) SCORE_STORE(2) SCORE_STORE(3)
    }
}

static void score_block(const float *qt, const float *const *kp, int64_t nk, int64_t d, float *s, int nv) {
    switch (nv) {
        case 1: score_tile(qt, kp, nk, d, s, 1); break;
        case 2: score_tile(qt, kp, nk, d, s, 2); break;
        default: score_tile(qt, kp, nk, d, s, 3);
    }
}

/* o[r][c0 + 0..w) += sum_i p[i][r0 + r] v_i[c0 + 0..w) for r < 6, w 16 or 8. */
#define PV_ROW(r)                                                        \
    {                                                                    \
        __m256 b = _mm256_broadcast_ss(pi + r);                          \
        a##r##0 = _mm256_fmadd_ps(v0, b, a##r##0);                       \
        if (w == 16) a##r##1 = _mm256_fmadd_ps(v1, b, a##r##1);          \
    }
static inline __attribute__((always_inline)) void pv_tile(const float *p, const float *const *vp, int64_t nk,
                                                          int64_t c0, const int w, float *o, int64_t d) {
    __m256 a00 = _mm256_loadu_ps(o + c0), a10 = _mm256_loadu_ps(o + d + c0),
           a20 = _mm256_loadu_ps(o + 2 * d + c0), a30 = _mm256_loadu_ps(o + 3 * d + c0),
           a40 = _mm256_loadu_ps(o + 4 * d + c0), a50 = _mm256_loadu_ps(o + 5 * d + c0);
    __m256 a01 = a00, a11 = a00, a21 = a00, a31 = a00, a41 = a00, a51 = a00;
    if (w == 16) {
        a01 = _mm256_loadu_ps(o + c0 + 8); a11 = _mm256_loadu_ps(o + d + c0 + 8);
        a21 = _mm256_loadu_ps(o + 2 * d + c0 + 8); a31 = _mm256_loadu_ps(o + 3 * d + c0 + 8);
        a41 = _mm256_loadu_ps(o + 4 * d + c0 + 8); a51 = _mm256_loadu_ps(o + 5 * d + c0 + 8);
    }
    for (int64_t i = 0; i < nk; i++) {
        const float *pi = p + i * QB;
        __m256 v0 = _mm256_loadu_ps(vp[i] + c0), v1 = v0;
        if (w == 16) v1 = _mm256_loadu_ps(vp[i] + c0 + 8);
        PV_ROW(0) PV_ROW(1) PV_ROW(2) PV_ROW(3) PV_ROW(4) PV_ROW(5)
    }
    _mm256_storeu_ps(o + c0, a00); _mm256_storeu_ps(o + d + c0, a10); _mm256_storeu_ps(o + 2 * d + c0, a20);
    _mm256_storeu_ps(o + 3 * d + c0, a30); _mm256_storeu_ps(o + 4 * d + c0, a40);
    _mm256_storeu_ps(o + 5 * d + c0, a50);
    if (w == 16) {
        _mm256_storeu_ps(o + c0 + 8, a01); _mm256_storeu_ps(o + d + c0 + 8, a11);
        _mm256_storeu_ps(o + 2 * d + c0 + 8, a21); _mm256_storeu_ps(o + 3 * d + c0 + 8, a31);
        _mm256_storeu_ps(o + 4 * d + c0 + 8, a41); _mm256_storeu_ps(o + 5 * d + c0 + 8, a51);
    }
}

/* Query r of a block sits at position first + r and sees keys <= it: key
 * `key` is hidden from the block's first min(key - first, QB) queries. */
static inline int64_t hidden_rows(int64_t key, int64_t first) {
    int64_t t = key - first;
    return t <= 0 ? 0 : (t < QB ? t : QB);
}

int ts_prefill_attention(const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                         const float *k_cache, const float *v_cache, int64_t bs, const int64_t *table,
                         int64_t ctx, float scale, float *out, int64_t ldo, int nthreads) {
    const int64_t group = hq / hkv, nqb = (n + QB - 1) / QB;
    int failed = 0;
    // Later query blocks see more keys: hand them out first (dynamic schedule).
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nthreads) reduction(+ : failed)
    for (int64_t b = nqb - 1; b >= 0; b--) {
        for (int64_t h = 0; h < hkv; h++) {
            const int64_t q0 = b * QB, rows = n - q0 < QB ? n - q0 : QB;
            const int64_t first = ctx - n + q0;           // position of the block's query 0
            const int64_t kend = first + rows;            // keys any of its queries sees
            const int nv = (int)((rows + 7) / 8), R = 8 * nv;  // query vectors, rows computed
            float *buf = malloc(sizeof(float) * (group * (2 * d * QB + 2 * QB) + KB * QB) +
                                sizeof(float *) * 2 * KB);
            if (buf == NULL) {
                failed++;
                continue;
            }
            float *qt = buf, *o = qt + group * d * QB, *m = o + group * QB * d, *l = m + group * QB,
                  *s = l + group * QB;
            const float **kp = (const float **)(s + KB * QB), **vp = kp + KB;
            for (int64_t j = 0; j < group; j++) {
                for (int64_t r = 0; r < QB; r++) {  // rows past the chunk: zero queries, outputs unused
                    const float *qr = q + (q0 + (r < rows ? r : 0)) * ldq + (h * group + j) * d;
                    for (int64_t e = 0; e < d; e++) qt[(j * d + e) * QB + r] = r < rows ? qr[e] * scale : 0.0f;
                    m[j * QB + r] = -INFINITY;
                    l[j * QB + r] = 0.0f;
                }
            }
            memset(o, 0, sizeof(float) * group * QB * d);
            // Rows >= R of s are never written, yet whole PV tiles of 6 rows
            // may read them (into output rows that are never stored): zero
            // them once, so no stale NaN or denormal from malloc enters an FMA.
            memset(s, 0, sizeof(float) * KB * QB);
            for (int64_t kb0 = 0; kb0 < kend; kb0 += KB) {
                const int64_t nk = kend - kb0 < KB ? kend - kb0 : KB, nk4 = (nk + 3) & ~(int64_t)3;
                for (int64_t i = 0; i < nk4; i++) {
                    int64_t p = kb0 + (i < nk ? i : nk - 1);  // padding repeats the last key
                    int64_t off = ((table[p / bs] * hkv + h) * bs + p % bs) * d;
                    kp[i] = k_cache + off;
                    vp[i] = v_cache + off;
                }
                const int masked = kb0 + nk - 1 > first;
                for (int64_t j = 0; j < group; j++) {
                    float *mj = m + j * QB, *lj = l + j * QB, *oj = o + j * QB * d;
                    score_block(qt + j * d * QB, kp, nk4, d, s, nv);
                    if (masked)
                        for (int64_t i = 0; i < nk; i++)
                            for (int64_t r = 0, hr = hidden_rows(kb0 + i, first); r < hr && r < R; r++)
                                s[i * QB + r] = -INFINITY;
                    float alpha[QB];
                    for (int64_t c = 0; c < R; c += 8) {
                        __m256 mx = _mm256_loadu_ps(mj + c);
                        for (int64_t i = 0; i < nk; i++) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + i * QB + c));
                        __m256 sum = _mm256_setzero_ps(), ninf = _mm256_set1_ps(-INFINITY);
                        for (int64_t i = 0; i < nk; i++) {
                            __m256 x = _mm256_loadu_ps(s + i * QB + c), e = exp8(_mm256_sub_ps(x, mx));
                            // hidden: exactly 0, not exp8's ~1e-38
                            if (masked) e = _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), e);
                            _mm256_storeu_ps(s + i * QB + c, e);
                            sum = _mm256_add_ps(sum, e);
                        }
                        __m256 a = exp8(_mm256_sub_ps(_mm256_loadu_ps(mj + c), mx));  // m_old = -inf: ~0
                        _mm256_storeu_ps(alpha + c, a);
                        _mm256_storeu_ps(mj + c, mx);
                        _mm256_storeu_ps(lj + c, _mm256_fmadd_ps(_mm256_loadu_ps(lj + c), a, sum));
                    }
                    for (int64_t r = 0; r < R; r++) {
                        __m256 a = _mm256_set1_ps(alpha[r]);
                        for (int64_t e = 0; e < d; e += 8)
                            _mm256_storeu_ps(oj + r * d + e, _mm256_mul_ps(a, _mm256_loadu_ps(oj + r * d + e)));
                    }
                    for (int64_t r0 = 0; r0 < rows; r0 += 6) {
                        int64_t c0 = 0;
                        for (; c0 + 16 <= d; c0 += 16) pv_tile(s + r0, vp, nk, c0, 16, oj + r0 * d, d);
                        if (c0 < d) pv_tile(s + r0, vp, nk, c0, 8, oj + r0 * d, d);
                    }
                }
            }
            for (int64_t j = 0; j < group; j++)
                for (int64_t r = 0; r < rows; r++) {
                    float *orow = out + (q0 + r) * ldo + (h * group + j) * d, inv = 1.0f / l[j * QB + r];
                    for (int64_t e = 0; e < d; e++) orow[e] = o[(j * QB + r) * d + e] * inv;
                }
            free(buf);
        }
    }
    return failed;
}
