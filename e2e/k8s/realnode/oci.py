"""One OCI image layout (umoci) holding every layer the image build made, by tag.

A tag names an image: a base root or a base plus the layers of some steps. `bundle()`
unpacks one to change it, `commit()` packs the changes as one more layer (and refreshes
the bundle, so the next commit holds only what changed after it); `rootfs()` keeps an
image unpacked between builds (the lower directory of `overlay.OverlayRoot`) and
`add_layer()` appends a layer made elsewhere; `export()` writes one image as the OCI tar
`ctr images import` reads.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from .overlay import apply_layer

__all__ = ["Store"]

_REF = "org.opencontainers.image.ref.name"
_ZSTD_LAYER = "application/vnd.oci.image.layer.v1.tar+zstd"


class Store:
    """The layout at `path` (created on first use)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held while a build changes the layout (test sessions may build at once)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            if not (self.path / "index.json").is_file():
                shutil.rmtree(self.path, ignore_errors=True)
                _umoci("init", "--layout", str(self.path))
            yield

    def _index(self) -> dict:
        return json.loads((self.path / "index.json").read_text())

    def _manifest(self, tag: str) -> dict:
        for entry in self._index().get("manifests") or ():
            if entry.get("annotations", {}).get(_REF) == tag:
                return entry
        raise KeyError(tag)

    def has(self, tag: str) -> bool:
        try:
            self._manifest(tag)
        except (KeyError, FileNotFoundError):
            return False
        return True

    def _blob(self, digest: str) -> Path:
        algorithm, hexdigest = digest.split(":", 1)
        return self.path / "blobs" / algorithm / hexdigest

    @contextlib.contextmanager
    def bundle(self, tag: str | None, where: Path) -> Iterator[Path]:
        """Image `tag` (None: an empty one) unpacked at `where`; yields its rootfs."""
        shutil.rmtree(where, ignore_errors=True)
        scratch = None
        if tag is None:
            scratch = tag = f"scratch.{where.parent.name}"
            _umoci("new", "--image", f"{self.path}:{tag}")
        try:
            _umoci("unpack", "--image", f"{self.path}:{tag}", str(where))
            yield where / "rootfs"
        finally:
            shutil.rmtree(where, ignore_errors=True)
            if scratch is not None:
                _umoci("rm", "--image", f"{self.path}:{scratch}")

    def rootfs(self, tag: str) -> Path:
        """Image `tag` unpacked, kept under `rootfs/` beside the layout until `prune()`
        drops the tag: a build over an unchanged image unpacks nothing."""
        kept = self.path.parent / "rootfs" / tag
        if not kept.is_dir():
            staging = kept.with_name(kept.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            try:
                entry, _ = self._blobs(tag)
                manifest = json.loads(self._blob(entry["digest"]).read_text())
                for layer in manifest["layers"]:
                    apply_layer(self._blob(layer["digest"]), layer["mediaType"], staging)
                staging.rename(kept)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return kept

    def add_layer(self, tag: str, new_tag: str, layer: Path, comment: str = "") -> None:
        """Image `tag` plus the uncompressed layer tar `layer`, tagged `new_tag`. The layer
        is stored zstd-compressed (`tar+zstd`, which containerd and umoci unpack): on two
        cores containerd's unpack of the multi-GB runtime layer took about 40 s with gzip
        and takes a few with zstd."""
        entry, _ = self._blobs(tag)
        manifest = json.loads(self._blob(entry["digest"]).read_text())
        config = json.loads(self._blob(manifest["config"]["digest"]).read_text())
        diff_id = _sha256_file(layer)
        packed = layer.with_suffix(".tar.zst")
        _run("zstd", "-q", "-f", "-T0", "-3", str(layer), "-o", str(packed))
        descriptor = self._put_file(packed, _ZSTD_LAYER)
        config.setdefault("rootfs", {"type": "layers", "diff_ids": []})["diff_ids"].append(diff_id)
        config.setdefault("history", []).append({"created_by": comment or "kvflow image build"})
        manifest["config"] = self._put_bytes(
            json.dumps(config).encode(), manifest["config"]["mediaType"]
        )
        manifest["layers"] = [*manifest["layers"], descriptor]
        new_entry = self._put_bytes(json.dumps(manifest).encode(), entry["mediaType"])
        new_entry["annotations"] = {_REF: new_tag}
        index = self._index()
        index["manifests"] = [
            m for m in index.get("manifests") or () if m.get("annotations", {}).get(_REF) != new_tag
        ] + [new_entry]
        self._write_index(index)

    def _put_bytes(self, data: bytes, media_type: str) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blob = self._blob(digest)
        if not blob.exists():
            partial = blob.with_name(blob.name + ".partial")
            partial.write_bytes(data)
            partial.rename(blob)
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    def _put_file(self, path: Path, media_type: str) -> dict:
        digest = _sha256_file(path)
        size = path.stat().st_size
        blob = self._blob(digest)
        if blob.exists():
            path.unlink()
        else:
            path.rename(blob)
        return {"mediaType": media_type, "digest": digest, "size": size}

    def _write_index(self, index: dict) -> None:
        partial = self.path / "index.json.partial"
        partial.write_text(json.dumps(index))
        partial.rename(self.path / "index.json")

    def commit(self, bundle: Path, tag: str) -> None:
        """The bundle's changes as a new layer, tagged `tag`."""
        _umoci("repack", "--refresh-bundle", "--image", f"{self.path}:{tag}", str(bundle))

    def configure(self, tag: str, new_tag: str, flags: list[str]) -> None:
        _umoci("config", "--image", f"{self.path}:{tag}", "--tag", new_tag, *flags)

    def prune(self, prefix: str, keep: set[str]) -> None:
        """Drop the tags starting with `prefix` that are not in `keep`, then their blobs."""
        stale = [
            ref
            for entry in self._index().get("manifests") or ()
            if (ref := entry.get("annotations", {}).get(_REF, "")).startswith(prefix)
            and ref not in keep
        ]
        for ref in stale:
            _umoci("rm", "--image", f"{self.path}:{ref}")
            shutil.rmtree(self.path.parent / "rootfs" / ref, ignore_errors=True)
        if stale:
            self._collect_garbage()

    def _collect_garbage(self) -> None:
        """Delete the blobs no tag reaches (what `umoci gc` does, without the minute it
        spends re-reading every blob of a multi-GB layout). Only manifests and indexes are
        read; configs and layers are leaves."""
        reachable: set[str] = set()
        pending: list[dict] = list(self._index().get("manifests") or ())
        while pending:
            descriptor = pending.pop()
            digest = descriptor["digest"]
            if digest in reachable:
                continue
            reachable.add(digest)
            media_type = descriptor.get("mediaType", "")
            if media_type.endswith(("manifest.v1+json", "index.v1+json")):
                document = json.loads(self._blob(digest).read_text())
                pending += document.get("manifests") or ()
                pending += [document["config"]] if "config" in document else []
                pending += document.get("layers") or ()
        for algorithm in (self.path / "blobs").iterdir():
            for blob in algorithm.iterdir():
                if f"{algorithm.name}:{blob.name}" not in reachable:
                    blob.unlink()

    def _blobs(self, tag: str) -> tuple[dict, list[str]]:
        entry = self._manifest(tag)
        manifest = json.loads(self._blob(entry["digest"]).read_text())
        digests = [entry["digest"], manifest["config"]["digest"]]
        digests += [layer["digest"] for layer in manifest["layers"]]
        return entry, digests

    def compressed_size(self, tag: str) -> int:
        """Bytes of the image's manifest, config and (compressed) layers."""
        return sum(self._blob(d).stat().st_size for d in self._blobs(tag)[1])

    def export(self, tag: str, ref_name: str, out: Path | IO[bytes]) -> None:
        """Image `tag` alone as an OCI layout tar whose one image is named `ref_name`,
        written to the file `out` or streamed to the binary stream `out`."""
        entry, digests = self._blobs(tag)
        entry = {**entry, "annotations": {_REF: ref_name}}
        index = json.dumps({"schemaVersion": 2, "manifests": [entry]}).encode()
        target = {"name": out} if isinstance(out, Path) else {"fileobj": out}
        with tarfile.open(mode="w|", **target) as tar:  # type: ignore[call-overload]
            for name, data in (("oci-layout", (self.path / "oci-layout").read_bytes()),
                               ("index.json", index)):  # fmt: skip
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            for digest in digests:
                tar.add(self._blob(digest), f"blobs/{digest.replace(':', '/')}")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} ... failed: {done.stderr.strip()[-2000:]}")


def _umoci(*args: str) -> str:
    done = subprocess.run(["umoci", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"umoci {' '.join(args[:3])} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout
