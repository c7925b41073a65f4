/* kvflow's CPU thread pool (see pool.h for what it promises).
 *
 * One loop at a time is published in `claim`, a 64-bit word:
 *
 *     bits 63..32  generation (one per loop)
 *     bits 31..16  chunks in the loop
 *     bits 15..0   next chunk to hand out
 *
 * A thread claims chunk c by a compare-and-swap of (gen, total, c) to (gen, total, c + 1),
 * so a claim can only succeed on the loop it read: a worker waking up late to a stale word
 * fails its swap or finds nothing left. The loop's fields (body, ctx, n, per) are written
 * before the word is published (release) and read after a successful claim (acquire); they
 * stay fixed until every chunk is done, and the caller publishes the next loop only then.
 * `done` counts finished chunks of the current loop.
 *
 * Sleeping uses two futex words: workers sleep on `seq` (bumped by every publish) after
 * counting themselves in `sleepers`; the caller sleeps on `done` after setting
 * `caller_asleep`. Each side stores its flag and then reads the other side's word, both
 * sequentially consistent, so a wake-up is never lost.
 */
#define _GNU_SOURCE
#include "pool.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define KVF_MAX_WORKERS 255
#define KVF_MAX_CHUNKS 0xFFFF

static struct {
    _Atomic uint64_t claim;
    kvf_body body;
    void *ctx;
    int64_t n, per;
    _Atomic uint32_t done;
    _Atomic uint32_t caller_asleep;
    _Atomic uint32_t seq;
    _Atomic uint32_t sleepers;
    _Atomic int busy;     /* a loop is running (others run inline) */
    _Atomic int threads;  /* 0: not set yet (every core this process may run on) */
    _Atomic int spin_ns;  /* how long a waiting thread spins before it sleeps */
    int started;          /* workers created (guarded by `lock`) */
    pthread_mutex_t lock;
} pool = {.spin_ns = 300000, .lock = PTHREAD_MUTEX_INITIALIZER};

static inline uint32_t chunks_of(uint64_t w) { return (uint32_t)(w >> 16) & 0xFFFF; }
static inline uint32_t next_of(uint64_t w) { return (uint32_t)w & 0xFFFF; }
static inline int has_work(uint64_t w) { return next_of(w) < chunks_of(w); }

static void futex_wait(_Atomic uint32_t *word, uint32_t expected) {
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word, int count) {
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, count, NULL, NULL, 0);
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Spins (yielding the core to whoever else wants it) until ready(arg) or the spin time is
 * up; returns ready(arg). */
static int spin_until(int (*ready)(void *), void *arg) {
    uint64_t deadline = 0;
    for (;;) {
        if (ready(arg)) return 1;
        uint64_t t = now_ns();
        if (!deadline) deadline = t + (uint64_t)atomic_load_explicit(&pool.spin_ns, memory_order_relaxed);
        else if (t >= deadline) return ready(arg);
        sched_yield();
    }
}

/* Claims and runs chunks of the published loop until none is left. */
static void run_chunks(void) {
    uint64_t w = atomic_load_explicit(&pool.claim, memory_order_acquire);
    while (has_work(w)) {
        if (!atomic_compare_exchange_weak_explicit(&pool.claim, &w, w + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        int64_t lo = (int64_t)next_of(w) * pool.per;
        int64_t hi = lo + pool.per < pool.n ? lo + pool.per : pool.n;
        uint32_t chunks = chunks_of(w);
        pool.body(pool.ctx, lo, hi);
        if (atomic_fetch_add(&pool.done, 1) + 1 == chunks && atomic_load(&pool.caller_asleep))
            futex_wake(&pool.done, 1);
        w = atomic_load_explicit(&pool.claim, memory_order_acquire);
    }
}

static int work_ready(void *id) {
    return (intptr_t)id < atomic_load_explicit(&pool.threads, memory_order_relaxed) - 1 &&
           has_work(atomic_load_explicit(&pool.claim, memory_order_relaxed));
}

static void *worker(void *arg) {
    for (;;) {
        if (!spin_until(work_ready, arg)) {
            uint32_t seq = atomic_load(&pool.seq);
            atomic_fetch_add(&pool.sleepers, 1);
            if (!work_ready(arg)) futex_wait(&pool.seq, seq);
            atomic_fetch_sub(&pool.sleepers, 1);
            continue;
        }
        run_chunks();
    }
    return NULL;
}

static int cores(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    return online > 0 ? (int)online : 1;
}

/* A forked child has none of the parent's workers. */
static void after_fork(void) {
    pool.started = 0;
    atomic_store(&pool.busy, 0);
    atomic_store(&pool.sleepers, 0);
    pthread_mutex_init(&pool.lock, NULL);
}

/* Creates workers up to the thread count; returns how many loops may use (the caller too). */
static int ensure_workers(void) {
    int threads = atomic_load(&pool.threads);
    if (threads == 0) {
        int expected = 0;
        atomic_compare_exchange_strong(&pool.threads, &expected, cores());
        threads = atomic_load(&pool.threads);
    }
    if (threads - 1 <= pool.started) return threads;
    pthread_mutex_lock(&pool.lock);
    static int hooked;
    if (!hooked) hooked = pthread_atfork(NULL, NULL, after_fork) == 0;
    while (pool.started < threads - 1 && pool.started < KVF_MAX_WORKERS) {
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&tid, &attr, worker, (void *)(intptr_t)pool.started);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.started++;
    }
    int usable = pool.started + 1;
    pthread_mutex_unlock(&pool.lock);
    return threads < usable ? threads : usable;
}

static int loop_done(void *chunks) {
    return atomic_load_explicit(&pool.done, memory_order_acquire) >= (uint32_t)(uintptr_t)chunks;
}

void kvf_parallel_for(int64_t n, int64_t per_chunk, kvf_body body, void *ctx) {
    if (n <= 0) return;
    if (per_chunk < 1) per_chunk = 1;
    if ((n + per_chunk - 1) / per_chunk > KVF_MAX_CHUNKS) per_chunk = (n + KVF_MAX_CHUNKS - 1) / KVF_MAX_CHUNKS;
    uint32_t chunks = (uint32_t)((n + per_chunk - 1) / per_chunk);
    int idle = 0;
    if (chunks == 1 || ensure_workers() < 2 ||
        !atomic_compare_exchange_strong(&pool.busy, &idle, 1)) {
        body(ctx, 0, n);
        return;
    }
    pool.body = body, pool.ctx = ctx, pool.n = n, pool.per = per_chunk;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    uint64_t gen = (atomic_load_explicit(&pool.claim, memory_order_relaxed) >> 32) + 1;
    atomic_store(&pool.claim, gen << 32 | (uint64_t)chunks << 16);
    atomic_fetch_add(&pool.seq, 1);
    if (atomic_load(&pool.sleepers)) futex_wake(&pool.seq, INT_MAX);
    run_chunks();
    void *arg = (void *)(uintptr_t)chunks;
    while (!spin_until(loop_done, arg)) { /* a claimed chunk is still running elsewhere */
        atomic_store(&pool.caller_asleep, 1);
        uint32_t done = atomic_load(&pool.done);
        if (done < chunks) futex_wait(&pool.done, done);
        atomic_store(&pool.caller_asleep, 0);
    }
    atomic_store_explicit(&pool.busy, 0, memory_order_release);
}

int kvf_pool_threads(void) {
    int threads = atomic_load(&pool.threads);
    return threads ? threads : cores();
}

/* Python's view (kvflow/kernels/cpu/pool.py): threads <= 0 means every usable core;
 * spin_us < 0 leaves the spin time as it is. */
void kvflow_pool_configure(int threads, int spin_us) {
    atomic_store(&pool.threads, threads > 0 ? threads : cores());
    if (spin_us >= 0) atomic_store(&pool.spin_ns, spin_us * 1000);
}

int kvflow_pool_threads(void) { return kvf_pool_threads(); }
