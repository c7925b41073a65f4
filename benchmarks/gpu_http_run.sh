#!/usr/bin/env bash
# One device-tool call on the GPU machine (issue 16): `kvflow serve` with Llama-3.1-8B shapes
# (dummy weights) driven by SGLang's own `python -m sglang.bench_serving`, and/or the GPU
# test suite. Writes everything under $OUT (the device tool's output folder).
#
#   bash benchmarks/gpu_http_run.sh http    # server + bench_serving (CI workload, then online)
#   bash benchmarks/gpu_http_run.sh tests   # pytest -m gpu tests/gpu tests/kernels
#
# Carried (gitignored, prepared on the dev machine; see benchmarks/results/gpu.md, "HTTP"):
#   .whl/grammar/*.whl, .whl/http/*.whl   cp312 wheels the GPU machine lacks
#   .bench_http/tokenizer/                SmolLM2's tokenizer.json + tokenizer_config.json
#   .bench_http/sglang/                   the files of SGLang 0.5.23 that bench_serving loads
set -u
MODE=${1:-http}
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

if [ "$MODE" = tests ]; then
  set -o pipefail
  timeout 560 python3 -P -m pytest -m gpu tests/gpu tests/kernels -q -p no:cacheprovider \
    -o timeout=240 2>&1 | tee "$OUT/pytest.log"
  echo "pytest rc=$? after $(( $(date +%s) - T0 )) s"
  exit 0
fi

PORT=30000
TOK=.bench_http/tokenizer
python3 -P -m kvflow serve --model-path llama-3.1-8b --load-format dummy --tokenizer-path "$TOK" \
  --dtype bfloat16 --max-running-requests 256 --cuda-graph-max-bs 256 \
  --host 127.0.0.1 --port $PORT > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 300); do
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
  --dataset-name random-ids --random-input-len 4096 --random-output-len 2048
  --random-range-ratio 0)
# SGLang's CI workload: 500 prompts, all at once.
timeout 420 "${BENCH[@]}" --num-prompts 500 --output-file "$OUT/ci.jsonl" 2>&1 | tee "$OUT/bench-ci.log"
echo "ci done after $(( $(date +%s) - T0 )) s"
# Online: 100 prompts at 1 request/s, if the call has time left.
if [ $(( $(date +%s) - T0 )) -lt 380 ]; then
  timeout $(( 560 - ($(date +%s) - T0) )) "${BENCH[@]}" --num-prompts 100 --request-rate 1 \
    --output-file "$OUT/online.jsonl" 2>&1 | tee "$OUT/bench-online.log"
  echo "online done after $(( $(date +%s) - T0 )) s"
fi
kill $SERVER
wait $SERVER
tail -5 "$OUT/server.log"
