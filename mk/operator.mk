# The operator, its CRD, chart and images. Cluster targets use the current KUBECONFIG
# (`make cluster` prints one for a local control plane); helm comes from the same cache
# as the cluster binaries (e2e/k8s).
HELM_BIN = $(shell $(PY) -P -c "import sys; sys.path.append('.'); from e2e.k8s import resolve_binaries; print(resolve_binaries(['helm'])['helm'])")
CHART := charts/kvflow-operator
OPERATOR_ARGS ?=
DOCKER ?= docker
IMAGE_REPO ?= ghcr.io/kvflow
IMAGE_TAG ?= 0.1.0

.PHONY: operator
operator: $(STAMP) ## run the operator against the current KUBECONFIG (OPERATOR_ARGS="-n ns ...")
	$(PY) -P -m kvflow operator $(OPERATOR_ARGS)

.PHONY: crds-apply
crds-apply: ## install or update the ModelDeployment CRD in the current cluster (kubectl)
	kubectl apply --server-side --force-conflicts -f crds/

.PHONY: chart-crds
chart-crds: ## copy crds/ into the chart (files/crds/), after editing the CRD
	cp crds/*.yaml $(CHART)/files/crds/

.PHONY: helm-lint
helm-lint: $(STAMP) ## helm lint --strict and helm template of the operator chart
	$(HELM_BIN) lint --strict $(CHART)
	$(HELM_BIN) template kvflow $(CHART) --namespace kvflow-system > /dev/null

.PHONY: operator-test
operator-test: $(STAMP) ## operator unit tests (no cluster): builders, golden files, CRD, chart files, status
	$(PY) -P -m pytest -q tests/operator $(PYTEST_ARGS)

.PHONY: operator-golden
operator-golden: $(STAMP) ## regenerate tests/operator/golden/*.yaml after an intended builder change
	KVFLOW_UPDATE_GOLDEN=1 $(PY) -P -m pytest -q tests/operator/test_operator_golden.py

.PHONY: operator-cluster-test
operator-cluster-test: $(STAMP) ## chart, operator and autoscaler tests against a local control plane (prints apply-to-Ready and scaling times)
	$(PY) -P -m pytest -q -rP e2e/test_chart.py e2e/test_operator.py e2e/test_operator_lws.py e2e/test_autoscaler.py $(PYTEST_ARGS)

.PHONY: operator-lint
operator-lint: $(STAMP) ## ruff and mypy on the operator and its tests
	$(VENV)/bin/ruff check operator tests/operator e2e/test_operator.py e2e/test_chart.py e2e/operator_process.py
	$(VENV)/bin/ruff format --check operator tests/operator e2e/test_operator.py e2e/test_chart.py e2e/operator_process.py
	$(VENV)/bin/mypy operator

.PHONY: images
images: ## build the runtime (CUDA), operator and router images (needs a Docker engine)
	$(DOCKER) build -f images/runtime.Dockerfile -t $(IMAGE_REPO)/runtime:$(IMAGE_TAG) .
	$(DOCKER) build -f images/operator.Dockerfile -t $(IMAGE_REPO)/operator:$(IMAGE_TAG) .
	$(DOCKER) build -f images/router.Dockerfile -t $(IMAGE_REPO)/router:$(IMAGE_TAG) .
