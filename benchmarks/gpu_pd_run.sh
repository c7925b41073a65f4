#!/usr/bin/env bash
# One device-tool call (issues 16 and 17): prefill/decode disaggregation on ONE GPU, as a
# functional check (not the two-GPU interference run). Llama-3.1-8B shapes with dummy
# weights, bf16, three `kvflow serve` processes sharing the GPU, each with a small KV pool:
#   unified  :30000                                  (+ `kvflow router` :30400 in front)
#   prefill  :30100 --role prefill --bootstrap-port 30198 --disable-cuda-graph
#   decode   :30200 --role decode                    (+ `kvflow router` PD mode :30300)
# KV moves prefill -> decode through the Mooncake transfer engine (CUDA wheel, TCP over
# loopback, GPU memory registered). Then, from the client below (ids in, ids out, no
# tokenizer: --skip-tokenizer-init):
#   1. greedy equality: 8 prompts of 100..4000 token ids (chunked prefill 1024, so the longer
#      ones are prefilled and sent in several chunks), /generate temperature 0, 32 tokens,
#      router->prefill->decode vs router->unified, compared id for id;
#   2. TTFT (streaming /generate, first event with an output id) of 4 fresh 4000-token
#      prompts, PD vs unified, and the prefill's KV-transfer metrics over those requests
#      (kvflow:kv_transfer_bytes_total, kvflow:kv_transfer_seconds_*, sglang:kv_transfer_*).
# Everything lands under $OUT (at most 8 files come back): env.txt, run.log, results.json
# and the five processes' logs (routers in one file). Every process is started in its own
# session and its whole group is killed at the end, whatever happens.
#
#   bash benchmarks/gpu_pd_run.sh            # on the GPU machine (device tool `run`)
#   PD_TRANSFER="--disaggregation-transfer-backend cuda_ipc" bash benchmarks/gpu_pd_run.sh
#   PD_LOCAL=1 bash benchmarks/gpu_pd_run.sh # CPU dry run here: a tiny dummy Llama config,
#                                            # the local venv's Mooncake, small prompts
# Carried (gitignored, made by benchmarks/gpu_pd_prep.sh): .whl/grammar, .whl/http (the
# server's wheels, as gpu_http_run.sh) and .whl/mooncake-cuda.tar.xz (the trimmed Mooncake
# CUDA wheel: `mooncake.engine` and the libraries it links, unpacked to /tmp/mooncake-cuda).
set -u
STOP_AT=${STOP_AT:-400}  # seconds after the start by which everything has ended
source benchmarks/pd/device.sh
if [ "$LOCAL" = 1 ]; then
  FLAGS=(--context-length 2048 --max-total-tokens 8000 --chunked-prefill-size 256
    --max-running-requests 8 --skip-tokenizer-init)
  export PD_LENGTHS="50 150 300 500 700 900 1200 1500" PD_TTFT_LEN=1500 PD_VOCAB=32000
else
  FLAGS=(--context-length 8192 --max-total-tokens 32768 --chunked-prefill-size 1024
    --max-running-requests 16 --cuda-graph-max-bs 16 --skip-tokenizer-init)
  export PD_LENGTHS="100 400 900 1500 2100 2800 3400 4000" PD_TTFT_LEN=4000 PD_VOCAB=128256
fi
env_lines > "$OUT/env.txt" 2>&1
echo "transfer: ${PD_TRANSFER:-mooncake over tcp}" >> "$OUT/env.txt"
cat "$OUT/env.txt"

start unified 30000
U=$!
# PD_TRANSFER: the pair's transport flags, e.g. "--disaggregation-transfer-backend cuda_ipc"
# or "--kv-transfer-protocol nvlink_intra" (default: Mooncake over TCP)
read -r -a TRANSFER <<< "${PD_TRANSFER:-}"
start prefill 30100 --role prefill --bootstrap-port 30198 --disable-cuda-graph "${TRANSFER[@]}"
P=$!
start decode 30200 --role decode "${TRANSFER[@]}"
D=$!
wait_up "$(left)" "unified:30000:$U" "prefill:30100:$P" "decode:30200:$D" || exit 1
echo "servers up after $(elapsed) s"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader 2> /dev/null
router --port 30300 --prefill-urls "http://127.0.0.1:30100#30198" \
  --decode-urls http://127.0.0.1:30200
router --port 30400 --worker-urls http://127.0.0.1:30000
for _ in $(seq 30); do up 30300 && up 30400 && break; sleep 1; done
echo "routers up after $(elapsed) s"

PD_DEADLINE=$(($(left) - 25)) timeout $(($(left) - 20)) $PYTHON - "$OUT/results.json" << 'PY'
"""The client: greedy equality, TTFT and the prefill's KV-transfer metrics."""
import http.client
import json
import os
import random
import sys
import time

sys.path.insert(0, os.environ["PD_LIB"])
import generate_stream  # noqa: E402

START = time.monotonic()
DEADLINE = START + float(os.environ["PD_DEADLINE"])
PD, UNIFIED, PREFILL = 30300, 30400, 30100
LENGTHS = [int(n) for n in os.environ["PD_LENGTHS"].split()]
TTFT_LEN = int(os.environ["PD_TTFT_LEN"])
VOCAB = int(os.environ["PD_VOCAB"])
rng = random.Random(0)
results: dict = {"lengths": LENGTHS, "ttft_len": TTFT_LEN}


def ids(n: int) -> list[int]:
    return [rng.randrange(1000, VOCAB - 1000) for _ in range(n)]


def post(port: int, body: dict, timeout: float = 120.0) -> dict:
    for attempt in range(20):  # a router may answer 503 until its health check saw workers
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status == 503 and attempt < 19:
            time.sleep(0.5)
            continue
        if resp.status != 200:
            raise RuntimeError(f"port {port}: HTTP {resp.status}: {data[:500]!r}")
        return json.loads(data)
    raise AssertionError("unreachable")


def stream_ttft(port: int, prompt: list[int], max_new: int) -> dict:
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}
    t0 = time.monotonic()
    first, out = None, []
    for at, event in generate_stream.events(port, body, 120):
        if first is None and event.get("output_ids"):
            first = at - t0
        out = event.get("output_ids", out)
    return {"ttft_s": first, "total_s": time.monotonic() - t0, "output_ids": out}


def metrics(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or "kv_transfer" not in line:
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{")[0]
        if "_bucket" in base:
            continue
        found[base] = found.get(base, 0.0) + float(value)
    return found


# 1. greedy equality
greedy = []
for n in LENGTHS:
    if time.monotonic() > DEADLINE - 60:
        greedy.append({"len": n, "skipped": "deadline"})
        continue
    prompt = ids(n)
    body = {"input_ids": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}}
    row: dict = {"len": n}
    try:
        t = time.perf_counter()
        pd = post(PD, body)
        row["pd_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        uni = post(UNIFIED, body)
        row["unified_s"] = round(time.perf_counter() - t, 3)
        a, b = pd["output_ids"], uni["output_ids"]
        row["equal"] = a == b
        row["tokens"] = len(a)
        if a != b:
            row["first_diff"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                     min(len(a), len(b)))
            row["pd_ids"], row["unified_ids"] = a, b
    except Exception as exc:  # the error is the result
        row["error"] = repr(exc)
    print("greedy", row, flush=True)
    greedy.append(row)
results["greedy"] = greedy
results["greedy_all_equal"] = all(r.get("equal") for r in greedy)

# 2. TTFT PD vs unified, and the transfer metrics over the PD requests of this phase. The
# prefill's /metrics shows the scheduler stats it last pushed (every 0.25 s at most): a scrape
# right after a response missed that request's writes in the first GPU run, hence the waits.
time.sleep(1.0)
before = metrics(PREFILL)
ttft = []
for i in range(4):
    if time.monotonic() > DEADLINE - 20:
        break
    prompt = ids(TTFT_LEN)
    row = {"i": i}
    try:
        row["pd"] = stream_ttft(PD, prompt, 8)
        row["unified"] = stream_ttft(UNIFIED, prompt, 8)
        row["equal"] = row["pd"].pop("output_ids") == row["unified"].pop("output_ids")
    except Exception as exc:
        row["error"] = repr(exc)
    print("ttft", row, flush=True)
    ttft.append(row)
time.sleep(1.0)
after = metrics(PREFILL)
results["ttft"] = ttft
results["prefill_metrics_before"], results["prefill_metrics_after"] = before, after
d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
ok = [r for r in ttft if "error" not in r and r["pd"]["ttft_s"] and r["unified"]["ttft_s"]]
summary: dict = {"ttft_requests": len(ok)}
if ok:
    pd_t = sorted(r["pd"]["ttft_s"] for r in ok)
    un_t = sorted(r["unified"]["ttft_s"] for r in ok)
    summary["pd_ttft_ms_median"] = round(1000 * pd_t[len(pd_t) // 2], 1)
    summary["unified_ttft_ms_median"] = round(1000 * un_t[len(un_t) // 2], 1)
    summary["pd_ttft_ms_all"] = [round(1000 * x, 1) for x in pd_t]
    summary["unified_ttft_ms_all"] = [round(1000 * x, 1) for x in un_t]
nbytes = d.get("kvflow:kv_transfer_bytes_total", 0.0)
secs = d.get("kvflow:kv_transfer_seconds_sum", 0.0)
count = d.get("kvflow:kv_transfer_seconds_count", 0.0)
summary["transfer_bytes"] = nbytes
summary["transfer_writes"] = count
summary["transfer_seconds_sum"] = secs
if secs > 0:
    summary["transfer_gb_s"] = round(nbytes / secs / 1e9, 3)
if ok and count:
    per_req = secs / len(ok)
    summary["transfer_ms_per_request"] = round(1000 * per_req, 1)
    summary["transfer_ms_per_1000_prompt_tokens"] = round(1000 * per_req / (TTFT_LEN / 1000), 1)
    summary["transfer_share_of_pd_ttft"] = round(per_req / (sum(pd_t) / len(pd_t)), 3)
summary["latest_write_gauges"] = {k: v for k, v in after.items() if k.startswith("sglang:")}
results["summary"] = summary
print("summary", json.dumps(summary, indent=1), flush=True)
json.dump(results, open(sys.argv[1], "w"), indent=1)
print(f"client done in {time.monotonic() - START:.0f} s")
PY
echo "client rc=$? after $(elapsed) s"
for p in 30100 30200; do
  echo "metrics :$p"
  $PYTHON -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$p/metrics', timeout=5).read().decode())" \
    2> /dev/null | grep -E '^(kvflow|sglang):(kv_transfer|num_requests_total|prompt_tokens_total|generation_tokens_total)' | grep -v _bucket
done
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader 2> /dev/null
echo "end after $(elapsed) s"
