# Local Kubernetes control plane (e2e/k8s): etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler and kwok-simulated GPU nodes as processes on loopback. Binaries are
# pinned in e2e/k8s/versions.py and cached in $${KVFLOW_CACHE_DIR:-~/.cache/kvflow}/k8s;
# the first build from source takes many minutes, later starts take seconds.
CLUSTER_ARGS ?=

.PHONY: cluster
cluster: $(STAMP) ## start a local Kubernetes control plane with fake GPU nodes; prints KUBECONFIG, Ctrl-C stops it
	$(PY) -m e2e.k8s up $(CLUSTER_ARGS)

.PHONY: cluster-bins
cluster-bins: $(STAMP) ## fetch or build the pinned Kubernetes binaries (etcd, apiserver, ..., kwok, kubectl, helm) into the cache
	$(PY) -m e2e.k8s build
