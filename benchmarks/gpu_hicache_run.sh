#!/usr/bin/env bash
# One device-tool call (issue 29): HiCache on the GPU, multi-turn TTFT with the host tier
# (L2) against the radix cache alone (off). Llama-3.1-8B shapes, dummy weights, bf16, ids in
# / ids out (--skip-tokenizer-init), `--page-size 16`, the device KV pool capped at
# DEVICE_TOKENS with --max-total-tokens, one `kvflow serve` on GPU 0 per phase:
#   off : the radix cache only
#   L2  : + `--hicache-host-memory-gb HOST_GB` (a pinned host pool that holds the working set)
# The same client and prompts in both phases: CONVERSATIONS conversations, each a DOC_LEN-id
# document, TURNS turns of QUESTION_LEN new ids + OUTPUT_LEN generated tokens (greedy,
# ignore_eos; the answer joins the history), CONCURRENCY conversations at a time, turn by
# turn. The working set (every conversation's history) is about 4x the device pool, so
# between two turns of a conversation the others evict its KV from the GPU: off recomputes
# it, L2 loads it back from host memory. Reported per phase: TTFT p50/p90 over turns >= 2
# (turn 1 is cold everywhere), the cached tokens per request (`meta_info.cached_tokens`),
# output tok/s, errors; and whether every turn's output ids are equal across phases (KV
# loaded back from the host must decode as the KV computed on the GPU).
# results.json is rewritten after every phase; at most 8 files come back: run.log,
# results.json, off.log, L2.log.
#
#   bash benchmarks/gpu_hicache_run.sh             # on nvidia-h200 (device tool `run`,
#                                                  # carry .whl)
#   PD_LOCAL=1 bash benchmarks/gpu_hicache_run.sh  # CPU dry run here: a tiny dummy Llama
# Carried (gitignored): .whl/grammar, .whl/http and .whl/mooncake-cuda.tar.xz (see
# gpu_pd_run.sh; the set-up in benchmarks/pd/device.sh installs them).
set -u
STOP_AT=${STOP_AT:-420}  # seconds after the start by which everything has ended
source benchmarks/pd/device.sh
if [ "$LOCAL" = 1 ]; then
  FLAGS=(--context-length 4096 --max-running-requests 8 --skip-tokenizer-init --page-size 16)
  export VOCAB=32000 CONVERSATIONS=6 DOC_LEN=300 TURNS=3 QUESTION_LEN=16 OUTPUT_LEN=4 \
    CONCURRENCY=2 DEVICE_TOKENS=${DEVICE_TOKENS:-600} HOST_GB=${HOST_GB:-0.05}
else
  FLAGS=(--context-length 16384 --max-running-requests 32 --cuda-graph-max-bs 32
    --skip-tokenizer-init --page-size 16)
  # working set 16 x ~6,400 = ~102k tokens (13.4 GB of KV) against a 25,600-token pool
  export VOCAB=128256 CONVERSATIONS=${CONVERSATIONS:-16} DOC_LEN=${DOC_LEN:-6000} \
    TURNS=${TURNS:-4} QUESTION_LEN=64 OUTPUT_LEN=32 CONCURRENCY=${CONCURRENCY:-4} \
    DEVICE_TOKENS=${DEVICE_TOKENS:-25600} HOST_GB=${HOST_GB:-24}
fi
{
  env_lines
  echo "flags: ${MODEL[*]} ${FLAGS[*]} --max-total-tokens $DEVICE_TOKENS; L2 adds --hicache-host-memory-gb $HOST_GB"
  env | grep -E '^(CONVERSATIONS|DOC_LEN|TURNS|QUESTION_LEN|OUTPUT_LEN|CONCURRENCY|DEVICE_TOKENS|HOST_GB|STOP_AT)='
}

CLIENT=/tmp/kvflow_hicache_client.py
cat > $CLIENT << 'PY'
"""One phase against PORT: the conversations turn by turn; merges its results into RESULTS."""
import json
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.environ["PD_LIB"])
import generate_stream  # noqa: E402

PHASE, PORT, RESULTS = sys.argv[1], int(sys.argv[2]), sys.argv[3]
E = os.environ
DEADLINE = time.monotonic() + float(E["PHASE_LEFT_S"])
VOCAB = int(E["VOCAB"])
N, DOC, TURNS = int(E["CONVERSATIONS"]), int(E["DOC_LEN"]), int(E["TURNS"])
QLEN, OUT, CONC = int(E["QUESTION_LEN"]), int(E["OUTPUT_LEN"]), int(E["CONCURRENCY"])
rng = random.Random(29)  # same seed, same prompts in both phases


def ids(n: int) -> list[int]:
    return [rng.randrange(1000, VOCAB - 1000) for _ in range(n)]


docs = [ids(DOC) for _ in range(N)]
questions = [[ids(QLEN) for _ in range(TURNS)] for _ in range(N)]


def stream(prompt: list[int]) -> dict:
    """Streamed /generate: TTFT, output ids, cached tokens."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": OUT, "ignore_eos": True}}
    sent = time.monotonic()
    first, out, cached = None, [], None
    for at, ev in generate_stream.events(PORT, body, max(5.0, DEADLINE - sent)):
        if first is None and ev.get("output_ids"):
            first = at - sent
        out = ev.get("output_ids", out)
        cached = ev.get("meta_info", {}).get("cached_tokens", cached)
    return {"ttft": first, "ids": out, "cached": cached}


history = [list(d) for d in docs]
rows: list[dict] = []
errors: list[str] = []
lock = threading.Lock()


def turn(c: int, t: int) -> None:
    if time.monotonic() > DEADLINE - 10:
        with lock:
            errors.append(f"conversation {c} turn {t}: deadline")
        return
    prompt = history[c] + questions[c][t]
    try:
        r = stream(prompt)
    except Exception as exc:  # the error is the result
        with lock:
            errors.append(f"conversation {c} turn {t}: {exc!r}"[:300])
        return
    history[c] = prompt + r["ids"]
    with lock:
        rows.append({"conv": c, "turn": t, "len": len(prompt), "ttft_ms": round(1000 * r["ttft"], 1)
                     if r["ttft"] is not None else None, "cached": r["cached"], "ids": r["ids"]})


start = time.monotonic()
with ThreadPoolExecutor(CONC) as pool:
    for t in range(TURNS):
        list(pool.map(lambda c: turn(c, t), range(N)))
        print(PHASE, f"turn {t + 1} done after {time.monotonic() - start:.1f} s, errors {len(errors)}",
              flush=True)
span = time.monotonic() - start


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (k - lo), 1)


later = [r for r in rows if r["turn"] >= 1 and r["ttft_ms"] is not None]
res = {
    "requests": len(rows), "errors": len(errors), "first_errors": errors[:5],
    "ttft_p50_ms": pct([r["ttft_ms"] for r in later], 50),
    "ttft_p90_ms": pct([r["ttft_ms"] for r in later], 90),
    "cached_tokens_per_request": round(sum(r["cached"] or 0 for r in later) / len(later), 1)
    if later else None,
    "prompt_tokens_per_request": round(sum(r["len"] for r in later) / len(later), 1)
    if later else None,
    "output_tok_s": round(sum(len(r["ids"]) for r in rows) / span, 1),
    "seconds": round(span, 1),
    "rows": sorted(rows, key=lambda r: (r["conv"], r["turn"])),
}
try:
    allres = json.load(open(RESULTS))
except (OSError, ValueError):
    allres = {}
allres[PHASE] = res
if PHASE != "off" and "off" in allres:
    base = {(r["conv"], r["turn"]): r["ids"] for r in allres["off"]["rows"]}
    same = [base[k] == r["ids"] for r in res["rows"] if (k := (r["conv"], r["turn"])) in base]
    res["outputs_equal_to_off"] = f"{sum(same)} of {len(same)} compared"
    if allres["off"]["ttft_p50_ms"] and res["ttft_p50_ms"]:
        res["ttft_p50_vs_off"] = round(res["ttft_p50_ms"] / allres["off"]["ttft_p50_ms"], 3)
json.dump(allres, open(RESULTS + ".tmp", "w"), indent=1)
os.replace(RESULTS + ".tmp", RESULTS)
print(PHASE, "result", json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
PY

for phase in off L2; do
  extra=()
  [ "$phase" = L2 ] && extra=(--hicache-host-memory-gb "$HOST_GB")
  echo "=== phase $phase ($(elapsed) s)"
  GPU=0 start "$phase" 33000 --max-total-tokens "$DEVICE_TOKENS" "${extra[@]}"
  S=$!
  if wait_up $(($(left) / 2 - 20)) "$phase:33000:$S"; then
    echo "$phase server up after $(elapsed) s"
    PHASE_LEFT=$(($(left) - 20))
    [ "$phase" = off ] && PHASE_LEFT=$((($(left) - 40) / 2))  # L2 needs its start-up too
    PHASE_LEFT_S=$PHASE_LEFT timeout $((PHASE_LEFT + 5)) $PYTHON $CLIENT "$phase" 33000 "$OUT/results.json"
    echo "$phase client rc=$? after $(elapsed) s"
    $PYTHON -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:33000/metrics', timeout=5).read().decode())" \
      2> /dev/null | grep -E '^(kvflow|sglang):(hicache|cached_tokens_total|prompt_tokens_total|token_usage)' | grep -v _bucket
  else
    echo "$phase phase skipped: server not up"
  fi
  stop_all
done
echo "end after $(elapsed) s"
