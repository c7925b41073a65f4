#!/usr/bin/env bash
# One device-tool call on the GPU machine (issue 16): `kvflow serve` with Llama-3.1-8B shapes
# (dummy weights) driven by SGLang's own `python -m sglang.bench_serving`, the offline engine
# on the same workload, and/or the GPU test suite. Writes everything under $OUT (the device
# tool's output folder: at most 8 files come back, so the clients' output goes to run.log).
# Each step runs only if the call has time left for it (STOP_AT). On the H100 the server
# starts in ~80 s, the CI workload takes ~145 s, online ~120 s, offline throughput ~150 s
# and offline online ~140 s: all three default steps do not fit one 600 s call (the offline
# step is then skipped), two do.
#
#   bash benchmarks/gpu_http_run.sh http     # sglang-oai: CI workload, online; then offline
#   bash benchmarks/gpu_http_run.sh native   # sglang (/generate, --tokenize-prompt): CI, online
#   STEPS="ci offline" bash benchmarks/gpu_http_run.sh native   # a subset of the steps
#   STEPS="online offline" OFFLINE_PARTS=online bash ...  # bench_gpu.py's online replay offline
#   bash benchmarks/gpu_http_run.sh tests    # pytest -m gpu tests/gpu tests/kernels
#   MODEL=llama-3.1-70b TP=4 bash benchmarks/gpu_http_run.sh http   # tensor parallel, 4 GPUs
#   MODEL=llama-3.1-8b TP=2 bash benchmarks/gpu_http_run.sh http    # (run on 4 H200s:
#       benchmarks/results/tp.md)
#   EXTRA_FLAGS="--quantization fp8" STEPS=ci bash benchmarks/gpu_http_run.sh http
#       more `kvflow serve` flags (split on spaces): FP8 weights, --kv-cache-dtype fp8_e4m3
#   MODEL=qwen3-30b-a3b STEPS=ci bash benchmarks/gpu_http_run.sh http   # another family's shape
#   EMULATE_GPU_MIB=81559 ... bash benchmarks/gpu_http_run.sh http
#       the KV pool an 80 GB H100 (81,559 MiB) would get at --mem-fraction-static 0.88:
#       the fraction is scaled by that total over this GPU's, so the reserve left out of
#       the pool is this GPU's total minus 0.88 of the emulated one (the pool's size, not
#       the H100's bandwidth or compute)
#   PORT=30001 CUDA_VISIBLE_DEVICES=1 ...    # a second server on another GPU of the host
#   TESTS="tests/kernels/x.py ..." bash benchmarks/gpu_http_run.sh smoke
#       those tests, then the server and a small bench_serving run (32 prompts, input <= 1024,
#       output <= 128, CUDA graphs up to batch 32): checks the chain works
#
#   CI workload: 500 prompts, input uniform in [1, 4096], output uniform in [1, 2048], all
#   at once (SGLang's offline-throughput CI bar). Online: 100 such prompts at 1 request/s.
#   Offline: benchmarks/bench_gpu.py throughput (its own draw of the same distributions
#   through Engine.generate, no HTTP), after the server has exited, so the HTTP cost shows
#   as a ratio of rates.
#
# Carried (gitignored, prepared on the dev machine by benchmarks/gpu_http_prep.sh):
#   .whl/grammar/*.whl, .whl/http/*.whl   cp312 wheels the GPU machine lacks
#   .bench_http/tokenizer/                SmolLM2's tokenizer padded to 128,256 ids
#   .bench_http/sglang/                   the files of SGLang 0.5.23 that bench_serving loads
set -u
MODE=${1:-http}
STOP_AT=${2:-570}  # seconds after the start by which every step must have ended
STEPS=${STEPS:-ci online offline}  # which of the steps below run
OFFLINE_PARTS=${OFFLINE_PARTS:-throughput}  # bench_gpu.py parts of the offline step
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-llama-3.1-8b}  # a shipped dummy config (runtime/configs/): qwen3-8b, gemma-2-9b...
TP=${TP:-1}  # --tp-size: 2 for 8B, 4 or 8 for 70B on a several-GPU machine
mkdir -p "$OUT"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( STOP_AT - $(elapsed) )); }
source scripts/device_env.sh
install_server_wheels || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{
  date -u; git log -1 --format='commit %H %s' 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'
  python3 -c 'import fastapi, uvicorn, zmq, pydantic; print("fastapi", fastapi.__version__, "uvicorn", uvicorn.__version__, "pyzmq", zmq.__version__, "pydantic", pydantic.__version__)'
  nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

SERVER_FLAGS=(--max-running-requests 256 --cuda-graph-max-bs 256)
read -r -a EXTRA <<< "${EXTRA_FLAGS:-}"  # more serve flags, e.g. --quantization fp8
if [ -n "${EMULATE_GPU_MIB:-}" ]; then
  GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "${CUDA_VISIBLE_DEVICES:-0}" | head -1)
  FRACTION=$(python3 -c "print(round(0.88 * $EMULATE_GPU_MIB / $GPU_MIB, 4))")
  echo "KV pool as on a $EMULATE_GPU_MIB MiB GPU: --mem-fraction-static $FRACTION of $GPU_MIB MiB" | tee -a "$OUT/env.txt"
  SERVER_FLAGS+=(--mem-fraction-static "$FRACTION")
fi
CI=(--num-prompts 500 --random-input-len 4096 --random-output-len 2048)
ONLINE=(--num-prompts 100 --random-input-len 4096 --random-output-len 2048 --request-rate 1)
CLIENT=(--backend sglang-oai)
case "$MODE" in
  http) ;;
  native) CLIENT=(--backend sglang --tokenize-prompt) ;;
  smoke)
    SERVER_FLAGS=(--max-running-requests 32 --cuda-graph-max-bs 32)
    CI=(--num-prompts 32 --random-input-len 1024 --random-output-len 128)
    ONLINE=()
    STEPS=ci
    timeout 100 python3 -P -m pytest -m gpu ${TESTS:-tests/gpu} -q -p no:cacheprovider \
      -o timeout=60 -rfE 2>&1 | tee "$OUT/pytest.log"
    echo "pytest rc=${PIPESTATUS[0]} after $(elapsed) s"
    ;;
  tests)
    timeout "$(left)" python3 -P -m pytest -m gpu tests/gpu tests/kernels -q -p no:cacheprovider \
      -o timeout=200 -rfE 2>&1 | tee "$OUT/pytest.log"
    echo "pytest rc=${PIPESTATUS[0]} after $(elapsed) s"
    exit 0
    ;;
  *) echo "unknown mode $MODE"; exit 2 ;;
esac

PORT=${PORT:-30000}
# The embedded tokenizer resized to this shape's vocabulary (benchmarks/bench_tokenizer.py).
VOCAB=$(python3 -P -c "import json; from kvflow.runtime.config import DUMMY_CONFIGS as C; print(json.load(open(C['$MODEL']))['vocab_size'])") || exit 1
TOK=/tmp/bench-tokenizer-$VOCAB-$PORT  # (one per server: two may start at once)
python3 -P benchmarks/bench_tokenizer.py .bench_http/tokenizer "$TOK" "$VOCAB" || exit 1
python3 -P -m kvflow serve --model-path "$MODEL" --tp-size "$TP" --load-format dummy \
  --tokenizer-path "$TOK" --dtype bfloat16 "${SERVER_FLAGS[@]}" ${EXTRA[@]+"${EXTRA[@]}"} \
  --host 127.0.0.1 --port $PORT > "$OUT/server.log" 2>&1 &
SERVER=$!
while [ "$(left)" -gt 0 ]; do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" \
    2> /dev/null && break
  kill -0 $SERVER 2> /dev/null || { echo "server exited"; tail -40 "$OUT/server.log"; exit 1; }
  sleep 1
done
echo "server up after $(elapsed) s"
python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$PORT/get_server_info').read().decode())" \
  > "$OUT/server_info.json"

# The client: SGLang's files first on the path, the kvflow shim not needed; no GPU (with CUDA
# visible SGLang's import chain loads sgl_kernel, which is not there).
BENCH=(env CUDA_VISIBLE_DEVICES= PYTHONPATH=".bench_http/sglang:/tmp/site" python3 -P -m sglang.bench_serving
  "${CLIENT[@]}" --host 127.0.0.1 --port $PORT --tokenizer "$TOK"
  --dataset-name random-ids --random-range-ratio 0)
flush() {  # empties the radix cache, so no run reuses an earlier run's prompts
  python3 -c "import urllib.request as u; u.urlopen(u.Request('http://127.0.0.1:$PORT/flush_cache', method='POST'), timeout=30)"
}
# SGLang's CI workload: 500 prompts, all at once (~140 s at 4,000 output tok/s).
[[ " $STEPS " == *" ci "* ]] && [ "$(left)" -gt 30 ] && timeout "$(left)" "${BENCH[@]}" "${CI[@]}" --output-file "$OUT/ci-$MODE.jsonl" 2>&1 | tee -a "$OUT/run.log"
echo "ci done after $(elapsed) s"
# Online: 100 prompts at 1 request/s (~120 s), if the call has time left.
if [ ${#ONLINE[@]} -gt 0 ] && [[ " $STEPS " == *" online "* ]] && [ "$(left)" -gt 150 ]; then
  flush
  timeout "$(left)" "${BENCH[@]}" "${ONLINE[@]}" --output-file "$OUT/online-$MODE.jsonl" 2>&1 \
    | tee -a "$OUT/run.log"
  echo "online done after $(elapsed) s"
fi
echo "server stats at the end:" >> "$OUT/run.log"
python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$PORT/get_server_info').read().decode())" \
  >> "$OUT/run.log"
kill $SERVER
for _ in $(seq 30); do kill -0 $SERVER 2> /dev/null || break; sleep 1; done
kill -9 $SERVER 2> /dev/null
wait $SERVER
tail -3 "$OUT/server.log"
# The offline engine on the same workload (~40 s to load, ~135 s to run), GPU now free.
if [[ " $STEPS " == *" offline "* ]] && [ "$(left)" -gt 180 ]; then
  timeout "$(left)" python3 -P benchmarks/bench_gpu.py $OFFLINE_PARTS --json-out "$OUT/offline.json" 2>&1 \
    | tee -a "$OUT/run.log"
  echo "offline done after $(elapsed) s"
fi
echo "end after $(elapsed) s"
