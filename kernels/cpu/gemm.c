/* Matmuls of few rows on CPU (decode steps): out[M, N] = x[M, K] . W[N, K]^T with W prepacked
 * in panels of 16 columns (see kvflow/kernels/cpu/gemm.py for the layouts), float32
 * accumulation, the output rounded once to the storage type.
 *
 * Threads of the kernels' pool (pool.h) take runs of 4 panel pairs (128 columns, contiguous
 * in the packed weight) as they come free (a thread descheduled by another process holds up
 * the matmul by at most its current run, and not at all before it has taken one), and run
 * every block of up to 8 rows over a pair before moving on: the pair is read from memory
 * once and from cache for the other blocks.
 * A block x pair tile keeps 8 x 2 accumulators of 16 lanes in registers over the whole K:
 * float32 multiplies a broadcast x element into a panel row (FMA); bfloat16 multiplies a
 * broadcast pair of x elements into a panel row of column pairs (vdpbf16ps, AVX512-BF16
 * only). The next pair's panels are prefetched into L2 while a pair runs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "pool.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define KVF_GEMM_BF16 1
#else
#define KVF_GEMM_BF16 0
#endif

#define KVF_NR 16 /* columns per panel */
#define KVF_MR 8  /* rows per tile */
#define KVF_MC 256 /* rows per pass over the panels (kept in L2 meanwhile) */
#define KVF_CHUNK 4 /* panel pairs a thread takes at a time */

typedef float kvf_g16 __attribute__((vector_size(64)));

/* What this build runs: bit 0 float32, bit 1 bfloat16. */
int kvflow_gemm_caps(void) { return 1 | (KVF_GEMM_BF16 << 1); }

static inline float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* Writes one tile's accumulators (rows < mr, the panel pair's columns below n_valid); with
 * `silu_mul` the pair is (gate, up) for the same 16 columns and 16 columns of
 * silu(gate) * up are written, rounded as the unfused matmul then SiLU-and-mul would:
 * matmul outputs, the activation and the product each to the storage type. */
static inline __attribute__((always_inline)) void store_tile(kvf_g16 (*c)[2], const int mr,
                                                             const int np, void *out,
                                                             int64_t o_st, int n_valid,
                                                             const int silu_mul,
                                                             const int is_bf16) {
    if (silu_mul) {
        for (int r = 0; r < mr; r++) {
            float y[KVF_NR];
            for (int j = 0; j < KVF_NR; j++) {
                float gate = is_bf16 ? bf16_round(c[r][0][j]) : c[r][0][j];
                float up = is_bf16 ? bf16_round(c[r][1][j]) : c[r][1][j];
                float act = gate / (1.0f + expf(-gate));
                y[j] = (is_bf16 ? bf16_round(act) : act) * up;
            }
            if (is_bf16) {
                uint16_t *dst = (uint16_t *)out + r * o_st;
                for (int j = 0; j < KVF_NR; j++) dst[j] = f32_to_bf16(y[j]);
            } else {
                memcpy((float *)out + r * o_st, y, sizeof y);
            }
        }
        return;
    }
    for (int r = 0; r < mr; r++)
        for (int p = 0; p < np; p++) {
            int cols = n_valid - p * KVF_NR;
            if (cols <= 0) continue;
            cols = cols < KVF_NR ? cols : KVF_NR;
            int64_t at = r * o_st + p * KVF_NR;
            if (is_bf16) {
                uint16_t *dst = (uint16_t *)out + at;
                for (int j = 0; j < cols; j++) dst[j] = f32_to_bf16(c[r][p][j]);
            } else {
                memcpy((float *)out + at, &c[r][p], (size_t)cols * sizeof(float));
            }
        }
}

/* float32 tile: rows x[0..mr) (stride x_st) times panels b0 (and b0 + panel when np == 2),
 * each panel [k][16]. */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t x_st,
                                                           const int mr, const float *b0,
                                                           int64_t panel, const int np, int k,
                                                           const char *ahead, void *out,
                                                           int64_t o_st, int n_valid,
                                                           const int silu_mul,
                                                           const float *init) {
    kvf_g16 c[KVF_MR][2], b_lo = {0}, b_hi = {0};
    if (init) memcpy(&b_lo, init, sizeof b_lo), memcpy(&b_hi, init + KVF_NR, sizeof b_hi);
    for (int r = 0; r < mr; r++) c[r][0] = b_lo, c[r][1] = b_hi;
    for (int i = 0; i < k; i++) {
        if (ahead) { /* two lines per step: the next pair is as long as this one */
            __builtin_prefetch(ahead + (int64_t)i * 128, 0, 1);
            __builtin_prefetch(ahead + (int64_t)i * 128 + 64, 0, 1);
        }
        kvf_g16 w0 = *(const kvf_g16 *)(b0 + (int64_t)i * KVF_NR);
        kvf_g16 w1 = np == 2 ? *(const kvf_g16 *)(b0 + panel + (int64_t)i * KVF_NR) : w0;
        for (int r = 0; r < mr; r++) {
            float a = x[r * x_st + i];
            c[r][0] += a * w0;
            if (np == 2) c[r][1] += a * w1;
        }
    }
    store_tile(c, mr, np, out, o_st, n_valid, silu_mul, 0);
}

#if KVF_GEMM_BF16
/* bfloat16 tile: panels [k / 2][16][2] (column pairs of consecutive k), x read as 32-bit
 * pairs of consecutive k. */
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, int64_t x_st,
                                                            const int mr, const uint16_t *b0,
                                                            int64_t panel, const int np, int k,
                                                            const char *ahead, void *out,
                                                            int64_t o_st, int n_valid,
                                                            const int silu_mul,
                                                            const float *init) {
    __m512 c[KVF_MR][2];
    __m512 b_lo = init ? _mm512_loadu_ps(init) : _mm512_setzero_ps();
    __m512 b_hi = init ? _mm512_loadu_ps(init + KVF_NR) : _mm512_setzero_ps();
    for (int r = 0; r < mr; r++) c[r][0] = b_lo, c[r][1] = b_hi;
    for (int i = 0; i < k / 2; i++) {
        if (ahead) {
            __builtin_prefetch(ahead + (int64_t)i * 128, 0, 1);
            __builtin_prefetch(ahead + (int64_t)i * 128 + 64, 0, 1);
        }
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + (int64_t)i * 2 * KVF_NR);
        __m512bh w1 = np == 2 ? (__m512bh)_mm512_loadu_si512(b0 + panel + (int64_t)i * 2 * KVF_NR) : w0;
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, x + r * x_st + 2 * i, sizeof pair);
            __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            c[r][0] = _mm512_dpbf16_ps(c[r][0], a, w0);
            if (np == 2) c[r][1] = _mm512_dpbf16_ps(c[r][1], a, w1);
        }
    }
    kvf_g16 v[KVF_MR][2];
    memcpy(v, c, sizeof v);
    store_tile(v, mr, np, out, o_st, n_valid, silu_mul, 1);
}
#endif

/* The tile for `mr` rows, specialized per row count (the compiler unrolls each). */
#define KVF_TILE_CASES(CALL) \
    switch (mr) {            \
        case 1: CALL(1); break; \
        case 2: CALL(2); break; \
        case 3: CALL(3); break; \
        case 4: CALL(4); break; \
        case 5: CALL(5); break; \
        case 6: CALL(6); break; \
        case 7: CALL(7); break; \
        default: CALL(8); break; \
    }

/* One tile: the storage type's kernel, specialized for the row count and the pair's panels. */
static void run_tile(const char *src, int64_t x_st, int mr, const char *b0, int64_t panel,
                     int np, int k, const char *fetch, char *dst, int64_t o_st, int n_valid,
                     int silu_mul, const float *init, int is_bf16) {
    if (is_bf16) {
#if KVF_GEMM_BF16
#define KVF_CALL(R)                                                                          \
    (np == 2 ? tile_bf16((const uint16_t *)src, x_st, R, (const uint16_t *)b0, panel, 2, k, \
                         fetch, dst, o_st, n_valid, silu_mul, init)                               \
             : tile_bf16((const uint16_t *)src, x_st, R, (const uint16_t *)b0, panel, 1, k, \
                         fetch, dst, o_st, n_valid, silu_mul, init))
        KVF_TILE_CASES(KVF_CALL)
#undef KVF_CALL
#endif
    } else {
#define KVF_CALL(R)                                                                    \
    (np == 2 ? tile_f32((const float *)src, x_st, R, (const float *)b0, panel, 2, k, \
                        fetch, dst, o_st, n_valid, silu_mul, init)                          \
             : tile_f32((const float *)src, x_st, R, (const float *)b0, panel, 1, k, \
                        fetch, dst, o_st, n_valid, silu_mul, init))
        KVF_TILE_CASES(KVF_CALL)
#undef KVF_CALL
    }
}

struct gemm_args {
    const char *x, *packed;
    const float *bias;
    char *out;
    int64_t x_st, o_st, m, n, k, panels, pairs, runs, size;
    int silu_mul, is_bf16;
};

/* Tasks [lo, hi): task t is run t % runs (KVF_CHUNK panel pairs) of row block t / runs
 * (KVF_MC rows); each pair is run over every tile of up to 8 rows of the block. */
static void gemm_tasks(void *ctx, int64_t lo, int64_t hi) {
    const struct gemm_args *a = ctx;
    int64_t panel = a->k * KVF_NR; /* elements per panel, either type */
    for (int64_t task = lo; task < hi; task++) {
        int64_t m_lo = task / a->runs * KVF_MC;
        int64_t m_hi = a->m - m_lo < KVF_MC ? a->m : m_lo + KVF_MC;
        int64_t pp_lo = task % a->runs * KVF_CHUNK;
        int64_t pp_hi = pp_lo + KVF_CHUNK < a->pairs ? pp_lo + KVF_CHUNK : a->pairs;
        for (int64_t pp = pp_lo; pp < pp_hi; pp++) {
            int np = 2 * pp + 1 < a->panels ? 2 : 1;
            int n_valid = (int)(a->n - pp * 2 * KVF_NR);
            const char *b0 = a->packed + pp * 2 * panel * a->size;
            const char *ahead = pp + 1 < a->pairs ? b0 + 2 * panel * a->size : NULL;
            for (int64_t m0 = m_lo; m0 < m_hi; m0 += KVF_MR) {
                int mr = (int)(m_hi - m0 < KVF_MR ? m_hi - m0 : KVF_MR);
                int64_t col = pp * (a->silu_mul ? 1 : 2) * KVF_NR;
                char *dst = a->out + (m0 * a->o_st + col) * a->size;
                const char *src = a->x + m0 * a->x_st * a->size;
                /* the first block streams the pair in and fetches the next one */
                const char *fetch = m0 == m_lo ? ahead : NULL;
                const float *init = a->bias ? a->bias + pp * 2 * KVF_NR : NULL;
                run_tile(src, a->x_st, mr, b0, panel, np, (int)a->k, fetch, dst, a->o_st,
                         n_valid, a->silu_mul, init, a->is_bf16);
            }
        }
    }
}

/* x [m, k] (row stride x_st), packed weight of n columns (padded to panels of 16), out
 * [m, n] (row stride o_st), the same storage type throughout (is_bf16). k is even for
 * bfloat16. With silu_mul the panels alternate gate and up blocks of 16 columns (n a
 * multiple of 32) and out is [m, n / 2] = silu(gate) * up. bias: NULL, or float32 [n padded
 * to panels], added before the rounding (the accumulators start from it). Returns 0, or -1
 * where this build has no kernel for the type. */
int kvflow_gemm(const void *x, int64_t x_st, const void *packed, const float *bias, int64_t m,
                int64_t n, int64_t k, void *out, int64_t o_st, int silu_mul, int is_bf16) {
    if (is_bf16 && !KVF_GEMM_BF16) return -1;
    int64_t panels = (n + KVF_NR - 1) / KVF_NR;
    int64_t pairs = (panels + 1) / 2;
    int64_t runs = (pairs + KVF_CHUNK - 1) / KVF_CHUNK;
    struct gemm_args a = {x, packed, bias, out, x_st, o_st, m, n, k, panels, pairs, runs,
                          is_bf16 ? 2 : 4, silu_mul, is_bf16};
    kvf_parallel_for((m + KVF_MC - 1) / KVF_MC * runs, 1, gemm_tasks, &a);
    return 0;
}
