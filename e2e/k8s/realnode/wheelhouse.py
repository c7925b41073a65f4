"""Wheels of the distributions installed in this virtual environment, so an image build
installs exactly the versions the tests run with, offline, without downloading torch and
its CUDA libraries again (several GB from PyPI on a fresh machine).

Each wheel is repacked from the installed files its RECORD lists (bytecode left out,
stored uncompressed: a wheel is unpacked once, by pip, on the same disk). Files installed
outside site-packages become the wheel's `.data/scripts` or `.data/data`; console scripts
are left to pip, which writes them again from `entry_points.txt`. Editable installs
(kvflow itself) are not repacked: the image installs kvflow from its sources.
"""

from __future__ import annotations

import configparser
import importlib.metadata as metadata
import re
import sysconfig
import zipfile
from pathlib import Path

__all__ = ["repack_installed"]

_DROPPED = {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _tag(dist: metadata.Distribution) -> str:
    tags = [
        line.split(":", 1)[1].strip()
        for line in (dist.read_text("WHEEL") or "").splitlines()
        if line.startswith("Tag:")
    ]
    if not tags:
        return "py3-none-any"
    pythons, abis, platforms = zip(*(t.split("-") for t in tags), strict=True)
    return "-".join(".".join(dict.fromkeys(part)) for part in (pythons, abis, platforms))


def _scripts(dist: metadata.Distribution) -> set[str]:
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(dist.read_text("entry_points.txt") or "")
    return {
        name
        for section in ("console_scripts", "gui_scripts")
        if parser.has_section(section)
        for name in parser.options(section)
    }


def _editable(dist: metadata.Distribution) -> bool:
    text = dist.read_text("direct_url.json") or ""
    return '"editable": true' in text or any("__editable__" in str(f) for f in dist.files or ())


def _repack(dist: metadata.Distribution, target: Path) -> None:
    site = Path(str(dist.locate_file("")))
    name, version = dist.metadata["Name"], dist.version
    data = f"{_canonical(name)}-{version}.data"
    scripts, records = _scripts(dist), []
    staging = target.with_suffix(".tmp")
    with zipfile.ZipFile(staging, "w", zipfile.ZIP_STORED) as wheel:
        for file in dist.files or ():
            parts = file.parts
            if "__pycache__" in parts or (
                parts[0].endswith(".dist-info") and file.name in _DROPPED
            ):
                continue
            source = (site / file).resolve()
            if parts[0] == "..":
                prefix = site.parents[2]  # <venv>/lib/pythonX.Y/site-packages
                relative = source.relative_to(prefix)
                if relative.parts[0] == "bin":
                    if relative.name in scripts:
                        continue
                    arcname = f"{data}/scripts/{relative.name}"
                else:
                    arcname = f"{data}/data/{relative}"
            else:
                arcname = str(file)
            if source.is_file():
                wheel.write(source, arcname)
                records.append(f"{arcname},,")
        info = f"{_canonical(name)}-{version}.dist-info"
        records.append(f"{info}/RECORD,,")
        wheel.writestr(f"{info}/RECORD", "\n".join(records) + "\n")
    staging.rename(target)


def repack_installed(
    names: set[str], into: Path, no_deps: set[str] = frozenset(), site_packages: Path | None = None
) -> list[Path]:
    """Wheels (cached in `into`, one per name and version) of the installed distributions
    `names` and everything they require (extras and markers evaluated for this machine),
    and of `no_deps` alone."""
    into.mkdir(parents=True, exist_ok=True)
    site = site_packages or Path(sysconfig.get_paths()["purelib"])
    installed = {
        _canonical(d.metadata["Name"]): d for d in metadata.distributions(path=[str(site)])
    }
    wanted = _closure(names, installed) | _closure(no_deps, installed, follow=False)
    wheels = []
    for key in sorted(wanted):
        dist = installed[key]
        if _editable(dist):
            continue
        target = into / f"{key}-{dist.version}-{_tag(dist)}.whl"
        if not target.is_file():
            _repack(dist, target)
        wheels.append(target)
    return wheels


def _closure(
    names: set[str], installed: dict[str, metadata.Distribution], follow: bool = True
) -> set[str]:
    from packaging.requirements import Requirement

    todo = [(_canonical(Requirement(n).name), set(Requirement(n).extras)) for n in names]
    seen: dict[str, set[str]] = {}
    while todo:
        key, extras = todo.pop()
        if key not in installed:
            raise LookupError(f"{key} is not installed here (make setup installs it)")
        if key in seen and extras <= seen[key]:
            continue
        seen[key] = seen.get(key, set()) | extras
        for text in installed[key].requires if follow and installed[key].requires else ():
            req = Requirement(text)
            env_extras = seen[key] or {""}
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in env_extras):
                continue
            todo.append((_canonical(req.name), set(req.extras)))
    return set(seen)
