/* y = x W^T (+ b) for a few rows of x (decode at batch 1-8, a speculative verify's rows), on every intra-op thread.
 *
 * For one row MKL takes its matrix-vector path, which runs on one thread, so a batch-1 decode step streams the
 * weights through a single core. Here the output features are split between the threads; each weight row is read
 * once (contiguous, K elements) and dotted with every row of x in the same pass (one accumulator per row of x), so
 * the step is bound by memory bandwidth over all cores instead of one core, up to MAX_M rows.
 *
 * Every output y[m, n] is computed the same way whatever M, the row's place in x or the thread count (the same
 * vector lanes, the same order over k, the same final reduction): a verify row gives the logits a decode row would.
 *
 *   x [M, K] float32, w [N, K] float32 (small_m_linear) or bfloat16 as raw uint16 (small_m_linear_bf16: x is rounded
 *   to bfloat16 too and the products are summed in float32), bias [N] float32 or NULL, y [M, N] float32; rows of
 *   x and y `x_stride` and `y_stride` elements apart.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_M 8
#define ROWS_PER_TASK 16

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void rows_f32(const float *restrict x, int64_t x_stride,
                                                            const float *restrict w, const float *restrict bias,
                                                            float *restrict y, int64_t y_stride, const int M,
                                                            int64_t K, int64_t n0, int64_t n1) {
    const int64_t K16 = K & ~(int64_t)15;
    const __mmask16 tail = (__mmask16)((1u << (K - K16)) - 1u);
    for (int64_t n = n0; n < n1; n++) {
        const float *wn = w + n * K;
        __m512 acc[MAX_M];
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K16; k += 16) {
            const __m512 wv = _mm512_loadu_ps(wn + k);
            for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * x_stride + k), wv, acc[m]);
        }
        if (tail) {
            const __m512 wv = _mm512_maskz_loadu_ps(tail, wn + K16);
            for (int m = 0; m < M; m++)
                acc[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x + m * x_stride + K16), wv, acc[m]);
        }
        const float b = bias ? bias[n] : 0.f;
        for (int m = 0; m < M; m++) y[m * y_stride + n] = _mm512_reduce_add_ps(acc[m]) + b;
    }
}
#else
static inline __attribute__((always_inline)) void rows_f32(const float *restrict x, int64_t x_stride,
                                                            const float *restrict w, const float *restrict bias,
                                                            float *restrict y, int64_t y_stride, const int M,
                                                            int64_t K, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const float *wn = w + n * K;
        for (int m = 0; m < M; m++) {
            const float *xm = x + m * x_stride;
            float a = 0.f;
#pragma omp simd reduction(+ : a)
            for (int64_t k = 0; k < K; k++) a += xm[k] * wn[k];
            y[m * y_stride + n] = a + (bias ? bias[n] : 0.f);
        }
    }
}
#endif

/* One call per M so that the accumulators live in registers. */
#define DISPATCH(FN, ...)                                                \
    switch (M) {                                                         \
    case 1: FN(__VA_ARGS__, 1, K, n0, n1); break;                        \
    case 2: FN(__VA_ARGS__, 2, K, n0, n1); break;                        \
    case 3: FN(__VA_ARGS__, 3, K, n0, n1); break;                        \
    case 4: FN(__VA_ARGS__, 4, K, n0, n1); break;                        \
    case 5: FN(__VA_ARGS__, 5, K, n0, n1); break;                        \
    case 6: FN(__VA_ARGS__, 6, K, n0, n1); break;                        \
    case 7: FN(__VA_ARGS__, 7, K, n0, n1); break;                        \
    default: FN(__VA_ARGS__, 8, K, n0, n1); break;                       \
    }

int small_m_linear(const float *x, int64_t x_stride, const float *w, const float *bias, float *y, int64_t y_stride,
                   int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || M > MAX_M) return 2;
    const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < N ? n0 + ROWS_PER_TASK : N;
        DISPATCH(rows_f32, x, x_stride, w, bias, y, y_stride)
    }
    return 0;
}

/* ---------------------------------------------------------------- bfloat16 weights */
#if defined(__AVX512BF16__)
static inline __attribute__((always_inline)) void rows_bf16(const uint16_t *restrict xb, const uint16_t *restrict w,
                                                             const float *restrict bias, void *restrict y,
                                                             int64_t y_stride, const int y_bf16, const int M,
                                                             int64_t K, int64_t n0, int64_t n1) {
    /* xb: x rounded to bf16, K padded to a multiple of 32 with zeros (row stride Kp) */
    const int64_t Kp = (K + 31) & ~(int64_t)31, K32 = K & ~(int64_t)31;
    const __mmask32 tail = (__mmask32)((K - K32) ? ((1ull << (K - K32)) - 1ull) : 0u);
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wn = w + n * K;
        __m512 acc[MAX_M];
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K32; k += 32) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(wn + k));
            for (int m = 0; m < M; m++)
                acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512((const void *)(xb + m * Kp + k)), wv);
        }
        if (tail) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, (const void *)(wn + K32));
            for (int m = 0; m < M; m++)
                acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512((const void *)(xb + m * Kp + K32)), wv);
        }
        const float b = bias ? bias[n] : 0.f;
        if (y_bf16)
            for (int m = 0; m < M; m++) ((uint16_t *)y)[m * y_stride + n] = f32_to_bf16_rne(_mm512_reduce_add_ps(acc[m]) + b);
        else
            for (int m = 0; m < M; m++) ((float *)y)[m * y_stride + n] = _mm512_reduce_add_ps(acc[m]) + b;
    }
}

/* x_bf16: x holds bfloat16 (raw uint16) rows instead of float32; y_bf16: y is written as bfloat16, rounded to
 * nearest even (the float32 result converted as torch converts it). */
int small_m_linear_bf16(const void *x, int64_t x_stride, const uint16_t *w, const float *bias, void *y,
                        int64_t y_stride, int64_t M, int64_t N, int64_t K, int num_threads, int x_bf16, int y_bf16) {
    if (M < 1 || M > MAX_M) return 2;
    const int64_t Kp = (K + 31) & ~(int64_t)31;
    uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * (size_t)(M * Kp));
    if (!xb) return 1;
    for (int64_t m = 0; m < M; m++) {
        if (x_bf16)
            for (int64_t k = 0; k < K; k++) xb[m * Kp + k] = ((const uint16_t *)x)[m * x_stride + k];
        else
            for (int64_t k = 0; k < K; k++) xb[m * Kp + k] = f32_to_bf16_rne(((const float *)x)[m * x_stride + k]);
        for (int64_t k = K; k < Kp; k++) xb[m * Kp + k] = 0;
    }
    const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < N ? n0 + ROWS_PER_TASK : N;
        DISPATCH(rows_bf16, xb, w, bias, y, y_stride, y_bf16)
    }
    free(xb);
    return 0;
}

int has_bf16_linear(void) { return 1; }
#else
int small_m_linear_bf16(const void *x, int64_t x_stride, const uint16_t *w, const float *bias, void *y,
                        int64_t y_stride, int64_t M, int64_t N, int64_t K, int num_threads, int x_bf16, int y_bf16) {
    (void)x; (void)x_stride; (void)w; (void)bias; (void)y; (void)y_stride; (void)M; (void)N; (void)K;
    (void)num_threads; (void)x_bf16; (void)y_bf16;
    return 3; /* built for a CPU without AVX512-BF16 */
}

int has_bf16_linear(void) { return 0; }
#endif
