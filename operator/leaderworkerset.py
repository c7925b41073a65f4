"""LeaderWorkerSets: a worker role whose replicas each span several nodes.

One replica is one group of ``nodesPerReplica`` pods running the same ``kvflow serve``
command (``--nnodes N --node-rank $(LWS_WORKER_INDEX) --dist-init-addr
$(LWS_LEADER_ADDRESS):PORT``, see :func:`.placement.cluster_node_placement`). The leader
(node rank 0) serves HTTP and carries the probes; the workers run ranks only, so they have
no HTTP probe: a rank that ends ends its pod, and the group is recreated whole
(``RecreateGroupOnPodRestart``). Services and the router select leaders
(:data:`names.LABEL_NODE`).
"""

from __future__ import annotations

import copy
from typing import Any

from . import lwsapi, names
from .configmap import worker_config_hash
from .pods import worker_pod_template
from .spec import ModelDeployment, WorkerRole

_PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
_SCRAPE_ANNOTATIONS = ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path")


def _node_template(template: dict[str, Any], node: str) -> dict[str, Any]:
    """The role's pod template as a group's leader or worker pod."""
    out = copy.deepcopy(template)
    out["metadata"]["labels"][names.LABEL_NODE] = node
    if node == names.NODE_WORKER:  # ranks only: no HTTP to probe, scrape or expose
        container = out["spec"]["containers"][0]
        for probe in _PROBES:
            del container[probe]
        del container["ports"]
        for key in _SCRAPE_ANNOTATIONS:
            del out["metadata"]["annotations"][key]
    return out


def worker_leader_worker_set(
    md: ModelDeployment, worker: WorkerRole, replicas: int
) -> dict[str, Any]:
    """LeaderWorkerSet ``<name>-<role>`` of ``replicas`` groups of ``nodesPerReplica`` pods.

    Groups roll one at a time: GPU groups without surge (a surge group would wait for free
    GPUs), CPU groups surge first. ``UniquePerReplica`` gives each group its own headless
    Service (``<name>-<role>-<group>``, publishing not-ready pods, so workers reach their
    leader before it is ready); the role's own Service ``<name>-<role>`` keeps its name.
    """
    template = worker_pod_template(md, worker, worker_config_hash(md))
    rolling = {"maxUnavailable": 1, "maxSurge": 0 if worker.gpus else 1}
    return {
        "apiVersion": lwsapi.API_VERSION,
        "kind": lwsapi.KIND,
        "metadata": names.object_meta(md, names.child_name(md.name, worker.role), worker.role),
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": rolling},
            "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
            "leaderWorkerTemplate": {
                "size": worker.nodes_per_replica,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _node_template(template, names.NODE_LEADER),
                "workerTemplate": _node_template(template, names.NODE_WORKER),
            },
        },
    }
