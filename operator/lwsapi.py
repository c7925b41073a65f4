"""What the operator uses of LeaderWorkerSet's API (sigs.k8s.io/lws, checked at v0.7.0).

A LeaderWorkerSet runs ``replicas`` groups of ``size`` pods: a leader (worker index 0) and
``size - 1`` workers. LWS's pod webhook gives every pod of a group the env below, which the
kubelet expands in the container command (``$(VAR)``); without the webhook the variables
are unset and the runtime refuses the literal ``$(LWS_WORKER_INDEX)`` as a node rank.
"""

from __future__ import annotations

GROUP = "leaderworkerset.x-k8s.io"
API_VERSION = f"{GROUP}/v1"
KIND = "LeaderWorkerSet"
PLURAL = "leaderworkersets"

LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"  # the leader pod's DNS name
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"  # 0 on the leader, 1 .. size - 1 on the workers
GROUP_SIZE_ENV = "LWS_GROUP_SIZE"

# A pod's index in its group (set by LWS's webhook and controller on every pod).
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
