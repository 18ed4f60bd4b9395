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
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

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

#define ZERO(i) __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = _mm256_setzero_ps(), c##i##2 = _mm256_setzero_ps();
#define ROW(i) { __m256 x = _mm256_loadu_ps(a + (size_t)(i) * lda + k); \
    c##i##0 = _mm256_fmadd_ps(x, w0, c##i##0); c##i##1 = _mm256_fmadd_ps(x, w1, c##i##1); c##i##2 = _mm256_fmadd_ps(x, w2, c##i##2); }
#define SUM(i) out[(i) * 3 + 0] = hsum(c##i##0); out[(i) * 3 + 1] = hsum(c##i##1); out[(i) * 3 + 2] = hsum(c##i##2);

// Dot products of MB rows of a with three rows of b (b0, b1, b2), 8 lanes at a time; the order of
// the sums is the same for every row count, so a row's result never depends on its neighbours.
#define KERNEL(MB)                                                                                          \
static void kern##MB(const float *a, int lda, const float *b0, const float *b1, const float *b2, int K,  \
                     float *out) {                                                                          \
    ZERO(0) ZERO(1) ZERO(2) ZERO(3)                                                                         \
    int k = 0;                                                                                              \
    for (; k + 8 <= K; k += 8) {                                                                            \
        __m256 w0 = _mm256_loadu_ps(b0 + k), w1 = _mm256_loadu_ps(b1 + k), w2 = _mm256_loadu_ps(b2 + k);   \
        ROW(0) if (MB > 1) ROW(1) if (MB > 2) ROW(2) if (MB > 3) ROW(3)                                     \
    }                                                                                                       \
    SUM(0) if (MB > 1) { SUM(1) } if (MB > 2) { SUM(2) } if (MB > 3) { SUM(3) }                             \
    for (int i = 0; i < MB; i++)                                                                            \
        for (int kk = k; kk < K; kk++) {                                                                    \
            out[i * 3 + 0] += a[(size_t)i * lda + kk] * b0[kk];                                             \
            out[i * 3 + 1] += a[(size_t)i * lda + kk] * b1[kk];                                             \
            out[i * 3 + 2] += a[(size_t)i * lda + kk] * b2[kk];                                             \
        }                                                                                                   \
}
KERNEL(1) KERNEL(2) KERNEL(3) KERNEL(4)

// One row of a against eight rows of b: for a decode step (M = 1) the product is a stream through
// the weights, and eight rows in flight keep more of memory's bandwidth busy than three. Each
// output is still one accumulator over K in steps of 8, so its bits equal the 4-row kernel's.
static void kern1x8(const float *a, const float *b, int ldb, int K, float *out) {
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    const float *b0 = b, *b1 = b + ldb, *b2 = b + 2 * (size_t)ldb, *b3 = b + 3 * (size_t)ldb, *b4 = b + 4 * (size_t)ldb,
                *b5 = b + 5 * (size_t)ldb, *b6 = b + 6 * (size_t)ldb, *b7 = b + 7 * (size_t)ldb;
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 x = _mm256_loadu_ps(a + k);
        c0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b0 + k), c0); c1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b1 + k), c1);
        c2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b2 + k), c2); c3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b3 + k), c3);
        c4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b4 + k), c4); c5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b5 + k), c5);
        c6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b6 + k), c6); c7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(b7 + k), c7);
    }
    out[0] = hsum(c0); out[1] = hsum(c1); out[2] = hsum(c2); out[3] = hsum(c3);
    out[4] = hsum(c4); out[5] = hsum(c5); out[6] = hsum(c6); out[7] = hsum(c7);
    const float *rows[8] = {b0, b1, b2, b3, b4, b5, b6, b7};
    for (int j = 0; j < 8; j++)
        for (int kk = k; kk < K; kk++) out[j] += a[kk] * rows[j][kk];
}

void mtplx_small_sgemm(int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb,
                       float beta, float *C, int ldc) {
    float out[12];
    int n = 0;
    if (M == 1)  // a decode step: eight rows of weights at a time, the last few below
        for (; n + 8 <= N; n += 8) {
            kern1x8(A, B + (size_t)n * ldb, ldb, K, out);
            for (int j = 0; j < 8; j++) C[n + j] = beta == 0.0f ? alpha * out[j] : alpha * out[j] + beta * C[n + j];
        }
    for (; n < N; n += 3) {
        int nb = N - n < 3 ? N - n : 3;
        const float *b0 = B + (size_t)n * ldb, *b1 = nb > 1 ? b0 + ldb : b0, *b2 = nb > 2 ? b0 + 2 * (size_t)ldb : b0;
        for (int m = 0; m < M; m += 4) {
            int mb = M - m < 4 ? M - m : 4;
            const float *a = A + (size_t)m * lda;
            switch (mb) {
                case 4: kern4(a, lda, b0, b1, b2, K, out); break;
                case 3: kern3(a, lda, b0, b1, b2, K, out); break;
                case 2: kern2(a, lda, b0, b1, b2, K, out); break;
                default: kern1(a, lda, b0, b1, b2, K, out);
            }
            for (int i = 0; i < mb; i++)
                for (int j = 0; j < nb; j++) {
                    float *c = C + (size_t)(m + i) * ldc + n + j;
                    *c = beta == 0.0f ? alpha * out[i * 3 + j] : alpha * out[i * 3 + j] + beta * *c;
                }
        }
    }
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
