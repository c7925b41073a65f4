/* Paged attention on CPU: each query row attends to the first `visible` KV slots of its row
 * of the request-to-token table, reading K and V in place from the paged pool.
 *
 * One work item per query row (all its heads, so each token's K/V row is read contiguously)
 * or, with few rows, per (query row, KV head). A block of tokens at a time, each KV head's
 * rows are loaded (converted to float32 once) and shared by the query heads of its group;
 * scores fold into an online softmax (float32 inside, whatever the storage type), so nothing
 * context-sized is ever materialized. Items run in parallel under OpenMP; built against the same libgomp as torch,
 * they share its thread pool and thread count.
 *
 * Where the compiler targets AVX512-BF16, bfloat16 scores come straight from the stored rows
 * with vdpbf16ps (products summed in float32; the scale applied after), no conversion.
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

#include "bf16.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define KVF_DPBF16 1 /* scores straight from bf16 rows with vdpbf16ps (dim % 32 == 0) */
#else
#define KVF_DPBF16 0
#endif

#define KVF_MAX_DIM 256
#define KVF_MAX_QHEADS 32 /* query heads one work item holds */
#define KVF_BLOCK 32
#define KVF_PREFETCH 24

/* Rows `slots[0..count)` of one KV head of a pool as float32 rows of `dim` in `dst`
 * (converted from bfloat16 once, for every query head of the group). While row t loads,
 * the rows `KVF_PREFETCH` slots ahead in `ahead` (up to `ahead_count`) are fetched. */
static inline __attribute__((always_inline)) void load_block(
    const void *pool, const int32_t *slots, int count, int64_t kv_st, int64_t head_off,
    int dim, float (*dst)[KVF_MAX_DIM], const void *ahead, int64_t ahead_count,
    int64_t ahead_bytes, const int is_bf16) {
    int bytes = is_bf16 ? 2 : 4;
    for (int t = 0; t < count; t++) {
        if (ahead && t + KVF_PREFETCH < ahead_count) {
            const char *row = (const char *)ahead + ((int64_t)slots[t + KVF_PREFETCH] * kv_st + head_off) * bytes;
            for (int64_t b = 0; b < ahead_bytes; b += 64) __builtin_prefetch(row + b);
        }
        int64_t at = (int64_t)slots[t] * kv_st + head_off;
        if (is_bf16) {
            const uint16_t *src = (const uint16_t *)pool + at;
            for (int d = 0; d < dim; d++) dst[t][d] = bf16_to_f32(src[d]);
        } else {
            memcpy(dst[t], (const float *)pool + at, (size_t)dim * sizeof(float));
        }
        for (int d = dim; d % 16; d++) dst[t][d] = 0.0f; /* vector tail (dim % 16 != 0) */
    }
}

typedef float kvf_v16 __attribute__((vector_size(64)));

/* acc[0..dim) += sum over t of p[t] * rows[t][0..dim), sixteen lanes at a time held in a
 * vector register across the tokens (the accumulator is read and written once per block).
 * Rows are 64-byte aligned and zero-padded to a multiple of 16 (the padding lanes of acc
 * hold junk that is never written out). */
static inline void accumulate(float *restrict acc, const float *restrict p, int count,
                              float (*rows)[KVF_MAX_DIM], int dim) {
    for (int d = 0; d < dim; d += 16) {
        kvf_v16 lanes = *(kvf_v16 *)(acc + d);
        for (int t = 0; t < count; t++) lanes += p[t] * *(const kvf_v16 *)(rows[t] + d);
        *(kvf_v16 *)(acc + d) = lanes;
    }
}

/* scores[t] = q . rows[t] for t < count; same layout as accumulate (q zero-padded too). */
static inline void score_block(const float *restrict q, float (*rows)[KVF_MAX_DIM], int count,
                               int dim, float *restrict scores) {
    for (int t = 0; t < count; t++) {
        kvf_v16 sum = *(const kvf_v16 *)q * *(const kvf_v16 *)rows[t];
        for (int d = 16; d < dim; d += 16)
            sum += *(const kvf_v16 *)(q + d) * *(const kvf_v16 *)(rows[t] + d);
        float total = 0.0f;
        for (int j = 0; j < 16; j++) total += sum[j];
        scores[t] = total;
    }
}

#if KVF_DPBF16
/* scores[t] = scale * (q . row t) for bf16 q and pool rows, products summed in float32 by
 * vdpbf16ps (32 elements per instruction, no conversion of the rows); prefetches the rows
 * KVF_PREFETCH ahead (every KV head of them, K and V) when `fetch` is set. */
static inline void score_block_bf16(const uint16_t *const *qs, int nq, const uint16_t *pool,
                                    const void *v, const int32_t *slots, int count,
                                    int64_t kv_st, int64_t head_off, int dim, float scale,
                                    int fetch, int64_t ahead_count, int64_t span,
                                    float (*scores)[KVF_BLOCK]) {
    for (int t = 0; t < count; t++) {
        if (fetch && t + KVF_PREFETCH < ahead_count) {
            int64_t ahead = ((int64_t)slots[t + KVF_PREFETCH] * kv_st + head_off) * 2;
            for (int64_t b = 0; b < span; b += 64) {
                __builtin_prefetch((const char *)pool + ahead + b);
                __builtin_prefetch((const char *)v + ahead + b);
            }
        }
        const uint16_t *row = pool + (int64_t)slots[t] * kv_st + head_off;
        for (int g = 0; g < nq; g++) {
            __m512 acc = _mm512_setzero_ps();
            for (int d = 0; d < dim; d += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qs[g] + d),
                                       (__m512bh)_mm512_loadu_si512(row + d));
            scores[g][t] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
}
#endif

/* Query row `q_row`'s heads of KV heads kv_first .. kv_first + kv_count - 1 (group query
 * heads each) over `len` slots, a block of tokens at a time: the block's K rows of one KV
 * head are loaded (and converted) once and scored against the group's query heads, the
 * online softmax is updated, then the V rows are folded in the same way. */
static inline __attribute__((always_inline)) void attend_item(
    const void *q, int64_t q_row, int64_t q_sh, const void *k, const void *v, int64_t kv_st,
    int64_t kv_sh, int kv_first, int kv_count, const int32_t *slots, int64_t len, void *out,
    int64_t o_row, int64_t o_sh, int group, int dim, float scale, const int is_bf16) {
    float qf[KVF_MAX_QHEADS][KVF_MAX_DIM] __attribute__((aligned(64)));
    float acc[KVF_MAX_QHEADS][KVF_MAX_DIM] __attribute__((aligned(64)));
    float s[KVF_MAX_QHEADS][KVF_BLOCK];
    float rows[KVF_BLOCK][KVF_MAX_DIM] __attribute__((aligned(64)));
    float m[KVF_MAX_QHEADS], l[KVF_MAX_QHEADS];
    int qheads = kv_count * group;
    int64_t q_first = (int64_t)kv_first * group;
    int bytes = is_bf16 ? 2 : 4;
    /* the first KV head's pass fetches every head of the rows ahead, K and V */
    int64_t span = ((int64_t)(kv_count - 1) * kv_sh + dim) * bytes;

    for (int g = 0; g < qheads; g++) {
        int64_t at = q_row + (q_first + g) * q_sh;
        for (int d = 0; d < dim; d++) {
            float x = is_bf16 ? bf16_to_f32(((const uint16_t *)q)[at + d]) : ((const float *)q)[at + d];
            qf[g][d] = x * scale;
            acc[g][d] = 0.0f;
        }
        for (int d = dim; d % 16; d++) qf[g][d] = acc[g][d] = 0.0f;
        m[g] = -FLT_MAX;
        l[g] = 0.0f;
    }
    for (int64_t start = 0; start < len; start += KVF_BLOCK) {
        int count = (int)(len - start < KVF_BLOCK ? len - start : KVF_BLOCK);
        const int32_t *block = slots + start;
        int64_t first_off = (int64_t)kv_first * kv_sh;
        for (int h = 0; h < kv_count; h++) {
#if KVF_DPBF16
            if (is_bf16 && dim % 32 == 0) {
                const uint16_t *qs[KVF_MAX_QHEADS];
                for (int g = 0; g < group; g++)
                    qs[g] = (const uint16_t *)q + q_row + (q_first + h * group + g) * q_sh;
                score_block_bf16(qs, group, (const uint16_t *)k, v, block, count, kv_st,
                                 first_off + (int64_t)h * kv_sh, dim, scale, h == 0,
                                 len - start, span, s + h * group);
                continue;
            }
#endif
            load_block(k, block, count, kv_st, first_off + (int64_t)h * kv_sh, dim, rows,
                       h == 0 ? k : NULL, len - start, span, is_bf16);
            for (int g = h * group; g < (h + 1) * group; g++)
                score_block(qf[g], rows, count, dim, s[g]);
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
        for (int h = 0; h < kv_count; h++) {
            load_block(v, block, count, kv_st, first_off + (int64_t)h * kv_sh, dim, rows,
                       h == 0 ? v : NULL, len - start, span, is_bf16);
            for (int g = h * group; g < (h + 1) * group; g++) accumulate(acc[g], s[g], count, rows, dim);
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
        const int32_t *slots = table + rows[i] * table_st;
        if (is_bf16)
            attend_item(q, i * q_st, q_sh, k, v, kv_st, kv_sh, first, per_item, slots,
                        visible[i], out, i * o_st, o_sh, group, dim, scale, 1);
        else
            attend_item(q, i * q_st, q_sh, k, v, kv_st, kv_sh, first, per_item, slots,
                        visible[i], out, i * o_st, o_sh, group, dim, scale, 0);
    }
}
