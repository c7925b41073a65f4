"""The Dockerfile reader the registry-free image build runs (`e2e.k8s.realnode.dockerfile`),
on kvflow's own Dockerfiles: what the build will run is what `docker build` would, and a
flavour the build cannot make here (the CUDA runtime) says so instead of building
something else. No cluster, no build."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.images import ROUTER, RUNTIME_CPU
from e2e.k8s.realnode.dockerfile import parse_dockerfile
from e2e.k8s.realnode.imagebuild import Unbuildable, _base_packages, _split_run

REPO = Path(__file__).resolve().parents[1]


def test_cuda_runtime_defaults_parse_and_are_refused_here() -> None:
    (stage,) = parse_dockerfile(RUNTIME_CPU.dockerfile)
    assert stage.image == "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04"
    assert stage.args["EXTRAS"] == "runtime,router,gpu"
    assert stage.args["MOONCAKE"] == "mooncake-transfer-engine==0.3.13.post1"
    with pytest.raises(Unbuildable, match="registries this machine cannot reach"):
        _base_packages(stage)


def test_cpu_runtime_flavour_args_reach_its_steps() -> None:
    (stage,) = parse_dockerfile(RUNTIME_CPU.dockerfile, RUNTIME_CPU.build_args)
    assert stage.image == "debian:bookworm-slim"
    assert stage.args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    packages, _ = _base_packages(stage)
    # libcurl4: mooncake_master links it (the pod crash-looped without it)
    assert {"python3", "python3-venv", "gcc", "libibverbs1", "libcurl4", "passwd"} <= set(packages)
    keywords = [step.keyword for step in stage.steps]
    # the base's apt line, the dependency layer, kvflow's install with its build checks
    assert keywords.count("RUN") == 3 and keywords[-1] == "CMD"
    (bind,) = [step for step in stage.steps if step.mounts]
    assert bind.mounts[0].source == "." and bind.mounts[0].rw


def test_router_image_is_python_slim_with_the_router_extra_only() -> None:
    (stage,) = parse_dockerfile(ROUTER.dockerfile)
    assert stage.image == "python:3.11-slim"
    runs = " ".join(step.text for step in stage.steps if step.keyword == "RUN")
    assert '".[router]"' in runs and "torch" in runs  # the no-heavy-package check
    packages, env = _base_packages(stage)
    assert "python-is-python3" in packages and env["LANG"] == "C.UTF-8"


def test_apt_lines_go_to_the_base_and_the_rest_runs() -> None:
    packages, rest = _split_run(
        "apt-get update && apt-get install -y --no-install-recommends gcc libnuma1 "
        "&& rm -rf /var/lib/apt/lists/* && groupadd --gid 1000 kvflow"
    )
    assert packages == ["gcc", "libnuma1"]
    assert rest == "groupadd --gid 1000 kvflow"


def test_unknown_instructions_fail_loudly(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM debian:bookworm-slim\nHEALTHCHECK CMD true\n")
    with pytest.raises(ValueError, match="HEALTHCHECK is not understood"):
        parse_dockerfile(dockerfile)
