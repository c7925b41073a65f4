#!/usr/bin/env bash
# One device-tool call on the GPU machine (issue 16): `kvflow serve` with Llama-3.1-8B shapes
# (dummy weights) driven by SGLang's own `python -m sglang.bench_serving`, and/or the GPU
# test suite. Writes everything under $OUT (the device tool's output folder).
#
#   bash benchmarks/gpu_http_run.sh http    # server + bench_serving (CI workload, then online)
#   bash benchmarks/gpu_http_run.sh tests   # pytest -m gpu tests/gpu tests/kernels
#   bash benchmarks/gpu_http_run.sh all [S] # tests, then http until S seconds (default 480)
#   TESTS="tests/kernels/x.py ..." bash benchmarks/gpu_http_run.sh smoke [S]
#       those tests, then the server and a small bench_serving run (32 prompts, input <= 1024,
#       output <= 128, CUDA graphs up to batch 32) until S seconds: checks the chain works
#
# Carried (gitignored, prepared on the dev machine; see benchmarks/results/gpu.md, "HTTP"):
#   .whl/grammar/*.whl, .whl/http/*.whl   cp312 wheels the GPU machine lacks
#   .bench_http/tokenizer/                SmolLM2's tokenizer.json + tokenizer_config.json
#   .bench_http/sglang/                   the files of SGLang 0.5.23 that bench_serving loads
set -u
MODE=${1:-http}
STOP_AT=${2:-480}  # all: seconds after the start by which the http part must end
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T0=$(date +%s)
source scripts/device_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/grammar/*.whl .whl/http/*.whl || exit 1
export PYTHONPATH="$PYTHONPATH:/tmp/site"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{
  date -u; git log -1 --format='commit %H %s' 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'
  python3 -c 'import fastapi, uvicorn, zmq, pydantic; print("fastapi", fastapi.__version__, "uvicorn", uvicorn.__version__, "pyzmq", zmq.__version__, "pydantic", pydantic.__version__)'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

SERVER_FLAGS=(--max-running-requests 256 --cuda-graph-max-bs 256)
SIZE=(--num-prompts 500 --random-input-len 4096 --random-output-len 2048)
if [ "$MODE" = smoke ]; then
  SERVER_FLAGS=(--max-running-requests 32 --cuda-graph-max-bs 32)
  SIZE=(--num-prompts 32 --random-input-len 1024 --random-output-len 128)
  timeout 100 python3 -P -m pytest -m gpu ${TESTS:-tests/gpu} -q -p no:cacheprovider \
    -o timeout=60 -rfE 2>&1 | tee "$OUT/pytest.log"
  echo "pytest rc=${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s"
elif [ "$MODE" = tests ] || [ "$MODE" = all ]; then
  LIMIT=560
  [ "$MODE" = all ] && LIMIT=290
  timeout $LIMIT python3 -P -m pytest -m gpu tests/gpu tests/kernels -q -p no:cacheprovider \
    -o timeout=200 -rfE 2>&1 | tee "$OUT/pytest.log"
  echo "pytest rc=${PIPESTATUS[0]} after $(( $(date +%s) - T0 )) s"
  [ "$MODE" = tests ] && exit 0
else
  STOP_AT=560
fi

PORT=30000
TOK=.bench_http/tokenizer
python3 -P -m kvflow serve --model-path llama-3.1-8b --load-format dummy --tokenizer-path "$TOK" \
  --dtype bfloat16 "${SERVER_FLAGS[@]}" \
  --host 127.0.0.1 --port $PORT > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 $(( STOP_AT - ($(date +%s) - T0) ))); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" \
    2> /dev/null && break
  kill -0 $SERVER 2> /dev/null || { echo "server exited"; tail -40 "$OUT/server.log"; exit 1; }
  sleep 1
done
echo "server up after $(( $(date +%s) - T0 )) s"
python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$PORT/get_server_info').read().decode())" \
  > "$OUT/server_info.json"

# The client: SGLang's files first on the path, the kvflow shim not needed.
BENCH=(env CUDA_VISIBLE_DEVICES= PYTHONPATH=".bench_http/sglang:/tmp/site" python3 -P -m sglang.bench_serving
  --backend sglang-oai --host 127.0.0.1 --port $PORT --tokenizer "$TOK"
  --dataset-name random-ids --random-range-ratio 0)
# SGLang's CI workload: 500 prompts, all at once.
timeout $(( STOP_AT - ($(date +%s) - T0) )) "${BENCH[@]}" "${SIZE[@]}" --output-file "$OUT/ci.jsonl" 2>&1 | tee "$OUT/bench-ci.log"
echo "ci done after $(( $(date +%s) - T0 )) s"
# Online: 100 prompts at 1 request/s, if the call has time left.
if [ $(( $(date +%s) - T0 )) -lt $(( STOP_AT - 180 )) ]; then
  timeout $(( STOP_AT - ($(date +%s) - T0) )) "${BENCH[@]}" --random-input-len 4096 --random-output-len 2048 --num-prompts 100 --request-rate 1 \
    --output-file "$OUT/online.jsonl" 2>&1 | tee "$OUT/bench-online.log"
  echo "online done after $(( $(date +%s) - T0 )) s"
fi
kill $SERVER
wait $SERVER
tail -5 "$OUT/server.log"
