/* bfloat16 <-> float32 for the kernels that read or write raw bfloat16 (uint16) rows. */
#ifndef RS_CPU_BF16_H
#define RS_CPU_BF16_H
#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c = {(uint32_t)h << 16};
    return c.f;
}

static inline uint16_t f32_to_bf16_rne(float f) { /* round to nearest even, as torch's conversion; NaN stays NaN */
    union { float f; uint32_t u; } c = {f};
    const uint32_t rounded = (c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16;
    return (uint16_t)(((c.u & 0x7fffffffu) > 0x7f800000u) ? ((c.u >> 16) | 0x40u) : rounded);
}
#endif
