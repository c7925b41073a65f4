# Serving benchmark (benchmarks/bench_serving.py): kvflow vs `transformers serve
# --continuous-batching` on the same prompts, and kvflow's radix cache on vs off on a
# shared-prefix workload; writes benchmarks/results/serving.md and serving.json.
# BENCH_SERVING_ARGS adds flags, e.g. BENCH_SERVING_ARGS="--only kvflow" or
# "--concurrency 1,32 --fixed-requests 1=8,32=64" (see `$(PY) benchmarks/bench_serving.py compare -h`).
BENCH_SERVING_ARGS ?=

.PHONY: bench-serving
bench-serving: $(STAMP) ## serving benchmark: kvflow vs transformers serve, radix on/off (benchmarks/results/serving.md)
	$(PY) benchmarks/bench_serving.py compare $(BENCH_SERVING_ARGS)

# Mixed chunked prefill: kvflow with and without --enable-mixed-chunk, 32 clients, 64
# requests (arrivals keep coming while others decode), alternating rounds.
.PHONY: bench-mixed-chunk
bench-mixed-chunk: $(STAMP) ## ITL p50/p99 with and without mixed chunked prefill, 32 clients (benchmarks/results/mixed-chunk-96.md)
	$(PY) benchmarks/bench_serving.py compare --only kvflow --workloads fixed --concurrency 32 \
	  --fixed-requests 32=64 --rounds 2 --out benchmarks/results/mixed-chunk-96.md

# Router benchmark (benchmarks/bench_router.py): kvflow router vs sglang-router (installed
# on first use into $(KVFLOW_CACHE_DIR or ~/.cache/kvflow)/venvs/sglang-router-0.3.2):
# overhead over a fast load target at 1/32/256 streams, and cache_aware vs power_of_two vs
# round_robin (and sglang-router's cache_aware) over 4 kvflow serve workers; ~15 minutes
# on 2 cores. BENCH_ROUTER_ARGS adds flags, e.g. "--parts overhead --rounds 3".
BENCH_ROUTER_ARGS ?=

.PHONY: bench-router
bench-router: $(STAMP) ## router overhead and cache-aware value vs sglang-router (benchmarks/results/router.md)
	$(PY) benchmarks/bench_router.py run $(BENCH_ROUTER_ARGS)

# KV transfer between two processes over the Mooncake transport on loopback TCP, in the
# embedded model's KV shape. BENCH_KV_TRANSFER_ARGS adds flags, e.g. "--seconds 5".
BENCH_KV_TRANSFER_ARGS ?=

.PHONY: bench-kv-transfer
bench-kv-transfer: $(STAMP) ## KV transfer GB/s, two processes, Mooncake over loopback TCP (benchmarks/results/kv-transfer.md)
	$(PY) benchmarks/bench_kv_transfer.py $(BENCH_KV_TRANSFER_ARGS)

# Prefill/decode disaggregation (benchmarks/bench_pd.py): 1 prefill + 1 decode behind kvflow
# router (PD mode) vs one unified kvflow serve behind kvflow router --worker-urls, same
# prompts, alternating rounds; the KV transfer's share of TTFT from the prefill's /metrics.
# ~10 minutes on 2 cores. BENCH_PD_ARGS adds flags, e.g. "--rounds 3 --concurrency 1,8".
# The long-prefill interference mode (`bench_pd.py interference`) is for the GPU machine.
BENCH_PD_ARGS ?=

.PHONY: bench-pd
bench-pd: $(STAMP) ## PD (prefill + decode) vs unified: TTFT, tok/s, KV transfer share and GB/s (benchmarks/results/pd.md)
	$(PY) benchmarks/bench_pd.py compare $(BENCH_PD_ARGS)

# CPU serving under contention (benchmarks/bench_cpu_contention.py): single-stream and
# 32-client tok/s of the OpenMP kernels (commit 08c8332) vs this tree's default and one
# thread, each idle and with a busy process on the last core, rounds alternating; ~8-15
# minutes on a shared 2-core machine. BENCH_CPU_CONTENTION_ARGS adds flags, e.g.
# "--rounds 2 --clients 0".
BENCH_CPU_CONTENTION_ARGS ?=

.PHONY: bench-cpu-contention
bench-cpu-contention: $(STAMP) ## CPU decode with a competing busy process: OpenMP vs kernel pool (benchmarks/results/cpu-contention.md)
	$(PY) benchmarks/bench_cpu_contention.py --out benchmarks/results/cpu-contention.md $(BENCH_CPU_CONTENTION_ARGS)

# HiCache (benchmarks/bench_hicache.py): multi-turn TTFT with the tiers off, L2, L2 + file
# store, L2 + Mooncake store (a real mooncake_master on loopback), working set ~4x the
# capped device pool; and a new instance's first-request TTFT against a warm vs an empty
# store. ~20 minutes on 2 cores. BENCH_HICACHE_ARGS adds flags, e.g. "--parts warm".
BENCH_HICACHE_ARGS ?=

.PHONY: bench-hicache
bench-hicache: $(STAMP) ## HiCache tiers: multi-turn TTFT off/L2/L2+file/L2+mooncake, warm start (benchmarks/results/hicache.md)
	$(PY) benchmarks/bench_hicache.py $(BENCH_HICACHE_ARGS)

# Speculative decoding (benchmarks/bench_spec.py): NGRAM vs no speculation on the embedded
# model at one stream, a workload that quotes its prompt and one that does not, rounds
# interleaved, outputs checked token for token; ~10 minutes on 2 cores. The GPU mode
# (`bench_spec.py gpu`: Llama-3.1-8B shapes, forced accept lengths, STANDALONE) is for the
# accelerator machine. BENCH_SPEC_ARGS adds flags, e.g. "--rounds 5".
BENCH_SPEC_ARGS ?=

.PHONY: bench-spec
bench-spec: $(STAMP) ## speculative decoding: NGRAM vs none at one stream, quoting and fresh workloads (benchmarks/results/spec.md)
	$(PY) -P benchmarks/bench_spec.py cpu --out benchmarks/results/spec.md $(BENCH_SPEC_ARGS)

# CPU peer benchmark (benchmarks/bench_cpu_peer.py): kvflow serve's defaults vs llama.cpp's
# llama-server (built on first use from the llama.cpp vendored in PyPI's llama-cpp-python
# sdist, cached under ~/.cache/kvflow), same prompts, alternating rounds.
BENCH_CPU_PEER_ARGS ?=

.PHONY: bench-cpu-peer
bench-cpu-peer: $(STAMP) ## kvflow (defaults and --quantization gguf) vs llama.cpp's llama-server on CPU, 1/8/32 clients (benchmarks/results/cpu-peer.md)
	$(PY) benchmarks/bench_cpu_peer.py --out benchmarks/results/cpu-peer.md $(BENCH_CPU_PEER_ARGS)

# Start-up benchmark (benchmarks/bench_startup.py): `kvflow serve` to /health 200, rounds
# alternating between the trees given with --tree LABEL=PYTHONPATH_DIR (default: this one).
BENCH_STARTUP_ARGS ?=

.PHONY: bench-startup
bench-startup: $(STAMP) ## kvflow serve from the command to /health 200, and its memory then (benchmarks/results/startup.md)
	$(PY) benchmarks/bench_startup.py --out benchmarks/results/startup.md $(BENCH_STARTUP_ARGS)
