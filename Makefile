# kvflow: `make run` serves the embedded model, `make test` runs the whole suite.
# Every target sets up what it needs (Debian packages, .venv, the embedded model) on first use.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Python started with -m or -c puts the working directory, the repository root, first on
# sys.path, where its top-level operator/ folder shadows the standard library's operator:
# every such start here takes -P (tests/test_safe_path.py checks the Makefile, mk/*.mk and
# scripts/*.sh). A script in a subfolder (benchmarks/...) puts only its own folder first.
# PY_REPO_MODULE runs a module of the repository that is not installed (e2e) with the root
# appended after the standard library and site-packages instead.
PY_REPO_MODULE = $(PY) -P -c 'import runpy, sys; sys.path.append("."); runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)'
STAMP := $(VENV)/.kvflow-setup
export PYTHONUNBUFFERED := 1

.DEFAULT_GOAL := help

$(STAMP): pyproject.toml setup.py scripts/setup.sh
	VENV=$(VENV) scripts/setup.sh
	touch $@

.PHONY: setup
setup: $(STAMP) ## create .venv and install kvflow, its extras and the embedded model

.PHONY: run
run: $(STAMP) ## serve the embedded SmolLM2-135M-Instruct on http://127.0.0.1:8000 (OpenAI API)
	$(PY) -P -m kvflow serve

.PHONY: test
test: $(STAMP) ## run the whole test suite (unit, engine parity, server, control plane)
	$(PY) -P -m pytest -q $(PYTEST_ARGS)

.PHONY: lint
lint: $(STAMP) ## ruff (lint + format check) and mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy kvflow operator runtime

.PHONY: fmt
fmt: $(STAMP) ## format the code with ruff
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

-include mk/*.mk


.PHONY: bench-offline
bench-offline: $(STAMP) ## offline throughput: Engine.generate vs transformers generate (benchmarks/results/offline.md)
	$(PY) benchmarks/bench_offline.py --num-prompts 64 --output-len 64

.PHONY: bench-cpu-kernels
bench-cpu-kernels: $(STAMP) ## native CPU kernels vs torch and oneDNN, engine on/off (benchmarks/results/cpu-kernels.md)
	$(PY) benchmarks/bench_cpu_kernels.py --out benchmarks/results/cpu-kernels.md

.PHONY: bench-tp
bench-tp: $(STAMP) ## tensor parallelism on CPU: decode-step cost of --tp-size 2 vs 1 (benchmarks/results/tp-cpu.md)
	$(PY) -P benchmarks/bench_tp.py --out benchmarks/results/tp-cpu.md

.PHONY: bench-gpu
bench-gpu: $(STAMP) ## GPU benchmarks with Llama-3.1-8B shapes (needs CUDA; see benchmarks/results/gpu.md)
	$(PY) benchmarks/bench_gpu.py all --json-out benchmarks/results/gpu-latest.json

.PHONY: bench-models
bench-models: $(STAMP) ## decode step of each family's real shapes on a GPU (needs CUDA; see benchmarks/results/models.md)
	$(PY) benchmarks/bench_models.py --json-out benchmarks/results/models-latest.json

.PHONY: help
help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sort | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'
