"""Where a server's scheduler ranks go, and the parallel settings refused before any start.

``tp_size`` ranks form one tensor-parallel group: a process each, rank ``r`` on GPU ``r``
(on CUDA), joined over a loopback rendezvous the launcher picks.
"""

from __future__ import annotations

import socket
from pathlib import Path

from kvflow.runtime.config import EngineConfig, ModelConfig
from kvflow.runtime.distributed import check_tensor_parallel
from kvflow.runtime.server.scheduler_process import RankPlace

__all__ = ["check_parallel", "rank_places"]


def check_parallel(engine: EngineConfig, role: str, model_path: Path) -> None:
    """Raise ValueError (one line) for parallel settings that cannot run: ranks that do not
    split the model's heads, more ranks than GPUs, and what is not built with TP yet."""
    if engine.dp_size != 1:
        raise ValueError("--dp-size other than 1 is not built yet; run one server per group")
    check_tensor_parallel(ModelConfig.from_path(model_path), engine.tp_size)
    if engine.tp_size == 1:
        return
    if role != "unified":
        raise ValueError(
            f"--tp-size {engine.tp_size} with --role {role}: prefill/decode with tensor "
            "parallelism is not built yet (run the roles with --tp-size 1)"
        )
    if engine.hicache_host_memory_gb > 0:
        raise ValueError(
            f"--tp-size {engine.tp_size} with HiCache: the host tier is not built for "
            "tensor parallelism yet (drop --hicache-host-memory-gb or use --tp-size 1)"
        )
    if engine.device.startswith("cuda"):
        import torch

        gpus = engine.tp_size * engine.dp_size
        found = torch.cuda.device_count()
        if gpus > found:
            raise ValueError(
                f"--tp-size {engine.tp_size} x --dp-size {engine.dp_size} needs {gpus} GPUs; "
                f"this machine shows {found} (CUDA_VISIBLE_DEVICES limits them)"
            )


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def rank_places(engine: EngineConfig) -> list[RankPlace]:
    """One place per scheduler process of the server, rank 0 first."""
    if engine.tp_size == 1:
        return [RankPlace()]
    init_addr = f"127.0.0.1:{_free_port('127.0.0.1')}"
    return [RankPlace(rank, init_addr, rank) for rank in range(engine.tp_size)]
