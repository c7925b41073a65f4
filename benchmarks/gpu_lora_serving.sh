#!/usr/bin/env bash
# One device-tool call on one GPU (issue 28): SGLang's LoRA serving bar. `kvflow serve` with
# Llama-3.1-8B shapes (dummy weights) and --enable-lora, four random PEFT adapters resident
# (a, c: rank 16; b, d: rank 64; all seven projections of every layer), driven by SGLang's
# own `python -P -m sglang.bench_serving`: 400 prompts at 8 requests/s, 256 input and 256
# output tokens each (--random-range-ratio 1; dataset random-ids: SGLang's `random` reads
# ShareGPT, which the GPU machine cannot download). Phases, one server:
#
#   warm   32 prompts over the four adapters, not judged: Triton's LoRA kernels compile
#   base   the base model (no --lora-name): the reference, no target
#   lora   each request on one of a b c d (--lora-name a b c d, uniform):
#          median TTFT < 58 ms, median end-to-end latency < 2,400 ms
#   churn  the same while benchmarks/lora_serving.py loads and unloads two more adapters
#          (e: rank 16, f: rank 64) through /load_lora_adapter and /unload_lora_adapter
#          the whole time: < 80 ms and < 4,000 ms, and no load/unload call failed
#
# The radix cache is flushed before each phase. Each phase ends by PHASE_S after its start
# and by STOP_AT after the call's; then the load/unload loop's last call (20 s at most) and
# the server's stop (15 s at most): the whole call ends within STOP_AT + ~40 s (< 9 minutes).
# Back in $OUT (8 files at most): run.log (everything printed), server.log, server_info.json,
# bench-{base,lora,churn}.jsonl (bench_serving's JSON, with per-request details),
# churn.json (each load/unload call) and summary.json (targets, pass/fail). Exit status 1
# when bench_serving cannot start or a phase has no result, 0 otherwise (pass/fail is in
# summary.json).
#
#   device tool, carry [".whl", ".bench_http"] (made by benchmarks/gpu_http_prep.sh):
#     bash benchmarks/gpu_lora_serving.sh
#   LORA_LOCAL=1 PYTHON=.venv/bin/python bash benchmarks/gpu_lora_serving.sh
#     CPU dry run here: a 4-layer float32 Llama of the 8B config's shape, 16 prompts of 32
#     tokens in, 8 out, at 4/s (NUM_PROMPTS, RATE, INPUT_LEN, OUTPUT_LEN override);
#     CLIENT_SITE: folders (:-joined) with the packages bench_serving needs and the venv lacks
#
# PHASE_S covers bench_serving's own start (on the H200 host ~25-40 s: its tokenizer, the
# prompts) as well as the 50 s of arrivals: 85 s was enough there, 60 s cut every phase.
#
# Environment: OUT (/tmp/out), STOP_AT (490), PHASE_S (120), PHASES ("base lora churn"),
# BACKEND (sglang: /generate with lora_path and --tokenize-prompt; or sglang-oai:
# /v1/completions with model = lora_path = the adapter), CHURN_PAUSE_S (0: seconds between
# two load/unload calls), CHURN_RANKS ("16 64": e's and f's ranks), SGLANG_FILES
# (.bench_http/sglang), TOK (.bench_http/tokenizer).
set -u
OUT=${OUT:-/tmp/out}
LOCAL=${LORA_LOCAL:-0}
STOP_AT=${STOP_AT:-490}
PHASE_S=${PHASE_S:-120}
PHASES=${PHASES:-base lora churn}
BACKEND=${BACKEND:-sglang}
CHURN_PAUSE_S=${CHURN_PAUSE_S:-0}
read -r RANK_E RANK_F <<< "${CHURN_RANKS:-16 64}"
SGLANG_FILES=${SGLANG_FILES:-.bench_http/sglang}
TOK=${TOK:-.bench_http/tokenizer}
PORT=${PORT:-30000}
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
left() { echo $((STOP_AT - $(elapsed))); }
exec > >(tee -a "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

ADAPTER_DIR=$(mktemp -d /tmp/kvflow-lora-serving.XXXXXX)
if [ "$LOCAL" = 1 ]; then
  PYTHON=${PYTHON:-.venv/bin/python}
  CONFIG=$ADAPTER_DIR/tiny/config.json
  mkdir -p "$(dirname "$CONFIG")"
  sed -e 's/"hidden_size": 4096/"hidden_size": 256/' -e 's/"intermediate_size": 14336/"intermediate_size": 512/' \
    -e 's/"num_hidden_layers": 32/"num_hidden_layers": 4/' -e 's/"num_attention_heads": 32/"num_attention_heads": 4/' \
    -e 's/"num_key_value_heads": 8/"num_key_value_heads": 2/' -e 's/"head_dim": 128/"head_dim": 64/' \
    -e 's/"torch_dtype": "bfloat16"/"torch_dtype": "float32"/' runtime/configs/llama-3.1-8b.json > "$CONFIG"
  MODEL=(--model-path "$CONFIG" --load-format dummy --dtype float32 --device cpu)
  SERVER_FLAGS=(--max-running-requests 16)
  NUM_PROMPTS=${NUM_PROMPTS:-16} RATE=${RATE:-4} INPUT_LEN=${INPUT_LEN:-32} OUTPUT_LEN=${OUTPUT_LEN:-8}
  WARM_PROMPTS=4
  CLIENT_PATH=$SGLANG_FILES${CLIENT_SITE:+:$CLIENT_SITE}
else
  PYTHON=python3
  CONFIG=runtime/configs/llama-3.1-8b.json
  source scripts/device_env.sh
  install_server_wheels || { echo "FAILED: the carried wheels (.whl/) did not install"; exit 1; }
  MODEL=(--model-path llama-3.1-8b --load-format dummy --dtype bfloat16)
  # ~20 requests in flight at 8/s and 2.4 s each; room for twice that under churn
  SERVER_FLAGS=(--max-running-requests 128 --cuda-graph-max-bs 128)
  NUM_PROMPTS=${NUM_PROMPTS:-400} RATE=${RATE:-8} INPUT_LEN=${INPUT_LEN:-256} OUTPUT_LEN=${OUTPUT_LEN:-256}
  WARM_PROMPTS=32
  CLIENT_PATH=$SGLANG_FILES:/tmp/site
fi
HELPER=(env PYTHONPATH="${PYTHONPATH:-}" $PYTHON -P benchmarks/lora_serving.py)

SERVER=
CHURN=
stop_all() {  # what this script started: the server's process group, the churn loop
  [ -n "$CHURN" ] && kill "$CHURN" 2> /dev/null
  if [ -n "$SERVER" ]; then
    kill -TERM -- "-$SERVER" 2> /dev/null
    for _ in $(seq 15); do kill -0 -- "-$SERVER" 2> /dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER" 2> /dev/null
    tail -3 "$OUT/server.log"
  fi
  SERVER= CHURN=
  rm -rf "$ADAPTER_DIR"
}
trap stop_all EXIT
fail() { echo "FAILED after $(elapsed) s: $*"; exit 1; }

{
  date -u
  git log -1 --format='commit %H %s' 2> /dev/null || true
  git status --short 2> /dev/null | grep -v '^??' | sed 's/^/uncommitted: /'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2> /dev/null
  $PYTHON -P -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'
  echo "workload: $NUM_PROMPTS prompts at $RATE/s, $INPUT_LEN in, $OUTPUT_LEN out; phases: $PHASES; backend $BACKEND"
}

# The client: SGLang's files first on the path; no GPU (with CUDA visible SGLang's import
# chain loads sgl_kernel, which is not there). Checked before anything else starts.
BENCH=(env CUDA_VISIBLE_DEVICES= PYTHONPATH="$CLIENT_PATH" $PYTHON -P -m sglang.bench_serving
  --backend "$BACKEND" --host 127.0.0.1 --port "$PORT" --tokenizer "$TOK"
  --dataset-name random-ids --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN"
  --random-range-ratio 1 --seed 1)
[ "$BACKEND" = sglang ] && BENCH+=(--tokenize-prompt)
timeout 60 "${BENCH[@]}" --help > /dev/null ||
  fail "sglang.bench_serving does not start (PYTHONPATH=$CLIENT_PATH): see the error above"

# Adapters: a-d resident from the start, e and f for the load/unload loop.
timeout 120 "${HELPER[@]}" adapters "$CONFIG" "$ADAPTER_DIR" a:16 b:64 c:16 d:64 e:$RANK_E f:$RANK_F ||
  fail "the adapters were not written"
echo "adapters written after $(elapsed) s"

setsid $PYTHON -P -m kvflow serve "${MODEL[@]}" --tokenizer-path "$TOK" "${SERVER_FLAGS[@]}" \
  --enable-lora --max-lora-rank 64 --max-loras-per-batch 6 \
  --lora-paths a="$ADAPTER_DIR/a" b="$ADAPTER_DIR/b" c="$ADAPTER_DIR/c" d="$ADAPTER_DIR/d" \
  --host 127.0.0.1 --port "$PORT" > "$OUT/server.log" 2>&1 &
SERVER=$!
until $PYTHON -P -c "import urllib.request as u; u.urlopen('$URL/health', timeout=2)" 2> /dev/null; do
  kill -0 "$SERVER" 2> /dev/null || { tail -40 "$OUT/server.log"; fail "the server exited"; }
  [ "$(left)" -gt "$PHASE_S" ] || { tail -20 "$OUT/server.log"; fail "the server is not up"; }
  sleep 1
done
echo "server up after $(elapsed) s"
$PYTHON -P -c "import urllib.request as u; print(u.urlopen('$URL/get_server_info').read().decode())" \
  > "$OUT/server_info.json"

flush() {  # empties the radix cache, so no phase reuses an earlier phase's prompts
  $PYTHON -P -c "import urllib.request as u; u.urlopen(u.Request('$URL/flush_cache', method='POST'), timeout=30)"
}
bench() {  # NAME FILE ARGS...: one bench_serving run, bounded by PHASE_S and the call's time
  local name=$1 file=$2 limit
  shift 2
  limit=$(($(left) < PHASE_S ? $(left) : PHASE_S))
  [ "$limit" -gt 20 ] || { echo "phase $name skipped: $(left) s left"; return 1; }
  flush
  echo "=== phase $name ($(elapsed) s, at most $limit s)"
  timeout "$limit" "${BENCH[@]}" --output-file "$file" "$@"
  local rc=$?
  echo "=== phase $name: rc $rc after $(elapsed) s"
  [ -s "$file" ] || { echo "phase $name: no result from bench_serving"; return 1; }
}
ADAPTERS=(--lora-name a b c d)
PHASE_ARGS=(--num-prompts "$NUM_PROMPTS" --request-rate "$RATE" --output-details)

bench warm "$ADAPTER_DIR/warm.jsonl" --num-prompts "$WARM_PROMPTS" --request-rate inf "${ADAPTERS[@]}" ||
  fail "bench_serving did not complete the warm-up phase (client or server broken)"
status=0
for phase in $PHASES; do
  case $phase in
    base) bench base "$OUT/bench-base.jsonl" "${PHASE_ARGS[@]}" || status=1 ;;
    lora) bench lora "$OUT/bench-lora.jsonl" "${PHASE_ARGS[@]}" "${ADAPTERS[@]}" || status=1 ;;
    churn)
      "${HELPER[@]}" churn "$URL" e="$ADAPTER_DIR/e" f="$ADAPTER_DIR/f" --pause "$CHURN_PAUSE_S" \
        --seconds "$PHASE_S" --timeout 20 --json-out "$OUT/churn.json" &
      CHURN=$!
      bench churn "$OUT/bench-churn.jsonl" "${PHASE_ARGS[@]}" "${ADAPTERS[@]}" || status=1
      kill "$CHURN" 2> /dev/null
      wait "$CHURN"
      CHURN=
      ;;
    *) fail "unknown phase $phase" ;;
  esac
done
$PYTHON -P -c "import urllib.request as u; print(u.urlopen('$URL/v1/models').read().decode())"
stop_all
SETUP="{\"backend\": \"$BACKEND\", \"local\": $LOCAL, \"churn_pause_s\": $CHURN_PAUSE_S,"
SETUP+=" \"adapters\": {\"resident\": {\"a\": 16, \"b\": 64, \"c\": 16, \"d\": 64},"
SETUP+=" \"churned\": {\"e\": $RANK_E, \"f\": $RANK_F}}, \"max_loras_per_batch\": 6, \"max_lora_rank\": 64}"
"${HELPER[@]}" summary "$OUT" --phases $PHASES --num-prompts "$NUM_PROMPTS" --rate "$RATE" \
  --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --setup "$SETUP" > /dev/null || status=1
$PYTHON -P -c "
import json; s = json.load(open('$OUT/summary.json'))
for name, p in s['phases'].items():
    print(name, {k: p.get(k) for k in ('completed', 'median_ttft_ms', 'median_e2e_latency_ms', 'passed', 'why')})
print('passed' if s['passed'] else 'NOT passed')"
echo "end after $(elapsed) s"
exit $status
