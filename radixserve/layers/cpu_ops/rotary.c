/* Rotary position embedding (neox layout, as the torch path in layers/rotary_embedding.py) applied in place to q and
 * k, one call for all tokens and heads instead of about two dozen small torch ops per layer.
 *
 * For token t at position p, each head's halves x1 = x[:D/2], x2 = x[D/2:] become
 *   x1 * cos[p] - x2 * sin[p],   x2 * cos[p] + x1 * sin[p]
 * with the same roundings as the torch path (separate multiplies and an add: no fused multiply-add), so the result
 * is bit-identical to it.
 *
 *   q [T, HQ * D] rows q_stride elements apart, k [T, HK * D] rows k_stride apart (contiguous within a row), both
 *   float32 or both bfloat16 (raw uint16: each element widened to float, rotated as above, rounded back to nearest
 *   even once, what rotating float copies and copying them back computes); positions [T] int64;
 *   cos_cache, sin_cache [max_position, D / 2] float32.
 */
#include <stdint.h>

#include "bf16.h"

__attribute__((optimize("fp-contract=off"))) static void rotate_heads(float *x, int H, int D, const float *c,
                                                                       const float *s) {
    const int half = D / 2;
    for (int h = 0; h < H; h++) {
        float *x1 = x + (int64_t)h * D, *x2 = x1 + half;
#pragma omp simd
        for (int i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            const float r1 = a * c[i] - b * s[i];
            const float r2 = b * c[i] + a * s[i];
            x1[i] = r1;
            x2[i] = r2;
        }
    }
}

__attribute__((optimize("fp-contract=off"))) static void rotate_heads_bf16(uint16_t *x, int H, int D, const float *c,
                                                                            const float *s) {
    const int half = D / 2;
    for (int h = 0; h < H; h++) {
        uint16_t *x1 = x + (int64_t)h * D, *x2 = x1 + half;
#pragma omp simd
        for (int i = 0; i < half; i++) {
            const float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
            const float r1 = a * c[i] - b * s[i];
            const float r2 = b * c[i] + a * s[i];
            x1[i] = f32_to_bf16_rne(r1);
            x2[i] = f32_to_bf16_rne(r2);
        }
    }
}

/* Returns 0, or 3 when a position is outside [0, max_position). */
int rotary_neox_inplace(void *q, int64_t q_stride, void *k, int64_t k_stride, const int64_t *positions,
                        const float *cos_cache, const float *sin_cache, int64_t max_position, int64_t T, int HQ,
                        int HK, int D, int bf16, int num_threads) {
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return 3;
    const int half = D / 2;
#pragma omp parallel for schedule(static) num_threads(T > 16 ? num_threads : 1)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_cache + positions[t] * half, *s = sin_cache + positions[t] * half;
        if (bf16) {
            rotate_heads_bf16((uint16_t *)q + t * q_stride, HQ, D, c, s);
            rotate_heads_bf16((uint16_t *)k + t * k_stride, HK, D, c, s);
        } else {
            rotate_heads((float *)q + t * q_stride, HQ, D, c, s);
            rotate_heads((float *)k + t * k_stride, HK, D, c, s);
        }
    }
    return 0;
}
