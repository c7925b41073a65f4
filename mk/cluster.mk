# Local Kubernetes control plane (e2e/k8s): etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler and kwok-simulated GPU nodes as processes on loopback. Binaries are
# pinned in e2e/k8s/versions.py and cached in $${KVFLOW_CACHE_DIR:-~/.cache/kvflow}/k8s;
# the first build from source takes many minutes, later starts take seconds.
# REAL_NODE=1 adds a real node (containerd + a kubelet built with the rest, on loopback)
# whose pods really run; see docs/cluster.md. It needs root and scripts/setup.sh's packages.
CLUSTER_ARGS ?=
REAL_NODE ?=

.PHONY: cluster
cluster: $(STAMP) ## start a local Kubernetes control plane with fake GPU nodes (REAL_NODE=1: plus a real node); prints KUBECONFIG, Ctrl-C stops it
	$(PY_REPO_MODULE) e2e.k8s up $(if $(REAL_NODE),--real-node) $(CLUSTER_ARGS)

.PHONY: cluster-bins
cluster-bins: $(STAMP) ## fetch or build the pinned Kubernetes binaries (etcd, apiserver, ..., kwok, kubectl, helm, kubelet, LeaderWorkerSet) into the cache
	$(PY_REPO_MODULE) e2e.k8s build
