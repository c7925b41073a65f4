"""Maps the repository's top-level folders onto the ``kvflow.*`` import packages.

The layout is fixed by the product's design (``runtime/``, ``kernels/``, ``operator/`` at
the top), while imports are ``kvflow.runtime`` and friends; setuptools' ``package_dir``
does the mapping, and this file lists every sub-package so wheels and editable installs
both see new modules without edits here.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {
    "kvflow": "kvflow",
    "kvflow.runtime": "runtime",
    "kvflow.kernels": "kernels",
    "kvflow.operator": "operator",
}


def _packages() -> list[str]:
    found = []
    for package, folder in ROOTS.items():
        for init in sorted(Path(folder).rglob("__init__.py")):
            rel = init.parent.relative_to(folder).parts
            found.append(".".join((package, *rel)))
    return found


setup(
    packages=_packages(),
    package_dir=ROOTS,
    include_package_data=True,
    package_data={"kvflow.runtime": ["configs/*.json"], "kvflow.kernels.cpu": ["*.c", "*.h"]},
)
