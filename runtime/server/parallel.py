"""Where a server's scheduler ranks go, and the parallel settings refused before any start.

``tp_size`` ranks form one tensor-parallel group: a process each, joined over a loopback
rendezvous the launcher picks; ``dp_size`` such groups serve side by side, on GPUs
``0 .. tp_size x dp_size - 1`` (on CUDA).
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

__all__ = ["RankPlace", "check_gpus", "check_parallel", "rank_places"]
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
    check_tensor_parallel(ModelConfig.from_path(model_path), engine.tp_size)
    check_gpus(engine)
    if engine.dp_size > 1 and role != "unified":
        raise ValueError(
            f"--dp-size {engine.dp_size} with --role {role}: prefill/decode with data "
            "parallelism is not built yet (run one server per copy, or --dp-size 1; "
            "--tp-size works)"
        )


def check_gpus(engine: EngineConfig) -> None:
    """On CUDA, refuse more ranks than visible GPUs; name the GPUs left idle."""
    if not engine.device.startswith("cuda"):
        return
    import torch

    gpus = engine.tp_size * engine.dp_size
    found = torch.cuda.device_count()
    if gpus > found:
        raise ValueError(
            f"--tp-size {engine.tp_size} x --dp-size {engine.dp_size} needs {gpus} GPUs; "
            f"this machine shows {found} (CUDA_VISIBLE_DEVICES limits them)"
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
    """One place per scheduler process of the server: group by group, rank 0 first;
    group ``g``'s rank ``r`` on GPU ``g * tp_size + r``."""
    places = []
    for group in range(engine.dp_size):
        init_addr = None if engine.tp_size == 1 else f"127.0.0.1:{_free_port('127.0.0.1')}"
        for rank in range(engine.tp_size):
            places.append(RankPlace(rank, init_addr, group * engine.tp_size + rank, group))
    return places
