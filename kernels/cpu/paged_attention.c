/* Paged attention on CPU: each query row attends to the first `visible` KV slots of its row
 * of the request-to-token table, reading K and V in place from the paged pool.
 *
 * One work item per (query row, KV head): the item's `group` query heads share every K/V row
 * it loads, scores are computed a block of tokens at a time and folded in with an online
 * softmax (float32 inside, whatever the storage type), so nothing context-sized is ever
 * materialized. Items run in parallel under OpenMP; built against the same libgomp as torch,
 * they share its thread pool and thread count.
 *
 * Strides are in elements; the head dimension must be contiguous. Storage: float32 or
 * bfloat16 (is_bf16), the same for q, the pool and out. Contract and limits are checked by
 * the Python wrapper (kvflow/kernels/cpu/paged_attention.py).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KVF_MAX_DIM 256
#define KVF_MAX_GROUP 16
#define KVF_BLOCK 32
#define KVF_PREFETCH 8

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; inputs are finite */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float dot_f32(const float *restrict q, const float *restrict k, int dim) {
    float acc = 0.0f;
    for (int d = 0; d < dim; d++) acc += q[d] * k[d];
    return acc;
}

static inline float dot_bf16(const float *restrict q, const uint16_t *restrict k, int dim) {
    float acc = 0.0f;
    for (int d = 0; d < dim; d++) acc += q[d] * bf16_to_f32(k[d]);
    return acc;
}

static inline void axpy_f32(float *restrict acc, float p, const float *restrict v, int dim) {
    for (int d = 0; d < dim; d++) acc[d] += p * v[d];
}

static inline void axpy_bf16(float *restrict acc, float p, const uint16_t *restrict v, int dim) {
    for (int d = 0; d < dim; d++) acc[d] += p * bf16_to_f32(v[d]);
}

static void attend_item(const void *q, int64_t q_row, const void *k, const void *v,
                        int64_t kv_st, int64_t kv_off, const int32_t *slots, int64_t len,
                        void *out, int64_t o_row, int64_t q_sh, int64_t o_sh, int group,
                        int dim, float scale, int is_bf16) {
    float qf[KVF_MAX_GROUP][KVF_MAX_DIM];
    float acc[KVF_MAX_GROUP][KVF_MAX_DIM];
    float s[KVF_MAX_GROUP][KVF_BLOCK];
    float m[KVF_MAX_GROUP], l[KVF_MAX_GROUP];

    for (int g = 0; g < group; g++) {
        int64_t at = q_row + g * q_sh;
        for (int d = 0; d < dim; d++) {
            float x = is_bf16 ? bf16_to_f32(((const uint16_t *)q)[at + d]) : ((const float *)q)[at + d];
            qf[g][d] = x * scale;
            acc[g][d] = 0.0f;
        }
        m[g] = -FLT_MAX;
        l[g] = 0.0f;
    }
    for (int64_t start = 0; start < len; start += KVF_BLOCK) {
        int count = (int)(len - start < KVF_BLOCK ? len - start : KVF_BLOCK);
        for (int t = 0; t < count; t++) {
            int64_t at = (int64_t)slots[start + t] * kv_st + kv_off;
            if (start + t + KVF_PREFETCH < len) { /* slots are scattered: fetch ahead */
                int64_t ahead = (int64_t)slots[start + t + KVF_PREFETCH] * kv_st + kv_off;
                int bytes = is_bf16 ? 2 : 4;
                for (int b = 0; b < dim * bytes; b += 64) {
                    __builtin_prefetch((const char *)k + ahead * bytes + b);
                    __builtin_prefetch((const char *)v + ahead * bytes + b);
                }
            }
            for (int g = 0; g < group; g++)
                s[g][t] = is_bf16 ? dot_bf16(qf[g], (const uint16_t *)k + at, dim)
                                  : dot_f32(qf[g], (const float *)k + at, dim);
        }
        for (int g = 0; g < group; g++) {
            float top = s[g][0];
            for (int t = 1; t < count; t++) top = s[g][t] > top ? s[g][t] : top;
            float next = top > m[g] ? top : m[g];
            float keep = m[g] == -FLT_MAX ? 0.0f : expf(m[g] - next);
            float sum = 0.0f;
            for (int t = 0; t < count; t++) {
                s[g][t] = expf(s[g][t] - next);
                sum += s[g][t];
            }
            l[g] = l[g] * keep + sum;
            m[g] = next;
            for (int d = 0; d < dim; d++) acc[g][d] *= keep;
        }
        for (int t = 0; t < count; t++) {
            int64_t at = (int64_t)slots[start + t] * kv_st + kv_off;
            for (int g = 0; g < group; g++) {
                if (is_bf16)
                    axpy_bf16(acc[g], s[g][t], (const uint16_t *)v + at, dim);
                else
                    axpy_f32(acc[g], s[g][t], (const float *)v + at, dim);
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        int64_t at = o_row + g * o_sh;
        for (int d = 0; d < dim; d++) {
            float x = acc[g][d] * inv;
            if (is_bf16)
                ((uint16_t *)out)[at + d] = f32_to_bf16(x);
            else
                ((float *)out)[at + d] = x;
        }
    }
}

/* q [n, heads, dim] (strides q_st, q_sh); k, v: one layer's pool [slots, kv_heads, dim]
 * (strides kv_st, kv_sh); table: request-to-token rows (stride table_st); rows[i] and
 * visible[i]: query row i's table row and how many of its slots it sees; out like q. */
void kvflow_paged_attention(const void *q, int64_t q_st, int64_t q_sh, const void *k,
                            const void *v, int64_t kv_st, int64_t kv_sh, const int32_t *table,
                            int64_t table_st, const int64_t *rows, const int64_t *visible,
                            void *out, int64_t o_st, int64_t o_sh, int64_t n, int heads,
                            int kv_heads, int dim, float scale, int is_bf16) {
    int group = heads / kv_heads;
    int64_t items = n * kv_heads;
#pragma omp parallel for schedule(dynamic, 2)
    for (int64_t item = 0; item < items; item++) {
        int64_t i = item / kv_heads;
        int h = (int)(item % kv_heads);
        attend_item(q, i * q_st + (int64_t)h * group * q_sh, k, v, kv_st, (int64_t)h * kv_sh,
                    table + rows[i] * table_st, visible[i], out,
                    i * o_st + (int64_t)h * group * o_sh, q_sh, o_sh, group, dim, scale,
                    is_bf16);
    }
}
