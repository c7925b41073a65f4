/* Paged attention on CPU: each query row attends to the first `visible` KV slots of its row
 * of the request-to-token table, reading K and V in place from the paged pool; with a sliding
 * `window` (> 0), only to the last `window` of them, and the slots before are never read.
 *
 * Decode rows: one work item per query row (all its heads, so each token's K/V row is read
 * contiguously) or, with few rows, per (query row, KV head). Extend rows (consecutive rows of
 * one request, each seeing one slot more): tiles of rows per KV head, so each block of K/V
 * serves the whole tile. A block of tokens at a time, each KV head's rows are loaded
 * (converted to float32 once) and shared by the query vectors of its group; scores fold into
 * an online softmax (float32 inside, whatever the storage type), so nothing context-sized is
 * ever materialized. Items run in parallel on the kernels' pool (pool.h), one at a time as
 * threads come free.
 *
 * Rows ahead are prefetched into L2 (prefetcht2), not L1: with every KV head of K and V
 * fetched 24 tokens ahead, L1-bound prefetches ran out of miss buffers (30 layers of decode
 * at batch 32, KV cold: 17.7-20.8 -> 12.5-14.6 ms).
 *
 * Where the compiler targets AVX512-BF16, bfloat16 scores come straight from the stored rows
 * with vdpbf16ps (products summed in float32; the scale applied after), no conversion.
 *
 * Strides are in elements; the head dimension must be contiguous. Storage: float32 or
 * bfloat16 (is_bf16), the same for q and out; the pool is float32, bfloat16 or FP8 (an FP8
 * KV cache): FP8 bytes are read through `kv_lut` (the 256 float32 values of the format,
 * built by the wrapper from torch's own conversion) and multiplied by the layer's `k_scale`
 * / `v_scale` as each row is loaded, so the float32 math sees exactly `fp8 * scale`. Contract
 * and limits are checked by the Python wrapper (kvflow/kernels/cpu/paged_attention.py).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "pool.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define KVF_DPBF16 1 /* scores straight from bf16 rows with vdpbf16ps (dim % 32 == 0) */
#else
#define KVF_DPBF16 0
#endif

#define KVF_MAX_DIM 256
#define KVF_MAX_VECS 32 /* query vectors (rows x heads) one work item holds */
#define KVF_BLOCK 32
#define KVF_PREFETCH 24
/* the pool's storage (kv_kind): float32, bfloat16, or FP8 read through a lookup table */
#define KVF_KV_F32 0
#define KVF_KV_BF16 1
#define KVF_KV_FP8 2

static inline int kv_bytes(int kv_kind) { return kv_kind == KVF_KV_F32 ? 4 : kv_kind == KVF_KV_BF16 ? 2 : 1; }

/* Rows `slots[0..count)` of one KV head of a pool as float32 rows of `dim` in `dst` (row
 * stride `ds`, a multiple of 16; converted from bfloat16 or FP8 (times `kv_scale`) once, for
 * every query vector of the head). While row t loads, the rows `KVF_PREFETCH` slots ahead
 * in `ahead` (up to `ahead_count`) are fetched. */
static inline __attribute__((always_inline)) void load_block(
    const void *pool, const int32_t *slots, int count, int64_t kv_st, int64_t head_off,
    int dim, int ds, float *dst, const void *ahead, int64_t ahead_count, int64_t ahead_bytes,
    const int kv_kind, const float *lut, float kv_scale) {
    int bytes = kv_bytes(kv_kind);
    for (int t = 0; t < count; t++) {
        if (ahead && t + KVF_PREFETCH < ahead_count) {
            const char *row = (const char *)ahead + ((int64_t)slots[t + KVF_PREFETCH] * kv_st + head_off) * bytes;
            for (int64_t b = 0; b < ahead_bytes; b += 64) __builtin_prefetch(row + b, 0, 1);
        }
        int64_t at = (int64_t)slots[t] * kv_st + head_off;
        float *row = dst + (int64_t)t * ds;
        if (kv_kind == KVF_KV_FP8) {
            const uint8_t *src = (const uint8_t *)pool + at;
            for (int d = 0; d < dim; d++) row[d] = lut[src[d]] * kv_scale;
        } else if (kv_kind == KVF_KV_BF16) {
            const uint16_t *src = (const uint16_t *)pool + at;
            for (int d = 0; d < dim; d++) row[d] = bf16_to_f32(src[d]);
        } else {
            memcpy(row, (const float *)pool + at, (size_t)dim * sizeof(float));
        }
        for (int d = dim; d < ds; d++) row[d] = 0.0f; /* vector tail (dim % 16 != 0) */
    }
}

typedef float kvf_v16 __attribute__((vector_size(64)));

/* acc[0..ds) += sum over t of p[t] * row t. Sixteen lanes per register, four registers
 * (64 elements) at a time held across the tokens, so the four chains of adds overlap and
 * each accumulator is read and written once per block. Rows (stride ds, a multiple of 16)
 * are 64-byte aligned and zero-padded to ds (the padding lanes of acc hold junk that is
 * never written out). */
static inline void accumulate(float *restrict acc, const float *restrict p, int count,
                              const float *restrict rows, int ds) {
    int d = 0;
    for (; d + 64 <= ds; d += 64) {
        kvf_v16 a0 = *(kvf_v16 *)(acc + d), a1 = *(kvf_v16 *)(acc + d + 16);
        kvf_v16 a2 = *(kvf_v16 *)(acc + d + 32), a3 = *(kvf_v16 *)(acc + d + 48);
        for (int t = 0; t < count; t++) {
            const float *row = rows + t * ds + d;
            a0 += p[t] * *(const kvf_v16 *)row;
            a1 += p[t] * *(const kvf_v16 *)(row + 16);
            a2 += p[t] * *(const kvf_v16 *)(row + 32);
            a3 += p[t] * *(const kvf_v16 *)(row + 48);
        }
        *(kvf_v16 *)(acc + d) = a0, *(kvf_v16 *)(acc + d + 16) = a1;
        *(kvf_v16 *)(acc + d + 32) = a2, *(kvf_v16 *)(acc + d + 48) = a3;
    }
    for (; d < ds; d += 16) {
        kvf_v16 lanes = *(kvf_v16 *)(acc + d);
        for (int t = 0; t < count; t++) lanes += p[t] * *(const kvf_v16 *)(rows + t * ds + d);
        *(kvf_v16 *)(acc + d) = lanes;
    }
}

/* scores[t] = q . row t for t < count; same layout as accumulate (q zero-padded too). */
static inline void score_block(const float *restrict q, const float *restrict rows, int ds,
                               int count, int dim, float *restrict scores) {
    for (int t = 0; t < count; t++) {
        const float *row = rows + t * ds;
        kvf_v16 sum = *(const kvf_v16 *)q * *(const kvf_v16 *)row;
        for (int d = 16; d < dim; d += 16) sum += *(const kvf_v16 *)(q + d) * *(const kvf_v16 *)(row + d);
        float total = 0.0f;
        for (int j = 0; j < 16; j++) total += sum[j];
        scores[t] = total;
    }
}

/* A block's K rows of one KV head transposed, kt[d * KVF_BLOCK + t] = row t's element d as
 * float32, for scoring a tile (lanes over tokens: no horizontal sums); lanes past `count` are
 * zero. */
static inline __attribute__((always_inline)) void load_block_t(
    const void *pool, const int32_t *slots, int count, int64_t kv_st, int64_t head_off,
    int dim, float *restrict kt, const int kv_kind, const float *lut, float kv_scale) {
    for (int t = 0; t < count; t++) {
        int64_t at = (int64_t)slots[t] * kv_st + head_off;
        if (kv_kind == KVF_KV_FP8) {
            const uint8_t *src = (const uint8_t *)pool + at;
            for (int d = 0; d < dim; d++) kt[d * KVF_BLOCK + t] = lut[src[d]] * kv_scale;
        } else if (kv_kind == KVF_KV_BF16) {
            const uint16_t *src = (const uint16_t *)pool + at;
            for (int d = 0; d < dim; d++) kt[d * KVF_BLOCK + t] = bf16_to_f32(src[d]);
        } else {
            const float *src = (const float *)pool + at;
            for (int d = 0; d < dim; d++) kt[d * KVF_BLOCK + t] = src[d];
        }
    }
    for (int t = count; t < KVF_BLOCK; t++)
        for (int d = 0; d < dim; d++) kt[d * KVF_BLOCK + t] = 0.0f;
}

/* scores[vecs[i]][t] = (query vector vecs[i]) . (row t) for a transposed block, every t of the
 * block (the caller reads only the slots each vector sees). Four vectors at a time share
 * each load of kt; each holds 32 token lanes in two registers. */
static inline void score_tile(const float *restrict qf, int ds, const int *vecs, int nv,
                              const float *restrict kt, int dim, float (*scores)[KVF_BLOCK]) {
    for (int i = 0; i < nv; i += 4) {
        const float *q0 = qf + vecs[i] * ds;
        const float *q1 = qf + vecs[i + 1 < nv ? i + 1 : i] * ds;
        const float *q2 = qf + vecs[i + 2 < nv ? i + 2 : i] * ds;
        const float *q3 = qf + vecs[i + 3 < nv ? i + 3 : i] * ds;
        kvf_v16 lo0 = {0}, hi0 = {0}, lo1 = {0}, hi1 = {0}, lo2 = {0}, hi2 = {0}, lo3 = {0}, hi3 = {0};
        for (int d = 0; d < dim; d++) {
            kvf_v16 lo = *(const kvf_v16 *)(kt + d * KVF_BLOCK);
            kvf_v16 hi = *(const kvf_v16 *)(kt + d * KVF_BLOCK + 16);
            lo0 += q0[d] * lo, hi0 += q0[d] * hi;
            lo1 += q1[d] * lo, hi1 += q1[d] * hi;
            lo2 += q2[d] * lo, hi2 += q2[d] * hi;
            lo3 += q3[d] * lo, hi3 += q3[d] * hi;
        }
        kvf_v16 out[8] = {lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3};
        for (int u = 0; u < 4 && i + u < nv; u++) {
            *(kvf_v16 *)scores[vecs[i + u]] = out[2 * u];
            *(kvf_v16 *)(scores[vecs[i + u]] + 16) = out[2 * u + 1];
        }
    }
}

#if KVF_DPBF16
/* A block's bf16 K rows of one KV head transposed in pairs: kt2[i * KVF_BLOCK + t] = elements
 * 2i and 2i + 1 of row t (the vdpbf16ps operand layout, lanes over tokens); lanes past
 * `count` are zero. */
static inline void load_block_t_bf16(const uint16_t *pool, const int32_t *slots, int count,
                                     int64_t kv_st, int64_t head_off, int dim,
                                     uint32_t *restrict kt2) {
    for (int t = 0; t < count; t++) {
        const uint16_t *src = pool + (int64_t)slots[t] * kv_st + head_off;
        for (int i = 0; i < dim / 2; i++) {
            uint32_t pair;
            memcpy(&pair, src + 2 * i, sizeof pair);
            kt2[i * KVF_BLOCK + t] = pair;
        }
    }
    for (int t = count; t < KVF_BLOCK; t++)
        for (int i = 0; i < dim / 2; i++) kt2[i * KVF_BLOCK + t] = 0;
}

/* scores[vecs[u]][t] = scale * (q vector u . row t) for bf16 q rows `qs` and a pair-transposed
 * block, products summed in float32 by vdpbf16ps (as the one-row path): four vectors at a
 * time share each load of kt2. */
static inline void score_tile_bf16(const uint16_t *const *qs, const int *vecs, int nv,
                                   const uint32_t *restrict kt2, int dim, float scale,
                                   float (*scores)[KVF_BLOCK]) {
    for (int i = 0; i < nv; i += 4) {
        const uint16_t *q[4];
        for (int u = 0; u < 4; u++) q[u] = qs[i + u < nv ? i + u : i];
        __m512 lo[4], hi[4];
        for (int u = 0; u < 4; u++) lo[u] = hi[u] = _mm512_setzero_ps();
        for (int p = 0; p < dim / 2; p++) {
            __m512bh klo = (__m512bh)_mm512_load_si512(kt2 + p * KVF_BLOCK);
            __m512bh khi = (__m512bh)_mm512_load_si512(kt2 + p * KVF_BLOCK + 16);
            for (int u = 0; u < 4; u++) {
                uint32_t pair;
                memcpy(&pair, q[u] + 2 * p, sizeof pair);
                __m512bh qp = (__m512bh)_mm512_set1_epi32((int32_t)pair);
                lo[u] = _mm512_dpbf16_ps(lo[u], qp, klo);
                hi[u] = _mm512_dpbf16_ps(hi[u], qp, khi);
            }
        }
        __m512 sc = _mm512_set1_ps(scale);
        for (int u = 0; u < 4 && i + u < nv; u++) {
            _mm512_storeu_ps(scores[vecs[i + u]], _mm512_mul_ps(lo[u], sc));
            _mm512_storeu_ps(scores[vecs[i + u]] + 16, _mm512_mul_ps(hi[u], sc));
        }
    }
}
#endif

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
                __builtin_prefetch((const char *)pool + ahead + b, 0, 1);
                __builtin_prefetch((const char *)v + ahead + b, 0, 1);
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

/* One work item: the query rows of a tile (consecutive rows of one request, row j seeing
 * `limit[j]` slots, rising) for KV heads kv_first .. kv_first + kv_count - 1, over the tile's
 * longest view, a block of tokens at a time. With a `window` (> 0), row j sees only slots
 * limit[j] - window .. limit[j] - 1: the blocks start at the first row's first slot, and a
 * row's slots before its own window (`skip`) get weight 0 (no infinities: the kernels are
 * built with -ffinite-math-only). Each KV head's K rows of a block are loaded
 * (and converted) once and scored against every query vector of that head in the tile (rows
 * x group); a row whose view ends inside the block scores only its part and one whose view
 * ended before skips the block. The online softmax is updated, then the V rows are folded in
 * the same way. Buffers are laid out with a row stride of `ds` floats (dim rounded up to 16):
 * compact, so a block's rows do not fight over the same cache sets. */
static inline __attribute__((always_inline)) void attend_tile(
    const void *q, const int64_t *q_rows, const int64_t *limit, int nt, int64_t q_sh,
    const void *k, const void *v, int64_t kv_st, int64_t kv_sh, int kv_first, int kv_count,
    const int32_t *slots, void *out, const int64_t *o_rows, int64_t o_sh, int group, int dim,
    float scale, int64_t window, float cap, const int is_bf16, const int kv_kind,
    const float *lut, float k_scale, float v_scale) {
    float qf[KVF_MAX_VECS * KVF_MAX_DIM] __attribute__((aligned(64)));
    float acc[KVF_MAX_VECS * KVF_MAX_DIM] __attribute__((aligned(64)));
    float rows[KVF_BLOCK * KVF_MAX_DIM] __attribute__((aligned(64)));
    float kt[KVF_MAX_DIM * KVF_BLOCK] __attribute__((aligned(64)));
    float s[KVF_MAX_VECS][KVF_BLOCK] __attribute__((aligned(64)));
    float m[KVF_MAX_VECS], l[KVF_MAX_VECS];
    int seen[KVF_MAX_VECS]; /* slots of the current block each vector sees (0: skips it) */
    int skip[KVF_MAX_VECS]; /* of those, the first ones before its window (weight 0) */
    const int ds = (dim + 15) & ~15;
    const int per_row = kv_count * group; /* vectors per query row: row j, head h, member g */
    const int nv = nt * per_row;
    const int64_t q_first = (int64_t)kv_first * group;
    const int64_t len = limit[nt - 1];
    const int64_t begin = window > 0 && limit[0] > window ? limit[0] - window : 0;
    const int bytes = kv_bytes(kv_kind);
    /* the bf16 dot-product paths read bf16 rows of q and of the pool alike */
    const int dp_bf16 = is_bf16 && kv_kind == KVF_KV_BF16;
    /* the first KV head's pass fetches every head of the rows ahead, K and V */
    const int64_t span = ((int64_t)(kv_count - 1) * kv_sh + dim) * bytes;

    for (int vec = 0; vec < nv; vec++) {
        int64_t at = q_rows[vec / per_row] + (q_first + vec % per_row) * q_sh;
        float *qv = qf + vec * ds, *av = acc + vec * ds;
        for (int d = 0; d < dim; d++) {
            float x = is_bf16 ? bf16_to_f32(((const uint16_t *)q)[at + d]) : ((const float *)q)[at + d];
            qv[d] = x * scale;
            av[d] = 0.0f;
        }
        for (int d = dim; d < ds; d++) qv[d] = av[d] = 0.0f;
        m[vec] = -FLT_MAX;
        l[vec] = 0.0f;
    }
    for (int64_t start = begin; start < len; start += KVF_BLOCK) {
        int count = (int)(len - start < KVF_BLOCK ? len - start : KVF_BLOCK);
        const int32_t *block = slots + start;
        int64_t first_off = (int64_t)kv_first * kv_sh;
        for (int vec = 0; vec < nv; vec++) {
            int64_t left = limit[vec / per_row] - start;
            int64_t before = window > 0 ? limit[vec / per_row] - window - start : 0;
            seen[vec] = left <= 0 ? 0 : left < count ? (int)left : count;
            skip[vec] = before <= 0 ? 0 : (int)before;
            if (skip[vec] >= seen[vec]) seen[vec] = skip[vec] = 0; /* all before its window */
        }
        for (int h = 0; h < kv_count; h++) {
            if (nt > 1) { /* a tile: transpose the block once for all its vectors */
                int vecs[KVF_MAX_VECS], nv_h = 0;
                for (int j = 0; j < nt; j++)
                    for (int vec = j * per_row + h * group; vec < j * per_row + (h + 1) * group; vec++)
                        if (seen[vec]) vecs[nv_h++] = vec;
#if KVF_DPBF16
                if (dp_bf16 && dim % 2 == 0) { /* whole pairs */
                    const uint16_t *qs[KVF_MAX_VECS];
                    for (int u = 0; u < nv_h; u++)
                        qs[u] = (const uint16_t *)q + q_rows[vecs[u] / per_row] +
                                (q_first + vecs[u] % per_row) * q_sh;
                    load_block_t_bf16((const uint16_t *)k, block, count, kv_st,
                                      first_off + (int64_t)h * kv_sh, dim, (uint32_t *)kt);
                    score_tile_bf16(qs, vecs, nv_h, (const uint32_t *)kt, dim, scale, s);
                    continue;
                }
#endif
                load_block_t(k, block, count, kv_st, first_off + (int64_t)h * kv_sh, dim, kt,
                             kv_kind, lut, k_scale);
                score_tile(qf, ds, vecs, nv_h, kt, dim, s);
                continue;
            }
#if KVF_DPBF16
            if (dp_bf16 && dim % 32 == 0) {
                for (int j = 0; j < nt; j++) {
                    int first = j * per_row + h * group;
                    if (!seen[first]) continue;
                    const uint16_t *qs[KVF_MAX_VECS];
                    for (int g = 0; g < group; g++)
                        qs[g] = (const uint16_t *)q + q_rows[j] + (q_first + h * group + g) * q_sh;
                    score_block_bf16(qs, group, (const uint16_t *)k, v, block, seen[first],
                                     kv_st, first_off + (int64_t)h * kv_sh, dim, scale,
                                     h == 0 && j == nt - 1, len - start, span, s + first);
                }
                continue;
            }
#endif
            load_block(k, block, count, kv_st, first_off + (int64_t)h * kv_sh, dim, ds, rows,
                       h == 0 ? k : NULL, len - start, span, kv_kind, lut, k_scale);
            for (int j = 0; j < nt; j++)
                for (int vec = j * per_row + h * group; vec < j * per_row + (h + 1) * group; vec++)
                    if (seen[vec]) score_block(qf + vec * ds, rows, ds, seen[vec], dim, s[vec]);
        }
        for (int vec = 0; vec < nv; vec++) {
            int c = seen[vec], b = skip[vec];
            if (!c) continue;
            if (cap > 0.0f) /* soft-capping (Gemma 2) of the scaled scores */
                for (int t = b; t < c; t++) s[vec][t] = cap * tanhf(s[vec][t] / cap);
            float top = s[vec][b];
            for (int t = b + 1; t < c; t++) top = s[vec][t] > top ? s[vec][t] : top;
            float next = top > m[vec] ? top : m[vec];
            float keep = m[vec] == -FLT_MAX ? 0.0f : expf(m[vec] - next);
            float sum = 0.0f;
            for (int t = 0; t < b; t++) s[vec][t] = 0.0f; /* before its window: weight 0 */
            for (int t = b; t < c; t++) {
                s[vec][t] = expf(s[vec][t] - next);
                sum += s[vec][t];
            }
            l[vec] = l[vec] * keep + sum;
            m[vec] = next;
            float *av = acc + vec * ds;
            for (int d = 0; d < dim; d++) av[d] *= keep;
        }
        for (int h = 0; h < kv_count; h++) {
            load_block(v, block, count, kv_st, first_off + (int64_t)h * kv_sh, dim, ds, rows,
                       h == 0 ? v : NULL, len - start, span, kv_kind, lut, v_scale);
            for (int j = 0; j < nt; j++)
                for (int vec = j * per_row + h * group; vec < j * per_row + (h + 1) * group; vec++)
                    if (seen[vec]) accumulate(acc + vec * ds, s[vec], seen[vec], rows, ds);
        }
    }
    for (int vec = 0; vec < nv; vec++) {
        float inv = l[vec] > 0.0f ? 1.0f / l[vec] : 0.0f;
        int64_t at = o_rows[vec / per_row] + (q_first + vec % per_row) * o_sh;
        const float *av = acc + vec * ds;
        for (int d = 0; d < dim; d++) {
            float x = av[d] * inv;
            if (is_bf16)
                ((uint16_t *)out)[at + d] = f32_to_bf16(x);
            else
                ((float *)out)[at + d] = x;
        }
    }
}

/* Whether query row i continues row i - 1's tile: the same table row, one more slot seen
 * (the next token of an extend). */
static inline int continues(const int64_t *rows, const int64_t *visible, int64_t i) {
    return i > 0 && rows[i] == rows[i - 1] && visible[i] == visible[i - 1] + 1;
}

struct attention_args {
    const void *q, *k, *v;
    const int32_t *table;
    const int64_t *rows, *visible;
    void *out;
    const int64_t *tile_first;
    int64_t q_st, q_sh, kv_st, kv_sh, table_st, o_st, o_sh, per_tile, window;
    int per_item, group, dim, is_bf16;
    float scale, cap;
    int kv_kind;
    const float *kv_lut;
    float k_scale, v_scale;
};

/* Work items [lo, hi): item i is KV heads (i % per_tile) * per_item .. + per_item - 1 of
 * tile i / per_tile. */
static void attention_items(void *ctx, int64_t lo, int64_t hi) {
    const struct attention_args *a = ctx;
    const int64_t q_st = a->q_st, q_sh = a->q_sh, kv_st = a->kv_st, kv_sh = a->kv_sh;
    const int64_t o_st = a->o_st, o_sh = a->o_sh, per_tile = a->per_tile;
    const int per_item = a->per_item, group = a->group, dim = a->dim, is_bf16 = a->is_bf16;
    const int64_t *tile_first = a->tile_first, *visible = a->visible;
    const void *q = a->q, *k = a->k, *v = a->v;
    void *out = a->out;
    const float scale = a->scale;
    for (int64_t item = lo; item < hi; item++) {
        int64_t t = item / per_tile, i0 = tile_first[t];
        int nt = (int)(tile_first[t + 1] - i0);
        int first = (int)(item % per_tile) * per_item;
        int64_t q_rows[KVF_MAX_VECS], o_rows[KVF_MAX_VECS];
        for (int j = 0; j < nt; j++) {
            q_rows[j] = (i0 + j) * q_st;
            o_rows[j] = (i0 + j) * o_st;
        }
        const int32_t *slots = a->table + a->rows[i0] * a->table_st;
        if (visible[i0 + nt - 1] <= 0) { /* sees nothing: zeros */
            for (int j = 0; j < nt; j++)
                for (int g = 0; g < per_item * group; g++) {
                    int64_t at = o_rows[j] + ((int64_t)first * group + g) * o_sh;
                    if (is_bf16) memset((uint16_t *)out + at, 0, (size_t)dim * 2);
                    else memset((float *)out + at, 0, (size_t)dim * 4);
                }
            continue;
        }
        const float *lut = a->kv_lut;
        const float ks = a->k_scale, vs = a->v_scale;
        /* constant storage types, so that each combination is compiled on its own */
#define KVF_ATTEND(Q_BF16, KV_KIND)                                                            \
    attend_tile(q, q_rows, visible + i0, nt, q_sh, k, v, kv_st, kv_sh, first, per_item, slots, \
                out, o_rows, o_sh, group, dim, scale, a->window, a->cap, Q_BF16, KV_KIND, lut, ks, vs)
        switch (a->kv_kind * 2 + is_bf16) {
        case KVF_KV_F32 * 2: KVF_ATTEND(0, KVF_KV_F32); break;
        case KVF_KV_F32 * 2 + 1: KVF_ATTEND(1, KVF_KV_F32); break;
        case KVF_KV_BF16 * 2: KVF_ATTEND(0, KVF_KV_BF16); break;
        case KVF_KV_BF16 * 2 + 1: KVF_ATTEND(1, KVF_KV_BF16); break;
        case KVF_KV_FP8 * 2: KVF_ATTEND(0, KVF_KV_FP8); break;
        default: KVF_ATTEND(1, KVF_KV_FP8); break;
        }
#undef KVF_ATTEND
    }
}

/* q [n, heads, dim] (strides q_st, q_sh); k, v: one layer's pool [slots, kv_heads, dim]
 * (strides kv_st, kv_sh); table: request-to-token rows (stride table_st); rows[i] and
 * visible[i]: query row i's table row and how many of its slots it sees (the last `window`
 * of them when window > 0); out like q. logit_cap > 0 soft-caps the scaled scores,
 * cap * tanh(s / cap), before the softmax (0: none). kv_kind: the pool's storage (KVF_KV_*):
 * float32, bfloat16, or FP8 bytes read as kv_lut[byte] * k_scale (v_scale for V).
 *
 * Work items: runs of rows continuing each other (an extend's new tokens) are cut into tiles
 * of up to KVF_MAX_VECS / group rows, one item per (tile, KV head), so each K/V block serves
 * the whole tile. Rows on their own (decode) are one item each with every head (contiguous
 * token rows) when there are enough to keep the threads busy, else one per (row, KV head).
 * Returns 0, or -1 when the tile list cannot be allocated. */
int kvflow_paged_attention(const void *q, int64_t q_st, int64_t q_sh, const void *k,
                            const void *v, int64_t kv_st, int64_t kv_sh, const int32_t *table,
                           int64_t table_st, const int64_t *rows, const int64_t *visible,
                           void *out, int64_t o_st, int64_t o_sh, int64_t n, int heads,
                           int kv_heads, int dim, float scale, int64_t window,
                           float logit_cap, int is_bf16, int kv_kind, const float *kv_lut,
                           float k_scale, float v_scale) {
    int group = heads / kv_heads;
    int runs = 0;
    for (int64_t i = 1; i < n && !runs; i++) runs = continues(rows, visible, i);
    int whole = !runs && n >= 4 * kvf_pool_threads() && heads <= KVF_MAX_VECS;
    int per_item = whole ? kv_heads : 1;
    int cap = runs ? KVF_MAX_VECS / group : 1;
    int64_t *tile_first = malloc((size_t)(n + 1) * sizeof(int64_t));
    if (!tile_first) return -1;
    int64_t tiles = 0;
    for (int64_t i = 0; i < n; i++)
        if (!continues(rows, visible, i) || i - tile_first[tiles - 1] == cap) tile_first[tiles++] = i;
    tile_first[tiles] = n;
    struct attention_args a = {q, k, v, table, rows, visible, out, tile_first, q_st, q_sh, kv_st,
                               kv_sh, table_st, o_st, o_sh, kv_heads / per_item, window,
                               per_item, group, dim, is_bf16, scale, logit_cap, kv_kind,
                               kv_lut, k_scale, v_scale};
    kvf_parallel_for(tiles * a.per_tile, 1, attention_items, &a);
    free(tile_first);
    return 0;
}
