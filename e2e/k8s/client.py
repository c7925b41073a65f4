"""`Kube`: a handle on a running cluster, driving kubectl and helm as subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .bins import Binaries

__all__ = ["CommandError", "Kube"]

T = TypeVar("T")


class CommandError(subprocess.CalledProcessError):
    """A kubectl or helm call failed; unlike its base class, str() shows stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


@dataclass(frozen=True)
class Kube:
    """A cluster reachable through `kubeconfig`, with the binaries that talk to it.

    `env` is `os.environ` plus `KUBECONFIG`, helm's config/cache/data dirs under the
    cluster's state dir, and the kubectl and helm directories first on `PATH`, so
    subprocesses a test starts (an operator, `make`, a script) reach this cluster.
    """

    kubeconfig: Path
    binaries: Binaries
    env: dict[str, str]

    @classmethod
    def connect(cls, kubeconfig: Path, binaries: Binaries, helm_dir: Path) -> Kube:
        env = dict(os.environ)
        tool_dirs = dict.fromkeys(str(binaries[n].parent) for n in ("kubectl", "helm"))
        env.update(
            KUBECONFIG=str(kubeconfig),
            PATH=os.pathsep.join([*tool_dirs, env.get("PATH", "")]),
            HELM_CACHE_HOME=str(helm_dir / "cache"),
            HELM_CONFIG_HOME=str(helm_dir / "config"),
            HELM_DATA_HOME=str(helm_dir / "data"),
        )
        return cls(kubeconfig=kubeconfig, binaries=binaries, env=env)

    def bin(self, name: str) -> Path:
        """Path of a resolved binary (`kubectl`, `helm`, `kube-apiserver`, ...)."""
        return self.binaries[name]

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster (text mode, output captured)."""
        return self._run("kubectl", args, input, check, timeout)

    def helm(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """Run helm against this cluster (text mode, output captured)."""
        return self._run("helm", args, input, check, timeout)

    def get_json(self, *args: str) -> Any:
        """`kubectl get <args> -o json`, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(self, manifest: str | Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> str:
        """`kubectl apply -f -` of YAML text, one object, or a list of objects."""
        if not isinstance(manifest, str):
            items = [manifest] if isinstance(manifest, Mapping) else list(manifest)
            manifest = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        return self.kubectl("apply", "-f", "-", input=manifest).stdout

    def wait_for(
        self,
        predicate: Callable[[], T],
        timeout: float = 60.0,
        interval: float = 0.5,
        what: str | None = None,
    ) -> T:
        """Call `predicate` until it returns something truthy, and return that.

        An exception from `predicate` counts as "not yet" (the object may not exist
        yet); on timeout, `TimeoutError` names `what` and chains the last exception.
        """
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while True:
            try:
                result = predicate()
                if result:
                    return result
                last_error = None
            except Exception as err:
                last_error = err
            if time.monotonic() >= deadline:
                label = what or getattr(predicate, "__name__", "condition")
                raise TimeoutError(
                    f"timed out after {timeout:g}s waiting for {label}"
                ) from last_error
            time.sleep(interval)

    def _run(
        self, tool: str, args: Sequence[str], input: str | None, check: bool, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(self.binaries[tool]), *args]
        done = subprocess.run(
            argv, input=input, capture_output=True, text=True, env=self.env, timeout=timeout
        )
        if check and done.returncode != 0:
            raise CommandError(done.returncode, argv, done.stdout, done.stderr)
        return done
