/* Row-wise ops of the Llama layer on CPU, each one pass over memory instead of torch's chain
 * of element-wise ops: RMSNorm with the residual add, rotary embedding in place, SiLU-and-mul.
 *
 * Rounding follows Hugging Face's float32/bfloat16 computation step by step (the residual sum
 * and the normalized value are rounded to the storage type before the weight multiplies,
 * silu(gate) is rounded before it multiplies up), so greedy decoding matches transformers.
 * Rows run in parallel under OpenMP only when there is enough work to pay for the fork.
 * Strides are in elements; the last dimension is contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define KVF_PARALLEL_MIN 65536 /* elements: below this a single thread is faster */

static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float round_to(float x, int is_bf16) { return is_bf16 ? bf16_to_f32(f32_to_bf16(x)) : x; }

static inline void store(void *p, int64_t i, float x, int is_bf16) {
    if (is_bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

static inline __attribute__((always_inline)) void rmsnorm_row(
    const void *x, const void *residual, void *residual_out, const void *weight, void *out,
    int hidden, float eps, float *row, const int is_bf16) {
    float sq = 0.0f;
    for (int j = 0; j < hidden; j++) {
        float h = load(x, j, is_bf16);
        if (residual) {
            h = round_to(h + load(residual, j, is_bf16), is_bf16);
            store(residual_out, j, h, is_bf16);
        }
        row[j] = h;
        sq += h * h;
    }
    float inv = 1.0f / sqrtf(sq / (float)hidden + eps);
    for (int j = 0; j < hidden; j++) {
        float normed = round_to(row[j] * inv, is_bf16);
        store(out, j, load(weight, j, is_bf16) * normed, is_bf16);
    }
}

/* out = weight * norm(x + residual); residual_out = x + residual (when residual is given).
 * x, residual, residual_out, out: [n, hidden] with row strides; weight [hidden]. */
void kvflow_rmsnorm(const void *x, int64_t x_st, const void *residual, int64_t r_st,
                    void *residual_out, int64_t ro_st, const void *weight, void *out,
                    int64_t o_st, int64_t n, int hidden, float eps, int is_bf16) {
    int64_t size = is_bf16 ? 2 : 4;
#pragma omp parallel for if (n * hidden >= KVF_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        float row[8192];
        const char *xi = (const char *)x + i * x_st * size;
        const char *ri = residual ? (const char *)residual + i * r_st * size : NULL;
        char *roi = residual ? (char *)residual_out + i * ro_st * size : NULL;
        char *oi = (char *)out + i * o_st * size;
        if (is_bf16)
            rmsnorm_row(xi, ri, roi, weight, oi, hidden, eps, row, 1);
        else
            rmsnorm_row(xi, ri, roi, weight, oi, hidden, eps, row, 0);
    }
}

static inline __attribute__((always_inline)) void rotate_head(void *head, const float *cos,
                                                              const float *sin, int half,
                                                              const int is_bf16) {
    for (int j = 0; j < half; j++) {
        float x1 = load(head, j, is_bf16), x2 = load(head, half + j, is_bf16);
        store(head, j, x1 * cos[j] - x2 * sin[j], is_bf16);
        store(head, half + j, x2 * cos[j] + x1 * sin[j], is_bf16);
    }
}

/* Rotates q [n, heads, dim] and k [n, kv_heads, dim] in place (NeoX layout: the first and
 * second halves of each head are the pair); cos_sin: float32 [positions, dim], cos in the
 * first half of a row, sin in the second. */
void kvflow_rotary(void *q, int64_t q_st, int64_t q_sh, void *k, int64_t k_st, int64_t k_sh,
                   const int64_t *positions, const float *cos_sin, int64_t n, int heads,
                   int kv_heads, int dim, int is_bf16) {
    int half = dim / 2;
    int64_t size = is_bf16 ? 2 : 4;
#pragma omp parallel for if (n * (heads + kv_heads) * dim >= KVF_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        const float *cos = cos_sin + positions[i] * dim;
        const float *sin = cos + half;
        for (int h = 0; h < heads + kv_heads; h++) {
            int64_t at = h < heads ? i * q_st + h * q_sh : i * k_st + (h - heads) * k_sh;
            char *head = (char *)(h < heads ? q : k) + at * size;
            if (is_bf16)
                rotate_head(head, cos, sin, half, 1);
            else
                rotate_head(head, cos, sin, half, 0);
        }
    }
}

/* One row of silu(gate) * up; `is_bf16` is a constant after inlining, so each storage type
 * gets its own branch-free (vectorized) loop. */
static inline __attribute__((always_inline)) void silu_row(const void *x, void *out,
                                                           int width, const int is_bf16) {
    for (int j = 0; j < width; j++) {
        float gate = load(x, j, is_bf16);
        float act = round_to(gate / (1.0f + expf(-gate)), is_bf16);
        store(out, j, act * load(x, width + j, is_bf16), is_bf16);
    }
}

/* out [n, width] = silu(gate) * up for x [n, 2 * width] = [gate | up]. */
void kvflow_silu_and_mul(const void *x, int64_t x_st, void *out, int64_t o_st, int64_t n,
                         int width, int is_bf16) {
    int64_t size = is_bf16 ? 2 : 4;
#pragma omp parallel for if (n * width >= KVF_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        const char *row = (const char *)x + i * x_st * size;
        char *dst = (char *)out + i * o_st * size;
        if (is_bf16)
            silu_row(row, dst, width, 1);
        else
            silu_row(row, dst, width, 0);
    }
}

/* Writes row i of k and v [n, heads, dim] (strides k_st/k_sh, v_st/v_sh) to slot loc[i] of
 * k_buf and v_buf [slots, heads, dim] (strides kv_st, kv_sh); one storage type of `size`
 * bytes throughout. A decode step's few rows copy on the calling thread (no fork/join). */
void kvflow_store_kv(void *k_buf, void *v_buf, int64_t kv_st, int64_t kv_sh, const void *k,
                     int64_t k_st, int64_t k_sh, const void *v, int64_t v_st, int64_t v_sh,
                     const int64_t *loc, int64_t n, int heads, int dim, int size) {
#pragma omp parallel for if (n * heads * dim >= KVF_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        for (int h = 0; h < heads; h++) {
            int64_t dst = (loc[i] * kv_st + h * kv_sh) * size;
            memcpy((char *)k_buf + dst, (const char *)k + (i * k_st + h * k_sh) * size, (size_t)dim * size);
            memcpy((char *)v_buf + dst, (const char *)v + (i * v_st + h * v_sh) * size, (size_t)dim * size);
        }
    }
}
