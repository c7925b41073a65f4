#!/usr/bin/env bash
# The several-GPU run's checks (issue 33), one device-tool call on a machine of 2+ GPUs:
# the NVLink topology and versions, the multi-GPU tensor-parallel tests (greedy TP 2/4/8
# equal to TP 1, a rank killed mid-stream), and the decode step at batch 1 and 32 with the
# all-reduce share (benchmarks/bench_tp_gpu.py) for Llama-3.1-8B shapes at TP 2 and
# Llama-3.1-70B shapes at TP 4 and 8 where the GPUs are there. Through HTTP, per shape:
#   MODEL=llama-3.1-8b TP=2 bash benchmarks/gpu_http_run.sh http
#   MODEL=llama-3.1-70b TP=4 bash benchmarks/gpu_http_run.sh http
# Carried (gitignored, made by benchmarks/gpu_http_prep.sh): .whl/grammar, .whl/http.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
source scripts/device_env.sh
install_server_wheels || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
GPUS=$(nvidia-smi -L | wc -l)
{
  date -u; git log -1 --format='commit %H %s' 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m
  python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "nccl", torch.cuda.nccl.version())'
  nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout 300 python3 -P -m pytest -m gpu tests/gpu/test_gpu_tp_ranks.py tests/gpu/test_gpu_tp.py \
  -q -s -p no:cacheprovider -o timeout=240 -rfEs 2>&1 | tee "$OUT/pytest.log"
echo "pytest rc=${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s"
bench() {  # model tp
  [ "$GPUS" -ge "$2" ] || return 0
  timeout 240 python3 -P benchmarks/bench_tp_gpu.py --model "$1" --tp "$2" \
    --json-out "$OUT/decode-$1-tp$2.json" 2>&1 | tail -60 >> "$OUT/bench.log"
  echo "decode $1 tp $2 rc=${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s"
}
bench llama-3.1-8b 2
bench llama-3.1-70b 4
bench llama-3.1-70b 8
echo "end after $(( $(date +%s) - T0 )) s"
