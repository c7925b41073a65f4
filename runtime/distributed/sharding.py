"""Which part of the model a tensor-parallel rank owns.

Attention heads split evenly across ranks; key/value heads too, unless there are fewer
of them than ranks: then each is replicated on ``size // num_kv_heads`` neighbouring
ranks (rank ``r`` holds head ``r // replicas``), as in SGLang and vLLM.
"""

from __future__ import annotations

from typing import NamedTuple

from kvflow.runtime.config import ModelConfig

__all__ = ["ShardedHeads", "check_tensor_parallel", "shard_range"]


class ShardedHeads(NamedTuple):
    """One rank's attention heads: how many, and the first of each kind it holds."""

    num_heads: int
    num_kv_heads: int
    first_head: int
    first_kv_head: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, rank: int, size: int) -> ShardedHeads:
        local_heads = num_heads // size
        if num_kv_heads >= size:
            local_kv = num_kv_heads // size
            first_kv = rank * local_kv
        else:
            local_kv = 1
            first_kv = rank // (size // num_kv_heads)
        return cls(local_heads, local_kv, rank * local_heads, first_kv)


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s even part of ``total`` (``total % size == 0``)."""
    part = total // size
    return rank * part, (rank + 1) * part


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Raise ValueError (one line, naming the numbers) if ``tp_size`` ranks cannot split
    this model: its heads, key/value heads or MLP width do not divide."""
    if tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {tp_size}")
    problems = []
    if config.num_heads % tp_size:
        problems.append(f"{config.num_heads} attention heads")
    kv = config.num_kv_heads
    if kv % tp_size and tp_size % kv:
        problems.append(f"{kv} key/value heads (nor a multiple of them)")
    if config.intermediate_size % tp_size:
        problems.append(f"MLP width {config.intermediate_size}")
    if problems:
        raise ValueError(
            f"--tp-size {tp_size} does not divide this model's {', '.join(problems)}; "
            f"choose a divisor of {config.num_heads}"
        )
