/* A decode step's whole layer stack in one call (model/decode_stack.py).
 *
 * Why: at batch 1 a step's products read the weights at the memory's rate,
 * and what is left is the work around them. Driven from Python, a layer is 8
 * kernel calls through ctypes plus the views, checks and output tensors
 * around each (~60 us a layer, a third of a 135M model's step), and the
 * kernels' OpenMP workers fall asleep in those gaps and are woken for each
 * call. Here the same kernels run in the same order on the same buffers, so
 * the step computes the very bits of the per-layer path, with none of that
 * between them.
 *
 * Per layer, on the residual stream x [t, hidden] (updated in place):
 *   h = rms_norm(x, in_norm); qkv = h W_qkv^T (+ b), each part in its format
 *   into its columns; Qwen3: each q and k head normed; RoPE on q, k and k, v
 *   into the pool (ts_rope_store);
 *   a = decode attention over the pool; x += a W_o^T (+ b);
 *   h = rms_norm(x, post_norm); act = silu(h W_gate^T) * (h W_up^T);
 *   x += act W_down^T.
 * The model's final norm and LM head stay with the caller. */
#include <stdint.h>
#include <stdlib.h>

#include "formats.h"

void ts_rms_norm(const float *x, int64_t m, int64_t d, int64_t ldx, const float *w, float eps, float *y, int64_t ldy,
                 int nthreads);
void ts_linear(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n, const float *bias,
               float *y, int64_t ldy, int acc, int nthreads);
void ts_gate_up_silu(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t inter, float *y,
                     int64_t ldy, const float *pre, int64_t ldp, int nthreads);
int ts_qlinear(const float *x, int64_t m, int64_t k, int64_t ldx, const void *w, int fmt, int64_t n, const float *bias,
               float *y, int64_t ldy, int acc, int amx, int nthreads);
int ts_qgate_up_silu(const float *x, int64_t m, int64_t k, int64_t ldx, const void *gate, const void *up, int fmt,
                     int64_t inter, float *y, int64_t ldy, const float *pre, int64_t ldp, int amx, int nthreads);
void ts_rms_norm_heads(float *x, int64_t t, int64_t ldx, int64_t heads, int64_t d, const float *w, float eps,
                       int nthreads);
void ts_rope_store(float *qkv, int64_t t, int64_t ldq, int64_t hq, int64_t hkv, int64_t d, const float *cos_t,
                   const float *sin_t, const int64_t *pos, void *k_cache, void *v_cache, const int64_t *slot_block,
                   const int64_t *slot_offset, int64_t bs, int kv_fmt, int nthreads);
void ts_decode_attention_q(const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                           const void *k_cache, const void *v_cache, int64_t bs, const int64_t *tables,
                           const int64_t *table_start, const int64_t *ctx, const int64_t *rows, float scale,
                           float *out, int64_t ldo, int kv_fmt, int64_t window, const float *sinks, int nthreads);
void ts_decode_attention_bf16(const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                              const uint16_t *k_cache, const uint16_t *v_cache, int64_t bs, const int64_t *tables,
                              const int64_t *table_start, const int64_t *ctx, const int64_t *rows, float scale,
                              float *out, int64_t ldo, int64_t window, const float *sinks, int nthreads);
void ts_decode_attention_amx(const float *q, int64_t ldq, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                             const void *k_cache, const void *v_cache, int64_t bs, const int64_t *tables,
                             const int64_t *table_start, const int64_t *ctx, const int64_t *rows, float scale,
                             float *out, int64_t ldo, int kv_fmt, const float *sinks, int nthreads);

/* One product: float panels (fmt TS_F32, cpu_kernels.pack) or quantized ones
 * (quant.py pack_panels); a quantized gate|up has its up panels in w2. */
typedef struct {
    const void *w, *w2;
    const float *bias;
    int64_t n, col;  // output features, first output column
    int64_t fmt;
} TsProduct;

/* The decode attention paths (CpuKernels.decode_path). */
enum { TS_ATTN_VECTOR = 0, TS_ATTN_BF16 = 1, TS_ATTN_AMX = 2 };

typedef struct {
    const float *in_norm, *post_norm, *q_norm, *k_norm, *cos, *sin;  // q_norm, k_norm: NULL but on Qwen3
    void *k_cache, *v_cache;
    int64_t window, attn, nqkv;
    TsProduct qkv[3], o, gate_up, down;
} TsLayer;

typedef struct {
    int64_t hidden, hq, hkv, d, inter, bs, kv_fmt, amx_int8;
    float eps, scale;
} TsStack;

/* y (+)= x W^T for one product; nonzero when its input blocks found no memory. */
static int product(const TsProduct *p, const float *x, int64_t m, int64_t k, float *y, int64_t ldy, int acc,
                   int amx, int nt) {
    if (p->fmt == TS_F32) {
        ts_linear(x, m, k, k, p->w, p->n, p->bias, y + p->col, ldy, acc, nt);
        return 0;
    }
    return ts_qlinear(x, m, k, k, p->w, (int)p->fmt, p->n, p->bias, y + p->col, ldy, acc, amx, nt);
}

/* Runs layers [0, nl) for t decode rows; returns nonzero (and leaves x
 * partly updated) only when a buffer found no memory. */
int ts_decode_stack(const TsStack *s, const TsLayer *layers, int64_t nl, float *x, int64_t t, const int64_t *pos,
                    const int64_t *slot_block, const int64_t *slot_offset, const int64_t *tables,
                    const int64_t *table_start, const int64_t *ctx, const int64_t *rows, int nt) {
    const int64_t D = s->hidden, qw = s->hq * s->d, width = qw + 2 * s->hkv * s->d;
    const int amx = (int)s->amx_int8;
    float *h = malloc(sizeof(float) * t * (D + width + qw + s->inter));
    if (h == NULL) return 1;
    float *qkv = h + t * D, *a = qkv + t * width, *act = a + t * qw;
    int failed = 0;
    for (int64_t i = 0; i < nl && !failed; i++) {
        const TsLayer *L = layers + i;
        ts_rms_norm(x, t, D, D, L->in_norm, s->eps, h, D, nt);
        for (int64_t p = 0; p < L->nqkv; p++) failed |= product(L->qkv + p, h, t, D, qkv, width, 0, amx, nt);
        if (L->q_norm != NULL) {
            ts_rms_norm_heads(qkv, t, width, s->hq, s->d, L->q_norm, s->eps, nt);
            ts_rms_norm_heads(qkv + qw, t, width, s->hkv, s->d, L->k_norm, s->eps, nt);
        }
        ts_rope_store(qkv, t, width, s->hq, s->hkv, s->d, L->cos, L->sin, pos, L->k_cache, L->v_cache, slot_block,
                      slot_offset, s->bs, (int)s->kv_fmt, nt);
        if (L->attn == TS_ATTN_AMX)
            ts_decode_attention_amx(qkv, width, t, s->hq, s->hkv, s->d, L->k_cache, L->v_cache, s->bs, tables,
                                    table_start, ctx, rows, s->scale, a, qw, (int)s->kv_fmt, NULL, nt);
        else if (L->attn == TS_ATTN_BF16)
            ts_decode_attention_bf16(qkv, width, t, s->hq, s->hkv, s->d, L->k_cache, L->v_cache, s->bs, tables,
                                     table_start, ctx, rows, s->scale, a, qw, L->window, NULL, nt);
        else
            ts_decode_attention_q(qkv, width, t, s->hq, s->hkv, s->d, L->k_cache, L->v_cache, s->bs, tables,
                                  table_start, ctx, rows, s->scale, a, qw, (int)s->kv_fmt, L->window, NULL, nt);
        failed |= product(&L->o, a, t, qw, x, D, 1, amx, nt);
        ts_rms_norm(x, t, D, D, L->post_norm, s->eps, h, D, nt);
        const TsProduct *gu = &L->gate_up;
        if (gu->fmt == TS_F32)
            ts_gate_up_silu(h, t, D, D, gu->w, s->inter, act, s->inter, NULL, 0, nt);
        else
            failed |= ts_qgate_up_silu(h, t, D, D, gu->w, gu->w2, (int)gu->fmt, s->inter, act, s->inter, NULL, 0,
                                       amx, nt);
        failed |= product(&L->down, act, t, s->inter, x, D, 1, amx, nt);
    }
    free(h);
    return failed;
}
