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
 *
 * With AMX (Sapphire Rapids and later, built with -march=native there, the process granted
 * the tile state by the kernel): bfloat16 matmuls (k a multiple of 32) run on the tile unit
 * instead (TDPBF16PS), in blocks of 16 or 32 rows, the same panels read as tiles of 16 k-pairs x 16 columns (the panel
 * layout is already the tile's VNNI layout), x as tiles of 16 rows x 32 k. The epilogue is
 * the same store_tile, from the accumulators stored out of the tiles. The last rows past a
 * whole 16 (a decode step's few) are copied into a 16-row buffer, so every row sums in the
 * same order wherever it sits in the batch. kvflow_gemm_amx turns it on or off (on when
 * granted).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "pool.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define KVF_GEMM_BF16 1
#else
#define KVF_GEMM_BF16 0
#endif

#if KVF_GEMM_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define KVF_GEMM_AMX 1
#else
#define KVF_GEMM_AMX 0
#endif

#define KVF_NR 16 /* columns per panel */
#define KVF_MR 8  /* rows per tile */
#define KVF_MC 256 /* rows per pass over the panels (kept in L2 meanwhile) */
#define KVF_CHUNK 4 /* panel pairs a thread takes at a time */

typedef float kvf_g16 __attribute__((vector_size(64)));

#if KVF_GEMM_AMX
/* -1: not asked yet; 0: off (refused by the kernel, or turned off); 1: on. */
static int amx_on = -1;

/* Asks Linux for the tile data state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): without it
 * the first tile instruction faults. The grant is the process's, for every thread. */
static int amx_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return granted;
}
#endif

/* Whether bfloat16 matmuls run on AMX tiles: `enable` 1 asks for them
 * (on where this build has them and the kernel grants them), 0 turns them off, -1 only
 * answers (first asked: on, unless $KVFLOW_CPU_AMX is "0"). */
int kvflow_gemm_amx(int enable) {
#if KVF_GEMM_AMX
    if (enable >= 0) amx_on = enable ? amx_granted() : 0;
    if (amx_on < 0) { /* first use: on unless $KVFLOW_CPU_AMX is 0 */
        const char *env = getenv("KVFLOW_CPU_AMX");
        amx_on = env && strcmp(env, "0") == 0 ? 0 : amx_granted();
    }
    return amx_on;
#else
    (void)enable;
    return 0;
#endif
}

/* What this build runs: bit 0 float32, bit 1 bfloat16, bit 2 AMX tiles for bfloat16. */
int kvflow_gemm_caps(void) { return 1 | (KVF_GEMM_BF16 << 1) | (KVF_GEMM_AMX << 2); }

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

#if KVF_GEMM_AMX
#define KVF_AMX_K 32 /* k per tile step: a tile row holds 64 bytes */

struct kvf_tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Every tile 16 rows of 64 bytes: accumulators 0-3 (row tile i, panel j at 2 * i + j), x
 * tiles 4-5, panel tiles 6-7. Per thread (the configuration is thread state). */
static void amx_configure(void) {
    struct kvf_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* 16 * mt rows of x (mt 1 or 2; stride x_st) times panels b0 (and b0 + panel when np == 2),
 * k a multiple of 32; then store_tile per 8 rows, from the accumulators with `init` added,
 * for the first `rows` rows. */
static inline __attribute__((always_inline)) void amx_block(const uint16_t *x, int64_t x_st,
                                                            const int mt, const uint16_t *b0,
                                                            int64_t panel, const int np, int k,
                                                            int rows, char *out, int64_t o_st,
                                                            int n_valid, int silu_mul,
                                                            const float *init) {
    float acc[4][16][KVF_NR];
    const int64_t x_bytes = x_st * 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kc = 0; kc < k; kc += KVF_AMX_K) {
        const uint16_t *w = b0 + (int64_t)kc * KVF_NR; /* k-pairs kc / 2 .. + 16 */
        _tile_loadd(6, w, 64);
        if (np == 2) _tile_loadd(7, w + panel, 64);
        _tile_loadd(4, x + kc, x_bytes);
        _tile_dpbf16ps(0, 4, 6);
        if (np == 2) _tile_dpbf16ps(1, 4, 7);
        if (mt == 2) {
            _tile_loadd(5, x + 16 * x_st + kc, x_bytes);
            _tile_dpbf16ps(2, 5, 6);
            if (np == 2) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc[0], 64);
    if (np == 2) _tile_stored(1, acc[1], 64);
    if (mt == 2) {
        _tile_stored(2, acc[2], 64);
        if (np == 2) _tile_stored(3, acc[3], 64);
    }
    kvf_g16 b_lo = {0}, b_hi = {0};
    if (init) memcpy(&b_lo, init, sizeof b_lo), memcpy(&b_hi, init + KVF_NR, sizeof b_hi);
    for (int half = 0; half < 2 * mt && half * KVF_MR < rows; half++) {
        kvf_g16 v[KVF_MR][2];
        int tile = half / 2, row0 = half % 2 * KVF_MR;
        int mr = rows - half * KVF_MR < KVF_MR ? rows - half * KVF_MR : KVF_MR;
        for (int r = 0; r < KVF_MR; r++) {
            memcpy(&v[r][0], acc[2 * tile][row0 + r], sizeof v[r][0]);
            v[r][0] += b_lo;
            if (np == 2) {
                memcpy(&v[r][1], acc[2 * tile + 1][row0 + r], sizeof v[r][1]);
                v[r][1] += b_hi;
            }
        }
        store_tile(v, mr, np, out + half * KVF_MR * o_st * 2, o_st, n_valid, silu_mul, 1);
    }
}

/* amx_block specialized for the pair's panels. */
static void amx_block_np(const uint16_t *x, int64_t x_st, int mt, const uint16_t *b0,
                         int64_t panel, int np, int k, int rows, char *out, int64_t o_st,
                         int n_valid, int silu_mul, const float *init) {
    if (mt == 2)
        np == 2 ? amx_block(x, x_st, 2, b0, panel, 2, k, rows, out, o_st, n_valid, silu_mul, init)
                : amx_block(x, x_st, 2, b0, panel, 1, k, rows, out, o_st, n_valid, silu_mul, init);
    else
        np == 2 ? amx_block(x, x_st, 1, b0, panel, 2, k, rows, out, o_st, n_valid, silu_mul, init)
                : amx_block(x, x_st, 1, b0, panel, 1, k, rows, out, o_st, n_valid, silu_mul, init);
}

/* The last rows of a row block (fewer than 16), copied once per task into a 16-row buffer
 * (the tile load reads 16 rows): every row of an AMX matmul then sums in the tile unit's
 * order, wherever the row sits in the batch (results do not depend on how requests are
 * batched). The rows past `rows` hold finite leftovers (zeros at first): each output row
 * reads only its own x row, and theirs are not stored. Per thread. */
static const uint16_t *amx_tail(const uint16_t *x, int64_t x_st, int rows, int64_t k) {
    static __thread uint16_t *buf;
    static __thread int64_t cap;
    if (cap < 16 * k) {
        free(buf);
        buf = calloc((size_t)(16 * k), sizeof *buf);
        cap = buf ? 16 * k : 0;
        if (!buf) return NULL;
    }
    for (int r = 0; r < rows; r++) memcpy(buf + r * k, x + r * x_st, (size_t)k * sizeof *buf);
    return buf;
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
    int silu_mul, is_bf16, amx;
};

/* Tasks [lo, hi): task t is run t % runs (KVF_CHUNK panel pairs) of row block t / runs
 * (KVF_MC rows); each pair is run over every tile of up to 8 rows of the block. */
static void gemm_tasks(void *ctx, int64_t lo, int64_t hi) {
    const struct gemm_args *a = ctx;
    int64_t panel = a->k * KVF_NR; /* elements per panel, either type */
#if KVF_GEMM_AMX
    if (a->amx) amx_configure();
#endif
    for (int64_t task = lo; task < hi; task++) {
        int64_t m_lo = task / a->runs * KVF_MC;
        int64_t m_hi = a->m - m_lo < KVF_MC ? a->m : m_lo + KVF_MC;
        int64_t pp_lo = task % a->runs * KVF_CHUNK;
        int64_t pp_hi = pp_lo + KVF_CHUNK < a->pairs ? pp_lo + KVF_CHUNK : a->pairs;
#if KVF_GEMM_AMX
        const uint16_t *tail = NULL, *tail_src = NULL; /* this task's padded last rows */
#endif
        for (int64_t pp = pp_lo; pp < pp_hi; pp++) {
            int np = 2 * pp + 1 < a->panels ? 2 : 1;
            int n_valid = (int)(a->n - pp * 2 * KVF_NR);
            const char *b0 = a->packed + pp * 2 * panel * a->size;
            const char *ahead = pp + 1 < a->pairs ? b0 + 2 * panel * a->size : NULL;
            int64_t col = pp * (a->silu_mul ? 1 : 2) * KVF_NR;
            const float *init = a->bias ? a->bias + pp * 2 * KVF_NR : NULL;
            int64_t m0 = m_lo;
#if KVF_GEMM_AMX
            while (a->amx && m0 < m_hi) { /* 32 rows, 16, or the last few padded to 16 */
                int64_t left = m_hi - m0;
                int take = left >= 32 ? 32 : left >= 16 ? 16 : (int)left;
                const uint16_t *src = (const uint16_t *)a->x + m0 * a->x_st;
                int64_t x_st = a->x_st;
                if (take < 16) {
                    if (tail_src != src) tail = amx_tail(src, x_st, take, a->k), tail_src = src;
                    if (!tail) break; /* out of memory: the vector tiles below */
                    src = tail, x_st = a->k;
                }
                amx_block_np(src, x_st, take == 32 ? 2 : 1, (const uint16_t *)b0, panel, np,
                             (int)a->k, take, a->out + (m0 * a->o_st + col) * a->size, a->o_st,
                             n_valid, a->silu_mul, init);
                m0 += take;
            }
#endif
            for (int64_t rows_lo = m0; m0 < m_hi; m0 += KVF_MR) {
                int mr = (int)(m_hi - m0 < KVF_MR ? m_hi - m0 : KVF_MR);
                char *dst = a->out + (m0 * a->o_st + col) * a->size;
                const char *src = a->x + m0 * a->x_st * a->size;
                /* the first block streams the pair in and fetches the next one */
                const char *fetch = m0 == rows_lo ? ahead : NULL;
                run_tile(src, a->x_st, mr, b0, panel, np, (int)a->k, fetch, dst, a->o_st,
                         n_valid, a->silu_mul, init, a->is_bf16);
            }
        }
    }
#if KVF_GEMM_AMX
    if (a->amx) _tile_release();
#endif
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
    /* AMX where k fills whole tile rows, for every row count: a decode row padded to 16 is
     * still faster than the vector tile (the same weight bytes, the multiply nearly free),
     * and every row then sums in the same order whatever the batch */
    int amx = is_bf16 && k % 32 == 0 && kvflow_gemm_amx(-1);
    struct gemm_args a = {x, packed, bias, out, x_st, o_st, m, n, k, panels, pairs, runs,
                          is_bf16 ? 2 : 4, silu_mul, is_bf16, amx};
    kvf_parallel_for((m + KVF_MC - 1) / KVF_MC * runs, 1, gemm_tasks, &a);
    return 0;
}
