"""Names, labels and owner references of the objects a ModelDeployment owns.

Every child carries the same label set; ``kvflow.dev/deployment`` and ``kvflow.dev/role``
select a role's pods, and ``app.kubernetes.io/managed-by`` marks what the operator may
prune. Child names are ``<deployment>-<component>`` (the CRD caps deployment names at 45
characters, so the longest suffix still fits a 63-character DNS label).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from kvflow import contract

GROUP = "kvflow.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ModelDeployment"
PLURAL = "modeldeployments"

FIELD_MANAGER = "kvflow-operator"
MANAGED_BY = "kvflow-operator"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_DEPLOYMENT = f"{GROUP}/deployment"
LABEL_ROLE = contract.ROLE_LABEL
# Pods of a role over several nodes: "leader" (node rank 0, serves HTTP) or "worker" (ranks
# only); Services and the router's discovery select leaders. Other pods do not carry it.
LABEL_NODE = f"{GROUP}/node"
NODE_LEADER = "leader"
NODE_WORKER = "worker"

# Annotations the operator writes on children.
ANNOTATION_GENERATION = f"{GROUP}/generation"  # ModelDeployment generation a child renders
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"  # pod template: rolls pods on config change
ANNOTATION_BOOTSTRAP_PORT = contract.BOOTSTRAP_PORT_ANNOTATION  # prefill pods: KV bootstrap port

# Component names; the runtime roles come from kvflow.contract.ROLES, a shared store's from
# its module in stores/.
ROUTER = "router"


def child_name(deployment: str, component: str) -> str:
    """``<deployment>-<component>``: the name of a child object."""
    return f"{deployment}-{component}"


def selector_labels(deployment: str, component: str) -> dict[str, str]:
    """The labels that select one component's pods (immutable in a Deployment selector)."""
    return {LABEL_DEPLOYMENT: deployment, LABEL_ROLE: component}


def owned_selector(deployment: str) -> str:
    """Label selector (string form) of every object the operator made for ``deployment``."""
    return f"{LABEL_DEPLOYMENT}={deployment},{LABEL_MANAGED_BY}={MANAGED_BY}"


def labels(deployment: str, component: str) -> dict[str, str]:
    """The full label set of a child object and its pods."""
    return {
        LABEL_NAME: "kvflow",
        LABEL_INSTANCE: deployment,
        LABEL_COMPONENT: component,
        LABEL_PART_OF: "kvflow",
        LABEL_MANAGED_BY: MANAGED_BY,
        **selector_labels(deployment, component),
    }


def owner_reference(deployment: str, uid: str) -> dict[str, Any]:
    """The controller owner reference that lets the garbage collector delete children."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": deployment,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


class OwnerInfo(Protocol):
    """Identity of the owning ModelDeployment (``spec.ModelDeployment`` satisfies it)."""

    @property
    def name(self) -> str: ...

    @property
    def namespace(self) -> str: ...

    @property
    def uid(self) -> str: ...

    @property
    def generation(self) -> int: ...


def object_meta(
    owner: OwnerInfo,
    name: str,
    component: str,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``metadata`` of a child: name, namespace, labels, generation annotation, owner."""
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner.name, component),
        "annotations": {ANNOTATION_GENERATION: str(owner.generation), **(annotations or {})},
        "ownerReferences": [owner_reference(owner.name, owner.uid)],
    }
