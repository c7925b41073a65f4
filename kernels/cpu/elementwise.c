/* Row-wise ops of the Llama layer on CPU, each one pass over memory instead of torch's chain
 * of element-wise ops: RMSNorm with the residual add, rotary embedding in place, SiLU-and-mul.
 *
 * Rounding follows Hugging Face's float32/bfloat16 computation step by step (the residual sum
 * and the normalized value are rounded to the storage type before the weight multiplies,
 * silu(gate) is rounded before it multiplies up), so greedy decoding matches transformers.
 * Rows run in parallel on the kernels' pool (pool.h) only when there is enough work to pay
 * for waking it.
 * Strides are in elements; the last dimension is contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "pool.h"

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

struct rmsnorm_args {
    const void *x, *residual, *weight;
    void *residual_out, *out;
    int64_t x_st, r_st, ro_st, o_st;
    int hidden, is_bf16;
    float eps;
};

static void rmsnorm_rows(void *ctx, int64_t lo, int64_t hi) {
    const struct rmsnorm_args *a = ctx;
    int64_t size = a->is_bf16 ? 2 : 4;
    float row[8192];
    for (int64_t i = lo; i < hi; i++) {
        const char *xi = (const char *)a->x + i * a->x_st * size;
        const char *ri = a->residual ? (const char *)a->residual + i * a->r_st * size : NULL;
        char *roi = a->residual ? (char *)a->residual_out + i * a->ro_st * size : NULL;
        char *oi = (char *)a->out + i * a->o_st * size;
        if (a->is_bf16)
            rmsnorm_row(xi, ri, roi, a->weight, oi, a->hidden, a->eps, row, 1);
        else
            rmsnorm_row(xi, ri, roi, a->weight, oi, a->hidden, a->eps, row, 0);
    }
}

/* Rows per chunk: the whole loop on the calling thread below KVF_PARALLEL_MIN elements,
 * else about that many elements a chunk. */
static int64_t rows_per_chunk(int64_t n, int64_t row_elems) {
    if (n * row_elems < KVF_PARALLEL_MIN) return n;
    int64_t rows = KVF_PARALLEL_MIN / 4 / (row_elems > 0 ? row_elems : 1);
    return rows > 0 ? rows : 1;
}

/* out = weight * norm(x + residual); residual_out = x + residual (when residual is given).
 * x, residual, residual_out, out: [n, hidden] with row strides; weight [hidden]. */
void kvflow_rmsnorm(const void *x, int64_t x_st, const void *residual, int64_t r_st,
                    void *residual_out, int64_t ro_st, const void *weight, void *out,
                    int64_t o_st, int64_t n, int hidden, float eps, int is_bf16) {
    struct rmsnorm_args a = {x, residual, weight, residual_out, out, x_st, r_st, ro_st, o_st,
                             hidden, is_bf16, eps};
    kvf_parallel_for(n, rows_per_chunk(n, hidden), rmsnorm_rows, &a);
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

struct rotary_args {
    void *q, *k;
    int64_t q_st, q_sh, k_st, k_sh;
    const int64_t *positions;
    const float *cos_sin;
    int heads, kv_heads, dim, is_bf16;
};

static void rotary_rows(void *ctx, int64_t lo, int64_t hi) {
    const struct rotary_args *a = ctx;
    int half = a->dim / 2;
    int64_t size = a->is_bf16 ? 2 : 4;
    for (int64_t i = lo; i < hi; i++) {
        const float *cos = a->cos_sin + a->positions[i] * a->dim;
        const float *sin = cos + half;
        for (int h = 0; h < a->heads + a->kv_heads; h++) {
            int64_t at = h < a->heads ? i * a->q_st + h * a->q_sh
                                      : i * a->k_st + (h - a->heads) * a->k_sh;
            char *head = (char *)(h < a->heads ? a->q : a->k) + at * size;
            if (a->is_bf16)
                rotate_head(head, cos, sin, half, 1);
            else
                rotate_head(head, cos, sin, half, 0);
        }
    }
}

/* Rotates q [n, heads, dim] and k [n, kv_heads, dim] in place (NeoX layout: the first and
 * second halves of each head are the pair); cos_sin: float32 [positions, dim], cos in the
 * first half of a row, sin in the second. */
void kvflow_rotary(void *q, int64_t q_st, int64_t q_sh, void *k, int64_t k_st, int64_t k_sh,
                   const int64_t *positions, const float *cos_sin, int64_t n, int heads,
                   int kv_heads, int dim, int is_bf16) {
    struct rotary_args a = {q, k, q_st, q_sh, k_st, k_sh, positions, cos_sin,
                            heads, kv_heads, dim, is_bf16};
    kvf_parallel_for(n, rows_per_chunk(n, (int64_t)(heads + kv_heads) * dim), rotary_rows, &a);
}

static inline __attribute__((always_inline)) void silu_row(const void *x, void *out,
                                                           int width, const int is_bf16) {
    for (int j = 0; j < width; j++) {
        float gate = load(x, j, is_bf16);
        float act = round_to(gate / (1.0f + expf(-gate)), is_bf16);
        store(out, j, act * load(x, width + j, is_bf16), is_bf16);
    }
}

struct silu_args {
    const void *x;
    void *out;
    int64_t x_st, o_st;
    int width, is_bf16;
};

static void silu_rows(void *ctx, int64_t lo, int64_t hi) {
    const struct silu_args *a = ctx;
    int64_t size = a->is_bf16 ? 2 : 4;
    for (int64_t i = lo; i < hi; i++) {
        const char *row = (const char *)a->x + i * a->x_st * size;
        char *dst = (char *)a->out + i * a->o_st * size;
        if (a->is_bf16)
            silu_row(row, dst, a->width, 1);
        else
            silu_row(row, dst, a->width, 0);
    }
}

/* out [n, width] = silu(gate) * up for x [n, 2 * width] = [gate | up]. */
void kvflow_silu_and_mul(const void *x, int64_t x_st, void *out, int64_t o_st, int64_t n,
                         int width, int is_bf16) {
    struct silu_args a = {x, out, x_st, o_st, width, is_bf16};
    kvf_parallel_for(n, rows_per_chunk(n, width), silu_rows, &a);
}

struct store_kv_args {
    void *k_buf, *v_buf;
    const void *k, *v;
    int64_t kv_st, kv_sh, k_st, k_sh, v_st, v_sh;
    const int64_t *loc;
    int heads, dim, size;
};

static void store_kv_rows(void *ctx, int64_t lo, int64_t hi) {
    const struct store_kv_args *a = ctx;
    size_t bytes = (size_t)a->dim * a->size;
    for (int64_t i = lo; i < hi; i++) {
        for (int h = 0; h < a->heads; h++) {
            int64_t dst = (a->loc[i] * a->kv_st + h * a->kv_sh) * a->size;
            memcpy((char *)a->k_buf + dst, (const char *)a->k + (i * a->k_st + h * a->k_sh) * a->size, bytes);
            memcpy((char *)a->v_buf + dst, (const char *)a->v + (i * a->v_st + h * a->v_sh) * a->size, bytes);
        }
    }
}

/* Writes row i of k and v [n, heads, dim] (strides k_st/k_sh, v_st/v_sh) to slot loc[i] of
 * k_buf and v_buf [slots, heads, dim] (strides kv_st, kv_sh); one storage type of `size`
 * bytes throughout. A decode step's few rows copy on the calling thread (no fork/join). */
void kvflow_store_kv(void *k_buf, void *v_buf, int64_t kv_st, int64_t kv_sh, const void *k,
                     int64_t k_st, int64_t k_sh, const void *v, int64_t v_st, int64_t v_sh,
                     const int64_t *loc, int64_t n, int heads, int dim, int size) {
    struct store_kv_args a = {k_buf, v_buf, k, v, kv_st, kv_sh, k_st, k_sh, v_st, v_sh,
                              loc, heads, dim, size};
    kvf_parallel_for(n, rows_per_chunk(n, (int64_t)heads * dim), store_kv_rows, &a);
}
