/* bfloat16 <-> float32 for kvflow's CPU kernels: bfloat16 is the top half of a float32. */
#ifndef KVFLOW_CPU_BF16_H
#define KVFLOW_CPU_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even; inputs are finite (no NaN handling). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif
