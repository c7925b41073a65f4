"""The images users run, built from images/*.Dockerfile without a registry (`e2e.images`)
and run as pods on the real node under the operator's default image names.

The router image: no torch in it (`import torch` fails) while the router's own modules
and CLI work, and its size stays under a measured bound. The CPU runtime image: its
`kvflow serve` CLI, torch and the Mooncake master are there. (Serving from both images is
e2e/test_real_node_serving.py's and e2e/test_real_node_pd.py's work.)
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from e2e.k8s import Kube
from e2e.k8s.realnode import RealNode, real_node_placement
from e2e.k8s.realnode.imagebuild import BuiltImage

pytestmark = pytest.mark.cluster

# Measured (November 2026): 121 MiB compressed (Debian bookworm minbase + python3 ~ 45 MiB,
# the router extra's venv ~ 75 MiB, of which the Kubernetes client is the most). The bound
# leaves ~30% for dependency updates; a torch (~900 MiB compressed with its CUDA libraries)
# or numpy (~15 MiB) coming along breaks the import check below first.
ROUTER_MAX_COMPRESSED_MIB = 160

ROUTER_CHECK = """
import importlib.util, sys
try:
    import torch
except ImportError as err:
    print("no torch:", err)
else:
    sys.exit("torch imported from " + torch.__file__)
import kvflow.runtime.router, kvflow.runtime.router.cli, kvflow.runtime.router.app
print("router modules:", kvflow.runtime.router.__file__)
"""
RUNTIME_CHECK = """
import shutil, torch, kvflow.runtime
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), float(torch.ones(3).sum()))
assert shutil.which("mooncake_master"), "mooncake_master missing"
"""


def run_pod(kube: Kube, ns: str, image: str, script: str, timeout: float = 180) -> str:
    """Run `script` in a pod of `image` on the real node (the restricted pod settings the
    operator gives its pods); return its log, failing with it unless it succeeded."""
    name = f"img-{uuid.uuid4().hex[:6]}"
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "hostNetwork": True,
            "restartPolicy": "Never",
            **real_node_placement(),
            "securityContext": {
                "runAsNonRoot": True,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-ec", script],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }
    kube.apply(pod)

    def ended() -> str | None:
        phase = kube.get_json("pod", name, "-n", ns)["status"].get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    phase = kube.wait_for(ended, timeout=timeout, what=f"pod {name} to end")
    logs = kube.kubectl("logs", "-n", ns, name, check=False)
    output = logs.stdout + logs.stderr
    assert phase == "Succeeded", f"{name} {phase}:\n{output}"
    return output


def python(code: str) -> str:
    return f"python -P -c '{code}'"


def test_router_image_holds_no_torch_and_runs_the_router(
    kube: Kube, real_node: RealNode, node_images: dict[str, str], kube_namespace: str
) -> None:
    output = run_pod(
        kube,
        kube_namespace,
        node_images["router"],
        f"{python(ROUTER_CHECK)} && kvflow router --help | head -3",
    )
    assert "no torch: No module named 'torch'" in output, output
    assert "router modules: /opt/kvflow/lib/python3.11/site-packages/" in output, output
    assert "usage:" in output, output


def test_router_image_size(built_images: dict[str, BuiltImage]) -> None:
    image = built_images["router"]
    mib = image.compressed_bytes / 2**20
    print(f"{image.recipe.reference}: {mib:.0f} MiB compressed")
    assert mib <= ROUTER_MAX_COMPRESSED_MIB, f"{mib:.0f} MiB > {ROUTER_MAX_COMPRESSED_MIB} MiB"


def test_cpu_runtime_image_runs_kvflow_serve(
    kube: Kube, real_node: RealNode, node_images: dict[str, str], kube_namespace: str
) -> None:
    output = run_pod(
        kube,
        kube_namespace,
        node_images["runtime-cpu"],
        f"{python(RUNTIME_CHECK)} && kvflow serve --help | head -3",
    )
    assert "torch 2." in output and "cuda False" in output, output
    assert "usage:" in output, output
