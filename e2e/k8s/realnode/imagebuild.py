"""kvflow's images built from their Dockerfiles without a registry or a container daemon.

The Dockerfiles start `FROM` images on Docker Hub or NVIDIA's registry, unreachable here.
This build runs each Dockerfile's own steps (`dockerfile.parse_dockerfile`) on a Debian
bookworm root instead, so the Dockerfile stays the one description of the image:

- `FROM python:3.11-slim` / `debian:bookworm-slim`: `mmdebstrap` makes a minimal bookworm
  root with Python (for `python:*`), `passwd`, and the packages the stage's `apt-get
  install` lines name (those lines' `apt-get` parts are satisfied by the root; the rest of
  each `RUN` runs). Any other base (the CUDA one) cannot be had here: `Unbuildable`.
- `RUN` runs in that root (a chroot in a private mount namespace), with the stage's args
  and env, its `--mount=type=bind` sources and, for pip, `PIP_NO_INDEX` and
  `PIP_FIND_LINKS` pointing at wheels repacked from this virtual environment
  (`wheelhouse`): pip resolves the Dockerfile's requirements offline, to the versions the
  tests run with. `COPY` (from the build context, `.dockerignore` applied, or `--from` a
  stage), `ENV`, `WORKDIR`, `USER` and the metadata instructions do what Docker does.
- Every `RUN` and `COPY` is a layer, tagged in one OCI layout under
  `<cache>/images/store` by a hash of everything it depends on: a step whose inputs did
  not change is reused, as Docker's cache would. Steps run on an overlayfs over the last
  reused image, kept unpacked between builds, and each step's upper directory is its
  layer (`overlay`, stored zstd-compressed): re-running the last step of a multi-GB
  image reads none of it. `import_built()` streams the result into the node's
  containerd under the chart's image name.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..env import K8sEnv
from ..log import elapsed, say
from .config import RealNodeConfig
from .dockerfile import Stage, Step, exec_form, expand, parse_dockerfile
from .images import import_image
from .oci import Store
from .overlay import OverlayRoot, layer_tar
from .wheelhouse import repack_installed

__all__ = ["BuiltImage", "ImageRecipe", "Unbuildable", "build_image", "import_built"]

_SUITE = "bookworm"
_DEBIAN_PYTHON = "3.11"
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_WHEELS = "/run/kvflow-wheels"  # where a RUN sees the wheelhouse
_BUILDER = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:8]


class Unbuildable(RuntimeError):
    """The Dockerfile asks for something this registry-free build cannot provide."""


@dataclass(frozen=True)
class ImageRecipe:
    """An image to build: `reference` (`repo:tag`, as the node's containerd will name it)
    from `dockerfile` with `build_args`, the repository as its build context."""

    name: str
    dockerfile: Path
    reference: str
    build_args: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BuiltImage:
    """A built image: its tag in `store`, its compressed size, and the seconds it took."""

    recipe: ImageRecipe
    store: Path
    tag: str
    compressed_bytes: int
    seconds: float


# --- the stand-in base: Debian bookworm with the stage's packages ---------------------


def _split_run(text: str) -> tuple[list[str], str]:
    """A RUN's `apt-get install` packages, and its command less the apt-get parts."""
    packages: list[str] = []
    kept = []
    for part in text.split("&&"):
        words = shlex.split(part)
        if words[:2] == ["apt-get", "install"]:
            packages += [w for w in words[2:] if not w.startswith("-")]
        elif words[:2] != ["apt-get", "update"] and words != ["rm", "-rf", "/var/lib/apt/lists/*"]:
            kept.append(part.strip())
    return packages, " && ".join(kept)


def _base_packages(stage: Stage) -> tuple[tuple[str, ...], dict[str, str]]:
    """Debian packages standing in for the stage's `FROM` image, and that image's env."""
    image = expand(stage.image, stage.args)
    packages = {"passwd"}
    env = {"PATH": _PATH}
    if image.startswith("python:"):
        version = image.split(":", 1)[1].split("-")[0]
        if version != _DEBIAN_PYTHON:
            raise Unbuildable(f"{image}: Debian {_SUITE} has Python {_DEBIAN_PYTHON} only")
        packages |= {"python3", "python3-venv", "python-is-python3", "ca-certificates"}
        env["LANG"] = "C.UTF-8"
    elif not image.startswith(f"debian:{_SUITE}"):
        raise Unbuildable(
            f"FROM {image}: only python:{_DEBIAN_PYTHON}-slim and debian:{_SUITE} have a "
            "stand-in here (other bases live in registries this machine cannot reach)"
        )
    for step in stage.steps:
        if step.keyword == "RUN":
            packages |= set(_split_run(step.text)[0])
    return tuple(sorted(packages)), env


def _ensure_base(store: Store, packages: tuple[str, ...]) -> str:
    tag = "base." + _digest(_SUITE, *packages)
    if store.has(tag):
        return tag
    start = time.monotonic()
    say(f"building a Debian {_SUITE} root with {', '.join(packages)}...")
    with tempfile.TemporaryDirectory(dir=store.path.parent) as work:
        tar = Path(work) / "debian.tar"
        _run("mmdebstrap", "--variant=minbase", f"--include={','.join(packages)}",
             _SUITE, str(tar))  # fmt: skip
        with store.bundle(None, Path(work) / "bundle") as rootfs:
            _run("tar", "-xf", str(tar), "-C", str(rootfs), "--numeric-owner")
            store.commit(rootfs.parent, tag)
    say(f"Debian root {tag} ready in {elapsed(start)}")
    return tag


# --- running the steps ---------------------------------------------------------------


@dataclass
class _State:
    """What a stage's steps see: its args, env, working directory and user."""

    args: dict[str, str]
    env: dict[str, str]
    workdir: str = "/"
    user: str | None = None
    config: list[str] = field(default_factory=list)

    def values(self) -> dict[str, str]:
        return {**self.args, **self.env}


class _Build:
    def __init__(self, recipe: ImageRecipe, repo: Path, store: Store, env: K8sEnv) -> None:
        self.recipe, self.repo, self.store, self.env = recipe, repo, store, env
        self.stages = parse_dockerfile(recipe.dockerfile, recipe.build_args)
        ignore = recipe.dockerfile.with_name(recipe.dockerfile.name + ".dockerignore")
        self.ignore = [
            line.strip()
            for line in (ignore.read_text().splitlines() if ignore.is_file() else [])
            if line.strip() and not line.startswith("#")
        ]
        self.keys: dict[int, str] = {}
        self.replayed: dict[int, list[tuple[Step, _State, str]]] = {}
        self.wheels: Path | None = None

    # context and keys

    def _ignored(self, relative: Path) -> bool:
        for pattern in self.ignore:
            bare = pattern.removeprefix("**/")
            for depth in range(1, len(relative.parts) + 1):
                prefix = Path(*relative.parts[:depth])
                if prefix.match(pattern) or (pattern != bare and prefix.name == bare):
                    return True
                if pattern != bare and Path(prefix.name).match(bare):
                    return True
        return False

    def _context_files(self, source: str) -> list[Path]:
        """The files of `source` that `.dockerignore` keeps, sorted. An ignored folder is
        not entered (the repository's `.venv` alone holds tens of thousands of files)."""
        root = (self.repo / source).resolve()
        if root.is_file():
            return [] if self._ignored(root.relative_to(self.repo)) else [root]
        files: list[Path] = []
        for current, folders, names in os.walk(root):
            here = Path(current)
            folders[:] = [
                f for f in folders if not self._ignored((here / f).relative_to(self.repo))
            ]
            files += [
                here / name
                for name in names
                if (here / name).is_file()
                and not self._ignored((here / name).relative_to(self.repo))
            ]
        return sorted(files)

    def _context_digest(self, sources: list[str]) -> str:
        digest = hashlib.sha256()
        for source in sources:
            for file in self._context_files(source):
                digest.update(str(file.relative_to(self.repo)).encode() + b"\0")
                digest.update(file.read_bytes())
        return digest.hexdigest()

    def _stage_index(self, name: str) -> int:
        for index, stage in enumerate(self.stages):
            if stage.name == name or str(index) == name:
                return index
        raise ValueError(f"COPY --from={name}: no such stage")

    def _step_key(self, previous: str, step: Step, state: _State) -> str:
        extra = ""
        if step.keyword == "COPY" and step.copy_from is not None:
            extra = self.stage_key(self._stage_index(step.copy_from))
        elif step.keyword == "COPY":
            extra = self._context_digest(exec_form(expand(step.text, state.values()))[:-1])
        elif step.mounts:
            extra = self._context_digest([m.source for m in step.mounts])
        if step.keyword == "RUN" and "pip" in step.text:
            extra += self._wheel_names()
        env = json.dumps([state.values(), state.workdir, state.user], sort_keys=True)
        return _digest(previous, step.keyword, step.text, env, extra)

    def _replay(self, index: int) -> list[tuple[Step, _State, str]]:
        """Each step of stage `index` with the state it runs in and its key; computed once
        per build (the working tree may change while the build runs)."""
        if index not in self.replayed:
            self.replayed[index] = list(self._compute_replay(index))
        return self.replayed[index]

    def _compute_replay(self, index: int) -> Iterator[tuple[Step, _State, str]]:
        stage = self.stages[index]
        packages, base_env = _base_packages(stage)
        state = _State(args=dict(stage.args), env=dict(base_env))
        key = _digest(_BUILDER, "base", *packages)
        for step in stage.steps:
            values = state.values()
            if step.keyword == "ENV":
                words = shlex.split(step.text)
                pairs = (
                    dict(w.split("=", 1) for w in words)
                    if "=" in words[0]
                    else {words[0]: " ".join(words[1:])}
                )
                state.env.update({k: expand(v, values) for k, v in pairs.items()})
            elif step.keyword == "WORKDIR":
                state.workdir = str(Path(state.workdir, expand(step.text, values)))
            elif step.keyword == "USER":
                state.user = expand(step.text, values)
            elif step.keyword in ("RUN", "COPY"):
                key = self._step_key(key, step, state)
            yield step, copy.deepcopy(state), key

    def stage_key(self, index: int) -> str:
        if index not in self.keys:
            keys = [key for _, _, key in self._replay(index)]
            self.keys[index] = keys[-1] if keys else _digest(_BUILDER, str(index))
        return self.keys[index]

    # wheels

    def _pip_requirements(self) -> tuple[set[str], set[str]]:
        """What the Dockerfile's `pip install` commands name: with their dependencies, and
        `--no-deps` ones alone. `.` or a path is this project (its build requirements,
        dependencies and the named extras)."""
        import tomllib

        project = tomllib.loads((self.repo / "pyproject.toml").read_text())
        follow: set[str] = set(project["build-system"]["requires"])
        alone: set[str] = set()
        for stage in self.stages:
            for step in stage.steps:
                if step.keyword != "RUN":
                    continue
                for part in step.text.split("&&"):
                    words = shlex.split(expand(part, stage.args))
                    if len(words) < 2 or not words[0].endswith("pip") or words[1] != "install":
                        continue
                    named, skip = [], False
                    for word in words[2:]:
                        if skip:
                            skip = False
                        elif word in ("--index-url", "-i", "--extra-index-url"):
                            skip = True
                        elif not word.startswith("-"):
                            named.append(word)
                    into = alone if "--no-deps" in words else follow
                    for name in named:
                        if name.startswith((".", "/")):
                            extras = name.partition("[")[2].rstrip("]")
                            into.update(project["project"]["dependencies"])
                            for extra in filter(None, extras.split(",")):
                                into.update(project["project"]["optional-dependencies"][extra])
                        else:
                            into.add(name)
        return follow, alone

    def _wheel_names(self) -> str:
        if self.wheels is None:
            follow, alone = self._pip_requirements()
            cache = self.env.cache_dir / "wheels"
            wheels = repack_installed(follow, cache, alone)
            self.wheels = Path(tempfile.mkdtemp(prefix="wheels-", dir=self.store.path.parent))
            for wheel in wheels:
                (self.wheels / wheel.name).hardlink_to(wheel)
        return ",".join(sorted(p.name for p in self.wheels.iterdir()))

    # building

    def build_stage(self, index: int) -> tuple[str, _State]:
        """Stage `index` built (or found) in the store; its last tag and final state."""
        stage = self.stages[index]
        replayed = list(self._replay(index))
        packages, _ = _base_packages(stage)
        tags = [f"{self.recipe.name}.{index}.{key[:16]}" for _, _, key in replayed]
        layered = [i for i, (step, _, _) in enumerate(replayed) if step.keyword in ("RUN", "COPY")]
        done = next((i for i in reversed(layered) if self.store.has(tags[i])), None)
        state = replayed[-1][1] if replayed else _State(args={}, env={})
        todo = [i for i in layered if done is None or i > done]
        if not todo:
            return (tags[done] if done is not None else _ensure_base(self.store, packages)), state
        start_tag = tags[done] if done is not None else _ensure_base(self.store, packages)
        below = self.store.rootfs(start_tag)
        with tempfile.TemporaryDirectory(dir=self.store.path.parent) as work:
            root = OverlayRoot([below], Path(work) / "overlay")
            previous = start_tag
            with root.mounted():
                for i in todo:
                    step, step_state, _ = replayed[i]
                    started = time.monotonic()
                    self._execute(step, step_state, root.merged, Path(work))
                    layer_tar(root.seal(), Path(work) / "layer.tar")
                    self.store.add_layer(previous, tags[i], Path(work) / "layer.tar")
                    (Path(work) / "layer.tar").unlink()
                    previous = tags[i]
                    say(
                        f"{self.recipe.name}: {step.keyword} {step.text[:60]!r}: {elapsed(started)}"
                    )
        return tags[layered[-1]] if layered else start_tag, state

    def _execute(self, step: Step, state: _State, rootfs: Path, work: Path) -> None:
        values = state.values()
        (rootfs / state.workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
        if step.keyword == "COPY":
            words = exec_form(expand(step.text, values))
            sources, dest = words[:-1], words[-1]
            target = rootfs / Path(state.workdir, dest).relative_to("/")
            if step.copy_from is not None:
                tag, _ = self.build_stage(self._stage_index(step.copy_from))
                other = self.store.rootfs(tag)
                for source in sources:
                    _copy(other / source.lstrip("/"), target, dest, len(sources))
            else:
                for source in sources:
                    _copy(self._context_copy(source, work), target, dest, len(sources))
            return
        _, command = _split_run(step.text)
        if not command:
            return
        binds = [(self._context_copy(m.source, work), m.target, m.rw) for m in step.mounts]
        env = dict(values)
        if self.wheels is not None or "pip" in command:
            self._wheel_names()
            assert self.wheels is not None
            env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=_WHEELS)
            binds.append((self.wheels, _WHEELS, False))
        _in_root(rootfs, f"cd {shlex.quote(state.workdir)} && {command}", env, binds, state.user)

    def _context_copy(self, source: str, work: Path) -> Path:
        """`source` of the build context, `.dockerignore` applied, copied under `work`."""
        out = work / "context" / _digest(source, str(time.monotonic_ns()))[:8]
        root = (self.repo / source).resolve()
        for file in self._context_files(source):
            relative = file.relative_to(root) if root.is_dir() else Path(file.name)
            (out / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, out / relative)
        return out if root.is_dir() else out / root.name


def _copy(source: Path, target: Path, dest: str, count: int) -> None:
    """Docker's COPY: a directory's contents into `target`; a file into `target` when
    `dest` ends with `/` or several sources are copied, else as `target`."""
    if source.is_dir():
        shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
    elif dest.endswith("/") or count > 1:
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target / source.name)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def _in_root(
    rootfs: Path,
    command: str,
    env: Mapping[str, str],
    binds: list[tuple[Path, str, bool]],
    user: str | None,
) -> None:
    """Run `command` (sh) chrooted in `rootfs` with exactly `env`, `/dev`, `/proc` and the
    `binds` (host path, path inside, writable) mounted in a private mount namespace that
    ends with it. Mount points it had to create are removed afterwards."""
    created = []
    for host, inside, _ in binds:
        point = rootfs / inside.lstrip("/")
        if not point.exists():
            missing = [p for p in [point, *point.parents] if not p.exists()]
            point.parent.mkdir(parents=True, exist_ok=True)
            point.touch() if host.is_file() else point.mkdir()
            created += [p for p in missing if p not in created]
    mounts = ['mount --rbind /dev "$R/dev"', 'mount -t proc proc "$R/proc"']
    for host, inside, writable in binds:
        point = shlex.quote(str(rootfs / inside.lstrip("/")))
        mounts.append(f"mount --bind {shlex.quote(str(host))} {point}")
        if not writable:
            mounts.append(f"mount -o remount,bind,ro {point}")
    userspec = f"--userspec={user} " if user else ""
    argv = ["env", "-i", *(f"{k}={v}" for k, v in env.items()), "/bin/sh", "-ec", command]
    script = f'set -e; R="$1"; {"; ".join(mounts)}; exec chroot {userspec}"$R" ' + shlex.join(argv)
    try:
        _run("unshare", "--mount", "--fork", "sh", "-c", script, "sh", str(rootfs))
    finally:
        for point in sorted(created, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                point.rmdir() if point.is_dir() else point.unlink()


def build_image(recipe: ImageRecipe, repo: Path, env: K8sEnv | None = None) -> BuiltImage:
    """Build `recipe` (each step cached, see the module docstring) and return it."""
    env = env or K8sEnv.from_environ()
    start = time.monotonic()
    store = Store(env.cache_dir / "images" / "store")
    with store.locked():
        build = _Build(recipe, repo, store, env)
        try:
            last = len(build.stages) - 1
            tag, _ = build.build_stage(last)
            final = f"{recipe.name}.final.{_digest(tag, json.dumps(_config(build, last)))[:16]}"
            if not store.has(final):
                store.configure(tag, final, _config(build, last))
            store.prune(f"{recipe.name}.", keep=_kept_tags(build, final))
        finally:
            if build.wheels is not None:
                shutil.rmtree(build.wheels, ignore_errors=True)
        size = store.compressed_size(final)
    seconds = time.monotonic() - start
    say(f"{recipe.reference}: built in {elapsed(start)} ({size / 2**20:.0f} MiB compressed)")
    return BuiltImage(recipe, store.path, final, size, seconds)


def _kept_tags(build: _Build, final: str) -> set[str]:
    keep = {final}
    for index in range(len(build.stages)):
        for _, _, key in build._replay(index):
            keep.add(f"{build.recipe.name}.{index}.{key[:16]}")
    return keep


def _config(build: _Build, index: int) -> list[str]:
    """`umoci config` flags for the last stage's metadata, env, user and workdir."""
    state = _State(args={}, env={})
    flags: list[str] = []
    for step, state, _ in build._replay(index):
        values = state.values()
        if step.keyword == "LABEL":
            flags += [f for w in shlex.split(step.text) for f in ("--config.label", w)]
        elif step.keyword == "EXPOSE":
            for port in expand(step.text, values).split():
                flags += ["--config.exposedports", port if "/" in port else f"{port}/tcp"]
        elif step.keyword == "ENTRYPOINT":
            flags += [f for w in exec_form(step.text) for f in ("--config.entrypoint", w)]
        elif step.keyword == "CMD":
            flags += [f for w in exec_form(step.text) for f in ("--config.cmd", w)]
    flags += [f for k, v in sorted(state.env.items()) for f in ("--config.env", f"{k}={v}")]
    flags += ["--config.workingdir", state.workdir]
    if state.user:
        flags += ["--config.user", state.user]
    return flags


def import_built(cfg: RealNodeConfig, image: BuiltImage) -> str:
    """Import `image` into the node's containerd as its recipe's reference; return that."""
    _, tag = image.recipe.reference.rsplit(":", 1)
    store = Store(image.store)
    import_image(cfg, lambda out: store.export(image.tag, tag, out), image.recipe.reference)
    return image.recipe.reference


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip()[-4000:]
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({done.returncode}):\n{tail}")
    return done.stdout
