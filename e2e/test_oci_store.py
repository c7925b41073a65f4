"""The image build's OCI layout (`e2e.k8s.realnode.oci.Store`) on a small layout made with
umoci: pruning tags deletes exactly the blobs `umoci gc` would, and the kept images stay
whole; a step's overlay upper becomes a layer that unpacks to what the step saw. The
build's context (`_context_files`) skips ignored folders without changing what
it keeps. No cluster, no image build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from e2e.k8s.env import K8sEnv
from e2e.k8s.realnode.imagebuild import ImageRecipe, _Build
from e2e.k8s.realnode.oci import Store
from e2e.k8s.realnode.overlay import OverlayRoot, layer_tar


def _umoci(*args: str) -> None:
    subprocess.run(["umoci", *args], check=True, capture_output=True)


def _blobs(layout: Path) -> set[str]:
    return {p.name for p in (layout / "blobs" / "sha256").iterdir()}


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    if shutil.which("umoci") is None:  # in CI the root conftest fails this skip
        pytest.skip("umoci not found (scripts/setup.sh installs it)")
    path = tmp_path / "store"
    _umoci("init", "--layout", str(path))
    for tag in ("app.a", "app.b", "other.c"):
        _umoci("new", "--image", f"{path}:{tag}")
        _umoci("config", "--image", f"{path}:{tag}", "--config.env", f"TAG={tag}")
    # a layer only app.b holds
    bundle = tmp_path / "bundle"
    _umoci("unpack", "--rootless", "--image", f"{path}:app.b", str(bundle))
    (bundle / "rootfs" / "only-in-b").write_text("b")
    _umoci("repack", "--image", f"{path}:app.b", str(bundle))
    return path


def test_prune_deletes_what_umoci_gc_would_and_keeps_the_rest_whole(
    layout: Path, tmp_path: Path
) -> None:
    reference = tmp_path / "reference"
    shutil.copytree(layout, reference)
    _umoci("rm", "--image", f"{reference}:app.b")
    _umoci("gc", "--layout", str(reference))

    before = _blobs(layout)
    Store(layout).prune("app.", keep={"app.a"})

    assert _blobs(layout) == _blobs(reference)
    assert _blobs(layout) < before  # app.b's manifest, config and layer went
    refs = [m["annotations"]["org.opencontainers.image.ref.name"] for m in
            json.loads((layout / "index.json").read_text())["manifests"]]  # fmt: skip
    assert sorted(refs) == ["app.a", "other.c"]
    for tag in refs:  # every kept image is still readable in full
        _umoci("stat", "--image", f"{layout}:{tag}")


def test_prune_without_stale_tags_deletes_nothing(layout: Path) -> None:
    before = _blobs(layout)
    Store(layout).prune("app.", keep={"app.a", "app.b"})
    assert _blobs(layout) == before


def test_context_files_skip_ignored_folders_and_keep_the_same_files(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    files = [
        "pyproject.toml",
        "kvflow/cli.py",
        "kvflow/__pycache__/cli.cpython-311.pyc",
        "runtime/deep/er/mod.py",
        "runtime/deep/er/mod.pyc",
        ".venv/lib/site.py",
        "tests/test_x.py",
        "pkg.egg-info/PKG-INFO",
        "docs/keep/not.md",
    ]
    for name in files:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(name)
    dockerfile = repo / "images" / "x.Dockerfile"
    dockerfile.parent.mkdir()
    dockerfile.write_text("FROM debian:bookworm-slim\n")
    ignore = ["**/__pycache__", "**/*.pyc", ".venv", "tests", "*.egg-info", "docs", "images"]
    dockerfile.with_name("x.Dockerfile.dockerignore").write_text("\n".join(ignore))
    recipe = ImageRecipe("x", dockerfile, "example/x:1")
    build = _Build(recipe, repo, Store(tmp_path / "unused"), K8sEnv.from_environ())

    every_file = sorted(p for p in repo.rglob("*") if p.is_file())
    want = [p for p in every_file if not build._ignored(p.relative_to(repo))]
    assert build._context_files(".") == want
    assert [p.relative_to(repo).as_posix() for p in want] == [
        "kvflow/cli.py",
        "pyproject.toml",
        "runtime/deep/er/mod.py",
    ]
    assert build._context_files("pyproject.toml") == [repo / "pyproject.toml"]


def _tree(root: Path) -> dict[str, tuple[str, str]]:
    """Every entry under `root`: its kind and content (file bytes, link target)."""
    out: dict[str, tuple[str, str]] = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[name] = ("link", os.readlink(path))
        elif path.is_dir():
            out[name] = ("dir", oct(path.stat().st_mode & 0o7777))
        else:
            out[name] = ("file", path.read_text() + oct(path.stat().st_mode & 0o7777))
    return out


def test_a_step_on_an_overlay_becomes_a_layer_that_unpacks_to_what_the_step_saw(
    layout: Path, tmp_path: Path
) -> None:
    """Changes made on an `OverlayRoot` (new, changed and deleted files, a folder replaced
    whole, links) stored by `layer_tar` + `Store.add_layer` unpack (`Store.rootfs`, zstd
    and whiteouts applied) to exactly the tree the step saw; the lower stays untouched."""
    if os.geteuid() != 0 or shutil.which("zstd") is None:  # CI runs as root with zstd
        pytest.skip("overlay mounts need root; zstd (Debian's zstd) compresses the layer")
    store = Store(layout)
    base = tmp_path / "base"
    for name, text in {"keep": "k", "change": "c", "gone": "g", "d/x": "x", "d/y": "y",
                       "e/old": "o", "bin/tool": "t"}.items():  # fmt: skip
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).write_text(text)
    (base / "lib").symlink_to("bin")
    subprocess.run(["tar", "-cf", str(tmp_path / "base.tar"), "-C", str(base), "."], check=True)
    store.add_layer("app.a", "app.base", tmp_path / "base.tar")
    lower = store.rootfs("app.base")
    assert _tree(lower) == _tree(base)
    before = _tree(lower)

    root = OverlayRoot([lower], tmp_path / "overlay")
    with root.mounted():
        merged = root.merged
        (merged / "change").write_text("changed")
        (merged / "gone").unlink()
        (merged / "d" / "x").unlink()
        shutil.rmtree(merged / "e")
        (merged / "e").mkdir()
        (merged / "e" / "new").write_text("n")
        (merged / "new" / "deep").mkdir(parents=True)
        (merged / "new" / "deep" / "f").write_text("f")
        os.link(merged / "new" / "deep" / "f", merged / "hard")
        (merged / "d" / "ln").symlink_to("../keep")
        (merged / "bin" / "tool").chmod(0o755)
        seen = _tree(merged)
        upper = root.seal()
        layer_tar(upper, tmp_path / "layer.tar")
    store.add_layer("app.base", "app.step", tmp_path / "layer.tar")

    assert _tree(store.rootfs("app.step")) == seen
    assert "gone" not in seen and "e/old" not in seen and seen["e/new"][0] == "file"
    assert _tree(lower) == before
