/* The small-row sgemm that mtplx puts in front of MKL on the CPU fast path (mtplx/small_gemm.py).

   MLX computes every Linear as cblas_sgemm(RowMajor, NoTrans, Trans, M, N, K, ...): x (M x K) times
   W (N x K) transposed. A decode step has M = 1, a verify k + 1, a batched round rows x tokens. On
   this kind of CPU MKL's sgemm for 2-16 rows runs at a fraction of its large-M rate (4 rows took
   1.6-2.5x one row inside decoding), while the product is one pass over W. This kernel reads each
   group of three rows of W once and multiplies it with up to four rows of x held in registers; a
   single row streams eight rows of W at a time.

   Each output is one dot product summed in a fixed order: eight lanes of fused multiply-adds over
   K, a fixed horizontal sum, then the K % 8 tail. The order never depends on M or N, so a row's
   result is the same alone, in a verify or in a batch. Every other call (more rows, other
   layouts, K < 8) goes to the BLAS set with mtplx_small_gemm_next (MKL's cblas_sgemm). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <immintrin.h>
#include "helper_thread.h"
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum { RowMajor = 101, NoTrans = 111, Trans = 112 };
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *, int);
static sgemm_fn next_sgemm;  /* set by mtplx/small_gemm.py before MLX makes its first call */
static int enabled = 1;     /* a switch for side-by-side measurement (bench/small_gemm.py) */
int mtplx_small_rows = 32;  /* the most rows this kernel takes (beyond, MKL's packed kernels win) */

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    return _mm_cvtss_f32(_mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 0x55)));
}

/* Four horizontal sums at once, each in exactly hsum's order: (l_i + l_i+4), then
   (x0 + x2) + (x1 + x3). */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    __m256 r = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
    __m256 h = _mm256_hadd_ps(r, r);
    return _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* The next block of weight rows (`next`, NB rows of ldb floats from it) is fetched into L1 one cache
   line per row per step over K while this block computes. A block's rows are short (1-2.5 KB at
   these widths), too short for the hardware prefetcher to pick up, and a decode step's weights
   (megabytes) no longer sit in L2 when the next product runs: without it, each block waited on
   memory and then computed, one after the other. Prefetching moves no value: the sums are the same. */
int mtplx_small_prefetch = 1;  /* blocks ahead (0: none, for side-by-side runs: bench/small_gemm.py) */
#define PREFETCH_NEXT(NB)                                                                            \
    _Pragma("GCC unroll 16") for (int j = 0; j < NB; j++)                                            \
        _mm_prefetch((const char *)(next + (size_t)j * ldb + k), _MM_HINT_T0)

/* MB rows of a against NB rows of b: MB*NB accumulators, each one dot product over K in steps
   of 8, the same fixed order for every tile shape. */
#define TILE(MB, NB)                                                                                 \
static void tile##MB##x##NB(const float *a, int lda, const float *b, int ldb, int nb, int K, float *out, \
                            const float *next) {                                                      \
    __m256 c[MB][NB];                                                                                \
    const float *w[NB];                                                                              \
    _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++) w[j] = b + (size_t)(j < nb ? j : 0) * ldb;  \
    _Pragma("GCC unroll 8") for (int i = 0; i < MB; i++)                                             \
        _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++) c[i][j] = _mm256_setzero_ps();          \
    int k = 0;                                                                                       \
    for (; k + 8 <= K; k += 8) {                                                                     \
        if (next != NULL && (k & 15) == 0) PREFETCH_NEXT(NB);                                        \
        if (MB <= NB) { /* registers: MB inputs held, one weight vector at a time */                \
            __m256 x[MB];                                                                            \
            _Pragma("GCC unroll 8") for (int i = 0; i < MB; i++) x[i] = _mm256_loadu_ps(a + (size_t)i * lda + k); \
            _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++) {                                   \
                __m256 wj = _mm256_loadu_ps(w[j] + k);                                               \
                _Pragma("GCC unroll 8") for (int i = 0; i < MB; i++) c[i][j] = _mm256_fmadd_ps(x[i], wj, c[i][j]); \
            }                                                                                        \
        } else { /* NB weight vectors held, one input row at a time */                               \
            __m256 wv[NB];                                                                           \
            _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++) wv[j] = _mm256_loadu_ps(w[j] + k);  \
            _Pragma("GCC unroll 8") for (int i = 0; i < MB; i++) {                                   \
                __m256 xi = _mm256_loadu_ps(a + (size_t)i * lda + k);                                \
                _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++) c[i][j] = _mm256_fmadd_ps(xi, wv[j], c[i][j]); \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    float sums[MB * NB + 4];                                                                         \
    int q = 0;                                                                                       \
    _Pragma("GCC unroll 8") for (; q + 4 <= MB * NB; q += 4)                                         \
        _mm_storeu_ps(sums + q, hsum4(c[q / NB][q % NB], c[(q + 1) / NB][(q + 1) % NB],              \
                                      c[(q + 2) / NB][(q + 2) % NB], c[(q + 3) / NB][(q + 3) % NB])); \
    for (; q < MB * NB; q++) sums[q] = hsum(c[q / NB][q % NB]);                                      \
    _Pragma("GCC unroll 8") for (int i = 0; i < MB; i++)                                             \
        _Pragma("GCC unroll 8") for (int j = 0; j < NB; j++) {                                       \
            float s = sums[i * NB + j];                                                              \
            for (int kk = k; kk < K; kk++) s += a[(size_t)i * lda + kk] * w[j][kk];                  \
            out[i * NB + j] = s;                                                                     \
        }                                                                                            \
}
typedef void (*tile_fn)(const float *, int, const float *, int, int, int, float *, const float *);

static void store(float *C, int ldc, const float *out, int mb, int nb, int NB, float alpha, float beta) {
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) {
            float *c = C + (size_t)i * ldc + j;
            *c = beta == 0.0f ? alpha * out[i * NB + j] : alpha * out[i * NB + j] + beta * *c;
        }
}

#if defined(__AVX512F__)
/* Where the CPU has AVX-512 (built with it by mtplx/native_build.py), every dot product runs on
   sixteen lanes instead of eight: on a core with full-width 512-bit FMA units (AMD Zen 5, Intel's
   server cores) that is twice the multiply-adds per cycle, and a verify's or a batch's rows are
   compute-bound here (the AVX2 tiles ran at that ISA's peak from 4 rows on). The order is as fixed
   as the AVX2 one's: sixteen lanes of FMAs over K, the last K % 16 as one masked step (zeros in
   the lanes past K), then the same tree for every output (lane l + l+8, then + l+4, + l+2, + l+1),
   four outputs at a time and a lone one padded with zero vectors into the same four-wide tree. */
static inline __m128 hsum4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    /* ab = [a(l)+a(l+8), l < 8 | b(l)+b(l+8)]: the 128-bit quarters 0, 2 hold lanes 0-3 of a and b */
    __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    /* r's quarters: a, b, c, d, each four partials (l + l+8) + (l+4 + l+12) */
    r = _mm512_add_ps(r, _mm512_shuffle_ps(r, r, 0x4E));  /* lanes l + l+2 within each quarter */
    r = _mm512_add_ps(r, _mm512_shuffle_ps(r, r, 0xB1));  /* + the neighbour: lane 0 of a quarter is its sum */
    __m512i pick = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(pick, r));
}

/* One step of sixteen lanes over K for an MB x NB tile; LOAD(MASK p) reads sixteen floats. */
#define STEP512(MB, NB, LOAD, ...)                                                                   \
    do {                                                                                             \
        if (MB <= NB) {                                                                              \
            __m512 x[MB];                                                                            \
            _Pragma("GCC unroll 16") for (int i = 0; i < MB; i++) x[i] = LOAD(__VA_ARGS__ a + (size_t)i * lda + k); \
            _Pragma("GCC unroll 16") for (int j = 0; j < NB; j++) {                                  \
                __m512 wj = LOAD(__VA_ARGS__ w[j] + k);                                              \
                _Pragma("GCC unroll 16") for (int i = 0; i < MB; i++) c[i][j] = _mm512_fmadd_ps(x[i], wj, c[i][j]); \
            }                                                                                        \
        } else {                                                                                     \
            __m512 wv[NB];                                                                           \
            _Pragma("GCC unroll 16") for (int j = 0; j < NB; j++) wv[j] = LOAD(__VA_ARGS__ w[j] + k); \
            _Pragma("GCC unroll 16") for (int i = 0; i < MB; i++) {                                  \
                __m512 xi = LOAD(__VA_ARGS__ a + (size_t)i * lda + k);                               \
                _Pragma("GCC unroll 16") for (int j = 0; j < NB; j++) c[i][j] = _mm512_fmadd_ps(xi, wv[j], c[i][j]); \
            }                                                                                        \
        }                                                                                            \
    } while (0)

#define TILE512(MB, NB)                                                                              \
static void wide##MB##x##NB(const float *a, int lda, const float *b, int ldb, int nb, int K, float *out, \
                            const float *next) {                                                      \
    __m512 c[MB][NB];                                                                                \
    const float *w[NB];                                                                              \
    _Pragma("GCC unroll 16") for (int j = 0; j < NB; j++) w[j] = b + (size_t)(j < nb ? j : 0) * ldb; \
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; i++)                                            \
        _Pragma("GCC unroll 16") for (int j = 0; j < NB; j++) c[i][j] = _mm512_setzero_ps();         \
    int k = 0;                                                                                       \
    for (; k + 16 <= K; k += 16) {                                                                   \
        if (next != NULL) PREFETCH_NEXT(NB);                                                         \
        STEP512(MB, NB, _mm512_loadu_ps, );                                                         \
    }                                                                                                \
    if (k < K) { /* the last K % 16: one masked step, zeros past K (0 * 0 adds nothing) */          \
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1);                                              \
        STEP512(MB, NB, _mm512_maskz_loadu_ps, m, );                                                 \
    }                                                                                                \
    __m512 zero = _mm512_setzero_ps();                                                               \
    int q = 0;                                                                                       \
    _Pragma("GCC unroll 16") for (; q < MB * NB; q += 4) {                                           \
        __m512 v1 = q + 1 < MB * NB ? c[(q + 1) / NB][(q + 1) % NB] : zero;                          \
        __m512 v2 = q + 2 < MB * NB ? c[(q + 2) / NB][(q + 2) % NB] : zero;                          \
        __m512 v3 = q + 3 < MB * NB ? c[(q + 3) / NB][(q + 3) % NB] : zero;                          \
        _mm_storeu_ps(out + q, hsum4_512(c[q / NB][q % NB], v1, v2, v3)); /* out has room to a multiple of 4 */ \
    }                                                                                                \
}
TILE512(1, 16) TILE512(2, 8) TILE512(3, 8) TILE512(4, 6) TILE512(1, 6) TILE512(2, 6) TILE512(3, 6)

#endif

TILE(1, 8) TILE(2, 6) TILE(3, 4) TILE(4, 3) TILE(1, 3) TILE(2, 3) TILE(3, 3)

/* A width's tiles: for 1-3 rows one block as wide as its accumulators allow (`few`, `widths`), so
   every weight is read once; from 4 rows on `nb` rows of weights at a time, read once from memory
   and reused from L1 by every block of four input rows (`four`, then `rest` for the last 1-3). */
typedef struct {
    tile_fn few[4];
    int widths[4];
    tile_fn four, rest[4];
    int nb;
} tiles_t;

/* AVX2: a decode step streams eight rows of weights at a time (more loads in flight); a verify at
   depth 1 or 2 (2 or 3 rows) took 1.1-1.25x as long in 3-column tiles; 5- and 6-row tiles
   measured slower than 4 + the rest. */
static const tiles_t NARROW = {{0, tile1x8, tile2x6, tile3x4}, {0, 8, 6, 4}, tile4x3, {0, tile1x3, tile2x3, tile3x3}, 3};
#if defined(__AVX512F__)
static const tiles_t WIDE = {{0, wide1x16, wide2x8, wide3x8}, {0, 16, 8, 8}, wide4x6, {0, wide1x6, wide2x6, wide3x6}, 6};
int mtplx_small_wide = 1;  /* 0: the AVX2 tiles, for side-by-side measurement (other sums, other bits) */
#else
int mtplx_small_wide = 0;
#endif

static void columns(int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb,
                    float beta, float *C, int ldc) {
#if defined(__AVX512F__)
    const tiles_t *t = mtplx_small_wide ? &WIDE : &NARROW;
#else
    const tiles_t *t = &NARROW;
#endif
    float out[24];  /* the most accumulators of any tile, rounded up to a multiple of 4 */
    if (M <= 3) {
        int NB = t->widths[M];
        for (int n = 0; n < N; n += NB) {
            int nb = N - n < NB ? N - n : NB;
            const float *next = mtplx_small_prefetch && n + mtplx_small_prefetch * NB < N ? B + (size_t)(n + mtplx_small_prefetch * NB) * ldb : NULL;
            t->few[M](A, lda, B + (size_t)n * ldb, ldb, nb, K, out, next);
            store(C + n, ldc, out, M, nb, NB, alpha, beta);
        }
        return;
    }
    for (int n = 0; n < N; n += t->nb) {
        int nb = N - n < t->nb ? N - n : t->nb;
        /* the first block of input rows fetches the next weights; the others find these in L1 */
        const float *next = mtplx_small_prefetch && n + mtplx_small_prefetch * t->nb < N ? B + (size_t)(n + mtplx_small_prefetch * t->nb) * ldb : NULL;
        for (int m = 0; m < M; m += 4) {
            int mb = M - m < 4 ? M - m : 4;
            (mb == 4 ? t->four : t->rest[mb])(A + (size_t)m * lda, lda, B + (size_t)n * ldb, ldb, nb, K, out,
                                               m == 0 ? next : NULL);
            store(C + (size_t)m * ldc + n, ldc, out, mb, nb, t->nb, alpha, beta);
        }
    }
}

/* A second thread for products big enough to share (a batch's or a verify's rows).

   MLX's CPU stream runs every sgemm on one thread, and while it does the engine's Python thread
   mostly waits for it: with several sequences decoding together the process used about one of
   the two cores. So a helper thread takes column chunks of a product: the caller publishes the
   product, both claim chunks of CHUNK columns from one atomic ticket, and the caller returns when
   every chunk is done. The caller never waits for a chunk nobody claimed, so a helper that is
   asleep or busy elsewhere only means the caller computes more of it (one preempted in the middle
   of a chunk holds the caller up to that chunk's end). Columns are independent
   outputs, each summed in the same order as ever: the result is bit-identical to one thread.
   After its last chunk the helper polls for mtplx_small_spin_ns (yielding the core to any thread that wants
   it), then sleeps on a futex until the next shared product. */
int mtplx_small_threads = 1;          /* off: every product on the calling thread */
long mtplx_small_split_macs = 131072; /* M * N * K from which a product is shared */
long mtplx_small_spin_ns = 2000000;   /* how long the idle helper polls before it sleeps */
enum { CHUNK = 48 };

static struct { int M, N, K; float alpha; const float *A; int lda; const float *B; int ldb; float beta; float *C; int ldc; } job;
static _Atomic uint64_t ticket;  /* generation << 32 | chunks << 16 | next chunk */
static atomic_int done;          /* chunks finished of the current generation */
static atomic_int wake, asleep;  /* the helper's futex word, and whether it sleeps on it */
static atomic_flag owner = ATOMIC_FLAG_INIT;  /* one shared product at a time; others run alone */
static atomic_int helper;        /* 0 not started, 1 running, -1 could not start */

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* The next unclaimed chunk of the current product, or -1. A chunk claimed under a generation is
   finished before its caller returns, so the job fields read after a claim are that product's. */
static int claim(void) {
    uint64_t t = atomic_load(&ticket);
    for (;;) {
        int next = (int)(t & 0xffff), count = (int)((t >> 16) & 0xffff);
        if (next >= count)
            return -1;
        if (atomic_compare_exchange_weak(&ticket, &t, t + 1))
            return next;
    }
}

static void run_chunk(int c) {
    int n0 = c * CHUNK, n = job.N - n0 < CHUNK ? job.N - n0 : CHUNK;
    columns(job.M, n, job.K, job.alpha, job.A, job.lda, job.B + (size_t)n0 * job.ldb, job.ldb, job.beta, job.C + n0,
            job.ldc);
    atomic_fetch_add(&done, 1);
}

static void *helper_main(void *unused) {
    (void)unused;
    long idle_since = now_ns();
    for (;;) {
        int c = claim();
        if (c >= 0) {
            run_chunk(c);
            idle_since = now_ns();
            continue;
        }
        if (now_ns() - idle_since < mtplx_small_spin_ns) {
            for (int i = 0; i < 32; i++) _mm_pause();
            sched_yield();
            continue;
        }
        int w = atomic_load(&wake);
        atomic_store(&asleep, 1);
        uint64_t t = atomic_load(&ticket);  /* published before `asleep` was seen: take it */
        if ((int)(t & 0xffff) >= (int)((t >> 16) & 0xffff))
            syscall(SYS_futex, &wake, FUTEX_WAIT_PRIVATE, w, NULL, NULL, 0);
        atomic_store(&asleep, 0);
        idle_since = now_ns();
    }
    return NULL;
}

static void forget_helper(void) { atomic_store(&helper, 0); atomic_store(&asleep, 0); atomic_flag_clear(&owner); }

static int start_helper(void) { return start_helper_thread(&helper, helper_main, forget_helper); }

void mtplx_small_sgemm(int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb,
                       float beta, float *C, int ldc) {
    int count = (N + CHUNK - 1) / CHUNK;
    if (!mtplx_small_threads || count < 2 || count > 0xffff || (long)M * N * K < mtplx_small_split_macs
        || atomic_flag_test_and_set(&owner)) {
        columns(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    if (!start_helper()) {
        atomic_flag_clear(&owner);
        columns(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    job.M = M; job.N = N; job.K = K; job.alpha = alpha; job.A = A; job.lda = lda; job.B = B; job.ldb = ldb;
    job.beta = beta; job.C = C; job.ldc = ldc;
    atomic_store(&done, 0);
    uint64_t generation = (atomic_load(&ticket) >> 32) + 1;
    atomic_store(&ticket, generation << 32 | (uint64_t)count << 16);
    if (atomic_load(&asleep)) {
        atomic_fetch_add(&wake, 1);
        syscall(SYS_futex, &wake, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    }
    int c;
    while ((c = claim()) >= 0)
        run_chunk(c);
    while (atomic_load(&done) < count)
        _mm_pause();
    atomic_flag_clear(&owner);
}


void cblas_sgemm(int layout, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
    if (enabled && layout == RowMajor && ta == NoTrans && tb == Trans && M >= 1 && M <= mtplx_small_rows && N >= 1
        && K >= 8) {
        mtplx_small_sgemm(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    if (!next_sgemm)  /* not attached (a process that loaded this library by itself): the next one in scope */
        next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    if (!next_sgemm) {  /* a clear stop, not a jump to address 0 */
        fprintf(stderr, "mtplx small-row kernel: no BLAS behind it for a %dx%dx%d sgemm\n", M, N, K);
        abort();
    }
    next_sgemm(layout, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void mtplx_small_gemm_enable(int on) { enabled = on; }
void mtplx_small_gemm_next(void *fn) { next_sgemm = (sgemm_fn)fn; }
