#!/usr/bin/env bash
# One device-tool call (issues 17 and 34): long-prefill interference, PD on two GPUs vs two
# unified replicas on the same two GPUs. Llama-3.1-8B shapes, dummy weights, bf16, ids in /
# ids out (--skip-tokenizer-init), default chunked prefill (8,192 on CUDA). Phases, one after
# the other (a phase's processes are stopped before the next starts), chosen by PHASES
# (default "pd unified"):
#   pd      : prefill :31100 on GPU 0 (--role prefill --bootstrap-port 31198
#             --disable-cuda-graph), decode :31200 on GPU 1 (--role decode), KV through the
#             transport PD_TRANSFER names (default: the Mooncake transfer engine, CUDA build,
#             TCP loopback; "--disaggregation-transfer-backend cuda_ipc": kvflow's kernel
#             writing the decode's GPU over NVLink; "--kv-transfer-protocol nvlink_intra":
#             Mooncake's NVLink transport; for both same-host transports the prefill sees
#             both GPUs, CUDA_VISIBLE_DEVICES=0,1, and computes on the first),
#             `kvflow router` PD mode :31300 in front; its results are stored under
#             PD_LABEL (default "pd")
#   unified : two `kvflow serve` :32000 on GPU 0 and :32001 on GPU 1 behind `kvflow router
#             --worker-urls ... --policy round_robin` :32300
# Same client, same seed, same workload in every phase (all through the phase's router):
#   1. greedy: GREEDY_LENS prompts, 32 tokens each, temperature 0; the unified phase sends
#      each prompt twice (round robin: both replicas) and compares with every pd phase's ids;
#   2. TTFT: TTFT_N fresh TTFT_LEN-token prompts one at a time (streamed, 8 tokens), and
#      for a pd phase the prefill's KV-transfer metrics over them (GB/s over write time);
#   3. a steady stream: one request every 1/RATE s, STREAM_IN prompt ids, STREAM_OUT tokens
#      (ignore_eos), streamed /generate; first QUIET_S s alone ("quiet"), then LOAD_S s while
#      long prompts (LONG_LENS, cycled; LONG_OUT tokens) arrive every LONG_EVERY s ("long");
#      ITL (gap between stream events, split evenly over the tokens an event adds, as
#      sglang bench_serving does) and TTFT p50/p99 of the stream per window, output tok/s
#      (all tokens whose event fell in the window), ITL p99.9, each request's longest gap,
#      requests that ended short of their tokens (finish reasons), long prompts' TTFT; the prefill's
#      /metrics before/after the long window (KV-transfer seconds per 1,000 prompt tokens).
# At the end of a pd phase both servers' /metrics show whether KV is still held (kv_used).
# Everything is time-guarded (STOP_AT seconds after the start); results.json is rewritten
# after every step, so a cut-off run still returns what it measured. At most 8 files come
# back: run.log (env first), results.json, prefill.log, decode.log, unified0.log,
# unified1.log, routers.log.
#
#   PD_TRANSFER="--disaggregation-transfer-backend cuda_ipc" \
#     bash benchmarks/gpu_pd_interference.sh          # on nvidia-h200-x2 (device tool `run`,
#                                                     # carry .whl)
#   PHASES=pd PD_LABEL=pd_tcp bash benchmarks/gpu_pd_interference.sh   # TCP, pd phase only
#   ONE_GPU=1 PD_TRANSFER=... bash benchmarks/gpu_pd_interference.sh  # issue 29: prefill and
#                          # decode share GPU 0, against one unified replica on GPU 0
#   ONE_GPU=1 LONG_EVERY=0 RATE=10 QUIET_S=100 LOAD_S=0 ...  # a steady stream alone (1,000
#                          # requests), no long prompts
#   PD_LOCAL=1 bash benchmarks/gpu_pd_interference.sh # CPU dry run here: a tiny dummy Llama,
#                                                     # small prompts, low rate, short windows
# Carried (gitignored): .whl/grammar, .whl/http and .whl/mooncake-cuda.tar.xz, made by
# benchmarks/gpu_http_prep.sh and benchmarks/gpu_pd_prep.sh (see gpu_pd_run.sh).
set -u
STOP_AT=${STOP_AT:-310}  # seconds after the start by which everything has ended
PHASES=${PHASES:-pd unified}
PD_LABEL=${PD_LABEL:-pd}
ONE_GPU=${ONE_GPU:-0}
source benchmarks/pd/device.sh
if [ "$LOCAL" = 1 ]; then
  FLAGS=(--context-length 2048 --max-total-tokens 8000 --max-running-requests 8 --skip-tokenizer-init)
  PREFILL_FLAGS=()
  export VOCAB=32000 GREEDY_LENS="40 300 900" TTFT_LEN=500 TTFT_N=2 STREAM_IN=32 \
    STREAM_OUT=12 RATE=0.5 LONG_LENS="600 900" LONG_OUT=4 LONG_EVERY=4 QUIET_S=4 LOAD_S=10 \
    DRAIN_S=20
else
  FLAGS=(--context-length 20480 --max-total-tokens 160000 --max-running-requests 64
    --cuda-graph-max-bs 32 --skip-tokenizer-init)
  PREFILL_FLAGS=(--disable-cuda-graph)
  export VOCAB=128256 GREEDY_LENS="64 512 4096 16000" TTFT_LEN=4000 TTFT_N=4 STREAM_IN=512 \
    STREAM_OUT=256 RATE=${RATE:-4} LONG_LENS="8192 12288 16384" LONG_OUT=16 \
    LONG_EVERY=${LONG_EVERY:-3} QUIET_S=${QUIET_S:-12} LOAD_S=${LOAD_S:-50} DRAIN_S=15
fi
{
  env_lines
  nvidia-smi topo -m 2> /dev/null
  echo "flags: ${MODEL[*]} ${FLAGS[*]}; prefill also ${PREFILL_FLAGS[*]:-}"
  echo "phases: $PHASES; pd transfer: ${PD_TRANSFER:-mooncake over tcp} (label $PD_LABEL); one GPU: $ONE_GPU"
  env | grep -E '^(GREEDY_LENS|TTFT_LEN|TTFT_N|STREAM_IN|STREAM_OUT|RATE|LONG_LENS|LONG_OUT|LONG_EVERY|QUIET_S|LOAD_S|DRAIN_S|STOP_AT)='
}

CLIENT=/tmp/kvflow_pd_interference_client.py
cat > $CLIENT << 'PY'
"""One phase of the interference run against ROUTER: greedy, then a steady stream, quiet and
with long prompts arriving; merges its results into RESULTS under the phase's name."""
import http.client
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.environ["PD_LIB"])
import generate_stream  # noqa: E402

PHASE, ROUTER, PREFILL, RESULTS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
E = os.environ
DEADLINE = time.monotonic() + float(E["PHASE_LEFT_S"])
VOCAB = int(E["VOCAB"])
GREEDY_LENS = [int(n) for n in E["GREEDY_LENS"].split()]
TTFT_LEN, TTFT_N = int(E["TTFT_LEN"]), int(E["TTFT_N"])
PD = PHASE.startswith("pd")
STREAM_IN, STREAM_OUT, RATE = int(E["STREAM_IN"]), int(E["STREAM_OUT"]), float(E["RATE"])
LONG_LENS = [int(n) for n in E["LONG_LENS"].split()]
LONG_OUT, LONG_EVERY = int(E["LONG_OUT"]), float(E["LONG_EVERY"])
QUIET_S, LOAD_S, DRAIN_S = float(E["QUIET_S"]), float(E["LOAD_S"]), float(E["DRAIN_S"])
rng = random.Random(17)  # same seed, same prompts in both phases
res: dict = {"router_port": ROUTER}


def save() -> None:
    try:
        allres = json.load(open(RESULTS))
    except (OSError, ValueError):
        allres = {}
    allres[PHASE] = res
    json.dump(allres, open(RESULTS + ".tmp", "w"), indent=1)
    os.replace(RESULTS + ".tmp", RESULTS)


def ids(n: int) -> list[int]:
    return [rng.randrange(1000, VOCAB - 1000) for _ in range(n)]


def body(prompt, max_new, stream):
    return {"input_ids": prompt, "stream": stream,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}


def post(b: dict, timeout: float) -> dict:
    for attempt in range(20):  # a router answers 503 until its health check saw workers
        conn = http.client.HTTPConnection("127.0.0.1", ROUTER, timeout=timeout)
        conn.request("POST", "/generate", json.dumps(b), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status == 503 and attempt < 19:
            time.sleep(0.5)
            continue
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
        return json.loads(data)
    raise AssertionError("unreachable")


def stream(prompt: list[int], max_new: int, timeout: float) -> dict:
    """Streamed /generate: send time, (time, completion_tokens) per event with new ids."""
    sent = time.monotonic()
    events, count, finish = [], 0, None
    for at, ev in generate_stream.events(ROUTER, body(prompt, max_new, True), timeout):
        meta = ev.get("meta_info", {})
        finish = meta.get("finish_reason") or finish
        n = meta.get("completion_tokens", len(ev.get("output_ids") or []))
        if n > count:
            events.append((at, n - count))
            count = n
    return {"sent": sent, "events": events, "tokens": count, "finish": finish}


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def metrics() -> dict[str, float]:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", PREFILL, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except OSError as exc:
        return {"error": repr(exc)}
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or "_bucket" in line:
            continue
        if not any(k in line for k in ("kv_transfer", "prompt_tokens_total", "num_requests_total",
                                       "token_usage")):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{")[0]
        found[base] = found.get(base, 0.0) + float(value)
    return found


# 1. greedy (also the warm-up: the first request and the first long prompt pay one-time costs)
greedy = []
for n in GREEDY_LENS:
    prompt = ids(n)
    row: dict = {"len": n}
    for _rep in range(1 if PD else 2):
        if time.monotonic() > DEADLINE - 30:
            row["skipped"] = "deadline"
            break
        try:
            t = time.monotonic()
            out = post(body(prompt, 32, False), timeout=max(5.0, min(60.0, DEADLINE - t - 20)))
            row.setdefault("s", []).append(round(time.monotonic() - t, 3))
            row.setdefault("ids", []).append(out["output_ids"])
        except Exception as exc:  # the error is the result
            row["error"] = repr(exc)
            break
    print(PHASE, "greedy", n, {k: v for k, v in row.items() if k != "ids"}, flush=True)
    greedy.append(row)
res["greedy"] = greedy
if not PD:
    try:
        earlier = json.load(open(RESULTS))
    except (OSError, ValueError):
        earlier = {}
    res["greedy_equal_to_pd"] = {}
    for label, phase in earlier.items():
        if not label.startswith("pd"):
            continue
        pd = {r["len"]: r.get("ids", [None])[0] for r in phase.get("greedy", [])}
        res["greedy_equal_to_pd"][label] = [
            None if pd.get(r["len"]) is None or not r.get("ids")
            else all(o == pd[r["len"]] for o in r["ids"])
            for r in greedy
        ]
    for r in greedy:
        outs = r.get("ids", [])
        r["replicas_equal"] = len(outs) == 2 and outs[0] == outs[1]
    print(PHASE, "greedy equal to pd:", res["greedy_equal_to_pd"], "replicas equal:",
          [r["replicas_equal"] for r in greedy], flush=True)
save()


def transfer_between(b: dict, a: dict) -> dict | None:
    """The prefill's KV writes between two scrapes."""
    if not PD or not b or not a or "error" in a or "error" in b:
        return None
    d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in a}
    secs = d.get("kvflow:kv_transfer_seconds_sum", 0.0)
    nbytes = d.get("kvflow:kv_transfer_bytes_total", 0.0)
    ptoks = d.get("sglang:prompt_tokens_total", 0.0)
    return {
        "prompt_tokens": ptoks, "requests": d.get("sglang:num_requests_total"),
        "bytes": nbytes, "writes": d.get("kvflow:kv_transfer_seconds_count"),
        "write_seconds_sum": round(secs, 4),
        "write_ms_per_1000_prompt_tokens": round(secs / (ptoks / 1e6), 2) if ptoks else None,
        "gb_s_over_write_time": round(nbytes / secs / 1e9, 2) if secs else None,
        "bytes_per_prompt_token": round(nbytes / ptoks, 1) if ptoks else None,
    }


# 2. TTFT of fresh TTFT_LEN-token prompts, one at a time
time.sleep(1.0)  # the prefill's /metrics lags its last writes (stats push)
before = metrics()
ttft = []
for _ in range(TTFT_N):
    if time.monotonic() > DEADLINE - 60:
        break
    try:
        r = stream(ids(TTFT_LEN), 8, timeout=60)
        ttft.append(round(1000 * (r["events"][0][0] - r["sent"]), 1) if r["events"] else None)
    except Exception as exc:
        ttft.append(repr(exc)[:200])
time.sleep(1.0)
good = sorted(t for t in ttft if isinstance(t, float))
res["ttft"] = {"len": TTFT_LEN, "ms": ttft, "median_ms": good[len(good) // 2] if good else None,
               "transfer": transfer_between(before, metrics())}
print(PHASE, "ttft", json.dumps(res["ttft"]), flush=True)
save()

# 3. the steady stream, quiet then with long prompts; windows shortened to fit the deadline
avail = DEADLINE - time.monotonic() - DRAIN_S - 5
quiet_s = max(0.0, min(QUIET_S, avail if LOAD_S == 0 else 0.2 * avail))  # no long window: all
load_s = max(0.0, min(LOAD_S, avail - quiet_s))
res["windows_s"] = {"quiet": quiet_s, "long": load_s}
print(PHASE, f"windows: quiet {quiet_s:.0f} s, long prompts {load_s:.0f} s", flush=True)
stream_prompts = [ids(STREAM_IN) for _ in range(int((quiet_s + load_s) * RATE) + 2)]
LONG_N = int(load_s / LONG_EVERY) + (load_s % LONG_EVERY > 0) if LONG_EVERY > 0 else 0
long_prompts = [ids(LONG_LENS[i % len(LONG_LENS)]) for i in range(LONG_N)]
lock = threading.Lock()
stream_done: list[dict] = []
long_done: list[dict] = []
errors: list[str] = []
req_timeout = quiet_s + load_s + DRAIN_S + 30


def run_one(prompt, max_new, sink, kind) -> None:
    try:
        r = stream(prompt, max_new, req_timeout)
        r["len"] = len(prompt)
        with lock:
            sink.append(r)
    except Exception as exc:
        with lock:
            errors.append(f"{kind}: {exc!r}"[:300])


t0 = time.monotonic()
w_quiet, w_long, w_end = t0, t0 + quiet_s, t0 + quiet_s + load_s
threads = []


def long_arrivals() -> None:
    i = 0
    while True:
        at = w_long + i * LONG_EVERY
        if at >= w_end or i >= len(long_prompts):
            return
        time.sleep(max(0.0, at - time.monotonic()))
        th = threading.Thread(target=run_one, args=(long_prompts[i], LONG_OUT, long_done, "long"),
                              daemon=True)
        th.start()
        threads.append(th)
        i += 1


scrape: dict = {}


def scrape_at_window() -> None:
    time.sleep(max(0.0, w_long - time.monotonic() - 0.5))
    scrape["before"] = metrics()


arrivals = threading.Thread(target=long_arrivals, daemon=True)
arrivals.start()
threading.Thread(target=scrape_at_window, daemon=True).start()
i = 0
while True:
    at = t0 + i / RATE
    if at >= w_end or i >= len(stream_prompts):
        break
    time.sleep(max(0.0, at - time.monotonic()))
    th = threading.Thread(target=run_one, args=(stream_prompts[i], STREAM_OUT, stream_done,
                                                "stream"), daemon=True)
    th.start()
    threads.append(th)
    i += 1
    if i % int(max(1, 10 * RATE)) == 0:
        print(PHASE, f"t={time.monotonic() - t0:.0f}s sent {i}, done {len(stream_done)}, "
              f"long done {len(long_done)}, errors {len(errors)}", flush=True)
sent_stream = i
arrivals.join(timeout=5)
drain_until = time.monotonic() + DRAIN_S
for th in list(threads):
    th.join(timeout=max(0.0, drain_until - time.monotonic()))
time.sleep(1.0)  # the prefill's /metrics lags its last writes (stats push)
scrape["after"] = metrics()
with lock:
    done, longs, errs = list(stream_done), list(long_done), list(errors)


def window_stats(lo: float, hi: float) -> dict:
    itl, ttft, worst, toks = [], [], [], 0
    for r in done:
        prev, top = r["sent"], None
        for j, (t, n) in enumerate(r["events"]):
            if lo <= t < hi:
                toks += n
                if j:
                    itl.extend([(t - prev) / n] * n)
                    top = max(top or 0.0, t - prev)
            prev = t
        if top is not None:
            worst.append(top)
        if lo <= r["sent"] < hi and r["events"]:
            ttft.append(r["events"][0][0] - r["sent"])
    long_toks = sum(n for r in longs for t, n in r["events"] if lo <= t < hi)
    span = hi - lo
    f = lambda x: None if x is None else round(1000 * x, 2)  # noqa: E731
    return {
        "span_s": round(span, 1),
        "itl_p50_ms": f(pct(itl, 50)), "itl_p99_ms": f(pct(itl, 99)),
        "itl_p999_ms": f(pct(itl, 99.9)), "itl_max_ms": f(max(itl) if itl else None),
        "itl_n": len(itl), "itl_over_50ms": sum(1 for x in itl if x > 0.05),
        # each request's longest gap between events: a stall shows here even when it is too
        # rare among all gaps to move the p99
        "req_max_gap_p50_ms": f(pct(worst, 50)), "req_max_gap_p99_ms": f(pct(worst, 99)),
        "ttft_p50_ms": f(pct(ttft, 50)), "ttft_p99_ms": f(pct(ttft, 99)), "ttft_n": len(ttft),
        "stream_out_tok_s": round(toks / span, 1) if span > 0 else None,
        "all_out_tok_s": round((toks + long_toks) / span, 1) if span > 0 else None,
    }


res["stream"] = {
    "sent": sent_stream, "completed": len(done),
    "complete_len": sum(1 for r in done if r["tokens"] == STREAM_OUT),
    # ended without error but short of STREAM_OUT tokens (e.g. a failed KV transfer aborts
    # the request): their finish reasons
    "short": [[r["tokens"], r["finish"]] for r in done if r["tokens"] != STREAM_OUT][:20],
    "short_n": sum(1 for r in done if r["tokens"] != STREAM_OUT),
    "quiet": window_stats(w_quiet, w_long), "long": window_stats(w_long, w_end),
}
res["long_prompts"] = {
    "sent": LONG_N,
    "completed": len(longs),
    "complete_len": sum(1 for r in longs if r["tokens"] == LONG_OUT),
    "ttft_ms": [round(1000 * (r["events"][0][0] - r["sent"]), 1) if r["events"] else None
                for r in sorted(longs, key=lambda r: r["sent"])],
    "lens": [r["len"] for r in sorted(longs, key=lambda r: r["sent"])],
}
res["errors"] = len(errs)
res["first_errors"] = errs[:5]
res["transfer_long_window"] = transfer_between(scrape.get("before", {}), scrape["after"])
res["prefill_metrics"] = scrape
save()
shown = {k: v for k, v in res.items() if k not in ("greedy", "prefill_metrics")}
print(PHASE, "result", json.dumps(shown, indent=1), flush=True)
PY

# Phase PD: prefill GPU 0, decode GPU 1, router PD mode.
read -r -a TRANSFER <<< "${PD_TRANSFER:-}"
PREFILL_GPUS=0
DECODE_GPU=1
case "${PD_TRANSFER:-}" in *cuda_ipc* | *nvlink_intra*) PREFILL_GPUS=0,1 ;; esac
[ "$ONE_GPU" = 1 ] && PREFILL_GPUS=0 DECODE_GPU=0
if [[ " $PHASES " == *" pd "* ]]; then
  echo "=== phase $PD_LABEL ($(elapsed) s): ${PD_TRANSFER:-mooncake over tcp}, prefill sees GPUs $PREFILL_GPUS"
  GPU=$PREFILL_GPUS start prefill 31100 --role prefill --bootstrap-port 31198 \
    "${PREFILL_FLAGS[@]}" "${TRANSFER[@]}"
  P=$!
  GPU=$DECODE_GPU start decode 31200 --role decode "${TRANSFER[@]}"
  D=$!
  # the pd phase gets half of what is left when a unified phase follows
  SHARE=1
  [[ " $PHASES " == *" unified "* ]] && SHARE=2
  if wait_up $(($(left) / 2 - 60)) "prefill:31100:$P" "decode:31200:$D"; then
    echo "pd servers up after $(elapsed) s"
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader 2> /dev/null
    router --port 31300 --prefill-urls "http://127.0.0.1:31100#31198" \
      --decode-urls http://127.0.0.1:31200
    for _ in $(seq 30); do up 31300 && break; sleep 1; done
    PHASE_LEFT=$((($(left) - 60) / SHARE))
    PHASE_LEFT_S=$PHASE_LEFT timeout $((PHASE_LEFT + 10)) $PYTHON $CLIENT "$PD_LABEL" 31300 31100 "$OUT/results.json"
    echo "pd client rc=$? after $(elapsed) s"
    sleep 2
    for p in 31100 31200; do  # token_usage 0: no request holds KV on that side
      echo "metrics :$p"
      $PYTHON -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$p/metrics', timeout=5).read().decode())" \
        2> /dev/null | grep -E '^(kvflow|sglang):(kv_transfer|num_requests_total|prompt_tokens_total|generation_tokens_total|token_usage|num_transfer_failed)' | grep -v _bucket
    done
  else
    echo "pd phase skipped: servers not up"
  fi
  stop_all
fi

# Phase unified: two replicas, GPU 0 and GPU 1, router round robin.
if [[ " $PHASES " == *" unified "* ]]; then
  echo "=== phase unified ($(elapsed) s)"
  GPU=0 start unified0 32000
  UP=("unified0:32000:$!")
  WORKERS=http://127.0.0.1:32000
  if [ "$ONE_GPU" != 1 ]; then
    GPU=1 start unified1 32001
    UP+=("unified1:32001:$!")
    WORKERS+=,http://127.0.0.1:32001
  fi
  if wait_up $(($(left) - 40)) "${UP[@]}"; then
    echo "unified servers up after $(elapsed) s"
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader 2> /dev/null
    router --port 32300 --policy round_robin --worker-urls "$WORKERS"
    for _ in $(seq 30); do up 32300 && break; sleep 1; done
    PHASE_LEFT=$(($(left) - 20))
    PHASE_LEFT_S=$PHASE_LEFT timeout $((PHASE_LEFT + 5)) $PYTHON $CLIENT unified 32300 32000 "$OUT/results.json"
    echo "unified client rc=$? after $(elapsed) s"
  else
    echo "unified phase skipped: servers not up"
  fi
  stop_all
fi
echo "end after $(elapsed) s"
