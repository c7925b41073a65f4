/* kvflow's CPU thread pool: the kernels' parallel loops, without OpenMP's team barrier.
 *
 * A loop is cut into chunks that the calling thread and the pool's workers claim one at a
 * time from one atomic word. The caller takes chunks too and then waits only for chunks
 * that some thread has claimed and not finished: a worker that has not woken up (say it is
 * descheduled by another process on a shared machine) holds nothing up, and takes nothing
 * once it wakes to a finished loop. Waiting threads spin briefly (consecutive kernels of a
 * decode step follow each other within microseconds), yielding the core, then sleep on a
 * futex, so a sibling preempted in the middle of a chunk gets the core back at once.
 * See pool.c for the protocol.
 */
#ifndef KVFLOW_CPU_POOL_H
#define KVFLOW_CPU_POOL_H

#include <stdint.h>

/* Runs items [lo, hi) of a loop. */
typedef void (*kvf_body)(void *ctx, int64_t lo, int64_t hi);

/* body(ctx, lo, hi) over [0, n) in chunks of `per_chunk` items (the last may be shorter),
 * in parallel on the pool; returns when every item has run. Runs inline on the calling
 * thread when the pool has one thread, there is one chunk, or another loop is running
 * (concurrent or nested calls). Chunks run in any order, on any thread. */
void kvf_parallel_for(int64_t n, int64_t per_chunk, kvf_body body, void *ctx);

/* Threads a loop may run on, the caller included. */
int kvf_pool_threads(void);

#endif
