"""Container images built here without a registry: OCI layouts by umoci, imported by ctr.

- `pause`: the sandbox image, compiled (`gcc -static`) from `build/pause/linux/pause.c` of
  the same k8s.io/kubernetes module the binaries come from.
- `hostbase`: an empty root whose `bin`, `lib`, `lib64` and `sbin` point into `/usr`, plus
  the host's passwd/group files, loader cache and alternatives (`cc` and friends). A pod mounts the host's `/usr` read-only over it (and
  whatever else it runs from, such as a Python installation and a virtual environment), so
  host programs run in a container without building an image of them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from ..bins.gotool import GoTool
from ..env import K8sEnv
from ..versions import K8sVersions
from .config import RealNodeConfig
from .containerd import PAUSE_IMAGE, ctr, ctr_argv

__all__ = [
    "HOST_BASE_IMAGE",
    "build_host_base",
    "build_pause",
    "import_image",
    "kubernetes_module_dir",
    "oci_image",
]

HOST_BASE_IMAGE = "localhost/kvflow/hostbase:local"
_TAG = "local"
_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"


def kubernetes_module_dir(env: K8sEnv, versions: K8sVersions) -> Path:
    """The k8s.io/kubernetes module's source directory in kvflow's Go module cache."""
    go = GoTool(env)
    module = f"k8s.io/kubernetes@v{versions.kubernetes}"
    done = subprocess.run(
        [go.command, "mod", "download", "-json", module],
        env=go.environ(""),
        capture_output=True,
        text=True,
        check=False,
        cwd=env.cache_dir if env.cache_dir.is_dir() else None,
    )
    try:
        directory = Path(json.loads(done.stdout)["Dir"])
    except (ValueError, KeyError):
        raise RuntimeError(f"go mod download {module} failed: {done.stdout}{done.stderr}") from None
    return directory


def oci_image(work: Path, name: str, rootfs: Path, config: Sequence[str]) -> Path:
    """Pack `rootfs` as one layer of image `<name>:local` with umoci; return a tar of the
    OCI layout (what `ctr images import` reads). `config` are `umoci config` flags."""
    layout = work / f"{name}.oci"
    bundle = work / f"{name}.bundle"
    shutil.rmtree(layout, ignore_errors=True)
    shutil.rmtree(bundle, ignore_errors=True)
    ref = f"{layout}:{_TAG}"
    _run("umoci", "init", "--layout", str(layout))
    _run("umoci", "new", "--image", ref)
    _run("umoci", "unpack", "--image", ref, str(bundle))
    shutil.copytree(rootfs, bundle / "rootfs", symlinks=True, dirs_exist_ok=True)
    _run("umoci", "repack", "--image", ref, str(bundle))
    shutil.rmtree(bundle)
    _run("umoci", "config", "--image", ref, *config)
    tar = work / f"{name}.tar"
    _run("tar", "-C", str(layout), "-cf", str(tar), ".")
    return tar


def import_image(
    cfg: RealNodeConfig, tar: Path | Callable[[IO[bytes]], None], reference: str
) -> None:
    """Import an OCI tar into the node's containerd as `reference` (`<repo>:<tag>`): a tar
    file, or a function that writes one to the stream it is given (`ctr` reads it from
    its stdin: a multi-GB image is not written to disk once more on the way)."""
    base = reference.rsplit(":", 1)[0]
    # NOTE: the CPU runtime image is ~3.4 GB; its import took 60-120 s on a 2-core machine
    # and once ran past 120 s with a cold page cache, so it gets a wider bound.
    if isinstance(tar, Path):
        ctr(cfg, "images", "import", "--base-name", base, str(tar), timeout=600)
    else:
        argv = ctr_argv(cfg, "images", "import", "--base-name", base, "-")
        with (
            tempfile.TemporaryFile() as err,
            subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=err, stderr=err) as importer,
        ):
            assert importer.stdin is not None
            try:
                with importer.stdin:
                    tar(importer.stdin)
            except BrokenPipeError:
                pass  # ctr stopped reading: its exit status and message say why
            try:
                importer.wait(timeout=600)
            except subprocess.TimeoutExpired:
                importer.kill()
                raise
            if importer.returncode != 0:
                err.seek(0)
                tail = err.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"ctr images import {reference} failed: {tail}")
    listed = ctr(cfg, "images", "ls", "-q").stdout.split()
    if reference not in listed:
        raise RuntimeError(f"{reference} missing after import; containerd has {listed}")


def build_pause(cfg: RealNodeConfig, module_dir: Path) -> None:
    """Compile the pause binary from the module's source and import `PAUSE_IMAGE`."""
    source = module_dir / "build" / "pause" / "linux" / "pause.c"
    rootfs = cfg.images_dir / "pause.rootfs"
    rootfs.mkdir(parents=True, exist_ok=True)
    _run("gcc", "-Os", "-static", "-o", str(rootfs / "pause"), str(source))
    config = ["--config.entrypoint", "/pause", "--config.user", "65535:65535"]
    import_image(cfg, oci_image(cfg.images_dir, "pause", rootfs, config), PAUSE_IMAGE)


def build_host_base(cfg: RealNodeConfig) -> None:
    """Build and import `HOST_BASE_IMAGE` (see the module docstring)."""
    rootfs = cfg.images_dir / "hostbase.rootfs"
    for sub in ("usr", "etc", "tmp", "proc", "sys", "dev"):
        (rootfs / sub).mkdir(parents=True, exist_ok=True)
    (rootfs / "tmp").chmod(0o1777)
    for link in ("bin", "lib", "lib64", "sbin"):
        target = rootfs / link
        if not target.is_symlink():
            os.symlink(f"usr/{link}", target)
    for name in ("passwd", "group", "nsswitch.conf", "ld.so.cache"):
        if Path("/etc", name).is_file():
            shutil.copy(Path("/etc", name), rootfs / "etc" / name)
    # Debian's alternatives (`cc` -> /etc/alternatives/cc -> gcc) are symlinks into /usr.
    if Path("/etc/alternatives").is_dir():
        shutil.copytree(
            "/etc/alternatives", rootfs / "etc" / "alternatives", symlinks=True, dirs_exist_ok=True
        )
    config = ["--config.env", f"PATH={_PATH}", "--config.cmd", "/bin/sh"]
    import_image(cfg, oci_image(cfg.images_dir, "hostbase", rootfs, config), HOST_BASE_IMAGE)


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
