"""`helm install` of the operator chart in tests that run it on the real node."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

from e2e.k8s import Kube

__all__ = ["CHART", "install_operator_chart"]

CHART = Path(__file__).resolve().parents[1] / "charts" / "kvflow-operator"
CRD_NAME = "modeldeployments.kvflow.dev"


def _adopt_crd(kube: Kube, release: str, namespace: str) -> list[str]:
    """Let this release own a CRD installed earlier in the session (by kubectl or another
    release), as docs/operator.md describes; returns the extra helm flags."""
    existing = kube.kubectl("get", "crd", CRD_NAME, "--ignore-not-found", "-o", "name").stdout
    if not existing.strip():
        return []
    kube.kubectl("label", "crd", CRD_NAME, "--overwrite", "app.kubernetes.io/managed-by=Helm")
    kube.kubectl(
        "annotate", "crd", CRD_NAME, "--overwrite",
        f"meta.helm.sh/release-name={release}", f"meta.helm.sh/release-namespace={namespace}",
    )  # fmt: skip
    return ["--force-conflicts"]


def install_operator_chart(
    kube: Kube, release: str, namespace: str, values: dict[str, Any], work: Path
) -> float:
    """Install the chart with `values` (`--wait`: the operator pod runs); return seconds."""
    values_file = work / f"{release}-values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    adopt = _adopt_crd(kube, release, namespace)
    started = time.monotonic()
    kube.helm(
        "install", release, str(CHART), "-n", namespace, "--create-namespace",
        "-f", str(values_file), *adopt, "--wait", "--timeout", "180s",
    )  # fmt: skip
    return time.monotonic() - started
