"""The contract of a HiCache shared store (L3) as the operator deploys it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..spec import ModelDeployment, PodSettings

Manifest = dict[str, Any]


@dataclass(frozen=True)
class StoreClient:
    """How a store client (a tiered worker) reaches the store, wherever it runs.

    ``storage_path`` is its ``--hicache-storage-path``. ``files`` are config files it reads
    (name -> text): the operator puts them in the runtime ConfigMap, mounted at
    ``contract.RUNTIME_CONFIG_DIR``; ``kvflow up`` writes them to its state directory.
    ``file_env`` names the variables that point at them (variable -> file name).
    """

    storage_path: str
    files: Mapping[str, str] = field(default_factory=dict)
    file_env: Mapping[str, str] = field(default_factory=dict)

    def env(self, directory: str) -> dict[str, str]:
        """The variables, with ``files`` in ``directory``."""
        return {name: f"{directory}/{file}" for name, file in self.file_env.items()}


@dataclass(frozen=True)
class StoreProcess:
    """A process of the store on this machine (``kvflow up``): started before the workers,
    healthy once ``port`` accepts a connection, with the env of ``spec.<pods>``."""

    name: str
    argv: list[str]
    port: int
    pods: str  # a key of SharedStore.pod_settings()


@dataclass(frozen=True)
class LocalStore:
    """The store placed on this machine: how workers reach it and what runs it."""

    client: StoreClient
    processes: Sequence[StoreProcess] = ()


class SharedStore(ABC):
    """The shared store of one parsed ModelDeployment (``self.md``), answering from it alone.

    The operator and ``kvflow up`` ask a store, never its kind, for everything that depends
    on it; the defaults here mean "nothing of that". Answers are pure, except :meth:`local`,
    which may create what the store needs under ``kvflow up``'s state directory.

    Store clients are the workers that run the HiCache tiers (``roles.uses_hicache``: the
    prefill and unified roles). Each gets ``--hicache-storage <kind>`` and
    ``--hicache-storage-path`` from its :class:`StoreClient`, the client's files and env,
    the volumes of :meth:`worker_volumes`, and :meth:`lent_memory_bytes` more memory.

    - Spec: :attr:`spec_sections` are top-level spec fields only this store reads (refused
      with another store); :meth:`check` refuses what the CRD's schema cannot
      (``SpecError``); :meth:`bound_ports` joins the check that ports do not clash.
    - Workers: with :attr:`pools_worker_memory`, clients lend memory to the store and move
      pages with the KV transfer engine, so they get ``--kv-transfer-protocol`` and the KV
      transfer ports are open between every worker role.
    - Cluster: :meth:`claims` are rendered before everything that mounts them;
      :meth:`workloads` (the store's own Services and Deployments) after the workers'
      Services; :meth:`components` are those Deployments' components, which must be ready
      for the model to serve; :meth:`policies` join the NetworkPolicies.
    - ``kvflow up``: :meth:`local_refusals`, then :meth:`local`; :meth:`pod_settings` are
      the spec's pod sections of the store's processes (their env; volumes are refused);
      :attr:`cluster_only_fields` are listed as not applied when set.
    """

    spec_sections: ClassVar[tuple[str, ...]] = ()
    cluster_only_fields: ClassVar[tuple[str, ...]] = ()  # dotted paths under spec
    pools_worker_memory: ClassVar[bool] = False

    def __init__(self, md: ModelDeployment) -> None:
        self.md = md

    @property
    def kind(self) -> str:
        """Its name in :data:`STORES`: ``spec.hiCache.sharedStore.type``, and the runtime's
        ``--hicache-storage``."""
        return self.md.hicache.store

    def check(self) -> None:
        """Raise ``SpecError`` naming the field for a spec this store cannot run."""
        return None

    def bound_ports(self) -> list[tuple[bool, dict[str, int]]]:
        """The store's pods: (on the host network, {field path: port it binds})."""
        return []

    def lent_memory_bytes(self) -> int:
        """Host memory each store client lends the store (added to its memory request)."""
        return 0

    @abstractmethod
    def cluster_client(self) -> StoreClient:
        """How worker pods reach the store in the cluster."""

    def worker_volumes(self) -> tuple[list[Manifest], list[Manifest]]:
        """(pod volumes, container volume mounts) of a store client's pods."""
        return [], []

    def claims(self) -> list[Manifest]:
        return []

    def workloads(self) -> list[Manifest]:
        return []

    def components(self) -> list[str]:
        return []

    def policies(self) -> list[Manifest]:
        return []

    def pod_settings(self) -> dict[str, PodSettings]:
        """Spec section (``mooncakeMaster``) -> the pod settings of processes it runs."""
        return {}

    def local_refusals(self, find_binary: Callable[[str], str | None]) -> list[str]:
        """What stops the store running here, one line each; ``find_binary`` is
        ``shutil.which`` on ``kvflow up``'s PATH."""
        return []

    @abstractmethod
    def local(self, state_dir: Path, free_port: Callable[[], int]) -> LocalStore:
        """The store on this machine (loopback, ports from ``free_port``, files under
        ``state_dir``)."""
