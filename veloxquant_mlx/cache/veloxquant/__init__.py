"""VeloxQuant's own compressed KV caches: the interface PooledKVCache wraps, and its methods."""

from veloxquant_mlx.cache.veloxquant.base import KVCache
from veloxquant_mlx.cache.veloxquant.config import KVCacheBuilder, KVCacheConfig, KVCacheFactory
from veloxquant_mlx.cache.veloxquant.kivi import KIVIKVCache
from veloxquant_mlx.cache.veloxquant.methods import AffineKVCache, FP16KVCache

__all__ = [
    "AffineKVCache",
    "FP16KVCache",
    "KIVIKVCache",
    "KVCache",
    "KVCacheBuilder",
    "KVCacheConfig",
    "KVCacheFactory",
]
