#!/usr/bin/env bash
# One device-tool call: GPU tests and the engine-level benchmark of one area, on the GPU
# machine (the set-up of benchmarks/pd/device.sh: carried server wheels and Mooncake).
#
#   PART=spec   tests/gpu/test_gpu_spec.py and tests/pd/test_pd_eagle_gpu.py (EAGLE under PD
#               over cuda_ipc and Mooncake), then `bench_spec.py gpu --skip-draft-eager`
#               (benchmarks/results/spec-gpu*.md)
#   PART=lora   `bench_lora_gpu.py engine` with the serving bar's adapter ranks (16,64,16,64)
#               at batch 8, 32 and 8 again: the base model and mixed adapters, their eager
#               prefills (each way an eager batch can run), each run's
#               kernels profiled at batch 32 (benchmarks/results/lora.md); then
#               tests/gpu/test_gpu_lora.py and tests/kernels/test_lora_kernel.py's grouped
#               layout (what the decode graphs run, segmented and dense shrinks, the expand
#               onto the joint GEMM's base columns), eager matmuls (per segment and
#               masked) and the extend attention on packed QKV
#
#   OUT=/tmp/out STOP_AT=540 PART=spec bash benchmarks/gpu_checks.sh
#
# Run two parts at once on a two-GPU machine with GPU=0 / GPU=1 (CUDA_VISIBLE_DEVICES).
# Results under $OUT/$PART: pytest's report, the benchmark's JSON and markdown, run.log.
set -u
PART=${PART:?PART=spec or PART=lora}
STOP_AT=${STOP_AT:-540}
OUT=${OUT:-/tmp/out}/$PART
source benchmarks/pd/device.sh
[ -n "${GPU:-}" ] && export CUDA_VISIBLE_DEVICES=$GPU
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/benchmarks"
env_lines > "$OUT/env.txt" 2>&1
budget() { echo $(($(left) > 10 ? $(left) : 10)); }

case "$PART" in
  spec)
    timeout "$(budget)" $PYTHON -P -m pytest -m gpu -q -p no:cacheprovider -rfEs \
      tests/gpu/test_gpu_spec.py tests/pd/test_pd_eagle_gpu.py --junitxml "$OUT/pytest.xml" \
      > "$OUT/pytest.txt" 2>&1
    echo "pytest rc $? after $(elapsed) s"
    tail -5 "$OUT/pytest.txt"
    timeout "$(budget)" $PYTHON -P benchmarks/bench_spec.py gpu --skip-draft-eager \
      --json-out "$OUT/spec-gpu.json" --md-out "$OUT/spec-gpu.md"
    echo "bench_spec rc $? after $(elapsed) s"
    ;;
  lora)
    # the benchmark first (the tests' time varies with what Triton compiles)
    timeout "$(budget)" $PYTHON -P benchmarks/bench_lora_gpu.py engine --batch-sizes 8,32,8 \
      --adapter-ranks 16,64,16,64 --runs base,mixed --profile \
      --json-out "$OUT/lora-engine.json"
    echo "bench_lora_gpu rc $? after $(elapsed) s"
    timeout "$(budget)" $PYTHON -P -m pytest -m gpu -v -p no:cacheprovider -rfEs \
      tests/gpu/test_gpu_lora.py tests/kernels/test_lora_kernel.py::test_lora_grouped_mixed_ranks_gpu \
      tests/kernels/test_lora_kernel.py::test_lora_eager_matmuls_gpu \
      tests/kernels/test_lora_kernel.py::test_lora_expand_onto_base_gpu \
      tests/kernels/test_lora_kernel.py::test_joined_projection_equals_separate_gpu \
      tests/kernels/test_extend_attention.py::test_extend_attention_packed_qkv_gpu \
      --junitxml "$OUT/pytest.xml" > "$OUT/pytest.txt" 2>&1
    echo "pytest rc $? after $(elapsed) s"
    tail -5 "$OUT/pytest.txt"
    ;;
  *)
    echo "PART is spec or lora, got $PART"
    exit 2
    ;;
esac
