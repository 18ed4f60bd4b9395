/* Shared AVX2 helpers of mtplx/native: a vector exponent for non-positive inputs, horizontal sum and
   max, and one row's softmax in place. Included by attention.c and draft_step.c. */
#ifndef MTPLX_SOFTMAX_H
#define MTPLX_SOFTMAX_H
#include <immintrin.h>
#include <math.h>

/* e^x for x <= 0 as 2^n * p(f): n = round(x log2 e), f in [-1/2, 1/2], p of degree 5
 * (relative error < 4e-7); n clamped at -127, whose exponent bits make exactly 0. */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 round = _mm256_set1_ps(12582912.0f); /* 1.5 * 2^23 */
    __m256 y = _mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f)), _mm256_set1_ps(-127.0f));
    __m256 t = _mm256_add_ps(y, round);
    __m256 n = _mm256_sub_ps(t, round);
    __m256 f = _mm256_sub_ps(y, n);
    __m256 p = _mm256_set1_ps(1.3333558e-3f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6180883e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504110e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline float hsum(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One row's scores in place: softmax weights over its first n keys (max subtracted, exponent),
 * zero from key n to `span` (exp of -inf gives exactly 0); returns 1 / the weights' sum. */
static float softmax_row(float *s, int n, int span) {
    int whole = n / 8 * 8;
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (int i = 0; i < whole; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + i));
    float mx = hmax(m);
    for (int i = whole; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    for (int i = n; i < span; i++) s[i] = -INFINITY;
    __m256 top = _mm256_set1_ps(mx), sum = _mm256_setzero_ps();
    int end = (n + 7) / 8 * 8;
    for (int i = 0; i < end; i += 8) {
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), top));
        _mm256_storeu_ps(s + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    for (int i = end; i < span; i++) s[i] = 0.0f;
    return 1.0f / hsum(sum);
}

#endif
