"""A build step's root as an overlay over an unpacked image, and its changes as one layer.

`umoci unpack` and `umoci repack` each walk and hash every file of the root: for the CPU
runtime image (several GB of torch and its libraries) a step that installs a few hundred
kB of kvflow spent minutes in them. Here the image below the step is unpacked once and
kept (`oci.Store.rootfs`); the step writes into an overlayfs upper directory over it, and
that directory alone becomes the layer: overlayfs whiteouts (character devices 0/0) become
OCI `.wh.<name>` entries and opaque directories a `.wh..wh..opq` entry, as the OCI image
spec's layer format asks. `apply_layer` is the inverse: an OCI layer tar (gzip or zstd)
applied onto a directory, whiteouts included, which is how `oci.Store.rootfs` unpacks an
image (umoci 0.4.7 reads gzip layers only).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["OverlayRoot", "apply_layer", "layer_tar"]

_OPAQUE = "trusted.overlay.opaque"
_WHITEOUT = ".wh."
_OPAQUE_ENTRY = ".wh..wh..opq"


class OverlayRoot:
    """An overlayfs root at `work/merged`: writes go to an upper directory over `lowers`
    (top first). `seal()` turns the current upper into a lower and starts a new one, so
    each step's upper holds only that step's changes."""

    def __init__(self, lowers: list[Path], work: Path) -> None:
        self.lowers = list(lowers)
        self.work = work
        self.merged = work / "merged"
        self.upper = self._fresh_upper()
        self._mounted = False

    def _fresh_upper(self) -> Path:
        upper = self.work / f"upper{len(self.lowers)}"
        upper.mkdir(parents=True)
        return upper

    def mount(self) -> None:
        scratch = self.work / f"scratch{len(self.lowers)}"
        scratch.mkdir(parents=True, exist_ok=True)
        self.merged.mkdir(parents=True, exist_ok=True)
        options = (
            f"lowerdir={':'.join(map(str, self.lowers))},upperdir={self.upper},"
            f"workdir={scratch},redirect_dir=off,index=off,metacopy=off"
        )
        _run("mount", "-t", "overlay", "overlay", "-o", options, str(self.merged))
        self._mounted = True

    def unmount(self) -> None:
        if self._mounted:
            _run("umount", str(self.merged))
            self._mounted = False

    def seal(self) -> Path:
        """Unmount, return the finished upper directory, and mount again over it."""
        self.unmount()
        done = self.upper
        self.lowers.insert(0, done)
        self.upper = self._fresh_upper()
        self.mount()
        return done

    @contextlib.contextmanager
    def mounted(self) -> Iterator[OverlayRoot]:
        self.mount()
        try:
            yield self
        finally:
            self.unmount()


def layer_tar(upper: Path, out: Path) -> None:
    """The changes in overlayfs `upper` as an uncompressed OCI layer tar at `out`."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for current, folders, names in os.walk(upper):
            here = Path(current)
            relative = here.relative_to(upper)
            if relative != Path("."):
                tar.add(here, str(relative), recursive=False, filter=_plain)
            if _is_opaque(here) and relative != Path("."):
                tar.addfile(_marker(relative / _OPAQUE_ENTRY))
            # Symbolic links to folders are listed among the folders and not entered.
            for name in [*names, *(f for f in folders if (here / f).is_symlink())]:
                path = here / name
                info = path.lstat()
                if stat.S_ISCHR(info.st_mode) and info.st_rdev == 0:
                    tar.addfile(_marker(relative / f"{_WHITEOUT}{name}"))
                else:
                    tar.add(path, str(relative / name), recursive=False, filter=_plain)


_DECOMPRESS = {
    "application/vnd.oci.image.layer.v1.tar+gzip": ("pigz", "-dc"),
    "application/vnd.oci.image.layer.v1.tar+zstd": ("zstd", "-dcq"),
    "application/vnd.oci.image.layer.v1.tar": ("cat",),
}


def apply_layer(blob: Path, media_type: str, target: Path) -> None:
    """Apply the OCI layer `blob` onto `target`: `.wh.<name>` deletes what a lower layer
    left at `<name>`, `.wh..wh..opq` empties its folder of lower layers' entries."""
    if media_type not in _DECOMPRESS:
        raise ValueError(f"layer media type {media_type} is not supported")
    ours: set[str] = set()  # entries this layer wrote: an opaque marker keeps them
    with subprocess.Popen([*_DECOMPRESS[media_type], str(blob)], stdout=subprocess.PIPE) as unzip:
        assert unzip.stdout is not None
        with tarfile.open(fileobj=unzip.stdout, mode="r|") as tar:
            for member in tar:
                name = os.path.normpath(member.name).lstrip("/")
                folder, base = os.path.split(name)
                if base == _OPAQUE_ENTRY:
                    _empty_lower(target / folder, folder, ours)
                elif base.startswith(_WHITEOUT):
                    _remove(target / folder / base.removeprefix(_WHITEOUT))
                else:
                    existing = target / name
                    if existing.is_symlink() or (existing.exists() and not existing.is_dir()):
                        existing.unlink()
                    elif existing.is_dir() and not member.isdir():
                        shutil.rmtree(existing)
                    tar.extract(member, target, numeric_owner=True, filter="fully_trusted")
                    ours.add(name)
    if unzip.returncode != 0:
        raise RuntimeError(f"{_DECOMPRESS[media_type][0]} failed on {blob}")


def _empty_lower(folder: Path, relative: str, ours: set[str]) -> None:
    if not folder.is_dir():
        return
    for child in folder.iterdir():
        if os.path.join(relative, child.name) not in ours:
            _remove(child)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _is_opaque(folder: Path) -> bool:
    try:
        return os.getxattr(folder, _OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _marker(name: Path) -> tarfile.TarInfo:
    info = tarfile.TarInfo(str(name))
    info.mode = 0o644
    return info


def _plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Numeric owners only: the names would be looked up on this host, not the image."""
    info.uname = info.gname = ""
    return info


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} ... failed: {done.stderr.strip()[-2000:]}")
