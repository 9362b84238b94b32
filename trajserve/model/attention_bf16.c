/* Attention over a bfloat16 KV pool: decode and prefill, one arithmetic,
 * on AMX tiles where the CPU has them.
 *
 * Why: a 2,048-token prefill spent 0.71 of its 1.62 s in float32 attention
 * at the FMA peak of a 2-core Sapphire Rapids, where torch's bf16 path runs
 * attention on AMX tiles (docs/benchmarks.md). A bf16 pool also halves the
 * K/V bytes every decode step reads and every tier moves.
 *
 * The arithmetic is AMX's. TDPBF16PS, measured on this project's Sapphire
 * Rapids (0 mismatches in 10^6 outputs; the SDM's newer pseudocode says the
 * same), computes for each output, over one instruction's 32 products:
 *     ev = fma chain over the even elements (from 0), od = over the odd ones,
 *     c  = c + (ev + od)
 * with input and output denormals flushed. So every kernel here computes
 * each query, per head, as:
 *   q'      = bf16(q * scale);  K, V stored as bf16 (rounded at the store)
 *   s_i     = over chunks of 32 dims in order: s = s + (ev + od), from 0
 *   m', p_i = exp8(s_i - m') as in cpu_kernels.c (hidden keys: exactly 0)
 *   p'_i    = bf16(p_i);  sum = p'_i in lanes i % 8, hsum8's tree
 *   a       = exp8(m - m');  l = fma(l, a, sum);  o = a * o
 *   o_c     = over chunks of 32 keys (aligned at 0): o_c = o_c + (ev + od)
 *   out     = o * (1 / l)
 * with keys in blocks of KB = 64 aligned at 0, and FTZ/DAZ set for the
 * task (AMX flushes denormals; the vector code must too). The vector decode
 * kernel (AVX2, every build) and the AMX prefill and decode kernels
 * therefore give the same bits for a query, so a token scores the same
 * decoded, in a chunk, or recomputed. Without AMX a chunk runs as decodes,
 * one per query.
 *
 * Pool layout as in cpu_kernels.c: [num_blocks, hkv, bs, d] uint16 (bf16).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kv_rows.h"
#include "simd_math.h"

#define MAX_GROUP 16
#define CHUNK 32 /* elements of one tile product: one AMX row of bf16 pairs */
#define FTZ_DAZ 0x8040

/* Decode attention for (sequence, kv head h, query heads j0 .. j0 + nh) of
 * one query over ctx keys; q: the token's q row, out: its output row. */
static void decode_heads_bf16(const float *q, int64_t hq, int64_t hkv, int64_t d, const uint16_t *k_cache,
                              const uint16_t *v_cache, int64_t bs, const int64_t *table, int64_t lo, int64_t ctx,
                              int64_t h, int64_t j0, int64_t nh, float scale, const float *sinks, float *out) {
    const int64_t group = hq / hkv, nv = d / 8;
    float qs[MAX_GROUP * 256], o[MAX_GROUP * 256], m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP * KB];
    for (int64_t j = 0; j < nh; j++) {
        const float *qr = q + (h * group + j0 + j) * d;
        for (int64_t e = 0; e < d; e += 8) {
            _mm256_storeu_ps(qs + j * d + e, bf16_float8(bf16_bits8(_mm256_mul_ps(_mm256_loadu_ps(qr + e),
                                                                                 _mm256_set1_ps(scale)))));
            _mm256_storeu_ps(o + j * d + e, _mm256_setzero_ps());
        }
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    for (int64_t kb0 = lo / KB * KB; kb0 < ctx; kb0 += KB) {  // keys from lo: as cpu_kernels.c's decode_heads
        const int64_t nk = ctx - kb0 < KB ? ctx - kb0 : KB, hid = lo > kb0 ? lo - kb0 : 0;
        const uint16_t *vp[KB];
        for (int64_t t = 0; t < nk; t += 8) {  // scores of 8 keys, the keys in the lanes
            const uint16_t *kp[8];
            for (int u = 0; u < 8; u++) {  // past the context: repeat the last key (its lanes are dropped)
                const int64_t i = t + u < nk ? t + u : nk - 1;
                const int64_t key = kb0 + (i < hid ? hid : i);  // before the window: key lo's row
                const int64_t off = ((table[key / bs] * hkv + h) * bs + key % bs) * d;
                kp[u] = k_cache + off;
                if (t + u < nk) vp[t + u] = v_cache + off;
            }
            __m256 acc[MAX_GROUP];
            for (int64_t j = 0; j < nh; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t c0 = 0; c0 < d; c0 += CHUNK) {
                __m256 ev[MAX_GROUP], od[MAX_GROUP];
                for (int64_t j = 0; j < nh; j++) ev[j] = od[j] = _mm256_setzero_ps();
                for (int64_t e0 = c0; e0 < c0 + CHUNK && e0 < d; e0 += 8) {
                    __m256 r[8], c[8];
                    for (int u = 0; u < 8; u++) r[u] = bf16_load8(kp[u] + e0);
                    transpose8(r, c);
                    for (int64_t j = 0; j < nh; j++)
                        for (int ee = 0; ee < 8; ee += 2) {
                            ev[j] = _mm256_fmadd_ps(_mm256_set1_ps(qs[j * d + e0 + ee]), c[ee], ev[j]);
                            od[j] = _mm256_fmadd_ps(_mm256_set1_ps(qs[j * d + e0 + ee + 1]), c[ee + 1], od[j]);
                        }
                }
                for (int64_t j = 0; j < nh; j++) acc[j] = _mm256_add_ps(acc[j], _mm256_add_ps(ev[j], od[j]));
            }
            for (int64_t j = 0; j < nh; j++) _mm256_storeu_ps(s + j * KB + t, acc[j]);
        }
        for (int64_t j = 0; j < nh; j++) {
            float *sj = s + j * KB, *oj = o + j * d;
            decode_softmax_block(sj, nk, m + j, l + j, oj, d, 1, hid);
            for (int64_t i0 = 0; i0 < nk; i0 += CHUNK) {  // keys in chunks of 32, even and odd keys apart
                __m256 ev[32], od[32];
                for (int64_t c = 0; c < nv; c++) ev[c] = od[c] = _mm256_setzero_ps();
                for (int64_t i = i0; i < i0 + CHUNK && i < nk; i += 2) {
                    const __m256 pe = _mm256_set1_ps(sj[i]);
                    for (int64_t c = 0; c < nv; c++) ev[c] = _mm256_fmadd_ps(bf16_load8(vp[i] + 8 * c), pe, ev[c]);
                    if (i + 1 < nk) {
                        const __m256 po = _mm256_set1_ps(sj[i + 1]);
                        for (int64_t c = 0; c < nv; c++) od[c] = _mm256_fmadd_ps(bf16_load8(vp[i + 1] + 8 * c), po, od[c]);
                    }
                }
                for (int64_t c = 0; c < nv; c++)
                    _mm256_storeu_ps(oj + 8 * c, _mm256_add_ps(_mm256_loadu_ps(oj + 8 * c), _mm256_add_ps(ev[c], od[c])));
            }
        }
    }
    for (int64_t j = 0; j < nh; j++) {
        float *orow = out + (h * group + j0 + j) * d;
        const float inv = 1.0f / sink_sum(l[j], m[j], sinks, h * group + j0 + j);
        for (int64_t e = 0; e < d; e++) orow[e] = o[j * d + e] * inv;
    }
}

/* As ts_decode_attention_q (cpu_kernels.c), over a bf16 pool. d % 8 == 0, d <= 256. */
void ts_decode_attention_bf16(const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                              const uint16_t *k_cache, const uint16_t *v_cache, int64_t bs, const int64_t *tables,
                              const int64_t *table_start, const int64_t *ctx, const int64_t *rows, float scale,
                              float *out, int64_t ldo, int64_t window, const float *sinks, int nthreads) {
    const int64_t group = hq / hkv;
    const int64_t per = n * hkv >= nthreads && group <= MAX_GROUP ? group : 1, runs = group / per;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t si = 0; si < n; si++)
        for (int64_t t = 0; t < hkv * runs; t++) {
            const unsigned csr = _mm_getcsr();
            _mm_setcsr(csr | FTZ_DAZ);
            const int64_t h = t / runs, j0 = (t % runs) * per;
            decode_heads_bf16(q + rows[si] * ldq, hq, hkv, d, k_cache, v_cache, bs, tables + table_start[si],
                              window_start(ctx[si] - 1, window), ctx[si], h, j0, per, scale, sinks,
                              out + rows[si] * ldo);
            _mm_setcsr(csr);
        }
}

/* A sequence's chunk of n queries (the last at position ctx - 1) as n
 * decodes, query i over the ctx - n + i + 1 keys it sees: the prefill of a
 * CPU without AMX, and of chunks of a few queries (cpu_kernels.py
 * AMX_MIN_QUERIES), for which a V^T copy of the whole context costs more. */
void ts_prefill_attention_bf16(const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                               const uint16_t *k_cache, const uint16_t *v_cache, int64_t bs, const int64_t *table,
                               int64_t ctx, float scale, float *out, int64_t ldo, int64_t window, const float *sinks,
                               int nthreads) {
    const int64_t group = hq / hkv, per = group <= MAX_GROUP ? group : 1, runs = group / per;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t i = n - 1; i >= 0; i--)
        for (int64_t t = 0; t < hkv * runs; t++) {
            const unsigned csr = _mm_getcsr();
            _mm_setcsr(csr | FTZ_DAZ);
            const int64_t h = t / runs, j0 = (t % runs) * per;
            decode_heads_bf16(q + i * ldq, hq, hkv, d, k_cache, v_cache, bs, table, window_start(ctx - n + i, window),
                              ctx - n + i + 1, h, j0, per, scale, sinks, out + i * ldo);
            _mm_setcsr(csr);
        }
}

#if defined(__AVX512F__)
/* ------------------------------------------------------------------ AMX prefill
 *
 * Task (block of AQ = 16 queries, kv head), tiles of 16 rows x 64 bytes:
 *   scores S^T [16 keys x 16 queries] = K rows (A, loaded straight from the
 *     pool: 16 keys of a block are contiguous) x Q^T as bf16 pairs (B);
 *   the softmax as in cpu_kernels.c's prefill, queries in the 16 lanes;
 *   O^T [16 dims x 16 queries] += V^T (A: V transposed once per call into a
 *     [hkv][d][ctx] buffer) x P as pairs of keys (B: two rows of p' interleaved).
 * Each C element is one AMX dot product over 32 elements, as above.
 * Requires d % 32 == 0, d <= 256, bs % 16 == 0. */
#define AQ 16
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Asks Linux for the AMX tile state (once per process): 1 if granted. */
int ts_amx_init(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

/* Each thread of an AMX kernel's parallel region: eight 16 x 64-byte tiles
 * configured, FTZ/DAZ on (the arithmetic every bf16 kernel shares); the
 * MXCSR it found is returned for amx_thread_end. */
__attribute__((target("amx-tile"))) static inline unsigned amx_thread_begin(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | FTZ_DAZ);
    _tile_loadconfig(&cfg);
    return csr;
}

static inline int64_t hidden_queries(int64_t key, int64_t first) {  /* of the block's AQ queries */
    const int64_t t = key - first;
    return t <= 0 ? 0 : (t < AQ ? t : AQ);
}

/* S^T of keys kb0 .. kb0 + 16 ng (ng <= 4) for one head: tmm0-3 hold the
 * ng score tiles at once (independent products overlap in the tile unit;
 * one at a time, each store waited for its product), tmm4/5 the K rows, tmm6
 * the queries' chunk. Tile numbers must be constants: one line per tile. */
#define SCORE_TILE(g, A)                                                                          \
    if (ng > g) {                                                                                 \
        _tile_loadd(A, k_cache + ((table[(kb0 + 16 * g) / bs] * hkv + h) * bs + (kb0 + 16 * g) % bs) * d + c, \
                    d * 2);                                                                       \
        _tile_dpbf16ps(g, A, 6);                                                                  \
    }
__attribute__((target("amx-tile,amx-bf16"))) static inline void scores_tiles(
    const uint16_t *k_cache, const int64_t *table, int64_t bs, int64_t hkv, int64_t h, int64_t d, int64_t kb0,
    int64_t ng, const uint32_t *qt, float *s) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < d; c += CHUNK) {
        _tile_loadd(6, qt + c / 2 * AQ, 64);
        SCORE_TILE(0, 4) SCORE_TILE(1, 5) SCORE_TILE(2, 4) SCORE_TILE(3, 5)
    }
    _tile_stored(0, s, 64);
    if (ng > 1) _tile_stored(1, s + 16 * AQ, 64);
    if (ng > 2) _tile_stored(2, s + 32 * AQ, 64);
    if (ng > 3) _tile_stored(3, s + 48 * AQ, 64);
}

/* O^T [d x 16] += V^T [d x 32 nc keys] (vt: the block's first key, rows of
 * ctxp) x P pairs (tmm6, tmm7), four 16-dim tiles at a time in tmm0-3. */
#define PV_TILE(t, A)                                                                             \
    if (c0 + 16 * t < d) {                                                                        \
        _tile_loadd(A, vt + (c0 + 16 * t) * ctxp, ctxp * 2);                                      \
        _tile_dpbf16ps(t, A, 6);                                                                  \
        if (nc > 1) {                                                                             \
            _tile_loadd(A, vt + (c0 + 16 * t) * ctxp + CHUNK, ctxp * 2);                          \
            _tile_dpbf16ps(t, A, 7);                                                              \
        }                                                                                         \
    }
#define PV_LOAD(t) if (c0 + 16 * t < d) _tile_loadd(t, o + (c0 + 16 * t) * AQ, 64);
#define PV_STORE(t) if (c0 + 16 * t < d) _tile_stored(t, o + (c0 + 16 * t) * AQ, 64);
__attribute__((target("amx-tile,amx-bf16"))) static inline void pv_tiles(const uint16_t *vt, int64_t ctxp, int64_t d,
                                                                        int64_t nc, const uint32_t *pp, float *o) {
    _tile_loadd(6, pp, 64);
    if (nc > 1) _tile_loadd(7, pp + 16 * AQ, 64);
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
        PV_LOAD(0) PV_LOAD(1) PV_LOAD(2) PV_LOAD(3)
        PV_TILE(0, 4) PV_TILE(1, 5) PV_TILE(2, 4) PV_TILE(3, 5)
        PV_STORE(0) PV_STORE(1) PV_STORE(2) PV_STORE(3)
    }
}

/* The softmax step of one key block over S^T (s: [ng * 16 keys][16 lanes],
 * hidden scores -inf where `masked`), the lanes being queries (prefill) or
 * heads (decode): m and l (16 lanes each) updated, p' written as key pairs
 * into pp (the B operand of O^T += V^T x P, or the rows of the decode's P),
 * a = exp16(m_old - m) returned for the caller's rescale of o. Keys i, i + 1
 * make one vector of pairs: VCVTNE2PS2BF16 rounds as bf16_bits8 does
 * (checked on every finite float), the permute interleaves the two keys'
 * halves, and p' comes back from the pairs for the sum. */
__attribute__((target("avx512bf16"))) static inline __m512 tile_softmax(const float *s, int64_t ng, int64_t nc,
                                                                      int masked, float *m, float *l, uint32_t *pp) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 mx = _mm512_loadu_ps(m);
    for (int64_t i = 0; i < ng * 16; i++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + i * AQ));
    __m512 part[8];
    for (int u = 0; u < 8; u++) part[u] = _mm512_setzero_ps();
    for (int64_t i0 = 0; i0 < nc * CHUNK; i0 += 8)  // 8 keys a step: part[] indices are constants
#pragma GCC unroll 4
        for (int u = 0; u < 8; u += 2) {
            const int64_t i = i0 + u;
            __m512 p[2];
            for (int v = 0; v < 2; v++) {
                p[v] = _mm512_setzero_ps();
                if (i + v < ng * 16) {
                    const __m512 x = _mm512_loadu_ps(s + (i + v) * AQ);
                    p[v] = exp16(_mm512_sub_ps(x, mx));
                    if (masked) p[v] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_UQ), p[v]);
                }
            }
            const __m512i pb = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
            part[u] = _mm512_add_ps(part[u], _mm512_castsi512_ps(_mm512_slli_epi32(pb, 16)));
            part[u + 1] = _mm512_add_ps(part[u + 1], _mm512_castsi512_ps(_mm512_and_si512(
                                                         pb, _mm512_set1_epi32((int)0xFFFF0000))));
            _mm512_storeu_si512(pp + i / 2 * AQ, pb);
        }
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(part[0], part[4]), _mm512_add_ps(part[2], part[6])),
                                     _mm512_add_ps(_mm512_add_ps(part[1], part[5]), _mm512_add_ps(part[3], part[7])));
    const __m512 a = exp16(_mm512_sub_ps(_mm512_loadu_ps(m), mx));
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), a, sum));
    _mm512_storeu_ps(m, mx);
    return a;
}

__attribute__((target("amx-tile,amx-bf16,avx512bf16"))) static int amx_task(
    const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv, int64_t d, const uint16_t *k_cache,
    const uint16_t *vt, int64_t ctxp, int64_t bs, const int64_t *table, int64_t ctx, float scale, const float *sinks,
    float *out, int64_t ldo, int64_t b, int64_t h) {
    const int64_t group = hq / hkv, q0 = b * AQ, rows = n - q0 < AQ ? n - q0 : AQ;
    const int64_t first = ctx - n + q0, kend = first + rows;
    /* per group head: Q^T pairs [d/2][16] u32, O^T [d][16] f32, m, l [16]; shared: S^T [KB][16], P pairs [KB/2][16] */
    uint8_t *buf = aligned_alloc(64, (size_t)group * (d * 32 + d * 64 + 128) + KB * 64 + KB * 32);
    if (buf == NULL) return 1;
    uint32_t *qt = (uint32_t *)buf;
    float *ot = (float *)(buf + group * d * 32), *ml = ot + group * d * 16;
    float *s = ml + group * 32;
    uint32_t *pp = (uint32_t *)(s + KB * AQ);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < group; j++) {
        uint32_t row[128];  // one query's q' as bf16 pairs (d <= 256), then into lane r of Q^T
        for (int64_t r = 0; r < AQ; r++) {  // rows past the chunk: 0
            const float *qr = q + (q0 + r) * ldq + (h * group + j) * d;
            for (int64_t e = 0; e < d; e += 16) {
                const __m512 x = r < rows ? _mm512_mul_ps(_mm512_loadu_ps(qr + e), _mm512_set1_ps(scale))
                                          : _mm512_setzero_ps();
                _mm256_storeu_si256((__m256i *)(row + e / 2), (__m256i)_mm512_cvtneps_pbh(x));
            }
            for (int64_t e = 0; e < d / 2; e++) qt[(j * d / 2 + e) * AQ + r] = row[e];
        }
        _mm512_storeu_ps(ml + j * 32, ninf);
        _mm512_storeu_ps(ml + j * 32 + 16, _mm512_setzero_ps());
    }
    memset(ot, 0, sizeof(float) * group * d * 16);
    for (int64_t kb0 = 0; kb0 < kend; kb0 += KB) {
        const int64_t nk = kend - kb0 < KB ? kend - kb0 : KB, ng = (nk + 15) / 16, nc = (nk + CHUNK - 1) / CHUNK;
        const int masked = kb0 + ng * 16 - 1 > first;
        for (int64_t j = 0; j < group; j++) {
            scores_tiles(k_cache, table, bs, hkv, h, d, kb0, ng, qt + j * d / 2 * AQ, s);
            if (masked)
                for (int64_t i = 0; i < ng * 16; i++) {
                    const int64_t hr = kb0 + i >= kend ? AQ : hidden_queries(kb0 + i, first);
                    if (hr) _mm512_storeu_ps(s + i * AQ, _mm512_mask_mov_ps(_mm512_loadu_ps(s + i * AQ),
                                                                             (__mmask16)((1u << hr) - 1), ninf));
                }
            float *mj = ml + j * 32, *lj = mj + 16, *oj = ot + j * d * 16;
            const __m512 a = tile_softmax(s, ng, nc, masked, mj, lj, pp);
            if (_mm512_cmp_ps_mask(a, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ))  // a == 1 everywhere: o * 1 == o
                for (int64_t c = 0; c < d; c++) _mm512_storeu_ps(oj + c * AQ, _mm512_mul_ps(a, _mm512_loadu_ps(oj + c * AQ)));
            pv_tiles(vt + h * d * ctxp + kb0, ctxp, d, nc, pp, oj);
        }
    }
    for (int64_t j = 0; j < group; j++)
        for (int64_t r = 0; r < rows; r++) {
            float *orow = out + (q0 + r) * ldo + (h * group + j) * d;
            const float inv = 1.0f / sink_sum(ml[j * 32 + 16 + r], ml[j * 32 + r], sinks, h * group + j);
            const float *oj = ot + j * d * 16;
            for (int64_t c = 0; c < d; c++) orow[c] = oj[c * AQ + r] * inv;
        }
    free(buf);
    return 0;
}

/* The block table of a buffer of rows read out of a quantized pool: the
 * buffer is block 0 (the AMX kernels' K operand reads through a table). */
static const int64_t ONE_BLOCK[1] = {0};

/* A quantized pool row as bf16: its exact values (kv_rows.h) rounded to
 * nearest even, as a bf16 pool's store rounds. On AMX a q8_0 / q4_0 pool is
 * read this way, so its attention is the bf16 pool's arithmetic over those
 * values (with the query and output rotated, kv_rows.h). d % 32 == 0.
 * dequantize_kv_row's values, 16 lanes at a time rather than calling it:
 * through its float buffer the decode layer of docs/benchmarks.md took 3.44
 * ms against 2.54 this way. */
__attribute__((target("avx512bf16"))) static inline __attribute__((always_inline)) void row_bf16(
    const uint8_t *row, const int fmt, int64_t d, uint16_t *out) {
    const uint16_t *scales = (const uint16_t *)(row + (fmt == TS_Q8_0 ? d : d / 2));
    for (int64_t g = 0; g < d / 32; g++) {  // dequantize_kv_row's exact values, 16 lanes at a time
        uint16_t h;
        memcpy(&h, scales + g, 2);
        const __m512 sc = _mm512_set1_ps(_cvtsh_ss(h));
        __m512 lo, hi;  // values 0 .. 15 and 16 .. 31 of the group
        if (fmt == TS_Q8_0) {
            lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 32 * g))));
            hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 32 * g + 16))));
        } else {
            const __m128i c = _mm_loadu_si128((const __m128i *)(row + 16 * g)), nib = _mm_set1_epi8(0x0F);
            const __m512 eight = _mm512_set1_ps(8.0f);
            lo = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(c, nib))), eight);
            hi = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(c, 4), nib))),
                               eight);
        }
        _mm512_storeu_si512(out + 32 * g, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, sc), _mm512_mul_ps(lo, sc)));
    }
}

/* Requires ts_amx_init() == 1, d % 32 == 0, d <= 256, n <= ctx, and for
 * TS_BF16 bs % 16 == 0 (tiles load 16 keys straight from a block).
 * kv_fmt TS_BF16, or TS_Q8_0 / TS_Q4_0 (any bs): the context's K rows are first
 * read into a bf16 buffer laid out as one pool block per kv head, V into
 * V^T as for bf16 (each row_bf16), and the queries rotated (kv_rows.h).
 * Returns the number of tasks that found no memory (outputs not written). */
__attribute__((target("amx-tile,amx-bf16,avx512bf16"))) int ts_prefill_attention_amx(
    const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv, int64_t d, const void *k_pool,
    const void *v_pool, int64_t bs, const int64_t *table, int64_t ctx, float scale, float *out, int64_t ldo,
    int kv_fmt, const float *sinks, int nthreads) {
    const int64_t ctxp = (ctx + KB - 1) / KB * KB, nqb = (n + AQ - 1) / AQ, rb = kv_row_bytes(kv_fmt, d);
    const int quant = kv_fmt != TS_BF16;
    const uint16_t *k_cache = k_pool, *v_cache = v_pool;
    const int64_t *ktable = table, kbs = quant ? ctxp : bs;
    uint16_t *vt = aligned_alloc(64, sizeof(uint16_t) * hkv * d * ctxp);
    uint16_t *kq = quant ? aligned_alloc(64, sizeof(uint16_t) * hkv * d * ctxp) : NULL;
    float *qr = quant ? aligned_alloc(64, sizeof(float) * ((n * hq * d + 15) / 16 * 16)) : NULL;
    if (vt == NULL || (quant && (kq == NULL || qr == NULL))) {
        free(vt), free(kq), free(qr);
        return (int)(nqb * hkv);
    }
    if (quant) {  // the rotated queries, the / 32 with the scale (exact)
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t i = 0; i < n; i++) {
            memcpy(qr + i * hq * d, q + i * ldq, sizeof(float) * hq * d);
            for (int64_t j = 0; j < hq; j++) rotate32(qr + (i * hq + j) * d, d);
        }
        q = qr, ldq = hq * d, scale *= 0.03125f, k_cache = kq, ktable = ONE_BLOCK;
    }
    // V^T per kv head, zero past the context: the A operand of the PV tiles.
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t h = 0; h < hkv; h++)
        for (int64_t k0 = 0; k0 < ctxp; k0 += KB) {
            const uint16_t *v[KB];
            uint16_t vb[KB * 256];  // a quantized block's V rows as bf16
            for (int64_t i = 0; i < KB; i++) {
                uint16_t *kr = quant ? kq + (h * ctxp + k0 + i) * d : NULL;
                if (k0 + i >= ctx) {  // past the context: no V row, a zero K row in the buffer
                    v[i] = NULL;
                    if (quant) memset(kr, 0, sizeof(uint16_t) * d);
                    continue;
                }
                const int64_t r = (table[(k0 + i) / bs] * hkv + h) * bs + (k0 + i) % bs;
                if (quant) {
                    row_bf16((const uint8_t *)k_pool + r * rb, kv_fmt, d, kr);
                    row_bf16((const uint8_t *)v_pool + r * rb, kv_fmt, d, vb + i * d);
                    v[i] = vb + i * d;
                } else {
                    v[i] = v_cache + r * d;
                }
            }
            for (int64_t c = 0; c < d; c++) {  // rows of V^T written in order, the block's V rows stay in L1
                uint16_t *row = vt + (h * d + c) * ctxp + k0;
                for (int64_t i = 0; i < KB; i++) row[i] = v[i] ? v[i][c] : 0;
            }
        }
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : failed)
    {
        const unsigned csr = amx_thread_begin();
        // Later query blocks see more keys: hand them out first.
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = nqb - 1; b >= 0; b--)
            for (int64_t h = 0; h < hkv; h++)
                failed += amx_task(q, ldq, n, hq, hkv, d, k_cache, vt, ctxp, kbs, ktable, ctx, scale, sinks, out, ldo,
                                   b, h);
        _tile_release();
        _mm_setcsr(csr);
    }
    if (quant && !failed)  // outputs back from the rotated space
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < hq; j++) unrotate32(out + i * ldo + j * d, d);
    free(vt), free(kq), free(qr);
    return failed;
}
/* AMX decode: one task per (sequence, kv head), the group's query heads as
 * the lanes (up to 16): S^T = K rows x Q^T pairs (scores_tiles, as in
 * prefill), the softmax with heads in the lanes, then O [heads x d] += P
 * [heads x 32 keys] x V pairs (two key rows interleaved). Every output
 * element is the same chain as in the prefill tiles and the vector decode
 * kernel, so the bits are theirs; only the work per key drops (the vector
 * kernel transposed every 8 x 8 K tile and ran 3 heads' FMAs per dim).
 * A q8_0 / q4_0 pool's key block is first read into bf16 buffers in L1
 * (row_bf16: K and V rows, 64 keys), the query rotated and the output
 * rotated back (kv_rows.h): the prefill's arithmetic over the same values,
 * so the bits are ts_prefill_attention_amx's for that pool (tested, and
 * checked at load: model/amx_check.py).
 * Requires hq / hkv <= 16 and the AMX prefill's shapes. */
__attribute__((target("amx-tile,amx-bf16,avx512bf16"))) static inline __attribute__((always_inline)) void amx_decode_task(
    const float *q, int64_t hq, int64_t hkv, int64_t d, const void *k_pool, const void *v_pool, const int fmt,
    int64_t bs, const int64_t *table, int64_t ctx, int64_t h, float scale, const float *sinks, float *out) {
    const int64_t group = hq / hkv, rb = kv_row_bytes(fmt, d);
    const int quant = fmt != TS_BF16;
    const uint16_t *k_cache = k_pool, *v_cache = v_pool;
    uint16_t kq[KB * 256] __attribute__((aligned(64)));  /* a quantized key block's K and V rows as bf16 */
    uint16_t vq[KB * 256] __attribute__((aligned(64)));
    uint32_t qt[128 * AQ] __attribute__((aligned(64)));        /* Q^T pairs [d/2][16 heads] */
    float s[KB * AQ] __attribute__((aligned(64)));             /* S^T [keys][heads] */
    uint32_t pp[KB / 2 * AQ] __attribute__((aligned(64)));     /* p' pairs [key pairs][heads] */
    uint16_t pa[AQ * KB] __attribute__((aligned(64)));         /* P [heads][keys]: the A operand */
    uint16_t vp[2 * 16 * 16 * 32] __attribute__((aligned(64))); /* V pairs [chunk][dim group <= 16][pair][32] */
    float o[AQ * 256] __attribute__((aligned(64)));            /* O [heads][d] */
    float ml[2 * AQ] __attribute__((aligned(64)));             /* m, l per head lane */
    memset(qt, 0, sizeof(uint32_t) * d / 2 * AQ);
    for (int64_t j = 0; j < group; j++) {
        const float *qr = q + (h * group + j) * d;
        float qrot[256];  // a quantized pool's query rotated (kv_rows.h), the / 32 with the scale (exact)
        if (quant) {
            memcpy(qrot, qr, d * sizeof(float));
            rotate32(qrot, d);
            qr = qrot;
        }
        const float sc = quant ? scale * 0.03125f : scale;
        uint32_t row[128];
        for (int64_t e = 0; e < d; e += 16)
            _mm256_storeu_si256((__m256i *)(row + e / 2),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(qr + e), _mm512_set1_ps(sc))));
        for (int64_t e = 0; e < d / 2; e++) qt[e * AQ + j] = row[e];
    }
    memset(pa, 0, sizeof pa);
    memset(o, 0, sizeof(float) * AQ * d);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    _mm512_storeu_ps(ml, ninf);
    _mm512_storeu_ps(ml + AQ, _mm512_setzero_ps());
    for (int64_t kb0 = 0; kb0 < ctx; kb0 += KB) {
        const int64_t nk = ctx - kb0 < KB ? ctx - kb0 : KB, ng = (nk + 15) / 16, nc = (nk + CHUNK - 1) / CHUNK;
        if (quant) {  // the block's rows as bf16 (their exact values rounded), then read as a one-block bf16 pool
            for (int64_t i = 0; i < nk; i++) {
                const int64_t key = kb0 + i, r = (table[key / bs] * hkv + h) * bs + key % bs;
                row_bf16((const uint8_t *)k_pool + r * rb, fmt, d, kq + i * d);
                row_bf16((const uint8_t *)v_pool + r * rb, fmt, d, vq + i * d);
            }
            // the tile's rows past the context: zero keys (their scores are set to -inf below)
            memset(kq + nk * d, 0, sizeof(uint16_t) * (ng * 16 - nk) * d);
            scores_tiles(kq, ONE_BLOCK, KB, 1, 0, d, 0, ng, qt, s);
        } else {
            scores_tiles(k_cache, table, bs, hkv, h, d, kb0, ng, qt, s);
        }
        for (int64_t i = nk; i < ng * 16; i++) _mm512_storeu_ps(s + i * AQ, ninf);  // past the context
        const __m512 a = tile_softmax(s, ng, nc, nk < ng * 16, ml, ml + AQ, pp);
        float av[AQ];
        _mm512_storeu_ps(av, a);
        // P as rows per head (the pairs' lane j), V as pairs of key rows, then O += P x V.
        for (int64_t j = 0; j < group; j++) {
            uint32_t *row = (uint32_t *)(pa + j * KB);
            for (int64_t r = 0; r < nc * CHUNK / 2; r++) row[r] = pp[r * AQ + j];
            if (av[j] != 1.0f)  // o * 1 == o
                for (int64_t c = 0; c < d; c += 16)
                    _mm512_storeu_ps(o + j * d + c, _mm512_mul_ps(_mm512_set1_ps(av[j]), _mm512_loadu_ps(o + j * d + c)));
        }
        const __m512i inter = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                               39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
        for (int64_t r = 0; r < nc * CHUNK / 2; r++) {
            const int64_t k0 = kb0 + 2 * r, k1 = k0 + 1;
            const uint16_t *v0, *v1;
            if (quant) {
                v0 = vq + 2 * r * d;
                v1 = k1 < ctx ? vq + (2 * r + 1) * d : NULL;
            } else {
                v0 = v_cache + ((table[k0 / bs] * hkv + h) * bs + k0 % bs) * d;
                v1 = k1 < ctx ? v_cache + ((table[k1 / bs] * hkv + h) * bs + k1 % bs) * d : NULL;
            }
            for (int64_t c0 = 0; c0 < d; c0 += 16) {  // keys past the context: zero (their p' is 0 too)
                const __m512i a0 = k0 < ctx ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v0 + c0)))
                                            : _mm512_setzero_si512();
                const __m512i a1 = v1 ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v1 + c0)))
                                      : _mm512_setzero_si512();
                _mm512_storeu_si512(vp + (((r / 16) * 16 + c0 / 16) * 16 + r % 16) * 32,
                                    _mm512_permutex2var_epi16(a0, inter, a1));
            }
        }
        _tile_loadd(6, pa, KB * 2);
        if (nc > 1) _tile_loadd(7, pa + CHUNK, KB * 2);
        for (int64_t c0 = 0; c0 < d; c0 += 16) {
            _tile_loadd(0, o + c0, d * 4);
            _tile_loadd(4, vp + (0 * 16 + c0 / 16) * 16 * 32, 64);
            _tile_dpbf16ps(0, 6, 4);
            if (nc > 1) {
                _tile_loadd(5, vp + (1 * 16 + c0 / 16) * 16 * 32, 64);
                _tile_dpbf16ps(0, 7, 5);
            }
            _tile_stored(0, o + c0, d * 4);
        }
    }
    for (int64_t j = 0; j < group; j++) {
        float *orow = out + (h * group + j) * d;
        const float inv = 1.0f / sink_sum(ml[AQ + j], ml[j], sinks, h * group + j);
        for (int64_t c = 0; c < d; c++) orow[c] = o[j * d + c] * inv;
        if (quant) unrotate32(orow, d);
    }
}

/* amx_decode_task with a constant format in each copy (the row reads fold). */
__attribute__((target("amx-tile,amx-bf16,avx512bf16"))) static void amx_decode_any(
    const float *q, int64_t hq, int64_t hkv, int64_t d, const void *k_pool, const void *v_pool, int fmt, int64_t bs,
    const int64_t *table, int64_t ctx, int64_t h, float scale, const float *sinks, float *out) {
    switch (fmt) {
        case TS_Q8_0: amx_decode_task(q, hq, hkv, d, k_pool, v_pool, TS_Q8_0, bs, table, ctx, h, scale, sinks, out); break;
        case TS_Q4_0: amx_decode_task(q, hq, hkv, d, k_pool, v_pool, TS_Q4_0, bs, table, ctx, h, scale, sinks, out); break;
        default: amx_decode_task(q, hq, hkv, d, k_pool, v_pool, TS_BF16, bs, table, ctx, h, scale, sinks, out);
    }
}

/* As ts_decode_attention_bf16, on tiles. Requires ts_amx_init() == 1,
 * d % 32 == 0, d <= 256, hq / hkv <= 16, and for TS_BF16 bs % 16 == 0.
 * kv_fmt: TS_BF16, or TS_Q8_0 / TS_Q4_0 (any bs: each key block's rows read
 * as bf16 one by one, amx_decode_task). */
__attribute__((target("amx-tile,amx-bf16,avx512bf16"))) void ts_decode_attention_amx(
    const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv, int64_t d, const void *k_cache,
    const void *v_cache, int64_t bs, const int64_t *tables, const int64_t *table_start, const int64_t *ctx,
    const int64_t *rows, float scale, float *out, int64_t ldo, int kv_fmt, const float *sinks, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        const unsigned csr = amx_thread_begin();
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t si = 0; si < n; si++)
            for (int64_t h = 0; h < hkv; h++)
                amx_decode_any(q + rows[si] * ldq, hq, hkv, d, k_cache, v_cache, kv_fmt, bs, tables + table_start[si],
                                ctx[si], h, scale, sinks, out + rows[si] * ldo);
        _tile_release();
        _mm_setcsr(csr);
    }
}

/* A quantized pool's short chunk (fewer than cpu_kernels.py's
 * AMX_MIN_QUERIES queries, which do not pay for the prefill's copy of the
 * whole context) as decodes on tiles, query i over the ctx - n + i + 1 keys
 * it sees: the same bits as ts_prefill_attention_amx gives them. */
__attribute__((target("amx-tile,amx-bf16,avx512bf16"))) void ts_prefill_attention_amx_decodes(
    const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv, int64_t d, const void *k_cache,
    const void *v_cache, int64_t bs, const int64_t *table, int64_t ctx, float scale, float *out, int64_t ldo,
    int kv_fmt, const float *sinks, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        const unsigned csr = amx_thread_begin();
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t i = n - 1; i >= 0; i--)
            for (int64_t h = 0; h < hkv; h++)
                amx_decode_any(q + i * ldq, hq, hkv, d, k_cache, v_cache, kv_fmt, bs, table, ctx - n + i + 1, h,
                                scale, sinks, out + i * ldo);
        _tile_release();
        _mm_setcsr(csr);
    }
}
#else
int ts_amx_init(void) { return 0; }
/* Not in this build; never called (cpu_kernels.py checks ts_amx_init first). */
void ts_decode_attention_amx(const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                             const void *k_cache, const void *v_cache, int64_t bs, const int64_t *tables,
                             const int64_t *table_start, const int64_t *ctx, const int64_t *rows, float scale,
                             float *out, int64_t ldo, int kv_fmt, const float *sinks, int nthreads) {}
void ts_prefill_attention_amx_decodes(const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                                      const void *k_cache, const void *v_cache, int64_t bs, const int64_t *table,
                                      int64_t ctx, float scale, float *out, int64_t ldo, int kv_fmt, const float *sinks,
                                      int nthreads) {}
int ts_prefill_attention_amx(const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                             const void *k_cache, const void *v_cache, int64_t bs, const int64_t *table,
                             int64_t ctx, float scale, float *out, int64_t ldo, int kv_fmt, const float *sinks,
                             int nthreads) {
    return -1;
}
#endif
