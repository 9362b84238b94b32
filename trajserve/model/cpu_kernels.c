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
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_rows.h"
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
    const float *pre;  /* gate: LoRA deltas added to g and u before silu ([m, ldp]: g's at c, u's at n + c), or NULL */
    int64_t ldp;
} Epilogue;

static void finish_tile(const Epilogue *e, int64_t p, int64_t i0, int64_t rows, const float *o) {
    if (e->gate) {  /* panel p: gate rows then up rows of outputs [8p, 8p + 8) */
        const int64_t c0 = p * 8, nc = e->n - c0 < 8 ? e->n - c0 : 8;
        for (int64_t r = 0; r < rows; r++) {
            __m256 g = _mm256_loadu_ps(o + r * 16), u = _mm256_loadu_ps(o + r * 16 + 8);
            if (e->pre) {  // adapters' gate and up products (lora_rows), before the activation as in W + s B A
                float t[16] = {0};
                const float *pr = e->pre + (i0 + r) * e->ldp;
                memcpy(t, pr + c0, nc * sizeof(float));
                memcpy(t + 8, pr + e->n + c0, nc * sizeof(float));
                g = _mm256_add_ps(g, _mm256_loadu_ps(t));
                u = _mm256_add_ps(u, _mm256_loadu_ps(t + 8));
            }
            __m256 v = _mm256_mul_ps(silu8(g), u);
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
    Epilogue e = {bias, y, ldy, n, acc, 0, NULL, 0};
    packed_product(x, m, k, ldx, packed, (n + 15) / 16, &e, nthreads);
}

/* One product per head (latent attention's absorbed products, model/mla.py):
 * for h < heads, y[i, h * y_head + c] = x[i, h * x_head : h * x_head + k] .
 * w_h[c, :] for c < n, w_h given as pack(w_h) at packed + h * panels * k * 16.
 * Every head's panels in one parallel loop; each output one accumulator
 * summed over k in order, so a row's result does not depend on the rows
 * beside it (torch's bmm's bits do): a verified row's products are a
 * decode's. */
void ts_linear_heads(const float *x, int64_t m, int64_t k, int64_t ldx, int64_t x_head, const float *packed,
                     int64_t n, int64_t heads, float *y, int64_t ldy, int64_t y_head, int nthreads) {
    const int64_t panels = (n + 15) / 16;
#pragma omp parallel num_threads(nthreads)
    for (int64_t m0 = 0; m0 < m; m0 += ROW_BLOCK) {
        const int64_t m1 = m - m0 < ROW_BLOCK ? m : m0 + ROW_BLOCK;
#pragma omp for schedule(static) nowait
        for (int64_t hp = 0; hp < heads * panels; hp++) {
            const int64_t h = hp / panels, p = hp % panels;
            const Epilogue e = {NULL, y + h * y_head, ldy, n, 0, 0, NULL, 0};
            float o[6 * 16];
            for (int64_t i0 = m0; i0 < m1; i0 += 6) {
                tile_rows(x + h * x_head, m1, ldx, packed + hp * k * 16, k, i0, o);
                finish_tile(&e, p, i0, m1 - i0 < 6 ? m1 - i0 : 6, o);
            }
        }
    }
}

/* The MLP's first half on gate and up packed together (cpu_kernels.
 * pack_gate_up): panel p holds gate rows [8p, 8p + 8) then up rows
 * [8p, 8p + 8), so y[i, 8p + c] = silu(gate) * up comes out of one tile.
 * pre (or NULL): LoRA deltas of gate and up, added before the activation. */
void ts_gate_up_silu(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed,
                     int64_t inter, float *y, int64_t ldy, const float *pre, int64_t ldp, int nthreads) {
    Epilogue e = {NULL, y, ldy, inter, 0, 1, pre, ldp};
    packed_product(x, m, k, ldx, packed, (inter + 7) / 8, &e, nthreads);
}

/* LoRA adapters over the rows of a batch (Punica's SGMV): for row i with
 * slot s = slot[i] >= 0 and rank r > 0 there,
 *
 *     u[j] = scale[s] * (x[i] . a[s, j])                      (j < r)
 *     y[i, :n] += sum_j u[j] * bt[s, j, :n]                   (in order of j)
 *
 * (with `overwrite`, y[i] = that sum, and 0 for a row without one: the
 * gate/up deltas' buffer needs no zeroing first). a: [slots][r_max][k]
 * (lora_A); bt: lora_B transposed in panels of 16 outputs,
 * [slots][ceil(n / 16)][r_max][16] (zero past n), so the product reads each
 * slot's matrices front to back (row-major B^T, 16 rows of it at a time,
 * ran 1.5x slower: sixteen strided streams). A slot's matrices
 * are float32 (a32, bt32, its rank in rank32) or bfloat16 (a16, bt16,
 * rank16): an adapter runs in the precision its file holds (exactly), and
 * a bf16 one reads half the bytes.
 *
 * `order` lists the rows grouped by slot; up to LORA_TILE rows of one slot
 * run together, each weight vector loaded (and widened from bf16) once for
 * all of them: one row at a time ran at a third of the speed (bound by the
 * loads and conversions). A row keeps its own accumulators, each summed in
 * the same order whatever rows share its tile, so a row's result never
 * depends on which adapters its neighbours use, as for the base products. */
#define LORA_TILE 4

static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float bf16f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline __attribute__((always_inline)) __m256 w8(const void *w, int64_t i, const int half) {
    return half ? bf16x8((const uint16_t *)w + i) : _mm256_loadu_ps((const float *)w + i);
}

static inline __attribute__((always_inline)) float w1(const void *w, int64_t i, const int half) {
    return half ? bf16f(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

static inline __attribute__((always_inline)) void lora_tile(const float *x, int64_t ldx, const int32_t *rows,
                                                             int64_t k, const void *as, const void *bs, int64_t r,
                                                             int64_t r_max, float scale, int64_t n, float *y,
                                                             int64_t ldy, int overwrite, const int R, const int half) {
    const int64_t esz = half ? 2 : 4;
    const float *xr[LORA_TILE];
    float *yr[LORA_TILE];
    for (int t = 0; t < R; t++) xr[t] = x + rows[t] * ldx, yr[t] = y + rows[t] * ldy;
    float u[LORA_TILE][r];
    // The panels B^T are read only after u: their fetch is started now, a
    // share per j, so it overlaps the first half (these weights come from
    // memory: a step reads every adapter once, and caches hold the base model).
    const int64_t bt_bytes = (n + 15) / 16 * r_max * 16 * esz, share = (bt_bytes / r + 63) / 64 * 64;
    for (int64_t j = 0; j < r; j++) {  // u = scale * (x . a_j): two partial sums per row, then the tail
        const char *aj = (const char *)as + j * k * esz;
        for (int64_t b = j * share; b < (j + 1) * share && b < bt_bytes; b += 64)
            _mm_prefetch((const char *)bs + b, _MM_HINT_T1);
        for (int64_t b = 0; j + 1 < r && b < k * esz; b += 64) _mm_prefetch(aj + k * esz + b, _MM_HINT_T0);
        __m256 s0[LORA_TILE], s1[LORA_TILE];
        for (int t = 0; t < R; t++) s0[t] = s1[t] = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= k; i += 16) {
            const __m256 wa = w8(aj, i, half), wb = w8(aj, i + 8, half);
            for (int t = 0; t < R; t++) {
                s0[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[t] + i), wa, s0[t]);
                s1[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[t] + i + 8), wb, s1[t]);
            }
        }
        for (; i + 8 <= k; i += 8) {
            const __m256 wa = w8(aj, i, half);
            for (int t = 0; t < R; t++) s0[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[t] + i), wa, s0[t]);
        }
        for (int t = 0; t < R; t++) {
            float v = hsum8(_mm256_add_ps(s0[t], s1[t]));
            for (int64_t q = i; q < k; q++) v += xr[t][q] * w1(aj, q, half);
            u[t][j] = scale * v;
        }
    }
    for (int64_t c = 0; c < n; c += 16) {  // y += u . bt: a panel (16 columns) of every row of the tile
        const char *panel = (const char *)bs + (c / 16) * r_max * 16 * esz;
        __m256 c0[LORA_TILE], c1[LORA_TILE];
        for (int t = 0; t < R; t++) c0[t] = c1[t] = _mm256_setzero_ps();
        for (int64_t j = 0; j < r; j++) {
            const __m256 wa = w8(panel, j * 16, half), wb = w8(panel, j * 16 + 8, half);
            for (int t = 0; t < R; t++) {
                const __m256 uj = _mm256_set1_ps(u[t][j]);
                c0[t] = _mm256_fmadd_ps(uj, wa, c0[t]);
                c1[t] = _mm256_fmadd_ps(uj, wb, c1[t]);
            }
        }
        const int64_t nc = n - c < 16 ? n - c : 16;
        for (int t = 0; t < R; t++) {
            float o[16];
            if (overwrite || nc < 16) {
                _mm256_storeu_ps(o, c0[t]);
                _mm256_storeu_ps(o + 8, c1[t]);
                for (int64_t q = 0; q < nc; q++) yr[t][c + q] = overwrite ? o[q] : yr[t][c + q] + o[q];
            } else {
                _mm256_storeu_ps(yr[t] + c, _mm256_add_ps(_mm256_loadu_ps(yr[t] + c), c0[t]));
                _mm256_storeu_ps(yr[t] + c + 8, _mm256_add_ps(_mm256_loadu_ps(yr[t] + c + 8), c1[t]));
            }
        }
    }
}

static void lora_tile_any(const float *x, int64_t ldx, const int32_t *rows, int nr, int64_t k, const void *as,
                          const void *bs, int64_t r, int64_t r_max, float scale, int64_t n, float *y, int64_t ldy,
                          int overwrite, int half) {
#define LORA_CASE(R)                                                                                  \
    case R:                                                                                           \
        if (half) lora_tile(x, ldx, rows, k, as, bs, r, r_max, scale, n, y, ldy, overwrite, R, 1);    \
        else lora_tile(x, ldx, rows, k, as, bs, r, r_max, scale, n, y, ldy, overwrite, R, 0);         \
        break;
    switch (nr) {
        LORA_CASE(1)
        LORA_CASE(2)
        LORA_CASE(3)
        default: LORA_CASE(4)
    }
#undef LORA_CASE
}

/* lora_tile for a bf16 slot of even rank on AVX512-BF16 (`dp` below): the
 * tile's rows rounded to bf16 once, then every product a `vdpbf16ps` (two
 * bf16 products into each float lane; no widening of the weights): the
 * shrink pairs neighbouring inputs, the expand pairs ranks j and j + 1 (the
 * two 16-wide panel rows, interleaved by one permute) against u rounded to
 * bf16 -- bf16 operands with float sums, as PEFT runs a bf16 adapter. About
 * a quarter of lora_tile's instructions (it was bound by them: the adapters
 * stay in cache between steps). A row still keeps its own accumulators. */
static inline uint32_t bf16_bits(float f) {  // round to nearest even, as vcvtne2ps2bf16
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u + 0x7fff + ((u >> 16) & 1)) >> 16;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static inline __attribute__((always_inline)) void
lora_tile_dp(const float *x, int64_t ldx, const int32_t *rows, int64_t k, const uint16_t *as, const uint16_t *bs,
             int64_t r, int64_t r_max, float scale, int64_t n, float *y, int64_t ldy, int overwrite, const int R) {
    const int64_t k32 = k / 32 * 32;
    const float *xr[LORA_TILE];
    float *yr[LORA_TILE];
    for (int t = 0; t < R; t++) xr[t] = x + rows[t] * ldx, yr[t] = y + rows[t] * ldy;
    uint16_t xb[LORA_TILE][k32 + 32];  // callers keep k <= LORA_DP_MAX_K
    for (int t = 0; t < R; t++)
        for (int64_t i = 0; i < k32; i += 32)
            _mm512_storeu_si512(xb[t] + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr[t] + i + 16),
                                                                        _mm512_loadu_ps(xr[t] + i)));
    uint32_t up[LORA_TILE][r / 2];
    float u[LORA_TILE][r];
    const int64_t bt_bytes = (n + 15) / 16 * r_max * 16 * 2, share = (bt_bytes / r + 63) / 64 * 64;
    for (int64_t j = 0; j < r; j++) {
        const uint16_t *aj = as + j * k;
        for (int64_t b = j * share; b < (j + 1) * share && b < bt_bytes; b += 64)
            _mm_prefetch((const char *)bs + b, _MM_HINT_T1);
        for (int64_t b = 0; j + 1 < r && b < k * 2; b += 64) _mm_prefetch((const char *)(aj + k) + b, _MM_HINT_T0);
        __m512 acc[LORA_TILE];
        for (int t = 0; t < R; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t i = 0; i < k32; i += 32) {
            const __m512bh w = (__m512bh)_mm512_loadu_si512(aj + i);
            for (int t = 0; t < R; t++)
                acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_loadu_si512(xb[t] + i), w);
        }
        for (int t = 0; t < R; t++) {
            float v = _mm512_reduce_add_ps(acc[t]);
            for (int64_t q = k32; q < k; q++) v += xr[t][q] * bf16f(aj[q]);
            u[t][j] = scale * v;
        }
    }
    for (int t = 0; t < R; t++)
        for (int64_t p = 0; p < r / 2; p++) up[t][p] = bf16_bits(u[t][2 * p]) | bf16_bits(u[t][2 * p + 1]) << 16;
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t c = 0; c < n; c += 16) {
        const uint16_t *panel = bs + (c / 16) * r_max * 16;
        __m512 acc[LORA_TILE];
        for (int t = 0; t < R; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t p = 0; p < r / 2; p++) {  // panel rows 2p and 2p + 1: 32 bf16 in a row, paired by column
            const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(panel + p * 32));
            for (int t = 0; t < R; t++)
                acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_set1_epi32((int)up[t][p]), w);
        }
        const int64_t nc = n - c < 16 ? n - c : 16;
        const __mmask16 mask = (__mmask16)((1u << nc) - 1);
        for (int t = 0; t < R; t++) {
            const __m512 prev = overwrite ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, yr[t] + c);
            _mm512_mask_storeu_ps(yr[t] + c, mask, _mm512_add_ps(prev, acc[t]));
        }
    }
}

#define LORA_DP_MAX_K 8192

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) static void lora_tile_dp_any(
    const float *x, int64_t ldx, const int32_t *rows, int nr, int64_t k, const uint16_t *as, const uint16_t *bs,
    int64_t r, int64_t r_max, float scale, int64_t n, float *y, int64_t ldy, int overwrite) {
    switch (nr) {
        case 1: lora_tile_dp(x, ldx, rows, k, as, bs, r, r_max, scale, n, y, ldy, overwrite, 1); break;
        case 2: lora_tile_dp(x, ldx, rows, k, as, bs, r, r_max, scale, n, y, ldy, overwrite, 2); break;
        case 3: lora_tile_dp(x, ldx, rows, k, as, bs, r, r_max, scale, n, y, ldy, overwrite, 3); break;
        default: lora_tile_dp(x, ldx, rows, k, as, bs, r, r_max, scale, n, y, ldy, overwrite, 4); break;
    }
}

/* One projection of a group that reads the same input (q, k, v; or gate,
 * up): its stacks (0 where a precision has none), output width, and where
 * its output goes. Passed as int64 words (lora/rows.py fills them). */
typedef struct {
    int64_t a32, bt32, rank32, a16, bt16, rank16, n, y, ldy;
} LoraModule;

/* Every row's adapter products for `nmod` projections of one input x.
 * dp: bf16 slots of even rank run lora_tile_dp (the caller has checked the
 * CPU has AVX512-BF16). Returns nonzero when the tile list found no memory
 * (nothing is written). */
int ts_lora_rows(const float *x, int64_t m, int64_t k, int64_t ldx, const int32_t *order, const int32_t *slot,
                 const float *scale, const int64_t *modules, int64_t nmod, int64_t r_max, int overwrite, int dp,
                 int nthreads) {
    const LoraModule *mods = (const LoraModule *)modules;
    int64_t *tiles = malloc(sizeof(int64_t) * (m + 1));  // first position in `order` of each tile
    if (tiles == NULL) return 1;
    int64_t nt = 0;
    for (int64_t p = 0; p < m;) {
        int64_t q = p + 1;
        while (q < m && q - p < LORA_TILE && slot[order[q]] == slot[order[p]]) q++;
        tiles[nt++] = p;
        p = q;
    }
    tiles[nt] = m;
#pragma omp parallel for schedule(static) num_threads(nt > 1 ? nthreads : 1)
    for (int64_t t = 0; t < nt; t++) {
        const int32_t *rows = order + tiles[t];
        const int nr = (int)(tiles[t + 1] - tiles[t]);
        const int32_t s = slot[rows[0]];
        for (int64_t i = 0; i < nmod; i++) {  // one tile through every projection: its rows stay in cache
            const LoraModule *M = mods + i;
            const int32_t *rank32 = (const int32_t *)(intptr_t)M->rank32;
            const int32_t *rank16 = (const int32_t *)(intptr_t)M->rank16;
            const int64_t r32 = s >= 0 && rank32 ? rank32[s] : 0, r16 = s >= 0 && rank16 ? rank16[s] : 0;
            const int64_t n = M->n, bt_slot = (n + 15) / 16 * 16 * r_max;  // a slot's panels
            float *y = (float *)(intptr_t)M->y;
            if (r16 > 0 && dp && r16 % 2 == 0 && k <= LORA_DP_MAX_K)
                lora_tile_dp_any(x, ldx, rows, nr, k, (const uint16_t *)(intptr_t)M->a16 + s * r_max * k,
                                 (const uint16_t *)(intptr_t)M->bt16 + s * bt_slot, r16, r_max, scale[s], n, y,
                                 M->ldy, overwrite);
            else if (r16 > 0)
                lora_tile_any(x, ldx, rows, nr, k, (const uint16_t *)(intptr_t)M->a16 + s * r_max * k,
                              (const uint16_t *)(intptr_t)M->bt16 + s * bt_slot, r16, r_max, scale[s], n, y, M->ldy,
                              overwrite, 1);
            else if (r32 > 0)
                lora_tile_any(x, ldx, rows, nr, k, (const float *)(intptr_t)M->a32 + s * r_max * k,
                              (const float *)(intptr_t)M->bt32 + s * bt_slot, r32, r_max, scale[s], n, y, M->ldy,
                              overwrite, 0);
            else if (overwrite)
                for (int q = 0; q < nr; q++) memset(y + rows[q] * M->ldy, 0, n * sizeof(float));
        }
    }
    free(tiles);
    return 0;
}

/* y = x / sqrt(mean(x^2) + eps) * w for one row of d (HF Llama's order);
 * y may be x (every value is read before any is written). */
static inline void rms_row(const float *x, int64_t d, const float *w, float eps, float *y) {
    const float inv = 1.0f / sqrtf(dot(x, x, d) / (float)d + eps);
    for (int64_t j = 0; j < d; j++) y[j] = (x[j] * inv) * w[j];
}

void ts_rms_norm(const float *x, int64_t m, int64_t d, int64_t ldx, const float *w, float eps,
                 float *y, int64_t ldy, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(m > 16 ? nthreads : 1)
    for (int64_t i = 0; i < m; i++) rms_row(x + i * ldx, d, w, eps, y + i * ldy);
}

/* In place, each of `heads` heads of d values of each of t rows (row i at
 * x + i * ldx): Qwen3's norm of every q and k head before RoPE. */
void ts_rms_norm_heads(float *x, int64_t t, int64_t ldx, int64_t heads, int64_t d, const float *w, float eps,
                       int nthreads) {
#pragma omp parallel for schedule(static) num_threads(t > 16 ? nthreads : 1)
    for (int64_t i = 0; i < t; i++)
        for (int64_t h = 0; h < heads; h++) rms_row(x + i * ldx + h * d, d, w, eps, x + i * ldx + h * d);
}

/* ---------------------------------------------------------- quantized K/V rows
 *
 * The row layout, the rotation and reading a row back: kv_rows.h.
 * Quantizing does kv_quant.py's float32 operations in its order (no FMA
 * contraction: -ffp-contract=off), so both write the same bytes. */
static void quantize_kv_row(const float *x, int64_t d, int fmt, uint8_t *row) {
    uint16_t *scales = (uint16_t *)(row + (fmt == TS_Q8_0 ? d : d / 2));
    for (int64_t g = 0; g < d / 32; g++) {
        const float *xg = x + 32 * g;
        float amax = 0.0f, peak = 0.0f;
        if (fmt == TS_Q8_0) {  // the largest magnitude (a max: any order gives it)
            const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
            __m256 m = _mm256_setzero_ps();
            for (int j = 0; j < 32; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(xg + j), abs));
            float lanes[8];
            _mm256_storeu_ps(lanes, m);
            for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
        } else {
            for (int j = 0; j < 32; j++) {
                const float a = fabsf(xg[j]);
                if (a > amax) amax = a, peak = xg[j];  // the first value of largest magnitude
            }
        }
        const float dq = fmt == TS_Q8_0 ? amax / 127.0f : peak / -8.0f;
        const float inv = dq != 0.0f ? 1.0f / dq : 0.0f;
        const uint16_t h = _cvtss_sh(dq, _MM_FROUND_TO_NEAREST_INT);
        memcpy(scales + g, &h, 2);
        if (fmt == TS_Q8_0) {
            for (int j = 0; j < 32; j += 8) {  // half to even, as torch.round; clamped to +-127
                __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xg + j), _mm256_set1_ps(inv)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q = _mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
                const __m256i w = _mm256_cvtps_epi32(q);  // exact: q is an integer
                const __m128i h16 = _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
                _mm_storel_epi64((__m128i *)(row + 32 * g + j), _mm_packs_epi16(h16, h16));
            }
        } else {
            uint8_t *c = row + 16 * g;
            for (int j = 0; j < 16; j++) {
                const float lo = xg[j] * inv + 8.5f, hi = xg[j + 16] * inv + 8.5f;
                const int ql = lo >= 15.0f ? 15 : (int)lo, qh = hi >= 15.0f ? 15 : (int)hi;
                c[j] = (uint8_t)((ql < 0 ? 0 : ql) | ((qh < 0 ? 0 : qh) << 4));
            }
        }
    }
}

/* RoPE (rotate-half layout) in place on the q and k heads of each token's
 * fused q|k|v row, then the token's k and v into its cache slot.
 * qkv: [t, ldq] with hq q heads, hkv k heads, hkv v heads of d floats;
 * cos/sin: [max_len, d] tables; caches: [num_blocks, hkv, bs, row] in the
 * pool's format kv_fmt: float32, bfloat16 (d % 8 == 0), or q8_0 / q4_0
 * rows of kv_row_bytes (d % 32 == 0). */
void ts_rope_store(float *qkv, int64_t t, int64_t ldq, int64_t hq, int64_t hkv, int64_t d,
                   const float *cos_t, const float *sin_t, const int64_t *pos, void *k_cache,
                   void *v_cache, const int64_t *slot_block, const int64_t *slot_offset, int64_t bs,
                   int kv_fmt, int nthreads) {
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
            const int64_t off = (base + h * bs) * d;
            const float *k = row + (hq + h) * d, *v = row + (hq + hkv + h) * d;
            if (kv_fmt == TS_Q8_0 || kv_fmt == TS_Q4_0) {  // quantized rows: bytes, not values
                const int64_t rb = kv_row_bytes(kv_fmt, d);
                float rk[256], rv[256];  // rotated copies: qkv's k must stay as computed (d <= 256)
                memcpy(rk, k, d * sizeof(float));
                memcpy(rv, v, d * sizeof(float));
                rotate32(rk, d);
                rotate32(rv, d);
                quantize_kv_row(rk, d, kv_fmt, (uint8_t *)k_cache + (base + h * bs) * rb);
                quantize_kv_row(rv, d, kv_fmt, (uint8_t *)v_cache + (base + h * bs) * rb);
            } else if (kv_fmt == TS_BF16) {  // a bf16 pool (attention_bf16.c): K and V rounded once, here
                for (int64_t e = 0; e < d; e += 8) {
                    bf16_store8((uint16_t *)k_cache + off + e, _mm256_loadu_ps(k + e));
                    bf16_store8((uint16_t *)v_cache + off + e, _mm256_loadu_ps(v + e));
                }
            } else {
                memcpy((float *)k_cache + off, k, d * sizeof(float));
                memcpy((float *)v_cache + off, v, d * sizeof(float));
            }
        }
    }
}

/* Attention: one arithmetic for every query, decode or prefill.
 *
 * A query's result is computed by the same float operations in the same
 * order whichever kernel runs it, so a token scores the same in a decode
 * step, in a prefill chunk, and when a preempted or dropped sequence is
 * recomputed. The quantized products make this matter: they round their
 * inputs to 8-bit codes, and a difference in the last bit of an attention
 * output can move a code and then a greedy token.
 * Per query (pre-scaled: q_e * scale), keys in blocks of KB aligned at 0:
 *   s_i     = sum over e in order of fma(q_e, k_ie, s)           (from 0)
 *   m'      = max(m, max_i s_i);  p_i = exp8(s_i - m')  (hidden keys: 0)
 *   sum     = keys i in lanes i % 8, each lane in key order, then the
 *             lanes as hsum8 adds them: ((0+4)+(2+6))+((1+5)+(3+7))
 *   a       = exp8(m - m');  l = fma(l, a, sum);  o = a * o
 *   o_c     = over keys in order, fma(v_ic, p_i, o_c)
 *   out     = o * (1 / l)
 * Keys a query cannot see contribute exact zeros (and a block it cannot see
 * at all rescales by exp8(0) = 1), so its result does not depend on the
 * chunk, the query block or the other queries. */
/* Prefill queries per block, in vectors of QV lanes: the AVX-512 build's
 * tiles are twice as wide, each lane doing what an AVX2 lane does. */
#if defined(__AVX512F__)
#define QV 16
typedef __m512 qvec;
#define QLOAD _mm512_loadu_ps
#define QSTORE _mm512_storeu_ps
#define QSET1 _mm512_set1_ps
#define QZERO _mm512_setzero_ps
#define QFMA _mm512_fmadd_ps
#define QMAX _mm512_max_ps
#define QSUB _mm512_sub_ps
#define QADD _mm512_add_ps
#define QEXP exp16
/* e where x is not -inf (a hidden key), else exactly 0 */
#define QKEEP(x, e) _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ), e)
#else
#define QV 8
typedef __m256 qvec;
#define QLOAD _mm256_loadu_ps
#define QSTORE _mm256_storeu_ps
#define QSET1 _mm256_set1_ps
#define QZERO _mm256_setzero_ps
#define QFMA _mm256_fmadd_ps
#define QMAX _mm256_max_ps
#define QSUB _mm256_sub_ps
#define QADD _mm256_add_ps
#define QEXP exp8
#define QKEEP(x, e) _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), e)
#endif
#define QB (3 * QV)


/* Decode attention for n sequences of one query token each, through block
 * tables. Task: (sequence, kv head, a run of its query heads): all the
 * group's heads share each transposed key tile, unless there are fewer
 * (sequence, kv head) pairs than threads, then one task per query head.
 * Against the split-by-keys kernel this replaced (whose sums ran in
 * another order): 1.0-1.25x its time, docs/benchmarks.md. Scores are 8 keys
 * in the lanes (keys transposed 8 x 8), so each key's sum over e runs in
 * order as in the prefill kernel, where the queries are the lanes.
 * tables: the block ids of all sequences back to back, sequence s's from
 * table_start[s]; ctx[s]: tokens in its cache (incl. this one); q row and
 * out row of s: rows[s]. window > 0: the query sees only the latest window
 * keys (a sliding-window layer); the table's blocks before them are never
 * read, so a window layer may have freed them. Requires d % 8 == 0 and
 * d <= 256. */
#define MAX_GROUP 16

/* Values e0 .. e0 + 7 of a quantized row (e0 % 8 == 0) whose group's scale
 * is sc: dequantize_kv_row's operations for those lanes, in registers. */
static inline __attribute__((always_inline)) __m256 dequant8(const uint8_t *row, const int fmt, int64_t e0,
                                                             float sc) {
    if (fmt == TS_Q8_0)
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + e0)))),
                             _mm256_set1_ps(sc));
    const int64_t j = e0 % 32;  // q4_0: byte 16 g + j holds values j (low nibble) and j + 16 (high) of group g
    __m128i b = _mm_loadl_epi64((const __m128i *)(row + 16 * (e0 / 32) + (j & 15)));
    if (j >= 16) b = _mm_srli_epi16(b, 4);
    b = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    return _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_set1_ps(8.0f)),
                         _mm256_set1_ps(sc));
}

/* The float16 scales of a quantized row as floats. */
static inline void row_scales(const uint8_t *row, const int fmt, int64_t d, float *sc) {
    const uint16_t *h = (const uint16_t *)(row + (fmt == TS_Q8_0 ? d : d / 2));
    for (int64_t g = 0; g < d / 32; g++) {
        uint16_t x;
        memcpy(&x, h + g, 2);
        sc[g] = _cvtsh_ss(x);
    }
}

/* Scores of keys kb0 + t .. kb0 + t + 31 (all inside the context) of a
 * float32 pool for nh <= 2 query heads, into s, and those keys' V rows into
 * vp: what decode_heads' loop over groups of 8 keys computes, the same
 * operations for every key (its sum over e in order), four groups at a time.
 * With one head a group was one chain of dependent FMAs (d of them), so an
 * MHA model's decode waited on FMA latency; here four (or eight) run
 * together. */
static inline __attribute__((always_inline)) void scores32(
    const float *qs, int64_t nh, int64_t d, const void *k_cache, const void *v_cache, const int64_t *table,
    int64_t hkv, int64_t h, int64_t bs, int64_t kb0, int64_t t, int64_t hid, float *s, const float **vp) {
    const float *kp[4][8];
    for (int g = 0; g < 4; g++)
        for (int u = 0; u < 8; u++) {
            const int64_t i = t + 8 * g + u, key = kb0 + (i < hid ? hid : i);
            const int64_t r = (table[key / bs] * hkv + h) * bs + key % bs;
            kp[g][u] = (const float *)k_cache + r * d;
            vp[i] = (const float *)v_cache + r * d;
        }
    __m256 acc[2][4];
    for (int j = 0; j < 2; j++)
        for (int g = 0; g < 4; g++) acc[j][g] = _mm256_setzero_ps();
    for (int64_t e0 = 0; e0 < d; e0 += 8)
        for (int g = 0; g < 4; g++) {
            __m256 r[8], c[8];
            for (int u = 0; u < 8; u++) r[u] = _mm256_loadu_ps(kp[g][u] + e0);
            transpose8(r, c);
            for (int64_t j = 0; j < nh; j++)
                for (int ee = 0; ee < 8; ee++)
                    acc[j][g] = _mm256_fmadd_ps(_mm256_set1_ps(qs[j * d + e0 + ee]), c[ee], acc[j][g]);
        }
    for (int64_t j = 0; j < nh; j++)
        for (int g = 0; g < 4; g++) _mm256_storeu_ps(s + j * KB + t + 8 * g, acc[j][g]);
}

/* Into L2, the K and V rows of keys [k0, min(k0 + n, ctx)) of kv head h. A key block's
 * rows lie in pieces of one pool block (16 rows of 256 bytes for a float32
 * head of 64) scattered over the pool, and the hardware prefetchers stop at
 * each piece's end: fetched one key block ahead, a piece's misses overlap
 * the block before it instead of stalling its first loads. */
static inline void prefetch_keys(const void *k_cache, const void *v_cache, const int64_t *table, int64_t hkv,
                                 int64_t h, int64_t bs, int64_t rb, int64_t k0, int64_t n, int64_t ctx) {
    const int64_t k1 = k0 + n < ctx ? k0 + n : ctx;
    for (int64_t key = k0; key < k1;) {
        const int64_t r = (table[key / bs] * hkv + h) * bs + key % bs;
        const int64_t rows = bs - key % bs < k1 - key ? bs - key % bs : k1 - key;
        const char *kp = (const char *)k_cache + r * rb, *vp = (const char *)v_cache + r * rb;
        for (int64_t b = 0; b < rows * rb; b += 64) {
            _mm_prefetch(kp + b, _MM_HINT_T1);
            _mm_prefetch(vp + b, _MM_HINT_T1);
        }
        key += rows;
    }
}

/* One (sequence, kv head, run of query heads) task. fmt is a constant in
 * each copy (decode_heads_any). A quantized pool's K rows are dequantized
 * in registers where the float32 kernel loads them (each K element is read
 * once, for all heads of the run); its V rows once per key block into an L1
 * buffer, which every head then reads (V dequantized in registers instead
 * is dequantized once per head: 2.91 vs 2.58 ms for a q8_0 layer of 16
 * sequences x 3,000 keys, docs/benchmarks.md). The query is rotated first
 * and the output rotated back (kv_rows.h); every operation between is the
 * float32 kernel's, so a quantized pool's result is the float32 kernel's
 * over its dequantized values for the rotated query, rotated back. */
static inline __attribute__((always_inline)) void decode_heads(
    const float *q, int64_t hq, int64_t hkv, int64_t d, const void *k_cache, const void *v_cache, const int fmt,
    int64_t bs, const int64_t *table, int64_t lo, int64_t ctx, int64_t h, int64_t j0, int64_t nh, float scale,
    const float *sinks, float *out) {
    const int64_t group = hq / hkv, rb = kv_row_bytes(fmt, d);
    const int quant = fmt == TS_Q8_0 || fmt == TS_Q4_0;
    float qs[MAX_GROUP * 256], o[MAX_GROUP * 256], m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP * KB];
    float ksc[8][8];  // a quantized pool's K row scales (d <= 256: 8 groups)
    float vq[KB * 256];  // its V rows of the key block, dequantized once (every head of the run reads them)
    for (int64_t j = 0; j < nh; j++) {
        const float *qr = q + (h * group + j0 + j) * d;
        for (int64_t e = 0; e < d; e++) qs[j * d + e] = qr[e], o[j * d + e] = 0.0f;
        if (quant) rotate32(qs + j * d, d);  // q . k = (H q) . (H k) / 32: the / 32 goes with the scale (exact)
        const float sc = quant ? scale * 0.03125f : scale;
        for (int64_t e = 0; e < d; e++) qs[j * d + e] *= sc;
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    // Key blocks stay aligned at 0 (as in the prefill kernel); the window's
    // first block starts before lo, its keys before lo are dropped.
    for (int64_t kb0 = lo / KB * KB; kb0 < ctx; kb0 += KB) {
        const int64_t nk = ctx - kb0 < KB ? ctx - kb0 : KB, hid = lo > kb0 ? lo - kb0 : 0;
        const float *vp[KB];
        int64_t t = 0;
        // Before scoring keys t.. of this block, fetch keys t.. of the next one (the task's first
        // block was fetched during the task before it: ts_decode_attention_q).
        if (!quant && nh <= 2)  // float32 rows, one or two heads: 32 keys at a time
            for (; t + 32 <= nk; t += 32) {
                prefetch_keys(k_cache, v_cache, table, hkv, h, bs, rb, kb0 + KB + t, 32, ctx);
                scores32(qs, nh, d, k_cache, v_cache, table, hkv, h, bs, kb0, t, hid, s, vp);
            }
        for (; t < nk; t += 8) {
            prefetch_keys(k_cache, v_cache, table, hkv, h, bs, rb, kb0 + KB + t, 8, ctx);
            const float *kp[8];
            const uint8_t *kb[8];
            for (int u = 0; u < 8; u++) {  // past the context: repeat the last key (its lanes are dropped)
                const int64_t i = t + u < nk ? t + u : nk - 1;
                const int64_t key = kb0 + (i < hid ? hid : i);  // before the window: key lo's row (never a freed block)
                const int64_t r = (table[key / bs] * hkv + h) * bs + key % bs;
                if (quant) {
                    kb[u] = (const uint8_t *)k_cache + r * rb;
                    row_scales(kb[u], fmt, d, ksc[u]);
                    if (t + u < nk) {
                        dequantize_kv_row((const uint8_t *)v_cache + r * rb, d, fmt, vq + (t + u) * d);
                        vp[t + u] = vq + (t + u) * d;
                    }
                } else {
                    kp[u] = (const float *)k_cache + r * d;
                    if (t + u < nk) vp[t + u] = (const float *)v_cache + r * d;
                }
            }
            __m256 acc[MAX_GROUP];
            for (int64_t j = 0; j < nh; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t e0 = 0; e0 < d; e0 += 8) {
                __m256 r[8], c[8];
                for (int u = 0; u < 8; u++)
                    r[u] = quant ? dequant8(kb[u], fmt, e0, ksc[u][e0 / 32]) : _mm256_loadu_ps(kp[u] + e0);
                transpose8(r, c);
                for (int64_t j = 0; j < nh; j++)
                    for (int ee = 0; ee < 8; ee++)
                        acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(qs[j * d + e0 + ee]), c[ee], acc[j]);
            }
            for (int64_t j = 0; j < nh; j++) _mm256_storeu_ps(s + j * KB + t, acc[j]);
        }
        for (int64_t j = 0; j < nh; j++) {
            float *sj = s + j * KB, *oj = o + j * d;
            decode_softmax_block(sj, nk, m + j, l + j, oj, d, 0, hid);
            // o_c = fma(v_ic, p_i, o_c) over the keys in order, 64 values of
            // o in registers at a time (through memory each key's update
            // waited on the last one's store).
            int64_t e = 0;
            for (; e + 64 <= d; e += 64) {
                __m256 acc[8];
                for (int c = 0; c < 8; c++) acc[c] = _mm256_loadu_ps(oj + e + 8 * c);
                for (int64_t i = 0; i < nk; i++) {
                    const __m256 pi = _mm256_set1_ps(sj[i]);
                    for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(_mm256_loadu_ps(vp[i] + e + 8 * c), pi, acc[c]);
                }
                for (int c = 0; c < 8; c++) _mm256_storeu_ps(oj + e + 8 * c, acc[c]);
            }
            for (; e < d; e += 8) {
                __m256 acc = _mm256_loadu_ps(oj + e);
                for (int64_t i = 0; i < nk; i++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(vp[i] + e), _mm256_set1_ps(sj[i]), acc);
                _mm256_storeu_ps(oj + e, acc);
            }
        }
    }
    for (int64_t j = 0; j < nh; j++) {
        float *orow = out + (h * group + j0 + j) * d;
        const float inv = 1.0f / sink_sum(l[j], m[j], sinks, h * group + j0 + j);
        for (int64_t e = 0; e < d; e++) orow[e] = o[j * d + e] * inv;
        if (quant) unrotate32(orow, d);
    }
}

static void decode_heads_any(const float *q, int64_t hq, int64_t hkv, int64_t d, const void *k_cache,
                             const void *v_cache, int fmt, int64_t bs, const int64_t *table, int64_t lo, int64_t ctx,
                             int64_t h, int64_t j0, int64_t nh, float scale, const float *sinks, float *out) {
    switch (fmt) {  // a constant format in each copy: the quantized branches fold away
        case TS_Q8_0: decode_heads(q, hq, hkv, d, k_cache, v_cache, TS_Q8_0, bs, table, lo, ctx, h, j0, nh, scale, sinks, out); break;
        case TS_Q4_0: decode_heads(q, hq, hkv, d, k_cache, v_cache, TS_Q4_0, bs, table, lo, ctx, h, j0, nh, scale, sinks, out); break;
        default: decode_heads(q, hq, hkv, d, k_cache, v_cache, TS_F32, bs, table, lo, ctx, h, j0, nh, scale, sinks, out);
    }
}

/* A float32 pool (kv_fmt TS_F32) or a quantized one (TS_Q8_0, TS_Q4_0: rows
 * dequantized as they are read, the float32 pool's operations after that,
 * on the rotated query, the output rotated back: decode_heads). A CPU with
 * AMX runs quantized pools on attention_bf16.c's tiles instead. */
void ts_decode_attention_q(const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv,
                           int64_t d, const void *k_cache, const void *v_cache, int64_t bs,
                           const int64_t *tables, const int64_t *table_start, const int64_t *ctx,
                           const int64_t *rows, float scale, float *out, int64_t ldo, int kv_fmt, int64_t window,
                           const float *sinks, int nthreads) {
    const int64_t group = hq / hkv;
    // A task per (sequence, kv head) while there are as many as threads (at a
    // batch of 1 with 3 kv heads on 2 threads that beat 9 per-head tasks,
    // which transpose each key tile 3 times: 236 vs 294 us at 3,000 keys).
    const int64_t per = n * hkv >= nthreads && group <= MAX_GROUP ? group : 1, runs = group / per;
    const int64_t tasks = n * hkv * runs, rb = kv_row_bytes(kv_fmt, d);
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t T = omp_get_num_threads();
        for (int64_t ti = omp_get_thread_num(); ti < tasks; ti += T) {
            if (ti + T < tasks) {  // this thread's next task: its first key block, one task ahead
                const int64_t sn = (ti + T) / (hkv * runs), hn = (ti + T) % (hkv * runs) / runs;
                prefetch_keys(k_cache, v_cache, tables + table_start[sn], hkv, hn, bs, rb,
                              window_start(ctx[sn] - 1, window), KB, ctx[sn]);
            }
            const int64_t si = ti / (hkv * runs), t = ti % (hkv * runs), h = t / runs, j0 = (t % runs) * per;
            decode_heads_any(q + rows[si] * ldq, hq, hkv, d, k_cache, v_cache, kv_fmt, bs, tables + table_start[si],
                             window_start(ctx[si] - 1, window), ctx[si], h, j0, per, scale, sinks, out + rows[si] * ldo);
        }
    }
}

void ts_decode_attention(const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv,
                         int64_t d, const float *k_cache, const float *v_cache, int64_t bs,
                         const int64_t *tables, const int64_t *table_start, const int64_t *ctx,
                         const int64_t *rows, float scale, float *out, int64_t ldo, int nthreads) {
    ts_decode_attention_q(q, ldq, n, hq, hkv, d, k_cache, v_cache, bs, tables, table_start, ctx, rows, scale, out,
                          ldo, TS_F32, 0, NULL, nthreads);
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
 * QB queries of a block are three vectors (24 queries in the AVX2 build, 48
 * in the AVX-512 one: 9.7 vs 13.6 ms for a 512-token chunk over 2,048 keys):
 * the score tile (4 keys x QB queries, 12 accumulators) broadcasts K
 * elements against the transposed, pre-scaled queries, and max / sum over
 * keys are vertical. The output tile (6 queries x 16 or 32 dims) broadcasts
 * probabilities against V rows, which the pool already stores contiguously.
 * A chunk's last, short block computes only the vectors and output tiles
 * its queries fill: a cached request that adds 8 tokens pays for 8 queries,
 * not 24 (1.6x faster at 8 new tokens
 * over 2,300 cached, 1.08x at 150, docs/benchmarks.md). Hidden scores are
 * -inf for the max and exactly 0 after exp, and key blocks are aligned at
 * 0, so a query's result does not depend on which chunk or query block it
 * was computed in (a real score of -inf, impossible with finite q and k,
 * would be treated as hidden). window > 0 (a sliding-window layer): query
 * i sees only keys > its position - window; key blocks before the first
 * query's window are skipped and keys before it never read, the other
 * hidden keys masked as the causal ones, so the result is again the decode
 * kernel's for that query.
 * Requires d % 8 == 0. Returns the number of tasks that found no memory
 * (their outputs are not written; the caller raises). */
/* s[i][0..QV nv) = qt^T k_i for keys i < nk (nk a multiple of 4; kp padded):
 * the block's first QV nv queries, nv = 1..3 vectors (a short last block
 * skips the vectors it does not fill). Each query's score is its own lane
 * over the same steps whatever nv is, so results do not depend on it. */
#define SCORE_KEY(j)                                                               \
    b = QSET1(k##j[e]);                                                            \
    a##j##0 = QFMA(q0, b, a##j##0);                                                \
    if (nv > 1) a##j##1 = QFMA(q1, b, a##j##1);                                    \
    if (nv > 2) a##j##2 = QFMA(q2, b, a##j##2);
#define SCORE_STORE(j)                                                             \
    QSTORE(si + j * QB, a##j##0);                                                  \
    if (nv > 1) QSTORE(si + j * QB + QV, a##j##1);                                 \
    if (nv > 2) QSTORE(si + j * QB + 2 * QV, a##j##2);
static inline __attribute__((always_inline)) void score_tile(const float *qt, const float *const *kp,
                                                             int64_t nk, int64_t d, float *s, const int nv) {
    for (int64_t i = 0; i < nk; i += 4) {
        qvec a00 = QZERO(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
        qvec a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
        const float *k0 = kp[i], *k1 = kp[i + 1], *k2 = kp[i + 2], *k3 = kp[i + 3];
        for (int64_t e = 0; e < d; e++) {
            qvec q0 = QLOAD(qt + e * QB), q1 = q0, q2 = q0, b;
            if (nv > 1) q1 = QLOAD(qt + e * QB + QV);
            if (nv > 2) q2 = QLOAD(qt + e * QB + 2 * QV);
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

/* o[r][c0 + 0..w) += sum_i p[i][r0 + r] v_i[c0 + 0..w) for r < 6, w one or two
 * vectors of V floats; one definition per vector width W, so the AVX-512
 * tile (W 512) does each element's operations as the AVX2 one (W 256). */
#define PV_ROW(W, r)                                                                   \
    {                                                                                  \
        __m##W b = _mm##W##_set1_ps(pi[r]);                                            \
        a##r##0 = _mm##W##_fmadd_ps(v0, b, a##r##0);                                   \
        if (w == 2 * V) a##r##1 = _mm##W##_fmadd_ps(v1, b, a##r##1);                   \
    }
#define PV_LOAD(W, r) a##r##0 = _mm##W##_loadu_ps(o + r * d + c0);                     \
    if (w == 2 * V) a##r##1 = _mm##W##_loadu_ps(o + r * d + c0 + V);
#define PV_STORE(W, r) _mm##W##_storeu_ps(o + r * d + c0, a##r##0);                    \
    if (w == 2 * V) _mm##W##_storeu_ps(o + r * d + c0 + V, a##r##1);
#define DEFINE_PV_TILE(NAME, W, V_)                                                                         \
    static inline __attribute__((always_inline)) void NAME(const float *p, const float *const *vp, int64_t nk, \
                                                           int64_t c0, const int w, float *o, int64_t d) {   \
        enum { V = V_ };                                                                                    \
        __m##W a00, a10, a20, a30, a40, a50, a01 = _mm##W##_setzero_ps(), a11 = a01, a21 = a01, a31 = a01,   \
                                             a41 = a01, a51 = a01;                                           \
        PV_LOAD(W, 0) PV_LOAD(W, 1) PV_LOAD(W, 2) PV_LOAD(W, 3) PV_LOAD(W, 4) PV_LOAD(W, 5)                 \
        for (int64_t i = 0; i < nk; i++) {                                                                  \
            const float *pi = p + i * QB;                                                                   \
            __m##W v0 = _mm##W##_loadu_ps(vp[i] + c0), v1 = v0;                                             \
            if (w == 2 * V) v1 = _mm##W##_loadu_ps(vp[i] + c0 + V);                                         \
            PV_ROW(W, 0) PV_ROW(W, 1) PV_ROW(W, 2) PV_ROW(W, 3) PV_ROW(W, 4) PV_ROW(W, 5)                   \
        }                                                                                                   \
        PV_STORE(W, 0) PV_STORE(W, 1) PV_STORE(W, 2) PV_STORE(W, 3) PV_STORE(W, 4) PV_STORE(W, 5)           \
    }
DEFINE_PV_TILE(pv_tile, 256, 8)
#if defined(__AVX512F__)
DEFINE_PV_TILE(pv_tile16, 512, 16)
#endif

/* Query r of a block sits at position first + r and sees keys <= it: key
 * `key` is hidden from the block's first min(key - first, QB) queries. */
static inline int64_t hidden_rows(int64_t key, int64_t first) {
    int64_t t = key - first;
    return t <= 0 ? 0 : (t < QB ? t : QB);
}

/* kv_fmt as in ts_decode_attention_q: a quantized pool's key block is
 * dequantized into the task's buffer once per block, then read as a
 * float32 pool's rows (queries rotated, outputs rotated back). */
int ts_prefill_attention_q(const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                           const void *k_cache, const void *v_cache, int64_t bs, const int64_t *table,
                           int64_t ctx, float scale, float *out, int64_t ldo, int kv_fmt, int64_t window,
                           const float *sinks, int nthreads) {
    const int64_t group = hq / hkv, nqb = (n + QB - 1) / QB, rb = kv_row_bytes(kv_fmt, d);
    const int quant = kv_fmt == TS_Q8_0 || kv_fmt == TS_Q4_0;
    int failed = 0;
    // Later query blocks see more keys: hand them out first (dynamic schedule).
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nthreads) reduction(+ : failed)
    for (int64_t b = nqb - 1; b >= 0; b--) {
        for (int64_t h = 0; h < hkv; h++) {
            const int64_t q0 = b * QB, rows = n - q0 < QB ? n - q0 : QB;
            const int64_t first = ctx - n + q0;           // position of the block's query 0
            const int64_t kend = first + rows;            // keys any of its queries sees
            const int64_t lo = window_start(first, window);  // the first of them (a window layer's)
            const int nv = (int)((rows + QV - 1) / QV), R = QV * nv;  // query vectors, rows computed
            float *buf = malloc(sizeof(float) * (group * (2 * d * QB + 2 * QB) + KB * QB + (quant ? 2 * KB * d : 0)) +
                                sizeof(float *) * 2 * KB);
            if (buf == NULL) {
                failed++;
                continue;
            }
            float *qt = buf, *o = qt + group * d * QB, *m = o + group * QB * d, *l = m + group * QB,
                  *s = l + group * QB;
            float *kq = s + KB * QB, *vq = kq + (quant ? KB * d : 0);  // a quantized key block, dequantized
            const float **kp = (const float **)(vq + (quant ? KB * d : 0)), **vp = kp + KB;
            for (int64_t j = 0; j < group; j++) {
                for (int64_t r = 0; r < QB; r++) {  // rows past the chunk: zero queries, outputs unused
                    const float *qr = q + (q0 + (r < rows ? r : 0)) * ldq + (h * group + j) * d;
                    float qrot[256];  // a quantized pool's query rotated, as in decode_heads (d <= 256 there)
                    if (quant) {
                        memcpy(qrot, qr, d * sizeof(float));
                        rotate32(qrot, d);
                        qr = qrot;
                    }
                    const float sc = quant ? scale * 0.03125f : scale;
                    for (int64_t e = 0; e < d; e++) qt[(j * d + e) * QB + r] = r < rows ? qr[e] * sc : 0.0f;
                    m[j * QB + r] = -INFINITY;
                    l[j * QB + r] = 0.0f;
                }
            }
            memset(o, 0, sizeof(float) * group * QB * d);
            // Rows >= R of s are never written, yet whole PV tiles of 6 rows
            // may read them (into output rows that are never stored): zero
            // them once, so no stale NaN or denormal from malloc enters an FMA.
            memset(s, 0, sizeof(float) * KB * QB);
            for (int64_t kb0 = lo / KB * KB; kb0 < kend; kb0 += KB) {
                const int64_t nk = kend - kb0 < KB ? kend - kb0 : KB, nk4 = (nk + 3) & ~(int64_t)3;
                // Some query's window starts after this block's first key.
                const int windowed = window > 0 && kb0 + window < first + R;
                for (int64_t i = 0; i < nk4; i++) {
                    int64_t p = kb0 + (i < nk ? i : nk - 1);  // padding repeats the last key
                    if (p < lo) p = lo;  // before every query's window: a seen key's row (never a freed block)
                    int64_t r = (table[p / bs] * hkv + h) * bs + p % bs;
                    if (!quant) {
                        kp[i] = (const float *)k_cache + r * d;
                        vp[i] = (const float *)v_cache + r * d;
                    } else if (i < nk) {
                        dequantize_kv_row((const uint8_t *)k_cache + r * rb, d, kv_fmt, kq + i * d);
                        dequantize_kv_row((const uint8_t *)v_cache + r * rb, d, kv_fmt, vq + i * d);
                        kp[i] = kq + i * d, vp[i] = vq + i * d;
                    } else {
                        kp[i] = kp[nk - 1], vp[i] = vp[nk - 1];
                    }
                }
                const int masked = kb0 + nk - 1 > first;
                for (int64_t j = 0; j < group; j++) {
                    float *mj = m + j * QB, *lj = l + j * QB, *oj = o + j * QB * d;
                    score_block(qt + j * d * QB, kp, nk4, d, s, nv);
                    if (masked)
                        for (int64_t i = 0; i < nk; i++)
                            for (int64_t r = 0, hr = hidden_rows(kb0 + i, first); r < hr && r < R; r++)
                                s[i * QB + r] = -INFINITY;
                    if (windowed)  // key p is before the window of rows r >= p - first + window
                        for (int64_t i = 0; i < nk; i++)
                            for (int64_t r = kb0 + i - first + window > 0 ? kb0 + i - first + window : 0; r < R; r++)
                                s[i * QB + r] = -INFINITY;
                    float alpha[QB];
                    for (int64_t c = 0; c < R; c += QV) {
                        qvec mx = QLOAD(mj + c);
                        for (int64_t i = 0; i < nk; i++) mx = QMAX(mx, QLOAD(s + i * QB + c));
                        // The sum in the decode kernel's order: key i into lane i % 8, then hsum8's tree.
                        qvec part[8];
                        for (int u = 0; u < 8; u++) part[u] = QZERO();
                        for (int64_t i = 0; i < nk; i++) {
                            qvec x = QLOAD(s + i * QB + c), e = QEXP(QSUB(x, mx));
                            if (masked || windowed) e = QKEEP(x, e);  // hidden: exactly 0, not exp's ~1e-38
                            QSTORE(s + i * QB + c, e);
                            part[i & 7] = QADD(part[i & 7], e);
                        }
                        qvec sum = QADD(QADD(QADD(part[0], part[4]), QADD(part[2], part[6])),
                                        QADD(QADD(part[1], part[5]), QADD(part[3], part[7])));
                        qvec a = QEXP(QSUB(QLOAD(mj + c), mx));  // m_old = -inf: ~0
                        // A row whose window starts past this block saw no key yet (m_old = mx = -inf,
                        // exp of their difference undefined): a = 0, so o and l stay 0 until its first key.
                        if (windowed) a = QKEEP(mx, a);
                        QSTORE(alpha + c, a);
                        QSTORE(mj + c, mx);
                        QSTORE(lj + c, QFMA(QLOAD(lj + c), a, sum));
                    }
                    for (int64_t r = 0; r < R; r++) {
                        __m256 a = _mm256_set1_ps(alpha[r]);
                        for (int64_t e = 0; e < d; e += 8)
                            _mm256_storeu_ps(oj + r * d + e, _mm256_mul_ps(a, _mm256_loadu_ps(oj + r * d + e)));
                    }
                    for (int64_t r0 = 0; r0 < rows; r0 += 6) {
                        int64_t c0 = 0;
#if defined(__AVX512F__)
                        for (; c0 + 32 <= d; c0 += 32) pv_tile16(s + r0, vp, nk, c0, 32, oj + r0 * d, d);
                        for (; c0 + 16 <= d; c0 += 16) pv_tile16(s + r0, vp, nk, c0, 16, oj + r0 * d, d);
#endif
                        for (; c0 + 16 <= d; c0 += 16) pv_tile(s + r0, vp, nk, c0, 16, oj + r0 * d, d);
                        if (c0 < d) pv_tile(s + r0, vp, nk, c0, 8, oj + r0 * d, d);
                    }
                }
            }
            for (int64_t j = 0; j < group; j++)
                for (int64_t r = 0; r < rows; r++) {
                    const float inv = 1.0f / sink_sum(l[j * QB + r], m[j * QB + r], sinks, h * group + j);
                    float *orow = out + (q0 + r) * ldo + (h * group + j) * d;
                    for (int64_t e = 0; e < d; e++) orow[e] = o[(j * QB + r) * d + e] * inv;
                    if (quant) unrotate32(orow, d);
                }
            free(buf);
        }
    }
    return failed;
}

int ts_prefill_attention(const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                         const float *k_cache, const float *v_cache, int64_t bs, const int64_t *table,
                         int64_t ctx, float scale, float *out, int64_t ldo, int nthreads) {
    return ts_prefill_attention_q(q, ldq, n, hq, hkv, d, k_cache, v_cache, bs, table, ctx, scale, out, ldo, TS_F32,
                                  0, NULL, nthreads);
}

/* exp8 and (in the avx512 build; else exp8 again) exp16 of x[0 .. n), n a
 * multiple of 16, under FTZ/DAZ when ftz (as the attention kernels run): the
 * test that the two widths give the same bits on every input. */
void ts_exp_widths(const float *x, int64_t n, float *narrow, float *wide, int ftz) {
    const unsigned csr = _mm_getcsr();
    if (ftz) _mm_setcsr(csr | 0x8040);
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(narrow + i, exp8(_mm256_loadu_ps(x + i)));
#if defined(__AVX512F__)
    for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(wide + i, exp16(_mm512_loadu_ps(x + i)));
#else
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(wide + i, exp8(_mm256_loadu_ps(x + i)));
#endif
    _mm_setcsr(csr);
}
