"""Where a server's scheduler ranks go, and the parallel settings refused before any start.

``tp_size`` ranks form one tensor-parallel group: a process each, joined over a loopback
rendezvous the launcher picks (or ``dist_init_addr``); ``dp_size`` such groups serve side
by side, on GPUs ``0 .. tp_size x dp_size - 1`` (on CUDA). Over ``nnodes`` nodes one group's
ranks are split evenly: node ``r`` runs ranks ``r x tp_size / nnodes ..`` on its GPUs
``0 ..``, all meeting at ``dist_init_addr`` (node 0's).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvflow.runtime.config import EngineConfig, ModelConfig
from kvflow.runtime.distributed import check_tensor_parallel

if TYPE_CHECKING:
    from kvflow.runtime.distributed import TPGroup

__all__ = ["RankPlace", "check_gpus", "check_nodes", "check_parallel", "rank_places", "ranks_here"]
logger = logging.getLogger("kvflow.server")


@dataclass(frozen=True)
class RankPlace:
    """Where one scheduler process sits: its data-parallel group, its rank in that
    group, the group's rendezvous (``HOST:PORT``, None for a single rank) and its GPU."""

    tp_rank: int = 0
    init_addr: str | None = None
    gpu_id: int = 0
    dp_rank: int = 0

    def engine(self, engine: EngineConfig) -> EngineConfig:
        """The engine settings of this rank: on CUDA, its own GPU."""
        if engine.device == "cuda":
            return dataclasses.replace(engine, device=f"cuda:{self.gpu_id}")
        return engine

    def join(self, engine: EngineConfig) -> TPGroup | None:
        if engine.tp_size == 1:
            return None
        from kvflow.runtime.distributed import init_tp_group  # torch: in the rank's process

        if self.init_addr is None:
            raise ValueError(f"tp_size {engine.tp_size} needs the group's address")
        return init_tp_group(self.tp_rank, engine.tp_size, self.init_addr, engine.device)


def check_parallel(engine: EngineConfig, role: str, model_path: Path) -> None:
    """Raise ValueError (one line) for parallel settings that cannot run: ranks that do not
    split the model's heads, more ranks than GPUs, and what is not built with DP yet (the
    prefill/decode roles; they run with TP, each rank sending its KV-head shard, and the
    prefill refuses a decode of another ``--tp-size`` when it registers)."""
    if engine.dp_size < 1:
        raise ValueError(f"--dp-size must be >= 1, got {engine.dp_size}")
    check_nodes(engine, role)
    check_tensor_parallel(ModelConfig.from_path(model_path), engine.tp_size)
    check_gpus(engine)
    if engine.dp_size > 1 and role != "unified":
        raise ValueError(
            f"--dp-size {engine.dp_size} with --role {role}: prefill/decode with data "
            "parallelism is not built yet (run one server per copy, or --dp-size 1; "
            "--tp-size works)"
        )


def check_nodes(engine: EngineConfig, role: str) -> None:
    """Raise ValueError (one line) for node settings that cannot run: a node number out of
    range, ranks that do not split evenly over the nodes, several nodes without the
    address they meet at, or with what is not built over nodes (data parallelism, the
    prefill/decode roles)."""
    nnodes, node = engine.nnodes, engine.node_rank
    if nnodes < 1 or not 0 <= node < nnodes:
        raise ValueError(f"--node-rank {node} with --nnodes {nnodes}: needs 0 <= rank < nodes")
    if engine.dist_init_addr is not None:
        host, _, port = engine.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--dist-init-addr {engine.dist_init_addr!r} is not HOST:PORT")
        if engine.dp_size > 1:
            raise ValueError("--dist-init-addr names one group's address: use --dp-size 1")
    if nnodes == 1:
        return
    if engine.dist_init_addr is None:
        raise ValueError(f"--nnodes {nnodes} needs --dist-init-addr HOST:PORT (node 0's)")
    if engine.tp_size % nnodes:
        raise ValueError(f"--tp-size {engine.tp_size} does not split over --nnodes {nnodes}")
    if engine.dp_size > 1 or role != "unified":
        raise ValueError(
            f"--nnodes {nnodes} runs one tensor-parallel group of the unified role "
            "(--dp-size 1; prefill/decode over nodes is not built)"
        )


def ranks_here(engine: EngineConfig) -> int:
    """Scheduler ranks this node runs (all of them on one node)."""
    return engine.tp_size * engine.dp_size // engine.nnodes


def check_gpus(engine: EngineConfig) -> None:
    """On CUDA, refuse more ranks than visible GPUs; name the GPUs left idle."""
    if not engine.device.startswith("cuda"):
        return
    import torch

    gpus = ranks_here(engine)
    found = torch.cuda.device_count()
    if gpus > found:
        raise ValueError(
            f"--tp-size {engine.tp_size} x --dp-size {engine.dp_size} needs {gpus} GPUs "
            f"on this node; it shows {found} (CUDA_VISIBLE_DEVICES limits them)"
        )
    if gpus < found:
        logger.warning(
            "%d of the %d visible GPUs are used (--tp-size %d x --dp-size %d); the rest "
            "stay idle (CUDA_VISIBLE_DEVICES chooses which are visible)",
            gpus,
            found,
            engine.tp_size,
            engine.dp_size,
        )


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def rank_places(engine: EngineConfig) -> list[RankPlace]:
    """One place per scheduler process of this node: group by group, rank 0 first;
    group ``g``'s rank ``r`` on GPU ``g * tp_size + r`` (over nodes: node ``n``'s ranks on
    its GPUs from 0)."""
    places = []
    per_node = engine.tp_size // engine.nnodes
    first = engine.node_rank * per_node
    for group in range(engine.dp_size):
        init_addr = engine.dist_init_addr
        if init_addr is None and engine.tp_size > 1:
            init_addr = f"127.0.0.1:{_free_port('127.0.0.1')}"
        for rank in range(first, first + per_node):
            gpu = group * engine.tp_size + rank - first
            places.append(RankPlace(rank, init_addr, gpu, group))
    return places
