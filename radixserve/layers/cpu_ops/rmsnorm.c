/* RMSNorm, optionally after the residual add, in one call instead of about twenty small torch ops.
 *
 * For each row: s = x (+ residual); out = w * (s * (1 / sqrt(mean(s^2) + eps))), the torch path's order of
 * operations (no fused multiply-add). The mean of squares is summed in double (in vector lanes), so it can differ
 * from torch's float sum in the last bit of the scale.
 *
 *   x [T, H] rows x_stride apart; residual [T, H] rows r_stride apart or NULL; out, residual_out [T, H] contiguous
 *   (residual_out written only with a residual); w [H]. All float32, or all bfloat16 (below). Strides in elements.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

__attribute__((optimize("fp-contract=off"))) static void norm_row(const float *x, const float *r, float *out,
                                                                   float *r_out, const float *w, int64_t H,
                                                                   float eps) {
    double ss = 0.0;
    if (r) {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; i++) {
            const float s = x[i] + r[i];
            r_out[i] = s;
            ss += (double)s * s;
        }
        x = r_out;
    } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; i++) ss += (double)x[i] * x[i];
    }
    const float inv = 1.0f / sqrtf((float)(ss / (double)H) + eps);
#pragma omp simd
    for (int64_t i = 0; i < H; i++) out[i] = w[i] * (x[i] * inv);
}

/* bfloat16 rows (raw uint16), as transformers' LlamaRMSNorm computes them: s = bf16(x + residual) (the add in float,
 * one rounding, as torch's bf16 add), the scale in float, y = bf16(s * inv), out = bf16(w * y). One call instead of
 * the float copies of x and w and the two casts back. */
__attribute__((optimize("fp-contract=off"))) static void norm_row_bf16(const uint16_t *x, const uint16_t *r,
                                                                        uint16_t *out, uint16_t *r_out,
                                                                        const uint16_t *w, int64_t H, float eps) {
    double ss = 0.0;
    if (r) {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; i++) {
            const uint16_t s = f32_to_bf16_rne(bf16_to_f32(x[i]) + bf16_to_f32(r[i]));
            r_out[i] = s;
            const float sf = bf16_to_f32(s);
            ss += (double)sf * sf;
        }
        x = r_out;
    } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < H; i++) {
            const float xf = bf16_to_f32(x[i]);
            ss += (double)xf * xf;
        }
    }
    const float inv = 1.0f / sqrtf((float)(ss / (double)H) + eps);
#pragma omp simd
    for (int64_t i = 0; i < H; i++)
        out[i] = f32_to_bf16_rne(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16_rne(bf16_to_f32(x[i]) * inv)));
}

int rmsnorm(const void *x, int64_t x_stride, const void *residual, int64_t r_stride, void *out, void *residual_out,
            const void *w, int64_t T, int64_t H, float eps, int bf16, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(T > 8 ? num_threads : 1)
    for (int64_t t = 0; t < T; t++) {
        if (bf16)
            norm_row_bf16((const uint16_t *)x + t * x_stride, residual ? (const uint16_t *)residual + t * r_stride : 0,
                          (uint16_t *)out + t * H, residual ? (uint16_t *)residual_out + t * H : 0,
                          (const uint16_t *)w, H, eps);
        else
            norm_row((const float *)x + t * x_stride, residual ? (const float *)residual + t * r_stride : 0,
                     (float *)out + t * H, residual ? (float *)residual_out + t * H : 0, (const float *)w, H, eps);
    }
    return 0;
}
