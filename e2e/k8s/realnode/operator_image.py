"""The operator image, built here without a registry or a container daemon.

`images/operator.Dockerfile` starts `FROM python:3.11-slim`, which lives on Docker Hub,
unreachable from this machine. This module follows the Dockerfile's steps on a Debian
root file system instead:

- `ensure_operator_base()` (set-up, needs Debian's mirror and the package index, cached):
  `mmdebstrap` makes a minimal bookworm root with `python3`, `python3-venv` and
  `ca-certificates`; the host's pip downloads the wheels of the `operator` extra (and
  the build requirements); inside the root (a chroot in a private mount namespace)
  `python3 -m venv /opt/kvflow` installs them offline and user 1000 `kvflow` is added.
  The result is an OCI layout under `<cache>/images/`, keyed by everything it depends on.
- `build_operator_image()` (no network): unpacks that base, installs this checkout's
  `kvflow` into the venv (`--no-deps --no-index`), runs the Dockerfile's checks
  (`kvflow operator --help`, no torch), and packs `localhost/kvflow/operator:local`
  (entrypoint `kvflow operator`, user 1000) as a second layer, then imports it. The
  packed image is cached by a hash of the sources it was made from.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import tomllib

from ..env import K8sEnv
from ..log import elapsed, say
from .config import RealNodeConfig
from .images import import_image

__all__ = [
    "OPERATOR_IMAGE",
    "build_operator_image",
    "ensure_operator_base",
    "image_builder_missing",
]

OPERATOR_IMAGE = "localhost/kvflow/operator:local"
_SUITE = "bookworm"
_DEBIAN_PACKAGES = ("python3", "python3-venv", "ca-certificates")
_VENV = "/opt/kvflow"
_SOURCES = ("pyproject.toml", "setup.py", "README.md", "kvflow", "operator")
_USER = ("kvflow", 1000)
_PATH = f"{_VENV}/bin:/usr/local/bin:/usr/bin:/bin"


def image_builder_missing() -> str | None:
    """Why the operator image cannot be built here, or None."""
    missing = [c for c in ("mmdebstrap", "umoci", "unshare", "chroot") if not shutil.which(c)]
    if missing:
        return f"missing {', '.join(missing)} (Debian's mmdebstrap and umoci; make setup)"
    return None


def _requirements(repo: Path) -> list[str]:
    project = tomllib.loads((repo / "pyproject.toml").read_text())
    return [
        *project["build-system"]["requires"],
        *project["project"]["dependencies"],
        *project["project"]["optional-dependencies"]["operator"],
    ]


def _base_key(repo: Path) -> str:
    text = json.dumps([_SUITE, _DEBIAN_PACKAGES, _requirements(repo), sys.version_info[:2]])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _run(*argv: str, cwd: Path | None = None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=cwd)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip()[-3000:]
        raise RuntimeError(f"{' '.join(argv[:6])} ... failed ({done.returncode}):\n{tail}")
    return done.stdout


def _in_root(rootfs: Path, script: str) -> str:
    """Run `script` (sh) chrooted in `rootfs`, with /dev and /proc mounted in a private
    mount namespace that ends with the command (nothing stays mounted)."""
    wrapper = (
        'set -e; R="$1"; shift; mount --rbind /dev "$R/dev"; mount -t proc proc "$R/proc"; '
        'exec chroot "$R" /bin/sh -ec "$1"'
    )
    return _run("unshare", "--mount", "--fork", "sh", "-c", wrapper, "sh", str(rootfs), script)


def _add_user(rootfs: Path) -> None:
    name, uid = _USER
    with open(rootfs / "etc" / "passwd", "a") as passwd:
        passwd.write(f"{name}:x:{uid}:{uid}::/nonexistent:/usr/sbin/nologin\n")
    with open(rootfs / "etc" / "group", "a") as group:
        group.write(f"{name}:x:{uid}:\n")


def ensure_operator_base(repo: Path, env: K8sEnv | None = None) -> Path:
    """The cached OCI layout (tag `base`) of Debian + Python + the operator's dependencies;
    built on first use (about 3 minutes: the mirror and PyPI are reached here only)."""
    env = env or K8sEnv.from_environ()
    layout = env.cache_dir / "images" / f"operator-base-{_base_key(repo)}"
    if (layout / "index.json").is_file():
        return layout
    start = time.monotonic()
    work = layout.with_name(layout.name + ".tmp")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    say(f"building the operator image's base (Debian {_SUITE} + Python deps) into {layout}...")
    base_tar = work / "debian.tar"
    _run("mmdebstrap", "--variant=minbase", f"--include={','.join(_DEBIAN_PACKAGES)}",
         _SUITE, str(base_tar))  # fmt: skip
    wheels = work / "wheels"
    _run(sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels), *_requirements(repo))
    oci, bundle = work / "oci", work / "bundle"
    _run("umoci", "init", "--layout", str(oci))
    _run("umoci", "new", "--image", f"{oci}:base")
    _run("umoci", "unpack", "--image", f"{oci}:base", str(bundle))
    rootfs = bundle / "rootfs"
    _run("tar", "-xf", str(base_tar), "-C", str(rootfs), "--numeric-owner")
    shutil.copytree(wheels, rootfs / "tmp" / "wheels")
    requirements = " ".join(f"'{r}'" for r in _requirements(repo))
    _in_root(
        rootfs,
        f"python3 -m venv {_VENV}; {_VENV}/bin/pip install -q --no-index --no-cache-dir "
        f"--disable-pip-version-check --find-links /tmp/wheels {requirements}; "
        "rm -rf /tmp/wheels",
    )
    _add_user(rootfs)
    _run("umoci", "repack", "--image", f"{oci}:base", str(bundle))
    shutil.rmtree(bundle)
    shutil.rmtree(layout, ignore_errors=True)
    oci.rename(layout)
    shutil.rmtree(work)
    say(f"operator image base ready in {elapsed(start)}")
    return layout


def _sources_key(repo: Path, base: Path) -> str:
    digest = hashlib.sha256(base.name.encode())
    for name in _SOURCES:
        path = repo / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if "__pycache__" in file.parts:
                continue
            digest.update(str(file.relative_to(repo)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:12]


def build_operator_image(cfg: RealNodeConfig, repo: Path, base: Path) -> str:
    """This checkout installed on `base`, checked and imported; return the image's name.

    The packed image is cached (`<cache>/images/operator-<hash of the sources>`, only the
    newest kept), so a session whose operator sources did not change only imports it.
    """
    start = time.monotonic()
    cached = base.parent / f"operator-{_sources_key(repo, base)}"
    if not (cached / "index.json").is_file():
        _pack_operator(cfg, repo, base, cached)
    tar = cfg.images_dir / "operator.tar"
    tar.parent.mkdir(parents=True, exist_ok=True)
    _run("tar", "-C", str(cached), "-cf", str(tar), ".")
    import_image(cfg, tar, OPERATOR_IMAGE)
    say(f"{OPERATOR_IMAGE} ready in {elapsed(start)} ({cached.name})")
    return OPERATOR_IMAGE


def _pack_operator(cfg: RealNodeConfig, repo: Path, base: Path, target: Path) -> None:
    oci = cfg.images_dir / "operator.oci"
    bundle = cfg.images_dir / "operator.bundle"
    shutil.rmtree(oci, ignore_errors=True)
    shutil.copytree(base, oci)
    _run("umoci", "unpack", "--image", f"{oci}:base", str(bundle))
    rootfs = bundle / "rootfs"
    src = rootfs / "src"
    for name in _SOURCES:
        source = repo / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, src / name)
    no_torch = (
        "import importlib.util as u, kvflow.operator.main; assert u.find_spec('torch') is None"
    )
    _in_root(
        rootfs,
        f"cd /src; {_VENV}/bin/pip install -q --no-deps --no-index --no-build-isolation "
        f"--no-cache-dir --disable-pip-version-check .; cd /; rm -rf /src; "
        f'{_VENV}/bin/kvflow operator --help >/dev/null; {_VENV}/bin/python -c "{no_torch}"',
    )
    _run("umoci", "repack", "--image", f"{oci}:local", str(bundle))
    shutil.rmtree(bundle)
    _run(
        "umoci", "config", "--image", f"{oci}:local",
        "--config.entrypoint", "kvflow", "--config.entrypoint", "operator",
        "--config.user", f"{_USER[1]}:{_USER[1]}",
        "--config.env", f"PATH={_PATH}",
        "--config.env", "PYTHONUNBUFFERED=1", "--config.env", "PYTHONDONTWRITEBYTECODE=1",
    )  # fmt: skip
    # Only the tag `local` stays: the import names images by their tags.
    _run("umoci", "rm", "--image", f"{oci}:base")
    _run("umoci", "gc", "--layout", str(oci))
    for old in base.parent.glob("operator-*"):
        if old != base and not old.name.startswith("operator-base-"):
            shutil.rmtree(old, ignore_errors=True)
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.move(str(oci), staging)
    staging.rename(target)
