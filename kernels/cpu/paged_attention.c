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
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define KVF_MAX_DIM 256
#define KVF_MAX_QHEADS 32 /* query heads one work item holds */
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

/* Row `at` of a pool as float32: a pointer into the pool for float32 storage, else the row
 * converted into `buf` (once, for every query head of the group that reads it). */
static inline const float *kvf_row(const void *pool, int64_t at, int dim, int is_bf16,
                                   float *restrict buf) {
    if (!is_bf16) return (const float *)pool + at;
    const uint16_t *src = (const uint16_t *)pool + at;
    for (int d = 0; d < dim; d++) buf[d] = bf16_to_f32(src[d]);
    return buf;
}

static inline void axpy_f32(float *restrict acc, float p, const float *restrict v, int dim) {
    for (int d = 0; d < dim; d++) acc[d] += p * v[d];
}


/* Query row `q_row`'s heads of KV heads kv_first .. kv_first + kv_count - 1 (group query
 * heads each) over `len` slots. Reading every KV head of a token together keeps the reads of
 * one token row contiguous. */
static void attend_item(const void *q, int64_t q_row, int64_t q_sh, const void *k,
                        const void *v, int64_t kv_st, int64_t kv_sh, int kv_first,
                        int kv_count, const int32_t *slots, int64_t len, void *out,
                        int64_t o_row, int64_t o_sh, int group, int dim, float scale,
                        int is_bf16) {
    float qf[KVF_MAX_QHEADS][KVF_MAX_DIM];
    float acc[KVF_MAX_QHEADS][KVF_MAX_DIM];
    float s[KVF_MAX_QHEADS][KVF_BLOCK];
    float m[KVF_MAX_QHEADS], l[KVF_MAX_QHEADS];
    float kf[KVF_MAX_DIM];
    int qheads = kv_count * group;
    int64_t q_first = (int64_t)kv_first * group;
    int bytes = is_bf16 ? 2 : 4;
    int64_t row_bytes = ((int64_t)(kv_count - 1) * kv_sh + dim) * bytes;

    for (int g = 0; g < qheads; g++) {
        int64_t at = q_row + (q_first + g) * q_sh;
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
            int64_t base = (int64_t)slots[start + t] * kv_st + (int64_t)kv_first * kv_sh;
            if (start + t + KVF_PREFETCH < len) { /* slots may be scattered: fetch ahead */
                int64_t ahead =
                    ((int64_t)slots[start + t + KVF_PREFETCH] * kv_st + (int64_t)kv_first * kv_sh) * bytes;
                for (int64_t b = 0; b < row_bytes; b += 64) {
                    __builtin_prefetch((const char *)k + ahead + b);
                    __builtin_prefetch((const char *)v + ahead + b);
                }
            }
            for (int h = 0; h < kv_count; h++) { /* one K row feeds its group's heads */
                const float *row = kvf_row(k, base + (int64_t)h * kv_sh, dim, is_bf16, kf);
                for (int g = h * group; g < (h + 1) * group; g++) s[g][t] = dot_f32(qf[g], row, dim);
            }
        }
        for (int g = 0; g < qheads; g++) {
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
            int64_t base = (int64_t)slots[start + t] * kv_st + (int64_t)kv_first * kv_sh;
            for (int h = 0; h < kv_count; h++) {
                const float *row = kvf_row(v, base + (int64_t)h * kv_sh, dim, is_bf16, kf);
                for (int g = h * group; g < (h + 1) * group; g++) axpy_f32(acc[g], s[g][t], row, dim);
            }
        }
    }
    for (int g = 0; g < qheads; g++) {
        float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        int64_t at = o_row + (q_first + g) * o_sh;
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
    /* One item per row (every head: contiguous token rows) when rows alone keep the threads
     * busy and the row's heads fit the item's buffers; else one per (row, KV head). */
    int whole = n >= 4 * omp_get_max_threads() && heads <= KVF_MAX_QHEADS;
    int per_item = whole ? kv_heads : 1;
    int64_t items = n * (kv_heads / per_item);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; item++) {
        int64_t i = item / (kv_heads / per_item);
        int first = (int)(item % (kv_heads / per_item)) * per_item;
        attend_item(q, i * q_st, q_sh, k, v, kv_st, kv_sh, first, per_item,
                    table + rows[i] * table_st, visible[i], out, i * o_st, o_sh, group, dim,
                    scale, is_bf16);
    }
}
