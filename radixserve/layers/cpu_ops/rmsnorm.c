/* RMSNorm, optionally after the residual add, in one call instead of about twenty small torch ops.
 *
 * For each row: s = x (+ residual); out = w * (s * (1 / sqrt(mean(s^2) + eps))), the torch path's order of
 * operations (no fused multiply-add). The mean of squares is summed in double, so it can differ from torch's float
 * sum in the last bit of the scale.
 *
 *   x [T, H] rows x_stride apart; residual [T, H] rows r_stride apart or NULL; out, residual_out [T, H] contiguous
 *   (residual_out written only with a residual); w [H]. float32.
 */
#include <math.h>
#include <stdint.h>

__attribute__((optimize("fp-contract=off"))) static void norm_row(const float *x, const float *r, float *out,
                                                                   float *r_out, const float *w, int64_t H,
                                                                   float eps) {
    double ss = 0.0;
    if (r) {
        for (int64_t i = 0; i < H; i++) {
            const float s = x[i] + r[i];
            r_out[i] = s;
            ss += (double)s * s;
        }
        x = r_out;
    } else {
        for (int64_t i = 0; i < H; i++) ss += (double)x[i] * x[i];
    }
    const float inv = 1.0f / sqrtf((float)(ss / (double)H) + eps);
#pragma omp simd
    for (int64_t i = 0; i < H; i++) out[i] = w[i] * (x[i] * inv);
}

int rmsnorm(const float *x, int64_t x_stride, const float *residual, int64_t r_stride, float *out,
            float *residual_out, const float *w, int64_t T, int64_t H, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(T > 8 ? num_threads : 1)
    for (int64_t t = 0; t < T; t++)
        norm_row(x + t * x_stride, residual ? residual + t * r_stride : 0, out + t * H,
                 residual ? residual_out + t * H : 0, w, H, eps);
    return 0;
}
