# syntax=docker/dockerfile:1.7
# The kvflow router (`kvflow router`, kvflow.runtime.router): aiohttp + uvloop, no torch
# (a build step checks). Build from the repository root:
#   docker build -f images/router.Dockerfile -t ghcr.io/kvflow/router:0.1.0 .
# The e2e tests build it registry-free from these same steps (e2e/k8s/realnode/imagebuild.py).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="kvflow-router" \
      org.opencontainers.image.description="kvflow request router (cache-aware, prefill/decode pairing)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 1000 kvflow && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin kvflow \
 && python -m venv /opt/kvflow
# The dependencies first, in a layer of their own that stays while only kvflow's code
# changes: the project's metadata alone (no packages yet) installs the extra's
# requirements; README.md, which pyproject.toml names, is an empty stand-in so that an
# edit of the README does not rebuild this layer. Only the router extra (aiohttp,
# prometheus-client, uvloop and the Kubernetes client for worker discovery).
COPY pyproject.toml setup.py /src/
RUN cd /src && touch README.md \
 && /opt/kvflow/bin/pip install --upgrade pip setuptools wheel \
 && /opt/kvflow/bin/pip install ".[router]" \
 && cd / && rm -rf /src
# kvflow itself: the contract and CLI (kvflow/) and the runtime package, whose torch-free
# modules the router imports; bind-mounted for this step (they leave no layer). The check:
# the command runs, and no heavy package came along.
RUN --mount=type=bind,source=pyproject.toml,target=/src/pyproject.toml \
    --mount=type=bind,source=setup.py,target=/src/setup.py \
    --mount=type=bind,source=README.md,target=/src/README.md \
    --mount=type=bind,source=kvflow,target=/src/kvflow \
    --mount=type=bind,source=runtime,target=/src/runtime \
    cp -r /src /tmp/src \
 && /opt/kvflow/bin/pip install --no-deps --no-build-isolation /tmp/src \
 && rm -rf /tmp/src \
 && /opt/kvflow/bin/kvflow router --help >/dev/null \
 && /opt/kvflow/bin/python -c "import importlib.util as u; heavy = [m for m in ('torch', 'numpy', 'triton', 'transformers') if u.find_spec(m)]; assert not heavy, heavy"
USER 1000:1000
ENV PATH=/opt/kvflow/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# API, /health and /metrics: contract.DEFAULT_API_PORT.
EXPOSE 8000
ENTRYPOINT ["kvflow", "router"]
