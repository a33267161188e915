/* Rotary position embedding (neox layout, as the torch path in layers/rotary_embedding.py) applied in place to q and
 * k, one call for all tokens and heads instead of about two dozen small torch ops per layer.
 *
 * For token t at position p, each head's halves x1 = x[:D/2], x2 = x[D/2:] become
 *   x1 * cos[p] - x2 * sin[p],   x2 * cos[p] + x1 * sin[p]
 * with the same roundings as the torch path (separate multiplies and an add: no fused multiply-add), so the result
 * is bit-identical to it.
 *
 *   q [T, HQ * D] rows q_stride apart, k [T, HK * D] rows k_stride apart (float32, contiguous within a row);
 *   positions [T] int64; cos_cache, sin_cache [max_position, D / 2] float32.
 */
#include <stdint.h>

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

int rotary_neox_inplace(float *q, int64_t q_stride, float *k, int64_t k_stride, const int64_t *positions,
                        const float *cos_cache, const float *sin_cache, int64_t max_position, int64_t T, int HQ,
                        int HK, int D, int num_threads) {
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return 3;
    const int half = D / 2;
#pragma omp parallel for schedule(static) num_threads(T > 16 ? num_threads : 1)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_cache + positions[t] * half, *s = sin_cache + positions[t] * half;
        rotate_heads(q + t * q_stride, HQ, D, c, s);
        rotate_heads(k + t * k_stride, HK, D, c, s);
    }
    return 0;
}

/* The same rotation on bfloat16 q / k (raw uint16): each element widened to float, rotated as above, rounded back
 * to nearest even once (what rotating float copies and copying them back computes). */
static inline float bf16f(uint16_t h) {
    union { uint32_t u; float f; } c = {(uint32_t)h << 16};
    return c.f;
}

static inline uint16_t bf16r(float f) {
    union { float f; uint32_t u; } c = {f};
    const uint32_t rounded = (c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16;
    return (uint16_t)(((c.u & 0x7fffffffu) > 0x7f800000u) ? ((c.u >> 16) | 0x40u) : rounded);
}

__attribute__((optimize("fp-contract=off"))) static void rotate_heads_bf16(uint16_t *x, int H, int D, const float *c,
                                                                            const float *s) {
    const int half = D / 2;
    for (int h = 0; h < H; h++) {
        uint16_t *x1 = x + (int64_t)h * D, *x2 = x1 + half;
#pragma omp simd
        for (int i = 0; i < half; i++) {
            const float a = bf16f(x1[i]), b = bf16f(x2[i]);
            const float r1 = a * c[i] - b * s[i];
            const float r2 = b * c[i] + a * s[i];
            x1[i] = bf16r(r1);
            x2[i] = bf16r(r2);
        }
    }
}

int rotary_neox_inplace_bf16(uint16_t *q, int64_t q_stride, uint16_t *k, int64_t k_stride, const int64_t *positions,
                             const float *cos_cache, const float *sin_cache, int64_t max_position, int64_t T, int HQ,
                             int HK, int D, int num_threads) {
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return 3;
    const int half = D / 2;
#pragma omp parallel for schedule(static) num_threads(T > 16 ? num_threads : 1)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_cache + positions[t] * half, *s = sin_cache + positions[t] * half;
        rotate_heads_bf16(q + t * q_stride, HQ, D, c, s);
        rotate_heads_bf16(k + t * k_stride, HK, D, c, s);
    }
    return 0;
}
