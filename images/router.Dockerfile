# syntax=docker/dockerfile:1.7
# The kvflow router (`kvflow router`, kvflow.runtime.router): aiohttp + uvloop, no torch
# (a build step checks). Build from the repository root:
#   docker build -f images/router.Dockerfile -t ghcr.io/kvflow/router:0.1.0 .
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvflow
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvflow/ kvflow/
# The router lives in the runtime package; only its torch-free modules are imported.
COPY runtime/ runtime/
# Only the router extra (aiohttp, prometheus-client, uvloop and the Kubernetes client for
# worker discovery). The check: the command runs, and no heavy package came along.
RUN /opt/kvflow/bin/pip install --upgrade pip setuptools wheel \
 && /opt/kvflow/bin/pip install ".[router]" \
 && /opt/kvflow/bin/kvflow router --help >/dev/null \
 && /opt/kvflow/bin/python -c "import importlib.util as u; heavy = [m for m in ('torch', 'numpy', 'triton', 'transformers') if u.find_spec(m)]; assert not heavy, heavy"

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="kvflow-router" \
      org.opencontainers.image.description="kvflow request router (cache-aware, prefill/decode pairing)" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 1000 kvflow && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin kvflow
COPY --from=build /opt/kvflow /opt/kvflow
ENV PATH=/opt/kvflow/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 1000:1000
# API, /health and /metrics: contract.DEFAULT_API_PORT.
EXPOSE 8000
ENTRYPOINT ["kvflow", "router"]
