"""The MLX side of the pool: pool-backed mlx_lm caches, pooled VeloxQuant caches, block storage.

Imports MLX and mlx_lm; ``veloxquant_mlx.pool`` does not.
"""

from veloxquant_mlx.cache.block_storage import MLXBlockStorage
from veloxquant_mlx.cache.pool_backed import (
    PoolBackedKVCache,
    build_pooled_caches,
    pooled_layer_fraction,
)
from veloxquant_mlx.cache.pool_backed_batch import PoolBackedBatchKVCache
from veloxquant_mlx.cache.pooled import PooledKVCache

__all__ = [
    "MLXBlockStorage",
    "PoolBackedBatchKVCache",
    "PoolBackedKVCache",
    "PooledKVCache",
    "build_pooled_caches",
    "pooled_layer_fraction",
]
