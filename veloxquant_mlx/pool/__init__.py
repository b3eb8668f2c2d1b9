"""Pure-Python KV block pool: bookkeeping only, no MLX, FastAPI or Prometheus imports.

``pool`` deals in owner ids and block ids; the MLX side lives in ``veloxquant_mlx.kv`` (the
serving path) and ``veloxquant_mlx.cache`` (the seed's caches).
"""

from veloxquant_mlx.pool.allocator import DEFAULT_HISTORY_SIZE, BlockPoolAllocator
from veloxquant_mlx.pool.block import Block
from veloxquant_mlx.pool.config import PoolConfig
from veloxquant_mlx.pool.errors import (
    BlockPoolError,
    BlockPoolExhaustedError,
    OwnerAlreadyActiveError,
)
from veloxquant_mlx.pool.stats import AllocationStats

__all__ = [
    "DEFAULT_HISTORY_SIZE",
    "AllocationStats",
    "Block",
    "BlockPoolAllocator",
    "BlockPoolError",
    "BlockPoolExhaustedError",
    "OwnerAlreadyActiveError",
    "PoolConfig",
]
