"""Pytest wiring for tests that need the local Kubernetes control plane.

- `kube` (session): builds or finds the binaries, starts etcd, kube-apiserver,
  kube-controller-manager, kube-scheduler and kwok with fake GPU nodes, yields an
  `e2e.k8s.Kube`, and stops everything at the end of the session.
- `kube_namespace` (function): a fresh namespace, deleted afterwards.
- `real_node` (session): a real node (containerd + kubelet, `e2e.k8s.realnode`) joined to
  the same control plane; tests that ask for it skip, naming what is missing, only when
  the machine cannot run one (`missing_capability()`: not root, packages, cgroups).
  When a selected test builds the operator image, its cached Debian base (the step that
  reaches Debian's mirror and PyPI) is built after collection, before any test.
- `built_images` (session): the router and CPU runtime images built from their
  Dockerfiles (`e2e.images`; each step cached under the kvflow cache), also built after
  collection when a selected test needs them; `node_images` imports them into the real
  node's containerd under the operator's default image names. Without the build tools
  they skip, except in CI (`CI=true`), where the setup provides them: there they fail.
- `lws` (session): LeaderWorkerSet's controller, CRD and webhooks in the same cluster
  (`e2e.k8s.lws`); its binary is built from the Go module proxy after collection when a
  selected test needs it (cached beside the other binaries), and a failed build fails
  those tests.
- `--no-cluster` skips every test marked `cluster`; tests that use `kube` or `real_node`
  (both built on `control_plane`) get the marker automatically. By default (and in CI)
  they run.

A cold binary build takes far longer than the per-test timeout, so binaries are
resolved once after collection, outside any test, when a selected test needs them.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.k8s import (
    BINARIES,
    BinaryResolutionError,
    ControlPlane,
    ControlPlaneConfig,
    Kube,
    resolve_binaries,
)
from e2e.k8s.bins import LWS_BINARIES, NODE_BINARIES
from e2e.k8s.lws import LwsController
from e2e.k8s.realnode import RealNode, missing_capability
from e2e.k8s.realnode.imagebuild import BuiltImage, build_image, import_built
from e2e.k8s.realnode.operator_image import ensure_operator_base, image_builder_missing

from . import images

__all__: list[str] = []

_RESOLUTION_ERROR = pytest.StashKey[BinaryResolutionError]()
_LWS_ERROR = pytest.StashKey[BinaryResolutionError]()
_BUILT = pytest.StashKey[dict[str, BuiltImage | Exception]]()
_IMAGE_FIXTURES = ("built_images", "node_images")
REPO = Path(__file__).resolve().parents[1]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--no-cluster",
        action="store_true",
        default=False,
        help="skip tests that need the local Kubernetes control plane (marked `cluster`)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="--no-cluster given")
    for item in items:
        if "control_plane" in getattr(item, "fixturenames", ()) and "cluster" not in item.keywords:
            item.add_marker(pytest.mark.cluster)
        if config.getoption("--no-cluster") and "cluster" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    if config.getoption("--no-cluster") or config.getoption("collectonly"):
        return
    fixtures = [set(getattr(item, "fixturenames", ())) for item in session.items]
    if any("control_plane" in names for names in fixtures):
        # The kubelet only when a selected test runs on a real node that can start here.
        node = any("real_node" in names for names in fixtures) and missing_capability() is None
        # A cold cache means a build of many minutes: let its progress lines through.
        capture = config.pluginmanager.getplugin("capturemanager")
        try:
            with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
                resolve_binaries((*BINARIES, *NODE_BINARIES) if node else BINARIES)
        except BinaryResolutionError as err:
            # Fail the cluster tests (in the `kube` fixture), not the whole session.
            config.stash[_RESOLUTION_ERROR] = err
        if any("lws" in names for names in fixtures):
            try:  # a build of about 2 minutes on a cold cache, then cached
                with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
                    resolve_binaries(LWS_BINARIES)
            except BinaryResolutionError as err:  # fails the `lws` tests, in their fixture
                config.stash[_LWS_ERROR] = err
        if node and any("operator_image" in names for names in fixtures):
            _prepare_operator_base(capture)
    if any(set(_IMAGE_FIXTURES) & names for names in fixtures):
        manager = getattr(config.pluginmanager.getplugin("capturemanager"),
                          "global_and_fixture_disabled", None)  # fmt: skip
        with manager() if manager else contextlib.nullcontext():
            config.stash[_BUILT] = _build_images()


def _build_images() -> dict[str, BuiltImage | Exception]:
    """The user images built (or found in the cache), each or the error it failed with."""
    built: dict[str, BuiltImage | Exception] = {}
    if images.image_builder_missing() is not None:
        return built
    for recipe in (images.ROUTER, images.RUNTIME_CPU):
        try:
            built[recipe.name] = build_image(recipe, REPO)
        except Exception as err:  # the fixture reports it
            built[recipe.name] = err
    return built


def _prepare_operator_base(capture: object) -> None:
    """Build (once, cached) the operator image's Debian base, before any test: it is the
    step that reaches Debian's mirror and PyPI. A failure is left to the test's fixture,
    which retries it and fails with the cause."""
    if image_builder_missing() is not None:
        return
    manager = getattr(capture, "global_and_fixture_disabled", None)
    with manager() if manager else contextlib.nullcontext():
        try:
            ensure_operator_base(REPO)
        except Exception as err:  # the fixture reports it
            print(f"operator image base not built: {err}")


@pytest.fixture(scope="session")
def control_plane(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    """A running control plane with 3 kwok nodes (64 CPU, 512Gi, 8 `nvidia.com/gpu` each)."""
    error = request.config.stash.get(_RESOLUTION_ERROR, None)
    if error is not None:
        raise error
    config = ControlPlaneConfig(state_dir=tmp_path_factory.mktemp("k8s"))
    with ControlPlane(resolve_binaries(), config) as plane:
        yield plane


@pytest.fixture(scope="session")
def kube(control_plane: ControlPlane) -> Kube:
    """The session's control plane, as a `Kube` handle."""
    return control_plane.kube


@pytest.fixture(scope="session")
def real_node(control_plane: ControlPlane) -> RealNode:
    """A real node `real-node` (label and NoSchedule taint `kvflow.dev/real-node`) in the
    session's cluster; stopped, leaving no process or mount, with the control plane."""
    reason = missing_capability()
    if reason is not None:
        pytest.skip(f"this machine cannot run a real node: {reason}")
    kubelet = resolve_binaries(NODE_BINARIES)["kubelet"]
    return control_plane.add_real_node(kubelet)


@pytest.fixture(scope="session")
def lws(request: pytest.FixtureRequest, control_plane: ControlPlane) -> LwsController:
    """LeaderWorkerSet's controller (sigs.k8s.io/lws, pinned in `versions.py`, built from
    the Go module proxy and cached) with its CRD and webhooks, in the session's cluster.
    A machine that cannot build it fails these tests (no skip: CI has go)."""
    error = request.config.stash.get(_LWS_ERROR, None)
    if error is not None:
        raise error
    return control_plane.start_lws(resolve_binaries(LWS_BINARIES))


@pytest.fixture(scope="session")
def built_images(request: pytest.FixtureRequest) -> dict[str, BuiltImage]:
    """The router and CPU runtime images (`e2e.images`), built from their Dockerfiles."""
    reason = images.image_builder_missing()
    if reason is not None:
        message = f"cannot build the images here: {reason}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    built = request.config.stash.get(_BUILT, None) or _build_images()
    out: dict[str, BuiltImage] = {}
    for name, image in built.items():
        if isinstance(image, Exception):
            raise RuntimeError(f"building the {name} image failed: {image}") from image
        out[name] = image
    return out


@pytest.fixture(scope="session")
def node_images(real_node: RealNode, built_images: dict[str, BuiltImage]) -> dict[str, str]:
    """The built images imported into the real node's containerd, by recipe name: the
    references the operator's defaults name."""
    started = time.monotonic()
    out = {name: import_built(real_node.config, image) for name, image in built_images.items()}
    print(f"images imported into the real node in {time.monotonic() - started:.1f}s: {out}")
    return out


@pytest.fixture
def kube_namespace(kube: Kube) -> Iterator[str]:
    """A namespace of this test's own; deleted (without waiting) afterwards."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    kube.kubectl("create", "namespace", name)
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)
