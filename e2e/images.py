"""The images users run (images/router.Dockerfile, images/runtime.Dockerfile in its CPU
flavour), built registry-free from their Dockerfiles (`e2e.k8s.realnode.imagebuild`) under
the names the operator gives pods by default, so real-node tests run what users run.

The CPU flavour's build args are the ones images/runtime.Dockerfile's header gives; its
torch comes from this virtual environment (PyPI's Linux torch, which carries the CUDA
libraries: the CPU-only index is unreachable here), so the image is larger than a
`docker build` of the CPU flavour would be.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from e2e.k8s.realnode.imagebuild import ImageRecipe
from kvflow.operator.spec import DEFAULT_ROUTER_IMAGE, DEFAULT_RUNTIME_IMAGE

__all__ = ["ROUTER", "RUNTIME_CPU", "image_builder_missing"]

REPO = Path(__file__).resolve().parents[1]

ROUTER = ImageRecipe("router", REPO / "images" / "router.Dockerfile", DEFAULT_ROUTER_IMAGE)
RUNTIME_CPU = ImageRecipe(
    "runtime-cpu",
    REPO / "images" / "runtime.Dockerfile",
    DEFAULT_RUNTIME_IMAGE,
    {
        "BASE_IMAGE": "debian:bookworm-slim",
        "TORCH_INDEX": "https://download.pytorch.org/whl/cpu",
        "EXTRAS": "runtime,router",
        "MOONCAKE": "mooncake-transfer-engine-non-cuda==0.3.13.post1",
    },
)


def image_builder_missing() -> str | None:
    """Why the images cannot be built here (a tool the setup installs), or None."""
    missing = [c for c in ("mmdebstrap", "umoci", "unshare", "chroot") if not shutil.which(c)]
    if missing:
        return f"missing {', '.join(missing)} (Debian's mmdebstrap and umoci; make setup)"
    return None
