#!/usr/bin/env bash
# One device-tool call (issue 29): the same-host KV transports on one GPU. The cuda_ipc GPU
# tests (tests/gpu/test_gpu_kv_transfer.py), then benchmarks/bench_kv_transfer_gpu.py:
# kvflow's cuda_ipc against Mooncake's nvlink_intra and TCP moving a 4,000-token prompt's
# KV in Llama-3.1-8B's shape between two processes. Results under $OUT: run.log,
# kv-transfer-gpu.json. Carried: .whl/grammar, .whl/http, .whl/mooncake-cuda.tar.xz
# (benchmarks/gpu_pd_prep.sh), as gpu_pd_run.sh.
#
#   bash benchmarks/gpu_kv_transfer_run.sh
set -u
STOP_AT=${STOP_AT:-500}
source benchmarks/pd/device.sh
env_lines
timeout 240 $PYTHON -P -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_kv_transfer.py
timeout $(($(left) - 10)) $PYTHON -P benchmarks/bench_kv_transfer_gpu.py --out "$OUT/kv-transfer-gpu.json"
