#!/usr/bin/env bash
# Prepares, on the dev machine, what benchmarks/gpu_http_run.sh needs on the GPU machine
# (nothing can be downloaded there). All of it is gitignored (.whl/ by .gitignore,
# .bench_http/ by .git/info/exclude) and travels with the device tool's `carry`:
#   .whl/grammar/*.whl      cp312 wheels of pydantic and xgrammar (with their needs)
#   .whl/http/*.whl         cp312 wheels of the server's and bench_serving's packages the
#                           GPU machine lacks
#   .bench_http/tokenizer/  the embedded model's (SmolLM2) tokenizer, its 49,152 ids padded
#                           with added tokens <|padN|> up to Llama-3.1-8B's 128,256 ids, so
#                           every id the random-weight model samples decodes to text (else
#                           bench_serving skips those chunks and TTFT/ITL come out wrong);
#                           bench_serving's random-ids prompts still draw from the 49,152
#                           (benchmarks/bench_tokenizer.py; gpu_http_run.sh resizes it again
#                           to another shape's vocabulary: Qwen, Mistral, Gemma)
#   .bench_http/sglang/     SGLang 0.5.23's Python files that `import sglang.bench_serving`
#                           and a random-ids run load (benchmarks/gpu_http_sglang_files.txt,
#                           listed from sys.modules after such a run), plus the kernels/jit
#                           include and csrc folders its import checks exist. Copied from the
#                           sglang-frontend venv (benchmarks/sglang_frontend_venv.py): the
#                           sglang wheel is cp311 only and its full install is 223 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=.venv/bin/pip
SITE=$(echo "${KVFLOW_CACHE_DIR:-$HOME/.cache/kvflow}"/venvs/sglang-frontend-0.5.23/lib/python3*/site-packages)
PLATFORMS=()
for p in manylinux_2_17 manylinux2014 manylinux1 manylinux_2_24 manylinux_2_26 manylinux_2_27 \
  manylinux_2_28 manylinux_2_31 manylinux_2_34; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
mkdir -p .whl/grammar .whl/http .bench_http/tokenizer .bench_http/sglang
# structured output and the server's request models (xgrammar imports apache-tvm-ffi)
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl/grammar \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  annotated-doc==0.0.7 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl/http \
  fastapi==0.165.0 opentelemetry-api==1.45.2 starlette==1.10.0 uvicorn==0.54.0 pyzmq==27.3.0 \
  orjson==3.13.0 msgspec==0.22.0 pybase64==1.5.1 datasets==5.2.0 dill==0.4.1 \
  multiprocess==0.70.19 loguru==0.7.3 compressed-tensors==0.20.0 gguf==0.19.0 httpx2==2.16.2 \
  httpcore2==2.16.2 truststore==0.10.5 ipython==9.18.1 traitlets==5.16.1 sniffio==1.3.1
MODEL=$(.venv/bin/python -P -c 'from kvflow.runtime.models import embedded_model_path as p; print(p())')
.venv/bin/python -P benchmarks/bench_tokenizer.py "$MODEL" .bench_http/tokenizer 128256
while read -r rel; do
  mkdir -p ".bench_http/sglang/$(dirname "$rel")"
  cp "$SITE/$rel" ".bench_http/sglang/$rel"
done < benchmarks/gpu_http_sglang_files.txt
cp -r "$SITE/sglang/kernels/jit/include" "$SITE/sglang/kernels/jit/csrc" \
  .bench_http/sglang/sglang/kernels/jit/
mkdir -p .git/info
grep -qx '/.bench_http/' .git/info/exclude 2> /dev/null || echo '/.bench_http/' >> .git/info/exclude
du -sh .whl .bench_http
