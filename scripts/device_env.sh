#!/usr/bin/env bash
# Source on the GPU machine (the device tool's run): makes `import kvflow` work with the
# machine's own torch venv, without putting the repo root on PYTHONPATH (its top-level
# operator/ folder would shadow Python's own `operator` module). Installs carried wheels
# from .whl/ when present.
set -e
REPO=$(pwd)
SHIM=/tmp/kvflow-shim
mkdir -p "$SHIM/kvflow"
cp "$REPO"/kvflow/*.py "$SHIM/kvflow/"
for part in runtime kernels operator; do ln -sfn "$REPO/$part" "$SHIM/kvflow/$part"; done
export PATH=/opt/torch/.venv/bin:$PATH
if [ -d .whl ] && ! python3 -P -c "import pytest" 2>/dev/null; then
  python3 -P -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
# The carried server wheels (.whl/grammar, .whl/http: made by benchmarks/gpu_http_prep.sh)
# into /tmp/site, once per machine (a second script of the same call finds them in place),
# and on PYTHONPATH; returns non-zero when they do not install.
install_server_wheels() {
  if [ ! -e /tmp/site/.kvflow-carried ]; then
    python3 -P -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site .whl/grammar/*.whl .whl/http/*.whl || return 1
    touch /tmp/site/.kvflow-carried
  fi
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
}
# The repository's root conftest.py (the CI skip policy) would put the repo root first on
# sys.path under pytest, where its bare kvflow/ folder hides the shim's kvflow.runtime:
# conftest files are looked up from tests/ down only.
export PYTEST_ADDOPTS="--confcutdir=$REPO/tests${PYTEST_ADDOPTS:+ $PYTEST_ADDOPTS}"
set +e
