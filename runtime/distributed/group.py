"""One tensor-parallel group as a rank sees it, and how ranks join it."""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TPGroup", "init_tp_group"]


class TPGroup:
    """Who this rank is among ``size`` ranks, and the collectives its layers and scheduler
    run.

    ``device_group`` carries tensors on the model's device (NCCL on CUDA, gloo on CPU);
    ``cpu_group`` (gloo) carries the scheduler's Python objects and flags. Every rank calls
    each collective in the same order: the scheduler's lockstep
    (:mod:`kvflow.runtime.server.tp_loop`) makes every rank take the same decisions.
    """

    def __init__(self, rank: int, size: int, device_group: Any, cpu_group: Any) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a group of {size}")
        self.rank, self.size = rank, size
        self.device_group, self.cpu_group = device_group, cpu_group

    @property
    def is_first(self) -> bool:
        """Rank 0: the one that talks to the tokenizer manager and detokenizer."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` (equal shapes) concatenated in rank order along ``dim``."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place; returns ``x``."""
        dist.broadcast(x, src=self._global(0), group=self.device_group)
        return x

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (picklable) on every rank; other ranks pass None."""
        if self.is_first:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=self._global(0), group=self.cpu_group)
        if not self.is_first:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=self._global(0), group=self.cpu_group)
        return obj if self.is_first else pickle.loads(payload.numpy().tobytes())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, obj, group=self.cpu_group)
        return gathered

    def all_true(self, flags: list[bool]) -> list[bool]:
        """Per position, whether the flag is set on every rank (equal lengths everywhere)."""
        if not flags:
            return []
        values = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(values, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return [bool(v) for v in values.tolist()]

    def min_int(self, value: int) -> int:
        """The smallest ``value`` any rank passed (e.g. KV pages every rank can hold)."""
        return self.all_min([value])[0]

    def all_min(self, values: list[int]) -> list[int]:
        """Per position, the smallest value any rank passed (equal lengths everywhere)."""
        if not values:
            return []
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return [int(v) for v in tensor.tolist()]

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.cpu_group, rank) if self.cpu_group else rank


def init_tp_group(
    rank: int, size: int, init_addr: str, device: str, timeout_s: float = 600.0
) -> TPGroup:
    """Join the process group of ``size`` ranks whose rank 0 listens on ``init_addr``
    (``HOST:PORT``); NCCL for tensors on CUDA (``device`` is this rank's GPU), gloo
    otherwise and for objects. Blocks until every rank has joined (up to ``timeout_s``)."""
    on_cuda = device.startswith("cuda")
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = {}
    if on_cuda:
        torch.cuda.set_device(device)
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(
        "nccl" if on_cuda else "gloo",
        init_method=f"tcp://{init_addr}",
        rank=rank,
        world_size=size,
        timeout=timeout,
        **kwargs,
    )
    world = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if on_cuda else world
    return TPGroup(rank, size, world, cpu_group)
