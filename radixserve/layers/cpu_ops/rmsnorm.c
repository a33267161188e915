/* RMSNorm, optionally after the residual add, in one call instead of about twenty small torch ops.
 *
 * For each row: s = x (+ residual); out = w * (s * (1 / sqrt(mean(s^2) + eps))), the torch path's order of
 * operations (no fused multiply-add). The mean of squares is summed in double (in vector lanes), so it can differ
 * from torch's float sum in the last bit of the scale.
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

int rmsnorm(const float *x, int64_t x_stride, const float *residual, int64_t r_stride, float *out,
            float *residual_out, const float *w, int64_t T, int64_t H, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(T > 8 ? num_threads : 1)
    for (int64_t t = 0; t < T; t++)
        norm_row(x + t * x_stride, residual ? residual + t * r_stride : 0, out + t * H,
                 residual ? residual_out + t * H : 0, w, H, eps);
    return 0;
}

/* bfloat16 rows (raw uint16), as transformers' LlamaRMSNorm computes them: s = bf16(x + residual) (the add in float,
 * one rounding, as torch's bf16 add), the scale in float, y = bf16(s * inv), out = bf16(w * y). One call instead of
 * the float copies of x and w and the two casts back. */
static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c = {(uint32_t)h << 16};
    return c.f;
}

static inline uint16_t f32_to_bf16_rne(float f) { /* round to nearest even, as torch's conversion; NaN stays NaN */
    union { float f; uint32_t u; } c = {f};
    const uint32_t rounded = (c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16;
    return (uint16_t)(((c.u & 0x7fffffffu) > 0x7f800000u) ? ((c.u >> 16) | 0x40u) : rounded);
}

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

int rmsnorm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *residual, int64_t r_stride, uint16_t *out,
                 uint16_t *residual_out, const uint16_t *w, int64_t T, int64_t H, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(T > 8 ? num_threads : 1)
    for (int64_t t = 0; t < T; t++)
        norm_row_bf16(x + t * x_stride, residual ? residual + t * r_stride : 0, out + t * H,
                      residual ? residual_out + t * H : 0, w, H, eps);
    return 0;
}
