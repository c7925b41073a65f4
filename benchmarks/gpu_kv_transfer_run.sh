#!/usr/bin/env bash
# One device-tool call (issues 29 and 34): the same-host KV transports. The cuda_ipc GPU
# tests (tests/gpu/test_gpu_kv_transfer.py, the slot-run kernel's tests; with two GPUs also
# writes into the other GPU), then benchmarks/bench_kv_transfer_gpu.py: kvflow's cuda_ipc
# against Mooncake's nvlink_intra and TCP moving a 4,000-token prompt's KV in
# Llama-3.1-8B's shape between two processes on one GPU, and with two GPUs again with the
# peer on the second (kv-transfer-2gpu.json). Results under $OUT: run.log,
# kv-transfer-gpu.json[, kv-transfer-2gpu.json]. Carried: .whl/grammar, .whl/http, .whl/mooncake-cuda.tar.xz
# (benchmarks/gpu_pd_prep.sh), as gpu_pd_run.sh.
#
#   bash benchmarks/gpu_kv_transfer_run.sh
set -u
STOP_AT=${STOP_AT:-500}
source benchmarks/pd/device.sh
env_lines
nvidia-smi topo -m 2> /dev/null
timeout 240 $PYTHON -P -m pytest -q -p no:cacheprovider -rs -m gpu tests/gpu/test_gpu_kv_transfer.py \
  tests/kernels/test_row_runs.py
GPUS=$($PYTHON -c 'import torch; print(torch.cuda.device_count())')
if [ "$GPUS" -ge 2 ]; then
  timeout $(($(left) / 2)) $PYTHON -P benchmarks/bench_kv_transfer_gpu.py --peer-gpu 1 \
    --out "$OUT/kv-transfer-2gpu.json"
fi
timeout $(($(left) - 10)) $PYTHON -P benchmarks/bench_kv_transfer_gpu.py --out "$OUT/kv-transfer-gpu.json"
