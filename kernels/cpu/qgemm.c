/* Weight-only quantized matmuls of few rows on CPU (decode steps): out[M, N] = x[M, K] .
 * W[N, K]^T with W in a GGUF block format (Q8_0, Q4_1), repacked once into panels of 16
 * columns (see kvflow/kernels/cpu/qgemm.py for the layouts). Weights are dequantized in
 * registers, products are summed in float32 and the output is rounded once.
 *
 * Per block of 32 k, a tile sums the block's products of the raw quants (blk) and then
 * scales them into the accumulators: Q8_0 acc += d * sum(x q); Q4_1 acc += d * sum(x q)
 * + m * sum(x), with sum(x) per row and block computed once per call.
 *
 * Two inner loops: the portable one (GCC vector extensions, compiled for any CPU) converts
 * quants to float32 and multiplies them into float32 activations with FMAs; the bfloat16
 * one (AVX512-BF16, Q4_1 only) turns a nibble q into the bfloat16 128 + q with one bitwise
 * op (0x4300 | q: exponent of 128, q in the 7 mantissa bits) and multiplies pairs of them
 * into pairs of bfloat16 activations with vdpbf16ps; the 128 * sum(x) it adds is taken
 * back in the block's scaling. From 16 rows on (prefill chunks, large batches) a panel pair
 * is instead dequantized once per pass into float32 (what gguf's dequantize computes) and
 * the rows run dense FMA tiles of 8 on it, so the decoding is paid once, not per 4 rows.
 * Threads of the kernels' pool (pool.h) take runs of panel pairs of a pass of 256 rows;
 * each pair runs every tile of the pass.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "pool.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define KVF_Q_BF16 1
#else
#define KVF_Q_BF16 0
#endif

#define KVF_QNR 16   /* columns per panel */
#define KVF_QMR 4    /* rows per tile */
#define KVF_QK 32    /* k per GGUF block */
#define KVF_QCHUNK 2 /* panel pairs a thread takes at a time */
#define KVF_QMC 256 /* rows per pass over the panels (kept in L2 meanwhile) */
/* From this many rows a panel pair is dequantized once per row pass into float32 and the
 * rows run a dense tile of 8 on it (many rows: the per-row dequantizing would dominate). */
#define KVF_QDENSE_ROWS 16
#define KVF_QMR_DENSE 8

/* layouts (qgemm.py): bytes of one panel's block */
enum { KVF_Q8_0 = 0, KVF_Q4_1 = 1, KVF_Q4_1_BF16 = 2 };
static const int64_t kvf_qbytes[3] = {32 + 512, 64 + 256, 64 + 256};

typedef float kvf_q16 __attribute__((vector_size(64)));
typedef _Float16 kvf_h16 __attribute__((vector_size(32)));
typedef int8_t kvf_i8x16 __attribute__((vector_size(16)));
typedef uint8_t kvf_u8x16 __attribute__((vector_size(16)));

/* What this build runs: bit 0 the portable layouts (Q8_0, Q4_1), bit 1 Q4_1 on bfloat16. */
int kvflow_qgemm_caps(void) { return 1 | (KVF_Q_BF16 << 1); }

typedef int32_t kvf_i32x16 __attribute__((vector_size(64)));

/* 16 fp16 scales, 16 int8 quants, 16 bytes of nibbles -> float32 lanes (AVX-512 where the
 * build has it: GCC lowers the generic byte conversions lane by lane). */
#if defined(__AVX512F__)
#if !KVF_Q_BF16
#include <immintrin.h>
#endif
static inline kvf_q16 half16(const uint8_t *p) {
    return (kvf_q16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline kvf_q16 q8_16(const uint8_t *p) {
    return (kvf_q16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static inline void nibbles16(const uint8_t *p, kvf_q16 *low, kvf_q16 *high) {
    __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *low = (kvf_q16)_mm512_cvtepi32_ps(_mm512_and_si512(wide, _mm512_set1_epi32(15)));
    *high = (kvf_q16)_mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4));
}
#else
static inline kvf_q16 half16(const uint8_t *p) {
    kvf_h16 h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, kvf_q16);
}

static inline kvf_q16 q8_16(const uint8_t *p) {
    kvf_i8x16 q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(__builtin_convertvector(q, kvf_i32x16), kvf_q16);
}

static inline void nibbles16(const uint8_t *p, kvf_q16 *low, kvf_q16 *high) {
    kvf_u8x16 q;
    memcpy(&q, p, sizeof q);
    kvf_i32x16 wide = __builtin_convertvector(q, kvf_i32x16);
    *low = __builtin_convertvector(wide & 15, kvf_q16);
    *high = __builtin_convertvector(wide >> 4, kvf_q16);
}
#endif

/* Writes rows < mr of the tile's np panels, columns below n_valid. */
static inline __attribute__((always_inline)) void store_qtile(kvf_q16 (*acc)[2], const int mr,
                                                              const int np, char *out,
                                                              int64_t o_st, int n_valid,
                                                              int is_bf16) {
    for (int r = 0; r < mr; r++)
        for (int p = 0; p < np; p++) {
            int cols = n_valid - p * KVF_QNR;
            if (cols <= 0) continue;
            cols = cols < KVF_QNR ? cols : KVF_QNR;
            int64_t at = r * o_st + p * KVF_QNR;
            if (is_bf16) {
                uint16_t *dst = (uint16_t *)out + at;
                for (int j = 0; j < cols; j++) dst[j] = f32_to_bf16(acc[r][p][j]);
            } else {
                memcpy((float *)out + at, &acc[r][p], (size_t)cols * sizeof(float));
            }
        }
}

/* Portable tile: float32 rows xf (stride k), their block sums xs (stride blocks), panels
 * b0 (and b0 + panel when np == 2) of a portable layout. Two partial sums per panel (even
 * and odd k) keep four FMA chains going at one row. */
static inline __attribute__((always_inline)) void qtile_f32(const float *xf, const float *xs,
                                                            const int mr, const uint8_t *b0,
                                                            int64_t panel, const int np,
                                                            int64_t k, const int layout,
                                                            char *out, int64_t o_st,
                                                            int n_valid, int is_bf16) {
    const int64_t blocks = k / KVF_QK, bytes = kvf_qbytes[layout];
    kvf_q16 acc[KVF_QMR][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = (kvf_q16){0};
    for (int64_t b = 0; b < blocks; b++) {
        kvf_q16 blk[KVF_QMR][2][2];
        for (int r = 0; r < mr; r++)
            for (int p = 0; p < 2; p++) blk[r][p][0] = blk[r][p][1] = (kvf_q16){0};
        for (int p = 0; p < np; p++) {
            const uint8_t *blockp = b0 + p * panel + b * bytes;
            if (layout == KVF_Q8_0) {
                const uint8_t *q = blockp + 32;
                for (int i = 0; i < KVF_QK; i += 2) {
                    kvf_q16 w0 = q8_16(q + i * KVF_QNR), w1 = q8_16(q + (i + 1) * KVF_QNR);
                    for (int r = 0; r < mr; r++) {
                        const float *xr = xf + r * k + b * KVF_QK;
                        blk[r][p][0] += xr[i] * w0;
                        blk[r][p][1] += xr[i + 1] * w1;
                    }
                }
            } else { /* Q4_1: byte j of column c holds k = j (low) and k = j + 16 (high) */
                const uint8_t *q = blockp + 64;
                for (int j = 0; j < KVF_QK / 2; j++) {
                    kvf_q16 w0, w1;
                    nibbles16(q + j * KVF_QNR, &w0, &w1);
                    for (int r = 0; r < mr; r++) {
                        const float *xr = xf + r * k + b * KVF_QK;
                        blk[r][p][0] += xr[j] * w0;
                        blk[r][p][1] += xr[j + 16] * w1;
                    }
                }
            }
        }
        for (int p = 0; p < np; p++) {
            const uint8_t *blockp = b0 + p * panel + b * bytes;
            kvf_q16 d = half16(blockp);
            if (layout == KVF_Q8_0) {
                for (int r = 0; r < mr; r++) acc[r][p] += d * (blk[r][p][0] + blk[r][p][1]);
            } else {
                kvf_q16 m = half16(blockp + 32);
                for (int r = 0; r < mr; r++)
                    acc[r][p] += d * (blk[r][p][0] + blk[r][p][1]) + xs[r * blocks + b] * m;
            }
        }
    }
    store_qtile(acc, mr, np, out, o_st, n_valid, is_bf16);
}

#if KVF_Q_BF16
/* bfloat16 Q4_1 tile: x rows in bfloat16 (stride x_st), read as 32-bit pairs of k. A
 * panel's block holds 8 chunks of 32 bytes; byte 2c + kk of chunk j holds, for column c,
 * k = 4j + kk in its low nibble and k = 4j + 2 + kk in its high one, so a chunk widened to
 * 16-bit lanes is the column pairs of two k pairs. */
static inline __attribute__((always_inline)) void qtile_bf16(const uint16_t *x, int64_t x_st,
                                                             const float *xs, const int mr,
                                                             const uint8_t *b0, int64_t panel,
                                                             const int np, int64_t k,
                                                             char *out, int64_t o_st,
                                                             int n_valid) {
    const int64_t blocks = k / KVF_QK, bytes = kvf_qbytes[KVF_Q4_1_BF16];
    const __m512i low = _mm512_set1_epi16(0x000f), bias = _mm512_set1_epi16(0x4300);
    const __m512 minus128 = _mm512_set1_ps(-128.0f);
    __m512 acc[KVF_QMR][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512 blk[KVF_QMR][2][2];
        for (int r = 0; r < mr; r++)
            for (int p = 0; p < 2; p++) blk[r][p][0] = blk[r][p][1] = _mm512_setzero_ps();
        for (int j = 0; j < KVF_QK / 4; j++) {
            __m512bh w[2][2];
            for (int p = 0; p < np; p++) {
                const uint8_t *chunk = b0 + p * panel + b * bytes + 64 + j * 32;
                __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)chunk));
                /* (wide & 0xf) | 0x4300 and (wide >> 4) | 0x4300 */
                w[p][0] = (__m512bh)_mm512_ternarylogic_epi32(wide, low, bias, 0xEA);
                w[p][1] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(wide, 4), bias);
            }
            for (int r = 0; r < mr; r++) {
                const uint16_t *xr = x + r * x_st + b * KVF_QK + 4 * j;
                int32_t lo, hi;
                memcpy(&lo, xr, sizeof lo);
                memcpy(&hi, xr + 2, sizeof hi);
                __m512bh a_lo = (__m512bh)_mm512_set1_epi32(lo);
                __m512bh a_hi = (__m512bh)_mm512_set1_epi32(hi);
                for (int p = 0; p < np; p++) {
                    blk[r][p][0] = _mm512_dpbf16_ps(blk[r][p][0], a_lo, w[p][0]);
                    blk[r][p][1] = _mm512_dpbf16_ps(blk[r][p][1], a_hi, w[p][1]);
                }
            }
        }
        for (int p = 0; p < np; p++) {
            const uint8_t *blockp = b0 + p * panel + b * bytes;
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blockp));
            __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blockp + 32)));
            __m512 shift = _mm512_fmadd_ps(minus128, d, m); /* m - 128 d */
            for (int r = 0; r < mr; r++) {
                __m512 sum = _mm512_add_ps(blk[r][p][0], blk[r][p][1]);
                acc[r][p] = _mm512_fmadd_ps(d, sum, acc[r][p]);
                acc[r][p] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * blocks + b]), shift, acc[r][p]);
            }
        }
    }
    kvf_q16 v[KVF_QMR][2];
    memcpy(v, acc, sizeof v);
    store_qtile(v, mr, np, out, o_st, n_valid, 1);
}
#endif

/* One panel (all its blocks) dequantized into float32 [k][16], as gguf's dequantize
 * computes d q (+ m). */
static void dequant_panel(const uint8_t *panel, int64_t blocks, int layout, float *w) {
    const int64_t bytes = kvf_qbytes[layout];
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blockp = panel + b * bytes;
        float *wb = w + b * KVF_QK * KVF_QNR;
        kvf_q16 d = half16(blockp);
        if (layout == KVF_Q8_0) {
            for (int i = 0; i < KVF_QK; i++) {
                kvf_q16 v = d * q8_16(blockp + 32 + i * KVF_QNR);
                memcpy(wb + i * KVF_QNR, &v, sizeof v);
            }
            continue;
        }
        kvf_q16 m = half16(blockp + 32);
        if (layout == KVF_Q4_1) {
            for (int j = 0; j < KVF_QK / 2; j++) {
                kvf_q16 low, high;
                nibbles16(blockp + 64 + j * KVF_QNR, &low, &high);
                low = d * low + m, high = d * high + m;
                memcpy(wb + j * KVF_QNR, &low, sizeof low);
                memcpy(wb + (j + 16) * KVF_QNR, &high, sizeof high);
            }
            continue;
        }
        /* the bfloat16 Q4_1 layout: chunk j, byte 2c + kk holds k = 4j + kk (low nibble) and
         * k = 4j + 2 + kk (high) of column c */
        float dv[KVF_QNR], mv[KVF_QNR];
        memcpy(dv, &d, sizeof dv), memcpy(mv, &m, sizeof mv);
        for (int j = 0; j < KVF_QK / 4; j++)
            for (int c = 0; c < KVF_QNR; c++)
                for (int kk = 0; kk < 2; kk++) {
                    uint8_t byte = blockp[64 + j * 32 + 2 * c + kk];
                    wb[(4 * j + kk) * KVF_QNR + c] = dv[c] * (float)(byte & 15) + mv[c];
                    wb[(4 * j + 2 + kk) * KVF_QNR + c] = dv[c] * (float)(byte >> 4) + mv[c];
                }
    }
}

/* Dense tile over a dequantized pair: float32 rows xf (stride k) times w0 (and w1 when
 * np == 2), each [k][16]. */
static inline __attribute__((always_inline)) void dense_qtile(const float *xf, int64_t k,
                                                              const int mr, const float *w0,
                                                              const float *w1, const int np,
                                                              char *out, int64_t o_st,
                                                              int n_valid, int is_bf16) {
    kvf_q16 acc[KVF_QMR_DENSE][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = (kvf_q16){0};
    for (int64_t i = 0; i < k; i++) {
        kvf_q16 v0, v1 = {0};
        memcpy(&v0, w0 + i * KVF_QNR, sizeof v0);
        if (np == 2) memcpy(&v1, w1 + i * KVF_QNR, sizeof v1);
        for (int r = 0; r < mr; r++) {
            float xv = xf[r * k + i];
            acc[r][0] += xv * v0;
            if (np == 2) acc[r][1] += xv * v1;
        }
    }
    store_qtile(acc, mr, np, out, o_st, n_valid, is_bf16);
}

#define KVF_QROWS8(CALL)        \
    switch (mr) {               \
        case 1: CALL(1); break; \
        case 2: CALL(2); break; \
        case 3: CALL(3); break; \
        case 4: CALL(4); break; \
        case 5: CALL(5); break; \
        case 6: CALL(6); break; \
        case 7: CALL(7); break; \
        default: CALL(8); break; \
    }

struct qgemm_args {
    const char *x;
    const float *xf, *xs;
    const uint8_t *packed;
    char *out;
    int64_t x_st, o_st, m, n, k, panels, pairs, runs;
    int layout, is_bf16;
};

#define KVF_QROWS(CALL)     \
    switch (mr) {           \
        case 1: CALL(1); break; \
        case 2: CALL(2); break; \
        case 3: CALL(3); break; \
        default: CALL(4); break; \
    }

/* Tasks [lo, hi): task t is run t % runs (KVF_QCHUNK panel pairs) of row block t / runs
 * (KVF_QMC rows); each pair runs every tile of the block: dequantized once into `w` and
 * run in dense tiles from KVF_QDENSE_ROWS rows on, else in quantized tiles. */
static void qgemm_tasks(void *ctx, int64_t lo, int64_t hi) {
    const struct qgemm_args *a = ctx;
    const int64_t blocks = a->k / KVF_QK, panel = blocks * kvf_qbytes[a->layout];
    const int size = a->is_bf16 ? 2 : 4;
    /* a pair dequantized (without memory: the quantized tiles, which need none) */
    float *w = a->m >= KVF_QDENSE_ROWS ? malloc((size_t)(2 * a->k * KVF_QNR) * sizeof(float))
                                       : NULL;
    for (int64_t task = lo; task < hi; task++) {
        int64_t m_lo = task / a->runs * KVF_QMC;
        int64_t m_hi = a->m - m_lo < KVF_QMC ? a->m : m_lo + KVF_QMC;
        int64_t pp_lo = task % a->runs * KVF_QCHUNK;
        int64_t pp_hi = pp_lo + KVF_QCHUNK < a->pairs ? pp_lo + KVF_QCHUNK : a->pairs;
        for (int64_t pp = pp_lo; pp < pp_hi; pp++) {
            int np = 2 * pp + 1 < a->panels ? 2 : 1;
            int n_valid = (int)(a->n - pp * 2 * KVF_QNR);
            const uint8_t *b0 = a->packed + pp * 2 * panel;
            if (w) {
                float *w1 = w + a->k * KVF_QNR;
                dequant_panel(b0, blocks, a->layout, w);
                if (np == 2) dequant_panel(b0 + panel, blocks, a->layout, w1);
                for (int64_t m0 = m_lo; m0 < m_hi; m0 += KVF_QMR_DENSE) {
                    int mr = (int)(m_hi - m0 < KVF_QMR_DENSE ? m_hi - m0 : KVF_QMR_DENSE);
                    char *dst = a->out + (m0 * a->o_st + pp * 2 * KVF_QNR) * size;
                    const float *xf = a->xf + m0 * a->k;
#define KVF_CALL(R)                                                                          \
    (np == 2 ? dense_qtile(xf, a->k, R, w, w1, 2, dst, a->o_st, n_valid, a->is_bf16) \
             : dense_qtile(xf, a->k, R, w, w1, 1, dst, a->o_st, n_valid, a->is_bf16))
                    KVF_QROWS8(KVF_CALL)
#undef KVF_CALL
                }
                continue;
            }
            for (int64_t m0 = m_lo; m0 < m_hi; m0 += KVF_QMR) {
                int mr = (int)(m_hi - m0 < KVF_QMR ? m_hi - m0 : KVF_QMR);
                char *dst = a->out + (m0 * a->o_st + pp * 2 * KVF_QNR) * size;
                const float *xs = a->xs + m0 * blocks;
#if KVF_Q_BF16
                if (a->layout == KVF_Q4_1_BF16) {
                    const uint16_t *src = (const uint16_t *)a->x + m0 * a->x_st;
#define KVF_CALL(R)                                                                       \
    (np == 2 ? qtile_bf16(src, a->x_st, xs, R, b0, panel, 2, a->k, dst, a->o_st, n_valid) \
             : qtile_bf16(src, a->x_st, xs, R, b0, panel, 1, a->k, dst, a->o_st, n_valid))
                    KVF_QROWS(KVF_CALL)
#undef KVF_CALL
                    continue;
                }
#endif
                const float *xf = a->xf + m0 * a->k;
#define KVF_CALL(R)                                                                      \
    (np == 2 ? qtile_f32(xf, xs, R, b0, panel, 2, a->k, a->layout, dst, a->o_st, n_valid, \
                         a->is_bf16)                                                      \
             : qtile_f32(xf, xs, R, b0, panel, 1, a->k, a->layout, dst, a->o_st, n_valid, \
                         a->is_bf16))
                KVF_QROWS(KVF_CALL)
#undef KVF_CALL
            }
        }
    }
    free(w);
}

/* x [m, k] (row stride x_st; bfloat16 when is_bf16, else float32), a packed weight of n
 * columns in `layout` (k a multiple of 32), out [m, n] (row stride o_st) in x's type.
 * Returns 0; -1 for a layout this build has no kernel for (or x of the wrong type for
 * it); -2 where scratch memory could not be had. */
int kvflow_qgemm(const void *x, int64_t x_st, const void *packed, int layout, int64_t m,
                 int64_t n, int64_t k, void *out, int64_t o_st, int is_bf16) {
    if (layout < 0 || layout > KVF_Q4_1_BF16 || k % KVF_QK) return -1;
    if (layout == KVF_Q4_1_BF16 && !(KVF_Q_BF16 && is_bf16)) return -1;
    const int64_t blocks = k / KVF_QK;
    const int portable = layout != KVF_Q4_1_BF16 || m >= KVF_QDENSE_ROWS;
    /* float32 copies of the rows (portable and dense tiles) and their sums per block */
    float *xf = portable ? malloc((size_t)(m * k) * sizeof(float)) : NULL;
    float *xs = malloc((size_t)(m * blocks) * sizeof(float));
    if ((portable && !xf) || !xs) {
        free(xf), free(xs);
        return -2;
    }
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < blocks; b++) {
            float sum = 0.0f;
            for (int64_t i = b * KVF_QK; i < (b + 1) * KVF_QK; i++) {
                float v = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[r * x_st + i])
                                  : ((const float *)x)[r * x_st + i];
                if (xf) xf[r * k + i] = v;
                sum += v;
            }
            xs[r * blocks + b] = sum;
        }
    int64_t panels = (n + KVF_QNR - 1) / KVF_QNR;
    int64_t pairs = (panels + 1) / 2;
    int64_t runs = (pairs + KVF_QCHUNK - 1) / KVF_QCHUNK;
    struct qgemm_args a = {x,  xf,   xs,     packed, out,  x_st,   o_st,   m,
                           n,  k,    panels, pairs,  runs, layout, is_bf16};
    kvf_parallel_for((m + KVF_QMC - 1) / KVF_QMC * runs, 1, qgemm_tasks, &a);
    free(xf), free(xs);
    return 0;
}
