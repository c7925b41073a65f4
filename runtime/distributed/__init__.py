"""Tensor parallelism's process groups and collectives (``torch.distributed``).

:class:`TPGroup` is the one communicator a rank's layers and scheduler use; a
:class:`Lockstep` is what the scheduler and its caches must see alike on every rank;
:mod:`.sharding` says which part of a tensor or which heads a rank owns.
"""

from kvflow.runtime.distributed.group import TPGroup, init_tp_group
from kvflow.runtime.distributed.lockstep import Lockstep, TPLockstep
from kvflow.runtime.distributed.sharding import (
    ShardedHeads,
    check_tensor_parallel,
    shard_range,
)

__all__ = [
    "Lockstep",
    "ShardedHeads",
    "TPGroup",
    "TPLockstep",
    "check_tensor_parallel",
    "init_tp_group",
    "shard_range",
]
