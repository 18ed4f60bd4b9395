/* Attention over many query positions on the CPU: scores, softmax and the value sum in one pass
 * per block of rows, without writing a score matrix to memory.
 *
 * Why: MLX's CPU attention is a chain of whole-array ops (scores, mask, max, exp, sum, divide,
 * values), each a pass over rows x keys floats on one thread, and its exp is scalar. At agent
 * context lengths a prefill chunk of tiny-dense spent ~3/4 of its time there.
 *
 * Layout: q (B, Hq, L, D), k and v (B, Hkv, S, D), each with its own strides in floats (the last
 * dimension contiguous: MLX hands over cache slices and transposed projections without copying);
 * out (B, Hq, L, D) contiguous. Query head h reads key group h / (Hq / Hkv). With `causal`, query
 * position i sees keys 0 .. S - L + i.
 *
 * Every output row is computed the same way whatever the other rows of the call: its scores in
 * one order over d, its max, exponents and sum in blocks of 8 keys up to its own last key, its
 * value sum over the keys in order (keys past its last one add an exact zero). A row's bits
 * therefore do not depend on the chunk it was prefilled in, the number of queries of the call or
 * the thread that ran it.
 */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "softmax.h"

#define ROWS 4  /* query rows per tile: they share each key and value load */
#define KEYS 16 /* keys per score block (two vectors) */

typedef struct {
    const float *q, *k, *v;
    float *out;
    long q_sb, q_sh, q_sl, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss;
    int B, Hq, Hkv, L, S, D, causal;
    float scale;
    float *kt; /* keys transposed per (b, g): D rows of Spad floats, zero past S */
    int Spad, tiles;
    int threads;
    const int *row_keys; /* few entry: batch row b's own key count (S the longest), else NULL */
} job_t;

typedef struct {
    job_t *job;
    int index;
} part_t;

/* dst[r * stride + c] = src row c, column r, for an 8 x 8 block (rows of src `step` floats apart). */
static inline void transpose8(const float *src, long step, float *dst, long stride) {
    __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + step), r2 = _mm256_loadu_ps(src + 2 * step),
           r3 = _mm256_loadu_ps(src + 3 * step), r4 = _mm256_loadu_ps(src + 4 * step),
           r5 = _mm256_loadu_ps(src + 5 * step), r6 = _mm256_loadu_ps(src + 6 * step),
           r7 = _mm256_loadu_ps(src + 7 * step);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
           t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
           t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
           u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
           u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
           u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst + stride, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst + 2 * stride, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst + 3 * stride, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst + 4 * stride, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst + 5 * stride, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst + 6 * stride, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst + 7 * stride, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* Transpose the keys of (b, g) pairs index, index + threads, ... into job->kt: whole 8 x 8 blocks
 * in registers, the last partial block of keys one value at a time (zeros past S). */
static void transpose_part(job_t *j, int index) {
    for (int bg = index; bg < j->B * j->Hkv; bg += j->threads) {
        int b = bg / j->Hkv, g = bg % j->Hkv;
        const float *k = j->k + b * j->k_sb + g * j->k_sh;
        float *kt = j->kt + (long)bg * j->D * j->Spad;
        int whole = j->S / 8 * 8;
        for (int s0 = 0; s0 < whole; s0 += 8)
            for (int d = 0; d < j->D; d += 8)
                transpose8(k + (long)s0 * j->k_ss + d, j->k_ss, kt + (long)d * j->Spad + s0, j->Spad);
        for (int s0 = whole; s0 < j->Spad; s0 += 8) {
            for (int d = 0; d < j->D; d++) {
                float *dst = kt + (long)d * j->Spad + s0;
                for (int u = 0; u < 8; u++)
                    dst[u] = s0 + u < j->S ? k[(long)(s0 + u) * j->k_ss + d] : 0.0f;
            }
        }
    }
}

/* One tile: up to ROWS query rows of key group g, rows r = position * rep + head-in-group. */
static void tile(job_t *j, int b, int g, int t, float *scores, float *qs) {
    int rep = j->Hq / j->Hkv, D = j->D, Spad = j->Spad;
    int first = t * ROWS, count = rep * j->L - first < ROWS ? rep * j->L - first : ROWS;
    int head[ROWS], pos[ROWS], last[ROWS], most = 0;
    for (int r = 0; r < ROWS; r++) {
        int row = first + (r < count ? r : 0);
        pos[r] = row / rep;
        head[r] = g * rep + row % rep;
        last[r] = j->causal ? j->S - j->L + pos[r] + 1 : j->S; /* keys this row sees */
        if (last[r] > most) most = last[r];
        const float *q = j->q + b * j->q_sb + head[r] * j->q_sh + (long)pos[r] * j->q_sl;
        for (int d = 0; d < D; d++) qs[r * D + d] = q[d] * j->scale;
    }
    const float *kt = j->kt + ((long)b * j->Hkv + g) * D * Spad;
    int blocks = (most + KEYS - 1) / KEYS;
    for (int kb = 0; kb < blocks; kb++) {
        __m256 a[ROWS][2];
        for (int r = 0; r < ROWS; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        const float *col = kt + kb * KEYS;
        for (int d = 0; d < D; d++) {
            __m256 k0 = _mm256_loadu_ps(col + (long)d * Spad), k1 = _mm256_loadu_ps(col + (long)d * Spad + 8);
            for (int r = 0; r < ROWS; r++) {
                __m256 qd = _mm256_broadcast_ss(qs + r * D + d);
                a[r][0] = _mm256_fmadd_ps(qd, k0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(qd, k1, a[r][1]);
            }
        }
        for (int r = 0; r < ROWS; r++) {
            _mm256_storeu_ps(scores + (long)r * Spad + kb * KEYS, a[r][0]);
            _mm256_storeu_ps(scores + (long)r * Spad + kb * KEYS + 8, a[r][1]);
        }
    }
    /* Per row: softmax weights in place, zero from its last key to the tile's block end. */
    float inv[ROWS];
    int span = blocks * KEYS;
    for (int r = 0; r < ROWS; r++) inv[r] = softmax_row(scores + (long)r * Spad, last[r], span);
    /* Values: 16 dims at a time for the tile's rows, every key in order. */
    for (int d0 = 0; d0 < D; d0 += 16) {
        int two = d0 + 16 <= D;
        __m256 a[ROWS][2];
        for (int r = 0; r < ROWS; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        const float *v = j->v + b * j->v_sb + g * j->v_sh + d0;
        for (int i = 0; i < most; i++, v += j->v_ss) {
            __m256 v0 = _mm256_loadu_ps(v), v1 = two ? _mm256_loadu_ps(v + 8) : _mm256_setzero_ps();
            for (int r = 0; r < ROWS; r++) {
                __m256 p = _mm256_broadcast_ss(scores + (long)r * Spad + i);
                a[r][0] = _mm256_fmadd_ps(p, v0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(p, v1, a[r][1]);
            }
        }
        for (int r = 0; r < count; r++) {
            float *o = j->out + (((long)b * j->Hq + head[r]) * j->L + pos[r]) * D + d0;
            __m256 w = _mm256_set1_ps(inv[r]);
            _mm256_storeu_ps(o, _mm256_mul_ps(a[r][0], w));
            if (two) _mm256_storeu_ps(o + 8, _mm256_mul_ps(a[r][1], w));
        }
    }
}

/* Scratch kept between calls (calls are serialised by `lock`): a fresh multi-megabyte malloc is
 * a new mapping the kernel zero-fills page by page on first touch, which cost more than the
 * attention itself for one query over 8k keys. */
#define KEEP_FLOATS (16L << 20) /* 64 MB */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static float *scratch[9];
static long scratch_floats[9];

static float *scratch_for(int slot, long floats) {
    if (scratch_floats[slot] < floats) {
        free(scratch[slot]);
        scratch[slot] = malloc(sizeof(float) * floats);
        scratch_floats[slot] = scratch[slot] ? floats : 0;
    }
    return scratch[slot];
}

static void *run_part(void *arg) {
    part_t *p = arg;
    job_t *j = p->job;
    float *scores = scratch_for(1 + p->index, (long)ROWS * j->Spad + ROWS * j->D);
    if (!scores) return (void *)1;
    float *qs = scores + (long)ROWS * j->Spad;
    int total = j->B * j->Hkv * j->tiles;
    for (int task = p->index; task < total; task += j->threads) {
        int bg = task / j->tiles;
        tile(j, bg / j->Hkv, bg % j->Hkv, task % j->tiles, scores, qs);
    }
    return NULL;
}

static void *run_transpose(void *arg) {
    part_t *p = arg;
    transpose_part(p->job, p->index);
    return NULL;
}

/* fn over parts 0 .. threads-1: part 0 here, the rest on helper threads (a part whose thread
 * could not start runs here too). Nonzero when any part failed. */
static int in_parallel(job_t *j, void *(*fn)(void *)) {
    pthread_t helper[8];
    part_t parts[8];
    int started[8] = {0}, failed = 0;
    for (int i = 0; i < j->threads; i++) parts[i] = (part_t){j, i};
    for (int i = 1; i < j->threads; i++) started[i] = pthread_create(&helper[i], NULL, fn, &parts[i]) == 0;
    failed |= fn(&parts[0]) != NULL;
    for (int i = 1; i < j->threads; i++) {
        void *r = NULL;
        if (started[i]) pthread_join(helper[i], &r);
        else r = fn(&parts[i]);
        failed |= r != NULL;
    }
    return failed;
}

/* 0: done. 1: scratch memory could not be had (out is then incomplete); 2: shapes it does not take. */
int mtplx_attention(const float *q, long q_sb, long q_sh, long q_sl, const float *k, long k_sb, long k_sh,
                    long k_ss, const float *v, long v_sb, long v_sh, long v_ss, float *out, int B, int Hq, int Hkv,
                    int L, int S, int D, float scale, int causal, int threads) {
    job_t j = {q, k, v, out, q_sb, q_sh, q_sl, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, B, Hq, Hkv, L, S, D, causal,
               scale, NULL, (S + KEYS - 1) / KEYS * KEYS, 0, threads < 1 ? 1 : (threads > 8 ? 8 : threads)};
    if (D % 8 || Hq % Hkv || S < 1 || L < 1 || (causal && L > S)) return 2;
    j.tiles = ((Hq / Hkv) * L + ROWS - 1) / ROWS;
    pthread_mutex_lock(&lock);
    j.kt = scratch_for(0, (long)B * Hkv * D * j.Spad);
    int failed = !j.kt;
    if (!failed) failed = in_parallel(&j, run_transpose);
    if (!failed) failed = in_parallel(&j, run_part);
    if (scratch_floats[0] > KEEP_FLOATS) { /* a long prompt's keys: not held for the rest of the process */
        free(scratch[0]);
        scratch[0] = NULL, scratch_floats[0] = 0;
    }
    pthread_mutex_unlock(&lock);
    return failed;
}

/* A few queries over many keys (a decode step, an MTP verify, a batch's rows): no transposed copy
 * of the keys, which for a handful of rows cost more than the attention. Per (batch row, key group)
 * each of its R = heads-per-group x L query rows takes every key's dot product in 8 lanes over d
 * (lane l sums dimensions l, l + 8, ... in order), eight keys' lanes folded by one fixed add tree;
 * softmax in blocks of 8 up to the row's own last key; values over the keys in order (keys past its
 * last one add an exact zero). So a row's bits do not depend on L, on the other rows of the call or
 * on the thread (a verify's row is the decode step's), though they are not `mtplx_attention`'s. */
#define FEW_ROWS 32
#define FEW_BLOCK 64 /* keys: 16 KB at D = 64 */
#ifndef FEW_SPLIT_MACS
#define FEW_SPLIT_MACS (1L << 21) /* ~2M multiply-adds of scores: below, a second thread costs more than it saves */
#endif

/* The 8 lane sums of a[0..7] as one vector: element u = the sum of a[u]'s lanes. */
static inline __m256 fold8(const __m256 *a) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* s0123 = [0 1 2 3 | 0 1 2 3] halves (low lanes, high lanes); likewise s4567 */
    __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    return _mm256_add_ps(lo, hi);
}

static void few_group(job_t *j, int b, int g, float *scores) {
    int rep = j->Hq / j->Hkv, D = j->D, R = rep * j->L, Spad = j->Spad;
    __m256 qv[256 / 8];
    int head[FEW_ROWS], pos[FEW_ROWS], last[FEW_ROWS], most = 0;
    int S = j->row_keys ? j->row_keys[b] : j->S; /* this row's keys: the sums as a call of its own */
    for (int r = 0; r < R; r++) {
        pos[r] = r / rep;
        head[r] = g * rep + r % rep;
        last[r] = j->causal ? S - j->L + pos[r] + 1 : S;
        if (last[r] > most) most = last[r];
    }
    const float *k = j->k + b * j->k_sb + g * j->k_sh;
    int span = (most + 7) / 8 * 8, chunks = D / 8;
    /* Keys in blocks of FEW_BLOCK, each block scored by every row while it sits in L1. */
    for (int b0 = 0; b0 < span; b0 += FEW_BLOCK)
    for (int r = 0; r < R; r++) {
        const float *q = j->q + b * j->q_sb + head[r] * j->q_sh + (long)pos[r] * j->q_sl;
        __m256 scale = _mm256_set1_ps(j->scale);
        for (int c = 0; c < chunks; c++) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(q + c * 8), scale);
        float *row = scores + (long)r * Spad;
        for (int s0 = b0; s0 < span && s0 < b0 + FEW_BLOCK; s0 += 8) {
            __m256 a[8];
            const float *key[8];
            for (int u = 0; u < 8; u++) {
                a[u] = _mm256_setzero_ps();
                /* past every row's keys: the last key again, a score the softmax overwrites */
                key[u] = k + (long)(s0 + u < most ? s0 + u : most - 1) * j->k_ss;
            }
            /* eight independent chains (one per key), each over d in order */
            for (int c = 0; c < chunks; c++)
                for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(key[u] + c * 8), a[u]);
            _mm256_storeu_ps(row + s0, fold8(a));
        }
    }
    float inv[FEW_ROWS];
    for (int r = 0; r < R; r++) inv[r] = softmax_row(scores + (long)r * Spad, last[r], span);
    /* Values in blocks of FEW_BLOCK keys, each block read from memory once and used by every row
     * (16 dims by up to 4 rows at a time); each row's sums run over the keys in order. */
    const float *vg = j->v + b * j->v_sb + g * j->v_sh;
    float acc[FEW_ROWS * 256];
    memset(acc, 0, sizeof(float) * R * D);
    for (int b0 = 0; b0 < most; b0 += FEW_BLOCK) {
        int b1 = b0 + FEW_BLOCK < most ? b0 + FEW_BLOCK : most;
        for (int d0 = 0; d0 < D; d0 += 16) {
            int two = d0 + 16 <= D;
            for (int r0 = 0; r0 < R; r0 += 4) {
                int n = R - r0 < 4 ? R - r0 : 4;
                __m256 a[4][2];
                for (int r = 0; r < n; r++) {
                    a[r][0] = _mm256_loadu_ps(acc + (r0 + r) * D + d0);
                    a[r][1] = two ? _mm256_loadu_ps(acc + (r0 + r) * D + d0 + 8) : _mm256_setzero_ps();
                }
                const float *v = vg + (long)b0 * j->v_ss + d0;
                for (int i = b0; i < b1; i++, v += j->v_ss) {
                    __m256 v0 = _mm256_loadu_ps(v), v1 = two ? _mm256_loadu_ps(v + 8) : _mm256_setzero_ps();
                    for (int r = 0; r < n; r++) {
                        __m256 p = _mm256_broadcast_ss(scores + (long)(r0 + r) * Spad + i);
                        a[r][0] = _mm256_fmadd_ps(p, v0, a[r][0]);
                        a[r][1] = _mm256_fmadd_ps(p, v1, a[r][1]);
                    }
                }
                for (int r = 0; r < n; r++) {
                    _mm256_storeu_ps(acc + (r0 + r) * D + d0, a[r][0]);
                    if (two) _mm256_storeu_ps(acc + (r0 + r) * D + d0 + 8, a[r][1]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float *o = j->out + (((long)b * j->Hq + head[r]) * j->L + pos[r]) * D;
        __m256 w = _mm256_set1_ps(inv[r]);
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d), w));
    }
}

static void *run_few(void *arg) {
    part_t *p = arg;
    job_t *j = p->job;
    float *scores = scratch_for(1 + p->index, (long)FEW_ROWS * j->Spad);
    if (!scores) return (void *)1;
    for (int bg = p->index; bg < j->B * j->Hkv; bg += j->threads) few_group(j, bg / j->Hkv, bg % j->Hkv, scores);
    return NULL;
}

/* As mtplx_attention (2: shapes it does not take, also more than FEW_ROWS query rows per key group
 * or D > 256); `threads` at most, and one where the call is too small to pay for starting another. */
static int attention_few(const float *q, long q_sb, long q_sh, long q_sl, const float *k, long k_sb, long k_sh,
                         long k_ss, const float *v, long v_sb, long v_sh, long v_ss, float *out, int B, int Hq,
                         int Hkv, int L, int S, int D, float scale, int causal, int threads, const int *row_keys) {
    job_t j = {q, k, v, out, q_sb, q_sh, q_sl, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, B, Hq, Hkv, L, S, D, causal,
               scale, NULL, (S + 7) / 8 * 8, 0, threads < 1 ? 1 : (threads > 8 ? 8 : threads), row_keys};
    if (D % 8 || D > 256 || Hq % Hkv || (Hq / Hkv) * L > FEW_ROWS || S < 1 || L < 1 || (causal && L > S)) return 2;
    for (int b = 0; row_keys && b < B; b++)
        if (row_keys[b] < 1 || row_keys[b] > S || (causal && L > row_keys[b])) return 2;
    if (j.threads > B * Hkv) j.threads = B * Hkv;
    if ((long)Hq * L * S * D < FEW_SPLIT_MACS) j.threads = 1;
    pthread_mutex_lock(&lock);
    int failed = in_parallel(&j, run_few);
    pthread_mutex_unlock(&lock);
    return failed;
}

int mtplx_attention_few(const float *q, long q_sb, long q_sh, long q_sl, const float *k, long k_sb, long k_sh,
                        long k_ss, const float *v, long v_sb, long v_sh, long v_ss, float *out, int B, int Hq,
                        int Hkv, int L, int S, int D, float scale, int causal, int threads) {
    return attention_few(q, q_sb, q_sh, q_sl, k, k_sb, k_sh, k_ss, v, v_sb, v_sh, v_ss, out, B, Hq, Hkv, L, S, D, scale,
                         causal, threads, NULL);
}

/* The few-row entry over a ragged batch: batch row b attends over its first row_keys[b] keys (its
 * queries the last L of them), each (row, key group) summed exactly as a call of that row alone with
 * S = row_keys[b]. One call, so one sync, for a batch whose rows all take this entry. */
int mtplx_attention_rows(const float *q, long q_sb, long q_sh, long q_sl, const float *k, long k_sb, long k_sh,
                         long k_ss, const float *v, long v_sb, long v_sh, long v_ss, float *out, int B, int Hq,
                         int Hkv, int L, int S, int D, float scale, int causal, int threads, const int *row_keys) {
    return attention_few(q, q_sb, q_sh, q_sl, k, k_sb, k_sh, k_ss, v, v_sb, v_sh, v_ss, out, B, Hq, Hkv, L, S, D, scale,
                         causal, threads, row_keys);
}
