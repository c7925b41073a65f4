"""Tensor parallelism's process groups and collectives (``torch.distributed``).

:class:`TPGroup` is the one communicator a rank's layers and scheduler use; a
:class:`Lockstep` is what the scheduler and its caches must see alike on every rank;
:mod:`.sharding` says which part of a tensor or which heads a rank owns.
"""

from typing import TYPE_CHECKING

from kvflow.lazy import lazy_exports
from kvflow.runtime.distributed.lockstep import Lockstep, TPLockstep
from kvflow.runtime.distributed.sharding import (
    ShardedHeads,
    check_tensor_parallel,
    shard_range,
)

if TYPE_CHECKING:
    from kvflow.runtime.distributed.group import TPGroup, init_tp_group
else:  # torch-free until a name is used (kvflow.lazy)
    __getattr__ = lazy_exports(__name__, {".group": ("TPGroup", "init_tp_group")})

__all__ = [
    "Lockstep",
    "ShardedHeads",
    "TPGroup",
    "TPLockstep",
    "check_tensor_parallel",
    "init_tp_group",
    "shard_range",
]
