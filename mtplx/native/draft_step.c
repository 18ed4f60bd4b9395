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
   per row; a SwiGLU MLP.

   A batch's rows step together (mtplx_draft_chains): a step's products run for all its rows at
   once, so each half-precision weight is loaded and converted once for up to four rows. Four rows'
   depth-2 chains on one core, in one call against four (bench/native_draft.py): tiny-dense 0.58
   against 0.90 ms, tiny-hybrid 0.62 against 0.91. */
#include <immintrin.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "helper_thread.h"
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
} Head;

/* One chain of a batch: its pending pairs (hidden[i], tokens[i]) at offset .. offset + pairs - 1,
   the head's cache of its sequence (keys, values: (kv_heads, cap, head_dim), `offset` positions
   written), a rule's vector (NULL, or one value per lm_head row added to its logit: a ban is -inf
   there, a logit bias its shift), its scratch and its drafts. `done`: how many it drafted. */
typedef struct {
    const float *hidden; const int32_t *tokens; int pairs;
    const float *keys, *values; int cap, offset;
    const float *bias;
    float *scratch; long scratch_floats; int32_t *out;
    int done;
} Row;

enum { MAX_ROWS = 64, SLOTS = 64 };

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

/* Inside a round the head's weights come back from memory (the verify evicted them), and a
   block's rows are short (half a kilobyte at these widths), too short for the hardware prefetcher:
   each block waited on memory, then computed. So a block fetches the next block's rows (`ahead`:
   WR rows past it exist) one line a row every 32 halves. No value changes. */
int mtplx_draft_prefetch = 1;  /* 0: no prefetch, for side-by-side measurement */

/* WR rows of W from row r against NB inputs, WR * NB accumulators (constants where it is inlined,
   so they stay in registers). */
static inline __attribute__((always_inline)) void rows_block(const uint16_t *w, const float *const *xs, float *const *ys,
                                                             int r, int n, const int WR, const int NB, const int ahead) {
    __m256 acc[4][4], h[4];
    for (int j = 0; j < WR; j++)
        for (int b = 0; b < NB; b++) acc[j][b] = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        if (ahead && (i & 31) == 0)  /* one cache line (32 halves) of each of the next block's rows */
            for (int j = 0; j < WR; j++) _mm_prefetch((const char *)(w + (size_t)(r + WR + j) * n + i), _MM_HINT_T0);
        for (int j = 0; j < WR; j++) h[j] = half8(w + (size_t)(r + j) * n + i);
        for (int b = 0; b < NB; b++) {
            const __m256 v = _mm256_loadu_ps(xs[b] + i);
            for (int j = 0; j < WR; j++) acc[j][b] = _mm256_fmadd_ps(h[j], v, acc[j][b]);
        }
    }
    for (int j = 0; j < WR; j++)
        for (int b = 0; b < NB; b++) ys[b][r + j] = hsum(acc[j][b]);
}

/* ys[b] = W xs[b] for `nx` inputs, W (rows, n) in half precision (n a multiple of 8): these
   products are bound by loading and converting W, and a draft needs no more than half precision's
   weights. One input takes four rows of W per pass (more loads in flight); a batch's rows stepping
   together share each converted eight halves of W among up to four inputs. Every (row of W, input)
   pair sums in one order (one eight-lane accumulator over n, then hsum), so an input's result has
   the same bits alone or beside others. */
static void gemv_rows(const uint16_t *w, const float *const *xs, int nx, int rows, int n, float *const *ys) {
    for (int b0 = 0; b0 < nx; b0 += 4) {
        const float *const *x = xs + b0;
        float *const *y = ys + b0;
        int r = 0;
        /* the first group of inputs fetches ahead; later groups find the rows in cache, or not at all
           (a batch of more than four inputs re-reads W per group) */
        const int pf = mtplx_draft_prefetch && b0 == 0;
        switch (nx - b0 < 4 ? nx - b0 : 4) {
        case 1:
            for (; r + 4 <= rows; r += 4) rows_block(w, x, y, r, n, 4, 1, pf && r + 8 <= rows);
            for (; r < rows; r++) rows_block(w, x, y, r, n, 1, 1, 0);
            break;
        case 2:
            for (; r + 4 <= rows; r += 4) rows_block(w, x, y, r, n, 4, 2, pf && r + 8 <= rows);
            for (; r < rows; r++) rows_block(w, x, y, r, n, 1, 2, 0);
            break;
        case 3:
            for (; r + 2 <= rows; r += 2) rows_block(w, x, y, r, n, 2, 3, pf && r + 4 <= rows);
            for (; r < rows; r++) rows_block(w, x, y, r, n, 1, 3, 0);
            break;
        default:
            for (; r + 2 <= rows; r += 2) rows_block(w, x, y, r, n, 2, 4, pf && r + 4 <= rows);
            for (; r < rows; r++) rows_block(w, x, y, r, n, 1, 4, 0);
        }
    }
}

/* Two cores on one chain call: each product's rows of W split between this thread and a helper.

   Inside a decode round the chain is bound by streaming the head's matrices and the LM head back
   from memory (the verify before it evicts them), and one core streams at a fraction of what two
   do. Rows of a product in chunks, claimed from one atomic ticket by both threads, each chunk
   all of the call's inputs: every weight is read once per product, by one of the two cores. A
   (row of W, input) pair sums as it does in gemv_rows whoever takes its chunk, so the drafts keep
   their bits. The caller never waits for a chunk nobody claimed (a helper that is late to wake
   only means the caller computes more). The helper polls while a call runs and sleeps on a futex
   between calls, so it never holds a core while MLX computes a verify. */
long mtplx_draft_split_macs = 32768; /* rows * n * inputs from which a product is shared */
static struct { const uint16_t *w; const float *const *xs; float *const *ys; int nx, rows, n, chunk; } job;
static _Atomic uint64_t ticket;  /* generation << 32 | chunks << 16 | next chunk */
static atomic_int finished;      /* chunks finished of the current generation */
static atomic_int calling;       /* a chain call runs: the helper polls (else it sleeps) */
static atomic_int wake;          /* the helper's futex word */
static atomic_int helper = 0;    /* 0 not started, 1 running, -1 could not start */
static atomic_flag owner = ATOMIC_FLAG_INIT;  /* one call uses the helper at a time; others run alone */

static int claim(uint64_t generation) {
    uint64_t t = atomic_load(&ticket);
    while ((t >> 32) == generation && (t & 0xffff) < ((t >> 16) & 0xffff))
        if (atomic_compare_exchange_weak(&ticket, &t, t + 1))
            return (int)(t & 0xffff);
    return -1;
}

static void run_chunk(int c) {
    int r0 = c * job.chunk, r1 = r0 + job.chunk < job.rows ? r0 + job.chunk : job.rows;
    float *ys[MAX_ROWS];
    for (int b = 0; b < job.nx; b++) ys[b] = job.ys[b] + r0;
    gemv_rows(job.w + (size_t)r0 * job.n, job.xs, job.nx, r1 - r0, job.n, ys);
}

static void *helper_main(void *unused) {
    (void)unused;
    uint64_t seen = atomic_load(&ticket) >> 32;
    for (;;) {
        int word = atomic_load(&wake);
        uint64_t t = atomic_load(&ticket);
        if ((t >> 32) != seen) {
            seen = t >> 32;
            int c;
            while ((c = claim(seen)) >= 0) {
                run_chunk(c);
                atomic_fetch_add(&finished, 1);
            }
        } else if (atomic_load(&calling)) {
            _mm_pause();
        } else {
            syscall(SYS_futex, &wake, FUTEX_WAIT_PRIVATE, word, NULL, NULL, 0);
        }
    }
    return NULL;
}

static void forget_helper(void) { atomic_store(&helper, 0); atomic_flag_clear(&owner); }

static int start_helper(void) { return start_helper_thread(&helper, helper_main, forget_helper); }

static _Thread_local int team = 0;  /* this thread's call holds the helper */

static void team_begin(int share) {
    team = share && !atomic_flag_test_and_set(&owner);
    if (team && !start_helper()) {
        atomic_flag_clear(&owner);
        team = 0;
    }
    if (team) {  /* woken at the call, not before: a helper polling while Python sets the rows up
                    measured slower (it holds a core the engine thread and MLX's stream want) */
        atomic_store(&calling, 1);
        atomic_fetch_add(&wake, 1);
        syscall(SYS_futex, &wake, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    }
}

static void team_end(void) {
    if (!team)
        return;
    atomic_store(&calling, 0);
    team = 0;
    atomic_flag_clear(&owner);
}

/* gemv_rows, shared with the helper when this call holds it and the product is big enough. */
static void gemv_team(const uint16_t *w, const float *const *xs, int nx, int rows, int n, float *const *ys) {
    if (!team || (long)rows * n * nx < mtplx_draft_split_macs || rows < 16) {
        gemv_rows(w, xs, nx, rows, n, ys);
        return;
    }
    int chunk = (rows + 7) / 8;             /* eight chunks: a late helper still takes its share */
    chunk = (chunk + 3) / 4 * 4;
    int count = (rows + chunk - 1) / chunk;
    job.w = w, job.xs = xs, job.ys = ys, job.nx = nx, job.rows = rows, job.n = n, job.chunk = chunk;
    atomic_store(&finished, 0);
    uint64_t generation = (atomic_load(&ticket) >> 32) + 1;
    atomic_store(&ticket, generation << 32 | (uint64_t)count << 16);
    int c;
    while ((c = claim(generation)) >= 0) {
        run_chunk(c);
        atomic_fetch_add(&finished, 1);
    }
    while (atomic_load(&finished) < count)
        _mm_pause();
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
   SLOTS chain slots of keys and values, the logits, the head's output, then one step's vectors and
   attention scores. */
long mtplx_draft_scratch(const Head *h, int positions) {
    long kv = (long)h->kv_heads * h->head_dim;
    long qw = (long)h->heads * h->head_dim * (h->gated ? 2 : 1);
    return 2 * kv * SLOTS + (long)h->vocab + 5L * h->hidden + qw + 2 * kv + (long)h->heads * h->head_dim
           + 2L * h->inter + (long)h->heads * (positions + 8) + 64;
}

/* One row's place in a head step: its head output m (overwritten), the pair's token and position,
   its chain slot, and whether the whole layer runs (else only the key and value). */
typedef struct {
    Row *row;
    float *m, *ck, *cv, *work;
    int token, pos, slot, full;
} Step;

/* A row's vectors inside its step's work area. */
typedef struct { float *cat, *x, *t, *q, *k, *v, *o, *g, *u, *scores; } Vectors;

static Vectors vectors(const Head *h, float *work) {
    Vectors w;
    w.cat = work, w.x = w.cat + 2 * h->hidden, w.t = w.x + h->hidden, w.q = w.t + h->hidden;
    w.k = w.q + (size_t)h->heads * h->head_dim * (h->gated ? 2 : 1);
    w.v = w.k + (size_t)h->kv_heads * h->head_dim, w.o = w.v + (size_t)h->kv_heads * h->head_dim;
    w.g = w.o + (size_t)h->heads * h->head_dim, w.u = w.g + h->inter, w.scores = w.u + h->inter;
    return w;
}

/* The attention of one row's query heads over its cache's `offset` positions and its chain slots
   0..slot, into o. */
static void attend(const Head *h, const Step *s, const Vectors *w) {
    const int D = h->head_dim, NH = h->heads, offset = s->row->offset, cap = s->row->cap;
    const int group = NH / h->kv_heads, n = offset + s->slot + 1, span = (n + 7) / 8 * 8, qstride = D * (h->gated ? 2 : 1);
    /* Per key head, its group of query heads together: each key and value is read once. */
    for (int kh = 0; kh < h->kv_heads; kh++) {
        const float *kc = s->row->keys + (size_t)kh * cap * D, *vc = s->row->values + (size_t)kh * cap * D;
        const float *qg = w->q + (size_t)kh * group * qstride;
        for (int j = 0; j < n; j++) {
            const float *kj = j < offset ? kc + (size_t)j * D : s->ck + ((size_t)kh * SLOTS + j - offset) * D;
            for (int g = 0; g < group; g++) w->scores[(size_t)g * span + j] = dot(qg + (size_t)g * qstride, kj, D) * h->scale;
        }
        float inv[64];
        for (int g = 0; g < group; g++) inv[g] = softmax_row(w->scores + (size_t)g * span, n, span);
        float *og = w->o + (size_t)kh * group * D;
        memset(og, 0, sizeof(float) * (size_t)group * D);
        for (int j = 0; j < n; j++) {
            const float *vj = j < offset ? vc + (size_t)j * D : s->cv + ((size_t)kh * SLOTS + j - offset) * D;
            for (int g = 0; g < group; g++) {
                const __m256 p = _mm256_set1_ps(w->scores[(size_t)g * span + j] * inv[g]);
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
}

/* One head step for n rows at once (each over its own pair and cache): the matrices' products
   run for all rows together (gemv_rows), the per-row parts (norms, RoPE, attention) row by row.
   Each step's key and value go to its row's chain slot; a full step also overwrites m with the
   head's output. The caller has checked every position against the RoPE table. */
static void head_steps(const Head *h, Step *st, int n) {
    const int H = h->hidden, D = h->head_dim, KV = h->kv_heads * D, NH = h->heads;
    Vectors w[MAX_ROWS];
    const float *in[MAX_ROWS];
    float *out[MAX_ROWS], *out2[MAX_ROWS];
    for (int b = 0; b < n; b++) {
        w[b] = vectors(h, st[b].work);
        rms_norm(h->embed + (size_t)st[b].token * H, h->norm_e, H, h->eps, w[b].cat);
        rms_norm(st[b].m, h->norm_h, H, h->eps, w[b].cat + H);
        in[b] = w[b].cat, out[b] = w[b].x;
    }
    gemv_team(h->fc, in, n, H, 2 * H, out);
    for (int b = 0; b < n; b++) {
        rms_norm(w[b].x, h->in_norm, H, h->eps, w[b].t);
        in[b] = w[b].t, out[b] = w[b].k, out2[b] = w[b].v;
    }
    gemv_team(h->wk, in, n, KV, H, out);
    gemv_team(h->wv, in, n, KV, H, out2);
    int full = 0;
    for (int b = 0; b < n; b++) {
        const float *row = h->rope + (size_t)st[b].pos * h->rot_dims;
        for (int kh = 0; kh < h->kv_heads; kh++) {
            float *kk = w[b].k + (size_t)kh * D;
            rms_norm(kk, h->k_norm, D, h->eps, kk);
            rotate(kk, row, h->rot_dims);
            memcpy(st[b].ck + ((size_t)kh * SLOTS + st[b].slot) * D, kk, sizeof(float) * D);  /* (kv_heads, SLOTS, D) */
            memcpy(st[b].cv + ((size_t)kh * SLOTS + st[b].slot) * D, w[b].v + (size_t)kh * D, sizeof(float) * D);
        }
        if (st[b].full) {  /* a pending pair before the last: only its key and value are read later */
            Step s = st[b];
            st[b] = st[full], st[full] = s;
            Vectors v = w[b];
            w[b] = w[full], w[full] = v;
            full++;
        }
    }
    if (!full) return;
    n = full;
    for (int b = 0; b < n; b++) in[b] = w[b].t, out[b] = w[b].q;
    gemv_team(h->wq, in, n, NH * D * (h->gated ? 2 : 1), H, out);
    for (int b = 0; b < n; b++) {
        const float *row = h->rope + (size_t)st[b].pos * h->rot_dims;
        for (int hd = 0; hd < NH; hd++) {  /* a gated query is [query, gate] per head */
            float *qh = w[b].q + (size_t)hd * D * (h->gated ? 2 : 1);
            rms_norm(qh, h->q_norm, D, h->eps, qh);
            rotate(qh, row, h->rot_dims);
        }
        attend(h, &st[b], &w[b]);
        in[b] = w[b].o, out[b] = w[b].t;
    }
    gemv_team(h->wo, in, n, H, NH * D, out);
    for (int b = 0; b < n; b++) {
        for (int i = 0; i < H; i++) w[b].x[i] += w[b].t[i];
        rms_norm(w[b].x, h->post_norm, H, h->eps, w[b].t);
        in[b] = w[b].t, out[b] = w[b].g, out2[b] = w[b].u;
    }
    gemv_team(h->w_gate, in, n, h->inter, H, out);
    gemv_team(h->w_up, in, n, h->inter, H, out2);
    for (int b = 0; b < n; b++) {
        for (int i = 0; i < h->inter; i++) w[b].g[i] = silu(w[b].g[i]) * w[b].u[i];
        in[b] = w[b].g, out[b] = w[b].t;
    }
    gemv_team(h->w_down, in, n, H, h->inter, out);
    for (int b = 0; b < n; b++) {
        for (int i = 0; i < H; i++) w[b].x[i] += w[b].t[i];
        rms_norm(w[b].x, h->final_norm, H, h->eps, st[b].m);
    }
}

/* The next draft of n rows: each output m's logits over the lm_head rows (the products together),
   its rule's vector added, argmax, as a token id. */
static void argmax_rows(const Head *h, Step *st, int n, int s) {
    const float *in[MAX_ROWS];
    float *logits[MAX_ROWS];
    for (int b = 0; b < n; b++) in[b] = st[b].m, logits[b] = st[b].m + h->hidden;  /* the logits follow m */
    gemv_team(h->lm_head, in, n, h->vocab, h->hidden, logits);
    for (int b = 0; b < n; b++) {
        const float *bias = st[b].row->bias;
        float *l = logits[b];
        if (bias)
            for (int i = 0; i < h->vocab; i++) l[i] += bias[i];
        int best = 0;
        for (int i = 1; i < h->vocab; i++)
            if (l[i] > l[best]) best = i;
        st[b].row->out[s] = h->lm_ids ? h->lm_ids[best] : best;
        st[b].row->done = s + 1;
    }
}

/* `steps` greedy drafts for each of n rows after its pending pairs: the head over the pairs (keys
   and values of all, the whole layer for the last), the first draft that output's argmax, each
   next one the argmax after a head step over (output, previous draft). The rows step together, so
   each product reads the head's matrices once for all of them; a row's drafts are the same as it
   would draft alone. `hidden` is not changed. A row whose positions pass the RoPE table stops
   early (its `done` says how far it got). `share`: each product's rows of W are split with the
   helper thread (unless another call holds it: then this one runs alone). Returns 0, or -1 for an
   unusable request (nothing run). */
int mtplx_draft_chains(const Head *h, Row *rows, int n, int steps, int share) {
    if (n < 1 || n > MAX_ROWS || steps < 1 || h->heads / h->kv_heads > 64 || (h->head_dim & 7) || (h->hidden & 7)
        || (h->inter & 7))
        return -1;
    for (int b = 0; b < n; b++) {
        Row *r = &rows[b];
        if (r->pairs < 1 || r->pairs + steps > SLOTS || r->offset < 0 || r->offset > r->cap
            || r->scratch_floats < mtplx_draft_scratch(h, r->offset + r->pairs + steps))
            return -1;
        r->done = 0;
    }
    team_begin(share);
    const long kvslots = (long)h->kv_heads * SLOTS * h->head_dim;
    Step all[MAX_ROWS], st[MAX_ROWS];
    int live[MAX_ROWS], max_pairs = 0;
    for (int b = 0; b < n; b++) {
        Row *r = &rows[b];
        float *ck = r->scratch, *cv = ck + kvslots, *m = cv + kvslots;  /* m, then its logits */
        all[b] = (Step){r, m, ck, cv, m + h->hidden + h->vocab, 0, 0, 0, 0};
        live[b] = 1;
        max_pairs = r->pairs > max_pairs ? r->pairs : max_pairs;
    }
    for (int i = 0; i < max_pairs; i++) {
        int k = 0;
        for (int b = 0; b < n; b++) {
            Row *r = &rows[b];
            if (!live[b] || i >= r->pairs) continue;
            if (r->offset + i >= h->rope_rows) { live[b] = 0; continue; }
            memcpy(all[b].m, r->hidden + (size_t)i * h->hidden, sizeof(float) * h->hidden);
            st[k] = all[b], st[k].token = r->tokens[i], st[k].pos = r->offset + i, st[k].slot = i;
            st[k++].full = i == r->pairs - 1;
        }
        if (k) head_steps(h, st, k);
    }
    for (int s = 0; s < steps; s++) {
        int k = 0;
        for (int b = 0; b < n; b++)
            if (live[b]) st[k++] = all[b];
        if (!k) break;
        argmax_rows(h, st, k, s);
        if (s + 1 == steps) break;
        k = 0;
        for (int b = 0; b < n; b++) {
            Row *r = &rows[b];
            if (!live[b]) continue;
            if (r->offset + r->pairs + s >= h->rope_rows) { live[b] = 0; continue; }
            st[k] = all[b], st[k].token = r->out[s], st[k].pos = r->offset + r->pairs + s, st[k].slot = r->pairs + s;
            st[k++].full = 1;
        }
        if (k) head_steps(h, st, k);
    }
    team_end();
    return 0;
}
