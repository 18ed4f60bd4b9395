/* The MTP head's draft chain in one call, for the CPU fp32 path (mtplx/engine/native_draft.py).

   On the CPU backend a draft step of a small head (one decoder layer, the LM head, an argmax) is
   some forty MLX ops, and each costs microseconds of dispatch: that, not arithmetic, is most of the
   step. Drafts decide only speed (the trunk verifies every one), so the whole chain runs here as
   plain loops over the head's weights, right after the verify that produced its pending pairs.
   The head's cache is read in place (its keys and values up to `offset`, written by MLX, which
   also appends the pending pairs' own, lazily, with the next verify); the keys and values this
   call computes go to a scratch buffer and are never kept.

   The matrices come as half-precision copies (half the bytes; these products are bound by
   reading the weights). Layout, as mlx-lm's Qwen3 and Qwen3-Next attention layers hold it: weights (out, in) row-major;
   queries optionally with a per-head gate (Qwen3-Next: each head's query then its gate); per-head
   query and key RMSNorm; RoPE on the first `rot_dims` of each head, non-interleaved halves, from
   a cos/sin table (rows of [cos half, sin half] per position); keys (kv_heads, cap, head_dim)
   for batch row 0; a SwiGLU MLP. */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "softmax.h"

typedef struct {
    int hidden, heads, kv_heads, head_dim, rot_dims, inter, vocab, gated;
    float eps, scale;
    const float *embed;        /* (vocab_embed, hidden): the token embedding, fp32 */
    const uint16_t *lm_head;   /* (vocab, hidden): the rows a draft is chosen from */
    const int32_t *lm_ids;     /* NULL, or the token id of each lm_head row (a draft vocabulary) */
    /* Matrices in half precision (uint16_t), vectors (norm weights) in fp32. */
    const float *norm_e, *norm_h; const uint16_t *fc;  /* fc: (hidden, 2 hidden), input [e, h] */
    const float *in_norm; const uint16_t *wq, *wk, *wv; const float *q_norm, *k_norm; const uint16_t *wo;
    const float *post_norm; const uint16_t *w_gate, *w_up, *w_down; const float *final_norm;
    const float *rope;         /* (positions, 2, rot_dims / 2) */
    int rope_rows;
    const float *bias;         /* NULL, or one value per lm_head row added to its logit (a rule's
                                  ban is -inf there, a logit bias its shift) */
} Head;

static inline float dot(const float *a, const float *b, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline __m256 half8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* y = W x, W (rows, n) in half precision (n a multiple of 8): the products are bound by reading
   W, and a draft needs no more than half precision's weights. Four rows per pass share each load
   of x. */
static void gemv(const uint16_t *w, const float *x, int rows, int n, float *y) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
        const uint16_t *w0 = w + (size_t)r * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
        __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps(), c = _mm256_setzero_ps(), d = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) {
            __m256 xv = _mm256_loadu_ps(x + i);
            a = _mm256_fmadd_ps(half8(w0 + i), xv, a);
            b = _mm256_fmadd_ps(half8(w1 + i), xv, b);
            c = _mm256_fmadd_ps(half8(w2 + i), xv, c);
            d = _mm256_fmadd_ps(half8(w3 + i), xv, d);
        }
        y[r] = hsum(a), y[r + 1] = hsum(b), y[r + 2] = hsum(c), y[r + 3] = hsum(d);
    }
    for (; r < rows; r++) {
        __m256 a = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) a = _mm256_fmadd_ps(half8(w + (size_t)r * n + i), _mm256_loadu_ps(x + i), a);
        y[r] = hsum(a);
    }
}

static void rms_norm(const float *x, const float *w, int n, float eps, float *out) {
    float ss = dot(x, x, n);
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

static void rotate(float *x, const float *row, int rot_dims) {
    int half = rot_dims / 2;
    const float *cs = row, *sn = row + half;
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cs[i] - b * sn[i];
        x[i + half] = a * sn[i] + b * cs[i];
    }
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* Scratch a chain needs over a cache of `positions` entries, in floats (the caller allocates it):
   64 chain slots of keys and values, the logits, then one step's vectors and attention scores. */
long mtplx_draft_scratch(const Head *h, int positions) {
    long kv = (long)h->kv_heads * h->head_dim;
    long qw = (long)h->heads * h->head_dim * (h->gated ? 2 : 1);
    return 2 * kv * 64 + (long)h->vocab + 5L * h->hidden + qw + 2 * kv + (long)h->heads * h->head_dim
           + 2L * h->inter + (long)h->heads * (positions + 8) + 64;
}

static int argmax_row(const Head *h, const float *m, float *logits) {
    gemv(h->lm_head, m, h->vocab, h->hidden, logits);
    if (h->bias)
        for (int i = 0; i < h->vocab; i++) logits[i] += h->bias[i];
    int best = 0;
    for (int i = 1; i < h->vocab; i++)
        if (logits[i] > logits[best]) best = i;
    return h->lm_ids ? h->lm_ids[best] : best;
}

/* One head step at position `pos` over the pair (m, token): m is overwritten with the head's
   output. The step's key and value go to chain slot `slot`; attention sees the cache's `offset`
   positions and the chain's slots 0..slot. Returns 0, or -1 when the RoPE table is too short. */
static int head_step(const Head *h, float *m, int token, int pos, const float *keys, const float *values, int cap,
                     int offset, float *ck, float *cv, int slot, float *work, int full) {
    const int H = h->hidden, D = h->head_dim, KV = h->kv_heads * D, NH = h->heads;
    if (pos >= h->rope_rows) return -1;
    float *cat = work, *x = cat + 2 * H, *t = x + H, *q = t + H, *k = q + (size_t)NH * D * (h->gated ? 2 : 1);
    float *v = k + KV, *o = v + KV, *g = o + (size_t)NH * D, *u = g + h->inter, *scores = u + h->inter;
    rms_norm(h->embed + (size_t)token * H, h->norm_e, H, h->eps, cat);
    rms_norm(m, h->norm_h, H, h->eps, cat + H);
    gemv(h->fc, cat, H, 2 * H, x);
    rms_norm(x, h->in_norm, H, h->eps, t);
    gemv(h->wk, t, KV, H, k);
    gemv(h->wv, t, KV, H, v);
    const float *row = h->rope + (size_t)pos * h->rot_dims;
    for (int kh = 0; kh < h->kv_heads; kh++) {
        float *kk = k + (size_t)kh * D;
        rms_norm(kk, h->k_norm, D, h->eps, kk);
        rotate(kk, row, h->rot_dims);
        memcpy(ck + ((size_t)kh * 64 + slot) * D, kk, sizeof(float) * D);  /* chain slots: (kv_heads, 64, D) */
        memcpy(cv + ((size_t)kh * 64 + slot) * D, v + (size_t)kh * D, sizeof(float) * D);
    }
    if (!full) return 0;  /* a pending pair before the last: only its key and value are read later */
    gemv(h->wq, t, NH * D * (h->gated ? 2 : 1), H, q);
    for (int hd = 0; hd < NH; hd++) {  /* a gated query is [query, gate] per head */
        float *qh = q + (size_t)hd * D * (h->gated ? 2 : 1);
        rms_norm(qh, h->q_norm, D, h->eps, qh);
        rotate(qh, row, h->rot_dims);
    }
    /* Per key head, its group of query heads together: each key and value is read once. */
    const int group = NH / h->kv_heads, n = offset + slot + 1, span = (n + 7) / 8 * 8, qstride = D * (h->gated ? 2 : 1);
    for (int kh = 0; kh < h->kv_heads; kh++) {
        const float *kc = keys + (size_t)kh * cap * D, *vc = values + (size_t)kh * cap * D;
        const float *qg = q + (size_t)kh * group * qstride;
        for (int j = 0; j < n; j++) {
            const float *kj = j < offset ? kc + (size_t)j * D : ck + ((size_t)kh * 64 + j - offset) * D;
            for (int g = 0; g < group; g++) scores[(size_t)g * span + j] = dot(qg + (size_t)g * qstride, kj, D) * h->scale;
        }
        float inv[64];
        for (int g = 0; g < group; g++) inv[g] = softmax_row(scores + (size_t)g * span, n, span);
        float *og = o + (size_t)kh * group * D;
        memset(og, 0, sizeof(float) * (size_t)group * D);
        for (int j = 0; j < n; j++) {
            const float *vj = j < offset ? vc + (size_t)j * D : cv + ((size_t)kh * 64 + j - offset) * D;
            for (int g = 0; g < group; g++) {
                const __m256 p = _mm256_set1_ps(scores[(size_t)g * span + j] * inv[g]);
                float *oh = og + (size_t)g * D;
                for (int d = 0; d < D; d += 8)
                    _mm256_storeu_ps(oh + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + d), _mm256_loadu_ps(oh + d)));
            }
        }
        if (h->gated)
            for (int g = 0; g < group; g++) {
                const float *gate = qg + (size_t)g * qstride + D;
                float *oh = og + (size_t)g * D;
                for (int d = 0; d < D; d++) oh[d] *= 1.0f / (1.0f + expf(-gate[d]));
            }
    }
    gemv(h->wo, o, H, NH * D, t);
    for (int i = 0; i < H; i++) x[i] += t[i];
    rms_norm(x, h->post_norm, H, h->eps, t);
    gemv(h->w_gate, t, h->inter, H, g);
    gemv(h->w_up, t, h->inter, H, u);
    for (int i = 0; i < h->inter; i++) g[i] = silu(g[i]) * u[i];
    gemv(h->w_down, g, H, h->inter, t);
    for (int i = 0; i < H; i++) x[i] += t[i];
    rms_norm(x, h->final_norm, H, h->eps, m);
    return 0;
}

/* `steps` greedy drafts after the pending pairs (hidden[i], token[i]), i < pairs, which sit at
   positions offset .. offset + pairs - 1 (the head's cache holds the `offset` before them): the
   head over the pairs (keys and values of all, the whole layer for the last), the first draft
   that output's argmax, each next one the argmax after a head step over (output, previous draft).
   `hidden` (pairs, hidden floats) is not changed. Writes the token ids to `out`; returns how many
   were drafted (fewer only when the RoPE table ends first), or -1 for an unusable request. */
int mtplx_draft_chain(const Head *h, const float *hidden, const int32_t *tokens, int pairs, const float *keys,
                      const float *values, int cap, int offset, int steps, float *scratch, long scratch_floats,
                      int32_t *out) {
    if (steps < 1 || pairs < 1 || pairs + steps > 64 || h->heads / h->kv_heads > 64 || (h->head_dim & 7)
        || (h->hidden & 7) || (h->inter & 7) || offset < 0 || offset > cap
        || scratch_floats < mtplx_draft_scratch(h, offset + pairs + steps))
        return -1;
    const long kvslots = (long)h->kv_heads * 64 * h->head_dim;
    float *ck = scratch, *cv = ck + kvslots, *logits = cv + kvslots, *m = logits + h->vocab, *work = m + h->hidden;
    for (int i = 0; i < pairs; i++) {
        memcpy(m, hidden + (size_t)i * h->hidden, sizeof(float) * h->hidden);
        if (head_step(h, m, tokens[i], offset + i, keys, values, cap, offset, ck, cv, i, work, i == pairs - 1) != 0)
            return 0;
    }
    int done = 0;
    for (int s = 0; s < steps; s++) {
        out[s] = argmax_row(h, m, logits);
        done = s + 1;
        if (s + 1 < steps
            && head_step(h, m, out[s], offset + pairs + s, keys, values, cap, offset, ck, cv, pairs + s, work, 1) != 0)
            break;
    }
    return done;
}
