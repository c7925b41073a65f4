# Sourced by the device scripts (gpu_pd_run.sh, gpu_pd_interference.sh, gpu_hicache_run.sh): the set-up and
# process handling they share. Before sourcing, the script sets STOP_AT (seconds after the
# start by which everything has ended); after it, the script sets FLAGS (and its workload).
#
#   OUT           results folder (default /tmp/out); run.log there gets all output
#   PD_LOCAL=1    CPU dry run on this machine: a tiny dummy Llama (4 layers, float32) from
#                 runtime/configs/llama-3.1-8b.json and the local venv's Mooncake
#   otherwise     the GPU machine: scripts/device_env.sh, the carried server wheels
#                 (.whl/grammar, .whl/http) and the trimmed Mooncake CUDA wheel
#                 (.whl/mooncake-cuda.tar.xz, made by benchmarks/gpu_pd_prep.sh)
#
# Sets PYTHON, MODEL, LOCAL, PD_LIB, MC (device only) and PGIDS; defines elapsed, left, start,
# router, stop_all (run at exit), up, wait_up and env_lines.

OUT=${OUT:-/tmp/out}
LOCAL=${PD_LOCAL:-0}
mkdir -p "$OUT"
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
left() { echo $((STOP_AT - $(elapsed))); }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PD_LIB=$PWD/benchmarks/pd  # the clients' shared code (generate_stream.py)
# the routers sign each PD pair with it and the decodes check it (docs/disaggregation.md)
export KVFLOW_INTERNAL_KEY=${KVFLOW_INTERNAL_KEY:-$(python3 -c 'import secrets; print(secrets.token_hex(32))')}
exec > >(tee -a "$OUT/run.log") 2>&1

if [ "$LOCAL" = 1 ]; then
  PYTHON=.venv/bin/python
  TINY=/tmp/kvflow-pd-tiny/config.json
  mkdir -p "$(dirname $TINY)"
  sed -e 's/"hidden_size": 4096/"hidden_size": 256/' -e 's/"intermediate_size": 14336/"intermediate_size": 512/' \
    -e 's/"num_hidden_layers": 32/"num_hidden_layers": 4/' -e 's/"num_attention_heads": 32/"num_attention_heads": 4/' \
    -e 's/"num_key_value_heads": 8/"num_key_value_heads": 2/' -e 's/"head_dim": 128/"head_dim": 64/' \
    -e 's/"vocab_size": 128256/"vocab_size": 32000/' -e 's/"torch_dtype": "bfloat16"/"torch_dtype": "float32"/' \
    runtime/configs/llama-3.1-8b.json > $TINY
  MODEL=(--model-path $TINY --load-format dummy --dtype float32)
else
  PYTHON=python3
  source scripts/device_env.sh
  install_server_wheels || exit 1
  # The trimmed Mooncake CUDA wheel: site/ (mooncake/ with engine.so, libasio, libetcd_wrapper
  # and mooncake_transfer_engine.libs/), lib/ (libcudart.so.12: the image has CUDA 13) and
  # syslibs/ (Debian 12's libibverbs, libmlx5, libnuma, libcurl and what they link), of which
  # only those the machine lacks go on the library path.
  MC=/tmp/mooncake-cuda
  mkdir -p $MC/missing
  [ -e $MC/site/mooncake ] || tar -C $MC -xJf .whl/mooncake-cuda.tar.xz || exit 1
  HAVE=$(ldconfig -p | awk '{print $1}')
  for f in $MC/syslibs/*; do
    n=$(basename "$f")
    grep -qx "$n" <<< "$HAVE" || ln -sf "$f" "$MC/missing/$n"
  done
  export LD_LIBRARY_PATH="$MC/lib:$MC/missing${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PYTHONPATH="$MC/site:$PYTHONPATH"  # first: no other mooncake is found before it
  MODEL=(--model-path llama-3.1-8b --load-format dummy --dtype bfloat16)
fi

env_lines() {  # what ran where: date, commit, GPUs, torch, the Mooncake engine in use
  date -u
  git log -1 --format='commit %H %s' 2> /dev/null || true
  git status --short 2> /dev/null | grep -v '^??' | sed 's/^/uncommitted: /'
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2> /dev/null
  $PYTHON -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "gpus", torch.cuda.device_count())'
  echo "carried system libraries linked (the machine lacks them): $(ls ${MC:-/nonexistent}/missing 2> /dev/null | tr '\n' ' ')"
  [ -n "${MC:-}" ] && { echo "ldd engine.so, unresolved:"; ldd $MC/site/mooncake/engine.so | grep 'not found'; }
  $PYTHON -c 'import mooncake.engine as m; print("mooncake.engine from", m.__file__)'
}

PGIDS=()
start() {  # NAME PORT ARGS...: a `kvflow serve` in its own session (its pid is its group);
  # GPU=<index> before the call pins it to one GPU
  local name=$1 port=$2 pin=()
  shift 2
  [ -n "${GPU:-}" ] && pin=(env "CUDA_VISIBLE_DEVICES=$GPU")
  "${pin[@]}" setsid $PYTHON -P -m kvflow serve "${MODEL[@]}" "${FLAGS[@]}" \
    --host 127.0.0.1 --port "$port" "$@" > "$OUT/$name.log" 2>&1 &
  PGIDS+=($!)
}
router() {  # ARGS...: a `kvflow router` in its own session, logging to routers.log
  echo "=== router $* ($(elapsed) s)" >> "$OUT/routers.log"
  setsid $PYTHON -P -m kvflow router --host 127.0.0.1 "$@" >> "$OUT/routers.log" 2>&1 &
  PGIDS+=($!)
}
stop_all() {  # every process group started so far: TERM, up to 15 s, then KILL
  [ ${#PGIDS[@]} = 0 ] && return
  for g in "${PGIDS[@]}"; do kill -TERM -- "-$g" 2> /dev/null; done
  for _ in $(seq 15); do
    alive=0
    for g in "${PGIDS[@]}"; do kill -0 -- "-$g" 2> /dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 1
  done
  for g in "${PGIDS[@]}"; do kill -KILL -- "-$g" 2> /dev/null; done
  PGIDS=()
  echo "processes stopped after $(elapsed) s"
}
trap stop_all EXIT
up() { $PYTHON -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health', timeout=2)" 2> /dev/null; }
wait_up() {  # LIMIT_S NAME:PORT:PID...: all healthy (0), or one exited / time out (1)
  local limit=$1
  shift
  local until=$(($(elapsed) + limit))
  while [ "$(elapsed)" -lt "$until" ]; do
    local ready=1
    for spec in "$@"; do
      IFS=: read -r name port pid <<< "$spec"
      up "$port" && continue
      ready=0
      kill -0 "$pid" 2> /dev/null || {
        echo "$name exited after $(elapsed) s:"
        tail -30 "$OUT/$name.log" 2> /dev/null
        return 1
      }
    done
    [ $ready = 1 ] && return 0
    sleep 1
  done
  echo "not up by $(elapsed) s: $*"
  return 1
}
