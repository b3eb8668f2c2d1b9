"""``veloxquant_mlx.memory.block_pool``: the seed's submodule path for the pool classes."""

from veloxquant_mlx.pool import (
    AllocationStats,
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    OwnerAlreadyActiveError,
    PoolConfig,
)

__all__ = [
    "AllocationStats",
    "Block",
    "BlockPoolAllocator",
    "BlockPoolExhaustedError",
    "OwnerAlreadyActiveError",
    "PoolConfig",
]
