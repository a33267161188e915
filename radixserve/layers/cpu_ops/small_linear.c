/* y = x W^T (+ b) for a few rows of x (decode at batch 1-4), float32, on every intra-op thread.
 *
 * For one row MKL takes its matrix-vector path, which runs on one thread, so a batch-1 decode step streams the
 * weights through a single core. Here the output features are split between the threads; each weight row is read
 * once (contiguous, K elements) and dotted with every row of x, so the step is bound by memory bandwidth over all
 * cores instead of one core.
 *
 *   x [M, K], w [N, K], bias [N] or NULL, y [M, N]: float32, contiguous rows (x and y rows `x_stride` and
 *   `y_stride` elements apart).
 */
#include <stdint.h>

#define MAX_M 4
#define ROWS_PER_TASK 16

static inline __attribute__((always_inline)) void rows_impl(const float *restrict x, int64_t x_stride,
                                                             const float *restrict w, const float *restrict bias,
                                                             float *restrict y, int64_t y_stride, int M, int64_t K,
                                                             int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const float *wn = w + n * K;
        float acc[MAX_M];
        for (int m = 0; m < M; m++) {
            const float *xm = x + m * x_stride;
            float a = 0.f;
#pragma omp simd reduction(+ : a)
            for (int64_t k = 0; k < K; k++) a += xm[k] * wn[k];
            acc[m] = a;
        }
        for (int m = 0; m < M; m++) y[m * y_stride + n] = acc[m] + (bias ? bias[n] : 0.f);
    }
}

int small_m_linear(const float *x, int64_t x_stride, const float *w, const float *bias, float *y, int64_t y_stride,
                   int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || M > MAX_M) return 2;
    const int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < N ? n0 + ROWS_PER_TASK : N;
        if (M == 1) rows_impl(x, x_stride, w, bias, y, y_stride, 1, K, n0, n1);
        else rows_impl(x, x_stride, w, bias, y, y_stride, (int)M, K, n0, n1);
    }
    return 0;
}
