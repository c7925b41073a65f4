# syntax=docker/dockerfile:1.7
# The kvflow operator: kopf + the kubernetes client, no torch (a build step checks).
# Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/kvflow/operator:0.1.0 .
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvflow
WORKDIR /src
# Only what the operator imports: the contract and CLI (kvflow/) and the operator itself.
COPY pyproject.toml setup.py README.md ./
COPY kvflow/ kvflow/
COPY operator/ operator/
RUN /opt/kvflow/bin/pip install --upgrade pip setuptools wheel \
 && /opt/kvflow/bin/pip install ".[operator]" \
 && /opt/kvflow/bin/kvflow operator --help >/dev/null \
 && /opt/kvflow/bin/python -c "import importlib.util as u, kvflow.operator.main; assert u.find_spec('torch') is None"

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="kvflow-operator" \
      org.opencontainers.image.description="Kubernetes operator for kvflow ModelDeployments" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 1000 kvflow && useradd --uid 1000 --gid 1000 --no-create-home --shell /usr/sbin/nologin kvflow
COPY --from=build /opt/kvflow /opt/kvflow
ENV PATH=/opt/kvflow/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 1000:1000
# Liveness: contract.OPERATOR_HEALTH_PORT / OPERATOR_HEALTH_PATH.
EXPOSE 8080
ENTRYPOINT ["kvflow", "operator"]
